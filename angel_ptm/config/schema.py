"""The configuration schema: one dataclass per section, every field with a default.

Constructing a section checks and converts its fields (see coerce.py) and then validates values, so a Config
that exists is a valid Config, whether it came from YAML, ``--set`` overrides or Python code. Choices are
``Literal`` annotations, so the allowed values are visible right in the field declaration.
"""

from __future__ import annotations

import math

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Optional, Tuple, Union

from angel_ptm.config.combinations import check_combinations
from angel_ptm.config.coerce import coerce
from angel_ptm.config.sizes import Budget, ByteSize, show_value
from angel_ptm.errors import ConfigTypeError, ConfigValueError


PAGE_ALIGNMENT = 4096  # pages are read and written with O_DIRECT, which needs 4 KiB-aligned sizes
# Upper bounds on the SSD engine's knobs (io/engine.py). A worker thread keeps one transfer of up to 16 MiB in
# flight: 4 threads read at 0.97 of a raw preadv loop and 8 already made the training step slower, so 64 is far
# past any gain on one node's SSDs, while 1e6 made the engine start 32k threads and hang. The queue holds up to
# queue_depth transfers (reads twice that), each split by the block layer into requests: 1024 already matches the
# Linux NVMe driver's default depth of a hardware queue (io_queue_depth=1024), and 1024 x 16 MiB is 16 GiB queued.
MAX_IO_THREADS = 64
MAX_QUEUE_DEPTH = 1024


def _word_or_positive(value: object, key: str, word: str, choices: str) -> Union[str, float]:
    """`word` (in any case) or a finite number > 0; `choices` names what is accepted besides a number."""
    if isinstance(value, str) and value.strip().lower() == word:
        return word
    try:
        number = coerce(value, float, key)
    except ConfigTypeError:
        raise ConfigTypeError(
            f"{key}: expected {choices} or a number, got {show_value(value)} ({type(value).__name__})") from None
    except ConfigValueError:
        number = float("nan")
    if not number > 0:
        raise ConfigValueError(f"{key}: must be {choices} or a finite number > 0, got {show_value(value)}")
    return number


def parse_loss_scale(value: object, key: str) -> Union[str, float]:
    """An fp16 loss scale: "dynamic" (grown and backed off as gradients allow) or a fixed number > 0."""
    return _word_or_positive(value, key, "dynamic", '"dynamic"')


LossScale = Annotated[Union[str, float], parse_loss_scale]


def parse_pace(value: object, key: str) -> Union[str, float, None]:
    """A save's pace: null (as fast as it can), "auto" (spread over the interval between saves) or GB/s > 0."""
    return None if value is None else _word_or_positive(value, key, "auto", 'null, "auto"')


Pace = Annotated[Union[str, float, None], parse_pace]


def parse_moe(value: object, key: str) -> Optional[dict]:
    """`model.moe`: null (a dense model) or a mapping of MoE settings (models/moe.py MoESpec's fields and `every`):
    unknown keys and impossible values refused naming `model.moe.<key>`, missing ones defaulted, all returned."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigTypeError(f"{key}: expected a mapping of MoE settings or null, got {show_value(value)}")
    from angel_ptm.models.moe import moe_settings

    return moe_settings(value, key)


MoESettings = Annotated[Optional[dict], parse_moe]


def parse_unit_modes(value: object, key: str) -> Optional[dict]:
    """`activations.unit_modes`: null or a mapping of unit type (module class name) to "none", "full" or
    "selective"."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigTypeError(f"{key}: expected a mapping of unit type to checkpoint mode, got {show_value(value)}")
    out = {}
    for name, mode in value.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigValueError(f"{key}: keys are module class names, got {show_value(name)}")
        if mode not in ("none", "full", "selective"):
            raise ConfigValueError(f'{key}.{name}: must be "none", "full" or "selective", got {show_value(mode)}')
        out[name] = mode
    return out


UnitModes = Annotated[Optional[dict], parse_unit_modes]
MAPPING_FIELDS = (MoESettings, UnitModes)  # fields whose keys `--set section.field.key=value` may name


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (``Annotated`` kept: it carries the byte-size parsers); no ClassVars."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


