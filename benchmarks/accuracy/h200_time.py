"""The step-time model against kernels and training steps measured on one H200.

tests/data/measured/h200 holds what ``benchmarks/accuracy/cuda_probe.py`` measured (torch 2.11,
CUDA 13, transformers 5.24): bf16 GEMMs and grouped expert GEMMs per pass (CUDA graphs), torch's
SDPA attention, HBM copies and AdamW's update, whole one-GPU training steps of trimmed or whole
models, and a torch.profiler split of four of those steps by kernel kind. This module prices the
same work with ndplan's model; ``benchmarks/accuracy_time.py`` prints the comparison into
docs/accuracy_time.md and tests/test_perf_measured_h200.py holds the model to it.

    python benchmarks/accuracy/h200_time.py          # print the section
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from ndplan.census.measure_step import trimmed_spec
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions
from ndplan.model import ModelSpec, load_model
from ndplan.perf.efficiency import default_efficiency, with_software
from ndplan.perf.flops import Gemm
from ndplan.perf.gemm import PASS_NAMES, ComputeRates, gemm_seconds
from ndplan.perf.report import estimate_time
from ndplan.perf.step import compute_rates, optimizer_bytes_per_param
from ndplan.strategy import Strategy, StrategyBatch

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "measured" / "h200"
DEVICE = "h200"
#: What the one-GPU steps ran: the pytorch runtime (eager modules, grouped_mm experts, foreach
#: AdamW) with transformers' SDPA attention.
OPTIONS = MemoryOptions(runtime="pytorch", attention="sdpa")


@dataclass(frozen=True)
class Compared:
    name: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_s / self.measured_s - 1.0


def _load(name: str, data: Path = DATA) -> dict:
    return json.loads((data / f"{name}.json").read_text())


def _rates(kernels: dict | None = None) -> ComputeRates:
    """The step-time model's bf16 rates on one device of the profile under ``kernels`` (software
    facts), but for the weight-gradient pass writing a plain bf16 result, as torch.matmul does
    (no fp32 accumulation into a gradient buffer)."""
    device = get_device(DEVICE)
    eff = with_software(default_efficiency(device), kernels)
    batch = StrategyBatch.of(Strategy(precision="bf16-pure"))
    return replace(compute_rates(Cluster(device=device, num_devices=1), batch, eff), wgrad_accum_bytes=2.0)


def gemms(expert_gemm: str = "grouped", data: Path = DATA) -> dict[str, list[Compared]]:
    """Every measured pass of every GEMM: 'dense' (torch.matmul) and 'grouped' (torch._grouped_mm,
    priced as ``expert_gemm`` runs them)."""
    doc = _load("gemm", data)
    rates = _rates({"expert_gemm": expert_gemm})
    out: dict[str, list[Compared]] = {"dense": [], "grouped": []}
    for row in doc["dense"]:
        g = Gemm("dense", row["m"], row["n"], row["k"])
        out["dense"] += [Compared(f"{row['m']}x{row['n']}x{row['k']} {p}", row[p], float(gemm_seconds(g, rates, p)))
                         for p in PASS_NAMES]
    for row in doc["grouped"]:
        if "error" in row:
            continue
        g = Gemm("experts", row["tokens_per_expert"], row["n"], row["k"], count=row["experts"], expert=True)
        label = f"{row['experts']}x{row['tokens_per_expert']} {row['n']}x{row['k']}"
        out["grouped"] += [Compared(f"{label} {p}", row[p], float(gemm_seconds(g, rates, p))) for p in PASS_NAMES]
    return out


#: The attention core's backward over its forward, as the model counts FLOPs (layer.py).
ATTENTION_FLOPS = 3.5


def attention(data: Path = DATA) -> list[Compared]:
    """Each measured SDPA forward+backward against the model's: FLOPs (the backward counting
    2.5x the forward) at the causal or, with a mask, the masked rate, plus the call's fixed cost."""
    device = get_device(DEVICE)
    eff = default_efficiency(device)
    peak = device.peak_flops_for("bf16")
    out = []
    for row in _load("attention", data)["cases"]:
        if "error" in row:
            continue
        pairs = row["seq"] ** 2 * (1.0 if row["window"] else 0.5)  # a mask: the kernel runs the full square
        flops = ATTENTION_FLOPS * 2.0 * row["batch"] * row["heads"] * (row["qk_dim"] + row["v_dim"]) * pairs
        rate = peak * (eff.figure("masked_attention_efficiency") if row["window"] else eff.attention_efficiency)
        out.append(Compared(row["name"], row["forward_backward_s"], flops / rate + eff.attention_call_s))
    return out


