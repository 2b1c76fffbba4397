"""Typed errors for everything a user (or the machine) can get wrong.

Each message is one line naming the key, path or numbers involved, so the CLI can print ``str(err)`` and exit
non-zero without a traceback.
"""

from __future__ import annotations


def _rebuilt(cls: type, args: tuple, state: dict) -> BaseException:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def _reduce(self: BaseException):
    """Pickled as raised: its message and attributes, not through an `__init__` that takes other arguments than
    the message (a rank's error reaches the others pickled: DCP gathers a failed save's errors, and an error that
    did not unpickle there left every other rank waiting for a result until parallel.timeout_s)."""
    return _rebuilt, (type(self), self.args, dict(self.__dict__))


class AngelError(Exception):
    """Base of every error angel-ptm raises on purpose."""

    __reduce__ = _reduce


# --- configuration -------------------------------------------------------------------------------------------
class ConfigError(AngelError):
    """A configuration problem; the message names the dotted key."""


class UnknownKeyError(ConfigError):
    """A config key that does not exist (the message suggests the closest valid key)."""


class ConfigTypeError(ConfigError):
    """A config value of the wrong type."""


class ConfigValueError(ConfigError):
    """A config value of the right type that is impossible (negative size, lr < 0, ...)."""


class DataError(AngelError):
    """A data directory or token file that is missing, empty or malformed."""


class DiskDirError(ConfigError):
    """A `memory.disk_dir` that cannot hold page files: a file, not creatable, not writable, or without room."""


class RunDirInUseError(ConfigError):
    """A `run.dir` that already holds an earlier run's metrics.jsonl: a run never overwrites another's record."""


# --- memory ---------------------------------------------------------------------------------------------------
class BudgetError(AngelError):
    """A request that a tier cannot hold; raised before anything is allocated."""

    def __init__(self, tier: str, requested: int, available: int, what: str = ""):
        self.tier, self.requested, self.available = tier, int(requested), int(available)
        extra = f" for {what}" if what else ""
        super().__init__(f"{tier} tier budget exceeded{extra}: requested {_sizes(self.requested, self.available)}")


def _sizes(requested: int, available: int) -> str:
    """Readable sizes and the exact count asked for, "1.5 GiB (1610612736 bytes), 512.0 MiB available" (the exact
    available count too where both round to the same size)."""
    from angel_ptm.config.sizes import format_bytes  # here, not at the top: config.sizes imports this module

    def exact(n: int) -> str:
        return format_bytes(n) if abs(n) < 1024 else f"{format_bytes(n)} ({n} bytes)"

    wanted, have = format_bytes(requested), format_bytes(available)
    return f"{exact(requested)}, {exact(available) if wanted == have else have} available"


class PageStateError(AngelError):
    """An illegal page state transition (a bug in the caller, never silently ignored)."""


# --- I/O ------------------------------------------------------------------------------------------------------
class PageIOError(AngelError):
    """A read or write that failed; the page stays on its source tier, unchanged."""

    def __init__(self, message: str, errno: int = 0, path: str = ""):
        self.errno, self.path = int(errno), path
        super().__init__(message)


class DiskFullError(PageIOError):
    """ENOSPC / EFBIG: the disk (or the file size limit) has no room for the write."""


class ChecksumError(AngelError):
    """A page read from disk whose checksum does not match the one recorded when it was written."""

    def __init__(self, page: str, path: str, expected: int, actual: int):
        self.page, self.path, self.expected, self.actual = page, path, expected, actual
        super().__init__(
            f"checksum mismatch for page {page} in {path}: expected {expected:#010x}, got {actual:#010x}"
        )


# --- reports (angel-ptm viz) ----------------------------------------------------------------------------------
class RunDirError(AngelError):
    """A run directory that is missing, is not a directory, or holds no trace.jsonl to report on."""


class TraceFormatError(AngelError):
    """A trace.jsonl with no readable event at all (every line malformed), so there is nothing to report."""


class ReportWriteError(AngelError):
    """A report or Chrome-trace output path that cannot be written (missing folder, no permission, disk full)."""


# --- kernels --------------------------------------------------------------------------------------------------
class KernelInputError(AngelError):
    """A tensor or scalar handed to a native kernel (fused Adam) with the wrong dtype, device, layout, size or range."""


# --- scheduling -----------------------------------------------------------------------------------------------
class ScheduleError(AngelError):
    """A recorded step that no plan can serve (an access pinning more pages than its tier holds)."""


# --- the engine and the model ---------------------------------------------------------------------------------
class ParameterAccessError(AngelError):
    """A parameter used outside the forward of its paging unit, where its values live in pages (not in the tensor)."""


class ActivationError(AngelError):
    """A saved activation that cannot be given back: read a second time after its activation pages were freed."""


class StateDictError(AngelError, RuntimeError):
    """A state dict that does not match the model: missing or unexpected keys, or a shape that differs. A
    RuntimeError too, as torch's load_state_dict raises (`except RuntimeError:` fallbacks keep working)."""


class EngineFailedError(AngelError):
    """A step failed part-way (I/O, checksum, disk full): the pages may hold a half-applied update, so every further
    call refuses; resume from the last checkpoint."""


class EngineClosedError(AngelError):
    """A call that trains, writes or checkpoints on an engine after its close(): the model holds its trained weights
    as ordinary tensors, and a new engine trains on from them."""


# --- checkpoints ----------------------------------------------------------------------------------------------
class CheckpointError(AngelError):
    """A checkpoint that cannot be saved or loaded: a path in use, a save between backward and step, a checkpoint
    of another model, a peer's failure during a collective save or load."""

    def __init__(self, message: str, path: str = ""):
        self.path = path
        super().__init__(message)


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file that is missing, truncated or whose bytes do not match the checksum the manifest recorded
    when it was written; the message names the file."""


class CheckpointWriteError(CheckpointError):
    """A save that failed writing (ENOSPC, EIO, permissions): the partial checkpoint was removed, the training state
    is untouched and the previous checkpoint stays the latest."""

    def __init__(self, message: str, path: str = "", errno: int = 0):
        self.errno = int(errno)
        super().__init__(message, path)


# --- distributed ----------------------------------------------------------------------------------------------
class DistributedError(AngelError):
    """A data-parallel run that cannot start: a world size the mesh does not divide, a process group that cannot
    be set up."""


class ConfigMismatchError(DistributedError):
    """Ranks started with different configs or page layouts (compared at start): their collectives would not match."""


class CollectiveError(DistributedError):
    """A collective failed or timed out (parallel.timeout_s): a peer died or hung. Fatal: the process group is
    poisoned and a step may be half-done, so every rank stops."""


class TensorParallelError(ConfigValueError):
    """Tensor parallelism cannot split this model as asked: a dimension (heads, kv heads, hidden, vocabulary,
    sequence) that tp does not divide, a plan naming a module the model lacks, or an operation on vocabulary-sharded
    logits that would compute on one rank's share only. The message names the module and the dimension."""


# --- signals --------------------------------------------------------------------------------------------------
class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm and Kubernetes send before they kill a job), raised where the run is: it unwinds and
    cleans up exactly as Ctrl-C does, and like KeyboardInterrupt no `except Exception` swallows it."""

    __reduce__ = _reduce

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"terminated by signal {self.signum}")


class EngineBusyError(AngelError, RuntimeError):
    """A thread called the engine while another thread was inside a call of it (forward, backward, step): the
    engine's paging state belongs to one step at a time; drive it from one thread, or one call after another."""
