"""Regenerate docs/accuracy_time.md: predicted against measured step time of published runs.

    .venv/bin/python benchmarks/accuracy_time.py            # writes docs/accuracy_time.md
    .venv/bin/python benchmarks/accuracy_time.py --no-fit   # defaults only (fast)

Two predictions per run:
* defaults: the family's first-principles EfficiencyProfile (ndplan.perf.efficiency), untouched;
* fitted: per device family, a few global figures fitted ONCE by ndplan.perf.calibrate on a
  training half of the runs (within each source, runs sorted by id, every other one starting
  with the first), then applied to every run. Errors are reported separately for the held-out
  half, which the fit never saw.
Nothing is fitted per run. Errors are predicted/measured - 1; "rank" is Spearman's rho between
predicted and measured values within one source's table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks" / "accuracy"))

from h200_time import section as h200_section  # noqa: E402

from ndplan.perf.calibrate import MeasuredRun, calibrate, load_runs, measured_step_s, spearman  # noqa: E402
from ndplan.perf.efficiency import EfficiencyProfile, default_efficiency, device_family  # noqa: E402
from ndplan.perf.report import estimate_time  # noqa: E402

RUNS = ROOT / "benchmarks" / "published_runs.yaml"
OUT = ROOT / "docs" / "accuracy_time.md"

#: Figures fitted per family, in two stages: dense figures on the dense training runs, then the
#: MoE figures on the MoE training runs with the dense ones fixed (fitting them together lets
#: MoE effects leak into, e.g., the attention efficiency of dense runs).
FIT_PLAN: dict[str, dict[str, list[str]]] = {
    "ampere": {"dense": ["gemm_efficiency", "hbm_efficiency", "scaleup_efficiency"]},
    "hopper": {"dense": ["gemm_efficiency", "fp8_gemm_efficiency"], "moe": ["grouped_gemm_factor", "host_moe_layer_s"]},
    "blackwell": {"dense": ["fp8_gemm_efficiency"], "moe": ["grouped_gemm_factor", "host_moe_layer_s"]},
    "davinci-mesh": {"dense": ["gemm_efficiency", "scaleup_efficiency"]},
}
#: Pull of each fitted figure toward its documented default (see calibrate(prior_weight=...)).
PRIOR_WEIGHT = 0.2


def predict(run: MeasuredRun, profile: EfficiencyProfile) -> dict[str, float]:
    report = estimate_time(
        run.model_spec(), run.strategy_obj(), run.cluster(),
        efficiency=run.efficiency(profile), overlap=run.overlap_config(),
    )
    return {"step_s": report.step_s, "mfu": report.mfu, "tokens_per_s_per_device": report.tokens_per_s_per_device}


def split(runs: list[MeasuredRun]) -> tuple[set[str], set[str]]:
    """Within each source, by id: every other run (from the first) trains, the rest are held out."""
    by_source: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        by_source[r.source].append(r.id)
    train: set[str] = set()
    for ids in by_source.values():
        train.update(sorted(ids)[0::2])
    return train, {r.id for r in runs} - train


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.1%}"


def _rho(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def _abs_stats(errors: list[float]) -> tuple[float, float]:
    if not errors:
        return float("nan"), float("nan")
    a = [abs(e) for e in errors]
    return statistics.median(a), max(a)


def _short(run: MeasuredRun) -> str:
    s = run.strategy_obj()
    return s.short().replace(" ", "&nbsp;")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fit", action="store_true", help="skip the per-family fit (defaults only)")
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args()
    started = time.perf_counter()
    runs = load_runs(RUNS)
    measured = {r.id: measured_step_s(r) for r in runs}
    devices = {r.id: r.device_spec() for r in runs}
    default = {r.id: predict(r, default_efficiency(devices[r.id])) for r in runs}

    train, test = split(runs)
    fitted_profiles: dict[str, EfficiencyProfile] = {}
    fit_reports = {}
    if not args.no_fit:
        for family, stages in FIT_PLAN.items():
            family_train = [r for r in runs if r.id in train and device_family(devices[r.id]) == family]
            if not family_train:
                continue
            profile = default_efficiency(devices[family_train[0].id])
            for stage, figures in stages.items():
                # Runs measured on software its developers report as regressed teach the figures
                # the regression: priced and listed, not fitted (``calibrate`` drops them too).
                chosen = [r for r in family_train if r.model_spec().is_moe == (stage == "moe") and not r.known_regression]
                if not chosen:
                    continue
                profile, report = calibrate(
                    chosen, devices[chosen[0].id], fit=figures, initial=profile, prior_weight=PRIOR_WEIGHT
                )
                fit_reports[f"{family} ({stage})"] = report
            fitted_profiles[family] = profile
    fitted = {}
    for r in runs:
        family = device_family(devices[r.id])
        if family in fitted_profiles:
            fitted[r.id] = predict(r, fitted_profiles[family])

    lines = write_report(runs, measured, default, fitted, train, test, fitted_profiles, fit_reports)
    lines += ["", *memory_section(runs)]
    lines += ["", *h200_section()]
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.output} ({len(runs)} runs, {time.perf_counter() - started:.0f} s)")


def _source_rows(runs: list[MeasuredRun], measured: dict[str, float], pred: dict[str, dict[str, float]],
                 ids: set[str] | None = None) -> list[tuple[str, int, float, float, float, float, float]]:
    """Per source: (source, runs, median and worst |error|, Spearman's rho of step time and of
    tokens/s/device, and of step time over the runs not reported regressed)."""
    by_source: dict[str, list[MeasuredRun]] = defaultdict(list)
    for r in runs:
        if r.id in pred and (ids is None or r.id in ids):
            by_source[r.source].append(r)
    out = []
    for source, rs in by_source.items():
        errors = [pred[r.id]["step_s"] / measured[r.id] - 1 for r in rs]
        med, worst = _abs_stats(errors)
        rho_step = spearman([pred[r.id]["step_s"] for r in rs], [measured[r.id] for r in rs])
        measured_tps = [r.strategy_obj().global_batch_size * r.strategy_obj().seq_length / measured[r.id] / r.num_devices for r in rs]
        rho_tps = spearman([pred[r.id]["tokens_per_s_per_device"] for r in rs], measured_tps)
        sound = [r for r in rs if not r.known_regression]
        rho_sound = spearman([pred[r.id]["step_s"] for r in sound], [measured[r.id] for r in sound])
        out.append((source, len(rs), med, worst, rho_step, rho_tps, rho_sound))
    return out


def _split_label(run: MeasuredRun, train: set[str]) -> str:
    if run.id not in train:
        return "held-out"
    return "train (not fitted: regressed)" if run.known_regression else "train"


class _NotFitted(dict):  # type: ignore[type-arg]
    """Fitted figures by key, 'n/a' for one the fit did not make."""

    def __missing__(self, key: str) -> str:
        return "n/a"


def write_report(runs, measured, default, fitted, train, test, profiles, reports) -> list[str]:  # type: ignore[no-untyped-def]
    all_errors = [default[r.id]["step_s"] / measured[r.id] - 1 for r in runs]
    med, worst = _abs_stats(all_errors)
    within10 = sum(abs(e) <= 0.10 for e in all_errors)
    within25 = sum(abs(e) <= 0.25 for e in all_errors)
    regressed = [r for r in runs if r.known_regression]
    sound = [e for r, e in zip(runs, all_errors, strict=True) if not r.known_regression]
    sm, sw = _abs_stats(sound)
    lines = [
        "# Step-time accuracy against published runs",
        "",
        "Generated by `benchmarks/accuracy_time.py` from `benchmarks/published_runs.yaml`; do not edit by hand.",
        "",
        "Each run's measured throughput is turned into seconds per step with the FLOP formula its source",
        "used (or directly from step time / tokens per second), and compared with",
        "`ndplan.perf.estimate_time` (simulated pipeline). Error = predicted / measured - 1 (negative:",
        "ndplan predicts a faster step than was measured). Settings a source does not state are",
        "assumed once per table and listed in the run's notes; nothing is adjusted per run.",
        "",
        "## Summary",
        "",
        f"**Default profiles (no fitting), all {len(runs)} runs:** median |error| {med:.1%}, worst {worst:.1%}; "
        f"{within10} within 10%, {within25} within 25%.",
        "",
        f"Without the {len(regressed)} runs whose software their developers report as regressed "
        f"({', '.join(r.id for r in regressed)}; their sources below): {len(sound)} runs, median |error| {sm:.1%}, "
        f"worst {sw:.1%}; {sum(abs(e) <= 0.10 for e in sound)} within 10%, {sum(abs(e) <= 0.25 for e in sound)} "
        "within 25%. They stay in every other figure on this page.",
        "",
        "| source | runs | median abs err | worst abs err | rank corr. step time | rank corr. tokens/s/device "
        "| rank corr. step time, regressed runs left out |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for source, n, m, w, rs, rt, rsound in _source_rows(runs, measured, default):
        lines.append(f"| {source} | {n} | {m:.1%} | {w:.1%} | {_rho(rs)} | {_rho(rt)} | {_rho(rsound)} |")
    dense = [e for r, e in zip(runs, all_errors, strict=True) if not r.model_spec().is_moe]
    moe = [e for r, e in zip(runs, all_errors, strict=True) if r.model_spec().is_moe]
    dm, dw = _abs_stats(dense)
    mm, mw = _abs_stats(moe)
    lines += [
        "",
        f"By model kind (defaults): dense models ({len(dense)} runs) median |error| {dm:.1%}, worst {dw:.1%}; "
        f"mixture-of-experts models ({len(moe)} runs) median {mm:.1%}, worst {mw:.1%}.",
    ]
    if fitted:
        held = [fitted[r.id]["step_s"] / measured[r.id] - 1 for r in runs if r.id in test and r.id in fitted]
        tr = [fitted[r.id]["step_s"] / measured[r.id] - 1 for r in runs if r.id in train and r.id in fitted]
        held_sound = [fitted[r.id]["step_s"] / measured[r.id] - 1 for r in runs
                      if r.id in test and r.id in fitted and not r.known_regression]
        hm, hw = _abs_stats(held)
        tm, tw = _abs_stats(tr)
        hsm, hsw = _abs_stats(held_sound)
        lines += [
            "",
            f"**Fitted per device family on the training half ({len(tr)} runs; the regressed ones not fitted), "
            f"evaluated on the held-out half ({len(held)} runs):** held-out median |error| {hm:.1%}, worst {hw:.1%}; "
            f"without the regressed, {len(held_sound)} runs: median {hsm:.1%}, worst {hsw:.1%} "
            f"(training half: median {tm:.1%}, worst {tw:.1%}).",
            "",
            "| source | held-out runs | median abs err | worst abs err | rank corr. step time | rank corr. tokens/s/device |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for source, n, m, w, rs, rt, _ in _source_rows(runs, measured, fitted, test):
            lines.append(f"| {source} | {n} | {m:.1%} | {w:.1%} | {_rho(rs)} | {_rho(rt)} |")
        lines += [
            "",
            f"Fitted figures (bounded least squares on log step-time ratios, training half only, prior weight "
            f"{PRIOR_WEIGHT} toward the defaults; dense figures first, then MoE figures on MoE runs):",
            "",
        ]
        for family, report in reports.items():
            figures = ", ".join(f"`{k}` {report.initial[k]:.3g} → {v:.3g}" for k, v in report.fitted.items())
            lines.append(f"* {family} ({len(report.runs)} training runs): {figures}")
    lines += [
        "",
        "Rank correlation needs 3+ runs in a table (n/a otherwise). Step-time ranks mostly follow model size;",
        "tokens/s/device ranks are the stricter test of whether ndplan orders configurations correctly. The",
        "last column leaves out the runs reported regressed (a software regression is no configuration's",
        "cost); every other figure keeps them.",
        "",
        "## Every run",
        "",
        "| run | hardware | devices | strategy | measured step (s) | predicted, defaults (s) | error | predicted, fitted (s) | error | split |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        d = default[r.id]["step_s"]
        f = fitted.get(r.id, {}).get("step_s", float("nan"))
        lines.append(
            f"| {r.id} | {r.device_spec().name} | {r.num_devices} | {_short(r)} | {measured[r.id]:.3f} | {d:.3f} | "
            f"{_pct(d / measured[r.id] - 1)} | {'n/a' if math.isnan(f) else f'{f:.3f}'} | {_pct(f / measured[r.id] - 1)} | "
            f"{_split_label(r, train)} |"
        )
    lines += ["", *_batch_pairs_section(runs, measured, default)]
    lines += ["", "## Sources and assumptions", ""]
    seen = set()
    for r in runs:
        if r.source not in seen:
            seen.add(r.source)
            lines.append(f"* **{r.source}**: {r.url}")
        if r.notes:
            lines.append(f"  * {r.id}: {r.notes}")
        if r.known_regression:
            lines.append(f"  * {r.id}, reported regressed: {r.known_regression}")
    # The commentary's per-row figures come from this run's predictions, so they cannot go stale.
    errors = {r.id: _pct(default[r.id]["step_s"] / measured[r.id] - 1) for r in runs}
    seconds = {r.id: f"{default[r.id]['step_s']:.1f} s" for r in runs}
    per_device = {r.id: f"{default[r.id]['tokens_per_s_per_device']:,.0f}" for r in runs}
    variants = _variant_errors({r.id: r for r in runs}, measured)
    imbalance = _imbalance({r.id: r for r in runs}, measured)
    # (n/a where --no-fit skipped the fit)
    fitted_errors = _NotFitted({r.id: _pct(fitted[r.id]["step_s"] / measured[r.id] - 1) for r in runs if r.id in fitted})
    fitted_figures = _NotFitted({f"{family}.{name}": f"{value:.2f}" for family, report in reports.items()
                                 for name, value in report.fitted.items()})
    lines += ["", "## What the errors say", ""] + [line.format(e=errors, s=seconds, t=per_device, v=variants, i=imbalance,
                                                               f=fitted_errors, g=fitted_figures)
                                                    for line in COMMENTARY]
    return lines


def batch_pairs(runs: list[MeasuredRun]) -> list[tuple[MeasuredRun, MeasuredRun]]:
    """Runs of one model on one cluster with the same strategy, overlap and software statements
    but for the micro-batches a step runs, in pairs (fewer micro-batches first): what the one
    does more than the other is those micro-batches alone."""
    by_setup: dict[str, list[MeasuredRun]] = defaultdict(list)
    for run in runs:
        strategy = run.strategy_obj().model_dump()
        for batch in ("num_micro_batches", "pipeline_runs", "global_batch_size"):
            strategy.pop(batch)
        setup = repr((run.model, run.device, run.num_devices, run.devices_per_node, run.runtime, run.loss_parallel,
                      sorted(strategy.items()), run.overlap, sorted(run.software.items())))
        by_setup[setup].append(run)
    pairs = []
    for group in by_setup.values():
        group.sort(key=_micro_batches_per_step)
        pairs += [(a, b) for a, b in zip(group, group[1:], strict=False)
                  if _micro_batches_per_step(a) < _micro_batches_per_step(b)]
    return pairs


def _micro_batches_per_step(run: MeasuredRun) -> int:
    return run.strategy_obj().micro_batches_per_step


def _batch_pairs_section(runs: list[MeasuredRun], measured: dict[str, float],
                         pred: dict[str, dict[str, float]]) -> list[str]:
    """Each pair of ``batch_pairs``: the measured and predicted seconds of one micro-batch more
    (the difference of the two steps over that of their micro-batches) and of the rest of a
    step (the smaller run's step less its micro-batches at that rate); and what a fixed cost per
    step fitted to the pair (``step_overhead_s``) leaves of its errors."""
    pairs = batch_pairs(runs)
    if not pairs:
        return []
    lines = [
        "## Per micro-batch and per step: runs that differ only in their batch",
        "",
        "Where a source measured one setup at two global batches (the same model, cluster, strategy and",
        "software statements; only the micro-batches a step runs differ), the difference of the two",
        "steps over the difference of their micro-batches is what one micro-batch costs, pipeline",
        "fill and drain, DP traffic after the pipeline, the optimizer and any other per-step cost",
        "cancelled; the rest of a step is the smaller run's step less its micro-batches at that rate.",
        "The same split of ndplan's predictions says whether its error lies in the micro-batches or in",
        "the step around them."
        + (" (Each pair here spans two of its source's tables, two releases of its software: the split"
           " assumes a micro-batch ran at one speed in both.)" if all(a.source != b.source for a, b in pairs) else ""),
        "",
        "| runs | micro-batches | measured per micro-batch (ms) | predicted (ms) | error | measured rest of step (s) "
        "| predicted (s) | fitted `step_overhead_s` (s) | errors before | errors after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    found = []
    for small, large in pairs:
        extra = _micro_batches_per_step(large) - _micro_batches_per_step(small)
        count = _micro_batches_per_step(small)
        each = {name: (steps[large.id] - steps[small.id]) / extra
                for name, steps in (("measured", measured), ("predicted", {k: v["step_s"] for k, v in pred.items()}))}
        rest = {"measured": measured[small.id] - count * each["measured"],
                "predicted": pred[small.id]["step_s"] - count * each["predicted"]}
        # The rest of a step as one fitted figure, from the defaults: ``ndplan calibrate`` on the pair.
        device = small.device_spec()
        profile, _ = calibrate([small, large], device, fit=["step_overhead_s"], initial=default_efficiency(device))
        before = [pred[run.id]["step_s"] / measured[run.id] - 1 for run in (small, large)]
        after = [predict(run, profile)["step_s"] / measured[run.id] - 1 for run in (small, large)]
        found.append({"small": small, "each_error": each["predicted"] / each["measured"] - 1, "rest": rest,
                      "overhead": profile.step_overhead_s, "before": before, "after": after})
        lines.append(
            f"| {small.id}, {large.id} | {count} → {_micro_batches_per_step(large)} | {each['measured'] * 1e3:.1f} | "
            f"{each['predicted'] * 1e3:.1f} | {_pct(found[-1]['each_error'])} | {rest['measured']:.2f} | "
            f"{rest['predicted']:.2f} | {profile.step_overhead_s:.2f} | {_pct(before[0])}, {_pct(before[1])} | "
            f"{_pct(after[0])}, {_pct(after[1])} |"
        )
    closest = min(abs(f["each_error"]) for f in found)
    farthest = max(abs(f["each_error"]) for f in found)
    gap = max(found, key=lambda f: f["rest"]["measured"] - f["rest"]["predicted"])
    miss = max(found, key=lambda f: abs(f["each_error"]))
    # The other reading of the largest gap: the step around the micro-batches as priced in both
    # runs, and the later one's micro-batches that much faster than the earlier one's.
    small, large = next((a, b) for a, b in pairs if a is gap["small"])
    rate = [(measured[run.id] - gap["rest"]["predicted"]) / _micro_batches_per_step(run) for run in (small, large)]
    others = {a.device_spec().name for a, _ in pairs if a is not small}
    lines += [
        "",
        f"ndplan's seconds per micro-batch are {closest:.1%} to {farthest:.1%} off these measurements. The",
        f"largest gap around the micro-batches is {gap['small'].id}'s: {gap['rest']['measured']:.2f} s a step "
        f"measured besides them, {gap['rest']['predicted']:.2f} s priced (pipeline fill and drain, DP traffic",
        f"after the pipeline, the optimizer), while its micro-batches read {_pct(gap['each_error'])}. A fixed cost "
        f"per step (`step_overhead_s`, which `ndplan calibrate` fits beside the other figures) of {gap['overhead']:.2f} s",
        f"takes the pair from {_pct(gap['before'][0])} and {_pct(gap['before'][1])} to {_pct(gap['after'][0])} and "
        f"{_pct(gap['after'][1])}: what ndplan misses there is paid once a step, and it does not know what. The",
        f"other reading, a step around the micro-batches as priced in both runs, has {large.id}'s micro-batches",
        f"{1 - rate[1] / rate[0]:.0%} faster than {small.id}'s, a change of release that the other pairs, "
        f"each one setup across two releases (on {', '.join(sorted(others))}), do not show.",
        f"Where the micro-batches themselves are off ({miss['small'].id}'s read {_pct(miss['each_error'])}), a "
        f"fixed cost cannot follow: fitted anyway ({miss['overhead']:.2f} s), it leaves {_pct(miss['after'][0])} "
        f"and {_pct(miss['after'][1])}.",
    ]
    return lines


#: Megatron-MoE-ModelZoo's long-context rows, each measured dropless and with forced balance.
LONG_CONTEXT = ("16k", "32k", "64k", "128k")
#: The same source's seq-4096 table, dropless too: where the long rows' factor is carried.
MODELZOO_4K = ("modelzoo-qwen3-235b-deepep-ep32", "modelzoo-qwen3-235b-deepep-ep32-a2a-overlap",
               "modelzoo-qwen3-235b-fsdp-ep8", "modelzoo-qwen3-235b-a2a-pp32", "modelzoo-qwen3-235b-deepep-tp4")


def _imbalance(runs: dict[str, MeasuredRun], measured: dict[str, float]) -> dict[str, str]:
    """Per long-context length, the ``moe_imbalance`` at which ndplan's dropless prediction is the
    forced-balance prediction times the measured dropless/forced ratio (bisection); their mean,
    and the errors of the 4K table's rows priced at that mean (defaults otherwise)."""

    def step(run: MeasuredRun, factor: float) -> float:
        # (a run that states its routing, a forced-balance one, keeps its own factor)
        return predict(run, default_efficiency(run.device_spec()).replace(moe_imbalance=factor))["step_s"]

    out: dict[str, str] = {}
    factors = []
    for length in LONG_CONTEXT:
        real, forced = runs[f"modelzoo-qwen3-235b-long-{length}"], runs[f"modelzoo-qwen3-235b-long-{length}-forced-balance"]
        target = step(forced, 1.0) * measured[real.id] / measured[forced.id]
        low, high = 1.0, 4.0
        for _ in range(24):
            middle = (low + high) / 2
            low, high = (middle, high) if step(real, middle) < target else (low, middle)
        factors.append((low + high) / 2)
        out[length] = f"{factors[-1]:.2f}"
    mean = statistics.fmean(factors)
    out["mean"] = f"{mean:.2f}"
    for run_id in MODELZOO_4K:
        out[run_id] = _pct(step(runs[run_id], mean) / measured[run_id] - 1)
    return out


def _variant_errors(runs: dict[str, MeasuredRun], measured: dict[str, float]) -> dict[str, str]:
    """Errors of a run priced with a setting changed, which the commentary compares (defaults)."""
    changes: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # (run, strategy change, run change)
        "deepseek-h100-even": ("bridge2509-h100-deepseek-v3", {"stage_layers": None}, {}),
        "deepseek-h100-even-no-recompute": ("bridge2509-h100-deepseek-v3",
                                            {"stage_layers": None, "recompute": "none", "recompute_modules": ()}, {}),
        "modelzoo-fsdp-fp32-grads": ("modelzoo-qwen3-235b-fsdp-ep8", {"precision": "megatron-bf16"}, {}),
        "modelzoo-fsdp-kept-params": ("modelzoo-qwen3-235b-fsdp-ep8",
                                      {"precision": "megatron-bf16", "reshard_after_forward": False}, {}),
        "qwen3-235b-h100-a2a-exposed": ("bridge2511-h100-qwen3-235b-a22b", {}, {"overlap": {"tp": True, "ep": False}}),
        # MindSpeed's TP 8 rows with MC2 priced as no overlap at all (the other bound).
        **{f"{run_id}-tp-exposed": (run_id, {}, {"overlap": {"tp": False}})
           for run_id in ("mindspeed-llama3-8b-8k-8npu", "mindspeed-llama2-70b-32npu", "mindspeed-llama31-70b-8k-32npu",
                          "mindspeed-qwen2-72b-32npu")},
    }
    out = {}
    for name, (run_id, change, run_change) in changes.items():
        run = runs[run_id]
        varied = run.model_copy(update={"strategy": {**run.strategy, **change}, **run_change})
        step = predict(varied, default_efficiency(varied.device_spec()))["step_s"]
        out[name] = _pct(step / measured[run_id] - 1)
        out[f"{name}-s"] = f"{step:.1f} s"
    return out


