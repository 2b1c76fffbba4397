"""Reports on a run's memory trace: a self-contained HTML page and a Chrome trace-event JSON (Perfetto).

    from angel_ptm.viz import build_report
    result = build_report("runs/20250101-120000")   # report.html and trace.chrome.json in the run directory

The trace is read once, as a stream, into downsampled series (bins.py, residency.py, digest.py), so a trace of
hundreds of MB takes seconds and little memory. `validate_chrome_trace` checks a trace-event file.
"""

from angel_ptm.viz.chrome import validate_chrome_trace
from angel_ptm.viz.digest import DigestLimits
from angel_ptm.viz.report import ReportResult, build_report

__all__ = ["DigestLimits", "ReportResult", "build_report", "validate_chrome_trace"]
