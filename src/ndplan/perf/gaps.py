"""What the step-time model is known to miss, said beside the number it prices.

The default efficiency profiles are checked against published training runs
(``benchmarks/published_runs.yaml``, docs/accuracy_time.md). Most land within 10%, but two kinds
of strategy read systematically fast, and a user ranking them should know it where the figure is
printed, not only in a document: mixture-of-experts models (their software's costs: dropless
routing's host syncs, grouped GEMMs, uneven routing) and PyTorch's experimental context
parallelism (torchtitan's rows at CP 2-8). ``time_known_gaps`` says so for a strategy of either
kind, with the published figures; ``tests/test_time_gaps.py`` prices the runs again and fails
when a change of the model moves a figure that these words still quote.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndplan.model.spec import ModelSpec
from ndplan.strategy import Strategy


@dataclass(frozen=True)
class PublishedMiss:
    """Step-time errors of one kind of published run against the default profiles: ``runs`` of
    them, ``fast`` read faster than measured, the median and the range of predicted / measured
    - 1 (negative: predicted faster)."""

    runs: int
    fast: int
    median: float
    lowest: float
    highest: float


#: Every published run of a mixture-of-experts model (Megatron-Bridge, Megatron-MoE-ModelZoo,
#: Megatron-Core's MoE report, NeMo AutoModel, DeepSeek-V3's report; H100, H800, B200, GB200, GB300).
MOE_RUNS = PublishedMiss(runs=41, fast=36, median=-0.167, lowest=-0.543, highest=0.088)
#: Every published run of the ``pytorch`` runtime with context parallelism (torchtitan's 8B and
#: 405B at 64K-256K tokens, CP 2-8, K/V all-gathered).
TORCH_CP_RUNS = PublishedMiss(runs=6, fast=5, median=-0.198, lowest=-0.281, highest=0.021)
#: Every published run on an Ascend NPU with tensor parallelism (MindSpeed-LLM's table: TP 8 on
#: Atlas 900 A2, MC2 on, priced as TP overlap, each collective under its own GEMM; their scripts'
#: unfused weight-gradient accumulation priced); its runs without TP read +4.2% and +3.3%.
ASCEND_TP_RUNS = PublishedMiss(runs=4, fast=4, median=-0.091, lowest=-0.311, highest=-0.055)


def is_moe_run(model: ModelSpec) -> bool:
    """The runs ``MOE_RUNS`` counts."""
    return model.is_moe


def is_torch_cp_run(strategy: Strategy, runtime: str) -> bool:
    """The runs ``TORCH_CP_RUNS`` counts: the ``pytorch`` runtime (torch's experimental context
    parallelism) with cp > 1."""
    return runtime == "pytorch" and strategy.cp > 1


def is_ascend_tp_run(strategy: Strategy, family: str) -> bool:
    """The runs ``ASCEND_TP_RUNS`` counts: an Ascend device family (``perf.efficiency.device_family``)
    with tp > 1."""
    return family.startswith("davinci") and strategy.tp > 1


def time_known_gaps(model: ModelSpec, strategy: Strategy, runtime: str, family: str = "") -> list[str]:
    """Published misses of the step-time model for strategies like ``strategy`` (the runtime
    profile's name ``runtime``, the device family ``family``), one sentence each; empty where
    the published runs of its kind landed within the default profiles' usual error."""
    gaps = []
    if is_moe_run(model):
        m = MOE_RUNS
        gaps.append(f"against {m.runs} published MoE training runs the step time read fast in {m.fast} "
                    f"(median {m.median:+.1%}, from {m.lowest:+.1%} to {m.highest:+.1%}; dense models mostly "
                    "within 10%): MoE software costs (dropless routing's host syncs, grouped GEMMs, uneven "
                    "routing) are not all priced, so treat the ranking of MoE strategies as a shortlist to "
                    "measure (docs/accuracy_time.md)")
    if is_torch_cp_run(strategy, runtime):
        c = TORCH_CP_RUNS
        gaps.append(f"PyTorch's experimental context parallelism read fast in {c.fast} of {c.runs} published "
                    f"torchtitan runs with CP 2-8 (median {c.median:+.1%}, from {c.highest:+.1%} to {c.lowest:+.1%}, "
                    "the more CP ranks the faster): expect its step to take longer than priced here "
                    "(docs/accuracy_time.md)")
    if is_ascend_tp_run(strategy, family):
        a = ASCEND_TP_RUNS
        gaps.append(f"on Ascend NPUs the step time of {a.runs} published runs with TP 8 read fast in {a.fast} "
                    f"(median {a.median:+.1%}, from {a.highest:+.1%} to {a.lowest:+.1%}; MindSpeed-LLM with MC2, "
                    "priced as TP overlap; without TP within 5%): expect a plan with tensor parallelism to take "
                    "longer than priced here (docs/accuracy_time.md)")
    if model.has_linear_attention:
        heads = model.linear_num_value_heads // strategy.tp
        gaps.append("no published training run of a Gated DeltaNet model is priced here: its chunked delta rule "
                    "runs at the rate one kernel benchmark measured on an H200 (fla 0.5.1, 32 value heads: 0.10 "
                    "of the bf16 peak), carried to this device"
                    + (f"; with {heads} value heads a device (tp={strategy.tp}) expect it slower: the same "
                       "benchmark took twice as long per head at 8" if heads < 32 else ""))
    return gaps


__all__ = ["ASCEND_TP_RUNS", "MOE_RUNS", "TORCH_CP_RUNS", "PublishedMiss", "is_ascend_tp_run", "is_moe_run",
           "is_torch_cp_run", "time_known_gaps"]
