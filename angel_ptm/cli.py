"""The ``angel-ptm`` command line.

    angel-ptm train [CONFIG.yaml] [--set section.field=value ...] [--no-progress]

With no CONFIG, ``train`` runs the packaged default job (configs/default.yaml: a small GPT on the Python standard
library's source text, on the CPU, with budgets small enough that pages live on all three tiers). A user mistake
(bad key or value, missing file, budget too small) prints one line, ``angel-ptm: error: <message>``, and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from angel_ptm.errors import AngelError

PROG = "angel-ptm"
EXIT_USAGE = 2  # user mistakes, as argparse reports its own
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


def default_config_path() -> Path:
    """configs/default.yaml of the source tree, which an editable install runs from."""
    return Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Pretraining with model states paged over GPU, host and SSD.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser("train", help="train a model", description="Train a model from a YAML config.")
    train.add_argument("config", nargs="?", metavar="CONFIG",
                       help="YAML config file (default: the packaged configs/default.yaml)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config value, e.g. --set optimizer.lr=3e-4 (repeatable)")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    train.set_defaults(handler=run_train)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 with a usage message on a bad command line
    try:
        return args.handler(args)
    except AngelError as err:
        return fail(str(err))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run_train(args: argparse.Namespace) -> int:
    # Imported here so `angel-ptm --help` stays fast (no torch import).
    from angel_ptm.config import load_config
    from angel_ptm.trainer import Trainer

    source = args.config
    if source is None:
        source = default_config_path()
        if not source.is_file():
            print(f"{PROG}: warning: {source} not found; using the built-in defaults", file=sys.stderr)
            source = None
    config = load_config(source, args.overrides)
    result = Trainer(config, progress=args.progress).run()

    print(f"run dir: {result.run_dir}")
    if result.losses:
        print(f"final train loss: {result.losses[-1]:.4f} (step {result.steps}, first {result.losses[0]:.4f})")
    if result.final_val_loss is not None:
        print(f"final val loss: {result.final_val_loss:.4f}")
    print(f"throughput: {result.tokens_per_s:,.0f} tokens/s")
    return 0


def fail(message: str) -> int:
    one_line = " ".join(message.split("\n"))  # the contract is one line, whatever the message holds
    print(f"{PROG}: error: {one_line}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
