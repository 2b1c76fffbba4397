"""Memory-trace events: every layer may emit them; nothing depends on reading them back."""

from angel_ptm.trace.recorder import EVENTS, TraceRecorder

__all__ = ["EVENTS", "TraceRecorder"]
