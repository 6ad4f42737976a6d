"""More tensor-parallel ranks than KV heads, as Megatron-Core runs it: each rank all-gathers the
QKV output over TP and keeps one KV head (Attention.get_query_key_value_tensors), torch's TP
plans refuse it. By hand, on a GQA model of 2 KV heads at TP 4."""

from __future__ import annotations

import numpy as np
import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.memory import MemoryOptions, estimate
from ndplan.memory.activations import layer_activations
from ndplan.memory.report import known_gaps
from ndplan.model import get_preset
from ndplan.perf import OverlapConfig, default_efficiency
from ndplan.perf.layer import LayerContext, piece_times
from ndplan.perf.step import compute_rates, strategy_columns
from ndplan.perf.topology import Fabric
from ndplan.strategy import Strategy, StrategyBatch

LLAMA = get_preset("llama-3.1-8b")  # 32 query heads of 128, hidden 4096, ffn 14336
TWO_KV = LLAMA.model_copy(update={"name": "llama-2kv", "num_kv_heads": 2})
FOUR_KV = LLAMA.model_copy(update={"name": "llama-4kv", "num_kv_heads": 4})
SEQ, D = 4096, 128
MEGATRON = MemoryOptions(runtime="megatron")


def _layer(model, tp: int):
    strategy = Strategy(tp=tp, sequence_parallel=True, seq_length=SEQ, precision="megatron-bf16")
    return layer_activations(model, StrategyBatch.of(strategy), MEGATRON)


def test_each_rank_keeps_one_whole_kv_head():
    """K and V (and nothing else of the layer) depend on the KV heads: at tp 4 a model of 2 KV
    heads keeps what one of 4 keeps, one head each a rank, 2·128·2 B a token; the old k/tp split
    kept half a head."""
    two, four = _layer(TWO_KV, 4), _layer(FOUR_KV, 4)
    assert float(two.full["dense"][0]) == pytest.approx(float(four.full["dense"][0]))
    eight = _layer(LLAMA, 4)  # 8 KV heads: 2 a rank
    assert float(eight.full["dense"][0]) - float(two.full["dense"][0]) == pytest.approx(2 * D * 2)


def test_the_backward_holds_the_gathered_qkv_gradient_whole():
    """The attention backward fills the gradient of the gathered QKV output, T·(q + k + v) wide,
    before reduce-scattering it; the MLP's backward working set, freed by then, is the other
    candidate: 3·ffn/tp. At tp 16 (Llama's 8 KV heads, 2 ranks each) the gathered width,
    (4096 + 2·1024)·2 B = 12,288 B a token, is above the MLP's 3·14336/16·2 = 5,376 B; at tp 8
    there is no gather."""
    at16, at8 = _layer(LLAMA, 16), _layer(LLAMA, 8)
    assert float(at16.backward_extra["dense"][0]) == pytest.approx((4096 + 2 * 1024) * 2)
    assert float(at8.backward_extra["dense"][0]) == pytest.approx(3 * 14336 / 8 * 2)


def _tp_seconds(model, tp: int, overlap: OverlapConfig) -> tuple[float, float]:
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=tp)
    batch = StrategyBatch.of(Strategy(tp=tp, sequence_parallel=True, seq_length=SEQ, precision="megatron-bf16"))
    eff = default_efficiency(cluster.device)
    ctx = LayerContext(model, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap,
                       batch.precision)
    dense = piece_times(ctx, strategy_columns(model, batch, overlap))["dense"].seconds
    return float(np.ravel(dense[("F", "tp")])[0]), float(np.ravel(dense[("B", "tp")])[0])


