"""The composed step time: one code path for one strategy and a batch, sensible numbers, and
the switches doing what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.model import get_preset
from ndplan.perf import OverlapConfig, default_efficiency, estimate_time, evaluate, step_time_batch
from ndplan.strategy import Strategy, StrategyBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_time import mixed_strategies  # noqa: E402

LLAMA8 = get_preset("llama-3.1-8b")
LLAMA70 = get_preset("llama-3.1-70b")
DSV3 = get_preset("deepseek-v3")
H100 = get_device("h100-sxm")
LLAMA_8B = get_preset("llama-3.1-8b")
LLAMA405 = get_preset("llama-3.1-405b")
#: The H100's profile without the SMs hidden data-parallel collectives hold, for the tests that
#: derive how much of them hides by hand
NO_DP_SMS = default_efficiency(H100).replace(dp_comm_compute_share=0.0)
PARTS = ("compute_s", "tp_s", "cp_s", "ep_s", "dp_s", "pp_s", "bubble_s", "optimizer_s")


def _cluster(n: int, device: str = "h100-sxm") -> Cluster:
    return Cluster(device=get_device(device), num_devices=n)


def test_report_fields_and_breakdown_sum_to_the_step():
    s = Strategy(dp=2, tp=4, pp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=8, seq_length=8192, zero=1)
    r = estimate_time(LLAMA70, s, _cluster(16))
    d = r.to_dict()
    assert set(d) == {"step_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "hfu", "breakdown", "chunk_seconds",
                      "sends_waited", "gradient_accumulation_fusion", "caveats"}
    assert d["gradient_accumulation_fusion"] is True  # (an "unfused_why" beside False: test_accumulation.py)
    assert d["sends_waited"] is True  # Megatron's 1F1B (the default profile's p2p_wait)
    assert set(d["breakdown"]) == {"compute", "comm_exposed", "bubble", "optimizer"}
    assert set(d["breakdown"]["comm_exposed"]) == {"tp", "cp", "ep", "dp", "offload", "pp"}
    b = d["breakdown"]
    assert b["compute"] + sum(b["comm_exposed"].values()) + b["bubble"] + b["optimizer"] == pytest.approx(r.step_s)
    assert r.tokens_per_s == pytest.approx(16 * 8192 / r.step_s)
    assert r.tokens_per_s_per_device == pytest.approx(r.tokens_per_s / 16)
    assert b["comm_exposed"]["tp"] > 0 and b["comm_exposed"]["pp"] > 0 and b["bubble"] > 0


def test_explain_names_every_term_with_values():
    s = Strategy(dp=8, tp=1, micro_batch_size=1, num_micro_batches=4, seq_length=4096, zero=1)
    lines = estimate_time(LLAMA8, s, _cluster(8)).explain()
    text = "\n".join(lines)
    for term in ("GEMM rate", "attention core", "dense layer", "pipeline", "DP per step", "optimizer", "MFU", "step ="):
        assert term in text
    assert all(isinstance(line, str) and line for line in lines)


def test_explain_names_the_expert_data_parallel_link():
    """Qwen3-30B-A3B ep 8 over 32 H100s: the experts' gradients reduce over dp·cp·tp/(ep·etp) =
    4 ranks at stride 8, one per node: the NIC's 50 GB/s · 0.85 = 42 GB/s, under ZeRO-0's
    all-reduce too (the explanation said nothing of the experts without ZeRO, and never named
    their link)."""
    qwen = get_preset("qwen3-30b-a3b")
    for zero in (0, 1):
        s = Strategy(dp=32, ep=8, num_micro_batches=2, seq_length=4096, zero=zero)
        text = "\n".join(estimate_time(qwen, s, _cluster(32)).explain())
        assert "experts over 4 ranks at stride ep·etp (42 GB/s scale-out)" in text


def test_explain_names_the_link_each_kind_of_context_parallelism_uses():
    """On the Ascend 910B's HCCS full mesh (196 GB/s · 0.7 over 7 links per NPU) a ring send
    takes one link, 19.6 GB/s, and an all-to-all over 4 its 3 links, 58.8 GB/s: Ulysses was
    explained with the ring's 20 GB/s while priced at 59 (layer._cp_seconds)."""
    base = dict(dp=2, cp=4, num_micro_batches=1, seq_length=8192)
    cluster = _cluster(8, "ascend-910b")

    def line(**settings) -> str:
        text = estimate_time(LLAMA8, Strategy(**base, **settings), cluster).explain()
        return next(x for x in text if x.strip().startswith("CP ("))

    assert "ring over cp=4 at stride tp (20 GB/s scale-up)" in line()
    assert "all-to-alls over cp=4 at stride tp (59 GB/s scale-up)" in line(cp_kind="ulysses")
    hybrid = line(cp_kind="hybrid", ulysses_degree=2)
    assert "all-to-alls over ulysses_degree=2 at stride tp (20 GB/s" in hybrid and "ring over 2 at stride tp·2" in hybrid


def test_invalid_strategy_is_refused_with_the_rules_it_breaks():
    with pytest.raises(NdplanError, match="dp·tp·pp·cp"):
        estimate_time(LLAMA8, Strategy(dp=3, tp=1), _cluster(8))


# (the pytorch runtime's kernels: FSDP2's copies on the compute stream, ZeRO-2's too, and its CPU offload)
PYTORCH_KERNELS = {"fsdp_stream_copies": True, "fsdp_cpu_offload": True}


@pytest.mark.parametrize("software", [None, {"p2p_wait": "1f1b+interleaved"}, PYTORCH_KERNELS])
@pytest.mark.parametrize(("model", "devices"), [(LLAMA70, 256), (DSV3, 512)])
def test_a_batch_prices_each_strategy_as_it_would_alone(model, devices, software):
    """Deduplication and grouping must not change any number: every row of a mixed batch
    equals the same strategy priced as a batch of one (some with several pipeline runs, some
    with the optimizer on the CPU), also where the looped schedules wait for their sends (their
    seconds vary with the pipeline's links, not with the layer configuration alone) and under
    the pytorch runtime's FSDP copies (ZeRO-2 rows beside ZeRO-1 ones were priced as ZeRO-1's)."""
    batch = mixed_strategies(model, devices, 120, seed=3)
    runs = np.where((batch.pp > 1) & (np.arange(len(batch)) % 3 == 0), 2, 1)
    batch = StrategyBatch.from_columns({**{n: getattr(batch, n) for n in batch.array_fields()}, "pipeline_runs": runs,
                                        "global_batch_size": batch.global_batch_size * runs}, batch.precision)
    # Each sharded row twice, its optimizer on the device and on the CPU (FSDP2's CPU offload
    # copies its shards: a row must not take its twin's layer prices).
    sharded = np.flatnonzero(batch.zero >= 2)
    twins = batch.take(sharded)
    offloaded = StrategyBatch.from_columns({**{n: getattr(twins, n) for n in twins.array_fields()},
                                            "optimizer_offload": np.ones(len(twins), dtype=np.int64)}, batch.precision)
    batch = StrategyBatch.concat([batch, offloaded])
    cluster = _cluster(devices)
    together = step_time_batch(model, batch, cluster, software=software)
    for i in range(len(batch)):
        alone = step_time_batch(model, batch.take(np.array([i])), cluster, software=software)
        for key in ("step_s", "mfu", "compute_s", "dp_s", "bubble_s", "ep_s", "pp_s"):
            assert together[key][i] == pytest.approx(alone[key][0], rel=1e-12, abs=1e-15), (i, key)


def test_layouts_whose_degrees_once_packed_alike_are_priced_apart():
    """pp 2 × vpp 66 and pp 3 × vpp 2 once shared a group key (pp·64 + vpp = 194 both), so a
    batch holding both priced the second on the first's stage layout (0.2918 s for its 0.2234 s
    alone). Each row of the batch must be what it is alone."""
    from ndplan.model.spec import ModelSpec

    deep = ModelSpec(name="deep", num_layers=132, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8,
                     num_kv_heads=8, head_dim=128, vocab_size=32000)
    a = Strategy(dp=3, pp=2, vpp=66, schedule="interleaved", num_micro_batches=4, seq_length=1024)
    b = Strategy(dp=2, pp=3, vpp=2, schedule="interleaved", num_micro_batches=6, seq_length=1024)
    cluster = _cluster(6)
    together = step_time_batch(deep, StrategyBatch.of([a, b]), cluster)["step_s"]
    for i, s in enumerate((a, b)):
        assert together[i] == step_time_batch(deep, StrategyBatch.of(s), cluster)["step_s"][0]


@pytest.mark.parametrize(("model", "devices"), [(LLAMA70, 256), (DSV3, 512)])
def test_batch_outputs_are_finite_and_parts_sum_to_the_step(model, devices):
    batch = mixed_strategies(model, devices, 2000, seed=1)
    out = step_time_batch(model, batch, _cluster(devices))
    assert np.all(np.isfinite(out["step_s"])) and np.all(out["step_s"] > 0)
    assert np.all(np.array([out[p] for p in PARTS]) >= 0)
    np.testing.assert_allclose(sum(out[p] for p in PARTS), out["step_s"], rtol=1e-12)
    assert np.all(out["hfu"] >= out["mfu"] - 1e-12)
    assert np.all((out["mfu"] > 0) & (out["mfu"] < 1))


def test_simulated_and_closed_form_steps_agree():
    cluster = _cluster(64)
    cases = [
        Strategy(dp=2, tp=4, pp=8, vpp=2, schedule="interleaved", sequence_parallel=True, num_micro_batches=16, seq_length=4096, zero=1),
        Strategy(dp=2, tp=4, pp=8, schedule="1f1b", sequence_parallel=True, num_micro_batches=32, seq_length=4096, zero=1),
        Strategy(dp=2, tp=4, pp=8, schedule="zb-h1", sequence_parallel=True, num_micro_batches=32, seq_length=4096, zero=1),
        Strategy(dp=2, tp=4, pp=8, vpp=2, schedule="zbv", sequence_parallel=True, num_micro_batches=32, seq_length=4096, zero=1),
        Strategy(dp=2, tp=4, pp=8, vpp=2, schedule="dualpipev", sequence_parallel=True, num_micro_batches=32, seq_length=4096, zero=1),
    ]
    for s in cases:
        simulated = estimate_time(LLAMA70, s, cluster).step_s
        closed = step_time_batch(LLAMA70, StrategyBatch.of(s), cluster)["step_s"][0]
        assert closed == pytest.approx(simulated, rel=0.05), s.short()


def test_mfu_of_a_known_configuration_is_in_a_sensible_range():
    # Llama-3.1-8B, 8 H100, data parallel with the distributed optimizer, 8k tokens: public
    # Megatron/NeMo BF16 runs of this shape report 40-55% MFU.
    s = Strategy(dp=8, micro_batch_size=1, num_micro_batches=16, seq_length=8192, zero=1)
    r = estimate_time(LLAMA8, s, _cluster(8))
    assert 0.35 < r.mfu < 0.65
    assert r.hfu == pytest.approx(r.mfu)  # nothing recomputed


def test_more_data_parallelism_never_lowers_total_throughput():
    per_device = dict(tp=8, micro_batch_size=1, num_micro_batches=8, seq_length=4096, zero=1, sequence_parallel=True)
    previous = 0.0
    for dp in (1, 2, 4, 8, 16, 32, 64):
        r = estimate_time(LLAMA70, Strategy(dp=dp, **per_device), _cluster(8 * dp))
        assert r.tokens_per_s >= previous * (1 - 1e-9), dp
        previous = r.tokens_per_s
    # and per device it does not collapse: the gradient reduce hides under the backward
    assert previous / 512 > 0.8 * estimate_time(LLAMA70, Strategy(dp=1, **per_device), _cluster(8)).tokens_per_s / 8


def test_recompute_costs_time_and_adds_hardware_flops():
    base = dict(dp=1, tp=8, sequence_parallel=True, micro_batch_size=1, num_micro_batches=4, seq_length=8192)
    cluster = _cluster(8)
    none = estimate_time(LLAMA70, Strategy(**base), cluster)
    selective = estimate_time(LLAMA70, Strategy(recompute="selective", **base), cluster)
    full = estimate_time(LLAMA70, Strategy(recompute="full", **base), cluster)
    assert none.step_s < selective.step_s < full.step_s
    assert full.hfu > full.mfu and none.hfu == pytest.approx(none.mfu)
    # full recompute re-runs the forward: ~1/3 more compute on a compute-bound layer stack
    assert 1.2 < full.breakdown["compute"] / none.breakdown["compute"] < 1.45


def test_tensor_parallel_overlap_hides_tp_communication():
    s = Strategy(dp=1, tp=8, sequence_parallel=True, micro_batch_size=1, num_micro_batches=4, seq_length=8192)
    cluster = _cluster(8)
    plain = estimate_time(LLAMA70, s, cluster)
    hidden = estimate_time(LLAMA70, s, cluster, overlap=OverlapConfig(tp=True))
    assert plain.breakdown["comm_exposed"]["tp"] > 0
    # (all but the output projection's pair in each pass: its GEMM, 2·1024·8192 FLOPs a token, is
    # shorter than its collective, 8192·2·7/8 bytes over NVLink; test_the_backward_pairs_...)
    assert hidden.breakdown["comm_exposed"]["tp"] < 0.25 * plain.breakdown["comm_exposed"]["tp"]
    assert hidden.step_s < plain.step_s


def test_dualpipev_hides_the_expert_all_to_all():
    cluster = _cluster(1024)
    common = dict(dp=64, pp=16, ep=64, vpp=2, num_micro_batches=128, seq_length=4096, zero=1)
    dualpipe = estimate_time(DSV3, Strategy(schedule="dualpipev", **common), cluster)
    zbv = estimate_time(DSV3, Strategy(schedule="zbv", **common), cluster)
    assert dualpipe.breakdown["comm_exposed"]["ep"] < 0.5 * zbv.breakdown["comm_exposed"]["ep"]
    forced_off = estimate_time(DSV3, Strategy(schedule="dualpipev", **common), cluster, overlap=OverlapConfig(ep=False))
    assert forced_off.breakdown["comm_exposed"]["ep"] > dualpipe.breakdown["comm_exposed"]["ep"]


def test_expert_overlap_leaves_warm_up_and_cool_down_exposed():
    """Only forwards with a partner backward hide their all-to-all. DualPipeV's first stage at
    pp 16 runs 47 of its 2m forwards unpaired (pp·3 − 1), so with m = 2·pp = 32 it hides only
    17/64 of what it hides per pass with many micro-batches; Megatron's interleaved overlap
    leaves the warm-up, (pp − 1)·2 + (vpp − 1)·pp forwards, exposed."""
    from ndplan.schedule.pairing import unpaired_forwards

    assert unpaired_forwards("dualpipev", 16, 2, 32) == (47, 64)
    assert unpaired_forwards("dualpipev", 16, 2, 128) == (47, 256)
    assert unpaired_forwards("interleaved", 8, 4, 128) == ((8 - 1) * 2 + (4 - 1) * 8, 512)
    assert unpaired_forwards("1f1b", 4, 1, 8) == (3, 8)
    assert unpaired_forwards("1f1b", 1, 1, 8) == (1, 8)  # a forward cannot hide under its own backward
    from ndplan.perf.efficiency import default_efficiency as efficiency_of
    from ndplan.perf.layer import LayerContext, piece_times
    from ndplan.perf.step import compute_rates, strategy_columns
    from ndplan.perf.topology import Fabric

    cluster = _cluster(1024)
    common = dict(dp=64, pp=16, ep=64, vpp=2, seq_length=4096, zero=1, schedule="dualpipev")
    batch = StrategyBatch.of([Strategy(num_micro_batches=m, **common) for m in (32, 128)])
    eff = efficiency_of(cluster.device)
    per_pass = {}
    for ep in (True, False):
        overlap = OverlapConfig(ep=ep)
        ctx = LayerContext(DSV3, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap,
                           batch.precision, False)
        moe = piece_times(ctx, strategy_columns(DSV3, batch, overlap))["moe"]
        per_pass[ep] = np.broadcast_to(moe.get("F", "ep") + moe.get("B", "ep"), (2,))
    hidden = per_pass[False] - per_pass[True]  # what overlap saves per layer and micro-batch
    assert hidden[1] > 0.0
    assert hidden[0] == pytest.approx(hidden[1] * (17 / 64) / (209 / 256), rel=1e-9)


def test_a_paired_layer_exposes_what_each_phase_of_megatrons_combined_1f1b_leaves():
    """Megatron-Core's combined 1F1B runs a forward layer beside another micro-batch's backward
    in three phases (TransformerLayerSchedulePlan.run): combine_B beside attention_F; dispatch_F
    then dispatch_B beside experts_B, experts_W, experts_F (experts_F waits for dispatch_F,
    dispatch_B for experts_B); combine_F beside attention_B. By hand, seconds: dispatch_F 3,
    combine_F 2, dispatch_B 2, combine_B 2; attention F 1, B 4; experts F 2, B 3, W 1."""
    from ndplan.perf.layer import paired_exposure

    comm, attention, experts = (3.0, 2.0, 2.0, 2.0), (1.0, 4.0), (2.0, 3.0, 1.0)
    # Phase 1 waits 2 - 1 = 1 for combine_B (the backward's); phase 2 ends at max(max(4, 3) + 2,
    # max(3, 3) + 2) = 6 = its compute; phase 3 hides combine_F under attention_B.
    assert paired_exposure(comm, attention, experts) == pytest.approx((0.0, 1.0))
    # A dispatch_F of 5 holds experts_F back: phase 2 ends at max(5 + 2, 5 + 2) = 7, one second
    # over its compute, split 5 : 2 by the dispatches. (Counting all of a pass's all-to-alls
    # against all of its compute, the forward's 5 + 2 against 1 + 2, exposed 4.)
    assert paired_exposure((5.0, 2.0, 2.0, 2.0), attention, experts) == pytest.approx((5 / 7, 1.0 + 2 / 7))
    # Where a hidden all-to-all's kernels hold 10% of the SMs, the compute beside it slows by
    # that share of what it hides: phase 1 1 + 0.1·1, phase 2 0.1·min(5, 6), phase 3 0.1·2.
    assert paired_exposure(comm, attention, experts, 0.1) == pytest.approx((0.2 + 0.5 * 3 / 5, 1.1 + 0.5 * 2 / 5))
    # A host-bound pair leaves the GPU idle 0.4 s beyond its GPU work: the all-to-alls run there
    # first (and a faster device, which adds to that slack, never lengthens the pair).
    assert paired_exposure((5.0, 2.0, 2.0, 2.0), attention, experts, slack=0.4) == pytest.approx(
        (5 / 7 * (2 - 0.4) / 2, (1.0 + 2 / 7) * (2 - 0.4) / 2))


def test_hidden_all_to_all_still_holds_its_sms():
    """A hidden expert all-to-all slows the compute it hides under by the SM share its kernels
    hold (20 of the H100's 132): where the all-to-all hides whole, exposed EP time is that share
    of the all-to-all's own time, as priced exposed with the overlap off."""
    cluster = _cluster(64)
    s = Strategy(dp=8, pp=8, ep=8, vpp=2, schedule="dualpipev", num_micro_batches=32, seq_length=4096, zero=1)
    eff = default_efficiency(H100)
    assert eff.ep_comm_compute_share == pytest.approx(20 / 132)
    free = estimate_time(DSV3, s, cluster, efficiency=eff.replace(ep_comm_compute_share=0.0))
    held = estimate_time(DSV3, s, cluster, efficiency=eff)
    shown = estimate_time(DSV3, s, cluster, efficiency=eff, overlap=OverlapConfig(ep=False))
    # Inside a node the paired passes hide all of it; the unpaired ones (warm-up, cool-down) none.
    from ndplan.schedule.pairing import unpaired_forwards

    unpaired, forwards = unpaired_forwards("dualpipev", 8, 2, 32)
    alone = unpaired / forwards
    exposed = shown.breakdown["comm_exposed"]["ep"]
    assert free.breakdown["comm_exposed"]["ep"] == pytest.approx(alone * exposed)
    assert held.breakdown["comm_exposed"]["ep"] == pytest.approx((alone + (1 - alone) * eff.ep_comm_compute_share) * exposed)


