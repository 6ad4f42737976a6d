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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

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
                chosen = [r for r in family_train if r.model_spec().is_moe == (stage == "moe")]
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
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.output} ({len(runs)} runs, {time.perf_counter() - started:.0f} s)")


def _source_rows(runs: list[MeasuredRun], measured: dict[str, float], pred: dict[str, dict[str, float]],
                 ids: set[str] | None = None) -> list[tuple[str, int, float, float, float, float]]:
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
        out.append((source, len(rs), med, worst, rho_step, rho_tps))
    return out


def write_report(runs, measured, default, fitted, train, test, profiles, reports) -> list[str]:  # type: ignore[no-untyped-def]
    all_errors = [default[r.id]["step_s"] / measured[r.id] - 1 for r in runs]
    med, worst = _abs_stats(all_errors)
    within10 = sum(abs(e) <= 0.10 for e in all_errors)
    within25 = sum(abs(e) <= 0.25 for e in all_errors)
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
        "| source | runs | median abs err | worst abs err | rank corr. step time | rank corr. tokens/s/device |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for source, n, m, w, rs, rt in _source_rows(runs, measured, default):
        lines.append(f"| {source} | {n} | {m:.1%} | {w:.1%} | {_rho(rs)} | {_rho(rt)} |")
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
        hm, hw = _abs_stats(held)
        tm, tw = _abs_stats(tr)
        lines += [
            "",
            f"**Fitted per device family on the training half ({len(tr)} runs), evaluated on the held-out half "
            f"({len(held)} runs):** held-out median |error| {hm:.1%}, worst {hw:.1%} "
            f"(training half: median {tm:.1%}, worst {tw:.1%}).",
            "",
            "| source | held-out runs | median abs err | worst abs err | rank corr. step time | rank corr. tokens/s/device |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for source, n, m, w, rs, rt in _source_rows(runs, measured, fitted, test):
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
        "tokens/s/device ranks are the stricter test of whether ndplan orders configurations correctly.",
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
            f"{_pct(d / measured[r.id] - 1)} | {f:.3f} | {_pct(f / measured[r.id] - 1)} | "
            f"{'train' if r.id in train else 'held-out'} |"
        )
    lines += ["", "## Sources and assumptions", ""]
    seen = set()
    for r in runs:
        if r.source not in seen:
            seen.add(r.source)
            lines.append(f"* **{r.source}**: {r.url}")
        if r.notes:
            lines.append(f"  * {r.id}: {r.notes}")
    lines += ["", "## What the errors say", ""] + COMMENTARY
    return lines


COMMENTARY = [
    "* Dense models on A100 (Narayanan et al. 2021, Korthikanti et al. 2022) are predicted from first",
    "  principles within 10%, including the pipeline bubble, unfused attention and full or selective",
    "  recompute, and the ranking within each table is right.",
    "* Dense FP8 runs on H100 and B200 (NeMo, Megatron-Bridge) fall within 15% with the default FP8",
    "  efficiency (FP8 training GEMMs at ~1.3-1.4x BF16 speed, plus the quantisation casts).",
    "* Fine-grained MoE (Qwen3-30B-A3B, Qwen3-235B-A22B with 16 local experts per device) still runs",
    "  much slower than predicted (Qwen3-30B-A3B on H100 -62%, on B200 -33%). ndplan now prices a",
    "  per-expert GEMM latency (`expert_gemm_latency_s`, 5 us), a per-expert host launch cost after",
    "  dropless dispatch's token-count sync (`host_expert_s`, 20 us), the per-expert weight reads and",
    "  the router/permutation bytes; with documented first-principles values these close only a few",
    "  points. The remaining cost grows with tokens and is not explained by FLOPs, bytes or launch",
    "  counts; the source's unstated settings (recompute, dispatcher) are a likely part.",
    "* Multi-node expert parallelism: DeepSeek-V3's runs dispatch once per destination node (HybridEP",
    "  in Megatron-Bridge's H100 recipe, DeepEP-style in the DeepSeek-V3 report), modelled by",
    "  `ep_dispatch: node_dedup`; the H100 EP64 row went from +49% to +17%. Qwen3-235B EP32 on H100",
    "  keeps the plain all-to-all (the source does not name a dispatcher) and is +15%.",
    "* torchtitan rows ran at a 500 W power limit on HBM2e H100s; the SXM peak ndplan uses is an",
    "  upper bound, so ndplan is optimistic there by construction.",
    "* Assumed settings (micro-batch size, schedule, recompute where a source is silent) are listed",
    "  per run above; they are the same within a table.",
    "* Not all of this is a blind test. The A100 rows matched within 10% on the first comparison and",
    "  nothing was changed for them. After that comparison the FP8 rows were ~20% optimistic and MoE",
    "  rows far off; the hopper/blackwell `fp8_gemm_efficiency` default was then lowered from 0.62/0.65",
    "  to 0.5 (from the FP8-versus-BF16 speed-up, not per row), and FP8 input casts, FP8 token dispatch",
    "  and the host floor per layer were added. Later the MoE terms above (per-expert latency and host",
    "  launches, router bytes, node-deduplicated dispatch) were added from first principles, again",
    "  not per row. The held-out columns of the fitted profiles are the",
    "  clean out-of-sample measure.",
]


if __name__ == "__main__":
    main()