def test_the_qkv_gather_is_priced_in_each_pass_and_never_hidden():
    """Over 4 NVLink ranks (450 GB/s at 0.8, 3 µs a step), the all-gather of T·(q + 2·k)·β =
    4096·(4096 + 2·256)·2 B in the forward and its gradient's reduce-scatter in the backward:
    3·3 µs + 3/4 of the bytes over the link. A model of 4 KV heads gathers nothing at tp 4;
    its other TP collectives are the same. Transformer Engine's TP overlap does not reach it."""
    gather = 3 * 3e-6 + 0.75 * SEQ * (4096 + 2 * 2 * D) * 2 / (450e9 * 0.8)
    for tp_overlap in (False, True):
        overlap = OverlapConfig(tp=tp_overlap)
        (two_f, two_b), (four_f, four_b) = _tp_seconds(TWO_KV, 4, overlap), _tp_seconds(FOUR_KV, 4, overlap)
        if tp_overlap:  # the pairs hide under the GEMMs they feed; the gather stays exposed
            assert two_f >= gather and two_b >= gather
        else:
            assert two_f - four_f == pytest.approx(gather, rel=1e-9)
            assert two_b - four_b == pytest.approx(gather, rel=1e-9)


def test_torch_runtimes_refuse_it_and_megatron_prices_it():
    strategy = Strategy(tp=16, sequence_parallel=True, seq_length=SEQ)
    with pytest.raises(NdplanError, match="tp=16 is above llama-3.1-8b's 8 KV heads, which the pytorch runtime"):
        estimate(LLAMA, strategy, "h100-sxm", MemoryOptions())
    report = estimate(LLAMA, strategy, "h100-sxm", MEGATRON)
    assert report.peak_bytes > 0
    assert any("above the model's 8 KV heads" in gap for gap in known_gaps(strategy, MEGATRON, LLAMA))


def test_megatron_search_ranks_it_and_pytorch_search_does_not():
    from ndplan.search import default_space, run_search
    from ndplan.search.run import NOT_RUNNABLE
    from ndplan.strategy import get_precision

    device = get_device("h100-sxm")
    space = default_space(TWO_KV, device, 8, 16, 4096, get_precision("megatron-bf16"), dims=("tp", "sp", "pp"))
    runs = {runtime: run_search(TWO_KV, device, space, memory_limit_bytes=10**12, top=10**6,
                                options=MemoryOptions(runtime=runtime)) for runtime in ("megatron", "pytorch")}
    assert any(row["tp"] > 2 for row in runs["megatron"].ranked)
    assert not any(row["tp"] > 2 for row in runs["pytorch"].ranked)
    assert runs["pytorch"].rejected[NOT_RUNNABLE] > runs["megatron"].rejected[NOT_RUNNABLE]


def test_the_torchtitan_writer_says_it_cannot_run_it():
    from ndplan.io import emit

    text = emit(TWO_KV, Strategy(tp=4, sequence_parallel=True), "torchtitan")
    assert "tp=4 above the model's 2 KV heads (torchtitan's TP plan splits whole heads" in text
    assert "KV heads" not in emit(FOUR_KV, Strategy(tp=4, sequence_parallel=True), "torchtitan")


def test_the_mindformers_writer_says_it_cannot_run_it():
    from ndplan.io import emit

    text = emit(TWO_KV, Strategy(tp=4, sequence_parallel=True), "mindformers")
    assert "tp=4 above the model's 2 KV heads (MindFormers' attention needs n_kv_head a multiple of" in text


def test_the_ring_sends_one_whole_kv_head_a_rank():
    """Transformer Engine's ring holds the K,V block in flight and the one computed on: 2·(k + v)
    a token, over min(tp, KV heads) where a rank holds one whole KV head: Llama's 8 KV heads at
    tp 16 and cp 2 hold 2·2·128·2 B a token, as at tp 8, not half of it."""
    from ndplan.memory.buffers import _cp_buffers

    batch = StrategyBatch.of([Strategy(tp=tp, cp=2, sequence_parallel=True, seq_length=SEQ, precision="megatron-bf16")
                              for tp in (8, 16)])
    tokens = np.full(2, SEQ / 2)
    assert _cp_buffers(LLAMA, batch, tokens, False).tolist() == pytest.approx([2 * 2 * 128 * 2 * SEQ / 2] * 2)