def test_fsdp_prefetch_and_dp_overlap_hide_data_parallel_traffic():
    s = Strategy(dp=64, zero=3, fsdp=True, micro_batch_size=2, num_micro_batches=1, seq_length=8192, precision="fsdp-bf16")
    cluster = _cluster(64)
    hidden = estimate_time(LLAMA8, s, cluster)
    exposed = estimate_time(LLAMA8, s, cluster, overlap=OverlapConfig(fsdp_prefetch=False, dp_grad_reduce=False))
    assert exposed.breakdown["comm_exposed"]["dp"] > 2 * hidden.breakdown["comm_exposed"]["dp"]


def test_fp8_speeds_up_a_compute_bound_model():
    s = dict(dp=1, tp=8, sequence_parallel=True, micro_batch_size=1, num_micro_batches=8, seq_length=4096)
    cluster = _cluster(8)
    bf16 = estimate_time(LLAMA70, Strategy(**s), cluster)
    fp8 = estimate_time(LLAMA70, Strategy(precision="megatron-fp8", **s), cluster)
    # TP 8 leaves shallow reductions (the o-projection sums over 8192/8 = 1024 elements), where
    # fp8 GEMMs lose more to per-tile overhead than bf16 (gemm.depth_factor): ~1.10 here.
    assert 1.05 < bf16.step_s / fp8.step_s < 1.8


def test_context_parallel_ring_hides_under_attention():
    s = Strategy(dp=1, tp=1, cp=8, micro_batch_size=1, num_micro_batches=2, seq_length=131072)
    cluster = _cluster(8)
    hidden = estimate_time(LLAMA8, s, cluster)
    exposed = estimate_time(LLAMA8, s, cluster, overlap=OverlapConfig(cp_ring=False))
    assert hidden.breakdown["comm_exposed"]["cp"] < exposed.breakdown["comm_exposed"]["cp"]
    ulysses = estimate_time(LLAMA8, s.model_copy(update={"cp_kind": "ulysses"}), cluster)
    assert ulysses.breakdown["comm_exposed"]["cp"] > 0


def test_context_parallel_ring_hides_only_under_the_steps_it_overlaps():
    # Transformer Engine's ring: step i's send of the next K/V block runs under step i's
    # attention, and the last step computes with nothing in flight. With load-balanced causal
    # chunks every step is the same share, so cp - 1 sends hide under (cp - 1)/cp of the
    # attention, never under all of it. Hand-derived on 16 A100s (no fixed attention call
    # cost), Llama-3.1-8B, tp 8, cp 2 (stride 8: the ring crosses nodes), seq 8192, one layer's
    # forward per micro-batch:
    #   K,V per step = (8192/2 tokens)·(8 + 8 heads·128)/8·2 B = 2,097,152 B
    #   send = 10 µs + 2,097,152 B / (25 GB/s · 0.85) = 108.69 µs (1 step)
    #   attention = 2·(32/8 heads)·(128 + 128)·(8192·8193/2)/2 FLOPs / (312 TFLOP/s · 0.6)
    #             = 34.36 GFLOP / 187.2 TFLOP/s = 183.55 µs, 91.78 µs a step
    #   exposed forward = 108.69 - 91.78 = 16.91 µs (all of the attention as cover: 0);
    #   backward 2 sends, 2·10 µs + 2·98.69 µs = 217.38 µs under 2.5·183.55 = 458.88 µs: hidden.
    s = Strategy(dp=1, tp=8, cp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=2, seq_length=8192)
    cluster = _cluster(16, "a100-80gb")
    kv = 4096 * (8 + 8) * 128 / 8 * 2
    send = 10e-6 + kv / (25e9 * 0.85)
    attention = 2 * 4 * 256 * (8192 * 8193 / 2) / 2 / (312e12 * 0.6)
    per_layer = send - attention / 2
    assert per_layer == pytest.approx(16.91e-6, abs=0.01e-6)
    r = estimate_time(LLAMA8, s, cluster)
    assert r.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * per_layer, rel=1e-6)


def test_context_parallel_ring_backward_sends_under_every_step():
    # Transformer Engine's ring backward sends at every one of its cp steps, each under that
    # step's attention backward: the first K,V alone, the middle ones K,V with the dK,dV
    # accumulated so far, the last dK,dV alone (cp sends, 2(cp - 1) blocks). So the whole
    # attention backward covers them and each send pays the latency. Hand-derived on 16 A100s,
    # Llama-3.1-8B, tp 8, cp 2 across nodes, seq 6144, per layer and micro-batch:
    #   K,V block = 3072·(8 + 8)·128/8·2 B = 1,572,864 B: 74.02 µs over 25 GB/s · 0.85
    #   forward: 10 + 74.02 = 84.02 µs under half the attention, 2·4·256·(6144·6145/2)/2 FLOPs
    #            / 187.2 TFLOP/s = 103.26 µs, 51.63 µs: 32.39 µs exposed
    #   backward: 2·10 + 2·74.02 = 168.03 µs under 2.5·103.26 = 258.15 µs: hidden (under half
    #            of it, 38.96 µs would show); with the ring's overlap off, all 168.03 µs (the
    #            backward was priced as one send, 158.03 µs).
    s = Strategy(dp=1, tp=8, cp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=2, seq_length=6144)
    cluster = _cluster(16, "a100-80gb")
    block = 3072 * 16 * 128 / 8 * 2 / (25e9 * 0.85)
    attention = 2 * 4 * 256 * (6144 * 6145 / 2) / 2 / (312e12 * 0.6)
    forward = 10e-6 + block - attention / 2
    backward = 2 * 10e-6 + 2 * block
    assert (forward, backward, 2.5 * attention) == (
        pytest.approx(32.39e-6, abs=0.01e-6), pytest.approx(168.03e-6, abs=0.01e-6), pytest.approx(258.15e-6, abs=0.01e-6))
    hidden = estimate_time(LLAMA8, s, cluster)
    assert hidden.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * forward, rel=1e-6)
    exposed = estimate_time(LLAMA8, s, cluster, overlap=OverlapConfig(cp_ring=False))
    assert exposed.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * (10e-6 + block + backward), rel=1e-6)


def test_cross_node_tensor_parallelism_is_slower():
    mha = LLAMA70.model_copy(update={"name": "mha-70b", "num_kv_heads": 64, "num_layers": 8, "layer_mlp_kinds": ("dense",) * 8})
    cluster = _cluster(16)
    inside = dict(dp=2, tp=8, sequence_parallel=True, num_micro_batches=4, seq_length=4096)
    across = dict(dp=1, tp=16, sequence_parallel=True, num_micro_batches=8, seq_length=4096)
    # the same tokens per step; a 16-way TP group spans two 8-GPU NVLink domains
    assert estimate_time(mha, Strategy(**across), cluster).breakdown["comm_exposed"]["tp"] > (
        3 * estimate_time(mha, Strategy(**inside), cluster).breakdown["comm_exposed"]["tp"]
    )


def test_explicit_stage_layers_move_the_bottleneck():
    cluster = _cluster(4)
    even = Strategy(pp=4, num_micro_batches=16, seq_length=4096)
    skewed = even.model_copy(update={"stage_layers": (14, 6, 6, 6)})
    assert estimate_time(LLAMA8, skewed, cluster).step_s > estimate_time(LLAMA8, even, cluster).step_s


def test_evaluate_details_and_user_efficiency():
    s = Strategy(dp=8, num_micro_batches=4, seq_length=4096, zero=1)
    batch = StrategyBatch.of(s)
    slow = default_efficiency(H100).replace(gemm_efficiency=0.4)
    fast = evaluate(LLAMA8, batch, _cluster(8), details=True)
    slower = evaluate(LLAMA8, batch, _cluster(8), efficiency=slow)
    assert "makespan_s" in fast and "makespan_s" not in slower
    assert slower["step_s"][0] > 1.3 * fast["step_s"][0]


def test_node_dedup_dispatch_cuts_ep_traffic():
    """DeepEP/HybridEP: a token crosses the network once per distinct remote node."""
    cluster = _cluster(1024)
    common = dict(dp=64, pp=16, ep=64, num_micro_batches=32, seq_length=4096, zero=1)
    plain = estimate_time(DSV3, Strategy(**common), cluster, overlap=OverlapConfig(ep=False))
    dedup = estimate_time(DSV3, Strategy(**common), cluster, overlap=OverlapConfig(ep=False, ep_dispatch="node_dedup"))
    assert dedup.to_dict()["breakdown"]["comm_exposed"]["ep"] < 0.8 * plain.to_dict()["breakdown"]["comm_exposed"]["ep"]
    # EP inside one NVLink domain: DeepEP still sends a token once per destination rank (below);
    # the all-to-all dispatcher's extra chunk sort is local HBM traffic, in compute
    inside = dict(common, ep=8)
    a = estimate_time(DSV3, Strategy(**inside), cluster, overlap=OverlapConfig(ep=False))
    b = estimate_time(DSV3, Strategy(**inside), cluster, overlap=OverlapConfig(ep=False, ep_dispatch="node_dedup"))
    assert b.breakdown["comm_exposed"]["ep"] < a.breakdown["comm_exposed"]["ep"]
    assert a.breakdown["compute"] > b.breakdown["compute"]


def test_per_expert_latency_makes_many_small_experts_slower():
    from ndplan.perf.flops import Gemm
    from ndplan.perf.gemm import ComputeRates, gemm_seconds

    rates = ComputeRates(1e15, 0.75, 256.0, 0.9, 5e14, 2.6e12, 2.0, expert_latency=5e-6)
    few = Gemm("experts_up", 64.0, 1536.0, 2048.0, count=32.0, expert=True)
    dense = Gemm("up", 64.0, 1536.0, 2048.0, count=32.0)
    assert float(gemm_seconds(few, rates)) == pytest.approx(float(gemm_seconds(dense, rates)) + 32 * 5e-6)


# A small MoE model for hand-derived EP numbers: h 1024, 16 experts, top-4, experts of 512.
TINY_MOE = get_preset("qwen3-30b-a3b").model_copy(update={
    "name": "tiny-moe", "num_layers": 2, "layer_mlp_kinds": ("moe", "moe"), "hidden_size": 1024,
    "num_attention_heads": 8, "num_kv_heads": 8, "head_dim": 128, "num_experts": 16,
    "num_experts_per_tok": 4, "moe_ffn_hidden_size": 512, "vocab_size": 1024,
})


def test_fp8_dispatch_moves_one_byte_per_element_instead_of_two():
    """Megatron-Core dispatches in bf16 and quantises inside the expert GEMM; with
    ep_dispatch_fp8 the dispatch all-to-all carries fp8. Inside one 8-GPU NVLink domain (H100:
    450 GB/s x 0.8) the difference per MoE layer is the dispatch's (n-1)/n share of
    T·k·h·(2 - 1) bytes: 4096·4·1024·(7/8) / 360e9 = 40.78 us; 2 layers, 1 micro-batch."""
    s = Strategy(dp=8, ep=8, micro_batch_size=1, num_micro_batches=1, seq_length=4096, zero=1, precision="megatron-fp8")
    cluster = _cluster(8)
    bf16 = estimate_time(TINY_MOE, s, cluster, overlap=OverlapConfig(ep=False))
    fp8 = estimate_time(TINY_MOE, s, cluster, overlap=OverlapConfig(ep=False, ep_dispatch_fp8=True))
    expected = 2 * 4096 * 4 * 1024 * (7 / 8) / (450e9 * 0.8)
    assert bf16.breakdown["comm_exposed"]["ep"] - fp8.breakdown["comm_exposed"]["ep"] == pytest.approx(expected, rel=1e-9)


def test_fp8_dispatch_is_refused_for_bf16_experts():
    """ep_dispatch_fp8 sends the fp8 its expert GEMMs read; under bf16 GEMMs no runtime
    dispatches fp8 (Megatron-Core's, DeepEP's and HybridEP's dispatchers send bf16), and the
    switch priced 2 bytes as though off (Mixtral dp8 ep8: 368.2 µs forward either way): it is
    refused, naming the switch. A dense model has no dispatch for it to act on."""
    s = Strategy(dp=8, ep=8, seq_length=4096, zero=1)
    with pytest.raises(NdplanError, match="ep_dispatch_fp8.*megatron-bf16"):
        estimate_time(TINY_MOE, s, _cluster(8), overlap=OverlapConfig(ep_dispatch_fp8=True))
    dense = Strategy(dp=8, seq_length=4096, zero=1)
    assert estimate_time(LLAMA8, dense, _cluster(8), overlap=OverlapConfig(ep_dispatch_fp8=True)).step_s > 0


def test_deduplicating_dispatch_sends_a_token_once_per_destination_rank():
    """DeepEP/HybridEP send a token once to each rank holding any of its k experts (the rank
    copies it to its local experts itself): D = R·(1 - C(E - E/R, k)/C(E, k)) copies instead of k.
    TINY_MOE (16 experts, top-4) over 8 ranks of one node: D = 8·(1 - C(14, 4)/C(16, 4)) = 3.6. Each
    of a layer's 4 all-to-alls (dispatch and combine, forward and backward) moves the (n-1)/n
    share of T·k·h·2 bytes over NVLink (450 GB/s x 0.8) with the all-to-all dispatcher, D/k of
    it deduplicated; 2 layers, 1 micro-batch. With the contiguous routing of a benchmarking
    gate (experts 4t..4t+3, two per rank) a token reaches D = 2 ranks."""
    from math import comb

    from ndplan.perf.layer import ranks_per_token

    assert ranks_per_token(8.0, 4.0, 16.0) == pytest.approx(8 * (1 - comb(14, 4) / comb(16, 4)), rel=1e-12)
    # 64 ranks of 4 experts, routing limited to 16 of them (64 experts): C(60, 8)/C(64, 8)
    assert ranks_per_token(64.0, 8.0, 256.0, 16.0) == pytest.approx(16 * (1 - comb(60, 8) / comb(64, 8)), rel=1e-12)
    # one expert per rank (Mixtral over ep 8): a token's 2 experts are 2 ranks, nothing to save
    assert ranks_per_token(8.0, 2.0, 8.0) == pytest.approx(2.0, rel=1e-12)
    s = Strategy(dp=8, ep=8, micro_batch_size=1, num_micro_batches=1, seq_length=4096, zero=1)
    cluster = _cluster(8)

    def ep_seconds(**overlap: object) -> float:
        report = estimate_time(TINY_MOE, s, cluster, overlap=OverlapConfig(ep=False, **overlap))
        return float(report.breakdown["comm_exposed"]["ep"])

    plain = ep_seconds()
    one = 4096 * 4 * 1024 * 2 * (7 / 8) / (450e9 * 0.8)  # one all-to-all's bytes, plain
    uniform = 8 * (1 - comb(14, 4) / comb(16, 4))
    assert plain - ep_seconds(ep_dispatch="node_dedup") == pytest.approx(2 * 4 * one * (1 - uniform / 4), rel=1e-9)
    assert plain - ep_seconds(ep_dispatch="node_dedup", ep_routing="contiguous") == pytest.approx(
        2 * 4 * one * (1 - 2 / 4), rel=1e-9)
    # the all-to-all dispatcher sends every copy whatever the routing
    assert ep_seconds(ep_routing="contiguous") == pytest.approx(plain, rel=1e-12)


def test_node_limited_routing_reaches_fewer_remote_nodes():
    from math import comb

    from ndplan.perf.layer import remote_nodes_per_token

    # 8 nodes of 32 of DeepSeek-V3's 256 experts, 8 distinct experts per token: a node is missed
    # with probability C(224, 8)/C(256, 8); 7/8 of the nodes reached are remote
    assert remote_nodes_per_token(8.0, 8.0, 256.0) == pytest.approx(8 * (1 - comb(224, 8) / comb(256, 8)) * 7 / 8, rel=1e-12)
    assert remote_nodes_per_token(8.0, 8.0, 256.0) == pytest.approx(4.6328, abs=1e-4)
    # at most 4 of the 8 nodes (DeepSeek-V3): the 128 experts of those 4, 32 per node
    assert remote_nodes_per_token(8.0, 8.0, 256.0, 4) == pytest.approx(4 * (1 - comb(96, 8) / comb(128, 8)) * 7 / 8, rel=1e-12)
    assert remote_nodes_per_token(8.0, 8.0, 256.0, 16) == pytest.approx(remote_nodes_per_token(8.0, 8.0, 256.0))
    assert remote_nodes_per_token(1.0, 8.0, 256.0) == 0.0
    # one expert per node: every expert on its own node, k of them
    assert remote_nodes_per_token(8.0, 2.0, 8.0) == pytest.approx(2 * 7 / 8, rel=1e-12)
    # through the step: fewer network copies, less exposed EP time
    cluster = _cluster(1024)
    s = Strategy(dp=64, pp=16, ep=64, num_micro_batches=32, seq_length=4096, zero=1)
    free = estimate_time(DSV3, s, cluster, overlap=OverlapConfig(ep=False, ep_dispatch="node_dedup"))
    limited = estimate_time(DSV3, s, cluster, overlap=OverlapConfig(ep=False, ep_dispatch="node_dedup", ep_node_limit=4))
    assert limited.breakdown["comm_exposed"]["ep"] < 0.8 * free.breakdown["comm_exposed"]["ep"]


def test_dropless_sync_serialises_the_attention_block_with_the_expert_launches():
    """Host-bound MoE forward: the token-count sync drains the GPU queue, so the GPU time
    before it (attention block and router, g_pre) adds to the host's launches after it:
    F >= (host_f - host_layer_s) + g_pre. With host_layer_s 0 the whole 20 ms host forward
    comes after the sync; with host_layer_s = host_f none of it does."""
    from ndplan.perf.efficiency import default_efficiency as eff_of
    from ndplan.perf.flops import Sharding, attention_gemms, layer_gemms
    from ndplan.perf.gemm import gemms_seconds
    from ndplan.perf.layer import LayerContext, attention_core_seconds
    from ndplan.perf.overlap import OverlapConfig as Ov
    from ndplan.perf.step import compute_rates
    from ndplan.perf.topology import Fabric

    s = Strategy(dp=8, ep=8, micro_batch_size=1, num_micro_batches=1, seq_length=4096, zero=1)
    cluster = _cluster(8)
    base = eff_of(H100).replace(host_moe_layer_s=20e-3, host_expert_s=0.0)
    after = evaluate(TINY_MOE, StrategyBatch.of(s), cluster, efficiency=base.replace(host_layer_s=0.0), details=True)
    before = evaluate(TINY_MOE, StrategyBatch.of(s), cluster, efficiency=base.replace(host_layer_s=20e-3), details=True)
    batch = StrategyBatch.of(s)
    rates = compute_rates(cluster, batch, base)
    ctx = LayerContext(TINY_MOE, rates, Fabric.of(cluster, base), base, Ov(), batch.precision)
    sh = Sharding(1.0, 4096.0, 1.0, 1.0, 8.0, 1.0)
    pre = attention_gemms(TINY_MOE, sh) + [g for g in layer_gemms(TINY_MOE, sh, "moe") if g.name == "router"]
    g_pre = gemms_seconds(pre, rates, "F")[0] + attention_core_seconds(ctx, sh)[0]
    assert 0 < g_pre < 20e-3
    # two MoE layers on the one stage; the embedding and head do not change
    assert after["stage_forward_s"][0] - before["stage_forward_s"][0] == pytest.approx(2 * g_pre, rel=1e-9)


