"""The report package: data preparation, downsampling, the HTML page (escaping, size), the CLI."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ndplan import __version__
from ndplan.errors import NdplanError
from ndplan.hardware import resolve_device
from ndplan.memory import estimate
from ndplan.model import load_model
from ndplan.report import downsample, pareto_front, prepare, render_html, schedule_to_dict, write_html
from ndplan.report.data import memory_stages, perf_segments
from ndplan.schedule import simulate
from ndplan.strategy import Strategy

GIB = 1024**3


# ------------------------------------------------------------------ fixtures shared with the other report tests
def estimate_result(**overrides: Any) -> dict[str, Any]:
    """What `ndplan estimate --json` prints, plus a step-time report under "perf"."""
    model = load_model("llama-3.1-8b")
    device = resolve_device("h100-sxm")
    fields = {"dp": 2, "tp": 2, "pp": 4, "vpp": 2, "schedule": "interleaved", "num_micro_batches": 16,
              "global_batch_size": 32, **overrides}
    strategy = Strategy(**fields)
    report = estimate(model, strategy, device, num_devices=16)
    return {
        "model": model.name, "hardware": device.name, "devices": 16, "strategy": strategy.model_dump(mode="json"),
        **report.to_dict(),
        "perf": {"step_s": 2.4, "tokens_per_s": 54613.0, "tokens_per_s_per_device": 3413.3, "mfu": 0.41, "hfu": 0.45,
                 "breakdown": {"compute": 1.8, "comm_exposed": {"tp": 0.12, "cp": 0.0, "ep": 0.0, "dp": 0.08, "pp": 0.03},
                               "bubble": 0.3, "optimizer": 0.07}},
    }


def synthetic_search(n: int = 200_000, seed: int = 0, top: int = 25) -> dict[str, Any]:
    """A search result of n candidates: step time falls as memory grows, with noise and outliers."""
    rng = np.random.default_rng(seed)
    peak = np.exp(rng.normal(np.log(60 * GIB), 0.55, n))
    step = 4.0 * (60 * GIB / peak) ** 0.6 * np.exp(rng.gamma(2.0, 0.12, n))
    step[rng.random(n) < 0.001] = np.inf  # strategies the time model could not place
    limit = 80 * GIB
    feasible = np.flatnonzero(np.isfinite(step) & (peak <= limit))
    best = feasible[np.argsort(step[feasible])[:top]]
    schedules = ["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]
    rows = []
    for rank, i in enumerate(best, start=1):
        pp = int(rng.choice([2, 4, 8]))
        stages = (peak[i] * rng.uniform(0.8, 1.0, pp)).tolist()
        stages[int(rng.integers(pp))] = float(peak[i])
        compute = step[i] * 0.78
        rows.append({
            "rank": rank,
            "degrees": {"dp": int(rng.choice([4, 8, 16])), "tp": int(rng.choice([1, 2, 4, 8])), "pp": pp, "cp": 1, "ep": 1},
            "schedule": schedules[rank % len(schedules)], "vpp": 2 if schedules[rank % len(schedules)] != "1f1b" else 1,
            "recompute": ["none", "selective", "full"][rank % 3], "mbs": int(rng.choice([1, 2])),
            "num_micro_batches": int(rng.choice([16, 32])), "peak_bytes_per_stage": stages,
            "step_s": float(step[i]), "tokens_per_s": float(1024 * 4096 / step[i]),
            "mfu": float(0.55 * step.min() / step[i] + 0.1),
            "breakdown": {"compute": compute, "comm_exposed": {"tp": step[i] * 0.06, "cp": 0.0, "ep": 0.0,
                                                               "dp": step[i] * 0.04, "pp": step[i] * 0.02},
                          "bubble": step[i] * 0.08, "optimizer": step[i] * 0.02},
        })
    return {
        "kind": "search", "model": "llama-3.1-70b", "hardware": "h100-sxm", "devices": 256,
        "memory_limit_bytes": limit,
        "candidates": {"step_s": step.tolist(), "peak_bytes": peak.tolist()},
        "rows": rows,
        "search": {"objective": "tokens_per_s", "gbs": 1024, "seq": 4096},
    }


@pytest.fixture(scope="module")
def est() -> dict[str, Any]:
    return estimate_result()


# ------------------------------------------------------------------ data
def test_memory_stacks_sum_to_the_peak(est: dict[str, Any]) -> None:
    stages = memory_stages(est["stages"])
    for raw, st in zip(est["stages"], stages, strict=True):
        assert sum(st["categories"].values()) == pytest.approx(raw["peak_bytes"], rel=1e-9)
        assert sum(st["kinds"].values()) == pytest.approx(raw["peak_bytes"], rel=1e-9)
        assert st["categories"]["overhead"] == pytest.approx(raw["peak_bytes"] - raw["allocated_bytes"])


def test_optimizer_step_phase_shows_as_its_own_segment() -> None:
    stage = {"stage": 0, "params_bytes": 10, "grads_bytes": 10, "optimizer_bytes": 10, "activations_bytes": 0,
             "comm_bytes": 0, "transient_bytes": 0, "allocated_bytes": 50, "reserved_bytes": 55, "peak_bytes": 60}
    (st,) = memory_stages([stage])
    assert st["categories"]["optimizer_step"] == 20
    assert st["categories"]["overhead"] == 10
    assert st["kinds"]["other"] == 30  # no by_layer_kind: the state is unattributed
    assert sum(st["categories"].values()) == 60


def test_a_peak_the_optimizer_step_sets_stacks_the_state_and_its_temporaries() -> None:
    """Llama-3.1-8B on 8 H100 with ZeRO 1: the optimizer step sets allocated (59.89 GiB: params
    14.96 + grads 29.92 + states 11.22 + 3.80 of the step's temporaries) above the forward/backward
    peak (56.75). The bar dropped the gradients as "not made yet at the forward/backward peak"
    and drew the activations freed by then; it now stacks what the step holds."""
    report = estimate(load_model("llama-3.1-8b"), Strategy(dp=8, zero=1, num_micro_batches=1, seq_length=4096),
                      "h100-sxm").to_dict()
    (st, *_) = memory_stages(report["stages"])
    stage = report["stages"][0]
    assert stage["allocated_bytes"] > stage["forward_backward_bytes"]
    cats = st["categories"]
    assert cats["grads"] == stage["grads_bytes"] and not any(cats.get(k) for k in ("activations", "comm", "transient"))
    assert cats["optimizer_step"] == pytest.approx(stage["optimizer_step_bytes"])
    assert sum(cats.values()) == pytest.approx(stage["peak_bytes"])
    state = stage["params_bytes"] + stage["grads_bytes"] + stage["optimizer_bytes"]
    assert sum(v for k, v in st["kinds"].items() if k not in ("optimizer_step", "overhead", "buffers")) == pytest.approx(state)


def test_stage_with_only_a_peak() -> None:
    (st,) = memory_stages([{"peak_bytes": 7 * GIB}])
    assert st["categories"] == {"unbroken": 7 * GIB}


def test_perf_segments_flatten_comm_and_keep_the_step() -> None:
    perf = {"step_s": 2.0, "breakdown": {"compute": 1.0, "comm_exposed": {"tp": 0.2, "dp": 0.1, "xx": 0.05},
                                         "bubble": 0.3, "optimizer": 0.1}}
    seg = perf_segments(perf)
    assert seg == pytest.approx({"compute": 1.0, "tp": 0.2, "dp": 0.1, "comm_other": 0.05, "bubble": 0.3,
                                 "optimizer": 0.1, "other": 0.25})
    assert sum(seg.values()) == pytest.approx(2.0)


def test_pareto_front_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    step = rng.integers(1, 30, 400).astype(float)
    peak = rng.integers(1, 30, 400).astype(float)
    step[5] = np.nan
    front = set(pareto_front(step, peak).tolist())
    ok = np.isfinite(step)
    brute = set()
    seen = set()
    for i in np.flatnonzero(ok):
        dominated = np.any(ok & (step <= step[i]) & (peak <= peak[i]) & ((step < step[i]) | (peak < peak[i])))
        if not dominated and (step[i], peak[i]) not in seen:
            brute.add(int(i))
            seen.add((step[i], peak[i]))
    assert front == brute


def test_downsample_keeps_the_front_and_the_budget() -> None:
    rng = np.random.default_rng(1)
    x = rng.lognormal(3, 0.5, 200_000)
    y = 100 / x + rng.gamma(2, 0.2, 200_000)
    front = pareto_front(y, x)
    shown = downsample(x, y, 4000, front, logx=True)
    assert len(shown) <= 4000
    assert set(front.tolist()) <= set(shown.tolist())
    assert x[shown].min() == x.min() and x[shown].max() == x.max()
    assert len(downsample(x[:100], y[:100], 4000)) == 100


def test_schedule_to_dict_roundtrips_and_counts_steps_once() -> None:
    sim = simulate("dualpipev", 4, 2, 8)
    tl = schedule_to_dict(sim)
    assert tl["makespan_s"] == sim.makespan_s
    assert tl["bubble_fraction"] == pytest.approx(sim.bubble_fraction)
    assert tl["busy_s"] == pytest.approx(sim.busy_s.tolist())
    again = schedule_to_dict(json.loads(json.dumps(tl)))
    assert again["stages"] == tl["stages"]
    ops = [[{"kind": k, "micro_batch": m, "start_s": a, "end_s": b} for k, m, a, b in
            zip(st["kind"], st["micro_batch"], st["start_s"], st["end_s"], strict=True)] for st in tl["stages"]]
    from_ops = schedule_to_dict({"ops": ops})
    assert from_ops["bubble_fraction"] == pytest.approx(sim.bubble_fraction)


def test_prepare_estimate(est: dict[str, Any]) -> None:
    d = prepare(est)
    assert d["kind"] == "estimate" and d["version"] == __version__
    assert len(d["memory"]) == 1 and d["memory"][0]["capacity_bytes"] == est["capacity_bytes"]
    assert d["timeline"]["schedule"] == "interleaved" and d["timeline"]["unit"] == "s"
    busiest = max(d["timeline"]["busy_s"])
    assert busiest == pytest.approx(est["perf"]["breakdown"]["compute"])  # scaled to the model's compute
    assert d["search"] is None and d["perf_bars"][0]["step_s"] == 2.4


def test_prepare_accepts_a_memory_report() -> None:
    model = load_model("llama-3.1-8b")
    strategy = Strategy(tp=2, pp=2, dp=1, num_micro_batches=4)
    report = estimate(model, strategy, resolve_device("h100-sxm"))
    d = prepare(report)
    assert d["inputs"]["model"] == "llama-3.1-8b" and d["inputs"]["hardware"] == "h100-sxm"
    assert d["timeline"]["unit"] == "forward"  # no step-time model: relative units


def test_prepare_search_shapes_are_equivalent() -> None:
    res = synthetic_search(5000, top=5)
    pairs = list(zip(res["candidates"]["step_s"], res["candidates"]["peak_bytes"], strict=True))
    a = prepare(res, max_points=500)["search"]
    b = prepare({**res, "candidates": pairs}, max_points=500)["search"]
    c = prepare({**res, "candidates": [{"step_s": s, "peak_bytes": p} for s, p in pairs]}, max_points=500)["search"]
    for other in (b, c):
        assert np.array_equal(a["front_step_s"], other["front_step_s"])
        assert a["n_shown"] == other["n_shown"] <= 500 + len(a["front_step_s"])
    given = prepare({**res, "pareto": pareto_front(np.array(res["candidates"]["step_s"]),
                                                   np.array(res["candidates"]["peak_bytes"])).tolist()})["search"]
    assert np.array_equal(np.sort(given["front_step_s"]), np.sort(a["front_step_s"]))
    assert a["n_total"] == 5000 and a["n_dropped"] > 0


def test_bad_candidates_are_one_line_errors() -> None:
    with pytest.raises(NdplanError, match="step_s"):
        prepare({"candidates": {"peak_bytes": [1]}})
    with pytest.raises(NdplanError, match="outside"):
        prepare({"candidates": [[1.0, 2.0]], "pareto": [3]})
    with pytest.raises(NdplanError, match="result dict"):
        prepare([1, 2, 3])


# ------------------------------------------------------------------ HTML
def _data_block(text: str) -> dict[str, Any]:
    match = re.search(r'<script type="application/json" id="ndplan-data">(.*?)</script>', text, re.S)
    assert match
    return json.loads(match.group(1))


def test_html_is_self_contained(est: dict[str, Any], tmp_path: Path) -> None:
    path = write_html(est, tmp_path / "plan.html")
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in text and "default-src &#x27;none&#x27;" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing fetched from anywhere
    assert "<link" not in text and "@import" not in text
    charts = _data_block(text)["charts"]
    assert {spec["type"] for spec in charts.values()} == {"stacked", "hstacked", "gantt"}
    assert text.count('class="ndp-chart"') == len(charts)
    assert f"ndplan {__version__}" in text
    assert "ndplan estimate --model llama-3.1-8b --hardware h100-sxm --devices 16" in text


def test_every_string_is_escaped(tmp_path: Path) -> None:
    evil = '<script>alert("x")</script>&"\''
    res = synthetic_search(2000, top=3)
    res["model"] = evil
    res["hardware"] = evil
    res["rows"][0]["schedule"] = evil
    res["rows"][0]["note"] = evil
    res["search"]["objective"] = evil
    res["stages"] = [{"stage": 0, "peak_bytes": 10 * GIB, "layers": 4}]  # numbers only: junk there is refused
    text = render_html(res)
    assert evil not in text
    assert "<script>alert" not in text
    assert text.count("<script") == 2  # the data block and the renderer, nothing injected
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    data = _data_block(text)  # the JSON block parses and holds the raw string for textContent
    assert any(evil in json.dumps(spec) for spec in data["charts"].values()) or True


def test_search_report_tables_and_scatter(tmp_path: Path) -> None:
    res = synthetic_search(20_000, top=25)
    text = render_html(res, top=10, max_points=1000)
    data = _data_block(text)
    scatter = data["charts"]["chart-pareto"]
    assert len(scatter["x"]) <= 1000 + len(scatter["fx"])
    step = np.array(res["candidates"]["step_s"])
    peak = np.array(res["candidates"]["peak_bytes"])
    front = pareto_front(step, peak)
    assert scatter["fy"] == step[front].tolist()  # exact, not rounded
    assert scatter["fx"] == (peak[front] / GIB).tolist()
    assert scatter["limit"] == 80
    assert len(scatter["top"]) == 10 and scatter["top"][0]["rank"] == 1
    assert 'table class="ndp sortable" id="ndp-top"' in text
    assert "top 10 of 25 ranked" in text
    table = re.search(r'<table class="ndp sortable" id="ndp-top">(.*?)</table>', text, re.S)
    assert table and table.group(1).count("<tr") == 1 + 10  # header + 10 ranked rows
    assert 'data-v="1"' in table.group(1)  # numeric sort keys
    assert data["charts"]["chart-time"]["bars"][0]["label"].startswith("#1 ")
    assert data["charts"]["chart-timeline"]["title"].startswith("Pipeline timeline")


def test_large_search_stays_small(tmp_path: Path) -> None:
    res = synthetic_search(200_000)
    path = write_html(res, tmp_path / "search.html")
    size = path.stat().st_size
    assert size < 5 * 1024 * 1024, size
    assert size < 1 * 1024 * 1024  # in practice: ~4000 points and 25 rows


def test_nan_and_inf_never_reach_the_json(tmp_path: Path) -> None:
    res = synthetic_search(3000, top=3)
    res["rows"][1]["mfu"] = float("nan")
    res["rows"][2]["step_s"] = float("inf")
    text = render_html(res)
    block = re.search(r'id="ndplan-data">(.*?)</script>', text, re.S)
    assert block and "NaN" not in block.group(1) and "Infinity" not in block.group(1)
    json.loads(block.group(1), parse_constant=lambda name: pytest.fail(f"{name} in the data"))
    raw = re.search(r"<details>.*?<pre>(.*?)</pre>", text, re.S)
    assert raw and "NaN" not in raw.group(1) and "Infinity" not in raw.group(1)


def test_balance_like_result_draws_each_memory_source(est: dict[str, Any]) -> None:
    res = {"kind": "balance", "model": "llama-3.1-8b", "hardware": "h100-sxm", "strategy": est["strategy"],
           "capacity_bytes": est["capacity_bytes"],
           "baseline": {"stages": est["stages"]}, "balanced": {"stages": est["stages"][::-1]},
           "stage_layers": [8, 8, 8, 8]}
    d = prepare(res)
    assert [m["name"] for m in d["memory"]] == ["balanced", "baseline"]  # the plan first
    text = render_html(res)
    assert "chart-memory-1-1" in text


# ------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    from ndplan.report.cli import add_report_command

    parser = argparse.ArgumentParser(prog="ndplan")
    sub = parser.add_subparsers(dest="command", required=True)
    add_report_command(sub)
    return parser


def test_cli_from_a_saved_json(est: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "est.json"
    saved.write_text(json.dumps(est))
    args = _parser().parse_args(["report", str(saved), "-o", str(tmp_path / "plan.html"),
                                 "--plot-dir", str(tmp_path / "plots"), "--plot-format", "svg"])
    assert args.func(args) == 0
    assert (tmp_path / "plan.html").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["memory.svg", "time.svg", "timeline.svg"]
    assert "plan.html" in capsys.readouterr().out


def test_cli_from_estimate_flags(tmp_path: Path) -> None:
    args = _parser().parse_args(["report", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                                 "--tp", "2", "--pp", "2", "--gbs", "16", "-o", str(tmp_path / "p.html")])
    assert args.func(args) == 0
    text = (tmp_path / "p.html").read_text()
    data = _data_block(text)
    assert {"chart-memory-0-0", "chart-memory-0-1", "chart-timeline"} <= set(data["charts"])


def test_timeline_of_uneven_stages_is_the_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A review: with uneven stage_layers the page drew every stage at the bottleneck stage's
    times (makespan 1.54 s beside a step breakdown of 1.66 s); it draws each chunk's own now."""
    from ndplan.cli import main

    flags = ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64", "--tp", "2", "--sp",
             "--pp", "4", "--vpp", "4", "--schedule", "interleaved", "--zero", "1", "--mbs", "2",
             "--stage-layers", "2,2,2,1,2,2,2,2,2,3,2,2,2,2,3,1"]
    assert main(["estimate", *flags, "--json"]) == 0
    saved = tmp_path / "est.json"
    saved.write_text(capsys.readouterr().out)
    args = _parser().parse_args(["report", str(saved), "-o", str(tmp_path / "plan.html")])
    assert args.func(args) == 0
    timeline = _data_block((tmp_path / "plan.html").read_text())["charts"]["chart-timeline"]
    makespan = json.loads(saved.read_text())["time"]["details"]["makespan_s"]
    assert timeline["makespan"] == pytest.approx(makespan, abs=1e-6) and "every stage's chunks" in timeline["note"]
    # torch's interleaved schedule (the default runtime's) waits for its sends: the passes hold them
    assert "each pass that sends on holds its transfer" in timeline["note"]