class _Section:
    """Shared construction for config sections: convert every field, then run the section's checks."""

    SECTION: ClassVar[str]  # the section's key in Config, used to name fields in error messages

    def __post_init__(self) -> None:
        types = field_types(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, coerce(getattr(self, f.name), types[f.name], self._key(f.name)))
        self.validate()

    def validate(self) -> None:
        """Value checks that the type alone cannot express (ranges, divisibility)."""

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}"

    def _require(self, name: str, ok: bool, requirement: str) -> None:
        if not ok:
            raise ConfigValueError(f"{self._key(name)}: must be {requirement}, got {show_value(getattr(self, name))}")

    def _require_positive(self, *names: str) -> None:
        for name in names:
            self._require(name, getattr(self, name) > 0, "> 0")


@dataclass
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model"

    name: Literal["gpt"] = "gpt"
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None  # None: same as n_head (plain multi-head attention)
    dim: int = 256
    ffn_hidden: Optional[int] = None  # None: the model picks its own width from dim
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    dropout: float = 0.0  # embeddings, attention probabilities and residual branches, while training
    # Mixture of experts (null: dense): {experts, top_k, gate, capacity_factor, every, aux_loss_weight, ...}
    # replaces the feed-forward of every `every`-th block with an MoE layer (angel_ptm/models/moe.py).
    moe: MoESettings = None

    def validate(self) -> None:
        self._require_positive("vocab_size", "seq_len", "n_layer", "n_head", "dim")
        self._require_positive("rope_theta", "norm_eps", "init_std")
        self._require("dropout", 0 <= self.dropout < 1, ">= 0 and < 1")
        self._require("dim", self.dim % self.n_head == 0, f"divisible by model.n_head ({self.n_head})")
        if self.n_kv_head is not None:
            self._require("n_kv_head", self.n_kv_head > 0, "> 0 or null")
            # Grouped-query attention shares each key/value head among an equal number of query heads.
            self._require("n_kv_head", self.n_head % self.n_kv_head == 0, f"a divisor of model.n_head ({self.n_head})")
        if self.ffn_hidden is not None:
            self._require("ffn_hidden", self.ffn_hidden > 0, "> 0 or null")
        if self.moe is not None:  # (imported here, as parse_moe does: loading a config imports no model code)
            from angel_ptm.models.moe import check_every
            check_every(self.moe, self.n_layer)


@dataclass
class DataConfig(_Section):
    SECTION: ClassVar[str] = "data"

    kind: Literal["text", "tokens"] = "text"
    path: Optional[str] = None  # None: the Python standard library sources, always present offline
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    batch_size: int = 8
    val_fraction: float = 0.05
    seed: int = 1234

    def validate(self) -> None:
        self._require_positive("batch_size")
        self._require("val_fraction", 0 <= self.val_fraction < 1, ">= 0 and < 1")
        self._require("seed", self.seed >= 0, ">= 0")  # numpy generators reject negative seeds