def test_a_host_bound_dense_pass_runs_its_collectives_in_the_gpus_idle_time():
    """A pass takes max(host, GPU + its exposed TP collectives): with a 1 s host floor a layer's
    exposed TP all-reduces (no overlap) run while the GPU waits for the host, so the step pays
    none of them; with a floor under the GPU's compute the pricing is as without one."""
    eff = default_efficiency(H100)
    s = Strategy(tp=8, micro_batch_size=1, num_micro_batches=1, seq_length=4096)
    cluster = _cluster(8)
    plain = OverlapConfig(tp=False)
    free = estimate_time(LLAMA_8B, s, cluster, efficiency=eff.replace(host_layer_s=0.0), overlap=plain)
    tp_s = free.breakdown["comm_exposed"]["tp"]
    assert tp_s > 0
    bound = estimate_time(LLAMA_8B, s, cluster, efficiency=eff.replace(host_layer_s=1.0), overlap=plain)
    longer = estimate_time(LLAMA_8B, s, cluster, efficiency=eff.replace(host_layer_s=2.0), overlap=plain)
    # what stays is the embedding's and the head's, outside the layers' passes, whatever the floor
    assert bound.breakdown["comm_exposed"]["tp"] == longer.breakdown["comm_exposed"]["tp"] < 0.05 * tp_s
    # a floor under the GPU's own time leaves the pricing as it was
    assert estimate_time(LLAMA_8B, s, cluster, efficiency=eff.replace(host_layer_s=1e-6),
                         overlap=plain).step_s == pytest.approx(free.step_s, rel=1e-12)


def test_a_faster_gpu_under_a_host_floor_does_not_slow_the_step():
    """The draw benchmarks/time_invariants.py found (seed 52): Qwen3-30B-A3B on GB200 under the
    pytorch runtime, host-bound, CP 2 and TP 2 under DualPipeV: 1.5x the FLOP/s priced it 0.25%
    slower while the ring's and TP's collectives could not use the GPU's idle time."""
    device = get_device("gb200-nvl72")
    s = Strategy(dp=2, tp=2, sequence_parallel=True, pp=2, vpp=2, cp=2, zero=2, micro_batch_size=1,
                 num_micro_batches=4, schedule="dualpipev", seq_length=4096)
    from ndplan.memory import MemoryOptions

    keywords = MemoryOptions(runtime="pytorch").time_keywords()
    faster = device.model_copy(update={"peak_flops": {k: 1.5 * v for k, v in device.peak_flops.items()}})
    base = estimate_time("qwen3-30b-a3b", s, Cluster(device=device, num_devices=16), **keywords).step_s
    fast = estimate_time("qwen3-30b-a3b", s, Cluster(device=faster, num_devices=16), **keywords).step_s
    assert fast <= base


def test_sandwich_norms_read_and_write_twice_the_norm_bytes():
    """Four h-wide norms a layer (Gemma 3) move 2 more reads and writes of h per token than two
    (both recomputable): T = 256 tokens, h = 1152, bf16 -> 2 norms x 2 passes x 256 x 1152 x 2 B."""
    from ndplan.perf.flops import Sharding
    from ndplan.perf.memory_ops import layer_bytes

    gemma = get_preset("gemma-3-1b")
    pre = gemma.model_copy(update={"norm_placement": "pre"})
    sh = Sharding(1.0, 256.0)
    (total, rerun), (total_pre, rerun_pre) = (layer_bytes(m, sh, 0.0, "dense", 2.0) for m in (gemma, pre))
    assert total - total_pre == rerun - rerun_pre == pytest.approx(2 * 2 * 256 * 1152 * 2.0)


def test_chunk_sort_is_charged_to_the_all_to_all_dispatcher_only():
    from ndplan.perf.flops import Sharding
    from ndplan.perf.memory_ops import layer_bytes

    # T = 256 tokens, top-4 -> 1024 routed copies of h = 1024; the sort and the unsort read and
    # write every received row once each: 4 · 1024 · 1024 elements · 2 bytes
    sh = Sharding(1.0, 256.0, ep=8.0)
    plain, _ = layer_bytes(TINY_MOE, sh, 0.0, "moe", 2.0)
    sorted_, _ = layer_bytes(TINY_MOE, sh, 0.0, "moe", 2.0, 1.0)
    assert sorted_ - plain == pytest.approx(2.0 * 4 * 1024 * 1024)
    # with etp = 2 each rank receives the rows of both expert-TP ranks
    sh2 = Sharding(1.0, 256.0, ep=8.0, etp=2.0)
    assert layer_bytes(TINY_MOE, sh2, 0.0, "moe", 2.0, 1.0)[0] - layer_bytes(TINY_MOE, sh2, 0.0, "moe", 2.0)[0] == (
        pytest.approx(2.0 * 4 * 1024 * 2 * 1024))


def test_torchtitan_selective_recompute_replays_matmuls_not_attention():
    """torchtitan's per-op policy recomputes k, o and w3 of every Llama block: per token
    2·4096·(1024 + 4096 + 14336) = 159,383,552 FLOPs per layer, 32 layers."""
    s = Strategy(dp=8, micro_batch_size=2, num_micro_batches=1, seq_length=8192, zero=3, fsdp=True,
                 recompute="selective", precision="fsdp-bf16")
    cluster = _cluster(8)
    op = default_efficiency(H100).replace(selective_recompute="torchtitan-op", elementwise_passes=3.0)
    r = estimate_time(LLAMA8, s, cluster, efficiency=op)
    tokens = 16 * 8192
    assert r.hardware_flops - r.model_flops == pytest.approx(tokens * 32 * 2 * 4096 * (1024 + 4096 + 14336), rel=1e-12)
    megatron = estimate_time(LLAMA8, s, cluster, efficiency=op.replace(selective_recompute="megatron"))
    # at 8k tokens the replayed matmuls (36% of the forward's) cost more than the attention core
    assert r.step_s > megatron.step_s


def test_runtime_selective_policy_prices_what_its_memory_profile_keeps(tmp_path):
    """The pytorch runtime's selective recompute keeps every matmul's and the attention core's
    output (its memory profile, the census's policy), so time re-runs the elementwise ops alone:
    no FLOPs added (HFU = MFU), a step between no recompute and Megatron's attention-core
    replay. Estimate, search and balancer read the policy from the runtime profile."""
    from ndplan.balance import build_problem
    from ndplan.memory import MemoryOptions
    from ndplan.memory.profile import get_profile
    from ndplan.search import runtime_step_time

    pytorch, megatron = MemoryOptions(runtime="pytorch"), MemoryOptions(runtime="megatron")
    assert pytorch.time_keywords()["software"]["selective_recompute"] == "keep-matmuls"
    assert megatron.time_keywords()["software"]["selective_recompute"] == "megatron"
    s = Strategy(dp=8, micro_batch_size=2, num_micro_batches=4, seq_length=8192, zero=3, fsdp=True,
                 recompute="selective", precision="fsdp-bf16")
    cluster = _cluster(8)
    keywords = pytorch.time_keywords()
    kept = estimate_time(LLAMA8, s, cluster, **keywords)
    assert kept.hardware_flops == kept.model_flops and kept.hfu == kept.mfu
    assert estimate_time(LLAMA8, s.with_recompute("none"), cluster, **keywords).step_s < kept.step_s
    # With fused elementwise kernels, between no recompute and Megatron's attention-core replay
    # (eager ones, 4.5 passes each, make the elementwise replay the dearer at 8k tokens)
    fused = {**keywords, "software": {**keywords["software"], "elementwise_passes": 1.0}}
    kept = estimate_time(LLAMA8, s, cluster, **fused)
    core = estimate_time(LLAMA8, s, cluster, **{**fused, "software": {**fused["software"], "selective_recompute": "megatron"}})
    plain = estimate_time(LLAMA8, s.with_recompute("none"), cluster, **fused)
    assert core.hardware_flops > core.model_flops
    assert plain.step_s < kept.step_s < core.step_s
    assert any("keep-matmuls policy: re-runs the norms and activations" in line for line in kept.explain())
    # the search's and the balancer's prices are the same policy's
    searched = runtime_step_time(pytorch)(LLAMA8, StrategyBatch.of(s), cluster)
    assert float(searched["hfu"][0]) == pytest.approx(float(searched["mfu"][0]), rel=1e-12)
    text = Path(__file__).resolve().parents[1].joinpath("src/ndplan/memory/profiles/pytorch.yaml").read_text()
    core_policy = tmp_path / "core.yaml"  # the same runtime but for Megatron's policy
    core_policy.write_text(text.replace("selective_policy: keep-matmuls", "selective_policy: megatron"))

    def selective_cost(options: MemoryOptions) -> float:
        return build_problem(LLAMA8, s, cluster, 1e15, options).costs[("dense", "selective")].time_s

    keep_matmuls = selective_cost(pytorch)
    assert keep_matmuls != selective_cost(MemoryOptions(runtime=str(core_policy)))
    assert keep_matmuls > build_problem(LLAMA8, s, cluster, 1e15, pytorch).costs[("dense", "none")].time_s
    # eager attention is the runtime's kernel for time as for memory: the full s² square, unfused
    eager = MemoryOptions(runtime="pytorch", attention="eager").time_keywords()
    assert eager["software"]["flash_attention"] is False and pytorch.time_keywords()["software"]["flash_attention"]
    assert estimate_time(LLAMA8, s, cluster, **eager).step_s > estimate_time(LLAMA8, s, cluster, **keywords).step_s
    # a profile YAML naming an unknown policy is refused with the allowed ones
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("selective_policy: keep-matmuls", "selective_policy: everything"))
    with pytest.raises(NdplanError, match="selective_policy is 'everything'; allowed: megatron, keep-matmuls, torchtitan-op"):
        get_profile(str(bad))