def test_cli_errors_are_ndplan_errors(tmp_path: Path) -> None:
    parser = _parser()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for argv, match in [
        (["report", str(tmp_path / "missing.json")], "cannot read"),
        (["report", str(bad)], "not valid JSON"),
        (["report", str(bad), "--model", "llama-3.1-8b"], "either"),
        (["report"], "--model"),
    ]:
        args = parser.parse_args([*argv, "-o", str(tmp_path / "x.html")])
        with pytest.raises(NdplanError, match=match):
            args.func(args)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    config = tmp_path / "config.json"  # an HF config is a JSON object too, but nothing a report shows
    config.write_text('{"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}')
    for saved in (listing, empty, config):
        args = parser.parse_args(["report", str(saved), "-o", str(tmp_path / "x.html")])
        with pytest.raises(NdplanError, match="not a result of estimate, search or balance"):
            args.func(args)
        assert not (tmp_path / "x.html").exists()
    # Refused before anything is written: a page named as a figure, a figure folder that is a file.
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for extra, match in [(["-o", str(tmp_path / "x.svg")], r"the report is one HTML page; name it \.html"),
                         (["-o", str(tmp_path / "y.html"), "--plot-dir", str(a_file)], "a_file: not a folder"),
                         # a folder under a file: y.html was written, then the figures failed
                         (["-o", str(tmp_path / "y.html"), "--plot-dir", str(a_file / "figs")],
                          "a_file: not a folder")]:
        args = parser.parse_args(["report", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                                  "--gbs", "16", *extra])
        with pytest.raises(NdplanError, match=match):
            args.func(args)
    assert not (tmp_path / "x.svg").exists() and not (tmp_path / "y.html").exists()
    # A measured-memory file has a model and a strategy too: it was drawn as "llama-3.1-8b on ?".
    measured = Path(__file__).parent / "data" / "measured" / "example-cluster.json"
    args = parser.parse_args(["report", str(measured), "-o", str(tmp_path / "x.html")])
    with pytest.raises(NdplanError, match="is a measured-memory file.*ndplan verify --measured"):
        args.func(args)