@dataclass
class OptimizerConfig(_Section):
    SECTION: ClassVar[str] = "optimizer"

    name: Literal["adamw"] = "adamw"
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Parameters AdamW does not decay (weight decay 0 for them): shell-style patterns matched against the names
    # model.named_parameters() gives ("*.bias", "*norm*"), as a recipe's second param group with weight_decay 0.
    no_decay: Tuple[str, ...] = ()
    # 0: synchronous (identical to torch.optim.AdamW). 1: ZeRO-Offload's delayed parameter update: the update of
    # step t runs during step t+1, which computes with the parameters after update t-1 (deterministic; fp32 jobs
    # get master pages of their own). An evaluation between steps sees the parameters the next step computes with;
    # the trainer lands the last update after the final step (Engine.flush).
    staleness: Literal[0, 1] = 0
    # With the planned scheduler and no gradient clipping, update each page group as soon as every gradient on it
    # is final (in the last micro-batch's backward), so the updates overlap the rest of backward.
    overlap_updates: bool = True
    # fp16 only (trainer.dtype: float16), as torch.amp.GradScaler: the loss is multiplied by the scale before
    # backward and gradients divided by it in the update; a step with an inf/NaN gradient is skipped. "dynamic":
    # the scale starts at loss_scale_initial, is multiplied by loss_scale_backoff on every overflow and by
    # loss_scale_growth after loss_scale_growth_interval steps in a row without one; a number: that scale, fixed.
    loss_scale: LossScale = "dynamic"  # type: ignore[assignment]
    loss_scale_initial: float = 65536.0  # 2**16
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_growth_interval: int = 2000

    def validate(self) -> None:
        for name in ("lr", "eps"):  # as torch.optim.AdamW: 0 allowed, a negative or non-finite value refused
            self._require(name, 0 <= getattr(self, name) < math.inf, ">= 0 and finite")
        self._require("betas", all(0 <= beta < 1 for beta in self.betas), "two numbers each >= 0 and < 1")
        self._require("weight_decay", self.weight_decay >= 0, ">= 0")
        self._require_positive("loss_scale_initial", "loss_scale_growth_interval")
        self._require("loss_scale_growth", self.loss_scale_growth > 1, "> 1")
        self._require("loss_scale_backoff", 0 < self.loss_scale_backoff < 1, "> 0 and < 1")


