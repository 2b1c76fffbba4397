"""The ``angel-ptm`` command line.

    angel-ptm train [CONFIG.yaml] [--set section.field=value ...] [--no-progress] [--resume RUN_DIR]
    angel-ptm estimate [CONFIG.yaml] [--set section.field=value ...] [--json]
    angel-ptm viz RUN_DIR [-o REPORT.html] [--chrome-trace PATH]
    angel-ptm export CHECKPOINT -o MODEL.safetensors [--dtype bfloat16]

With no CONFIG, ``train`` runs the packaged default job (configs/default.yaml: a small GPT on the Python standard
library's source text, on the CPU, with budgets small enough that pages live on all three tiers). ``estimate``
prints, before anything is allocated, the bytes each tier needs per rank and whether the job fits its budgets
(exit 0 if it does, 2 with the one-line reason if not); ``--json`` prints one JSON object instead of the table.
``viz`` reads a run directory's trace.jsonl and metrics.jsonl and writes a self-contained HTML report (default
RUN_DIR/report.html) and a Chrome trace-event JSON for Perfetto (default RUN_DIR/trace.chrome.json). A user mistake
(bad key or value, missing file or run directory, budget too small) prints one line, ``angel-ptm: error:
<message>``, and exits 2. A run stopped by Ctrl-C or SIGTERM cleans up (its page files removed) and exits 130 or
143, as a shell reports those signals.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

from angel_ptm.errors import AngelError, Terminated

PROG = "angel-ptm"
EXIT_USAGE = 2  # user mistakes, as argparse reports its own
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: the shell's code for SIGTERM (Slurm, Kubernetes, kill)


def default_config_path() -> Path:
    """configs/default.yaml of the source tree, which an editable install runs from."""
    return Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Pretraining with model states paged over GPU, host and SSD.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_train_command(commands)
    add_estimate_command(commands)
    add_viz_command(commands)
    add_export_command(commands)
    return parser


def add_job_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """CONFIG and --set KEY=VALUE: how every command that reads a job names it (load_job_config reads them)."""
    parser.add_argument("config", nargs="?", metavar="CONFIG",
                        help="YAML config file (default: the packaged configs/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override one config value, e.g. --set {example} (repeatable)")


def add_train_command(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="train a model", description="Train a model from a YAML config.")
    add_job_arguments(train, example="optimizer.lr=3e-4")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its newest complete checkpoint (its config.yaml "
                            "unless CONFIG is given; metrics.jsonl is appended to)")
    train.set_defaults(handler=run_train)


def add_estimate_command(commands: argparse._SubParsersAction) -> None:
    estimate = commands.add_parser(
        "estimate", help="memory each tier needs, and whether the job fits",
        description="Before anything is allocated: per rank, the pages and bytes of each state kind, the resolved "
                    "budgets, the activation peak, pinned host memory, disk space, and per tier the bytes needed, "
                    "the budget and the expected peak in use. Exits 0 if the job fits, 2 with the reason if not. "
                    "--gpu-memory estimates a GPU job on a machine without that GPU.")
    add_job_arguments(estimate, example="memory.host_budget=8GiB")
    estimate.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    estimate.add_argument("--device", choices=("cpu", "cuda"),
                          help="the compute device to estimate for (default: trainer.device; cuda with --gpu-memory)")
    estimate.add_argument("--world-size", type=int, metavar="N",
                          help="estimate rank 0 of N ranks on this machine: N / parallel.tp data-parallel ranks "
                               "(parallel.zero says what is sharded; default: parallel.dp x parallel.tp)")
    estimate.add_argument("--gpu-memory", metavar="SIZE",
                          help="the GPU's memory, e.g. 80GiB: a device budget of auto resolves against it instead of "
                               "the free memory of a GPU present here (there may be none)")
    estimate.set_defaults(handler=run_estimate)


def add_viz_command(commands: argparse._SubParsersAction) -> None:
    viz = commands.add_parser(
        "viz", help="HTML report and Chrome trace of a run's memory trace",
        description="Read RUN_DIR/trace.jsonl (as a stream, any size) and metrics.jsonl; write a self-contained HTML "
                    "report (where step time went, loss curve, tier usage, page residency, bytes moved, lanes "
                    "with busy and summed time, per-step table with bytes in use per tier) and a Chrome "
                    "trace-event JSON that Perfetto and chrome://tracing open.")
    viz.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by angel-ptm train")
    viz.add_argument("-o", "--output", metavar="REPORT.html", help="the HTML report (default: RUN_DIR/report.html)")
    viz.add_argument("--chrome-trace", metavar="PATH",
                     help="the Chrome trace-event JSON (default: RUN_DIR/trace.chrome.json)")
    viz.set_defaults(handler=run_viz)


def add_export_command(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help="consolidated weights of a checkpoint as safetensors",
        description="Write a checkpoint's weights (the fp32 master where saved) as one safetensors file with "
                    "model.state_dict()'s names, streaming one tensor at a time; a HuggingFace model's config.json "
                    "beside it. CHECKPOINT is a checkpoint directory, or a run or checkpoints directory (its newest "
                    "complete checkpoint).")
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("-o", "--output", required=True, metavar="MODEL.safetensors")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="cast floating tensors to this dtype (default: as saved)")
    export.set_defaults(handler=run_export)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 with a usage message on a bad command line
    formatwarning = warnings.formatwarning  # a warning of the library's is one line here, as the CLI's own
    warnings.formatwarning = lambda message, category, *_: f"{PROG}: warning: {message}\n"
    try:
        return args.handler(args)
    except AngelError as err:
        return fail(str(err))
    except Terminated as stop:  # raised by the trainer's SIGTERM handler, once the run has cleaned up as on Ctrl-C
        print(f"{PROG}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `angel-ptm estimate | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    finally:
        warnings.formatwarning = formatwarning


def load_job_config(args: argparse.Namespace):
    """The job's Config: CONFIG (default configs/default.yaml, else the built-in defaults) with --set overrides."""
    # Imported here so `angel-ptm --help` stays fast (no torch import).
    from angel_ptm.config import load_config

    source = args.config
    if source is None:
        source = default_config_path()
        if not source.is_file():
            print(f"{PROG}: warning: {source} not found; using the built-in defaults", file=sys.stderr)
            source = None
    return load_config(source, args.overrides)


