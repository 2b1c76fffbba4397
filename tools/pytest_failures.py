"""A pytest plugin that writes each failure's report to $OUT/failures.log the moment it happens (a suite cut off
by a time limit still says which tests failed and why), and the time and count of each finished test to
$OUT/progress.log (so a suite cut off after its last test tells a slow tail from a hang at exit):
`python -m pytest -p tools.pytest_failures`."""

import os
import time

_START = time.monotonic()
_DONE = [0]


def _out(name):
    return os.path.join(os.environ.get("OUT", "."), name)


def pytest_runtest_logreport(report):
    if report.failed:
        with open(_out("failures.log"), "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
    if report.when == "teardown":
        _DONE[0] += 1
        with open(_out("progress.log"), "a") as log:
            log.write(f"{time.monotonic() - _START:.1f}s {_DONE[0]} {report.nodeid}\n")


def pytest_sessionfinish(session, exitstatus):
    with open(_out("progress.log"), "a") as log:
        log.write(f"{time.monotonic() - _START:.1f}s session finished, exit status {int(exitstatus)}\n")
