"""The Megatron-Core profile against Megatron-LM's functional tests' measured peaks.

tests/data/measured/megatron_goldens.yaml holds, per test, its launch arguments and the
mem-max-allocated-bytes of its reference run (the last rank); benchmarks/accuracy/
megatron_goldens.py reads each as a launch script and compares the last stage's estimate
(docs/accuracy_megatron.md). The bands are the comparison's own numbers, so that a change to the
profile or the reader that moves them has to say so there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy"))
import megatron_goldens  # noqa: E402

CASES = megatron_goldens.load_cases()


@pytest.fixture(scope="module")
def comparisons() -> dict[str, megatron_goldens.Comparison]:
    return {case["id"]: megatron_goldens.compare(case) for case in CASES}


def test_every_case_is_read_as_its_test_runs_it(comparisons):
    strategies = {key: c.strategy for key, c in comparisons.items()}
    assert strategies["gpt3_mcore_te_tp2_pp2"] == "dp2 tp2 pp2 mbs4 m4 1f1b"
    assert strategies["gpt3_mcore_te_tp1_pp4_vp1"] == "dp2 tp1 pp4 vpp3 mbs4 m4 interleaved"
    assert strategies["gpt3_mcore_te_tp2_pp2_cp2"] == "dp1 tp2 sp pp2 cp2-ring mbs4 m8 1f1b"
    assert strategies["gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute"] == "dp8 tp1 pp1 mbs4 m1 1f1b rc-full"
    assert strategies["gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4"] == "dp4 tp2 sp pp1 ep4 etp1 mbs4 m2 1f1b"
    # --attention-backend unfused and --transformer-impl local keep the s x s softmax; flash does not.
    assert comparisons["gpt3_mcore_tp1_pp2"].attention == "eager"
    assert comparisons["gpt3_mcore_te_tp2_pp2"].attention == "eager"
    assert comparisons["gpt3_mcore_te_tp2_pp2_cp2"].attention == "flash"


def test_dense_cases_are_within_two_percent(comparisons):
    dense = {key: c.error for key, c in comparisons.items() if not c.is_moe}
    assert len(dense) == 9
    assert all(abs(error) < 0.02 for error in dense.values()), dense


def test_moe_cases_read_low_by_at_most_ten_percent(comparisons):
    """ndplan assumes balanced experts; the measured MoE peaks creep up with the routing."""
    moe = {key: c.error for key, c in comparisons.items() if c.is_moe}
    assert len(moe) == 3
    assert all(-0.10 < error < 0.0 for error in moe.values()), moe


def test_the_generated_page_is_current(comparisons):
    text = megatron_goldens.DOC.read_text()
    assert text == megatron_goldens.document([comparisons[case["id"]] for case in CASES])
