"""Ulysses over more ranks than a tensor-parallel rank's KV heads, as MindSpeed runs it: its
UlyssesContextAttention repeat_interleaves K and V to the rank's query heads before the
all-to-all and sums the copies' gradients after the backward's; Transformer Engine's all-to-all
attention and torch's runtimes refuse such a group. By hand, on Llama-3.1-8B (32 query heads,
8 KV heads of 128) at tp 8 (one KV head a rank) over a Ulysses group of 2, whose K and V are
then as wide as the queries, as a multi-head copy of the model (32 KV heads) holds them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.memory import MemoryOptions
from ndplan.memory.activations import layer_activations
from ndplan.memory.buffers import _cp_buffers
from ndplan.model import get_preset
from ndplan.model.heads import ulysses_kv_repeat
from ndplan.perf import OverlapConfig, default_efficiency
from ndplan.perf.flops import Sharding
from ndplan.perf.layer import LayerContext, piece_times
from ndplan.perf.memory_ops import kv_repeat_bytes
from ndplan.perf.step import compute_rates, strategy_columns
from ndplan.perf.topology import Fabric
from ndplan.search.run import runtime_refusals
from ndplan.strategy import Strategy, StrategyBatch

LLAMA = get_preset("llama-3.1-8b")
MHA = LLAMA.model_copy(update={"name": "llama-mha", "num_kv_heads": 32})
DSV3 = get_preset("deepseek-v3")
SEQ, D = 8192, 128
MEGATRON = MemoryOptions(runtime="megatron")


def _strategy(cp_kind: str = "ulysses", tp: int = 8, cp: int = 2, **more) -> Strategy:
    return Strategy(tp=tp, cp=cp, cp_kind=cp_kind, sequence_parallel=True, seq_length=SEQ,
                    precision="megatron-bf16", **more)


def test_the_repeat_is_the_query_heads_over_the_kv_heads_where_the_group_outnumbers_them():
    # tp 8: one KV head a rank, 4 query heads; tp 4: 2 and 8; tp 2: 4 and 16
    assert ulysses_kv_repeat(LLAMA, 8, 2) == 4
    assert ulysses_kv_repeat(LLAMA, 4, 4) == 4
    assert ulysses_kv_repeat(LLAMA, 4, 2) == 1  # 2 ranks, 2 heads: scattered as they are
    assert ulysses_kv_repeat(LLAMA, 2, 4) == 1
    assert ulysses_kv_repeat(LLAMA, 16, 2) == 2  # one gathered head a rank, 2 query heads
    assert ulysses_kv_repeat(LLAMA, 8, 1) == 1  # no Ulysses
    assert ulysses_kv_repeat(DSV3, 8, 8) == 1  # MLA: a key and value head per query head
    np.testing.assert_array_equal(ulysses_kv_repeat(LLAMA, np.array([8, 4, 1]), np.array([2, 2, 8])), [4, 1, 1])


def test_only_mindspeed_runs_it():
    strategy = _strategy()
    refused = runtime_refusals(strategy, MEGATRON, LLAMA, get_device("h100-sxm"))
    assert len(refused) == 1
    assert "its 2 all-to-all ranks outnumber the 1 KV head(s) a tensor-parallel rank holds" in refused[0]
    assert "Transformer Engine's all-to-all attention (--cp-comm-type a2a, a2a+p2p) asserts they divide" in refused[0]
    assert runtime_refusals(strategy, MEGATRON, LLAMA, get_device("ascend-910b")) == []
    assert "the pytorch runtime repeats no KV heads" in runtime_refusals(
        strategy, MemoryOptions(runtime="pytorch"), LLAMA, get_device("ascend-910b"))[0]
    # a group that scatters whole heads runs everywhere
    assert runtime_refusals(_strategy(tp=4), MEGATRON, LLAMA, get_device("h100-sxm")) == []


def test_the_kernel_keeps_k_and_v_as_wide_as_the_queries():
    """Repeated K and V are what the attention kernel keeps: 4x a rank's 2·128 elements a token,
    3·256·2 B = 1,536 B more than the ring keeps; a layer then keeps what the multi-head model's
    does (the rest of the layer is the same)."""
    def layer(model, strategy):
        return float(layer_activations(model, StrategyBatch.of(strategy), MEGATRON).full["dense"][0])

    repeated, ring = layer(LLAMA, _strategy()), layer(LLAMA, _strategy("ring"))
    assert repeated - ring == pytest.approx(3 * 2 * D * 2)
    assert repeated == pytest.approx(layer(MHA, _strategy()))
    assert layer(LLAMA, _strategy("hybrid", cp=4, ulysses_degree=2)) == pytest.approx(repeated)
    assert layer(LLAMA, _strategy(tp=4)) == pytest.approx(layer(LLAMA, _strategy("ring", tp=4)))  # no repeat


def test_the_exchange_buffers_carry_the_repeated_heads():
    """Ulysses' buffers, 2·(Q + K + V + O) a token, and the hybrid's ring blocks, 2·(K + V), at
    the repeated width: the multi-head model's, ×β = 2 bytes, over the rank's 8192/2 tokens."""
    for kind, more in (("ulysses", {}), ("hybrid", {"cp": 4, "ulysses_degree": 2})):
        batch = StrategyBatch.of(_strategy(kind, **more))
        tokens = np.array([SEQ / batch.cp[0]])
        ulysses = kind == "ulysses"
        assert _cp_buffers(LLAMA, batch, tokens, ulysses)[0] == pytest.approx(_cp_buffers(MHA, batch, tokens, ulysses)[0])
    # a rank's Q and O, 4096/8 wide each, and K and V repeated to its 4 query heads, 4·128 each
    batch = StrategyBatch.of(_strategy())
    assert _cp_buffers(LLAMA, batch, np.array([SEQ / 2]), True)[0] == pytest.approx(
        2 * (4096 / 8 + 4096 / 8 + 4 * D + 4 * D) * (SEQ / 2) * 2)


def test_the_all_to_alls_move_the_repeated_heads_and_the_copies_are_priced():
    """The all-to-alls carry K and V at the query heads' width, the multi-head model's bytes
    (its per-layer CP seconds the same); the repeat reads a rank's K and V and writes 4 copies,
    T·2·128·(1 + 4)·2 B each way, T = 8192/2 tokens."""
    seconds = {}
    for model in (LLAMA, MHA):
        cluster = Cluster(device=get_device("ascend-910b"), num_devices=16)
        batch = StrategyBatch.of(_strategy())
        eff = default_efficiency(cluster.device)
        overlap = OverlapConfig()
        ctx = LayerContext(model, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap,
                           batch.precision)
        dense = piece_times(ctx, strategy_columns(model, batch, overlap))["dense"].seconds
        seconds[model.name] = (float(np.ravel(dense[("F", "cp")])[0]), float(np.ravel(dense[("B", "cp")])[0]))
    assert seconds["llama-3.1-8b"] == pytest.approx(seconds["llama-mha"], rel=1e-12)
    assert seconds["llama-3.1-8b"][0] > 0
    sh = Sharding(micro_batch=1.0, seq=float(SEQ), tp=8.0, cp=2.0)
    forward, backward = kv_repeat_bytes(LLAMA, sh, 2.0, 4.0)
    assert forward == backward == pytest.approx(SEQ / 2 * 2 * D * 5 * 2)
    assert kv_repeat_bytes(LLAMA, sh, 2.0, 1.0) == (0.0, 0.0)


def test_an_ascend_search_ranks_it_and_a_gpu_search_does_not():
    from ndplan.search import default_space, run_search
    from ndplan.strategy import get_precision

    ranked = {}
    for name in ("ascend-910b", "h100-sxm"):
        device = get_device(name)
        space = default_space(LLAMA, device, 16, 16, 32768, get_precision("megatron-bf16"),
                              dims=("tp", "sp", "cp", "cp_kind"))
        result = run_search(LLAMA, device, space, memory_limit_bytes=10**12, top=10**6, options=MEGATRON)
        ranked[name] = {(row["tp"], row["cp"], row["cp_kind"]) for row in result.ranked}
    assert (8, 2, "ulysses") in ranked["ascend-910b"]
    assert (8, 2, "ulysses") not in ranked["h100-sxm"]
    assert (4, 2, "ulysses") in ranked["h100-sxm"]


def test_the_megatron_writer_says_transformer_engine_refuses_it_and_mindspeed_runs_it():
    from ndplan.io import emit

    gpu = emit(LLAMA, _strategy(), "megatron")
    assert ("Megatron-LM will refuse this launch: a Ulysses group of 2 ranks over the 1 KV head(s) a "
            "tensor-parallel rank holds" in gpu)
    assert "--cp-comm-type a2a" in gpu
    npu = emit(LLAMA, _strategy(), "megatron", device_runtime="cann")
    assert "--context-parallel-algo ulysses_cp_algo" in npu and "will refuse" not in npu
    assert "will refuse" not in emit(LLAMA, _strategy(tp=4), "megatron")


def test_mindspeed_llm_repeats_every_gqa_layer_s_heads(tmp_path):
    """MindSpeed-LLM repeats every GQA layer's KV heads before a Ulysses all-to-all
    (--kv-head-repeat-before-uly-alltoall, on by default there), not only where the group
    outnumbers a rank's heads: Llama-3.1-8B at tp 1 over cp 4 (8 KV heads a rank) keeps K and V
    4x as wide, (4 - 1)·2·1024·2 B = 12,288 B a token more a layer, and moves them so. A launch with
    the flag reads as 'always'; the writer writes it back; the pytorch runtime has no such repeat."""
    from ndplan.io import emit, read_config

    strategy = _strategy(tp=1, cp=4)
    assert ulysses_kv_repeat(LLAMA, 1, 4) == 1 and ulysses_kv_repeat(LLAMA, 1, 4, "always") == 4
    assert ulysses_kv_repeat(LLAMA, 1, 1, "always") == 1 and ulysses_kv_repeat(DSV3, 8, 8, "always") == 1

    def layer(when):
        options = MemoryOptions(runtime="megatron", ulysses_kv_repeat=when)
        return float(layer_activations(LLAMA, StrategyBatch.of(strategy), options).full["dense"][0])

    assert layer("always") - layer("needed") == pytest.approx(3 * 2 * 1024 * 2)
    script = tmp_path / "train.sh"
    script.write_text(emit(LLAMA, strategy, "megatron", device_runtime="cann", ulysses_kv_repeat="always"))
    assert "--kv-head-repeat-before-uly-alltoall" in script.read_text()
    read = read_config(script, devices=4)
    assert read.runtime_settings["ulysses_kv_repeat"] == "always"
    assert not any("--kv-head-repeat-before-uly-alltoall" in w for w in read.warnings)
    assert "--kv-head-repeat" not in emit(LLAMA, strategy, "megatron", device_runtime="cann")
    with pytest.raises(NdplanError, match="ulysses_kv_repeat 'always' is MindSpeed-LLM's"):
        MemoryOptions(runtime="pytorch", ulysses_kv_repeat="always")
    with pytest.raises(NdplanError, match="ulysses_kv_repeat must be one of needed, always"):
        MemoryOptions(runtime="megatron", ulysses_kv_repeat="sometimes")


def test_the_always_repeat_moves_wider_heads(capsys):
    from ndplan.cli import main

    argv = ["estimate", "--model", "llama-3.1-8b", "--hardware", "ascend-910b", "--runtime", "megatron", "--cp", "4",
            "--cp-kind", "ulysses", "--seq", "32768", "--devices", "4", "--json"]
    seen = {}
    for when in ("needed", "always"):
        assert main([*argv, "--ulysses-kv-repeat", when]) == 0
        data = json.loads(capsys.readouterr().out)
        seen[when] = (data["time"]["breakdown"]["comm_exposed"]["cp"], data["peak_bytes"],
                      data["time"].get("kv_heads_repeated", 1))
    assert seen["always"][0] > seen["needed"][0] and seen["always"][1] > seen["needed"][1]
    assert (seen["needed"][2], seen["always"][2]) == (1, 4)


def test_a_search_says_how_many_ranked_plans_repeat_the_heads(capsys):
    import json

    from ndplan.cli import main

    argv = ["search", "--model", "llama-3.1-8b", "--hardware", "ascend-910b", "--runtime", "megatron", "--devices",
            "16", "--gbs", "16", "--seq", "32768", "--fix", "cp_kind=ulysses", "--fix", "cp=2", "--fix", "tp=8",
            "--top", "5", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    notes = [note for note in data["notes"] if "run Ulysses over more ranks than a tensor-parallel rank's KV heads" in note]
    assert len(notes) == 1 and notes[0].startswith(f"{len(data['ranked'])} of the {len(data['ranked'])} ranked plans")
    # at tp 1 (8 KV heads a rank) only MindSpeed-LLM's repeat applies
    argv[argv.index("tp=8")] = "tp=1"
    assert main(argv) == 0
    assert not any("KV heads" in note for note in json.loads(capsys.readouterr().out)["notes"])
    assert main([*argv, "--ulysses-kv-repeat", "always"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("MindSpeed-LLM repeats every GQA layer's KV heads to the query heads" in note for note in notes)


def test_estimate_says_the_heads_are_repeated(capsys):
    from ndplan.cli import main

    argv = ["estimate", "--model", "llama-3.1-8b", "--hardware", "ascend-910b", "--runtime", "megatron", "--tp", "8",
            "--sp", "--cp", "2", "--seq", "8192", "--devices", "16"]
    assert main([*argv, "--cp-kind", "ulysses"]) == 0
    out = capsys.readouterr().out
    assert "KV heads repeated 4x: a tensor-parallel rank holds 1, fewer than the Ulysses all-to-all's 2 ranks" in out
    assert main([*argv, "--cp-kind", "ring"]) == 0
    assert "KV heads repeated" not in capsys.readouterr().out
    assert main([*argv, "--cp-kind", "ulysses", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time"]["kv_heads_repeated"] == 4
