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
    assert strategies["gpt3_7b_tp1_pp4_memory_speed"] == "dp2 tp1 pp4 vpp8 zero1 mbs1 m4 interleaved"
    # --account-for-embedding/loss-in-pipeline-split: 6 layers and the two as 8 virtual stages.
    assert strategies["gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split"] == (
        "dp2 tp1 pp4 vpp2 mbs4 m4 interleaved")
    assert strategies["gpt3_mcore_te_tp1_pp1_ep8_etp1_cp_memory_speed"] == "dp8 tp1 pp1 ep8 zero1 mbs1 m16 1f1b"
    assert strategies["gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental"] == (
        "dp2 tp2 sp pp2 vpp4 ep4 etp1 zero1 mbs4 m4 interleaved rc-selective(layernorm+moe_act+mla_up_proj+mlp)")
    # --attention-backend unfused and --transformer-impl local keep the s x s softmax; flash does not.
    assert comparisons["gpt3_mcore_tp1_pp2"].attention == "eager"
    assert comparisons["gpt3_mcore_te_tp2_pp2"].attention == "eager"
    assert comparisons["gpt3_mcore_te_tp2_pp2_cp2"].attention == "flash"


CP_HYBRID = "gpt3_mcore_te_tp1_pp2_resume_torch_dist_cp4_a2a_p2p_nondeterministic"
#: TP 4 with Transformer Engine's q and k layernorms: 3.3% low, about three q-sized tensors a layer
#: the profile does not hold (not found; the q/k norms' inputs and outputs are priced).
QK_LAYERNORM = "gpt3_mcore_te_tp4_pp1_resume_torch_dist_qk_layernorm_test_mode"


def test_dense_cases_are_within_two_percent(comparisons):
    """Up to 7B at 8k tokens (53-56 GiB measured); hierarchical CP's A100 run reads high by about the
    Hopper-sized workspaces it does not take (its test leaves PyTorch's default cuBLAS workspace)."""
    dense = {key: c.error for key, c in comparisons.items() if not c.is_moe}
    assert len(dense) == 18
    assert all(abs(error) < 0.02 for key, error in dense.items() if key not in (CP_HYBRID, QK_LAYERNORM)), dense
    assert 0.04 < dense[CP_HYBRID] < 0.07
    assert -0.04 < dense[QK_LAYERNORM] < -0.025
    big = [c for c in comparisons.values() if c.measured_bytes > 40 * 2**30]
    assert len(big) == 6 and all(abs(c.error) < 0.06 for c in big)


def test_moe_cases_within_six_percent(comparisons):
    """ndplan assumes balanced experts; the measured MoE peaks creep up with the routing."""
    moe = {key: c.error for key, c in comparisons.items() if c.is_moe}
    assert len(moe) == 10
    assert all(-0.06 < error < 0.0 for error in moe.values()), moe
    # The DeepSeek-like proxies (MLA, MTP: 32 experts over interleaved PP at 53 GiB measured; 72
    # experts over EP 8 with the all-to-all overlap and a capacity factor at 57 GiB).
    assert abs(comparisons["gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed"].error) < 0.02
    assert abs(comparisons["gpt3_mcore_te_tp1_pp1_ep8_etp1_cp_memory_speed"].error) < 0.01


def test_the_generated_page_is_current(comparisons):
    text = megatron_goldens.DOC.read_text()
    assert text == megatron_goldens.document([comparisons[case["id"]] for case in CASES])


def test_verify_takes_a_launch_script_and_a_clusters_peaks(tmp_path, capsys, comparisons):
    """`ndplan verify --from train.sh --measured peaks.json`: the script's model, strategy and
    runtime (megatron, its attention kernel), the file's peaks per global rank; the same figure
    as the goldens' comparison."""
    import json

    from ndplan.cli import main

    case = next(c for c in CASES if c["id"] == "gpt3_7b_tp1_pp4_memory_speed")
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py " + " ".join(case["args"]) + "\n")
    peaks = tmp_path / "peaks.json"
    peaks.write_text(json.dumps({"schema": "ndplan.measured-memory", "schema_version": 1, "source": "golden",
                                 "ranks": [{"rank": 7, "allocated_bytes": case["max_allocated_bytes"]}]}))
    assert main(["verify", "--from", str(script), "--measured", str(peaks), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (stage,) = [s for s in data["stages"] if s["measured_ranks"]]
    assert stage["stage"] == 3  # rank 7 of 8 with pp 4: the last stage
    row = next(r for r in stage["rows"] if r["key"] == "allocated")
    assert row["estimate_bytes"] == pytest.approx(comparisons[case["id"]].estimate_bytes)
    assert main(["verify", "--from", str(script), "--measured", str(peaks), "--tolerance", "0.1"]) == 1
    # One source for the model and strategy: the config, not the file or the flags as well.
    capsys.readouterr()
    peaks.write_text(json.dumps({"model": "llama-3.1-8b", "ranks": [{"rank": 7, "allocated_bytes": 1}]}))
    assert main(["verify", "--from", str(script), "--measured", str(peaks)]) == 2
    assert "states 'model', which the launch config (--from) gives: leave it out" in capsys.readouterr().err
    assert main(["verify", "--from", str(script), "--measured", str(peaks), "--tp", "2"]) == 2
    assert "the strategy comes from the config; drop the strategy flags" in capsys.readouterr().err


def test_verify_from_a_script_without_its_world_size_takes_devices(tmp_path, capsys):
    """A script launched without torchrun's counts (srun, a job file) needs --devices; --attention
    overrides the script's kernel."""
    import json

    from ndplan.cli import main

    case = next(c for c in CASES if c["id"] == "gpt3_mcore_te_tp2_pp2")
    script = tmp_path / "train.sh"
    script.write_text("python pretrain_gpt.py " + " ".join(case["args"]) + "\n")
    peaks = tmp_path / "peaks.json"
    peaks.write_text(json.dumps({"ranks": [{"rank": 7, "allocated_bytes": case["max_allocated_bytes"]}]}))
    args = ["verify", "--from", str(script), "--measured", str(peaks), "--json"]
    assert main(args) == 2
    assert "--devices" in capsys.readouterr().err
    assert main([*args, "--devices", "8"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*args, "--devices", "8", "--attention", "sdpa"]) == 0
    flash_like = json.loads(capsys.readouterr().out)

    def allocated(data: dict) -> float:
        stage = data["stages"][-1]
        return float(next(r for r in stage["rows"] if r["key"] == "allocated")["estimate_bytes"])

    assert allocated(flash_like) < allocated(eager)  # the script's unfused attention keeps s x s
    peaks.write_text(json.dumps({"attention": "eager", "ranks": [{"rank": 7, "allocated_bytes": 1}]}))
    assert main([*args, "--devices", "8"]) == 2
    assert "states 'attention'" in capsys.readouterr().err