def optimizer(data: Path = DATA) -> list[Compared]:
    """AdamW's update (foreach and fused) and clip_grad_norm_ over the measured parameters."""
    from ndplan.strategy.precision import get_precision

    doc = _load("bandwidth", data)
    rates = _rates()
    out = []
    for label, precision in (("bf16", "bf16-pure"), ("fp32", "fp32")):
        prec, params = get_precision(precision), doc[f"{label}_params"]
        for kernel in ("foreach", "fused"):
            predicted = params * optimizer_bytes_per_param(prec, kernel, clip=False) / rates.optimizer_rate
            out.append(Compared(f"{label} AdamW {kernel}", doc[f"{label}_adamw_{kernel}_s"], predicted))
        # torch's clip_grad_norm_: the gradient bytes foreach AdamW's count adds for clipping
        clip = optimizer_bytes_per_param(prec, "foreach") - optimizer_bytes_per_param(prec, "foreach", clip=False)
        out.append(Compared(f"{label} clip_grad_norm_", doc[f"{label}_clip_grad_norm_s"],
                            params * clip / rates.optimizer_rate))
    return out


def steps(data: Path = DATA) -> list[Compared]:
    """Forward and backward of each measured one-GPU step (the optimizer apart: the steps ran
    AdamW without clipping, which ``optimizer`` compares kernel by kernel)."""
    out = []
    for row in _load("times", data)["steps"]:
        if "error" in row:
            continue
        spec = trimmed_spec(load_model(row["model"]), row["layers"])
        settings = {k: row[k] for k in ("seq_length", "recompute", "num_micro_batches", "micro_batch_size") if k in row}
        report = estimate_time(spec, Strategy(precision="bf16-pure", **settings), DEVICE, options=OPTIONS)
        out.append(Compared(row["name"], row["forward_backward_s"], report.step_s - report.breakdown["optimizer"]))
    return out


#: The profiled steps (profile.json) and what they ran.
PROFILED: dict[str, tuple[str, int, dict]] = {
    "llama8b-32l-s4k": ("llama-3.1-8b", 32, {"seq_length": 4096}),
    "qwen3-moe-12l-s4k-full": ("qwen3-30b-a3b", 12, {"seq_length": 4096, "recompute": "full"}),
    "mistral-32l-s8k-sel": ("mistral-7b", 32, {"seq_length": 8192, "recompute": "selective"}),
    "dsv2-lite-12l-s4k-full": ("deepseek-v2-lite", 12, {"seq_length": 4096, "recompute": "full"}),
}