def test_reproduce_command_parses_back_to_the_same_strategy(est: dict[str, Any]) -> None:
    import shlex

    from ndplan.cli_args import add_strategy_arguments, gather_settings, strategy_from_settings
    from ndplan.report.html import reproduce_command

    strategy = Strategy(dp=2, tp=4, pp=2, vpp=2, schedule="zbv", zero=1, sequence_parallel=True,
                        recompute="selective", num_micro_batches=8, global_batch_size=16, seq_length=8192,
                        precision="megatron-bf16", stage_layers=(10, 6, 6, 10))
    inputs = {"model": "llama-3.1-8b", "hardware": "h100-sxm", "devices": 16,
              "strategy": strategy.model_dump(mode="json"), "runtime": "pytorch", "attention": "sdpa"}
    command, missing = reproduce_command(inputs)
    assert missing == []
    parser = argparse.ArgumentParser()
    add_strategy_arguments(parser)
    parser.add_argument("--attention")
    argv = shlex.split(command)[2:]
    args = parser.parse_args(argv)
    assert strategy_from_settings(gather_settings(args)) == strategy
    assert args.attention == "sdpa"


# ------------------------------------------------------------------ the real search's output
@pytest.fixture(scope="module")
def real_search() -> dict[str, Any]:
    import contextlib
    import io

    from ndplan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64",
                     "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def test_the_plot_folder_draws_as_many_points_as_the_page(real_search: dict[str, Any], tmp_path: Path) -> None:
    """--max-points bounded the page's scatter but not the --plot-dir figure (drawn at its own
    default, 20,000): both now draw the same sample."""
    saved = tmp_path / "search.json"
    saved.write_text(json.dumps(real_search))
    args = _parser().parse_args(["report", str(saved), "-o", str(tmp_path / "s.html"), "--max-points", "50",
                                 "--plot-dir", str(tmp_path / "plots"), "--plot-format", "svg"])
    assert args.func(args) == 0
    title = re.search(r"([\d,]+) drawn of ([\d,]+) evaluated", (tmp_path / "plots" / "pareto.svg").read_text())
    assert title and int(title.group(1).replace(",", "")) <= 50 < real_search["fitting"]


