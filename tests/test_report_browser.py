"""The HTML report in a real browser: headless Chromium with networking off.

Every chart's script sets ``data-rendered="1"`` (or ``"error"`` and an entry in ``window.__errors``
and ``#ndp-errors``); the page writes ``data-errors`` and ``data-render-ms`` (``performance.now()``
when rendering finished) on ``<html>``. The DOM is read back with ``--dump-dom`` and the console
with ``--enable-logging=stderr``. Screenshots go to ``$NDPLAN_REPORT_ARTIFACTS`` when set (else
pytest's temporary folder) and their paths are printed (``pytest -s``).

Chromium is Debian's ``chromium`` package (``apt-get install -y chromium``); without it these tests
skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from ndplan.report import write_html
from test_report import estimate_result, synthetic_search

CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium", shutil.which("chromium-browser"))
                 if p and Path(p).exists()), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install -y chromium)")

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
    # networking off: every host resolves to nothing and any proxied request goes nowhere
    "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("NDPLAN_REPORT_ARTIFACTS") or tmp_path_factory.mktemp("report-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def chromium(page: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="ndplan-chromium-") as profile:
        return subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout, check=False,
        )


def render(page: Path) -> tuple[str, list[str]]:
    """The DOM after the page's scripts ran, and the console messages it logged."""
    run = chromium(page, "--enable-logging=stderr", "--v=0", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return run.stdout, console


def screenshot(page: Path, out: Path, size: str = "1400,2000") -> Path:
    run = chromium(page, f"--screenshot={out}", f"--window-size={size}")
    assert run.returncode == 0 and out.exists(), run.stderr[-2000:]
    return out


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def distinct_colours(path: Path) -> int:
    image = pytest.importorskip("PIL.Image")
    with image.open(path) as im:
        return len(im.convert("RGB").resize((350, 500)).getcolors(1 << 20) or [])


def check_rendered(dom: str, console: list[str], charts: int) -> dict[str, str]:
    """Every chart drew, no script error anywhere; returns the <html> attributes."""
    states = re.findall(r'class="ndp-chart"[^>]*data-rendered="([^"]*)"', dom)
    assert states == ["1"] * charts, (states, console)
    html_tag = re.search(r"<html[^>]*>", dom)
    assert html_tag
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', html_tag.group(0)))
    assert attrs.get("data-errors") == "0", console
    assert re.search(r'<pre id="ndp-errors" class="ndp-error" hidden=""></pre>', dom)
    assert not [line for line in console if "ndplan report" in line or "Uncaught" in line or "Refused" in line]
    assert dom.count('data-sortable-ready="1"') == dom.count('<table class="ndp sortable"')
    return attrs


def chart_count(text: str) -> int:
    return len(json.loads(re.search(r'id="ndplan-data">(.*?)</script>', text, re.S).group(1))["charts"])  # type: ignore[union-attr]


def test_estimate_report_renders(tmp_path: Path, artifacts: Path) -> None:
    page = write_html(estimate_result(), tmp_path / "estimate.html")
    dom, console = render(page)
    attrs = check_rendered(dom, console, chart_count(page.read_text()))
    assert dom.count("<svg") >= 4 and "Pipeline timeline: interleaved" in dom
    shot = screenshot(page, artifacts / "report-estimate.png")
    assert png_size(shot) == (1400, 2000)
    assert distinct_colours(shot) > 40  # charts drawn, not a blank page
    print(f"\nestimate report: {page.stat().st_size / 1024:.0f} KiB, rendered in {attrs['data-render-ms']} ms; "
          f"screenshot {shot}")


@pytest.mark.parametrize("schedule,extra", [
    ("dualpipev", {"vpp": 2, "pp": 4}),
    ("zb-h1", {"vpp": 1, "pp": 4}),
    ("seq1f1b", {"vpp": 1, "pp": 2, "dp": 4, "seq_chunks": 2, "num_micro_batches": 8}),
])
def test_timelines_of_other_schedules_render(schedule: str, extra: dict[str, Any], tmp_path: Path) -> None:
    result = estimate_result(schedule=schedule, **extra)
    del result["perf"]  # no step-time model: the timeline in relative units
    page = write_html(result, tmp_path / f"{schedule}.html")
    dom, console = render(page)
    check_rendered(dom, console, chart_count(page.read_text()))
    assert f"Pipeline timeline: {schedule}" in dom


def test_large_search_report_size_and_load_time(tmp_path: Path, artifacts: Path) -> None:
    page = write_html(synthetic_search(200_000), tmp_path / "search.html")
    size = page.stat().st_size
    assert size < 5 * 1024 * 1024
    dom, console = render(page)
    attrs = check_rendered(dom, console, chart_count(page.read_text()))
    render_ms = float(attrs["data-render-ms"])
    assert render_ms < 10_000, render_ms  # typically a few hundred ms
    shot = screenshot(page, artifacts / "report-search.png")
    assert png_size(shot) == (1400, 2000) and distinct_colours(shot) > 40
    (artifacts / "report-search-timing.json").write_text(json.dumps(
        {"candidates": 200_000, "html_bytes": size, "render_ms": render_ms}, indent=2))
    print(f"\nsearch report, 200,000 candidates: {size / 1024:.0f} KiB, rendered in {render_ms:.0f} ms "
          f"(performance.now() at the end of the page script); screenshot {shot}")


def test_table_sorts_on_header_click(tmp_path: Path) -> None:
    text = write_html(synthetic_search(5000, top=12), tmp_path / "s.html").read_text()
    probe = """<script>
    (function () {
      var table = document.getElementById("ndp-top"), heads = table.tHead.rows[0].cells, col = -1;
      for (var i = 0; i < heads.length; i++) if (heads[i].textContent === "MFU") col = i;
      var read = function () { return Array.prototype.map.call(table.tBodies[0].rows,
        function (r) { return parseFloat(r.cells[col].getAttribute("data-v")); }).join(","); };
      heads[col].click();
      document.body.setAttribute("data-asc", read());
      heads[col].click();
      document.body.setAttribute("data-desc", read());
      document.body.setAttribute("data-sort-state", heads[col].getAttribute("aria-sort"));
    })();
    </script></body>"""
    page = tmp_path / "probe.html"
    page.write_text(text.replace("</body>", probe))
    dom, console = render(page)
    asc = [float(v) for v in re.search(r'data-asc="([^"]*)"', dom).group(1).split(",")]  # type: ignore[union-attr]
    desc = [float(v) for v in re.search(r'data-desc="([^"]*)"', dom).group(1).split(",")]  # type: ignore[union-attr]
    assert asc == sorted(asc) and desc == sorted(asc, reverse=True) and len(asc) == 12
    assert 'data-sort-state="descending"' in dom


def test_nothing_is_fetched_and_failures_are_reported(tmp_path: Path) -> None:
    """The page's CSP refuses any load (so a report can never reach the network); a chart whose
    data is broken is marked, listed, and logged, and the others still draw."""
    text = write_html(estimate_result(), tmp_path / "e.html").read_text()
    text = text.replace('"type":"gantt"', '"type":"no-such-chart"', 1)
    text = text.replace("</main>", '<img src="http://example.com/x.png" alt=""></main>')
    page = tmp_path / "broken.html"
    page.write_text(text)
    dom, console = render(page)
    states = re.findall(r'class="ndp-chart"[^>]*data-rendered="([^"]*)"', dom)
    assert states.count("error") == 1 and states.count("1") == len(states) - 1
    assert 'data-errors="1"' in dom and "chart-timeline:" in dom
    assert any("ndplan report: chart-timeline" in line for line in console)
    assert any("Content Security Policy" in line or "Refused" in line for line in console)
