"""A pytest plugin that writes each failure's report to $OUT/failures.log the moment it happens (a suite cut off
by a time limit still says which tests failed and why): `python -m pytest -p tools.pytest_failures`."""

import os


def pytest_runtest_logreport(report):
    if report.failed:
        path = os.path.join(os.environ.get("OUT", "."), "failures.log")
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