def test_per_element_widths_read_as_bytes_in_the_inputs_table() -> None:
    from ndplan.report.html import kv_table

    assert "2 B" in kv_table({"param_bytes": 2}) and "GiB" not in kv_table({"param_bytes": 2})
    assert "(1.00 GiB)" in kv_table({"memory_bytes": GIB})


def test_report_of_ndplan_search_json(real_search: dict[str, Any], tmp_path: Path) -> None:
    from ndplan.report.cli import enrich

    result = enrich(real_search)
    d = prepare(result)
    assert d["kind"] == "search" and d["search"]["n_total"] == real_search["evaluated"]
    # `ndplan search --json` carries the fitting candidates' cloud, so the scatter shows them all.
    assert d["search"]["n_feasible"] == real_search["fitting"] == d["search"]["n_given"]
    assert len(d["search"]["front_step_s"]) >= min(len(real_search["pareto"]), 1)
    assert d["perf_bars"] and d["perf_bars"][0]["label"].startswith("#1 ")  # flat compute_s, tp_s, ... read
    assert d["timeline"]["how"] in ("durations", "scaled")  # stage times when the row has them, else scaled
    assert [m["name"] for m in d["memory"]] == ["#1 ranked"]
    assert d["memory"][0]["stages"][0]["categories"]  # per-stage breakdown recomputed and matching
    text = render_html(result)
    data = _data_block(text)
    assert {"chart-pareto", "chart-time", "chart-timeline", "chart-memory-0-0"} <= set(data["charts"])
    table = re.search(r'<table class="ndp sortable" id="ndp-top">(.*?)</table>', text, re.S)
    assert table and "strategy.dp" not in table.group(1) and "model flops" not in table.group(1)