@dataclass
class LRScheduleConfig(_Section):
    SECTION: ClassVar[str] = "lr_schedule"

    warmup_steps: int = 20
    decay: Literal["cosine", "constant", "linear"] = "cosine"
    min_lr_ratio: float = 0.1  # the decay ends at lr * min_lr_ratio

    def validate(self) -> None:
        self._require("warmup_steps", self.warmup_steps >= 0, ">= 0")
        self._require("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, ">= 0 and <= 1")


@dataclass
class MemoryConfig(_Section):
    SECTION: ClassVar[str] = "memory"

    page_bytes: ByteSize = "64MiB"  # type: ignore[assignment]  # read from a size string into an int
    # Budgets stay "auto" here; they are resolved against the real hardware when the run starts.
    device_budget: Budget = "auto"
    host_budget: Budget = "auto"
    disk_dir: Optional[str] = None  # None: a temporary directory under the run directory
    disk_budget: Budget = "auto"
    io_threads: int = 4
    queue_depth: int = 32
    # planned: record the first step's page accesses, then move pages ahead of need (schedule/); on_demand:
    # every page is fetched when it is touched.
    scheduler: Literal["on_demand", "planned"] = "planned"
    lookahead: int = 0  # accesses the plan may prefetch ahead; 0 = as far as the free slots allow
    # Without CUDA the device and host pools are both plain memory: a page changes tier by trading slots between
    # them instead of being copied. false: copy (as a GPU run must), e.g. to study copy traffic on a CPU machine.
    zero_copy: bool = True
    # MoE experts that are paging units of their own: per expert, the moving average over steps of whether the step
    # ran it (the past's weight: expert_history_ema); an expert below expert_warm_threshold is cold, and the
    # plan's fetches of its pages wait for its gate to route to it (schedule/predictor.py). 0: every expert the plan
    # holds is fetched ahead of its gate.
    expert_warm_threshold: float = 0.5
    expert_history_ema: float = 0.8

    def validate(self) -> None:
        self._require(
            "page_bytes",
            self.page_bytes > 0 and self.page_bytes % PAGE_ALIGNMENT == 0,
            f"a positive multiple of {PAGE_ALIGNMENT}",
        )
        self._require("io_threads", 1 <= self.io_threads <= MAX_IO_THREADS, f"from 1 to {MAX_IO_THREADS}")
        self._require("queue_depth", 1 <= self.queue_depth <= MAX_QUEUE_DEPTH, f"from 1 to {MAX_QUEUE_DEPTH}")
        self._require("lookahead", self.lookahead >= 0, ">= 0")
        self._require("expert_warm_threshold", 0.0 <= self.expert_warm_threshold <= 1.0, "from 0 to 1")
        self._require("expert_history_ema", 0.0 <= self.expert_history_ema < 1.0, "from 0 to below 1")


@dataclass
class TraceConfig(_Section):
    SECTION: ClassVar[str] = "trace"

    # Once trace.jsonl holds this many bytes, the recorder writes one summary event per step instead of every page
    # event (and notes once, in a "mark" event, that it did). null: no bound. A page-heavy job writes ~100 bytes per
    # page event, thousands per step, so an unbounded multi-day run fills a disk with its trace.
    max_bytes: Optional[ByteSize] = "256MiB"  # type: ignore[assignment]


@dataclass
class TrainerConfig(_Section):
    SECTION: ClassVar[str] = "trainer"

    steps: int = 200
    grad_accum: int = 1
    grad_clip: Optional[float] = 1.0  # 0 or None: no clipping
    eval_every: int = 50  # 0: never evaluate
    eval_steps: int = 4
    log_every: int = 1
    seed: int = 0
    # The compute dtype. bfloat16 / float16: mixed precision -- the model runs with parameters and gradients in it,
    # the optimizer updates fp32 master weights (their own pages); float16 adds loss scaling (optimizer.loss_scale).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def validate(self) -> None:
        self._require_positive("steps", "grad_accum", "eval_steps", "log_every")
        if self.grad_clip is not None:
            self._require("grad_clip", self.grad_clip >= 0, ">= 0 or null")
        self._require("eval_every", self.eval_every >= 0, ">= 0")
        self._require("seed", 0 <= self.seed < 2**64, ">= 0 and < 2**64")  # (torch.manual_seed's range)


@dataclass
class ParallelConfig(_Section):
    SECTION: ClassVar[str] = "parallel"

    # Data-parallel ranks (ZeRO shards page groups across them). null: the world size over tp (torchrun's
    # WORLD_SIZE, 1 without torchrun). dp x tp must equal the world size.
    dp: Optional[int] = None
    # Tensor-parallel ranks (Megatron 1-D: each layer's weights split over tp consecutive ranks, the communication in
    # the layers' autograd functions; angel_ptm/parallel/tensor). 1: none.
    tp: int = 1
    # Expert-parallel ranks: each MoE layer's experts split over ep data-parallel ranks, tokens exchanged by
    # all-to-all (angel_ptm/parallel/moe). 1: none. ep must divide dp: each group of ep consecutive data-parallel
    # ranks holds every expert once, and the dp / ep ranks holding the same experts all-reduce their gradients
    # (experts replicated over them, not ZeRO-sharded).
    ep: int = 1
    # How an MoE layer's all-to-all runs with ep > 1: flat (one exchange over the ep group) or hierarchical
    # (HetuMoE: gathered on each node's first rank, exchanged between nodes, scattered; nodes of LOCAL_WORLD_SIZE).
    moe_a2a: Literal["flat", "hierarchical"] = "flat"
    # Load-driven expert placement (FlexMoE's idea; ep > 1, optimizer.staleness 0): every this many steps, where the
    # busiest rank's share of an MoE layer's tokens (an EMA of tokens per expert, weight `moe_rebalance_ema` on the
    # past) exceeds `moe_rebalance_threshold` times the mean rank's, experts swap ranks at the step boundary (their
    # weights, moments and step counts move with them) if the measured expert time saved over the next interval
    # exceeds the measured time to move them (angel_ptm/parallel/moe/placement.py). 0: never. The losses do not
    # change: only where each expert runs.
    moe_rebalance_every: int = 0
    moe_rebalance_threshold: float = 1.25
    moe_rebalance_ema: float = 0.5
    # Hot-expert replicas (FlexMoE; with moe_rebalance_every): at each rebalance, after the swaps, an expert whose
    # share keeps its rank the busiest gets copies of its weights on the least loaded ranks, at most this many per
    # rank and layer, where the cost model says they pay (each copy's weights out and gradients back every step). A
    # replica computes its share of the expert's rows (each rank's rows dealt equally over the owner and the
    # replicas); its gradients go to the owner in backward, which alone holds and updates the expert's states; the
    # owner's new weights reach the replicas after every step. Replica weights live beside the pages, on the device,
    # counted by the estimate as activations are (memory_stats: moe_rebalance.replicas). 0: experts only swap ranks.
    moe_replicas: int = 0
    # Sequence parallelism (tp > 1): norms and the residual stream on sequence shards; all-gather before the
    # column-parallel linears, reduce-scatter after the row-parallel ones.
    sequence_parallel: bool = False
    # 0: every rank holds every state (gradients all-reduced, as DDP). 1: optimizer states (moments, fp32 master)
    # sharded: rank r keeps page r of every page group; gradients reduce-scattered onto their owners after backward.
    # 2: gradients sharded during backward too (a group reduced as soon as it is final). 3: parameters too (a page
    # group is all-gathered before its unit computes and dropped after).
    zero: Literal[0, 1, 2, 3] = 3
    # Seconds a collective may wait for its peers (process-group set-up included): past it, a dead or hung rank ends
    # every rank with a CollectiveError naming the collective, instead of a hang.
    timeout_s: float = 300.0
    # OSDP (zero 3 only): keep the page groups whose gathers compute waited on longest (measured in the first step
    # that follows the recorded one, agreed over ranks) replicated on every rank: refreshed by one all-gather after
    # each update instead of gathered before use, within half of the device room spare beside the largest unit's
    # groups (the other half keeps prefetching). The estimate says how many may be; the engine which, and why.
    osdp: bool = False

    def validate(self) -> None:
        if self.dp is not None:
            self._require("dp", self.dp >= 1, ">= 1 or null")
        self._require("tp", self.tp >= 1, ">= 1")
        self._require("ep", self.ep >= 1, ">= 1")
        if self.sequence_parallel:
            self._require("sequence_parallel", self.tp > 1, "false unless tp > 1 (it splits the sequence over tp)")
        if self.osdp:
            self._require("osdp", self.zero == 3, "false unless zero is 3 (only ZeRO-3 shards parameters)")
        self._require("timeout_s", 0 < self.timeout_s <= 86400, "> 0 and at most 86400 (a day)")
        if self.moe_a2a == "hierarchical":
            self._require("moe_a2a", self.ep > 1, "flat unless ep > 1 (only expert parallelism exchanges tokens)")
        self._require("moe_rebalance_every", self.moe_rebalance_every >= 0, ">= 0")
        if self.moe_rebalance_every:
            self._require("moe_rebalance_every", self.ep > 1, "0 unless ep > 1 (experts move between ep ranks)")
        self._require("moe_rebalance_threshold", self.moe_rebalance_threshold >= 1.0, ">= 1.0 (a max/mean ratio)")
        self._require("moe_rebalance_ema", 0.0 <= self.moe_rebalance_ema < 1.0, "in [0, 1)")
        self._require("moe_replicas", self.moe_replicas >= 0, ">= 0")
        if self.moe_replicas:
            self._require("moe_replicas", self.moe_rebalance_every > 0,
                          "0 unless moe_rebalance_every > 0 (replicas are placed at a rebalance)")


@dataclass
class CheckpointConfig(_Section):
    SECTION: ClassVar[str] = "checkpoint"

    # Save the whole training state every this many steps (and after the last step); 0: only on a signal.
    every: int = 0
    keep: int = 2  # complete checkpoints kept; older ones are deleted after each save
    dir: Optional[str] = None  # None: <run.dir>/checkpoints
    # SIGTERM or SIGINT: finish the step, save a checkpoint, then exit cleanly (page files removed). false: stop at
    # once, as before (nothing saved).
    on_signal: bool = True
    # Write the `every`-step checkpoints beside training: the pages in memory are copied aside only when training is
    # about to change them before they are written (checkpoint/snapshot.py), those on disk held in their slots until
    # written (a page written back meanwhile takes another slot, beyond the disk budget if need be: up to twice the
    # disk-resident states), and the next steps run while a thread writes. The checkpoint still holds exactly that
    # step's state. (`async` is a Python keyword.)
    async_save: bool = False
    # A save beside training writes at most this many GB/s (1e9 bytes; null: as fast as it can). Where training
    # pages to the same disk, a paced save takes longer but slows each step less. "auto" (the default): at the pace
    # that writes it in half the time until the next one (`every` steps at the median step time so far; unpaced
    # without `every`). Waiting for a save (the next save, a load, close, a signal) lifts its pace.
    async_max_gbps: Pace = "auto"

    def validate(self) -> None:
        self._require("every", self.every >= 0, ">= 0")
        self._require("keep", self.keep >= 1, ">= 1")


@dataclass
class ActivationsConfig(_Section):
    SECTION: ClassVar[str] = "activations"

    # Recomputation per paging unit (angel_ptm/activations/recompute.py). "full": a checkpointed unit keeps only its
    # inputs in forward and recomputes its forward in backward (torch.utils.checkpoint, non-reentrant, RNG state
    # restored), its parameters brought back for the recomputation. "selective": it keeps the outputs of its matrix
    # products and fused attention kernels (expensive to recompute, small to keep) and recomputes everything else
    # -- norms, activation functions, softmax, dropout, elementwise ops, unfused attention scores -- as Megatron's
    # selective recomputation and torchtitan's op-level selective checkpointing do. "none": autograd keeps every
    # saved tensor.
    checkpoint: str = "none"
    # The unit types (module class names, as `angel-ptm estimate` lists the units) that checkpoint; empty: every
    # unit but the model's root.
    units: Tuple[str, ...] = ()
    # A mode per unit type, over `checkpoint` and `units` for the types it names (e.g. {Attention: selective,
    # FeedForward: full}); null: none (angel_ptm/activations/recompute.py checkpoint_modes).
    unit_modes: UnitModes = None
    # Saved tensors in activation pages (angel_ptm/activations/offload.py): "host" writes every saved tensor of at
    # least offload_min_bytes (under checkpointing: each checkpointed unit's inputs) into pages that the scheduler
    # moves like any page -- evicted from the device when the pool needs room, prefetched back before the backward
    # that reads them; "disk" also writes each filled page to disk at once (write-behind), so host memory holds only
    # the pages in flight. "none": saved tensors stay where autograd keeps them.
    offload: str = "none"
    offload_min_bytes: ByteSize = "64KiB"  # type: ignore[assignment]

    def validate(self) -> None:
        self._require("checkpoint", self.checkpoint in ("none", "full", "selective"), '"none", "full" or "selective"')
        self._require("offload", self.offload in ("none", "host", "disk"), '"none", "host" or "disk"')
        self._require("offload_min_bytes", self.offload_min_bytes >= 0, ">= 0")
        if self.units:
            self._require("units", self.checkpoint != "none", 'empty while checkpoint is "none"')
            self._require("units", all(name.strip() for name in self.units), "a list of module class names")


@dataclass
class RunConfig(_Section):
    SECTION: ClassVar[str] = "run"

    dir: Optional[str] = None  # None: runs/<timestamp> (runs/<name>-<timestamp> with a run.name)
    name: str = "default"
    # null: a new run. "auto": continue from the newest complete checkpoint in checkpoint.dir if there is one (a new
    # run otherwise). A path: that checkpoint directory. torchrun's restarts (TORCHELASTIC_RESTART_COUNT > 0)
    # resume as "auto" does.
    resume: Optional[str] = None

    def validate(self) -> None:
        self._require("name", self.name.strip() != "" and "/" not in self.name and self.name not in (".", ".."),
                      "a non-empty name without '/' (it names the run's directory under runs/)")
        if self.resume is not None:
            self._require("resume", self.resume.strip() != "", '"auto", a checkpoint path or null')


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        # Sections validate themselves; here we only catch a section of the wrong class passed from code.
        for name, section_class in section_classes().items():
            section = getattr(self, name)
            if not isinstance(section, section_class):
                raise ConfigTypeError(
                    f"{name}: expected {section_class.__name__}, got {show_value(section)} ({type(section).__name__})"
                )
        check_combinations(self)  # rules across sections (config/combinations.py)


@functools.cache
def section_classes() -> dict[str, type]:
    """Section name -> dataclass, in declaration order (``{"model": ModelConfig, ...}``)."""
    types = field_types(Config)
    return {f.name: types[f.name] for f in dataclasses.fields(Config)}