def run_train(args: argparse.Namespace) -> int:
    from angel_ptm.trainer import Trainer

    config = resume_config(args) if args.resume else load_job_config(args)
    result = Trainer(config, progress=args.progress).run()
    if result.rank != 0:  # under torchrun, rank 0 speaks for the run
        return 0
    print(f"run dir: {result.run_dir}")
    if result.resumed_from is not None:
        print(f"resumed from: {result.resumed_from} (step {result.start_step - 1})")
    if result.losses:
        print(f"final train loss: {result.losses[-1]:.4f} (step {result.steps}, first {result.losses[0]:.4f} at step "
              f"{result.start_step})")
    if result.final_val_loss is not None:
        print(f"final val loss: {result.final_val_loss:.4f}")
    print(f"throughput: {result.tokens_per_s:,.0f} tokens/s")
    return 0


def resume_config(args: argparse.Namespace):
    """`train --resume RUN_DIR`: the run's config (RUN_DIR/config.yaml, or CONFIG), its directory, and its
    checkpoints to resume from (checkpoint.dir, else RUN_DIR/checkpoints): a run without one is an error."""
    import dataclasses

    from angel_ptm.config import load_config
    from angel_ptm.errors import ConfigValueError

    run_dir = Path(args.resume).expanduser().absolute()
    if not run_dir.is_dir():
        raise ConfigValueError(f"--resume: {run_dir} is not a run directory")
    source = args.config or run_dir / "config.yaml"
    if not Path(source).is_file():
        raise ConfigValueError(f"--resume: {source} not found; give the run's CONFIG")
    moved = [o for o in args.overrides if o.partition("=")[0].strip() == "run.dir"]
    if moved:
        raise ConfigValueError(f"--resume {args.resume}: the resumed run continues in its own directory; "
                               f"{moved[0]!r} would start another (train without --resume, or drop it)")
    config = load_config(source, args.overrides)
    recorded = config.run.dir  # a run directory copied or moved: the page files go to its own, not the source's
    if recorded and Path(recorded) != run_dir and config.memory.disk_dir == str(Path(recorded) / "pages"):
        config = dataclasses.replace(config, memory=dataclasses.replace(config.memory, disk_dir=None))
    checkpoints = config.checkpoint.dir or str(run_dir / "checkpoints")
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(run_dir), resume=checkpoints))


def run_export(args: argparse.Namespace) -> int:
    import torch

    from angel_ptm.checkpoint.directory import Checkpoints
    from angel_ptm.checkpoint.export import export_weights
    from angel_ptm.config import format_bytes
    from angel_ptm.errors import CheckpointError

    source = Path(args.checkpoint).expanduser().absolute()
    if not (source / ".metadata").is_file():  # a run directory or a directory of checkpoints: the newest one
        found = Checkpoints(source / "checkpoints").latest() or Checkpoints(source).latest()
        if found is None:
            raise CheckpointError(f"export: no complete checkpoint in {source}", str(source))
        source = found
    result = export_weights(source, args.output, getattr(torch, args.dtype) if args.dtype else None)
    print(f"exported {result['tensors']} tensors from {source} to {result['path']} ({format_bytes(result['bytes'])})"
          + ("; config.json beside it" if result["config"] else ""))
    return 0


