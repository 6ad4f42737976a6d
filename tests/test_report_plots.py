"""The matplotlib figures: every plot function, every input shape, PNG and SVG, no pyplot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import resolve_device
from ndplan.memory import estimate
from ndplan.model import load_model
from ndplan.schedule import simulate
from ndplan.strategy import Strategy
from test_report import estimate_result, synthetic_search

pytest.importorskip("matplotlib")

from ndplan.report import (  # noqa: E402
    pareto_front,
    plot_memory,
    plot_pareto,
    plot_time,
    plot_timeline,
    schedule_to_dict,
    write_plots,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def est() -> dict[str, Any]:
    return estimate_result()


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


def test_importing_the_report_does_not_import_matplotlib() -> None:
    code = "import sys, ndplan.report, ndplan.report.cli; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_plot_memory_from_a_memory_report_as_the_estimate_cli_calls_it(tmp_path: Path) -> None:
    model = load_model("llama-3.1-8b")
    report = estimate(model, Strategy(tp=2, pp=4, dp=1, num_micro_batches=8), resolve_device("h100-sxm"))
    out = plot_memory(report, tmp_path / "memory.png")
    assert is_png(out)
    assert "matplotlib.pyplot" not in sys.modules  # drawn on the Agg canvas, the caller's backend untouched


def test_plot_memory_svg_from_the_json(est: dict[str, Any], tmp_path: Path) -> None:
    out = plot_memory(est, tmp_path / "m.svg")
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "device capacity" in text and "activations" in text  # legend text kept as text


def test_plot_time_from_a_perf_dict_and_from_search_rows(est: dict[str, Any], tmp_path: Path) -> None:
    assert is_png(plot_time(est["perf"], tmp_path / "t1.png"))
    assert is_png(plot_time(synthetic_search(2000, top=6), tmp_path / "t2.png"))
    flat = {"step_s": 2.0, "compute_s": 1.5, "tp_s": 0.2, "dp_s": 0.1, "bubble_s": 0.15, "optimizer_s": 0.05}
    assert is_png(plot_time(flat, tmp_path / "t3.png"))


@pytest.mark.parametrize("schedule,pp,vpp,m", [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("zbv", 4, 2, 8),
                                                ("dualpipev", 4, 2, 10), ("gpipe", 2, 1, 4)])
def test_plot_timeline_of_every_schedule_shape(schedule: str, pp: int, vpp: int, m: int, tmp_path: Path) -> None:
    sim = simulate(schedule, pp, vpp, m)
    assert is_png(plot_timeline(sim, tmp_path / "a.png"))
    assert is_png(plot_timeline(schedule_to_dict(sim), tmp_path / "b.png"))


def test_plot_timeline_of_a_result_simulates_its_schedule(est: dict[str, Any], tmp_path: Path) -> None:
    assert is_png(plot_timeline(est, tmp_path / "tl.png"))
    with pytest.raises(NdplanError, match="schedule"):
        plot_timeline({"model": "x", "stages": [{"peak_bytes": 1}]}, tmp_path / "none.png")


def test_plot_pareto_from_arrays_and_from_a_result(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    peak = rng.uniform(10, 100, 50_000) * 2**30
    step = 100 * 2**30 / peak + rng.gamma(2, 0.3, 50_000)
    pairs = np.stack([step, peak], axis=1)
    front = pareto_front(step, peak)
    assert is_png(plot_pareto(pairs, tmp_path / "p1.png", pareto=front, limit_bytes=80 * 2**30))
    assert is_png(plot_pareto(synthetic_search(20_000), tmp_path / "p2.png"))
    assert plot_pareto({"step_s": step, "peak_bytes": peak}, tmp_path / "p3.svg").read_text().count("<svg") == 1


def test_write_plots_writes_what_the_result_has(est: dict[str, Any], tmp_path: Path) -> None:
    names = sorted(p.name for p in write_plots(est, tmp_path / "e"))
    assert names == ["memory.png", "time.png", "timeline.png"]
    names = sorted(p.name for p in write_plots(synthetic_search(5000), tmp_path / "s", fmt="svg"))
    assert names == ["memory-1-ranked.svg", "pareto.svg", "time.svg", "timeline.svg"]


def test_plot_errors_are_one_line(est: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(NdplanError, match="suffix"):
        plot_memory(est, tmp_path / "m.bmpx")
    with pytest.raises(NdplanError, match="no per-stage memory"):
        plot_memory({"model": "x"}, tmp_path / "m.png")
    with pytest.raises(NdplanError, match="no step-time"):
        plot_time({"stages": est["stages"]}, tmp_path / "t.png")
    with pytest.raises(NdplanError, match="no candidates"):
        plot_pareto({"candidates": None}, tmp_path / "p.png")


def test_a_timeline_in_forward_units_names_the_chunk_as_the_page_does() -> None:
    """The figure said 'one micro-batch forward' where the page says 'on one chunk': under vpp a
    unit is one chunk's forward, a vpp-th of a micro-batch's."""
    from matplotlib.figure import Figure

    from ndplan.report.data import schedule_to_dict
    from ndplan.report.plots import _draw_timeline

    tl = {**schedule_to_dict(simulate("interleaved", 2, 2, 4)), "unit": "forward"}
    fig = Figure()
    _draw_timeline(fig, tl, "")
    assert fig.axes[0].get_xlabel() == "time (unit: one micro-batch forward on one chunk)"