def memory_section(runs: list[MeasuredRun]) -> list[str]:
    """Every published run ran, so it fitted in its devices' memory: the estimate of its
    largest stage must not exceed the device's memory. A one-sided check (a run may have
    fitted with room to spare), but the one a search depends on: a strategy priced over the
    limit is never recommended."""
    rows = [(r, r.fullest_stage(), r.device_spec().memory_bytes) for r in runs]
    over = [(r, w, cap) for r, w, cap in rows if w.peak_bytes > cap]
    gib = 2.0**30
    lines = [
        "## Memory: do the published runs fit?",
        "",
        "Each run above ran, so each fitted in its devices' memory. ndplan's estimate of the run's",
        "fullest stage (`ndplan.memory.estimate`, the run's framework's runtime profile, overhead",
        "included) should therefore not exceed the device's memory. It is a one-sided check: a run may",
        "have fitted with room to spare, so a low estimate passes it. It is the check a search needs:",
        "a strategy estimated over the limit is never recommended.",
        "",
        f"**{len(rows) - len(over)} of {len(rows)} runs are estimated to fit**; "
        f"{len(over)} are estimated over their devices' memory:",
        "",
        "| run | runtime profile | device memory (GiB) | estimated peak (GiB) | over by | fullest stage: activations, static (GiB) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r, w, cap in over:
        static = w.params_bytes + w.grads_bytes + w.optimizer_bytes
        lines.append(f"| {r.id} | {r.runtime} | {cap / gib:.1f} | {w.peak_bytes / gib:.1f} | "
                     f"{w.peak_bytes / cap - 1:+.1%} | stage {w.stage}: {w.activations_bytes / gib:.1f}, "
                     f"{static / gib:.1f} |")
    # The commentary's figures come from this run's estimates, so they cannot go stale.
    over_by = {r.id: f"{w.peak_bytes / cap - 1:+.1%}" for r, w, cap in rows}
    lines += [""] + [line.format(m=over_by) for line in MEMORY_COMMENTARY] + [
        "",
        "<details><summary>Every run's estimated peak</summary>",
        "",
        "| run | runtime profile | device memory (GiB) | estimated peak (GiB) | share of memory |",
        "|---|---|---:|---:|---:|",
    ]
    for r, w, cap in rows:
        lines.append(f"| {r.id} | {r.runtime} | {cap / gib:.1f} | {w.peak_bytes / gib:.1f} | {w.peak_bytes / cap:.0%} |")
    lines += ["", "</details>"]
    reported = [(r, w) for r, w, _ in rows if r.reserved_gib is not None]
    if reported:
        lines += [
            "",
            "### Where a source measured the memory",
            "",
            "Two-sided, where a source reports the peak memory of its runs: the caching allocator's peak",
            "reserved bytes (torch.cuda's `reserved_bytes.all.peak`, the most of any rank), against ndplan's",
            "`reserved` of the fullest stage (allocated plus the allocator's slack; the CUDA context and",
            "communicator buffers, outside the allocator, left out).",
            "",
            "The last two columns: the same step on fake tensors (`ndplan measure`, where it can run the",
            "run's step: no TP, PP or CP), its allocations replayed through PyTorch's caching allocator",
            "(`ndplan.census.allocator`; benchmarks/accuracy/torchtitan_replay.py, kept in",
            "tests/data/measured/torchtitan).",
            "",
            "| run | measured reserved (GiB) | estimated reserved (GiB) | error | estimated allocated (GiB) "
            "| replayed reserved (GiB) | error |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        replays = _torchtitan_replays()
        for r, w in reported:
            measured_gib = float(r.reserved_gib or 0.0)
            replayed = replays.get(r.id)
            lines.append(f"| {r.id} | {measured_gib:.1f} | {w.reserved_bytes / gib:.1f} | "
                         f"{w.reserved_bytes / gib / measured_gib - 1:+.1%} | {w.allocated_bytes / gib:.1f} | "
                         + ("- | - |" if replayed is None else
                            f"{replayed / gib:.1f} | {replayed / gib / measured_gib - 1:+.1%} |"))
        every = {r.id: w.reserved_bytes / gib / float(r.reserved_gib or 1.0) - 1 for r, w in reported}
        errors = {key: f"{value:+.1%}" for key, value in every.items()}
        # The December 2024 page's figures (the June 2025 H200 page's are said apart).
        ratios = {r.id: every[r.id] for r, _ in reported if r.source.startswith("torchtitan-2024")}
        errors |= {f"replayed {r.id}": f"{replays[r.id] / gib / float(r.reserved_gib or 1.0) - 1:+.1%}"
                   for r, _ in reported if r.id in replays}
        from ndplan.census.measurement import load_measurement

        eight = "torchtitan-8b-fsdp-8gpu"
        fake = load_measurement(ROOT / "tests" / "data" / "measured" / "torchtitan" / f"{eight}-fake.json")
        errors["fake allocated"] = f"{fake.ranks[0].allocated_bytes / gib:.1f}"
        errors["estimated allocated"] = next(f"{w.allocated_bytes / gib:.1f}" for r, w in reported if r.id == eight)
        # The fake steps of the 70B and 405B rows against the estimate of the same (bf16) step,
        # on the fullest measured stage.
        from ndplan.census.verify import verify
        from ndplan.model import load_model

        for key, run_id in (("70b", "torchtitan-70b-2d"), ("405b", "torchtitan-405b-3d-1f1b")):
            fake = load_measurement(ROOT / "tests" / "data" / "measured" / "torchtitan" / f"{run_id}-fake.json")
            rows = [s.row("allocated") for s in verify(load_model(fake.model), fake).compared]
            fullest = max((row for row in rows if row is not None), key=lambda row: row.measured or 0)
            errors[f"fake allocated {key}"] = f"{(fullest.measured or 0) / gib:.1f}"
            errors[f"estimated allocated {key}"] = f"{fullest.estimate / gib:.1f}"
        errors["most ratio"] = f"{1 / (1 + min(ratios.values())):.2f}"
        errors |= {"count": str(len(ratios)), "least": f"{max(ratios.values()):+.1%}",
                   "most": f"{min(ratios.values()):+.1%}", "median": f"{statistics.median(ratios.values()):+.1%}"}
        for prefix in ("torchtitan-8b-cp", "torchtitan-405b"):  # a table's range: "-x% to -y%"
            group = sorted((v for k, v in ratios.items() if k.startswith(prefix)), reverse=True)
            errors[prefix] = f"{group[0]:+.1%} to {group[-1]:+.1%}" if group else "n/a"
        lines += [""] + [line.format(r=errors) for line in MEASURED_MEMORY_COMMENTARY]
    return lines


def _torchtitan_replays() -> dict[str, float]:
    """Run id -> the replayed reserved bytes of its fake step (benchmarks/accuracy/torchtitan_replay.py)."""
    from ndplan.census.measurement import load_measurement

    out = {}
    for path in sorted((ROOT / "tests" / "data" / "measured" / "torchtitan").glob("*-fake.json")):
        # (the most of any measured rank, as the page reports its runs)
        replayed = max((r.replayed_reserved_bytes or 0 for r in load_measurement(path).ranks), default=0) or None
        if replayed is not None:
            out[path.name.removesuffix("-fake.json")] = float(replayed)
    return out


MEASURED_MEMORY_COMMENTARY = [
    "torchtitan's benchmark page (Grand Teton H100, 96 GB) gives each run's memory, and ndplan reads",
    "every one of its {r[count]} rows low, from {r[least]} to {r[most]} (median {r[median]}): the eager 8B rows under FSDP",
    "with the per-op checkpointing {r[torchtitan-8b-fsdp-8gpu]} and {r[torchtitan-8b-fsdp-128gpu]}, the 8B at 32K-256K tokens "
    "{r[torchtitan-8b-cp]}, the 70B",
    "over FSDP and TP {r[torchtitan-70b-2d]}, the 405B over FSDP, TP and PP {r[torchtitan-405b]}. "
    "The compiled 8B rows read",
    "{r[torchtitan-8b-fsdp-compile-8gpu]} and {r[torchtitan-8b-fsdp-compile-128gpu]}, as the eager ones do, since the forty-ninth session priced compiled layers as they keep",
    "(torch.compile's partitioner keeps a norm's bf16 input and statistic, not eager's fp32 copies, and",
    "rebuilds the MLP's activation: measured on compiled layers, tests/data/measured/compiled; 4 GiB",
    "less here, where the page measured about 5 GiB between its eager and compiled rows; they read",
    "-8.2% and -3.8% against eager modules before). The layers'",
    "own bytes are measured (the census, for the per-op policy too), and a fake step of the 8B rows",
    "allocates what the estimate does ({r[fake allocated]} against {r[estimated allocated]} GiB at 8 GPUs), "
    "so what is missing lies",
    "around them. It is the caching allocator's segments: replaying the fake step's allocations",
    "through the allocator, FSDP2's all-gather and reduce-scatter streams in pools of their own, reads",
    "the eager rows {r[replayed torchtitan-8b-fsdp-8gpu]} and {r[replayed torchtitan-8b-fsdp-128gpu]}, "
    "where the estimate's fixed 5% slack reads {r[torchtitan-8b-fsdp-8gpu]} and {r[torchtitan-8b-fsdp-128gpu]}. "
    "The rows it",
    "stands in for with eager bf16 modules read: the compiled rows {r[replayed torchtitan-8b-fsdp-compile-8gpu]} and "
    "{r[replayed torchtitan-8b-fsdp-compile-128gpu]} (compiled",
    "layers keep fewer tensors than the eager step replayed), the 32K-token row {r[replayed torchtitan-8b-cp1-32k]} "
    "(compiled, and",
    "with Float8 all-gathers, as its entry assumes, of half the bytes of the bf16 step's), and the 70B",
    "over FSDP and TP {r[replayed torchtitan-70b-2d]} (sequence and loss parallelism as torchtitan runs them; "
    "its fake step allocates {r[fake allocated 70b]} GiB,",
    "the estimate of the same bf16 step {r[estimated allocated 70b]}). The 405B over FSDP, TP and PP",
    "{r[replayed torchtitan-405b-3d-1f1b]}: its fake step found what the estimate left out, the whole [vocab, h] embedding",
    "gradient FSDP accumulates for the pipeline's deferred reduce under TP (7.8 GiB in fp32 on the first",
    "stage), and what the loss's moments hold beside them (every unit of a stage never resharded after",
    "forward stays gathered there), both now priced: it allocates {r[fake allocated 405b]} GiB on its",
    "fullest stage, the estimate of that step {r[estimated allocated 405b]}. The context-parallel rows stay",
    "unreplayed (for the 4D runs also what Float8,",
    "torch.compile and AsyncTP's symmetric-memory buffers hold). Their estimates read flat across CP",
    "degrees until the forty-third session, while the measured peaks grow with them: torch's ring",
    "holds, while a layer's backward runs, the keys and values all-gathered from all its ranks at the",
    "query heads' width and fp32 gradient buffers (`buffers._cp_buffers`, read in its",
    "_attention.py), where the model had kept Transformer Engine's two K,V blocks: the 405B at CP 2-8",
    "from -3.8%, -5.3%, -14.0% to the table's figures, the 8B from -15% to -8.0% .. -4.6%.",
    "ndplan's estimate of a torchtitan run at this scale is therefore not a safe upper bound (the",
    "measured peak is up to {r[most ratio]}x the estimate): leave 30% of the device free, or measure one step",
    "on fake tensors (`ndplan verify`, on a CPU), whose replayed reserved peak counts the",
    "fragmentation. Four rows read high before this",
    "comparison existed, each error hiding another: the 8B rows priced torchtitan's per-op",
    "checkpointing as keeping every matmul's output (+10%, +19%), and the 405B rows replicated the",
    "logits over TP where torchtitan shards them (+18%, +33%).",
    "",
    "A second torchtitan page (llama3_8b_h200_2025-06, June 2025: Llama 3.1 8B under FSDP over 32 and",
    "64 H200s, compiled blocks and loss, Float8; added in the forty-eighth session) reads as December's:",
    "{r[torchtitan-8b-h200-fsdp-32gpu]} and {r[torchtitan-8b-h200-fsdp-64gpu]} (its step times land within "
    "3%, above). It read 27-28% over until the forty-ninth session: its stack holds far less than",
    "December's (48 GiB at FSDP 32 where December's comparable Float8 run held 61.8 GiB at FSDP 128,",
    "whose sharding leaves less on a GPU), and the estimate priced eager modules and an eager loss.",
    "Its --training.compile compiled the blocks and the loss: compiled layers keep a smaller set",
    "(measured, docs/memory.md), and the compiled loss keeps the bf16 logits where the eager one keeps",
    "an fp32 log-softmax, and its backward is one kernel writing the bf16 gradient where eager's",
    "holds two fp32 copies of the logits (8 bytes a logit: 15.7 GiB of the estimate at 16K tokens and",
    "128K words; read in Inductor's code for the compiled loss). Priced so, it reads low by what",
    "December's rows do.",
]


MEMORY_COMMENTARY = [
    "When this check was added, 21 of the 64 runs were estimated over their devices' memory. It found",
    "settings the entries left out and four things the memory model priced wrong, each taken from",
    "the frameworks' code or recipes, not fitted to these rows:",
    "",
    "* NVIDIA's performance recipes (every Megatron-Bridge model's `..._llm_pretrain.py`) set",
    "  `grad_reduce_in_fp32 = False`: bf16 main gradients (precision `megatron-fp8-grad16`), half the",
    "  gradient buffer. DeepSeek-V3's recipes also recompute `mla_up_proj` (and `mlp` on H100) and lay",
    "  the H100 pipeline out as `Et|(tt|)*30mL`; the entries now say so.",
    "* Transformer Engine's fp8 linears keep the quantised copy of their input for the weight",
    "  gradient, 1 byte an element, not the bf16 input (the Megatron profile's `fp8_bytes`).",
    "* Megatron-Core (0.13 on) weights the experts' activation by the routing probabilities",
    "  (`weighted_bias_swiglu`) and un-permutes without them, so the un-permute keeps no copy of the",
    "  experts' output (k x h per token, the largest MoE tensor the profile had).",
    "* NeMo AutoModel's benchmark configs compute the loss on the bf16 logits",
    "  (`MaskedCrossEntropy(fp32_upcast: false)`), which ndplan priced as an fp32 upcast: now the",
    "  `loss_upcast` option (`--no-loss-upcast`; Megatron's `--cross-entropy-fusion-impl te` too).",
    "  AutoModel's Qwen3-30B went from +4.1% to {m[automodel-qwen3-30b-a3b-8gpu]}.",
    "* NeMo 24.07's table does not state the gradients' dtype, and its rows were priced with fp32",
    "  gradients (GPT-3 20B +5.2%, GPT-3 175B on 512 GPUs +6.2% and Llama 3 8B +0.7% over). The",
    "  NeMo-Framework-Launcher H100 FP8 example scripts behind such tables add",
    "  `+training.model.optim.grad_sync_dtype=bf16`, and both optimizers NeMo ran keep the gradients",
    "  in that dtype (Apex's distributed Adam allocates its whole gradient buffer in it; NeMo's",
    "  Megatron-Core optimizer reduces in fp32 only when it is fp32). Priced so (`megatron-fp8-grad16`)",
    "  the three read {m[nemo2407-gpt3-20b]}, {m[nemo2407-gpt3-175b-512]} and {m[nemo2407-llama3-8b]} against",
    "  their memory; the step times above use the same precision (a halved gradient reduce-scatter).",
    "* Megatron-LM's own functional tests, whose measured peaks the Megatron profile now meets within",
    "  2% on 16 of 18 dense cases (docs/accuracy_megatron.md), showed that Megatron's cross-entropy turns its",
    "  fp32 copy of the logits into the kept softmax in place, where the profile had counted a second",
    "  fp32 copy around the loss: Megatron-Bridge's Qwen3-30B-A3B on H100, whose last stage holds the",
    "  output head beside 47 micro-batch chunks, went from +1.0% to +0.8%; priced with the loss",
    "  Megatron-Bridge's performance recipes ran, Transformer Engine's fused cross-entropy on the bf16",
    "  logits (`cross_entropy_fusion_impl te`, Bridge PR #595; `loss_upcast: false`, the forty-second",
    "  session), it reads {m[bridge2511-h100-qwen3-30b-a3b]}.",
    "* Megatron-Bridge's Llama 3 70B on GB300 and GB200 (added in the fiftieth session, blind): its",
    "  presets offload the activations of 20 (GB300) and 40 (GB200) of its 80 layers to host memory",
    "  (`cpu_offloading_num_layers`), +16.3% and +74.6% over the device while ndplan did not price it;",
    "  priced since the fifty-first session (`offload_layers`: every tensor those layers save moves,",
    "  all but the last of them off the device at the backward's start, `memory.layer_offload`) they",
    "  read {m[bridge2511-gb300-llama3-70b]} and {m[bridge2511-gb200-llama3-70b]}. The same table's "
    "405B rows read {m[bridge2511-gb300-llama31-405b]} and {m[bridge2511-gb200-llama31-405b]}: they were",
    "  8.0% and 4.2% over the device until the FP8 recipe's weights kept in fp8 (`fp8_param_gather`,",
    "  which Bridge's FP8 current-scaling recipe sets) were priced as such, a 1-byte weight and its",
    "  transposed copy where a 2-byte weight sat beside two fp8 copies (precision",
    "  `megatron-fp8-param-grad16`, the fiftieth session; every FP8-CS row of the table now runs it).",
    "* Megatron-Core's DeepSeek-V3 on GB200 in MXFP8 moves its optimizer states and master weights to host",
    "  memory between updates (`--offload-optimizer-states`, its launch command): +1.2% over the device while",
    "  ndplan kept them there, it reads {m[mcore-moe-deepseek-v3-gb200-mxfp8]} since the fifty-second session",
    "  priced them off the device through the forward and backward (`offload_optimizer_states`,",
    "  Megatron-Core's OptimizerStateOffloader); its bf16 Adam moments, which the paper states, are priced.",
    "  The same model's GB200 BF16 run ({m[mcore-moe-deepseek-v3-gb200-bf16]}) fits, with a layout no source",
    "  gives (assumed).",
    "* NeMo AutoModel's GPT-OSS rows read +26.8% and +41.4% over their devices while their modules were",
    "  priced as transformers' eager ones (the forty-seventh session made the profile exact for those:",
    "  an eager gpt-oss-20b step on an H200 reads -0.02% in activations). AutoModel's benchmark configs",
    "  build other modules (`backend: rms_norm te, enable_deepep`): Transformer Engine's RMSNorm, which",
    "  keeps its bf16 input and one fp32 statistic a token where the eager norm keeps an fp32 copy and",
    "  the normalised input besides, and DeepEP experts whose activation is one fused function that",
    "  weighs each routed copy by its fp32 routing probability before the down projection",
    "  (`quick_geglu_deepep` under torch.compile; Megatron's `weighted_bias_swiglu` for its SwiGLU",
    "  models), so it keeps its input and the probabilities, not the clamped SwiGLU's intermediates or",
    "  the experts' outputs. Priced so (`modules: te`, the fifty-third session, read from AutoModel's",
    "  code) they read -9.7% and -13.4%; its other rows recompute every layer and",
    "  moved by less than 1.5 GiB. Its Kimi K2 still read +2.6%: 34.5 GiB of its first stage were",
    "  priced as FSDP2's unit buffers, the routed experts' among them. AutoModel's MoE parallelizer",
    "  leaves the experts out of FSDP where their shard group is one rank (`apply_fsdp`: `ignored_params`",
    "  unless its ep_shard mesh has more than one rank; EP over the whole data-parallel group, five of",
    "  its six rows): no gathered copy or unsharded fp32 gradient of theirs, their gradients in bf16.",
    "  Priced so (`experts_outside_fsdp`, the same session) Kimi K2 reads {m[automodel-kimi-k2-256gpu]} and",
    "  GPT-OSS {m[automodel-gpt-oss-20b-8gpu]} and {m[automodel-gpt-oss-120b-64gpu]}.",
    "",
    "What is still over:",
    "",
    "* Frameworks ndplan has no profile of: Meta's (Llama 3 405B; the paper states no activation",
    "  settings, so no recompute is assumed, as for the step time) and DeepSeek's HAI-LLM (DeepSeek-V3",
    "  on H800: its report recomputes every norm and the MLA up-projections, caches some activations",
    "  in fp8 and keeps the EMA on the host, none of which the Megatron profile describes).",
    "* Megatron-Bridge's Llama 3.1 405B on B200 read over (+0.4%) from when the Megatron profile",
    "  priced the fp8 copies Transformer Engine keeps of every linear weight across micro-batches",
    "  (`fp8_weight_cache_bytes`, 2 bytes an element, met within 0.2% on Megatron-LM's own FP8",
    "  functional test: docs/accuracy_megatron.md; its recipe does not turn that cache off,",
    "  `disable_parameter_transpose_cache`) until the forty-third session, when its pipeline split",
    "  counted the embedding and the loss as layers, as its recipe does (126 layers do not split over",
    "  64 virtual stages, 128 do): its first virtual stage holds the embedding and one layer, and it",
    "  reads {m[bridge2511-b200-llama31-405b]} against the device. On Blackwell, Float8 with per-tensor scaling needs",
    "  no transposed copy (1 byte an element; MXFP8 keeps both, 2 bytes and scales): ndplan does not",
    "  know which recipe a B200 row ran and prices 2 bytes.",
    "* torchtitan's 405B rows read over (+2.1%, +1.1%) until their loss was priced vocab-parallel, as",
    "  torchtitan runs it with TP (now {m[torchtitan-405b-3d-1f1b]} and {m[torchtitan-405b-3d-interleaved]} against the device): they fit, but the",
    "  page measured their memory, and ndplan reads it low (below).",
]


COMMENTARY = [
    "* Dense models on A100 (Narayanan et al. 2021, Korthikanti et al. 2022) are predicted from first",
    "  principles within about 10% (the 1T run reads {e[narayanan21-1008b]}, just past it), including the pipeline bubble, unfused attention and full or selective",
    "  recompute, and the ranking within each table is right.",
    "* Pipeline sends, as the runtimes wait for them (the forty-fourth session): Megatron-Core's 1F1B",
    "  batches each send with a receive and synchronises the device after it, and",
    "  torch.distributed.pipelining waits for every step's fused sends, so a send lasts its transfer on the sender's",
    "  timeline (`p2p_wait`; Megatron's interleaved schedule overlaps them). The bottleneck stage then",
    "  pays its own sends, which its neighbours' slack used to absorb: DeepSeek-V3 on B200 (PP 16)",
    "  -29.9% and -17.5% to {e[bridge2511-b200-deepseek-v3]} and {e[bridge2602-b200-deepseek-v3]}, NeMo AutoModel's",
    "  interleaved rows about a point slower (Kimi K2 -25.0% to {e[automodel-kimi-k2-256gpu]}). The 2021-22 papers'",
    "  Megatron-LM also scattered a send over the TP ranks without SP and gathered it on the receiver",
    "  (`pipeline_scatter_gather`, its default then), an eighth of the bytes over InfiniBand: their rows",
    "  moved within 0.5 points either way (the 1T run from -10.0% to {e[narayanan21-1008b]}).",
    "* Dense FP8 runs on H100 and B200 (NeMo, Megatron-Bridge) fall within 15% with the default FP8",
    "  efficiency (FP8 training GEMMs at ~1.3-1.4x BF16 speed, plus the quantisation casts).",
    "* MoE mechanisms checked against the runs, each priced from bytes, FLOPs or the frameworks' code,",
    "  none tuned (points: change of the error):",
    "  * Small-GEMM efficiency: expert parallelism gathers tokens, so each local expert gets",
    "    T*k*ep*etp/(tp*E) = 1,024-8,192 tokens per micro-batch here, and the expert GEMMs' forward and",
    "    input-gradient passes are compute-bound (intensity above the ridge point). The roofline prices",
    "    each pass's own bytes; the weight-gradient GEMM read-modify-writes the fp32 gradient (8 bytes",
    "    per weight per micro-batch), which makes DeepSeek-V3's 32 local experts x 1,024 tokens on B200",
    "    memory-bound in W (+1.9 on that row; dense rows unchanged). What thin expert GEMMs do lose is",
    "    reduction depth: each output tile pays a fixed cost worth ~720 (fp8) / ~240 (bf16) elements of",
    "    its reduction on Hopper, ~740 / ~480 on Blackwell (fitted to DeepGEMM's H800 table and",
    "    OpenXLA's measured sm_90/sm_100 GEMM tables, not to these runs), and the forward of an expert",
    "    down-projection sums over only f_e = 768 (Qwen3-30B) or 1,536 (Qwen3-235B) elements, the weight",
    "    gradient over the 1-4 K tokens of its expert. Priced per pass (`fp8_gemm_depth_knee`,",
    "    normalised so the quoted efficiencies hold at depth 8,192): +0.5 to +3.5 on the MoE rows (the",
    "    expert GEMMs are a small share of these steps), and dense FP8 rows with shallow TP-split",
    "    reductions move +1 to +7 (NeMo H100 median 6.8% -> 4.0% then; now in the summary above).",
    "  * Memory-bound MoE passes: Megatron's all-to-all dispatcher also sorts the received rows by local",
    "    expert and back (4 elements per row and hidden unit): +2 to +4 on its rows, none where the",
    "    host floor binds (Qwen3-30B on B200).",
    "  * All-to-all: Megatron-Core dispatches in BF16 (HybridEP's code asserts it has no FP8 dispatch),",
    "    so the dispatch now moves 2 bytes per element (+1 on intra-node rows, +4.5 on DeepSeek-V3 and +9",
    "    on Qwen3-235B over H100 nodes); DeepSeek-V3's own framework quantises first (`ep_dispatch_fp8`). Group-",
    "    limited routing (DeepSeek-V3: 4 of 8 groups, one group per node at EP 64 over 8 nodes) sends a",
    "    token to 3.18 remote nodes instead of 4.63 (`ep_node_limit`): the H100 Megatron-Bridge row went",
    "    from +24% to +7%.",
    "  * Deduplicating dispatch: DeepEP and HybridEP send a token once to each rank that holds any of",
    "    its experts (the rank copies it to its local experts itself), D = R*(1 - C(E-E/R, k)/C(E, k))",
    "    copies instead of k: inside one node 0.67 of the all-to-all dispatcher's bytes for Qwen3-235B",
    "    (top-8 of 128 experts over 8 ranks). It moved the DeepEP rows with EP 8 inside a node by -1 to -5 points (the",
    "    forced-balance long-context rows from +2.3%, +3.2%, +2.0%, -0.7%), and none across nodes,",
    "    where the network leg, already once per node, binds.",
    "  * Host: dropless dispatch copies the token counts to the host mid-forward; the GPU work queued",
    "    before that sync (attention block, router) now adds to the expert launches after it (+2 on",
    "    Qwen3-235B).",
    "  * Load imbalance: the Megatron-Bridge benchmarks force-balance routing (random scores), so the",
    "    busiest of ep ranks carries about sigma*sqrt(2 ln ep) more tokens than the mean,",
    "    sigma = sqrt((1-1/ep)/copies per rank): 0.7-2% of the expert share here; not modelled.",
    "* DeepSeek-V3 on Megatron-Bridge ({e[bridge2509-h100-deepseek-v3]} on H100, {e[bridge2511-b200-deepseek-v3]} on B200): its recipes, read for",
    "  the memory check below, recompute `mla_up_proj` (and `mlp` on H100), reduce gradients in bf16",
    "  and unoverlapped, run TE's cross-entropy on the bf16 logits, and on H100 give MTP and the loss",
    "  a virtual stage of their own",
    "  (`Et|(tt|)*30mL`). Under the default even layout (61 layers over 32 virtual stages) the last",
    "  one held a decoder layer besides them and set the pipeline's pace: the H100 row would read",
    "  {v[deepseek-h100-even]} with the recompute, {v[deepseek-h100-even-no-recompute]} without (it read +11.9% before "
    "the recipe was read).",
    "  The B200 configs (PP 16, no VP) pass no layout, so the recipe's own for PP 16 holds",
    "  (`layout_map[(16, 1)]`: the embedding and 4 layers, 14 stages of 4, then 1 layer with MTP and",
    "  the loss); Megatron cannot split 61 layers evenly over 16 stages. Until the forty-third",
    "  session these rows took ndplan's even split, whose last stage held 3-4 layers beside MTP and",
    "  the loss and set the pace: -5.9% and +13.1%. With the recipe's layout a stage of 4 MoE layers",
    "  sets it and they read {e[bridge2511-b200-deepseek-v3]} and {e[bridge2602-b200-deepseek-v3]}: the MoE layers'",
    "  missing time shows, as in the other Megatron MoE rows (below and the Qwen3-235B table).",
    "* What is left is not explained by FLOPs, bytes or link rates, and the source shows why. Its 25.09",
    "  table ran the same configurations token-drop (same FLOPs, bytes and all-to-all volumes, no host",
    "  sync): Qwen3-30B-A3B on H100 at 12.5 s per step against 24.8 s dropless (ndplan {s[bridge2511-h100-qwen3-30b-a3b]}, under",
    "  the token-drop run), on B200 at 14.5 s against 28.2 s (ndplan {s[bridge2511-b200-qwen3-30b-a3b]}; 11.2 s GPU-only), Qwen3-235B",
    "  on B200 at 16.0 s against 20.0 s (ndplan {s[bridge2511-b200-qwen3-235b-a22b]} with EP overlap, as that run had it: Megatron-Bridge",
    "  PR #1760 then disabled it 'due to CPU overhead', 20.1 s to 16.9 s: its developers' issue #1705 calls that run a",
    "  regression, so it is marked as one since the fortieth session, and the PR's 16.9 s is a row of its own,",
    "  {e[bridge-pr1760-b200-qwen3-235b-a22b]}). Megatron-Core's all-to-all dispatcher only syncs",
    "  the host on the token counts when it is not `drop_and_pad` (`_maybe_dtoh_and_synchronize`), so",
    "  the 2x of the Qwen3-30B rows is the dropless path's host cost, on both H100 and B200. The",
    "  recipes of that period also differ in host-side settings the tables do not list (the B200",
    "  Qwen3-30B recipe at one point used full-iteration CUDA graphs, which only a sync-free path can",
    "  capture), so ndplan cannot tell how much of it is launch overhead that the token-drop runs hid.",
    "  On B200 the dropless rows spend 9.2 ms (Qwen3-30B) and 13.3 ms (Qwen3-235B) per MoE layer and",
    "  micro-batch of 4,096 tokens; the 26.02 table runs the same model at 29,521 tokens/s/GPU on B300",
    "  with micro-batch 8 against 9,691 on B200 with micro-batch 1, i.e. about 7 ms per layer and",
    "  micro-batch that does not grow with tokens. That fixed cost looks like host time per MoE layer",
    "  (forward and backward) of ~7-8 ms, where ndplan's floor is 5 ms (2 ms + 20 us per local expert",
    "  forward, twice that backward); no source states the per-expert host cost of Transformer Engine's",
    "  grouped linear layers, so the default is not raised. The fitted profiles lower",
    "  `grouped_gemm_factor` (and raise `host_moe_layer_s` on Blackwell) to absorb it; the defaults stay",
    "  first-principles.",
    "* fp8 recipes keep the output head in bf16 (Megatron-Core's output layer is no Transformer Engine",
    "  module, torchao's Float8 skips `output`, DeepSeek-V3's report keeps the head in its original",
    "  precision): priced so since the thirty-first session, where it had run at the fp8 rate. The",
    "  FP8 rows moved 0.1-7.8 points slower: DeepSeek-V3 on B200 from -12.9% and +4.3% (under the even",
    "  layout then assumed; the recipe's since, above),",
    "  on H100 -0.0% to {e[bridge2509-h100-deepseek-v3]}, its own H800 DualPipe row +9.6% (later +18.5%, below) to {e[deepseek-v3-h800]}.",
    "* DeepSeek-V3's own H800 row runs the fine-grained FP8 GEMMs its report describes (1x128 and",
    "  128x128 scales, promoted to FP32 every 128 elements), which DeepSeek published as DeepGEMM with",
    "  an H800 table: 0.66 of the fp8 peak at the profiles' reference depth, where Transformer",
    "  Engine's training GEMMs take 0.5 (`fp8_gemm_kernel: deepgemm`, the forty-second session; the",
    "  MLA key assembly's bytes had moved the row from +17.4% to +18.5%): {e[deepseek-v3-h800]}.",
    "* MLA's key is built per head out of its up-projection's output and one rope key per token, a",
    "  memory-bound pass the model had not counted: Megatron-Core's fused MLA RoPE kernels write key",
    "  and value in one pass (`mla_assembly: fused`, the default), NeMo AutoModel's and torchtitan's",
    "  torch.cat more (`cat`). Priced since the forty-second session, Megatron's DeepSeek-V3 rows moved",
    "  1.1-1.3 points slower (Bridge on H100 +3.2% to {e[bridge2509-h100-deepseek-v3]}, on B200 -6.9% to",
    "  -5.9% and +11.8% to +13.1% under the even layout then assumed).",
    "* The 26.02 table (added in the twenty-second session, each row with its 25.11 twin's",
    "  assumptions) runs Qwen3-30B no faster: {e[bridge2602-h100-qwen3-30b-a3b]} on H100 and "
    "{e[bridge2602-b200-qwen3-30b-a3b]} on B200, so the dropless",
    "  path's cost stayed. The B200 Qwen3-235B without VP and EP overlap reads {e[bridge2602-b200-qwen3-235b-a22b]} "
    "(25.11's, with both,",
    "  {e[bridge2511-b200-qwen3-235b-a22b]}); DeepSeek-V3 on B200 at twice the global batch {e[bridge2602-b200-deepseek-v3]} "
    "(25.11: {e[bridge2511-b200-deepseek-v3]}: the release",
    "  sped it up 26% per GPU, more than its halved bubble explains). The dense H100 rows at 2-3x the",
    "  global batch read {e[bridge2602-h100-llama3-70b]} and {e[bridge2602-h100-llama31-405b]} "
    "(25.11: {e[bridge2511-h100-llama3-70b]}, {e[bridge2511-h100-llama31-405b]}): for the 70B the bubble's share is priced "
    "right; the 405B's",
    "  gained more per GPU than its smaller bubble explains (a software change between the releases).",
    "* Qwen3-235B on H100 ({e[bridge2511-h100-qwen3-235b-a22b]}) runs with its expert all-to-all over InfiniBand (EP 32 over 4 nodes)",
    "  hidden where a partner micro-batch allows: its recipe sets `moe_a2a_overlap=True`",
    "  (Megatron-Core's --overlap-moe-expert-parallel-comm) and counts the embedding and loss in the",
    "  pipeline split, which the entry now states; with the all-to-all exposed ndplan predicts",
    "  {v[qwen3-235b-h100-a2a-exposed-s]} ({v[qwen3-235b-h100-a2a-exposed]}). The same configuration token-drop in the 25.09 table took 27.2 s.",
    "* Megatron-MoE-ModelZoo's Qwen3-235B table (five layouts of one model on the same 256 H100s, BF16)",
    "  is the direct test of ranking MoE layouts, what the search does, and ndplan fails it (rank",
    "  correlation 0.46). Three of its layouts ran Megatron's norm and MoE-activation recompute",
    "  (`--recompute-modules layernorm moe_act`), now priced as such: +0.1 s on each, from replaying",
    "  memory-bound norms and activations. Row by row:",
    "  * DeepEP with EP 32 over 4 nodes: {e[modelzoo-qwen3-235b-deepep-ep32]}. Megatron-Bridge 25.11 ran this layout in FP8 with the",
    "    all-to-all dispatcher and its recipe's `moe_a2a_overlap=True` in 20.8 s (ndplan {s[bridge2511-h100-qwen3-235b-a22b]}).",
    "  * The same with the source's '+1f1b overlap' (`--overlap-moe-expert-parallel-comm`): measured",
    "    2.1 s faster, 17.6 s. ndplan's EP-overlap switch hides the all-to-all of the passes that have",
    "    a partner micro-batch, but for the 20 of 132 SMs its kernels hold meanwhile",
    "    (`ep_comm_compute_share`, from DeepSeek-V3's report and DeepEP's default; it moved this row",
    "    from -32% and DeepSeek-V3's own DualPipe row from +1.0% to +4.5%). The first stage's 38",
    "    warm-up forwards of 512 and as many cool-down backwards have no partner and run their",
    "    all-to-all exposed (`schedule.pairing`; -26.5% before, and DeepSeek-V3's row, where",
    "    DualPipeV leaves 47 of 240 forwards unpaired at pp 16, moved from +4.5% to +8.3%; +7.7% once",
    "    Megatron's default selective recompute replayed the attention core alone, as core_attn does;",
    "    {e[deepseek-v3-h800]} now):",
    "    1.35 s of exposed all-to-all, {s[modelzoo-qwen3-235b-deepep-ep32-a2a-overlap]} predicted ({e[modelzoo-qwen3-235b-deepep-ep32-a2a-overlap]}). Not modelled: the host driving two",
    "    micro-batches at once.",
    "  * Megatron-FSDP with EP 8 inside a node: {e[modelzoo-qwen3-235b-fsdp-ep8]}, with gradients reduced in BF16.",
    "    Megatron-FSDP reduce-scatters every micro-batch (its `no_sync` keeps syncing sharded gradients)",
    "    and gathers each layer twice per micro-batch (forward, and backward after resharding): with",
    "    Megatron's default FP32 reduction a rank's 16 experts' shards alone would move 4 x (55 + 55 +",
    "    110) GB across its 50 GB/s InfiniBand NIC, 17.6 s at line rate, the whole measured step, so",
    "    that default cannot be what ran (priced with it, the row reads {v[modelzoo-fsdp-fp32-grads]}; it read +55% before the",
    "    exposed NVLink all-to-all and TP collectives counted as cover for FSDP's InfiniBand traffic,",
    "    which runs on its own stream, +73% before the recomputed forward counted in the backward's",
    "    window). The source adds Megatron-FSDP's flags to the launcher's and does not list them; the",
    "    row takes the setting Megatron-FSDP's user guide recommends (`--grad-reduce-in-bf16`) and",
    "    Megatron-Bridge's Megatron-FSDP recipes set (`grad_reduce_in_fp32 = False`). The other way to",
    "    move fewer bytes, FP32 reduction with the forward's gathered parameters kept for the backward,",
    "    reads {v[modelzoo-fsdp-kept-params]}: the choice between the two moves the row by a few percent; the bound, not the",
    "    error, rules the default out.",
    "  * All-to-all dispatcher with one layer per virtual stage (pp 32, vpp 3, the embedding and loss",
    "    counted as layers): {e[modelzoo-qwen3-235b-a2a-pp32]}. Megatron-Bridge's Qwen3-30B H100 row ({e[bridge2511-h100-qwen3-30b-a3b]}) also has one layer per",
    "    virtual stage, also with this dispatcher, whose dropless host sync ndplan underprices (above).",
    "  * DeepEP with TP 4 and EP 8: {e[modelzoo-qwen3-235b-deepep-tp4]}.",
    "* The same source's long-context table (Qwen3-235B, TP 4, EP 8, PP 8 with VPP 4, CP 1 to 8 for 16K",
    "  to 128K tokens, `--recompute-modules layernorm moe`) ran every length twice: dropless, and with",
    "  routing forced to balance (`--moe-router-force-load-balancing`). Its TFLOP/s are converted with",
    "  Megatron-Core's own formula, which reproduces the 4K table's step times and TFLOP/s within 0.6%.",
    "  ndplan assumes balanced experts (`moe_imbalance` 1.0) and lands {e[modelzoo-qwen3-235b-long-16k-forced-balance]}, "
    "{e[modelzoo-qwen3-235b-long-32k-forced-balance]}, {e[modelzoo-qwen3-235b-long-64k-forced-balance]} and "
    "{e[modelzoo-qwen3-235b-long-128k-forced-balance]} from",
    "  the forced-balance runs: long-context MoE with context parallelism is priced right. The dropless",
    "  runs are 9-25% slower than those, the cost of uneven routing, shrinking as attention's share grows",
    "  with length; ndplan does not predict it ({e[modelzoo-qwen3-235b-long-16k]} at 16K to {e[modelzoo-qwen3-235b-long-128k]} at 128K). "
    "Rank correlation is",
    "  trivial in both tables (the length orders them).",
    "  * One factor on the busiest rank's routed-expert compute and all-to-all (`--moe-imbalance`)",
    "    explains each length's slowdown: {i[16k]}, {i[32k]}, {i[64k]} and {i[128k]} from 16K to 128K (found per pair",
    "    by bisection, this section's generator). So the step's split between experts and attention holds",
    "    across lengths, and this checkpoint's dropless routing gives the busiest of 8 EP ranks (16",
    "    experts each) about {i[mean]}x its balanced share. Carried to the 4K table at {i[mean]} (other layouts",
    "    of the same model and cluster, also dropless; defaults otherwise): EP 8 with TP 4 {i[modelzoo-qwen3-235b-deepep-tp4]}, PP 32",
    "    {i[modelzoo-qwen3-235b-a2a-pp32]}, FSDP {i[modelzoo-qwen3-235b-fsdp-ep8]} (its gathers bind, not its experts), but EP 32 over 4 nodes",
    "    {i[modelzoo-qwen3-235b-deepep-ep32]} and {i[modelzoo-qwen3-235b-deepep-ep32-a2a-overlap]} with its overlap. The factor does not carry from EP 8 to",
    "    EP 32, so the default stays 1.0 (balanced routing, as benchmarks that force it run); for",
    "    real routing a user sets their own (`--moe-imbalance`, or `ndplan calibrate`).",
    "* Megatron-Core's MoE report (arXiv 2603.07685, Table 11; added in the forty-eighth session and",
    "  priced blind: nothing in the model was changed for it) ran DeepSeek-V3 and Qwen3-235B on GB300,",
    "  GB200 and H100 with routing forced to balance, the same software line as the ModelZoo tables,",
    "  and its configurations come with the launch commands that reproduce them. Nine rows: GB200 and",
    "  GB300 NVL72 with the expert all-to-all inside the rack (HybridEP), MXFP8 and BF16, one 128K-token",
    "  run with CP 4, and H100 with DeepEP across nodes. Qwen3-235B {e[mcore-moe-qwen3-235b-gb200-mxfp8]} (GB200 MXFP8, activation",
    "  offloading), {e[mcore-moe-qwen3-235b-gb200-bf16]} (GB200 BF16), {e[mcore-moe-qwen3-235b-gb300-mxfp8]} (GB300 MXFP8), "
    "{e[mcore-moe-qwen3-235b-gb300-128k]} (GB300, 128K tokens), {e[mcore-moe-qwen3-235b-h100]} (H100);",
    "  DeepSeek-V3 {e[mcore-moe-deepseek-v3-gb200-mxfp8]}, {e[mcore-moe-deepseek-v3-gb200-bf16]} (GB200 MXFP8, BF16), "
    "{e[mcore-moe-deepseek-v3-gb300-mxfp8]} (GB300), {e[mcore-moe-deepseek-v3-h100-fp8]} (1,024 H100s, FP8",
    "  blockwise). Not priced, or assumed: the partial CUDA graphs most of them capture (attention,",
    "  router, MoE preprocessing), which cut the host launches the host floor prices (they would make",
    "  a prediction slower, not faster); the DeepSeek-V3 GB200 BF16 row's layout, which no source gives",
    "  (assumed from Megatron-LM's GB200 guide for the same configuration); and two Qwen3 figures whose",
    "  layouts the paper's appendix and ModelZoo's commands give differently (the commands are taken). The H100",
    "  Qwen3 row is ModelZoo's EP 32 layout with its all-to-all overlap, forced balance and a later",
    "  branch: 15.4 s where ModelZoo's dropless run took 17.6 s; ndplan's {s[mcore-moe-qwen3-235b-h100]} reads",
    "  {e[mcore-moe-qwen3-235b-h100]} against the balanced run and {e[modelzoo-qwen3-235b-deepep-ep32-a2a-overlap]} against the dropless one: about half of",
    "  that row's error goes with its routing (and the branch).",
    "* Megatron-Bridge 25.11's DGX-GB300 and DGX-GB200 sections, their Llama rows (added in the",
    "  fiftieth session, priced blind from the recipes of the period): 8B {e[bridge2511-gb300-llama3-8b]} "
    "and {e[bridge2511-gb200-llama3-8b]}, 70B under",
    "  Megatron-FSDP {e[bridge2511-gb300-llama3-70b]} and {e[bridge2511-gb200-llama3-70b]}, 405B "
    "{e[bridge2511-gb300-llama31-405b]} and {e[bridge2511-gb200-llama31-405b]} (GB300, GB200). The two share",
    "  their datasheet peaks (NVIDIA's NVL72 figures: 2.5 PFLOP/s BF16 and 5 FP8 dense a GPU), so",
    "  ndplan prices one configuration alike on both, where the table measured the 8B's 1.19x and the",
    "  70B's 1.05x faster on GB300 (the 405B ran other layouts there, 1.23x). What a GB300 adds is",
    "  not in those peaks: Blackwell Ultra doubles the exponential units softmax runs on (NVIDIA's",
    "  'Making Softmax More Efficient with NVIDIA Blackwell Ultra': +35% on an FP8 attention",
    "  forward), which on the 8B's attention (a fifth of its step, whose backward FlashAttention-4's",
    "  authors find bound by shared memory on B200, not by exponentials) would give about 1.5%; the",
    "  rest (clocks under a larger power budget?) is not sourced, and not priced. The 70B rows",
    "  offload 20 and 40 layers' activations to host memory, priced neither in time nor in memory",
    "  (below): GB200's, with twice the copies, reads the faster of the two.",
    "* torchtitan's June 2025 H200 page (Llama 3.1 8B under FSDP over 32 and 64 H200s, compiled blocks",
    "  and loss, Float8, per-op checkpointing; added in the forty-eighth session): "
    "{e[torchtitan-8b-h200-fsdp-32gpu]} and {e[torchtitan-8b-h200-fsdp-64gpu]}",
    "  (+2.0% and +0.1% with the loss priced eager, until the forty-ninth session found torchtitan's",
    "  loss of that period compiled with the blocks: the entries say what was read),",
    "  its SDPA priced as FlashAttention-2, which torch 2.8 ran first on Hopper (cuDNN's kernel is",
    "  preferred only with a bundled cuDNN past 9.15, torch 2.10 on), as the December rows. Not blind:",
    "  both kernels were priced before that was looked up (cuDNN's rate reads the rows 11-12% fast).",
    "  Its memory reads high instead (below).",
    "* AMD Instinct (added in the forty-eighth session with the MI325X and MI355X presets, priced blind;",
    "  no family fit: n/a in the fitted columns): Llama 3.1 8B in FP8 on MI325X, AMD's measured rows",
    "  as its Primus blog quotes them, {e[amd-mi325x-llama31-8b-fp8-8gpu]} on one node and "
    "{e[amd-mi325x-llama31-8b-fp8-64gpu]} on eight, with CDNA3's figures (their global",
    "  batch assumed); MLPerf Training v5.1's Llama 3.1 8B on eight MI355X {e[mlperf51-mi355x-llama31-8b]}, CDNA3's "
    "figures carried to",
    "  CDNA4 unmeasured, and its FP8 attention priced in bf16.",
    "* MindSpeed-LLM's README table (Ascend 910B, Atlas 900 A2 PODc; added in the forty-eighth session and",
    "  priced blind) is the first test of the Ascend defaults (`davinci-mesh`: the cube at 0.7 of the",
    "  353.9 TFLOP/s derived peak, HCCS at 0.7), which no published run had checked. Six dense rows",
    "  with the configurations of the launch scripts the table points to (later versions than the",
    "  table's). Without tensor parallelism they land: Llama 2 7B {e[mindspeed-llama2-7b-8npu]}, Qwen2 7B "
    "{e[mindspeed-qwen2-7b-8npu]} (Llama 2 7B's 4,672 tokens/s a NPU is 56% of the derived peak).",
    "  Every script passes --no-gradient-accumulation-fusion: each weight gradient is added to its fp32",
    "  buffer by a kernel of its own, 10 bytes a weight a micro-batch at the HBM rate (priced since the",
    "  fifty-fifth session; before, these rows read -2.8%, -3.8% and, with TP 8 below, -32.1%, -13.2%,",
    "  -8.8% and -17.9%).",
    "  With TP 8 the table's MC2 (MindSpeed's fused matmul and collective kernels, on for every row by",
    "  its header) is priced as TP overlap, and they read fast: Llama 3 8B at 8K {e[mindspeed-llama3-8b-8k-8npu]}, Llama 2 70B",
    "  {e[mindspeed-llama2-70b-32npu]}, Llama 3.1 70B at 8K {e[mindspeed-llama31-70b-8k-32npu]}, Qwen2 72B "
    "{e[mindspeed-qwen2-72b-32npu]}; with the collectives all exposed,",
    "  {v[mindspeed-llama3-8b-8k-8npu-tp-exposed]}, {v[mindspeed-llama2-70b-32npu-tp-exposed]}, "
    "{v[mindspeed-llama31-70b-8k-32npu-tp-exposed]} and {v[mindspeed-qwen2-72b-32npu-tp-exposed]}. The 70B-class "
    "steps lie between",
    "  the two bounds (MC2 hides part of the collectives); Llama 3 8B's is slower than even the",
    "  exposed bound, so the 8-way split GEMMs (its key and value projections are 128 wide a rank)",
    "  may also run slower on the cube than the one efficiency says; neither is measured. The",
    "  per-family fit, trained on three TP 8 rows, puts the difference on the collectives (HCCS's efficiency",
    "  0.7 -> {g[davinci-mesh (dense).scaleup_efficiency]}, the cube's 0.7 -> {g[davinci-mesh (dense).gemm_efficiency]}), "
    "and the held-out TP 1 rows then read {f[mindspeed-llama2-7b-8npu]} and",
    "  {f[mindspeed-qwen2-7b-8npu]}. Ascend plans with TP are a shortlist to measure.",
    "* torchtitan's selective checkpointing is its per-op policy (recompute every second matmul, keep",
    "  attention), now modelled (`selective_recompute: torchtitan-op`, +2). These rows ran at a 500 W",
    "  power limit on HBM2e H100s whose peak the source places between H100 SXM (989 TFLOP/s) and NVL",
    "  (835): ndplan takes the middle of that range, 912 TFLOP/s (the thirty-first session; the SXM",
    "  peak before, the fastest the range allows, read every row of the page 4-7 points faster). With",
    "  eager elementwise kernels priced at 4.5 passes (measured on an H200, below; it was 3, a guess)",
    "  they read {e[torchtitan-8b-fsdp-8gpu]} and {e[torchtitan-8b-fsdp-128gpu]} (were -29%, -31%), the last 2 points",
    "  from FSDP2's copies on the compute stream (each gathered unit out of its all-gather buffer, each",
    "  gradient into the reduce-scatter buffer, read in torch's code: `fsdp_stream_copies`, the fortieth",
    "  session; every FSDP2 row of the page and AutoModel's moved 0.1-2.4 points slower). Since the",
    "  fiftieth session the SMs NCCL's kernels hold while FSDP's gathers and reduce-scatters hide",
    "  under compute are priced (16 of 132 at NVLink's rate, fewer in proportion on a slower link:",
    "  NCCL's maintainer, NVIDIA/nccl#689; docs/time.md section 6): these rows moved 0.6-0.8 points",
    "  slower, the H200 page's 0.9-1.0. The page measured 128 GPUs 1.8-2.8% slower than 8 in each",
    "  pair; ndplan prices the SMs alike at both (the same bytes) and the 128-GPU rows 1.9-2.8%",
    "  faster, for their optimizer, sharded 16 times finer: the one inversion in this table's",
    "  rank correlation, not explained.",
    "* The same page's 3D rows (Llama 3.1 405B on 512 of those GPUs: FSDP 8, TP 8, PP 8, Float8,",
    "  torch.compile, AsyncTP) were added with torch pipelining's FSDP behaviour (reduce deferred to a",
    "  run's end, parameters kept gathered) and priced blind: 1F1B {e[torchtitan-405b-3d-1f1b]}, Interleaved",
    "  1F1B {e[torchtitan-405b-3d-interleaved]}, about the 8B rows' offset (the power limit); "
    "interleaved against 1F1B, predicted {t[torchtitan-405b-3d-interleaved]}",
    "  against {t[torchtitan-405b-3d-1f1b]} tokens/s per GPU, measured 128 against 100. Their micro-batches",
    "  (8 of 4 sequences, torchtitan's default then) and compiled elementwise kernels (1 pass) are assumed.",
    "* The page's other tables were added in the twenty-second session, after every figure above was",
    "  chosen: the 8B rows with torch.compile and Float8 (tables 1 and 3), the 8B at 32K-256K tokens",
    "  with CP 1-8 (table 2), the 70B over FSDP 32 and TP 8 with and without AsyncTP (table 4) and the",
    "  405B at 32K-256K with CP 1-8 over TP 8 and PP 8 (table 6). First priced, the long-context rows",
    "  read 40-64% fast. Their cause, sourced apart from them: torchtitan calls SDPA, which in the",
    "  torch nightlies of that month ran FlashAttention-2 on H100 (cuDNN's kernel deprioritised,",
    "  pytorch#141133; 329 TFLOP/s against cuDNN's 631 in pytorch#142132), 0.33 of the peak where the",
    "  Hopper default, 0.55, is cuDNN's kernel measured on an H200 today: every row of the page",
    "  stated `attention_efficiency: 0.33` (the existing rows moved by +3 to +5 points). That figure is",
    "  the forward alone (tritonbench's default mode), and the efficiency prices forward and backward",
    "  FLOPs alike (the H200 measurement timed both). FlashAttention-2's backward runs at 0.86 of its",
    "  forward on an H100 (the FlashAttention-3 paper's figures, head dim 128, 8K tokens: 318 against",
    "  370 TFLOP/s); weighted by the FLOPs (1 : 2.5), 0.30 since the forty-third session, which moved",
    "  every row of the page 1-6.5 points slower (the 8B at CP 4 from -30.3% to -24.8%). What is left:",
    "  * The long-context rows still read fast, more so with more CP ranks: the 8B from",
    "    {e[torchtitan-8b-cp1-32k]} at CP 1 to {e[torchtitan-8b-cp8-256k]} at CP 8, the 405B from {e[torchtitan-405b-4d-cp1-32k]} to "
    "{e[torchtitan-405b-4d-cp8-256k]}. At CP 1 that is the",
    "    power limit and the kernel's long-sequence rate; beyond, torch's experimental context",
    "    parallelism (SDPA on each K/V shard, the shards all-gathered) costs more than a ring like",
    "    Transformer Engine's, whose exchange hides under balanced causal attention. Since the",
    "    forty-first session its merges are priced as its code runs them (`ring_merge: torch`: each",
    "    step's output merged into an fp32 running output, keys, values and their fp32 gradients",
    "    copied every step, torch/distributed/tensor/experimental/_attention.py), 3-5 points of the",
    "    CP rows (the 8B at CP 8 read -38.4% before); since the forty-third its exchange too",
    "    (`ring_exchange: allgather`, the same file): K and V, which torchtitan repeats to every",
    "    query head, all-gathered once a pass under the first step's attention alone, and their fp32",
    "    gradients sent on after every backward step, the last with nothing to hide it. Over the",
    "    405B's cross-node ring (42 GB/s a GPU) that is 3-7 points (CP 8 from -29.7% to",
    "    {e[torchtitan-405b-4d-cp8-256k]}); inside the 8B's node, a few tenths. What the 8B's CP 4",
    "    and 8 rows still miss ({e[torchtitan-8b-cp4-128k]}, {e[torchtitan-8b-cp8-256k]}), about 2 s of",
    "    step per ring rank, is not found. The ranking within each table is right (the length",
    "    orders it).",
    "  * torch.compile: ndplan prices the compiled blocks' fused elementwise kernels (1 pass against",
    "    eager's 4.5; the final norm and loss, which torchtitan then left outside the compiled blocks,",
    "    eager since the thirty-first session: +3 to +4 points) and predicts a larger gain than measured",
    "    (8 GPUs: {t[torchtitan-8b-fsdp-compile-8gpu]} tokens/s per GPU",
    "    predicted against 6,667 measured, {e[torchtitan-8b-fsdp-compile-8gpu]}, where eager reads {e[torchtitan-8b-fsdp-8gpu]}); Float8 on top reads",
    "    {e[torchtitan-8b-fsdp-compile-float8-8gpu]} and {e[torchtitan-8b-fsdp-compile-float8-128gpu]}.",
    "  * AsyncTP: the 70B over TP 8 reads {e[torchtitan-70b-2d]} without it and {e[torchtitan-70b-2d-asynctp]} with it",
    "    (829 to 876 tokens/s per GPU measured, 5.7%). Until the fortieth session ndplan's TP overlap",
    "    hid every TP collective (-15.9%); torch's AsyncTP is Inductor's micro-pipeline pass, which",
    "    fuses a reduce-scatter only with a lone matmul feeding it, and the backward's input-gradient",
    "    reduce-scatters take sums of the q/k/v and w1/w3 input gradients: the backward's TP",
    "    reduce-scatters stay exposed (`tp_overlap_backward: all-gathers`, the pytorch runtime's fact,",
    "    read in torch's code, not fitted). That moved every AsyncTP row by 1-4.5 points (the 3D rows",
    "    from -12.3% and -13.6%). With Float8 linears torchtitan's TP styles (torchao's",
    "    Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput) all-gather fp8 in both",
    "    passes (`fp8_tp_gather`): the 2D row without AsyncTP, whose gathers are exposed, read +5.4%",
    "    before it. What is left is not placed: the decomposed matmuls' own cost, the",
    "    symmetric-memory copies' SMs.",
    "* NeMo AutoModel's table (PyTorch-native: FSDP2, torch.distributed.pipelining, DeepEP, Transformer",
    "  Engine kernels; H100, BF16) was added after every figure above was chosen. Each row's settings",
    "  are read off the benchmark config the table links and AutoModel's code: bf16 parameters and",
    "  Adam states with FP32 gradient reduction (its MoE parallelizer's mixed-precision policy), no",
    "  MTP module in its DeepSeek-V3, whole-layer activation checkpointing where the config sets it.",
    "  Priced first with the `pytorch` runtime's eager kernels (4.5 elementwise passes, measured on",
    "  transformers models) and experts drawn at random, Qwen3-30B read +106% and DeepSeek-V3 +54%.",
    "  AutoModel's MoE layers run",
    "  Megatron-Core's fused permutation (moe_permute_fusion) and fused weighted SwiGLU, and TE's",
    "  norms, rotary and attention: the default profile's fused kernels (1 pass) describe them. Its",
    "  benchmark gate (FakeBalancedGate) gives token t the experts t*k .. t*k+k-1, which lie on one",
    "  rank (Qwen3-30B, 16 experts per rank) or two ranks of one node (DeepSeek-V3), and DeepEP sends",
    "  a token once per rank (`ep_routing: contiguous`). So priced: Qwen3-30B {e[automodel-qwen3-30b-a3b-8gpu]},",
    "  DeepSeek-V3 on 256 GPUs {e[automodel-deepseek-v3-256gpu]}, GPT-OSS-20B {e[automodel-gpt-oss-20b-8gpu]}, "
    "GPT-OSS-120B {e[automodel-gpt-oss-120b-64gpu]}. The GPT-OSS",
    "  rows read -37.8% and -34.3% until the forty-first session read three more facts of their",
    "  code: the experts add their biases apart, split per expert and concatenated, the down",
    "  projection's in fp32 because its bias is weighted by the fp32 routing probabilities first",
    "  (`expert_bias_add: split-cat`, about 1.1 s of the 20B's 10 s step); FlexAttention's wrapper",
    "  rescales the output for the sinks with an fp32 scale and casts it back (`sink_rescale: fp32`);",
    "  and FlexAttention runs at 0.78 of the cuDNN-class kernel on H100 by its developer's averages",
    "  (`flex_attention`). Their experts' clamped activation is one compiled kernel (torch.compile),",
    "  as the fused default assumes. The forty-second session read three more: the grouped_gemm",
    "  library its experts call runs CUTLASS's grouped kernel on sm_80 alone and on H100 a cuBLAS GEMM",
    "  per expert on four streams (`expert_gemm: per-expert`); its DeepSeek-V3 attention builds the",
    "  query and key with torch.cat, the rope key expanded to every head (`mla_assembly: cat`); its",
    "  flex backend copies q, k and v into head-major layout and the output back (`qkv_transpose`):",
    "  together 1.0 to 2.3 points on the six rows. The rest is not found. DeepSeek-V3 on 1024 GPUs and Kimi K2",
    "  accumulate gradients over local batches (GA 4",
    "  and 2), each one run of the pipeline schedule (`pipeline_runs`, added for them and for",
    "  torchtitan, whose train step does the same): {e[automodel-deepseek-v3-1024gpu]} and "
    "{e[automodel-kimi-k2-256gpu]}, optimistic",
    "  like DeepSeek-V3 on 256 GPUs. Measured, DeepSeek-V3 loses 14% of its tokens/s per GPU",
    "  from 256 to 1024 GPUs (1002 to 865); ndplan's prediction far less ({t[automodel-deepseek-v3-256gpu]} to "
    "{t[automodel-deepseek-v3-1024gpu]}: the",
    "  per-run reduce of FSDP's gradients, exposed, and over 256 ranks): what costs more is not found.",
    "* Assumed settings (micro-batch size, schedule, recompute where a source is silent) are listed",
    "  per run above; they are the same within a table.",
    "* Not all of this is a blind test. The A100 rows matched within 10% on the first comparison and",
    "  nothing was changed for them. After that comparison the FP8 rows were ~20% optimistic and MoE",
    "  rows far off; the hopper/blackwell `fp8_gemm_efficiency` default was then lowered from 0.62/0.65",
    "  to 0.5 (from the FP8-versus-BF16 speed-up, not per row), and FP8 input casts, FP8 token dispatch",
    "  (since found wrong for Megatron-Core) and the host floor per layer were added. Later the MoE",
    "  terms (per-expert latency and host launches, router bytes, node-deduplicated dispatch) and, in a",
    "  further round, the per-pass GEMM",
    "  bytes, the chunk sort, BF16 dispatch, group-limited routing, the dropless sync and torchtitan's",
    "  recompute policy were added, each from the frameworks' code or configuration and hardware",
    "  bytes, none tuned per row (BF16 dispatch made the Qwen3-235B H100 row worse and was kept). The",
    "  reduction-depth term came last, its knees from GEMM microbenchmark tables, not from these rows",
    "  (it made the Qwen3-235B and DeepSeek-V3 H100 rows worse by 2-3 points and was kept). Then an",
    "  H200 measured kernels directly (benchmarks/accuracy/cuda_probe.py): cuDNN's flash attention takes",
    "  its FLOPs at 0.55 of peak plus 0.2 ms per call (Hopper's `attention_call_s`, new), and eager",
    "  elementwise kernels 4.5 passes (torchtitan's rows; both from kernels, none fitted to a row). The",
    "  held-out columns of the fitted profiles are the clean out-of-sample measure.",
]


if __name__ == "__main__":
    main()
