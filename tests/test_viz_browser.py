"""The report in a real browser: a short training run through the CLI, `angel-ptm viz` on its run directory, and
the report opened in headless Chromium, which must run its scripts without an error and draw every chart with data.

The report's scripts write their status into the DOM (ERROR_HOOK and REPORT_JS in angel_ptm/viz/assets.py):
``body[data-errors]`` counts uncaught errors, ``body[data-render-complete]`` is set once every chart was tried, and
each ``[data-chart]`` gets ``data-rendered="N points"`` (or ``data-error``). Chromium's ``--dump-dom`` prints that
DOM after the scripts ran. Skipped where /usr/bin/chromium is absent (Debian packages chromium and
chromium-driver; .ci/run installs them). Set ANGEL_PTM_VIZ_SCREENSHOT to a path to keep the screenshot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from angel_ptm import cli

CHROMIUM = Path("/usr/bin/chromium")
CHARTS = ("usage", "residency", "moved", "lanes")
# A tiny GPT whose model states (~108 pages of 4 KiB) are far larger than the device and host budgets (40 pages
# each: the one block's unit with the root's pages is 27), so pages move between all three tiers on every step;
# six steps take a few seconds on a CPU.
TINY_JOB = [
    "model.dim=32", "model.n_layer=1", "model.n_head=2", "model.seq_len=16", f"data.path={os.__file__}",
    "data.batch_size=4", "trainer.steps=6", "trainer.eval_every=0", "memory.page_bytes=4KiB",
    "memory.device_budget=160KiB", "memory.host_budget=160KiB",
]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason=f"{CHROMIUM} not found (apt-get install chromium chromium-driver)")


class StatusAttributes(HTMLParser):
    """Collects the attributes of <body> and of every element with a data-chart attribute."""

    def __init__(self):
        super().__init__()
        self.body: dict[str, str] = {}
        self.charts: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag, attrs):
        attributes = {name: value or "" for name, value in attrs}
        if tag == "body":
            self.body = attributes
        if "data-chart" in attributes:
            self.charts[attributes["data-chart"]] = attributes


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"chromium failed ({result.returncode}): {result.stderr[-2000:]}"
    return result


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    pytest.importorskip("angel_ptm.engine")
    run_dir = tmp_path_factory.mktemp("viz-browser") / "run"
    overrides = [arg for setting in TINY_JOB + [f"run.dir={run_dir}"] for arg in ("--set", setting)]
    assert cli.main(["train", "--no-progress", *overrides]) == 0
    assert cli.main(["viz", str(run_dir)]) == 0
    return run_dir / "report.html"


def test_report_renders_every_chart_with_data_and_no_script_error(report, tmp_path):
    dom = chromium(tmp_path / "profile", "--dump-dom", report.as_uri()).stdout
    status = StatusAttributes()
    status.feed(dom)
    assert status.body.get("data-render-complete") == "true", "the report's script did not finish"
    assert status.body.get("data-errors") == "0", status.body.get("data-error-messages")
    assert set(status.charts) == set(CHARTS)
    for name, attributes in status.charts.items():
        assert "data-error" not in attributes, f"chart {name}: {attributes['data-error']}"
        rendered = attributes.get("data-rendered", "")
        assert rendered.endswith(" points") and int(rendered.split()[0]) > 0, f"chart {name}: {rendered!r}"
    assert '<table id="steps-table">' in dom and "<svg" in dom and "<canvas" in dom


def test_report_screenshot_is_taken(report, tmp_path):
    screenshot = tmp_path / "report.png"
    chromium(tmp_path / "profile", "--window-size=1400,3000", "--hide-scrollbars", f"--screenshot={screenshot}",
             report.as_uri())
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 100_000  # a page of charts (about 450 KB), not a blank one (about 19 KB)
    keep = os.environ.get("ANGEL_PTM_VIZ_SCREENSHOT")
    if keep:
        shutil.copyfile(screenshot, keep)