def test_split_backward_rebuilds_a_checkpointed_layer_once_per_parameter_group():
    """Under torch's split backward each parameter group's weight-gradient call replays the
    checkpointed layer's forward: with full recompute, W gains G forwards of the layer (G =
    weight_grad_groups: 9 for Llama), its collectives included; B keeps its one rebuild, and
    nothing changes without full recompute, without a split backward, or for a runtime that
    does not rebuild per group."""
    from ndplan.model.params import weight_grad_groups
    from ndplan.perf.efficiency import default_efficiency as efficiency_of
    from ndplan.perf.layer import LayerContext, piece_times
    from ndplan.perf.overlap import default_overlap
    from ndplan.perf.step import compute_rates, strategy_columns
    from ndplan.perf.topology import Fabric

    model = get_preset("llama-3.1-8b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=8)
    strategies = [Strategy(dp=2, tp=2, sequence_parallel=True, pp=2, vpp=2, schedule=schedule, recompute=recompute,
                           num_micro_batches=8, seq_length=4096)
                  for schedule in ("zbv", "interleaved") for recompute in ("full", "selective")]
    batch = StrategyBatch.of(strategies)
    eff, overlap = efficiency_of(cluster.device), default_overlap(cluster.device.runtime)
    cols = strategy_columns(model, batch, overlap)

    def pieces(rebuilds: bool):
        ctx = LayerContext(model, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap,
                           batch.precision, rebuilds)
        return piece_times(ctx, cols)

    on, off = pieces(True), pieces(False)
    groups = weight_grad_groups(model)["dense"]
    assert groups == 9
    forward = np.broadcast_to(on["dense"].total("F"), (4,))
    w_on = np.broadcast_to(on["rc_dense"].total("W"), (4,))
    # ZB-V with full recompute: G forwards (compute and its collectives) in W; the rest: none.
    assert w_on[0] == pytest.approx(groups * forward[0], rel=1e-12)
    assert list(w_on[1:]) == [0.0, 0.0, 0.0]
    assert np.all(np.broadcast_to(off["rc_dense"].total("W"), (4,)) == 0.0)
    np.testing.assert_array_equal(np.broadcast_to(on["rc_dense"].total("B"), (4,)),
                                  np.broadcast_to(off["rc_dense"].total("B"), (4,)))
    # The step pays it: ZB-V with full recompute slows, the others do not move.
    slow = step_time_batch(model, batch, cluster, weight_grad_rebuilds=True)["step_s"]
    plain = step_time_batch(model, batch, cluster)["step_s"]
    assert slow[0] > plain[0] * 1.5 and np.array_equal(slow[1:], plain[1:])
    report = estimate_time(model, strategies[0], cluster, weight_grad_rebuilds=True)
    assert report.step_s > estimate_time(model, strategies[0], cluster).step_s * 1.5


def test_fsdp_backward_traffic_hides_under_the_recomputed_forward():
    """FSDP gathers a layer before its backward and reduce-scatters after it; with full recompute
    the replayed forward runs in that backward, so the same traffic is less exposed than
    without recompute (same bytes, a longer window). Qwen3-235B's experts unsharded by EP make
    the traffic outlast the backward: the step stays bound by it, recompute or not."""
    common = dict(dp=64, zero=3, fsdp=True, micro_batch_size=1, num_micro_batches=4, seq_length=4096, precision="fsdp-bf16")
    cluster = _cluster(64)
    # (the SMs the hidden part holds priced apart: test_hidden_data_parallel_traffic_holds_sms)
    plain = estimate_time(get_preset("qwen3-235b-a22b"), Strategy(**common), cluster, efficiency=NO_DP_SMS)
    full = estimate_time(get_preset("qwen3-235b-a22b"), Strategy(**common, recompute="full"), cluster,
                         efficiency=NO_DP_SMS)
    recomputed_s = full.breakdown["compute"] - plain.breakdown["compute"]
    assert recomputed_s > 1.0
    assert full.breakdown["comm_exposed"]["dp"] == pytest.approx(plain.breakdown["comm_exposed"]["dp"] - recomputed_s)
    assert full.step_s == pytest.approx(plain.step_s)



def test_fsdp_across_nodes_hides_under_nvlink_collectives_too(monkeypatch):
    """FSDP's gathers run on their own stream: when its shard groups cross nodes and the expert
    all-to-all stays on NVLink, the all-to-all's exposed time covers FSDP traffic as compute
    does. Qwen3-235B's expert shards outlast both, so the exposed FSDP time drops by exactly
    the exposed all-to-all (forward, backward and the full recompute's replay, which the EP
    breakdown counts too). On one node the two share NVLink and the all-to-all covers nothing."""
    from ndplan.perf import layer

    model = get_preset("qwen3-235b-a22b")
    common = dict(tp=1, ep=8, zero=3, fsdp=True, micro_batch_size=1, num_micro_batches=4, seq_length=4096,
                  precision="fsdp-bf16", recompute="full")
    def exposed(dp: int) -> dict[str, float]:
        return estimate_time(model, Strategy(dp=dp, **common), _cluster(dp), efficiency=NO_DP_SMS).breakdown["comm_exposed"]

    across, inside = exposed(32), exposed(8)
    nothing = np.zeros(1, dtype=bool)
    beside_and_sharing = layer._fsdp_beside_scaleup
    monkeypatch.setattr(layer, "_fsdp_beside_scaleup",
                        lambda ctx, cols: ((nothing, nothing, nothing), beside_and_sharing(ctx, cols)[1]))
    across_uncovered, inside_uncovered = exposed(32), exposed(8)
    assert across["ep"] > 0.1
    assert across["dp"] == pytest.approx(across_uncovered["dp"] - across["ep"])
    assert inside["dp"] == pytest.approx(inside_uncovered["dp"])


def test_unpaired_forwards_closed_forms_match_the_op_order():
    """The steady-phase closed forms ``unpaired_forwards`` takes for long schedules count what
    the op order counts, on every valid shape of a grid (pp 2-16, m 2·pp to 6·pp)."""
    from ndplan.errors import NdplanError
    from ndplan.schedule.pairing import _counted, _steady_unpaired

    checked = 0
    for schedule, vpps in (("1f1b", (1,)), ("zb-h1", (1,)), ("interleaved", (2, 3, 4)), ("zbv", (2,)),
                           ("dualpipev", (2,)), ("gpipe", (1,))):
        for pp in (2, 3, 4, 5, 8, 16):
            for vpp in vpps:
                for m in range(2 * pp, 6 * pp + 1):
                    try:
                        counted = _counted(schedule, pp, vpp, m, 1)
                    except NdplanError:  # a shape the schedule does not run
                        continue
                    assert (_steady_unpaired(schedule, pp, vpp, m), m * vpp) == counted, (schedule, pp, vpp, m)
                    checked += 1
    assert checked > 500


def test_explain_states_where_fsdp_and_expert_sharding_go():
    """The explain lines' figures add up to what they explain: FSDP's exposed DP time lies in the
    passes, not after the pipeline; MoE optimizer states shard over the experts' own replicas."""
    import re

    from ndplan.memory import estimate
    from ndplan.model import get_preset

    s = Strategy(dp=64, zero=3, num_micro_batches=1)
    report = estimate_time(LLAMA8, s, _cluster(64))
    line = " ".join(x for x in report.explain() if x.startswith("DP per step"))
    after, inside = (float(v) for v in re.findall(r"([\d.]+) ms", line)[:2])
    assert (after + inside) / 1e3 == pytest.approx(report.breakdown["comm_exposed"]["dp"], abs=2e-6) and inside > 0
    moe = estimate(get_preset("qwen3-30b-a3b"), Strategy(dp=64, ep=8, zero=1), "h100-sxm", num_devices=64)
    assert any(x.startswith("optimizer") and "experts / dp·cp·tp/(ep·etp)" in x for x in moe.explain())


def test_moe_imbalance_option_prices_the_busiest_rank_in_time_too():
    """``MemoryOptions.moe_imbalance`` (--moe-imbalance) holds the busiest rank's expert
    activations in memory; time waits for that rank's experts as well (it once raised memory only)."""
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.perf import estimate_time

    model = get_preset("mixtral-8x7b")
    strategy = Strategy(dp=8, ep=8, num_micro_batches=8, seq_length=4096)
    balanced = estimate_time(model, strategy, "h100-sxm", options=MemoryOptions())
    skewed = estimate_time(model, strategy, "h100-sxm", options=MemoryOptions(moe_imbalance=1.5))
    assert skewed.step_s > 1.2 * balanced.step_s


def test_a_capacity_factor_prices_the_padded_buffers_in_time_too():
    """A token-dropping MoE padded to capacity (--moe-capacity-factor, Megatron's
    --moe-pad-expert-input-to-capacity) gives every expert capacity_factor × its balanced share:
    the expert GEMMs and the all-to-alls move that multiple, whatever the routing imbalance
    (the factor once changed memory only). Mixtral dp8 ep8 at 4096 tokens: a balanced
    all-to-all sends 4096·2·4096·2 bytes over NVLink, 7·3 µs + 7/8·S/360e9 = 184.1 µs, dispatch
    and combine forward 368.2 µs; capacity 1.5 moves 1.5 times that, 0.5 half."""
    from ndplan.memory import MemoryOptions

    mixtral = get_preset("mixtral-8x7b")
    balanced = 2 * (7 * NVLINK_LATENCY + 7 / 8 * 4096 * 2 * 4096 * 2 / NVLINK)
    assert balanced == pytest.approx(368.2e-6, rel=1e-4)
    s = Strategy(dp=8, ep=8, seq_length=4096)
    for factor in (0.5, 1.5):
        software = MemoryOptions(runtime="megatron", moe_capacity_factor=factor, moe_imbalance=1.2).time_keywords()
        moe = _pieces(mixtral, s, 8, software=software["software"])["moe"]
        assert moe[("F", "ep")][0] == pytest.approx(factor * balanced, rel=1e-12)
    strategy = Strategy(dp=8, ep=8, zero=1, num_micro_batches=8, seq_length=4096)
    capacity = estimate_time(mixtral, strategy, "h100-sxm", options=MemoryOptions(moe_capacity_factor=1.5))
    skewed = estimate_time(mixtral, strategy, "h100-sxm", options=MemoryOptions(moe_imbalance=1.5))
    assert capacity.step_s == pytest.approx(skewed.step_s, rel=1e-12)


def test_runtime_kernel_facts_reach_the_step_time_and_are_checked(tmp_path: Path):
    """A runtime profile states its kernels (the pytorch one: eager elementwise ops, one grouped
    GEMM for all experts, foreach AdamW); time_keywords hands them to the step-time model, and a
    wrong fact in a profile YAML is refused with what is allowed."""
    from ndplan.memory import MemoryOptions
    from ndplan.memory.profile import get_profile

    software = MemoryOptions(runtime="pytorch").time_keywords()["software"]
    assert software["elementwise_passes"] == 4.5
    assert software["expert_gemm"] == "grouped" and software["optimizer_kernel"] == "foreach"
    assert "expert_gemm" not in MemoryOptions(runtime="megatron").time_keywords()["software"]
    # foreach AdamW moves more bytes than a fused one: the optimizer takes longer
    s = Strategy(dp=8, seq_length=4096, num_micro_batches=4)
    cluster = _cluster(8)
    fused = estimate_time(LLAMA8, s, cluster, software={"optimizer_kernel": "fused"})
    foreach = estimate_time(LLAMA8, s, cluster, software={"optimizer_kernel": "foreach"})
    assert foreach.breakdown["optimizer"] > fused.breakdown["optimizer"]
    text = Path(__file__).resolve().parents[1].joinpath("src/ndplan/memory/profiles/pytorch.yaml").read_text()
    for old, new, message in (
        ("expert_gemm: grouped", "expert_gemm: magic", r"kernels: invalid efficiency figure.*per-expert.*grouped"),
        ("optimizer_kernel: foreach", "optimiser: foreach", "unknown kernel fact 'optimiser'; known: elementwise_passes"),
    ):
        bad = tmp_path / f"{new.split(':')[0]}.yaml"
        bad.write_text(text.replace(old, new))
        with pytest.raises(NdplanError, match=message):
            get_profile(str(bad))


def test_software_facts_are_checked_and_coerced(tmp_path: Path):
    """A software fact given to the step-time model is validated (a typo in a value names the
    field and the allowed values); a runtime profile's quoted number is taken as a number; a
    run's software section takes software facts only; foreach AdamW is counted for Adam alone."""
    from ndplan.memory.profile import get_profile
    from ndplan.perf.calibrate import load_runs
    from ndplan.perf.step import optimizer_bytes_per_param
    from ndplan.strategy import get_precision

    cluster = _cluster(8)
    with pytest.raises(NdplanError, match=r"expert_gemm='Per-Expert'.*'per-expert' or 'grouped'"):
        estimate_time(LLAMA8, Strategy(dp=8), cluster, software={"expert_gemm": "Per-Expert"})
    with pytest.raises(NdplanError, match=r"elementwise_passes=-3"):
        estimate_time(LLAMA8, Strategy(dp=8), cluster, software={"elementwise_passes": -3})
    text = Path(__file__).resolve().parents[1].joinpath("src/ndplan/memory/profiles/pytorch.yaml").read_text()
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text(text.replace("elementwise_passes: 4.5", 'elementwise_passes: "4.5"'))
    assert get_profile(str(quoted)).kernels["elementwise_passes"] == 4.5
    runs = tmp_path / "runs.yaml"
    runs.write_text("runs:\n  - {id: x, source: s, model: llama-3.1-8b, device: h100-sxm, num_devices: 8,\n"
                    "     strategy: {dp: 8}, software: {gemm_efficiency: 0.5}, measured: {step_s: 1.0}}\n")
    with pytest.raises(NdplanError, match="'gemm_efficiency' is not a software fact"):
        load_runs(runs)
    adam, sgd = get_precision("bf16-pure"), get_precision("bf16-pure").model_copy(update={"optimizer_states": 1})
    assert optimizer_bytes_per_param(adam, "foreach") == 46 and optimizer_bytes_per_param(adam, "fused") == 18
    assert optimizer_bytes_per_param(sgd, "foreach") == optimizer_bytes_per_param(sgd, "fused")


def test_attention_call_cost_once_per_kernel_call():
    """Hopper's attention_call_s (0.2 ms, measured on an H200) is paid per call of the attention
    kernel, split 1:2.5 between forward and backward; ring attention calls it once per ring step,
    Ulysses once (ring_steps: cp over the Ulysses degree)."""
    from ndplan.perf import default_efficiency
    from ndplan.perf.flops import Sharding
    from ndplan.perf.layer import FLASH_BACKWARD_FACTOR, LayerContext, attention_core_seconds, ring_steps
    from ndplan.perf.overlap import default_overlap
    from ndplan.perf.step import compute_rates
    from ndplan.perf.topology import Fabric

    cluster = _cluster(8)
    eff = default_efficiency(cluster.device)
    assert eff.attention_call_s == 2e-4
    batch = StrategyBatch.of(Strategy(dp=8))
    ctx = LayerContext(LLAMA8, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff,
                       default_overlap(cluster.device), batch.precision, False, (), ())
    sh = Sharding(1.0, 4096.0)
    one_f, one_b = attention_core_seconds(ctx, sh)
    eight_f, eight_b = attention_core_seconds(ctx, sh, calls=8.0)
    share = eff.attention_call_s / (1 + FLASH_BACKWARD_FACTOR)
    assert eight_f - one_f == pytest.approx(7 * share) and eight_b - one_b == pytest.approx(7 * share * FLASH_BACKWARD_FACTOR)
    cols = {"cp": np.array([8.0, 8.0, 8.0, 1.0]), "cp_kind": np.array([0, 1, 2, 0]),
            "ulysses_degree": np.array([1.0, 8.0, 2.0, 1.0])}
    assert ring_steps(cols).tolist() == [8.0, 1.0, 4.0, 1.0]


def test_optimizer_updates_the_shard_its_group_holds():
    """The optimizer updates the local shard: non-expert elements over the shard group (dp·cp
    without HSDP), experts over the expert ranks of a shard group (shard_group·tp/(ep·etp)).
    Under FSDP with dp 8 and ep 2 the shard groups are (8, 4), (4, 2) and (2, 1) for
    shard_group none, 4 and 2; update = rate·local + a grad-norm latency the three share, so
    (u4 - u0) / (u2 - u0) = (L4 - L0) / (L2 - L0)."""
    from ndplan.model import count_parameters

    model = TINY_MOE
    counts = count_parameters(model)
    non_expert, expert = counts.total - counts.routed_experts, counts.routed_experts / 2

    def update(shard_group: int) -> float:
        s = Strategy(dp=8, ep=2, zero=3, fsdp=True, shard_group=shard_group, seq_length=1024)
        return float(evaluate(model, StrategyBatch.of(s), _cluster(8), details=True)["optimizer_update_s"][0])

    local = {0: non_expert / 8 + expert / 4, 4: non_expert / 4 + expert / 2, 2: non_expert / 2 + expert / 1}
    assert (update(4) - update(0)) / (update(2) - update(0)) == pytest.approx(
        (local[4] - local[0]) / (local[2] - local[0]), rel=1e-9)


def _pieces(model, strategies, devices, overlap=None, software=None, efficiency=None, device="h100-sxm"):
    """``layer.piece_times`` of ``strategies`` (one Strategy or several) on ``devices`` H100s (or ``device``),
    with the device's efficiency profile and ``software`` facts over it; {piece: {(pass,
    category): seconds per strategy}}."""
    from ndplan.perf.efficiency import with_software
    from ndplan.perf.layer import LayerContext, piece_times
    from ndplan.perf.overlap import default_overlap
    from ndplan.perf.step import compute_rates, strategy_columns
    from ndplan.perf.topology import Fabric

    batch = StrategyBatch.of(strategies)
    cluster = _cluster(devices, device)
    eff = with_software(efficiency or default_efficiency(cluster.device), software)
    overlap = overlap or default_overlap(cluster.device.runtime)
    ctx = LayerContext(model, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap,
                       batch.precision, recompute_modules=batch.recompute_modules)
    pieces = piece_times(ctx, strategy_columns(model, batch, overlap))
    return {name: {key: np.broadcast_to(value, (len(batch),)) for key, value in piece.seconds.items()}
            for name, piece in pieces.items()}


#: Scale-up rate and latency of an H100 group inside one node: 450 GB/s at 0.8, 3 µs a step.
NVLINK, NVLINK_LATENCY = 450e9 * 0.8, 3e-6


def test_sequence_parallel_embedding_all_gathers_its_gradient():
    """With SP the embedding reduce-scatters its partial lookups to the sequence shards; the
    backward of that all-gathers the output gradient, the same A = 2048·4096·2 bytes: over tp 8
    on NVLink 7·3 µs + 7/8·A/360e9 = 61.8 µs. Without SP the forward's all-reduce has an
    identity backward: nothing."""
    activation = 2048 * 4096 * 2
    gather = 7 * NVLINK_LATENCY + 7 / 8 * activation / NVLINK
    emb = _pieces(LLAMA8, [Strategy(tp=8, sequence_parallel=sp, seq_length=2048) for sp in (True, False)], 8)["emb"]
    assert emb[("F", "tp")][0] == pytest.approx(gather, rel=1e-12)  # the reduce-scatter moves as much
    backward = emb.get(("B", "tp"), np.zeros(2))
    assert backward[0] == pytest.approx(gather, rel=1e-12)
    assert backward[1] == 0.0
    assert emb[("F", "tp")][1] == pytest.approx(14 * NVLINK_LATENCY + 2 * 7 / 8 * activation / NVLINK, rel=1e-12)


def test_a_loss_on_replicated_logits_gathers_them_and_reads_them_all():
    """Without the vocabulary-parallel loss (the pytorch runtime's default: torchtitan's output
    layer then returns Replicate logits) each of tp 8 ranks all-gathers the T·V bf16 logits
    forward, 7·3 µs + 7/8·2048·128256·2/360e9 (its backward keeps the local shard: nothing),
    and the loss reads all T·V logits, 10 bytes each at 0.8 of 3.35 TB/s, not T·V/8; the three
    per-token fp32 all-reduces of the vocabulary-parallel loss go (once priced whatever the
    loss, as were its T·V/8 logits)."""
    from ndplan.memory import MemoryOptions

    tokens, vocab = 2048, 128256
    assert MemoryOptions(runtime="pytorch").time_keywords()["software"]["loss_parallel"] is False
    assert MemoryOptions(runtime="pytorch", loss_parallel=True).time_keywords()["software"]["loss_parallel"] is True
    assert MemoryOptions(runtime="megatron").time_keywords()["software"]["loss_parallel"] is True
    s = Strategy(tp=8, seq_length=tokens)
    parallel = _pieces(LLAMA8, s, 8, software={"loss_parallel": True})["head"]
    gathered = _pieces(LLAMA8, s, 8, software={"loss_parallel": False})["head"]
    ce = 3 * (14 * NVLINK_LATENCY + 2 * 7 / 8 * tokens * 4 / NVLINK)
    assert parallel[("F", "tp")][0] == pytest.approx(ce, rel=1e-12)
    assert gathered[("F", "tp")][0] == pytest.approx(7 * NVLINK_LATENCY + 7 / 8 * tokens * vocab * 2 / NVLINK, rel=1e-12)
    assert gathered[("B", "tp")][0] == pytest.approx(parallel[("B", "tp")][0], rel=1e-12)  # the input's all-reduce
    extra = 10 * tokens * vocab * (1 - 1 / 8) / (3.35e12 * 0.8)
    for pass_ in ("F", "B"):
        assert gathered[(pass_, "compute")][0] - parallel[(pass_, "compute")][0] == pytest.approx(extra, rel=1e-9)


def test_a_moe_block_pays_the_tp_collectives_of_what_it_runs_under_tp():
    """Megatron-Core runs the MoE block on the sequence shard: the attention's TP group moves
    only its AG+RS pair around attention, plus one around the shared experts (an MLP over that
    group) where the model has them; expert tensor parallelism all-gathers the received copies
    over the etp group and reduce-scatters them back. Every layer once paid a dense layer's two
    pairs, whatever etp. Mixtral (no shared experts) at 4096 tokens, tp 2 with SP, on NVLink
    (360 GB/s, 3 µs a step): A = 4096·4096·2, a pair 2·(3 µs + A/2/360e9) = 99.2 µs (was
    198.4 µs); with etp 2 the etp group moves T·k·etp/t = 8192 copies of h, 2·(3 µs +
    8192·4096·2/2/360e9) = 192.4 µs more; recomputing the moe module replays those. DeepSeek-V2-
    Lite (2 shared experts, h 2048): two pairs at etp 1, but for its MLA's gather of the
    inputs of its up-projections and the rope key, T·(h + 512 + 64) (a query without a latent
    projects the hidden state: test_mla_under_sp_all_gathers_its_latents_not_the_hidden_state)."""
    def pair(nbytes: float) -> float:
        return 2 * (NVLINK_LATENCY + nbytes / 2 / NVLINK)

    mixtral = get_preset("mixtral-8x7b")
    attention = pair(4096 * 4096 * 2)
    gather = pair(4096 * 2 * 2 / 2 * 4096 * 2)
    assert attention == pytest.approx(99.2e-6, rel=1e-3) and gather == pytest.approx(192.4e-6, rel=1e-3)
    strategies = [Strategy(dp=4, tp=2, ep=8, etp=1, sequence_parallel=True, seq_length=4096),
                  Strategy(dp=4, tp=2, ep=4, etp=2, sequence_parallel=True, seq_length=4096, recompute="selective",
                           recompute_modules=("moe",))]
    for strategy, block in zip(strategies, (0.0, gather), strict=True):
        pieces = _pieces(mixtral, strategy, 8)
        for pass_ in ("F", "B"):
            assert pieces["moe"][(pass_, "tp")][0] == pytest.approx(attention + block, rel=1e-12)
    assert pieces["rc_moe"][("B", "tp")][0] == pytest.approx(gather, rel=1e-12)
    lite = _pieces(get_preset("deepseek-v2-lite"), Strategy(dp=4, tp=2, ep=8, etp=1, sequence_parallel=True,
                                                            seq_length=4096), 8)
    latents = 4096 * (2048 + 512 + 64) * 2
    mla = 2 * pair(4096 * 2048 * 2) + (latents - 4096 * 2048 * 2) / 2 / NVLINK
    assert lite["moe"][("F", "tp")][0] == pytest.approx(mla, rel=1e-12)
    assert lite["dense"][("F", "tp")][0] == pytest.approx(mla, rel=1e-12)


def test_seq1f1b_sends_each_sub_sequence_on_its_own():
    """Seq1F1B's k sub-sequences each cross a stage boundary as [1, 8192/k, 4096] bf16: over
    the H100's NIC (pp groups of stride 8 span nodes; 50 GB/s at 0.85) a transfer takes
    10 µs + 8192/k·4096·2 / 42.5e9 s: 1.589, 0.800, 0.405 ms for k 1, 2, 4 (each was priced
    as the whole micro-batch's 1.589 ms, while the schedule counts a transfer per sub-sequence)."""
    for k in (1, 2, 4):
        s = Strategy(dp=8, pp=4, schedule="seq1f1b", seq_chunks=k, num_micro_batches=8, seq_length=8192)
        got = evaluate(LLAMA8, StrategyBatch.of(s), _cluster(32), details=True)["p2p_s"][0]
        assert got == pytest.approx(10e-6 + 8192 / k * 4096 * 2 / (50e9 * 0.85), rel=1e-12)


def test_pipeline_hops_inside_a_node_use_nvlink():
    """A pipeline of stride tp·cp·dp = 2 over pp 8 on 8-GPU H100 nodes puts stages 0-3 on one
    node and 4-7 on the next: of 1F1B's 7 hops one (3 -> 4) crosses the network, the rest
    stay on NVLink, and the critical path's transfers (the fill's chain and every steady-state
    round trip) cross each hop alike, so a transfer costs their mean. One send [1, 4096/2,
    4096] bf16 = 16,777,216 B: over NVLink 3 µs + B/(450 GB/s · 0.8) = 49.60 µs, over the NIC
    10 µs + B/(50 GB/s · 0.85) = 404.76 µs; mean (6·49.60 + 404.76)/7 = 100.34 µs (every hop
    was priced at the NIC's 404.76 µs). Interleaved over 2 chunks: 15 hops, the crossing one
    in each chunk and the wrap from stage 7 back to stage 0, 3 of 15: 120.63 µs. A V (ZB-V)
    turns on stage 7 without a transfer: 14 hops, 2 crossing, as 1F1B's mean. Stride 8 (dp 4):
    every hop crosses, 404.76 µs; pp 4 over stride 2 fits one node, 49.60 µs."""
    nbytes = 4096 / 2 * 4096 * 2
    inside = 3e-6 + nbytes / (450e9 * 0.8)
    outside = 10e-6 + nbytes / (50e9 * 0.85)
    assert (inside, outside) == (pytest.approx(49.60e-6, abs=0.01e-6), pytest.approx(404.76e-6, abs=0.01e-6))

    def p2p(devices: int, **settings) -> float:
        s = Strategy(tp=2, sequence_parallel=True, num_micro_batches=16, seq_length=4096, **settings)
        return float(evaluate(LLAMA8, StrategyBatch.of(s), _cluster(devices), details=True)["p2p_s"][0])

    assert p2p(16, pp=8) == pytest.approx((6 * inside + outside) / 7, rel=1e-12)
    assert p2p(16, pp=8, schedule="interleaved", vpp=2) == pytest.approx((12 * inside + 3 * outside) / 15, rel=1e-12)
    assert p2p(16, pp=8, schedule="zbv", vpp=2) == pytest.approx((12 * inside + 2 * outside) / 14, rel=1e-12)
    assert p2p(64, pp=8, dp=4) == pytest.approx(outside, rel=1e-12)
    assert p2p(8, pp=4) == pytest.approx(inside, rel=1e-12)


def test_pipeline_hops_of_mixed_links_priced_together_as_alone():
    """A batch mixing pipelines whose hops all stay inside a node, all cross, partly cross (the
    mean is worked out on those rows alone) and no pipeline prices each strategy's transfer as
    it is priced alone, bit for bit."""
    settings = [dict(pp=8), dict(pp=8, dp=2), dict(pp=4), dict(pp=8, schedule="interleaved", vpp=2),
                dict(pp=1, dp=16), dict(pp=2, dp=8)]
    strategies = [Strategy(tp=2, sequence_parallel=True, num_micro_batches=16, seq_length=4096, **s) for s in settings]
    together = evaluate(LLAMA8, StrategyBatch.of(strategies), _cluster(32), details=True)["p2p_s"]
    alone = [evaluate(LLAMA8, StrategyBatch.of(s), _cluster(32), details=True)["p2p_s"][0] for s in strategies]
    assert together.tolist() == alone
    assert together[4] == 0.0 and len(set(together.tolist())) >= 4


def test_the_gradient_norm_all_reduce_costs_nothing_on_one_device():
    """A fused Adam moves 38 bytes per parameter under megatron-bf16 (gradient 4, states and
    master 2·(8 + 4), the bf16 copy 2, clipping's read and zeroing 2·4) at 0.6 of the H100's
    3.35 TB/s; the gradient norm's all-reduce adds 2·ceil(log2(world)) steps of 10 µs, none on
    one device (it cost 20 µs there) and 2 on two."""
    from ndplan.model import count_parameters

    update = count_parameters(LLAMA8).total * 38 / (3.35e12 * 0.6)
    for dp, norm in ((1, 0.0), (2, 2 * 10e-6)):
        s = Strategy(dp=dp, seq_length=1024)
        got = evaluate(LLAMA8, StrategyBatch.of(s), _cluster(dp), details=True)["optimizer_update_s"][0]
        assert got == pytest.approx(update + norm, rel=1e-12)


def test_pieces_keep_the_parameters_tensor_parallelism_leaves_whole():
    """The time model's parameters per piece split as the memory model's do: norms, routers and
    MLA's down-projections stay whole on every tensor-parallel rank (DeepSeek-V3: about 15M of
    a layer's 187M attention elements), so DP traffic and the optimizer's shard count them
    whole; the rest is divided by tp."""
    from ndplan.memory.static import layer_elements
    from ndplan.perf.step import piece_params

    tp = np.array([1.0, 2.0, 8.0])
    ones = np.ones(3)
    elements = layer_elements(DSV3, tp, ones, ones)
    params = piece_params(DSV3)
    for kind in ("dense", "moe"):
        split, whole, routed = params[kind]
        assert whole > 1e7
        np.testing.assert_allclose(split / tp + whole, elements.non_expert[kind], rtol=1e-12)
        assert routed == pytest.approx(float(elements.expert[kind][0]), rel=1e-12)


def test_contiguous_routing_across_nodes_reaches_one_node_and_two_ranks():
    """DeepSeek-V3's 256 experts over ep 64 (8 nodes of 8): with contiguous routing token t's
    experts 8t..8t+7 lie on 2 ranks (4 experts each) of one node (32 experts each), remote for
    7/8 of the tokens. One all-to-all of S bytes (all k copies): the network carries
    S/k·7/8, NVLink S/k·2·7/8 (the two ranks, less the one the network delivered to), the
    slower sets the time after the latencies; spread uniformly they would reach
    7·(1 - C(224, 8)/C(256, 8)) remote nodes."""
    from math import comb
    from types import SimpleNamespace

    from ndplan.perf.efficiency import default_efficiency
    from ndplan.perf.layer import _ep_all_to_all_s
    from ndplan.perf.topology import Fabric, inside_bandwidth

    cluster = _cluster(512)
    fabric = Fabric.of(cluster, default_efficiency(cluster.device))
    cols = {"ep": np.array([64.0]), "etp": np.array([1.0])}
    nbytes = 4096 * 8 * 7168 * 2.0

    def seconds(**overlap: object) -> float:
        ctx = SimpleNamespace(model=DSV3, fabric=fabric, overlap=OverlapConfig(ep_dispatch="node_dedup", **overlap))
        return float(_ep_all_to_all_s(ctx, cols, nbytes)[0])  # type: ignore[arg-type]

    latency = 7 * fabric.scaleout_latency + 7 * fabric.scaleup_latency
    outside = nbytes / 8 * 7 / 8 / fabric.scaleout_bw
    inside = nbytes / 8 * 2 * 7 / 8 / float(inside_bandwidth(fabric, 8.0))
    assert seconds(ep_routing="contiguous") == pytest.approx(latency + max(inside, outside), rel=1e-12)
    uniform = nbytes / 8 * 8 * (1 - comb(224, 8) / comb(256, 8)) * 7 / 8 / fabric.scaleout_bw
    assert seconds() >= latency + uniform * (1 - 1e-12)


def test_a_tied_table_apart_from_the_embedding_counts_on_the_output_stage():
    """With the embedding and the head on different stages, the output stage keeps its own copy
    of a tied table (and MTP modules one of the embedding), as the memory model holds: per
    stage, a tied model then has an untied one's parameters, and the same optimizer time (it had
    none of the table on the last stage); its DP time adds the two copies' gradient sum, once a
    step (test_a_table_the_output_stage_copies_is_summed_between_the_two_stages)."""
    tied = TINY_MOE.model_copy(update={"tie_word_embeddings": True, "vocab_size": 65536})
    untied = tied.model_copy(update={"tie_word_embeddings": False})
    for zero in ({"zero": 1}, {"zero": 3, "fsdp": True}):  # under FSDP its gathers and reduces too
        strategy = Strategy(dp=4, pp=2, ep=4, num_micro_batches=4, seq_length=1024, **zero)
        s = StrategyBatch.of(strategy)
        a = evaluate(tied, s, _cluster(8), details=True)
        b = evaluate(untied, s, _cluster(8), details=True)
        assert a["optimizer_update_s"][0] == pytest.approx(b["optimizer_update_s"][0], rel=1e-12), zero
        summed = a["dp_step_s"][0] - b["dp_step_s"][0]
        assert summed > 0
        for key in ("dp_s", "step_s"):
            assert a[key][0] - b[key][0] == pytest.approx(summed, rel=1e-9), (zero, key)
        simulated = [estimate_time(model, strategy, _cluster(8)).step_s for model in (tied, untied)]
        assert simulated[0] - simulated[1] == pytest.approx(summed, rel=1e-9)


def test_zero2_reduce_scatters_every_micro_batch_and_all_reduces_across_groups_once():
    """ZeRO-2 with shard groups of 2 over dp 8 (Megatron's distributed-optimizer instances):
    each micro-batch's gradients are reduce-scattered inside the group, and the shard is
    all-reduced across the 4 groups once per step. With nothing overlapped, ZeRO-2 at m = 4 pays
    3 more reduce-scatters than ZeRO-1 and no more all-reduces: the difference is 3 x the
    reduce-scatter of Llama-8B's fp32 gradients over 2 ranks of one node."""
    from ndplan.model import count_parameters
    from ndplan.perf import collectives as coll
    from ndplan.perf.topology import Fabric, group_link

    cluster = _cluster(8)
    quiet = OverlapConfig(dp_grad_reduce=False, dp_param_gather=False)

    def dp_step(zero: int) -> float:
        s = Strategy(dp=8, zero=zero, shard_group=2, num_micro_batches=4, seq_length=1024)
        return float(evaluate(LLAMA8, StrategyBatch.of(s), cluster, overlap=quiet, details=True)["dp_step_s"][0])

    fabric = Fabric.of(cluster, default_efficiency(cluster.device))
    grads = count_parameters(LLAMA8).total * 4.0
    reduce_scatter = float(coll.reduce_scatter_s(grads, 2.0, group_link(2.0, 1.0, fabric, "ring")))
    assert dp_step(2) - dp_step(1) == pytest.approx(3 * reduce_scatter, rel=1e-9)


def test_explain_says_what_the_deduplicating_dispatch_sends():
    """--explain states the ranks and remote nodes a token reaches, as the step prices them:
    DeepSeek-V3 over ep 64 (8 nodes) with routing limited to 4 nodes reaches 3.18 remote nodes
    (4·(1 - C(96, 8)/C(128, 8))·7/8) and, of the 32 ranks on 4 nodes holding 128 experts,
    32·(1 - C(124, 8)/C(128, 8)) = 7.36 ranks."""
    from math import comb

    s = Strategy(dp=64, pp=16, ep=64, num_micro_batches=32, seq_length=4096, zero=1)
    lines = estimate_time(DSV3, s, _cluster(1024),
                          overlap=OverlapConfig(ep_dispatch="node_dedup", ep_node_limit=4)).explain()
    line = next(line for line in lines if "EP per MoE layer" in line)
    ranks = 32 * (1 - comb(124, 8) / comb(128, 8))
    remote = 4 * (1 - comb(96, 8) / comb(128, 8)) * 7 / 8
    assert f"reach {ranks:.2f} ranks ({ranks * 7 / 8:.2f} sends over the scale-up links) on {remote:.2f} remote nodes" in line
    plain = estimate_time(DSV3, s, _cluster(1024), overlap=OverlapConfig()).explain()
    assert not any("node-dedup" in line for line in plain)


def test_zero2_costs_at_least_zero1_under_overlap():
    """ZeRO-2 runs ZeRO-1's gradient collectives plus m - 1 more reduce-scatters: with one
    micro-batch it is ZeRO-1, with more it never costs less (shard groups of 8 over dp 64, the
    default overlap)."""
    cluster = _cluster(64)

    def dp_step(zero: int, m: int) -> float:
        s = Strategy(dp=64, zero=zero, shard_group=8, num_micro_batches=m, seq_length=4096)
        return float(evaluate(LLAMA8, StrategyBatch.of(s), cluster, details=True)["dp_step_s"][0])

    assert dp_step(2, 1) == pytest.approx(dp_step(1, 1), rel=1e-12)
    for m in (2, 4):
        assert dp_step(2, m) >= dp_step(1, m)


def test_contiguous_reach_counts_blocks_that_straddle_groups():
    """k consecutive experts from a multiple of k span the groups of E/ep experts they touch:
    DeepSeek-V3's 8 over ranks of 4 always 2; DeepSeek-V2-Lite's 6 over ranks of 8, counted over
    every start 6t mod 64, 1.5 on average."""
    from ndplan.perf.layer import contiguous_reach

    def brute(experts: int, k: int, per_group: int) -> float:
        starts = sorted({t * k % experts for t in range(experts)})
        return float(np.mean([len({(s + i) // per_group for i in range(k)}) for s in starts]))

    assert float(contiguous_reach(256, 8, 4.0)) == 2.0
    assert float(contiguous_reach(64, 6, 8.0)) == pytest.approx(brute(64, 6, 8), rel=1e-12)
    assert float(contiguous_reach(64, 6, 8.0)) == pytest.approx(1.5, rel=1e-12)
    np.testing.assert_allclose(contiguous_reach(128, 8, np.array([16.0, 8.0, 4.0])), [1.0, 1.0, 2.0])


def test_explain_names_shard_groups_only_where_there_are_several():
    """A shard group of every data-parallel rank is no HSDP: the DP lines name dp·cp alone;
    groups of 8 over dp 64 are named with the all-reduce across the 8 groups."""
    cluster = _cluster(64)
    whole = estimate_time(LLAMA8, Strategy(dp=64, zero=1, shard_group=64, seq_length=4096), cluster).explain()
    assert not any("groups" in line for line in whole if line.lstrip().startswith("DP"))
    groups = estimate_time(LLAMA8, Strategy(dp=64, zero=1, shard_group=8, seq_length=4096), cluster).explain()
    assert any("shard_group = 8, all-reduced across 8 groups" in line for line in groups)
    assert any("across the 8 groups" in line for line in groups)


def test_pipeline_runs_repeat_the_schedule_and_its_gradient_reduce():
    """Gradient accumulation outside the pipeline (torchtitan, AutoModel): the schedule runs twice
    a step over 4 micro-batches each. Every per-run term (compute, exposed communication, the
    p2p on the critical path, the bubble, DDP's gradient all-reduce at each run's end) is paid
    twice; the optimizer once: step(2 runs) = 2·step(1 run) − optimizer. One run over all 8
    micro-batches computes as much and pays one bubble instead of two."""
    cluster = _cluster(32)

    def price(m: int, runs: int) -> dict[str, np.ndarray]:
        s = Strategy(dp=8, pp=4, num_micro_batches=m, pipeline_runs=runs, seq_length=4096)
        return step_time_batch(LLAMA8, StrategyBatch.of(s), cluster)

    one, two, merged = price(4, 1), price(4, 2), price(8, 1)
    assert one["dp_s"][0] > 0 and one["bubble_s"][0] > 0 and one["pp_s"][0] > 0
    for part in PARTS:
        assert two[part][0] == pytest.approx((1 if part == "optimizer_s" else 2) * one[part][0], rel=1e-12), part
    assert two["step_s"][0] == pytest.approx(2 * one["step_s"][0] - one["optimizer_s"][0], rel=1e-12)
    assert two["model_flops"][0] == pytest.approx(2 * one["model_flops"][0], rel=1e-12)
    # ZeRO-1: each run reduce-scatters its gradients, the parameters are gathered once a step.
    sharded = [evaluate(LLAMA8, StrategyBatch.of(Strategy(dp=8, pp=4, zero=1, num_micro_batches=4, pipeline_runs=r,
                                                           seq_length=4096)), cluster, details=True)["dp_step_s"][0]
               for r in (1, 2, 3)]
    assert sharded[2] - sharded[1] == pytest.approx(sharded[1] - sharded[0], rel=1e-9)
    assert sharded[0] < sharded[1] < 2 * sharded[0]
    assert merged["compute_s"][0] == pytest.approx(two["compute_s"][0], rel=1e-12)
    assert merged["bubble_s"][0] < two["bubble_s"][0] and merged["step_s"][0] < two["step_s"][0]
    # The simulated schedule agrees with the closed form, and --explain says how the step runs.
    s = Strategy(dp=8, pp=4, num_micro_batches=4, pipeline_runs=2, seq_length=4096)
    report = estimate_time(LLAMA8, s, cluster)
    assert report.step_s == pytest.approx(two["step_s"][0], rel=0.05)
    text = "\n".join(report.explain())
    assert "2 runs of the schedule, each" in text and "pipeline runs 2" in text and "once per pipeline run, 2 times" in text


def test_a_pipeline_that_defers_fsdps_reduce_reduces_once_a_run():
    """torch.distributed.pipelining (the pytorch runtime) runs every micro-batch's backward
    without FSDP's reduce and reduces a chunk's gradients after its last backward, exposed; where
    parameters stay gathered after forward it gathers them once a run. So: no FSDP traffic in the
    passes, a per-step DP term that grows with the runs and not with the micro-batches. Without
    the deferral (Megatron's FSDP) every micro-batch reduces inside its backward."""
    cluster = _cluster(32)
    deferred = {"pipeline_defers_fsdp_reduce": True}

    def price(m: int = 4, runs: int = 1, reshard: bool = False, software: dict | None = None,
              overlap: OverlapConfig | None = None) -> dict[str, float]:
        s = Strategy(dp=16, pp=2, zero=3, fsdp=True, reshard_after_forward=reshard, num_micro_batches=m,
                     pipeline_runs=runs, seq_length=4096)
        out = evaluate(LLAMA8, StrategyBatch.of(s), cluster, details=True, software=software, overlap=overlap)
        return {k: float(v[0]) for k, v in out.items()}

    kept = price(software=deferred)
    assert kept["dp_step_s"] > 0 and kept["dp_s"] == pytest.approx(kept["dp_step_s"], rel=1e-12)  # nothing per pass
    assert price(m=8, software=deferred)["dp_step_s"] == pytest.approx(kept["dp_step_s"], rel=1e-12)
    assert price(runs=2, software=deferred)["dp_step_s"] == pytest.approx(2 * kept["dp_step_s"], rel=1e-12)
    # Resharding after forward: a layer is gathered again for each backward (in the passes; the
    # next forward finds it gathered), the reduce still once a run. Without the deferral each
    # micro-batch gathers twice and reduces too.
    resharded = price(reshard=True, software=deferred)
    assert resharded["dp_step_s"] < kept["dp_step_s"] and resharded["dp_s"] >= resharded["dp_step_s"]
    exposed = OverlapConfig(fsdp_prefetch=False)
    in_passes = {d: price(reshard=True, software={"pipeline_defers_fsdp_reduce": d}, overlap=exposed)
                 for d in (True, False)}
    one_gather = in_passes[True]["dp_s"] - in_passes[True]["dp_step_s"]
    assert 0 < one_gather < (in_passes[False]["dp_s"] - in_passes[False]["dp_step_s"]) / 2
    assert price(software=deferred, overlap=exposed)["dp_s"] == pytest.approx(
        price(software=deferred, overlap=exposed)["dp_step_s"], rel=1e-12)
    # Megatron's FSDP: the reduce-scatters ride in every micro-batch's backward (hidden under it by
    # default; exposed without prefetch, twice as long for twice the micro-batches), none per step.
    assert price()["dp_step_s"] == 0.0
    assert price(m=8, overlap=exposed)["dp_s"] == pytest.approx(2 * price(overlap=exposed)["dp_s"], rel=1e-12)
    # Four chunks a rank, one more than torch keeps gathered: 15 gathers of a chunk a run at pp 4 and
    # 16 micro-batches (schedule.unshard), not 4; exposed without prefetch (3.75 times the
    # gathers of two chunks, each gathered once), hidden under the run's compute with it.
    def gathers(vpp: int, prefetch: bool) -> float:
        def step(reshard: bool) -> float:
            s = Strategy(dp=8, pp=4, vpp=vpp, schedule="interleaved", zero=3, fsdp=True, num_micro_batches=16,
                         reshard_after_forward=reshard, seq_length=4096)
            return float(evaluate(LLAMA8, StrategyBatch.of(s), cluster, details=True, software=deferred,
                                  overlap=OverlapConfig(fsdp_prefetch=prefetch))["dp_step_s"][0])
        return step(False) - step(True)  # the reduce is the same either way

    assert gathers(4, prefetch=False) == pytest.approx(15 / 4 * gathers(2, prefetch=False), rel=1e-9)
    assert gathers(4, prefetch=True) == pytest.approx(gathers(2, prefetch=True), rel=1e-9)
    # The pytorch runtime states the fact; Megatron's does not; --explain says it.
    from ndplan.memory import MemoryOptions

    assert MemoryOptions(runtime="pytorch").time_keywords()["software"]["pipeline_defers_fsdp_reduce"] is True
    assert MemoryOptions(runtime="megatron").time_keywords()["software"]["pipeline_defers_fsdp_reduce"] is False
    s = Strategy(dp=16, pp=2, zero=3, fsdp=True, reshard_after_forward=False, num_micro_batches=4, seq_length=4096)
    text = "\n".join(estimate_time(LLAMA8, s, cluster, software=deferred).explain())
    assert "the pipeline defers FSDP's reduce" in text and "gathered once a run, prefetched" in text


def test_chunk_seconds_are_what_the_step_simulated():
    """A timeline drawn from ``chunk_seconds`` (as the HTML report draws one) has the step's
    makespan, uneven chunks included: the report drew every stage at the bottleneck's times."""
    from ndplan.schedule import simulate

    s = Strategy(dp=2, tp=2, sequence_parallel=True, pp=4, vpp=4, schedule="interleaved", zero=1, micro_batch_size=2,
                 num_micro_batches=16, stage_layers=(2, 2, 2, 1, 2, 2, 2, 2, 2, 3, 2, 2, 2, 2, 3, 1))
    r = estimate_time(get_preset("llama-3.1-8b"), s, _cluster(16))
    chunks = {k: np.asarray(v) for k, v in r.chunk_seconds.items()}
    assert all(v.shape == (4, 4) for v in chunks.values())
    assert chunks["forward"][3, 0] < chunks["forward"][0, 1] < chunks["forward"][2, 3]  # 1, 2 and 3 layers
    timeline = simulate("interleaved", 4, 4, 16, forward_s=chunks["forward"], backward_s=chunks["backward"],
                        weight_grad_s=chunks["weight_grad"], p2p_s=r.details["p2p_s"], overlap_f_and_b=False)
    assert timeline.makespan_s == pytest.approx(r.details["makespan_s"], rel=1e-12)


def test_a_table_the_output_stage_copies_is_summed_between_the_two_stages():
    """Llama-3.1-8B with its embedding tied to the head, over pp 4: the first and the last stage
    each hold the table, and its gradient is all-reduced between them once the backward is done
    (Megatron-Core's embedding group), exposed: vocab·h/tp fp32 gradient bytes over the two ranks'
    link, once a step; nothing where the table is not shared (untied), or where one stage holds
    both ends (DualPipeV's V), or without a pipeline."""
    from ndplan.perf import collectives as coll
    from ndplan.perf.topology import Fabric, group_link

    llama = get_preset("llama-3.1-8b")
    tied = llama.model_copy(update={"tie_word_embeddings": True})
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=16)

    def dp_step(model, **settings):
        strategy = Strategy(dp=2, tp=2, pp=4, num_micro_batches=16, seq_length=4096, **settings)
        return float(evaluate(model, StrategyBatch.of(strategy), cluster, details=True)["dp_step_s"][0])

    table = llama.vocab_size * llama.hidden_size / 2 * 4  # /tp, fp32 gradients (megatron-bf16)
    link = group_link(np.array([4.0]), np.array([4.0]), Fabric.of(cluster, default_efficiency(cluster.device)), "p2p")
    expected = float(np.asarray(coll.all_reduce_s(table, 2.0, link))[0])
    assert expected > 0.01  # 525 MB over the pipeline's (cross-node) link
    assert dp_step(tied) - dp_step(llama) == pytest.approx(expected, rel=1e-9)
    # In a V both ends sit on stage 0: no sum between stages (what differs is the shared table's
    # smaller data-parallel reduce, a fraction of the sum).
    v = {"schedule": "dualpipev", "vpp": 2}
    assert abs(dp_step(tied, **v) - dp_step(llama, **v)) < 0.1 * expected


def test_an_mtp_module_pays_its_embedding_and_projection_tp_collectives():
    """Megatron's MTP module looks its shifted tokens up in the vocabulary-parallel embedding
    (reduce-scatter of A forward under SP, all-gather of its gradient backward; without SP an
    all-reduce forward) and runs eh_proj, a column-parallel 2h -> h: under SP it all-gathers its
    [s/t, b, 2h] input (2A) forward and reduce-scatters that gradient backward, then
    gather_from_tensor_model_parallel_region all-gathers the h/t outputs (A) forward and
    scatter_to_sequence_parallel_region's backward all-gathers A; without SP the input's copy
    all-reduces its 2A gradient backward and the output gather moves A forward. Llama-3.1-8B
    with one MTP module, 2048 tokens, tp 8 on NVLink: A = 2048·4096·2. Once the module paid
    only its layer's and the head's collectives."""
    mtp = LLAMA8.model_copy(update={"mtp_depth": 1})
    a = 2048 * 4096 * 2

    def ring(nbytes: float) -> float:  # an all-gather or reduce-scatter of an nbytes buffer over 8
        return 7 * NVLINK_LATENCY + 7 / 8 * nbytes / NVLINK

    def all_reduce(nbytes: float) -> float:
        return 2 * ring(nbytes)

    strategies = [Strategy(tp=8, sequence_parallel=sp, seq_length=2048) for sp in (True, False)]
    with_mtp, without = _pieces(mtp, strategies, 8), _pieces(LLAMA8, strategies, 8)
    expected = {("F", 0): ring(a) + ring(2 * a) + ring(a), ("B", 0): ring(a) + ring(2 * a) + ring(a),
                ("F", 1): all_reduce(a) + ring(a), ("B", 1): all_reduce(2 * a)}
    for (pass_, row), extra in expected.items():
        module = with_mtp["head"][(pass_, "tp")][row] - without["head"][(pass_, "tp")][row]
        own = module - without["head"][(pass_, "tp")][row] - with_mtp["dense"][(pass_, "tp")][row]
        assert own == pytest.approx(extra, rel=1e-9), (pass_, row)


def test_mla_under_sp_all_gathers_its_latents_not_the_hidden_state():
    """Under SP Megatron-Core's MLA projects each rank's T/t tokens down (duplicated TELinear),
    so what the tensor-parallel group all-gathers before the attention is the latents the
    up-projections take (ColumnParallel over q_lora_rank and kv_lora_rank inputs) and the shared
    rope key (gather_from_sequence_parallel_region): T·(q_lora + kv_lora + rope) elements, not the
    hidden state's T·h; the backward reduce-scatters their gradients. The output projection's
    reduce-scatter of A and the MLP's pair (a MoE layer's shared experts' pair) stay. DeepSeek-V3,
    4096 tokens, tp 2 on NVLink: latents 4096·(1536 + 512 + 64)·2 bytes against A = 4096·7168·2,
    per pass 3·(3 µs + A/2/360e9) + (3 µs + latents/2/360e9) = 0.281 ms (was 4·(3 µs +
    A/2/360e9) = 0.338 ms). Recomputing mla_up_proj replays the up-projections' gathers,
    T·(q_lora + kv_lora)."""
    tokens = 4096
    a = tokens * 7168 * 2
    latents = tokens * (1536 + 512 + 64) * 2

    def ring(nbytes: float) -> float:  # an all-gather or reduce-scatter over 2
        return NVLINK_LATENCY + nbytes / 2 / NVLINK

    s = Strategy(dp=4, tp=2, ep=8, etp=1, sequence_parallel=True, seq_length=tokens, recompute="selective",
                 recompute_modules=("mla_up_proj",))
    pieces = _pieces(DSV3, s, 8)
    for pass_ in ("F", "B"):
        assert pieces["dense"][(pass_, "tp")][0] == pytest.approx(3 * ring(a) + ring(latents), rel=1e-12)
        assert pieces["moe"][(pass_, "tp")][0] == pytest.approx(3 * ring(a) + ring(latents), rel=1e-12)
    assert pieces["rc_dense"][("B", "tp")][0] == pytest.approx(ring(tokens * (1536 + 512) * 2), rel=1e-12)


def test_full_recompute_of_every_layer_replays_the_mtp_layer_too():
    """Megatron-Core's MTP module checkpoints its projection and decoder layer under full
    recompute with the uniform method (MultiTokenPredictionLayer._checkpointed_forward), which
    recomputing every layer emits; the block method (recompute_layers k) skips it with a warning.
    Selective recompute acts inside its decoder layer as in any other. So the module's backward
    adds its layer's recompute (and, recomputed in full, the projection's forward) except under
    the block method; hardware FLOPs add one forward of the module's projection and layer."""
    from ndplan.perf.flops import Sharding, attention_core_flops, gemm_flops, layer_gemms, mtp_gemms
    from ndplan.perf.gemm import gemm_seconds
    from ndplan.perf.step import compute_rates

    mtp = LLAMA8.model_copy(update={"mtp_depth": 1})
    strategies = [Strategy(seq_length=2048), Strategy(seq_length=2048, recompute="full"),
                  Strategy(seq_length=2048, recompute="full", recompute_layers=1),
                  Strategy(seq_length=2048, recompute="selective")]
    pieces = _pieces(mtp, strategies, 1)
    head_b = pieces["head"][("B", "compute")]
    rc_b = pieces["rc_dense"][("B", "compute")]
    batch = StrategyBatch.of(strategies[1])
    rates = compute_rates(_cluster(1), batch, default_efficiency(H100))
    proj = float(gemm_seconds(mtp_gemms(mtp, Sharding(1.0, 2048.0))[0], rates, "F"))
    assert head_b[1] - head_b[0] == pytest.approx(rc_b[1] + proj, rel=1e-9)
    assert head_b[2] == pytest.approx(head_b[0], rel=1e-12)
    assert head_b[3] - head_b[0] == pytest.approx(rc_b[3], rel=1e-9) and rc_b[3] > 0
    # hardware FLOPs: the full rebuild of every layer adds the MTP module's projection and layer
    sh = Sharding(1.0, 2048.0)
    module = gemm_flops(mtp_gemms(mtp, sh)) + gemm_flops(layer_gemms(mtp, sh, "dense")) + attention_core_flops(mtp, sh)
    layers = 32 * (gemm_flops(layer_gemms(mtp, sh, "dense")) + attention_core_flops(mtp, sh))
    out = step_time_batch(mtp, StrategyBatch.of(strategies[:3]), _cluster(1))
    extra = (out["hardware_flops"] - out["model_flops"]) / StrategyBatch.of(strategies[:3]).global_batch_size
    assert extra[1] == pytest.approx(layers + module, rel=1e-12)
    assert extra[2] == pytest.approx(layers / 32, rel=1e-12)  # one layer of the single stage, no MTP


def test_flash_backward_counts_its_five_products_with_their_own_head_widths():
    """FlashAttention's backward recomputes S = QKᵀ (2·d_qk per pair and head) and runs
    dV = Pᵀ·dO (2·d_v), dP = dO·Vᵀ (2·d_v), dQ = dS·K and dK = dSᵀ·Q (2·d_qk each): 2·(3·d_qk +
    2·d_v) against the forward's 2·(d_qk + d_v). Equal widths give 2.5× the forward; MLA's
    d_qk 192, d_v 128 give (576 + 256)/320 = 2.6×, not 2.5×."""
    from ndplan.perf.efficiency import with_software
    from ndplan.perf.flops import Sharding
    from ndplan.perf.layer import LayerContext, attention_core_seconds
    from ndplan.perf.overlap import default_overlap
    from ndplan.perf.step import compute_rates
    from ndplan.perf.topology import Fabric

    cluster = _cluster(8)
    eff = with_software(default_efficiency(cluster.device), {"flash_attention": True}).replace(attention_call_s=0.0)
    for model, factor in ((LLAMA8, 2.5), (DSV3, 2.6)):
        batch = StrategyBatch.of(Strategy(seq_length=4096))
        ctx = LayerContext(model, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff,
                           default_overlap("cuda"), batch.precision)
        forward, backward = attention_core_seconds(ctx, Sharding(1.0, 4096.0))
        assert backward / forward == pytest.approx(factor, rel=1e-12), model.name


def test_allgather_dispatcher_moves_every_token_of_the_group_whatever_the_routing():
    """Megatron's allgather dispatcher (software moe_dispatcher): tp 1, ep 8, etp 1 on one NVLink
    node, 4,096 tokens a rank. It gathers G = 4,096·8 tokens: forward the routing map (G·E
    bytes), the fp32 probabilities (G·E·4), the hidden states (G·h·2) and the combine's fp32
    reduce-scatter (G·h·4); backward G·h·4 + G·h·2 + G·E·4: every ring moves (n-1)/n of its
    buffer. Against the all-to-all's 2·(n-1)/n·4,096·k·h·2 each way, with k = 4 of 16 experts the
    gather moves G·h·6 / (4,096·k·h·4) = 8·6/16 = 3x the hidden bytes, and none of it scales
    with the busiest rank's routed tokens (moe_imbalance) as the all-to-all does."""
    from ndplan.perf.collectives import all_gather_s
    from ndplan.perf.topology import Fabric, group_link

    cluster = _cluster(8)
    strategy = Strategy(dp=8, ep=8, seq_length=4096, global_batch_size=8)
    overlap = OverlapConfig(ep=False)

    def ep_seconds(**software):
        return estimate_time(TINY_MOE, strategy, cluster, overlap=overlap, software=software).breakdown["comm_exposed"]["ep"]

    gather, a2a = ep_seconds(moe_dispatcher="allgather"), ep_seconds()
    assert ep_seconds(moe_dispatcher="allgather", moe_imbalance=1.5) == pytest.approx(gather)
    assert ep_seconds(moe_imbalance=1.5) == pytest.approx(1.5 * a2a)
    # by hand: seven ring collectives per layer of 2 layers, each (n-1)·latency + (n-1)/n·S/bw
    link = group_link(8.0, 1.0, Fabric.of(cluster, default_efficiency(cluster.device)), "ring")
    g, h, e = 4096 * 8, 1024, 16
    sizes = (g * e, g * e * 4, g * h * 2, g * h * 4, g * h * 4, g * h * 2, g * e * 4)
    assert gather == pytest.approx(2 * sum(float(all_gather_s(float(s), 8.0, link)) for s in sizes))
    assert gather > 2.5 * a2a


def test_allgather_dispatcher_combine_moves_the_gathered_rows_in_fp32():
    """T = 256 tokens a rank (tp 1), ep 8: the allgather combine zero-fills the G = 256·8 = 2,048
    gathered rows (2 B an element), casts them to fp32 (read 2, write 4) and the rank's 256 rows
    back (read 4, write 2): 2,048·1,024·8 + 256·1,024·6 bytes more than without, and the
    all-to-all's chunk sort is not run (layer.py passes 0 for it under allgather)."""
    from ndplan.perf.flops import Sharding
    from ndplan.perf.memory_ops import layer_bytes

    sh = Sharding(1.0, 256.0, ep=8.0)
    plain, _ = layer_bytes(TINY_MOE, sh, 0.0, "moe", 2.0)
    gathered, _ = layer_bytes(TINY_MOE, sh, 0.0, "moe", 2.0, 0.0, 1.0)
    assert gathered - plain == 2048 * 1024 * 8 + 256 * 1024 * 6
    # in the step: a GPU-bound layer (8 sequences of 4,096 a micro-batch) computes longer
    strategy = Strategy(dp=8, ep=8, seq_length=4096, micro_batch_size=8, global_batch_size=64)
    compute = {d: estimate_time(TINY_MOE, strategy, _cluster(8), software={"moe_dispatcher": d}).breakdown["compute"]
               for d in ("alltoall", "allgather")}
    assert compute["allgather"] > compute["alltoall"]


def test_the_last_gradient_bucket_is_what_the_backward_leaves_exposed():
    """Llama-3.1-8B (8,030,261,248 parameters, a 128256 x 4096 = 525,336,576-parameter token
    table), dp 8 without ZeRO on one H100 node (ring all-reduce at 360 GB/s, 3 µs a step, fp32
    gradients): the all-reduce, 0.156 s, hides under one micro-batch's 0.46 s backward but for
    the last bucket. Buckets are cut backwards from the head, so the last holds the table and
    what the others leave of the other 7,504,924,672 parameters.
    Megatron-Core (40e6 a bucket, max(40e6, 1e6·8)): 7,504,924,672 - 187·40e6 = 24,924,672, so
    550,261,248 parameters, 2,201,044,992 bytes: 2·7/8·2,201,044,992/360e9 + 14·3 µs = 10.742 ms
    (one layer's share, 0.156/32 = 4.88 ms, before). --ddp-bucket-size 1e9: 504,924,672 left,
    1,030,261,248 parameters, 20.075 ms. PyTorch DDP at 100 MiB (torchtitan), 26,214,400
    parameters a bucket: 7,504,924,672 - 286·26,214,400 = 7,606,272 left, 532,942,848
    parameters, 10.405 ms."""
    s = Strategy(dp=8, zero=0, num_micro_batches=1, seq_length=8192)
    cluster = _cluster(8)

    def dp_step(**kw: object) -> float:
        kw.setdefault("efficiency", NO_DP_SMS)  # their SMs: test_hidden_data_parallel_traffic_holds_sms
        return float(evaluate(LLAMA8, StrategyBatch.of(s), cluster, details=True, **kw)["dp_step_s"][0])  # type: ignore[arg-type]

    def all_reduce(params: int) -> float:
        return 2 * 7 / 8 * params * 4 / 360e9 + 14 * 3e-6

    assert dp_step() == pytest.approx(all_reduce(550_261_248), rel=1e-9)
    assert dp_step() == pytest.approx(0.010742, abs=1e-6)
    assert dp_step(overlap=OverlapConfig(dp_bucket_params=10**9)) == pytest.approx(all_reduce(1_030_261_248), rel=1e-9)
    ddp = dp_step(efficiency=NO_DP_SMS.replace(grad_buckets="ddp", ddp_bucket_cap_mb=100))
    assert ddp == pytest.approx(all_reduce(532_942_848), rel=1e-9)
    # Without --overlap-grad-reduce the whole all-reduce waits for the backward's end.
    assert dp_step(overlap=OverlapConfig(dp_grad_reduce=False)) == pytest.approx(
        2 * 7 / 8 * 8_030_261_248 * 4 / 360e9 + 14 * 3e-6, rel=1e-9)


def test_megatron_buckets_only_the_first_pipeline_stage():
    """Llama-3.1-8B over pp 2, dp 8 without ZeRO: the second stage (16 layers, the head and
    the final norm) holds the most parameters, but Megatron-Core gives a later stage one
    bucket, reduced after its last backward while the first stage runs its own (0.23 s, more
    than the 16,060,514,304-byte reduce's 78 ms): hidden. The first stage's last bucket stays
    exposed: the table and 16·218,112,000 - 87·40e6 = 9,792,000 layer parameters,
    535,128,576 parameters, 2·7/8·2,140,514,304/360e9 + 14·3 µs = 10.447 ms (the second
    stage's one-layer share, 78 ms/16 = 4.88 ms, before)."""
    s = Strategy(dp=8, pp=2, zero=0, num_micro_batches=2, seq_length=8192)
    out = evaluate(LLAMA8, StrategyBatch.of(s), _cluster(16), details=True, efficiency=NO_DP_SMS)
    assert out["dp_step_s"][0] == pytest.approx(2 * 7 / 8 * 535_128_576 * 4 / 360e9 + 14 * 3e-6, rel=1e-9)


def test_an_fp8_recipe_leaves_the_output_head_in_bf16():
    """Megatron-Core's output layer is not a Transformer Engine module, torchao's Float8 skips
    ``output``, DeepSeek-V3 keeps its head in bf16: under megatron-fp8 the head's GEMMs take the
    bf16 run's seconds (no fp8 casts), while a decoder layer's GEMMs speed up. Llama-3.1-8B, one
    H100, 4096 tokens: the head is 2·4096·128256·4096 = 4.3 TFLOP forward, at the bf16 rate."""
    s = dict(num_micro_batches=1, seq_length=4096)
    bf16 = _pieces(LLAMA8, Strategy(precision="megatron-bf16", **s), 1)
    fp8 = _pieces(LLAMA8, Strategy(precision="megatron-fp8", **s), 1)
    for pass_ in ("F", "B", "W"):
        assert fp8["head"][(pass_, "compute")][0] == pytest.approx(bf16["head"][(pass_, "compute")][0], rel=1e-12)
    assert fp8["dense"][("F", "compute")][0] < 0.9 * bf16["dense"][("F", "compute")][0]
    head_f = 2 * 4096 * 128256 * 4096 / (989.4e12 * default_efficiency(get_device("h100-sxm")).gemm_efficiency)
    assert bf16["head"][("F", "compute")][0] > head_f


def test_a_compiled_model_leaves_the_loss_at_the_eager_figure():
    """torch.compile of the decoder layers (torchtitan's components = ["model"]) fuses their
    elementwise ops, not the final norm and loss: ``loss_elementwise_passes`` prices those alone.
    Llama-3.1-8B on one H100, 4096 tokens: the loss reads 2·4096·4096·2 bytes of hidden states
    and LOSS_BYTES_PER_LOGIT per logit, each pass; 4.5 passes against 1 adds 3.5 times that, and
    nothing else moves."""
    from ndplan.memory import MemoryOptions
    from ndplan.perf.memory_ops import LOSS_BYTES_PER_LOGIT

    s = Strategy(num_micro_batches=1, seq_length=4096)
    fused = _pieces(LLAMA8, s, 1, software={"elementwise_passes": 1.0})
    eager_loss = _pieces(LLAMA8, s, 1, software={"elementwise_passes": 1.0, "loss_elementwise_passes": 4.5})
    hbm = 3.35e12 * default_efficiency(get_device("h100-sxm")).hbm_efficiency
    loss_bytes = 2 * 2 * 4096 * 4096 + LOSS_BYTES_PER_LOGIT * 4096 * 128256
    for pass_ in ("F", "B"):
        added = eager_loss["head"][(pass_, "compute")][0] - fused["head"][(pass_, "compute")][0]
        assert added == pytest.approx(3.5 * loss_bytes / hbm, rel=1e-9)
    assert eager_loss["dense"][("F", "compute")][0] == fused["dense"][("F", "compute")][0]
    # The options: the runtime's eager figure (pytorch: 4.5) outside what is compiled.
    software = {c: MemoryOptions(torch_compile=c).time_keywords()["software"] for c in ("off", "model", "model+loss", "loss")}
    assert software["off"]["elementwise_passes"] == 4.5 and "loss_elementwise_passes" not in software["off"]
    assert (software["model"]["elementwise_passes"], software["model"]["loss_elementwise_passes"]) == (1.0, 4.5)
    assert (software["model+loss"]["elementwise_passes"], software["model+loss"]["loss_elementwise_passes"]) == (1.0, 1.0)
    assert (software["loss"]["elementwise_passes"], software["loss"]["loss_elementwise_passes"]) == (4.5, 1.0)
    with pytest.raises(NdplanError, match="torch_compile must be one of off, model, model\\+loss, loss, got 'all'"):
        MemoryOptions(torch_compile="all")  # type: ignore[arg-type]


def test_chunk_seconds_by_stage_are_the_chunk_seconds_transposed():
    """``_chunk_seconds_by_stage`` (the interleaved chains' input): each chunk's forward and
    B + W seconds, [vpp, pp, n], equal to the bit to ``_chunk_seconds``' [n, pp, vpp] ones; over
    uneven interleaved layouts (model order chunk-major), a V (chunk 1 of stage s is virtual
    stage 2pp-1-s: reordered), recompute limits, and enough rows for several blocks (bench_time's
    1M mixed DeepSeek-V3 strategies raised a broadcast error at 6 chunks before)."""
    from types import SimpleNamespace

    from ndplan.perf.layer import PIECES
    from ndplan.perf.pipeline import stage_layout
    from ndplan.perf.step import _chunk_seconds, _chunk_seconds_by_stage

    rng = np.random.default_rng(5)
    model = get_preset("deepseek-v3")  # dense and MoE layers, an MTP module
    pr = SimpleNamespace(model=model, table=rng.uniform(0.0, 1e-2, (40, 6, len(PIECES))))
    # (pp 3 × vpp 2 and a V over pp 6: chunk counts whose transposed pieces do not divide a block)
    for pp, vpp, v_shape, layers in ((4, 2, False, (9, 8, 8, 8, 8, 8, 8, 4)), (8, 4, False, None),
                                     (16, 2, False, None), (4, 2, True, None), (3, 2, False, None),
                                     (6, 2, True, None)):
        layout = stage_layout(model, pp, vpp, v_shape, layers)
        model_order = bool(np.all(layout.chunk_of * pp + layout.stage_of == np.arange(pp * vpp)))
        assert model_order != v_shape
        n = 1500
        config = rng.integers(0, 40, n)
        limit = np.where(rng.uniform(size=n) < 0.3, rng.integers(1, 4, n), 0)
        f, b, w = _chunk_seconds(pr, layout, config, limit)
        ft, bt = _chunk_seconds_by_stage(pr, layout, config, limit)
        assert ft.shape == bt.shape == (vpp, pp, n)
        assert np.array_equal(ft, f.transpose(2, 1, 0))
        assert np.array_equal(bt, (b + w).transpose(2, 1, 0))
        assert np.all(ft > 0)


def test_torch_async_tp_hides_the_backward_all_gathers_alone():
    """Torch's async TP (Inductor's micro-pipeline pass) fuses a reduce-scatter only with the one
    matmul feeding it: the backward's input-gradient reduce-scatters, each fed the sum of the
    q/k/v (gate/up) projections' input gradients, stay exposed; its all-gathers hide
    (``tp_overlap_backward`` all-gathers, the pytorch runtime's fact). A layer of Llama-3.1-8B
    over TP 8 with SP at 2,048 tokens moves per pass two all-gathers and two reduce-scatters of
    A = 2048·4096·2 bytes, each 7·3 µs + 7/8·A/360e9 = 61.8 µs. Each hides under its own GEMM
    (test_the_backward_pairs_each_collective_with_its_own_gemm_too), which Llama-3.1-405B's
    projections at TP 8 outlast (A = 2048·16384·2 bytes, 177 µs each; the shortest GEMM, the output
    projection's input gradient, 2·2048·16384·2048 FLOPs at 0.75 of 989 TFLOP/s, 185 µs):
    Transformer Engine's overlap hides them all, torch's leaves the two reduce-scatters, 2 · 177 µs.
    With torchtitan's float8 TP styles (``fp8_tp_gather``, fp8 compute) the all-gathers move
    1 byte an element, 7·3 µs + 7/8·A/2/360e9 = 41.4 µs each, in both passes; the
    reduce-scatters stay at 2. (At 2,048 tokens over TP 8 the backward is host-bound, and the
    host floor's idle GPU would hide some of them: the floor is left out, as the collectives are
    what is checked here.)"""
    free = default_efficiency(H100).replace(host_layer_s=0.0)
    activation = 2048 * 4096 * 2
    gather, half_gather = (7 * NVLINK_LATENCY + 7 / 8 * activation * share / NVLINK for share in (1.0, 0.5))
    strategies = [Strategy(tp=8, sequence_parallel=True, seq_length=2048)]
    big = 7 * NVLINK_LATENCY + 7 / 8 * 2048 * 16384 * 2 / NVLINK
    assert 2 * 2048 * 16384 * 2048 / (989.4e12 * 0.75) > big
    te = _pieces(LLAMA405, strategies, 8, efficiency=free, overlap=OverlapConfig(tp=True))["dense"]
    torch_tp = _pieces(LLAMA405, strategies, 8, efficiency=free, overlap=OverlapConfig(tp=True),
                       software={"tp_overlap_backward": "all-gathers"})["dense"]
    plain = _pieces(LLAMA8, strategies, 8, efficiency=free, software={"tp_overlap_backward": "all-gathers"})["dense"]
    assert plain[("B", "tp")][0] == pytest.approx(4 * gather, rel=1e-12)  # no overlap: the choice changes nothing
    assert te[("B", "tp")][0] == 0.0
    assert torch_tp[("B", "tp")][0] == pytest.approx(2 * big, rel=1e-12)
    assert torch_tp[("F", "tp")][0] == te[("F", "tp")][0]
    fp8 = [Strategy(tp=8, sequence_parallel=True, seq_length=2048, precision="megatron-fp8")]
    bf16_gathers = _pieces(LLAMA8, fp8, 8, efficiency=free)["dense"]
    fp8_gathers = _pieces(LLAMA8, fp8, 8, efficiency=free, software={"fp8_tp_gather": True})["dense"]
    for pass_ in ("F", "B"):
        assert bf16_gathers[(pass_, "tp")][0] == pytest.approx(4 * gather, rel=1e-12)
        assert fp8_gathers[(pass_, "tp")][0] == pytest.approx(2 * gather + 2 * half_gather, rel=1e-12)
    bf16_compute = _pieces(LLAMA8, strategies, 8, efficiency=free, software={"fp8_tp_gather": True})["dense"]
    assert bf16_compute[("F", "tp")][0] == pytest.approx(4 * gather, rel=1e-12)  # gathers fp8 under fp8 compute alone
    exposed = _pieces(LLAMA405, fp8, 8, efficiency=free, overlap=OverlapConfig(tp=True),
                      software={"fp8_tp_gather": True, "tp_overlap_backward": "all-gathers"})["dense"]
    assert exposed[("B", "tp")][0] == pytest.approx(2 * big, rel=1e-9)  # the reduce-scatters, at full width


def test_expert_bias_adds_cost_their_bytes_by_the_runtimes_code():
    """gpt-oss's routed experts carry biases; how they are added is the runtime's
    (``expert_bias_add``). gpt-oss-20b over EP 8 at micro-batch 2 of 4,096 tokens: the device
    receives R = 8192·4 = 32,768 routed rows, the gate/up output 2·2880 = 5,760 wide, the down
    output 2,880. Per element (bf16, β = 2): 'repeat' (torchtitan) 8 bytes forward and 2
    backward on both; 'split-cat' (NeMo AutoModel) the same on gate/up and, the down bias
    weighted by fp32 probabilities, 2β + 24 = 28 forward and 2β + 32 = 36 backward. On an H100
    at 3.35e12·0.8 B/s. 'fused' and a model without expert biases cost nothing."""
    gpt_oss = get_preset("gpt-oss-20b")
    rows, up, down, rate = 8192 * 4, 5760, 2880, 3.35e12 * 0.8
    strategies = [Strategy(dp=8, ep=8, micro_batch_size=2, seq_length=4096)]
    fused = _pieces(gpt_oss, strategies, 8, software={"expert_bias_add": "fused"})["moe"]
    for kernel, ((up_f, up_b), (down_f, down_b)) in {"repeat": ((8, 2), (8, 2)),
                                                      "split-cat": ((8, 2), (28, 36))}.items():
        added = _pieces(gpt_oss, strategies, 8, software={"expert_bias_add": kernel})["moe"]
        for pass_, per_up, per_down in (("F", up_f, down_f), ("B", up_b, down_b)):
            extra = added[(pass_, "compute")][0] - fused[(pass_, "compute")][0]
            assert extra == pytest.approx(rows * (up * per_up + down * per_down) / rate, rel=1e-9)
    unbiased = get_preset("qwen3-30b-a3b")
    plain = [Strategy(dp=8, ep=8, seq_length=4096)]
    assert (_pieces(unbiased, plain, 8, software={"expert_bias_add": "split-cat"})["moe"][("B", "compute")][0]
            == _pieces(unbiased, plain, 8, software={"expert_bias_add": "fused"})["moe"][("B", "compute")][0])


def test_attention_sink_rescale_costs_its_bytes_by_the_runtimes_code():
    """gpt-oss's attention sinks, where the kernel does not take them, rescale its output by
    sigmoid(lse - sink) after it (``sink_rescale``). gpt-oss-20b at micro-batch 2 of 4,096 tokens:
    8192·64·64 = 33,554,432 output elements a layer, per element (β = 2) 'bf16' (torchtitan)
    2β = 4 bytes forward and 6β = 12 backward, 'fp32' (NeMo AutoModel) 2β + 8 = 12 and
    3β + 28 = 34; on dense and MoE layers alike. Nothing under 'fused', nor without sinks."""
    gpt_oss = get_preset("gpt-oss-20b")
    elements, rate = 8192 * 64 * 64, 3.35e12 * 0.8
    strategies = [Strategy(dp=8, ep=8, micro_batch_size=2, seq_length=4096)]
    fused = _pieces(gpt_oss, strategies, 8, software={"sink_rescale": "fused"})["moe"]
    for kernel, (forward, backward) in {"bf16": (4, 12), "fp32": (12, 34)}.items():
        rescaled = _pieces(gpt_oss, strategies, 8, software={"sink_rescale": kernel})["moe"]
        for pass_, per in (("F", forward), ("B", backward)):
            extra = rescaled[(pass_, "compute")][0] - fused[(pass_, "compute")][0]
            assert extra == pytest.approx(elements * per / rate, rel=1e-9)
    plain = [Strategy(dp=8, seq_length=4096)]
    assert (_pieces(LLAMA8, plain, 8, software={"sink_rescale": "fp32"})["dense"][("F", "compute")][0]
            == _pieces(LLAMA8, plain, 8, software={"sink_rescale": "fused"})["dense"][("F", "compute")][0])


def test_mla_query_and_key_assembly_costs_its_bytes_by_the_runtimes_code():
    """MLA's key is assembled per head out of the up-projection's output and one rope key per
    token (``mla_assembly``). DeepSeek-V3 (a = 128 heads, d_nope 128, d_rope 64, d_v 128) at
    4,096 tokens a micro-batch, bf16: 'fused' (Megatron-Core's kernels) moves
    2·128 + 2·128 + 64 = 576 elements a head in each pass, 4096·128·576·2 = 603,979,776 bytes;
    'cat' (torch.cat) 3·192 + 128 = 704 a head and 64 a token forward, 4096·(128·704 + 64)·2 =
    738,721,792 bytes, and 2·192 + 2·128 + 2·128 + 64 = 960 a head and 64 a token backward,
    1,007,157,248 bytes (memory_ops' docstring). In a layer's passes at 3.35e12·0.8 B/s; a
    selective recompute of mla_up_proj builds them again in the backward. Nothing for GQA."""
    from ndplan.perf.flops import Sharding
    from ndplan.perf.memory_ops import mla_assembly_bytes

    dsv3 = get_preset("deepseek-v3")
    sh = Sharding(1.0, 4096.0, 1.0, 1.0, 8.0, 1.0, 0.0)
    assert mla_assembly_bytes(dsv3, sh, 2.0, "fused") == (603_979_776, 603_979_776)
    assert mla_assembly_bytes(dsv3, sh, 2.0, "cat") == (738_721_792, 1_007_157_248)
    assert mla_assembly_bytes(LLAMA8, sh, 2.0, "cat") == (0.0, 0.0)
    rate = 3.35e12 * 0.8
    plain = [Strategy(dp=8, ep=8, seq_length=4096)]
    fused = _pieces(dsv3, plain, 8)["dense"]
    cat = _pieces(dsv3, plain, 8, software={"mla_assembly": "cat"})["dense"]
    forward, backward = (738_721_792 - 603_979_776) / rate, (1_007_157_248 - 603_979_776) / rate
    assert cat[("F", "compute")][0] - fused[("F", "compute")][0] == pytest.approx(forward, rel=1e-9)
    assert cat[("B", "compute")][0] - fused[("B", "compute")][0] == pytest.approx(backward, rel=1e-9)
    replayed = [Strategy(dp=8, ep=8, seq_length=4096, recompute="selective", recompute_modules=["mla_up_proj"])]
    fused_rc = _pieces(dsv3, replayed, 8)["rc_dense"]
    cat_rc = _pieces(dsv3, replayed, 8, software={"mla_assembly": "cat"})["rc_dense"]
    assert cat_rc[("B", "compute")][0] - fused_rc[("B", "compute")][0] == pytest.approx(forward, rel=1e-9)


def test_head_major_copies_cost_their_bytes_where_the_runtime_makes_them():
    """NeMo AutoModel's sdpa and flex backends copy q, k, v into head-major layout and the output
    back (``qkv_transpose``). gpt-oss-20b (64 query heads, 8 key/value heads, 64 wide) at
    micro-batch 2 of 4,096 tokens: (64·128 + 8·128)·8192 = 75,497,472 elements, read and written
    at 2 bytes: 301,989,888 bytes in each pass, at 3.35e12·0.8 B/s. A selective policy that
    keeps the matmuls' and the attention's outputs makes the copies again in the backward."""
    gpt_oss = get_preset("gpt-oss-20b")
    copy_s = 301_989_888 / (3.35e12 * 0.8)
    strategies = [Strategy(dp=8, ep=8, micro_batch_size=2, seq_length=4096)]
    plain = _pieces(gpt_oss, strategies, 8)["moe"]
    copied = _pieces(gpt_oss, strategies, 8, software={"qkv_transpose": True})["moe"]
    for pass_ in ("F", "B"):
        assert copied[(pass_, "compute")][0] - plain[(pass_, "compute")][0] == pytest.approx(copy_s, rel=1e-9)
    selective = [Strategy(dp=8, ep=8, micro_batch_size=2, seq_length=4096, recompute="selective")]
    keep = {"selective_recompute": "keep-matmuls"}
    plain_rc = _pieces(gpt_oss, selective, 8, software=keep)["rc_moe"]
    copied_rc = _pieces(gpt_oss, selective, 8, software={**keep, "qkv_transpose": True})["rc_moe"]
    assert copied_rc[("B", "compute")][0] - plain_rc[("B", "compute")][0] == pytest.approx(copy_s, rel=1e-9)


def test_deepgemm_fp8_gemms_run_at_their_published_h800_rates():
    """``fp8_gemm_kernel: deepgemm`` prices fp8 GEMMs at DeepGEMM's H800 table: M = 4096 GEMMs at
    K = 512, 1536, 2048, 7168, 16384 ran 590, 990, 1025, 1304, 1358 TFLOP/s; through the hopper fp8
    knee (720) to the reference depth 8192, rate · (K + 720)/K · 8192/8912, mean 1307 of 1979
    TFLOP/s: 0.66. bf16 GEMMs and families without a figure keep their own rate."""
    from ndplan.perf.step import compute_rates

    table = ((512, 590), (1536, 990), (2048, 1025), (7168, 1304), (16384, 1358))
    mean = sum(rate * (k + 720) / k * 8192 / 8912 for k, rate in table) / len(table)
    assert mean / 1978.9 == pytest.approx(0.66, abs=0.005)
    fp8 = StrategyBatch.of([Strategy(dp=8, seq_length=4096, precision="megatron-fp8")])
    bf16 = StrategyBatch.of([Strategy(dp=8, seq_length=4096)])
    for device, share in (("h100-sxm", 0.66), ("b200", None)):
        cluster = Cluster(device=get_device(device), num_devices=8)
        eff = default_efficiency(cluster.device)
        deep = eff.replace(fp8_gemm_kernel="deepgemm")
        assert compute_rates(cluster, fp8, deep).gemm_eff == (share or eff.fp8_gemm_efficiency)
        assert compute_rates(cluster, bf16, deep).gemm_eff == eff.gemm_efficiency


def test_flex_attention_runs_at_its_developers_share_of_the_flash_kernel():
    """FlexAttention (``flex_attention``) at its developer's averages: on H100 85% of
    FlashAttention-3's forward speed and 76% of its backward, weighted 1 : 2.5 by FLOPs,
    3.5/(1/0.85 + 2.5/0.76) = 0.7837 of the hopper kernel; on A100 90% and 85% of
    FlashAttention-2's, 0.8636; no figure for MI300X (its own kernel's rate). The attention core
    of a Llama-3.1-8B layer takes 1/0.7837 times as long on H100."""
    from ndplan.perf.step import compute_rates

    batch = StrategyBatch.of([Strategy(dp=8, seq_length=8192)])
    for device, share in (("h100-sxm", 3.5 / (1 / 0.85 + 2.5 / 0.76)), ("a100-80gb", 3.5 / (1 / 0.90 + 2.5 / 0.85)),
                          ("mi300x", 1.0)):
        cluster = Cluster(device=get_device(device), num_devices=8)
        eff = default_efficiency(cluster.device)
        flash = compute_rates(cluster, batch, eff).attention_rate
        flex = compute_rates(cluster, batch, eff.replace(flex_attention=True)).attention_rate
        assert flex / flash == pytest.approx(share, rel=1e-12)
    assert 3.5 / (1 / 0.85 + 2.5 / 0.76) == pytest.approx(0.7837, abs=1e-4)
    strategies = [Strategy(dp=8, seq_length=8192)]
    flash_layer = _pieces(LLAMA8, strategies, 8)["dense"]
    flex_layer = _pieces(LLAMA8, strategies, 8, software={"flex_attention": True})["dense"]
    assert flex_layer[("F", "compute")][0] > flash_layer[("F", "compute")][0]


def test_torch_ring_attention_merges_cost_their_bytes():
    """torch's context parallelism (``ring_merge`` torch) merges each ring step's output into an
    fp32 running output and copies keys, values and their fp32 gradients every step. Llama-3.1-8B
    over a ring of 4 at 16,384 tokens: T = 4,096 tokens a device, Q = O = 4096·32·128 =
    16,777,216 elements, K + V (repeated to the 32 query heads) 33,554,432; β = 2, n = 4:
    forward n·2β(K + V) + ((n + 1)(β + 4) + 32(n - 1))·O = 16(K + V) + 126·O = 2,650,800,128 bytes,
    backward 50·Q + 107(K + V) = 4,429,185,024 bytes (memory_ops' docstring), at 3.35e12·0.8 B/s.
    Nothing under Ulysses (no ring) or 'fused'."""
    rate = 3.35e12 * 0.8
    ring = [Strategy(dp=2, cp=4, cp_kind="ring", seq_length=16384)]
    fused = _pieces(LLAMA8, ring, 8)["dense"]
    merged = _pieces(LLAMA8, ring, 8, software={"ring_merge": "torch"})["dense"]
    assert merged[("F", "compute")][0] - fused[("F", "compute")][0] == pytest.approx(2_650_800_128 / rate, rel=1e-9)
    assert merged[("B", "compute")][0] - fused[("B", "compute")][0] == pytest.approx(4_429_185_024 / rate, rel=1e-9)
    ulysses = [Strategy(dp=2, cp=4, cp_kind="ulysses", seq_length=16384)]
    assert (_pieces(LLAMA8, ulysses, 8, software={"ring_merge": "torch"})["dense"][("B", "compute")][0]
            == _pieces(LLAMA8, ulysses, 8)["dense"][("B", "compute")][0])


def test_torch_ring_all_gathers_keys_and_values_and_sends_their_gradients_every_step():
    """torch's context parallelism (``ring_exchange`` allgather) all-gathers K and V, at the query
    heads' width, once a pass under the first ring step's attention alone, and sends their fp32
    gradients to the next rank after every backward step: each send under the next step, the last
    under nothing. Hand-derived on 16 A100s, Llama-3.1-8B, tp 8, cp 2 across nodes (25 GB/s ·
    0.85, 10 µs a step), seq 8192, per layer and micro-batch:
      K + V = 4096 tokens · (32/8 heads) · (128 + 128) = 4,194,304 elements, 8,388,608 B in bf16
      all-gather = 10 µs + (1/2)·(2·8,388,608 B)/21.25 GB/s = 404.76 µs; gradient send = 10 µs
      + 4·4,194,304 B/21.25 GB/s = 799.52 µs
      attention forward 183.55 µs (test above), 91.78 µs a step; backward 2.5x, 229.44 µs a step
      forward exposed 404.76 - 91.78 = 312.97 µs; backward (404.76 - 229.44) + (799.52 - 229.44)
      + 799.52 = 1,544.87 µs."""
    s = Strategy(dp=1, tp=8, cp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=2, seq_length=8192)
    cluster = _cluster(16, "a100-80gb")
    link = 25e9 * 0.85
    elements = 4096 * 4 * 256
    gather = 10e-6 + 0.5 * 2 * elements * 2 / link
    send = 10e-6 + 4 * elements / link
    step = 2 * 4 * 256 * (8192 * 8193 / 2) / 2 / (312e12 * 0.6) / 2
    forward = gather - step
    backward = (gather - 2.5 * step) + (send - 2.5 * step) + send
    assert (gather, send, forward, backward) == (
        pytest.approx(404.76e-6, abs=0.01e-6), pytest.approx(799.52e-6, abs=0.01e-6),
        pytest.approx(312.97e-6, abs=0.01e-6), pytest.approx(1544.87e-6, abs=0.01e-6))
    efficiency = default_efficiency(cluster.device).replace(ring_exchange="allgather")
    r = estimate_time(LLAMA8, s, cluster, efficiency=efficiency)
    assert r.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * (forward + backward), rel=1e-6)
    # With the ring's overlap off every byte shows: the gather each pass and both sends.
    plain = estimate_time(LLAMA8, s, cluster, efficiency=efficiency, overlap=OverlapConfig(cp_ring=False))
    assert plain.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * (2 * gather + 2 * send), rel=1e-6)


def test_fsdp2_copies_its_units_on_the_compute_stream():
    """FSDP2 copies a gathered unit out of its all-gather buffer (2·g bytes an element) and a
    gradient into the reduce-scatter buffer, cast to the reduce dtype (a + r bytes), on the
    compute stream (``fsdp_stream_copies``, the pytorch runtime's fact). A Llama-3.1-8B decoder
    layer holds P = 4096·10240 + 3·4096·14336 + 2·4096 = 218,112,000 parameters; under fsdp-bf16
    (gather 2 B, gradients 2 B reduced in fp32, 4 B) over FSDP 8 with resharding, on an H100 at
    3.35e12·0.8 B/s: forward 4P/rate = 325 µs, backward (4 + 6)P/rate = 814 µs. Nothing where the
    shard group is one rank."""
    params, rate = 218_112_000, 3.35e12 * 0.8
    sharded = [Strategy(dp=8, zero=3, fsdp=True, precision="fsdp-bf16", seq_length=2048)]
    plain = _pieces(LLAMA8, sharded, 8)["dense"]
    copies = _pieces(LLAMA8, sharded, 8, software={"fsdp_stream_copies": True})["dense"]
    assert copies[("F", "compute")][0] - plain[("F", "compute")][0] == pytest.approx(4 * params / rate, rel=1e-9)
    assert copies[("B", "compute")][0] - plain[("B", "compute")][0] == pytest.approx(10 * params / rate, rel=1e-9)
    alone = [Strategy(dp=1, zero=3, fsdp=True, precision="fsdp-bf16", seq_length=2048)]
    one = _pieces(LLAMA8, alone, 1, software={"fsdp_stream_copies": True})["dense"]
    assert one[("F", "compute")][0] == _pieces(LLAMA8, alone, 1)["dense"][("F", "compute")][0]


def test_zero2_reduces_on_a_stage_with_slack_lengthen_the_step_by_what_outlasts_it():
    """The compute stream waits for each micro-batch's reduce-scatters at its backward's end
    (FSDP2's finalize_backward), so on the heavy stage they lengthen its period; where that
    stage is not the bottleneck, its slack takes the first of it. Llama-8B over pp 2 with 17
    layers and the embedding on stage 0 (the most parameters) and 15 layers with the head and
    loss on stage 1 (the longest per micro-batch), nothing overlapped: ZeRO-2 adds to ZeRO-1's
    step (m - 1)·max(0, reduce-scatter of stage 0's fp32 gradients over dp 4 - (T1 - T0)), T the
    stages' seconds a micro-batch. (Added whole after the pipeline, a faster device, which
    shrinks the slack, priced a slower step: tests/test_invariants.py.)"""
    from ndplan.model import count_parameters
    from ndplan.perf import collectives as coll
    from ndplan.perf.topology import Fabric, group_link

    cluster, m = _cluster(8), 8
    quiet = OverlapConfig(dp_grad_reduce=False, dp_param_gather=False)

    def report(zero: int):  # type: ignore[no-untyped-def]
        s = Strategy(dp=4, pp=2, stage_layers=[17, 15], zero=zero, num_micro_batches=m, seq_length=4096)
        return estimate_time(LLAMA8, s, cluster, overlap=quiet)

    one, two = report(1), report(2)
    per_stage = sum(np.asarray(one.chunk_seconds[p]).sum(axis=1) for p in ("forward", "backward", "weight_grad"))
    slack = float(per_stage[1] - per_stage[0])  # a micro-batch's seconds on each stage
    counts = count_parameters(LLAMA8)
    layer = (counts.attention + counts.norms + counts.mlp) / LLAMA8.num_layers
    fabric = Fabric.of(cluster, default_efficiency(cluster.device))
    own = float(coll.reduce_scatter_s((counts.embedding + 17 * layer) * 4.0, 4.0, group_link(4.0, 1.0, fabric, "ring")))
    assert 0 < slack < own  # the slack takes a part, not the whole
    extra = float(two.details["dp_step_s"]) - float(one.details["dp_step_s"])
    assert extra == pytest.approx((m - 1) * (own - slack), rel=1e-9)


def test_megatrons_1f1b_waits_for_its_sends():
    """Megatron-Core's 1F1B batches each send with a receive and synchronises the device after
    it (batch_p2p_comm, batch_p2p_sync), so a send lasts its transfer on the sender's timeline.
    Llama-8B over pp 2 across two nodes, the last stage (head and loss) the slower: stage 1 runs
    its m passes back to back either way, and waited, its backward's send to stage 0 lasts one
    transfer each, of which the last is the receiver's wait it also was: (m - 1) x p2p more than
    a sender that runs on (p2p_wait none)."""
    from ndplan.memory.options import MemoryOptions

    keywords = MemoryOptions(runtime="megatron").time_keywords()
    s = Strategy(tp=8, sequence_parallel=True, pp=2, num_micro_batches=8, seq_length=8192, zero=1)
    waited = estimate_time(LLAMA8, s, _cluster(16), **keywords)
    keywords["software"] = {**keywords["software"], "p2p_wait": "none"}
    running_on = estimate_time(LLAMA8, s, _cluster(16), **keywords)
    assert waited.sends_waited and not running_on.sends_waited and waited.details["bottleneck_stage"] == 1
    assert waited.step_s - running_on.step_s == pytest.approx(7 * waited.details["p2p_s"], rel=1e-9)
    # The interleaved schedule overlaps them (overlap_p2p_comm): nothing waited under Megatron.
    looped = Strategy(tp=8, sequence_parallel=True, pp=2, vpp=2, schedule="interleaved", num_micro_batches=8,
                      seq_length=8192, zero=1)
    assert not estimate_time(LLAMA8, looped, _cluster(16), options=MemoryOptions(runtime="megatron")).sends_waited


def test_old_megatron_scatters_a_pipeline_send_over_tp_and_gathers_it():
    """Megatron-LM before Megatron-Core sent a TP rank's 1/tp of the activation without SP and
    all-gathered it over TP on the receiver (scatter_gather_tensors_in_pipeline): Llama-70B's
    [1, 2048, 8192] bf16 over tp 8 across A100 nodes, 4.2 MB a rank over HDR InfiniBand plus an
    all-gather of 33.6 MB over NVLink, where each rank sent all 33.6 MB."""
    from ndplan.perf import collectives as coll
    from ndplan.perf.topology import Fabric, group_link

    s = Strategy(tp=8, pp=2, num_micro_batches=8, seq_length=2048, zero=0)
    cluster = _cluster(16, "a100-80gb")
    activation = 2048 * 8192 * 2.0
    fabric = Fabric.of(cluster, default_efficiency(cluster.device))

    def p2p(scatter: bool) -> float:
        return float(evaluate(LLAMA70, StrategyBatch.of(s), cluster, details=True,
                              software={"pipeline_scatter_gather": scatter})["p2p_s"][0])

    assert p2p(False) == pytest.approx(fabric.scaleout_latency + activation / fabric.scaleout_bw, rel=1e-12)
    gather = float(coll.all_gather_s(activation, 8.0, group_link(8.0, 1.0, fabric, "ring")))
    assert p2p(True) == pytest.approx(fabric.scaleout_latency + activation / 8 / fabric.scaleout_bw + gather, rel=1e-12)


def test_torchs_1f1b_and_interleaved_schedules_wait_for_their_sends_and_its_lowered_runtime_does_not():
    """The pytorch profile's p2p_wait: Schedule1F1B and PipelineScheduleMulti's Interleaved1F1B
    wait for a step's sends; ZB-V and DualPipeV (the lowered runtime) and GPipe send on."""
    from ndplan.memory.options import MemoryOptions

    options = MemoryOptions(runtime="pytorch")
    common = dict(tp=8, sequence_parallel=True, pp=2, num_micro_batches=8, seq_length=8192, zero=1)
    for schedule, vpp, waited in (("1f1b", 1, True), ("interleaved", 2, True), ("zbv", 2, False),
                                  ("dualpipev", 2, False), ("gpipe", 1, False)):
        s = Strategy(**common, schedule=schedule, vpp=vpp)
        assert estimate_time(LLAMA8, s, _cluster(16), options=options).sends_waited is waited, schedule


def test_hidden_data_parallel_traffic_holds_sms():
    """NCCL's kernels hold SMs of their own while they run (one block a channel), as many as
    reach the link's rate: 16 of the H100's 132 at the scale-up rate (360 GB/s here), in
    proportion below it. So a hidden collective slows its cover by 16/132 of its bytes' time at
    360 GB/s, whatever link it runs on. Llama-3.1-8B dp 8 without ZeRO on one node: the fp32
    all-reduce of 8,030,261,248 parameters, 2·7/8·P·4/360e9 + 14·3 µs = 156.2 ms, hides but for
    its last bucket (550,261,248 parameters, 10.742 ms; test_the_last_gradient_bucket_...): the
    step pays 16/132 · (156.2 - 10.742 ms) · (its time at 360 GB/s without latency / 156.2 ms)
    more. Off with the overlap (nothing hides) and on a runtime without a figure."""
    from ndplan.perf.topology import Fabric, collective_sm_share

    eff = default_efficiency(H100)
    assert eff.dp_comm_compute_share == pytest.approx(16 / 132)
    s = StrategyBatch.of(Strategy(dp=8, zero=0, num_micro_batches=1, seq_length=8192))
    cluster = _cluster(8)

    def dp_step(efficiency: object, **kw: object) -> float:
        return float(evaluate(LLAMA8, s, cluster, details=True, efficiency=efficiency, **kw)["dp_step_s"][0])  # type: ignore[arg-type]

    full_rate = 2 * 7 / 8 * 8_030_261_248 * 4 / 360e9
    whole, last = full_rate + 14 * 3e-6, 2 * 7 / 8 * 550_261_248 * 4 / 360e9 + 14 * 3e-6
    assert dp_step(eff) - dp_step(NO_DP_SMS) == pytest.approx(16 / 132 * (whole - last) * full_rate / whole, rel=1e-9)
    quiet = OverlapConfig(dp_grad_reduce=False)
    assert dp_step(eff, overlap=quiet) == dp_step(NO_DP_SMS, overlap=quiet)
    # across nodes a collective holds fewer SMs, as its rate falls: one rank a node, one NIC
    fabric = Fabric.of(_cluster(64), eff)
    assert fabric.scaleout_bw / fabric.scaleup_bw == pytest.approx(50 * 0.85 / 360)
    assert collective_sm_share(eff, 1.0, 360 / 42.5) == pytest.approx(16 / 132 * 42.5 / 360)
    assert collective_sm_share(eff, 1.0, 0.5) == pytest.approx(16 / 132)  # never above the full rate's
    assert collective_sm_share(eff, 1.0, 0.0) == 0.0
    assert collective_sm_share(eff.replace(dp_comm_compute_share=0.0), 1.0, 1.0) == 0.0


def test_a_hidden_fsdp_gather_holds_sms_for_its_bytes_on_any_link():
    """Llama-3.1-8B's decoder layer (P = 218,112,000 parameters) gathered in bf16 by FSDP 8 hides
    under the layer's forward; what the forward loses is 16/132 of the gather's bytes,
    7/8·P·2, at 360 GB/s: 128.5 µs, on one node (NVLink ring) as across eight with one rank
    each (tp 8 beside it: P/8 a rank, over a 42.5 GB/s NIC, holding 2 SMs for 8.5x longer)."""
    params = 218_112_000

    def forward_dp(strategy: Strategy, devices: int, efficiency: object) -> float:
        pieces = _pieces(LLAMA8, [strategy], devices, efficiency=efficiency)["dense"]
        return float(np.asarray(pieces[("F", "dp")]).ravel()[0])

    eff = default_efficiency(H100)
    inside = Strategy(dp=8, zero=3, fsdp=True, precision="fsdp-bf16", seq_length=8192)
    assert forward_dp(inside, 8, NO_DP_SMS) == 0.0  # hidden whole
    assert forward_dp(inside, 8, eff) == pytest.approx(16 / 132 * 7 / 8 * params * 2 / 360e9, rel=1e-9)
    across = Strategy(dp=8, tp=8, sequence_parallel=True, zero=3, fsdp=True, precision="fsdp-bf16", seq_length=8192)
    assert forward_dp(across, 64, NO_DP_SMS) == 0.0
    per_rank = (params - 2 * 4096) / 8 + 2 * 4096  # the norms whole on every TP rank
    assert forward_dp(across, 64, eff) == pytest.approx(16 / 132 * 7 / 8 * per_rank * 2 / 360e9, rel=1e-9)


def test_fp8_parameters_are_gathered_in_fp8():
    """The distributed optimizer all-gathers the updated weights as the forward keeps them:
    under --fp8-param-gather (megatron-fp8-param) one byte an element, not two. Llama-3.1-8B
    (8,030,261,248 parameters) over dp 8 on one H100 node, nothing overlapped: the gather takes
    7/8·P·(2 - 1)/360e9 s less (the norms and the embedding priced at the gather width too)."""
    def dp_step(precision: str) -> float:
        s = StrategyBatch.of(Strategy(dp=8, zero=1, num_micro_batches=1, seq_length=4096, precision=precision))
        quiet = OverlapConfig(dp_grad_reduce=False, dp_param_gather=False)
        return float(evaluate(LLAMA8, s, _cluster(8), details=True, efficiency=NO_DP_SMS, overlap=quiet)["dp_step_s"][0])

    assert dp_step("megatron-fp8") - dp_step("megatron-fp8-param") == pytest.approx(7 / 8 * 8_030_261_248 / 360e9,
                                                                                   rel=1e-9)


def test_an_overlapped_collective_hides_under_its_own_gemm_alone():
    """Sequence-parallel TP overlap (Transformer Engine's userbuffers, MindSpeed's MC2, torch's
    AsyncTP) pipelines each all-gather with the GEMM that reads it and each reduce-scatter with
    the GEMM that makes it. Llama-3.1-8B over TP 8 on Ascend 910B at 16,384 tokens: A =
    16384·4096·2 B, each collective 7·3 µs + 7/8·A/(196e9·0.70) = 0.877 ms over the HCCS mesh;
    the GEMMs at 353.9e12·0.70 FLOP/s: QKV 2·16384·4096·768 FLOPs = 0.416 ms and the output
    projection 2·16384·512·4096 = 0.277 ms, shorter than their collectives, and the MLP's
    2·16384·4096·3584 = 1.942 ms each, longer. The layer's GEMMs (4.58 ms) outlast its
    collectives (3.51 ms), so priced together nothing showed; paired, the attention block's
    two show: (0.877 - 0.416) + (0.877 - 0.277) = 1.06 ms. On H100s over NVLink, Llama-3.1-405B's
    projections at TP 8 outlast their collectives (the output projection 2·2048·16384 FLOPs a
    token against 16384·2·7/8 bytes): nothing shows; the 70B's output projection (2·1024·8192)
    does not: its reduce-scatter shows."""
    strategies = [Strategy(tp=8, sequence_parallel=True, micro_batch_size=2, seq_length=8192)]
    ascend = _pieces(LLAMA8, strategies, 8, overlap=OverlapConfig(tp=True), device="ascend-910b")["dense"]
    activation = 16384 * 4096 * 2
    collective = 7 * 3e-6 + 7 / 8 * activation / (196e9 * 0.70)
    rate = 353.9e12 * 0.70
    qkv, out = (2 * 16384 * 4096 * 768 / rate, 2 * 16384 * 512 * 4096 / rate)
    mlp = 2 * 16384 * 4096 * 3584 / rate
    assert 4 * collective < qkv + out + 2 * mlp
    assert ascend[("F", "tp")][0] == pytest.approx((collective - qkv) + (collective - out), rel=1e-6)
    def on_h100(model):
        return _pieces(model, [Strategy(tp=8, sequence_parallel=True, seq_length=8192)], 8,
                       overlap=OverlapConfig(tp=True))["dense"][("F", "tp")][0]

    assert on_h100(get_preset("llama-3.1-405b")) == 0.0
    assert on_h100(LLAMA70) > 0.0


def test_the_backward_pairs_each_collective_with_its_own_gemm_too():
    """The backward's collectives, as the forward's (above): the gradient of the output and down
    projections' outputs all-gathered with their input-gradient GEMMs, the QKV and up
    projections' input gradients reduce-scattered with theirs, each GEMM as long as its forward
    (the same three sizes). Llama-3.1-8B over TP 8 on Ascend 910B at 16,384 tokens: the attention
    block's two show, (0.877 - 0.416) + (0.877 - 0.277) = 1.06 ms, where the layer's backward
    GEMMs together hid them all. torch's AsyncTP hides the all-gathers alone
    (``tp_overlap_backward`` all-gathers): its two reduce-scatters count whole, 2 · 0.877 ms, and
    its gathers hide under the output and down projections' GEMMs on Ascend only where they
    outlast them (the output projection's does not: 0.600 ms more)."""
    strategies = [Strategy(tp=8, sequence_parallel=True, micro_batch_size=2, seq_length=8192)]
    activation = 16384 * 4096 * 2
    collective = 7 * 3e-6 + 7 / 8 * activation / (196e9 * 0.70)
    rate = 353.9e12 * 0.70
    qkv, out = (2 * 16384 * 4096 * 768 / rate, 2 * 16384 * 512 * 4096 / rate)
    ascend = _pieces(LLAMA8, strategies, 8, overlap=OverlapConfig(tp=True), device="ascend-910b")["dense"]
    assert ascend[("B", "tp")][0] == pytest.approx((collective - qkv) + (collective - out), rel=1e-6)
    torch_tp = _pieces(LLAMA8, strategies, 8, overlap=OverlapConfig(tp=True), device="ascend-910b",
                       software={"tp_overlap_backward": "all-gathers"})["dense"]
    assert torch_tp[("B", "tp")][0] == pytest.approx(2 * collective + (collective - out), rel=1e-6)
    # without SP (all-reduces) the pairs do not apply: the layer's GEMMs together, as before
    plain = [Strategy(tp=8, micro_batch_size=2, seq_length=8192)]
    assert _pieces(LLAMA8, plain, 8, overlap=OverlapConfig(tp=True), device="ascend-910b")["dense"][("B", "tp")][0] == 0.0