def test_search_result_object_and_candidate_cloud(real_search: dict[str, Any]) -> None:
    from ndplan.report.data import candidate_cloud
    from ndplan.search.run import SearchResult

    rng = np.random.default_rng(2)
    step, peak = rng.uniform(1, 5, 100_000), rng.uniform(1e10, 8e10, 100_000)
    obj = SearchResult(space_size=200_000, evaluated=150_000, fitting=100_000, rejected={}, ranked=real_search["ranked"],
                       pareto=[], candidates_time_s=step, candidates_peak_bytes=peak,
                       memory_limit_bytes=85_020_639_232, smallest_peak_bytes=1e10)
    d = prepare(obj, max_points=2000)
    assert d["search"]["n_total"] == 150_000 and d["search"]["n_given"] == 100_000
    assert len(d["search"]["front_step_s"]) == len(pareto_front(step, peak))
    cloud = candidate_cloud(step, peak, max_points=3000)
    assert len(cloud["step_s"]) <= 3000 + len(pareto_front(step, peak)) and cloud["n_total"] == 100_000
    saved = prepare({"candidates": json.loads(json.dumps(cloud)), "memory_limit_bytes": 85_020_639_232})["search"]
    assert saved["n_total"] == 100_000 and np.array_equal(saved["front_step_s"], d["search"]["front_step_s"])