def run_estimate(args: argparse.Namespace) -> int:
    import torch

    from angel_ptm.config import parse_bytes
    from angel_ptm.errors import ConfigValueError
    from angel_ptm.estimate import estimate_job
    from angel_ptm.memory import compute_device
    from angel_ptm.parallel import Ownership
    from angel_ptm.parallel.mesh import mesh_shape

    from angel_ptm.config.combinations import engine_config_for_trainer

    config = engine_config_for_trainer(load_job_config(args))  # (the job as the trainer runs its engine)
    gpu_memory = None if args.gpu_memory is None else parse_bytes(args.gpu_memory, "--gpu-memory")
    if gpu_memory is not None and args.device == "cpu":
        raise ConfigValueError("--gpu-memory is the memory of a GPU: use it with --device cuda, not cpu")
    device = torch.device(args.device or "cuda") if args.device or gpu_memory is not None else \
        compute_device(config.trainer.device)
    if device.type == "cuda" and gpu_memory is None and not torch.cuda.is_available():
        where = "--device cuda" if args.device else 'trainer.device: "cuda"'
        raise ConfigValueError(f"{where}: no CUDA device is available here to measure; to estimate for a GPU "
                               f"elsewhere, give its memory: --gpu-memory 80GiB")
    tp = config.parallel.tp
    world = args.world_size if args.world_size is not None else (config.parallel.dp or 1) * tp
    if world < 1 or world % tp:
        raise ConfigValueError(f"--world-size: must be a positive multiple of parallel.tp ({tp}), got {world}")
    dp, _tp, _ep = mesh_shape(config.parallel, world)  # (the rules training's mesh enforces)
    ownership = Ownership(rank=0, dp=dp, stage=config.parallel.zero)
    estimate = estimate_job(config, device=device, gpu_memory=gpu_memory, ownership=ownership,
                            local_world_size=world)
    print(estimate.to_json() if args.json else estimate.format_table())
    sys.stdout.flush()  # the numbers first, then (on stderr) the one-line reason it does not fit
    estimate.check()
    return 0


def run_viz(args: argparse.Namespace) -> int:
    from angel_ptm.config import format_bytes
    from angel_ptm.viz import build_report

    from angel_ptm.viz.ranks import build_rank_reports, rank_traces

    if rank_traces(args.run_dir) and not (Path(args.run_dir) / "trace.jsonl").exists():  # a torchrun run
        with warnings_to_stderr("angel_ptm.viz"):
            ranks = build_rank_reports(args.run_dir, args.output, args.chrome_trace)
        print(f"report: {ranks.html_path} ({len(ranks.ranks)} ranks side by side)")
        for result in ranks.ranks:
            print(f"  {result.html_path.name} from {result.events:,} trace events, {result.chrome_path.name} "
                  f"({result.chrome_events:,} events)")
        print(f"chrome trace: {ranks.chrome.path} ({format_bytes(ranks.chrome.bytes)}, {ranks.chrome.events:,} events, "
              f"every rank a process on one time axis)")
        return 0
    with warnings_to_stderr("angel_ptm.viz"):
        if rank_traces(args.run_dir):  # a segment at another data-parallel size: its ranks' traces are not drawn
            logging.getLogger("angel_ptm.viz").warning(
                f"{args.run_dir} also holds per-rank traces ({', '.join(rank_traces(args.run_dir).values())}) of "
                f"a part of the run trained at another data-parallel size; this report draws trace.jsonl only")
        result = build_report(args.run_dir, args.output, args.chrome_trace)
    print(f"report: {result.html_path} ({format_bytes(result.html_bytes)})")
    print(f"chrome trace: {result.chrome_path} ({format_bytes(result.chrome_bytes)}, {result.chrome_events:,} events)")
    print(f"read {result.events:,} events ({format_bytes(result.trace_bytes)}) in {result.seconds:.1f} s"
          + (f"; {len(result.warnings)} warning(s)" if result.warnings else ""))
    return 0


@contextlib.contextmanager
def warnings_to_stderr(logger_name: str) -> Iterator[None]:
    """While active, warnings logged under `logger_name` print as ``angel-ptm: warning: <message>`` lines."""
    logger = logging.getLogger(logger_name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # printed once, here, not again by a root handler
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def fail(message: str) -> int:
    one_line = " ".join(message.split("\n"))  # the contract is one line, whatever the message holds
    print(f"{PROG}: error: {one_line}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