def elementwise_passes(data: Path = DATA) -> dict[str, float]:
    """Per profiled step: the seconds of its kernels that are neither GEMMs nor attention, over
    the seconds of one pass over the elementwise bytes the model counts (the model's step time
    at 2 passes less at 1, the host floors off so that only kernels are counted)."""
    cases = {c["name"]: c for c in _load("profile", data)["cases"]}
    eff = default_efficiency(get_device(DEVICE)).replace(host_layer_s=0.0, host_moe_layer_s=0.0, layer_overhead_s=0.0)
    keywords = OPTIONS.time_keywords()

    def forward_backward(spec: ModelSpec, strategy: Strategy, passes: float) -> float:
        software = {**keywords["software"], "elementwise_passes": passes}
        report = estimate_time(spec, strategy, DEVICE, efficiency=eff, software=software,
                               weight_grad_rebuilds=keywords["weight_grad_rebuilds"])
        return report.step_s - report.breakdown["optimizer"]

    out = {}
    for name, (preset, layers, settings) in PROFILED.items():
        spec = trimmed_spec(load_model(preset), layers)
        strategy = Strategy(precision="bf16-pure", **settings)
        one_pass = forward_backward(spec, strategy, 2.0) - forward_backward(spec, strategy, 1.0)
        out[name] = cases[name]["kernel_s_by_kind"]["other"] / one_pass
    return out


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def section(data: Path = DATA) -> list[str]:
    """The Markdown section for docs/accuracy_time.md."""
    by_kind = gemms(data=data)
    per_expert = gemms("per-expert", data)["grouped"]
    doc = _load("times", data)
    lines = [
        "## One H200, measured here",
        "",
        f"Kernels and one-GPU training steps measured on an {doc['device']} (torch {doc['torch']}, CUDA "
        f"{doc['cuda']}, transformers {doc['transformers']}) by `benchmarks/accuracy/cuda_probe.py`, kept in "
        "tests/data/measured/h200 and compared by `benchmarks/accuracy/h200_time.py` with the `h200` "
        "profile (tests/test_perf_measured_h200.py holds the model to them). Error = predicted / measured - 1.",
        "",
    ]
    for kind, rows in by_kind.items():
        errors = [abs(r.error) for r in rows]
        lines.append(f"* {kind.capitalize()} bf16 GEMMs ({len(rows)} passes, timed in CUDA graphs): median |error| "
                     f"{statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.0f}% "
                     f"({max(rows, key=lambda r: abs(r.error)).name}).")
    errors = [abs(r.error) for r in per_expert]
    lines.append(f"* The grouped GEMMs priced as per-expert launches (Transformer Engine's GroupedLinear, the "
                 f"profile's default) would read median {statistics.median(errors) * 100:.0f}%, worst "
                 f"{max(errors) * 100:.0f}% too slow: torch._grouped_mm has no per-expert cost, so the `pytorch` "
                 "runtime states `expert_gemm: grouped`.")
    eff = default_efficiency(get_device(DEVICE))
    lines.append("* torch's SDPA (cuDNN flash attention) forward+backward, timed eagerly, against FLOPs / (peak · "
                 f"{eff.attention_efficiency:g}, or {eff.figure('masked_attention_efficiency'):g} given a sliding "
                 f"window as a mask) + {eff.attention_call_s * 1e3:g} ms per call: " + ", ".join(
                     f"{r.name} {r.measured_s * 1e3:.2f} ms ({_pct(r.error)})" for r in attention(data))
                 + ". At 2k the eager timing measures the host's dispatch; MLA's 192/128 head dims run slower.")
    lines.append("* Optimizer kernels (0.84 B parameters): " + ", ".join(
        f"{r.name} {r.measured_s * 1e3:.1f} ms ({_pct(r.error)})" for r in optimizer(data)) + ".")
    lines += ["", "| one-GPU step | measured fwd+bwd (s) | predicted (s) | error | |", "|---|---:|---:|---:|---|"]
    compared = steps(data)
    held_out = {row["name"] for row in doc["steps"] if row.get("held_out")}
    lines += [f"| {r.name} | {r.measured_s:.3f} | {r.predicted_s:.3f} | {_pct(r.error)} | "
              f"{'held out' if r.name in held_out else ''} |" for r in compared]
    errors = [abs(r.error) for r in compared]
    unseen = [abs(r.error) for r in compared if r.name in held_out]
    passes = elementwise_passes(data)
    profiled = {c["name"]: c for c in _load("profile", data)["cases"]}
    dsv2 = profiled["dsv2-lite-12l-s4k-full"]
    lines += ["", f"Steps: median |error| {statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}%; "
              f"the {len(unseen)} held out (measured after the figures were chosen; none is fitted to a step time): median "
              f"{statistics.median(unseen) * 100:.1f}%, worst {max(unseen) * 100:.1f}%. "
              "The kernels that are neither GEMMs nor attention (torch.profiler, profile.json) took "
              + ", ".join(f"{value:.1f}" for value in passes.values())
              + f" times one pass over the elementwise bytes the model counts in {', '.join(passes)}: the "
              f"`pytorch` runtime's `elementwise_passes` is {OPTIONS.profile.kernels['elementwise_passes']:g}. "
              "DeepSeek-V2-Lite reads low because the host, "
              f"not its kernels, set the pace (kernels {dsv2['kernel_s']:.3f} s of a "
              f"{dsv2['forward_backward_wall_s']:.3f} s profiled step).", ""]
    return lines


if __name__ == "__main__":
    print("\n".join(section()))