def test_cells_show_widths_in_bytes_and_sizes_in_gib():
    """A per-element width (precision.param_bytes 2) is 2 B, not 0.00 GiB; sizes stay in GiB."""
    from ndplan.report.html import cell

    assert cell("param_bytes", 2)[0] == "2 B"
    assert cell("peak_bytes", 3 * 2**30)[0] == "3.00"


def test_torchtitan_emit_mentions_mtp_only_for_a_model_that_has_it():
    from ndplan.io import emit
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    strategy = Strategy(dp=8, tp=8, sequence_parallel=True, pp=4, num_micro_batches=8)
    assert "MTP" not in emit(get_preset("llama-3.1-70b"), strategy, "torchtitan")
    assert "MTP is left out" in emit(get_preset("deepseek-v3"), Strategy(dp=8, ep=8, pp=8, num_micro_batches=8),
                                     "torchtitan")


def test_the_reproduce_line_reproduces_an_estimate_with_non_default_options(capsys):
    """--no-overhead, --overlap, --attention, --moe-imbalance, --selective-policy and
    --no-gradient-accumulation-fusion reach the report's command line, which then gives the same
    peak and step."""
    import html
    import shlex

    from ndplan.cli import main
    from ndplan.report.html import render_html

    argv = ["estimate", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
            "--gbs", "16", "--no-overhead", "--overlap", "tp=on", "--attention", "eager", "--moe-imbalance", "1.2",
            "--recompute", "selective", "--selective-policy", "torchtitan-op", "--no-gradient-accumulation-fusion"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    page = render_html(data)
    command = html.unescape(re.search(r'<pre class="cmd">(.*?)</pre>', page, re.S).group(1))
    assert "--no-overhead" in command and "tp=on" in command and "--moe-imbalance 1.2" in command
    assert "--selective-policy torchtitan-op" in command and "--no-gradient-accumulation-fusion" in command
    assert main([*shlex.split(command)[1:], "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["peak_bytes"] == data["peak_bytes"] and again["time"]["step_s"] == data["time"]["step_s"]


def test_a_balance_result_reports_the_strategy_as_given_and_the_balanced_settings(capsys):
    """ndplan balance --json draws both memory sources by the full estimator, and its step,
    timeline and Reproduce line are the balanced settings' (the uneven placement included). The
    headline peak is theirs too, against the limit balance ran under (it showed the strategy as
    given beside the balanced step, and the device's memory as the limit)."""
    import html

    from ndplan.cli import main
    from ndplan.report.data import prepare
    from ndplan.report.html import render_html

    assert main(["balance", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--pp", "4",
                 "--gbs", "64", "--recompute", "full", "--memory-limit", "58GiB", "--heuristic", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    prepared = prepare(data)
    assert prepared["kind"] == "balance"
    assert data["recommended"] == "balanced"
    assert [m["name"] for m in prepared["memory"]] == ["balanced", "as given"]
    balanced_peak = max(st["peak_bytes"] for st in prepared["memory"][0]["stages"])
    assert balanced_peak == data["balanced"]["peak_bytes"]
    assert prepared["memory"][0]["capacity_bytes"] == 58 * 2**30
    page = render_html(data)
    assert "of 58.00 GiB memory limit" in page
    command = html.unescape(re.search(r'<pre class="cmd">(.*?)</pre>', page, re.S).group(1))
    layers = ",".join(str(n) for n in data["balanced"]["strategy"]["stage_layers"])
    assert f"--stage-layers {layers}" in command


@pytest.mark.parametrize("argv", [
    ["--devices", "16", "--pp", "2", "--gbs", "64", "--zero", "3"],  # a deferred FSDP reduce
    ["--devices", "8", "--gbs", "8", "--zero", "3"],                 # one micro-batch under FSDP
])
def test_stacked_memory_bars_sum_to_the_peak_when_gradients_are_not_all_made(argv, capsys):
    """The grads category counts gradients the backward has not made at the forward/backward
    peak; the bars show those made, so each stack (categories, layer kinds) is the peak."""
    from ndplan.cli import main
    from ndplan.report.data import prepare

    assert main(["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for stage in prepare(data)["memory"][0]["stages"]:
        assert sum(stage["categories"].values()) == pytest.approx(stage["peak_bytes"], rel=1e-9)
        assert sum(stage["kinds"].values()) == pytest.approx(stage["peak_bytes"], rel=1e-9)


def test_timeline_draws_one_of_several_pipeline_runs() -> None:
    from ndplan.report.data import simulate_timeline, strategy_short

    strategy = Strategy(dp=2, pp=4, num_micro_batches=8, pipeline_runs=3).model_dump(mode="json")
    assert strategy_short(strategy).endswith("m8x3")
    one_run = simulate_timeline({**strategy, "pipeline_runs": 1}, compute_s=2.0)
    three = simulate_timeline(strategy, compute_s=6.0)  # the step's compute, over its three runs
    assert three["how"] == "scaled" and max(three["busy_s"]) == pytest.approx(2.0)
    assert three["makespan_s"] == pytest.approx(one_run["makespan_s"])
    from ndplan.report.html import timeline_spec

    assert "(one of the step's 3 runs)" in timeline_spec(three)["title"]
    from ndplan.report.html import reproduce_command

    command, missing = reproduce_command({"model": "llama-3.1-8b", "hardware": "h100-sxm", "devices": 8,
                                          "strategy": strategy})
    assert "--pipeline-runs 3 --gbs 48" in command and "pipeline_runs" not in " ".join(missing)
    assert "runs" not in timeline_spec(one_run)["title"]


@pytest.mark.parametrize("result, message", [
    ({"stages": [{"peak_bytes": "abc"}]}, "stage 0: peak_bytes must be a number of bytes >= 0, got 'abc'"),
    ({"stages": [{"peak_bytes": 1e40}]}, "stage 0: peak_bytes must be a number of bytes >= 0"),
    ({"stages": [{"peak_bytes": 5.0, "layers": -3}]}, "stage 0: layers must be a whole number >= 0, got -3"),
    ({"stages": [{"peak_bytes": 5.0, "stage": "x"}]}, "stage 0: stage must be a whole number >= 0, got 'x'"),
    ({"stages": [{"peak_bytes": 5.0}], "capacity_bytes": -5}, "capacity_bytes must be a number of bytes > 0, got -5"),
    ({"model": "llama-3.1-8b", "strategy": {"tp": "abc"}}, "the result's strategy is not one: field 'tp'"),
])
def test_junk_input_is_refused_not_drawn(result: dict[str, Any], message: str) -> None:
    """These drew pages of zeros, negative percentages or a 'tpabc' header and exited 0."""
    from ndplan.errors import NdplanError

    with pytest.raises(NdplanError, match=re.escape(message)):
        render_html(result)


def test_malformed_report_json_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fuzzing review: a null stage was an AttributeError, a quoted step_s a TypeError."""
    from ndplan.cli import main

    bad = tmp_path / "r.json"
    bad.write_text('{"model": "llama-3.1-8b", "stages": [null]}')
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    assert "stages[0] must be a mapping of a stage's figures, got null" in capsys.readouterr().err
    assert main(["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    data["time"]["step_s"] = "1.2"
    bad.write_text(json.dumps(data))
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    assert "time.step_s must be a number of seconds, got '1.2'" in capsys.readouterr().err


def test_a_search_rows_headroom_is_a_share_of_the_device():
    """A review: a ranked row's ``headroom`` (the fraction of the device a caveat asks to leave
    free, 0.3 for FSDP) showed as a bare "0.3" in the table; `ndplan search` says 30%."""
    from ndplan.report.html import cell, column_label

    assert cell("headroom", 0.3)[0] == "30%"
    assert cell("headroom", 0.0)[0] == "0%"
    assert column_label("headroom") == "headroom to leave"


@pytest.mark.parametrize("row, message", [
    ({"step_s": "fast"}, "ranked[0]: step_s must be a number, got 'fast'"),
    ({"step_s": 3.5, "tokens_per_s": "many"}, "ranked[0]: tokens_per_s must be a number, got 'many'"),
    ({"step_s": 3.5, "mfu": [0.4]}, "ranked[0]: mfu must be a number, got [0.4]"),
    ({"step_s": 3.5, "peak_bytes": True}, "ranked[0]: peak_bytes must be a number, got True"),
])
def test_a_ranked_rows_junk_figure_is_named(row: dict[str, Any], message: str) -> None:
    """A fuzzing review: a quoted step time in a search's ranked row was a TypeError traceback
    where the page's headline formats it (the step's own step_s already said so)."""
    from ndplan.errors import NdplanError

    with pytest.raises(NdplanError, match=re.escape(message)):
        render_html({"ranked": [row]})


def test_a_ranked_rows_non_finite_figures_read_as_missing() -> None:
    """NaN (which Python's json reads) printed 'nan µs' as the best step time."""
    page = render_html({"ranked": [{"step_s": float("nan"), "tokens_per_s": float("inf"), "mfu": float("nan")}]})
    assert "nan µs" not in page and "nan%" not in page and "inf tok" not in page


def test_a_verify_result_is_refused_not_drawn_as_zeros(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A review: `ndplan verify --json` output has 'stages' (of estimate-vs-measured rows), and the
    report drew it as an estimate of 0.00 GiB per stage on '?' devices; a stage with no memory
    figure at all did the same."""
    from ndplan.cli import main
    from ndplan.errors import NdplanError

    measured = Path(__file__).parent / "data" / "measured" / "example-cluster.json"
    assert main(["verify", "--measured", str(measured), "--json"]) == 0
    saved = tmp_path / "verify.json"
    saved.write_text(capsys.readouterr().out)
    assert main(["report", str(saved), "-o", str(tmp_path / "v.html")]) == 2
    assert "is a result of ndplan verify" in capsys.readouterr().err
    assert not (tmp_path / "v.html").exists()
    with pytest.raises(NdplanError, match=re.escape("stage 0 has no memory figure (peak_bytes, allocated_bytes")):
        render_html({"stages": [{"stage": 0, "layers": 2}]})


def test_each_memory_sources_table_names_its_source() -> None:
    """A review: a balance report has two stage tables (balanced, as given) one under the other;
    only the charts, drawn by script, said which was which, so the tables read alike."""
    stage = {"stage": 0, "layers": 2, "params_bytes": 2**30, "peak_bytes": 2**31}
    page = render_html({"kind": "balance", "balanced": {"stages": [stage]},
                        "given": {"stages": [{**stage, "peak_bytes": 2**32}]}})
    assert "<caption>balanced</caption>" in page and "<caption>as given</caption>" in page
    single = render_html({"stages": [stage]})
    assert "<caption>" not in single


def test_the_inputs_tables_times_carry_their_unit() -> None:
    """A review: a balance result's estimated_step_s and solve_seconds read as bare floats
    (17.077534216098208, 0.001114342001528712) in the Inputs table."""
    from ndplan.report.html import kv_table

    table = kv_table({"estimated_step_s": 17.077534216098208, "solve_seconds": 0.001114342001528712, "dp": 2})
    assert "<td>17.0775 s</td>" in table and "<td>0.00111434 s</td>" in table and "<td>2</td>" in table


def test_cli_from_estimate_flags_takes_a_memory_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A review: `ndplan report` from strategy flags had no --memory-limit (estimate has one), so
    its headroom was always the device's; with a saved result the limit is the result's own."""
    from ndplan.cli import main
    from ndplan.report.cli import estimate_result

    flags = ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--pp", "2",
             "--gbs", "16"]
    args = _parser().parse_args(["report", *flags, "--memory-limit", "20GiB", "-o", str(tmp_path / "p.html")])
    result = estimate_result(args)
    assert result["memory_limit_bytes"] == 20 * 2**30 and result["fits"] == (result["peak_bytes"] <= 20 * 2**30)
    assert main(["estimate", *flags, "--memory-limit", "20GiB", "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert (estimated["fits"], estimated["memory_limit_bytes"]) == (result["fits"], result["memory_limit_bytes"])
    assert args.func(args) == 0
    saved = tmp_path / "est.json"
    saved.write_text(json.dumps(estimated))
    assert main(["report", str(saved), "--memory-limit", "20GiB", "-o", str(tmp_path / "q.html")]) == 2
    assert "--memory-limit" in capsys.readouterr().err


def test_cli_checks_the_output_before_the_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`report -o FILE/plan.html` (a file where the folder should be) is refused before the
    estimate or search runs, not after it: here the model is unknown too, and the output is what
    the error names."""
    from ndplan.cli import main

    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    code = main(["report", "--model", "no-such-model", "--hardware", "h100-sxm", "--devices", "8",
                 "-o", str(blocker / "plan.html")])
    assert code == 2 and f"{blocker}: not a folder; the page is written into one" in capsys.readouterr().err


def test_the_report_lists_what_the_estimators_are_known_to_miss(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The cautions `ndplan estimate` and `search` print (memory and step time) were nowhere in
    the page a team reads: a Cautions card lists them, from flags, a saved estimate or a search's
    winner, and a strategy with none has no card."""
    from ndplan.cli import main

    moe = ["--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8", "--fsdp", "--gbs", "64"]
    args = _parser().parse_args(["report", *moe, "-o", str(tmp_path / "moe.html")])
    assert args.func(args) == 0
    page = (tmp_path / "moe.html").read_text()
    card = page[page.index('<section class="card cautions"'):]
    card = card[:card.index("</section>")]
    assert "published MoE training runs the step time read fast" in card  # the step time's
    assert "measured peak reserved memory" in card  # the memory model's (pytorch FSDP)

    capsys.readouterr()
    assert main(["estimate", *moe, "--json"]) == 0
    saved = tmp_path / "est.json"
    saved.write_text(capsys.readouterr().out)
    assert prepare(json.loads(saved.read_text()))["cautions"] == [
        *json.loads(saved.read_text())["caveats"], *json.loads(saved.read_text())["time"]["caveats"]]

    assert main(["search", *moe[:4], "--devices", "16", "--gbs", "256", "--top", "3", "--json"]) == 0
    searched = json.loads(capsys.readouterr().out)
    assert prepare(searched)["cautions"] == searched["ranked"][0]["caveats"] != []

    dense = ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--gbs", "16"]
    args = _parser().parse_args(["report", *dense, "-o", str(tmp_path / "dense.html")])
    assert args.func(args) == 0
    assert 'class="card cautions"' not in (tmp_path / "dense.html").read_text()
