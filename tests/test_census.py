"""The census: record format (pure Python) and measurements on tiny configs (need torch + transformers)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from ndplan.census.record import (
    SCHEMA_VERSION,
    CensusRecord,
    Recompute,
    SavedOp,
    from_json,
    load_census_file,
    save_census_file,
    to_json,
)
from ndplan.errors import NdplanError
from ndplan.memory import MemoryOptions

SEQ = 32

# A tiny llama: h=64, 4 heads of 16, 2 KV heads, FFN 160, vocab 100.
H, NH, NKV, HD, FFN, VOCAB = 64, 4, 2, 16, 160, 100
TINY_LLAMA = dict(
    model_type="llama", hidden_size=H, intermediate_size=FFN, num_attention_heads=NH,
    num_key_value_heads=NKV, head_dim=HD, num_hidden_layers=2, vocab_size=VOCAB,
)
TINY_QWEN3_MOE = dict(
    model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
    vocab_size=100,
)
TINY_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=3, vocab_size=100,
)


def llama_saved_per_token(h: int, nh: int, nkv: int, hd: int, ffn: int) -> int:
    """What a transformers 5 LlamaDecoderLayer keeps for backward (bf16, SDPA), derived by hand.

    LlamaRMSNorm: x.to(float32) is saved by pow(2) and by the mul with rsqrt (4h, one storage), the
    rsqrt (4), and the bf16 normalized value saved by weight * (.) (2h): 6h + 4 per norm, two norms.
    q/k/v_proj save their input, the input norm's output (2h); gate/up_proj save the post-attention
    norm's output (2h). Rotary: q*cos, rotate_half(q)*sin save only cos/sin (shared by all layers,
    not per layer); the rotated q (2*nh*hd) and k (2*nkv*hd) are new tensors SDPA saves, with v
    (the v_proj output, 2*nkv*hd; GQA runs inside the kernel, enable_gqa=True, no repeat_kv). The
    CPU flash kernel saves its output (2*nh*hd, which is also o_proj's input: same storage) and the
    fp32 logsumexp (4*nh). The MLP saves gate and up (mm outputs), silu(gate) and silu*up (down's
    input): 4 * 2*ffn. Residual adds save nothing.
    """
    norms = 2 * (6 * h + 4)
    norm_outputs = 2 * (2 * h)
    attention = 2 * nh * hd + 2 * nkv * hd + 2 * nkv * hd + 2 * nh * hd + 4 * nh
    mlp = 4 * 2 * ffn
    return norms + norm_outputs + attention + mlp


def llama_replicated_per_token(h: int) -> int:
    return 2 * (6 * h + 4) + 2 * (2 * h)  # norms and their outputs: not split by TP


# --------------------------------------------------------------------------------------------------
# record format (no torch)


def _record(**over: object) -> CensusRecord:
    rc = Recompute(10.0, 6.0, 4.0, 3.0)
    base = dict(
        model="m", model_type="llama", layer_kind="dense", num_layers=2, hidden_size=64, seq_length=32,
        micro_batch_size=1, dtype="bfloat16", attention="sdpa", torch_version="2.13.0", transformers_version="5",
        saved_bytes_per_token=100.0, saved_tp_scaled_bytes_per_token=60.0, saved_replicated_bytes_per_token=40.0,
        backward_peak_extra_bytes_per_token=20.0, full_recompute=Recompute(8.0, 0.0, 8.0, 120.0), selective=rc,
        saved_ops=(SavedOp("aten.mm", 50.0, "mlp.up_proj", (32, 160), "bfloat16"), SavedOp("input", 50.0)),
    )
    base.update(over)
    return CensusRecord(**base)  # type: ignore[arg-type]


def test_record_json_round_trip(tmp_path):
    recs = [_record(), _record(layer_kind="output", num_layers=1, saved_bytes_per_token=1.5)]
    assert from_json(to_json(recs)) == recs
    path = tmp_path / "census.json"
    save_census_file(path, recs)
    assert load_census_file(path) == recs
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["records"][0]["schema_version"] == SCHEMA_VERSION
    # A bare list of records reads too.
    assert from_json(json.dumps(data["records"])) == recs


def test_memory_options_take_a_census_files_path_and_refuse_other_types(tmp_path):
    """The Python API takes what --census takes (a path) besides loaded records; anything else
    is an NdplanError naming the field, not an AttributeError deep in the model."""
    recs = [_record()]
    path = tmp_path / "census.json"
    save_census_file(path, recs)
    assert MemoryOptions(census=str(path)).census == tuple(recs) == MemoryOptions(census=path).census
    assert MemoryOptions(census=recs).census == tuple(recs)
    with pytest.raises(NdplanError, match="census must be census records .* got int 1"):
        MemoryOptions(census=[1])
    with pytest.raises(NdplanError, match="cannot read census file"):
        MemoryOptions(census=str(tmp_path / "missing.json"))


def test_a_census_of_several_models_serves_each_and_refuses_another_width_or_kernel():
    """A review: a census file of two models served only the first (the second was refused as
    measured on another model); a bfloat16 census priced fp32 activations at half, and an eager
    one a fused kernel (or the reverse), silently."""
    from ndplan.memory.activations import _census_for, _check_census_runtime
    from ndplan.model import ModelSpec
    from ndplan.strategy import Strategy, StrategyBatch

    other, mine = _record(model="other", hidden_size=128), _record(model="m")
    spec = ModelSpec(name="m", num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                     num_kv_heads=2, head_dim=16, vocab_size=100)
    assert _census_for(MemoryOptions(census=(other, mine)), "dense", spec) is mine
    with pytest.raises(NdplanError, match="measured on other"):
        _census_for(MemoryOptions(census=(other,)), "dense", spec)
    # A model without dense layers looks up none: another model's dense record is no concern.
    moe_only = spec.model_copy(update={"num_experts": 4, "num_experts_per_tok": 2, "moe_ffn_hidden_size": 32,
                                       "layer_mlp_kinds": ("moe", "moe")})
    assert _census_for(MemoryOptions(census=(other,)), "dense", moe_only) is None
    bf16 = StrategyBatch.of(Strategy())
    _check_census_runtime(mine, bf16, MemoryOptions(attention="sdpa"))  # as measured: no error
    _check_census_runtime(mine, bf16, MemoryOptions())  # flash keeps what SDPA's fused kernels keep
    with pytest.raises(NdplanError, match=r"the census measured bfloat16 activations \(2 B\), and precision fp32"):
        _check_census_runtime(mine, StrategyBatch.of(Strategy(precision="fp32")), MemoryOptions())
    with pytest.raises(NdplanError, match="the census measured sdpa attention, and the estimate prices eager"):
        _check_census_runtime(mine, bf16, MemoryOptions(attention="eager"))


@pytest.mark.parametrize("field, value, words", [
    ("runtime", None, "runtime must be a runtime's name or a profile YAML's path, got None"),
    ("include_overhead", "no", "include_overhead must be True or False, got 'no'"),
    ("loss_upcast", 0, "loss_upcast must be True or False, got 0"),
    ("loss_parallel", "yes", "loss_parallel must be True or False (or None: the runtime's choice)"),
])
def test_memory_options_refuse_values_of_the_wrong_type(field, value, words):
    with pytest.raises(NdplanError, match=re.escape(words)):
        MemoryOptions(**{field: value})


def test_record_saved_at_tp_and_policy():
    r = _record()
    assert r.saved_at(1) == 100.0
    assert r.saved_at(2) == 40.0 + 30.0
    assert r.saved_at(2, policy="full") == 8.0
    assert r.saved_at(1, policy="selective") == 10.0
    with pytest.raises(NdplanError, match="policy"):
        r.saved_at(1, policy="most")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.pop("saved_bytes_per_token"), "saved_bytes_per_token"),
        (lambda d: d.update(saved_bytes_per_token="lots"), "saved_bytes_per_token"),
        (lambda d: d.update(saved_bytes_per_token=-1), "saved_bytes_per_token"),
        (lambda d: d.update(num_layers=0), "num_layers"),
        (lambda d: d.update(layer_kind=""), "layer_kind"),
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d["full_recompute"].pop("backward_peak_extra_bytes_per_token"),
         "backward_peak_extra_bytes_per_token"),
        (lambda d: d.update(selective=[1, 2]), "selective"),
        (lambda d: d["saved_ops"][0].update(bytes_per_token=None), "bytes_per_token"),
        (lambda d: d["saved_ops"][0].update(shape="32x160"), "shape"),
        (lambda d: d["saved_ops"][0].update(scaling="quadratic"), "scaling"),
        (lambda d: d.update(saved_constant_bytes=-4), "saved_constant_bytes"),
    ],
)
def test_malformed_census_file_names_the_field(tmp_path, mutate, field):
    data = json.loads(to_json([_record()]))
    mutate(data["records"][0])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(NdplanError, match=field) as e:
        load_census_file(path)
    assert "\n" not in str(e.value)
    assert "record 0" in str(e.value)


def test_malformed_census_file_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(NdplanError, match="not valid JSON"):
        load_census_file(path)
    with pytest.raises(NdplanError, match="cannot read"):
        load_census_file(tmp_path / "missing.json")
    path.write_text(json.dumps({"schema_version": 1, "records": {"a": 1}}))
    with pytest.raises(NdplanError, match="'records'"):
        load_census_file(path)


def test_record_module_does_not_import_torch():
    code = "import sys, ndplan.census, ndplan.census.record; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_extra_is_an_ndplan_error(monkeypatch):
    from ndplan.census import measure

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(NdplanError) as e:
        measure.run_census(TINY_LLAMA, seq_length=SEQ)
    assert str(e.value) == (
        "census needs the optional extra: pip install 'ndplan[census]' (torch==2.13.0, transformers)"
    )


def test_bad_arguments_are_ndplan_errors():
    from ndplan.census import run_census

    with pytest.raises(NdplanError, match="attention"):
        run_census(TINY_LLAMA, seq_length=SEQ, attention="flash")
    with pytest.raises(NdplanError, match="seq_length"):
        run_census(TINY_LLAMA, seq_length=2)
    with pytest.raises(NdplanError, match="experts"):
        run_census(TINY_LLAMA, seq_length=SEQ, experts="eager")


# --------------------------------------------------------------------------------------------------
# measurements (torch + transformers)

needs_torch = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="needs the census extra (torch, transformers)",
)


def _by_kind(records: list[CensusRecord]) -> dict[str, CensusRecord]:
    return {r.layer_kind: r for r in records}


@pytest.fixture(scope="module")
def llama():
    from ndplan.census import run_census

    return _by_kind(run_census(TINY_LLAMA, seq_length=SEQ, name="tiny-llama"))


@needs_torch
def test_llama_hand_checked_saved_bytes(llama):
    r = llama["dense"]
    assert r.num_layers == 2
    assert r.saved_bytes_per_token > 0
    assert r.saved_bytes_per_token == llama_saved_per_token(H, NH, NKV, HD, FFN)  # 2712
    assert r.attention_kernel == "aten._scaled_dot_product_flash_attention_for_cpu"
    # The per-op list adds up to the total and names the pieces of the derivation.
    assert sum(op.bytes_per_token for op in r.saved_ops) == r.saved_bytes_per_token
    assert {op.scaling for op in r.saved_ops} == {"token"} and r.saved_constant_bytes == 0
    by_op: dict[str, float] = {}
    for op in r.saved_ops:
        by_op[op.op] = by_op.get(op.op, 0.0) + op.bytes_per_token
    assert by_op["aten.rsqrt"] == 2 * 4
    assert by_op["aten._scaled_dot_product_flash_attention_for_cpu"] == 2 * NH * HD + 4 * NH
    assert by_op["aten.silu"] == 2 * FFN
    # cos and sin (bf16, [1, s, head_dim] each) are shared by every layer: counted once per model.
    assert r.shared_saved_bytes_per_token == 2 * 2 * HD
    # Flash/SDPA attention is linear in the sequence length.
    assert r.saved_bytes_per_token_per_seq == 0.0
    assert r.model == "tiny-llama" and r.model_type == "llama" and r.attention == "sdpa"


@needs_torch
def test_llama_tp2_split(llama):
    from ndplan.census import run_census

    r = llama["dense"]
    assert r.saved_replicated_bytes_per_token == llama_replicated_per_token(H)
    assert r.saved_tp_scaled_bytes_per_token + r.saved_replicated_bytes_per_token == r.saved_bytes_per_token
    # An independent run of what one TP-2 rank holds (heads, KV heads, FFN halved) saves
    # tp_part / 2 + replicated.
    half = dict(TINY_LLAMA, num_attention_heads=NH // 2, num_key_value_heads=NKV // 2, intermediate_size=FFN // 2)
    r2 = _by_kind(run_census(half, seq_length=SEQ))["dense"]
    assert r2.saved_bytes_per_token == r.saved_tp_scaled_bytes_per_token / 2 + r.saved_replicated_bytes_per_token
    assert r2.saved_bytes_per_token == r.saved_at(tp=2)
    assert r2.saved_bytes_per_token == llama_saved_per_token(H, NH // 2, NKV // 2, HD, FFN // 2)


@needs_torch
def test_tp2_split_of_a_config_without_head_dim():
    """A review: qwen2 (and mixtral, qwen2_moe) configs state no head_dim, and transformers takes
    hidden_size / heads: the census's TP-2 run halved the heads, doubled head_dim, and shrank no
    projection (the shipped qwen2.5-7b census put 16 KB/token of attention in the replicated part).
    The split equals that of the same config with its head_dim stated."""
    from ndplan.census import run_census

    qwen2 = dict(TINY_LLAMA, model_type="qwen2", head_dim=None)
    del qwen2["head_dim"]
    implicit = _by_kind(run_census(qwen2, seq_length=SEQ))["dense"]
    stated = _by_kind(run_census(dict(qwen2, head_dim=HD), seq_length=SEQ))["dense"]
    assert implicit.saved_tp_scaled_bytes_per_token == stated.saved_tp_scaled_bytes_per_token
    assert implicit.saved_replicated_bytes_per_token == stated.saved_replicated_bytes_per_token


@needs_torch
def test_llama_full_recompute_saves_the_layer_input(llama):
    r = llama["dense"]
    assert r.full_recompute.saved_bytes_per_token == 2 * H  # b*s*h bf16 elements / (b*s)
    assert r.full_recompute.saved_tp_scaled_bytes_per_token == 0.0
    # Backward recomputes the forward: its working set holds everything no-recompute saves.
    assert r.full_recompute.backward_peak_extra_bytes_per_token >= r.saved_bytes_per_token


@needs_torch
def test_llama_selective_between_full_and_none(llama):
    for r in llama.values():
        assert r.full_recompute.saved_bytes_per_token < r.selective.saved_bytes_per_token < r.saved_bytes_per_token
    # Selective keeps the input, the matmul outputs (q, k, v, o, gate, up, down) and SDPA's out + lse.
    r = llama["dense"]
    mm = (NH * HD + 2 * NKV * HD + H + 2 * FFN + H) * 2
    assert r.selective.saved_bytes_per_token == 2 * H + mm + 2 * NH * HD + 4 * NH


@needs_torch
def test_llama_output_layer(llama):
    r = llama["output"]
    # Final norm (6h+4), lm_head input (2h), fp32 log-softmax (4V), padded int64 labels (8(s+1)/s),
    # and nll's fp32 total_weight: one 4-byte scalar per micro-batch, a constant, not per token.
    assert r.saved_bytes_per_token == (6 * H + 4) + 2 * H + 4 * VOCAB + 8 * (SEQ + 1) / SEQ
    assert r.saved_constant_bytes == 4
    assert [op.scaling for op in r.saved_ops if op.op == "aten.nll_loss_forward"] == ["constant"]
    assert r.full_recompute.saved_bytes_per_token == 2 * H


@needs_torch
def test_saved_bytes_scale_with_hidden_size():
    from ndplan.census import run_census

    wide = dict(TINY_LLAMA, hidden_size=2 * H, intermediate_size=2 * FFN, num_attention_heads=2 * NH,
                num_key_value_heads=2 * NKV)
    r = _by_kind(run_census(wide, seq_length=SEQ))["dense"]
    assert r.saved_bytes_per_token == llama_saved_per_token(2 * H, 2 * NH, 2 * NKV, HD, 2 * FFN)
    # Everything doubles but the two 4-byte rsqrt values.
    assert r.saved_bytes_per_token == 2 * llama_saved_per_token(H, NH, NKV, HD, FFN) - 8


@needs_torch
def test_eager_attention_adds_an_s2_term():
    from ndplan.census import run_census

    r = _by_kind(run_census(TINY_LLAMA, seq_length=SEQ, attention="eager"))["dense"]
    # fp32 softmax output (4 bytes) and its bf16 copy (2 bytes) per head per (query, key) pair.
    assert r.saved_bytes_per_token_per_seq == 6 * NH
    assert r.attention == "eager"
    assert sorted(op.bytes_per_token for op in r.saved_ops if op.scaling == "token*seq") == [2 * NH * SEQ, 4 * NH * SEQ]
    # Per token at s: eager keeps q, the repeat_kv copies of k and v (nh heads each) and the
    # transposed output copy (2*nh*hd each) where SDPA kept q, k, v (nkv heads), out and the
    # logsumexp; plus the s^2 term.
    sdpa_attention = 2 * NH * HD + 2 * 2 * NKV * HD + 2 * NH * HD + 4 * NH
    eager_attention = 4 * (2 * NH * HD) + 6 * NH * SEQ
    assert r.saved_bytes_per_token == llama_saved_per_token(H, NH, NKV, HD, FFN) - sdpa_attention + eager_attention


@needs_torch
def test_qwen3_moe_measures():
    from ndplan.census import run_census

    recs = _by_kind(run_census(TINY_QWEN3_MOE, seq_length=SEQ))
    assert set(recs) == {"moe", "output"}
    r = recs["moe"]
    assert r.num_layers == 2 and r.experts == "grouped_mm"
    assert r.saved_bytes_per_token > 0 and r.saved_replicated_bytes_per_token > 0
    assert r.full_recompute.saved_bytes_per_token == 2 * 64
    assert r.full_recompute.saved_bytes_per_token < r.selective.saved_bytes_per_token < r.saved_bytes_per_token
    assert any(op.op == "aten._grouped_mm" for op in r.saved_ops)


@needs_torch
@pytest.mark.parametrize("config,kinds", [
    # Every class of these families says MoE (Glm4MoeMLP, Qwen3MoeDecoderLayer): a dense layer is
    # told by its lack of experts, not by its class's name (once, GLM-4.5's dense layers measured
    # as 'moe' and its MoE layers as 'moe-1', which no estimate could find).
    (dict(model_type="glm4_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
          n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3, vocab_size=100),
     {"dense": 1, "moe": 2}),
    ({**TINY_QWEN3_MOE, "mlp_only_layers": [0]}, {"dense": 1, "moe": 1}),
])
def test_a_dense_layer_of_a_moe_family_is_measured_as_dense(config, kinds):
    from ndplan.census import run_census

    recs = _by_kind(run_census(config, seq_length=SEQ))
    assert {kind: r.num_layers for kind, r in recs.items() if kind != "output"} == kinds


@needs_torch
@pytest.mark.parametrize("config", [
    dict(model_type="glm4_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=8,
         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=8,
         num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=1000, use_qk_norm=True,
         attention_bias=True),
    dict(model_type="minimax_m2", hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
         num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000),
    # Phi-3/4: the query copy, and the fused qkv projection's whole output kept (v is a view of it)
    dict(model_type="phi3", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
         num_key_value_heads=2, vocab_size=1000, pad_token_id=0, eos_token_id=1),
])
def test_the_pytorch_profile_prices_glm_and_minimax_layers_as_the_census_measures(config):
    """GLM-4.5's, MiniMax-M2's and Phi-3's attention keeps one more query-sized copy than Llama's
    (the profile's query_copy, 2·q bytes a token; once the formulas read GLM-4.5-Air's layers
    6-11% under the census), Phi-3's also its fused projection's q and k (fused_qkv, 2·(q + k);
    11% under): dense and MoE layers to the byte, with and without full recompute (a MoE layer
    read 4·k bytes a token under until its routing weights gathered per routed copy were priced:
    routing_weights_gathered, fp32 for these routers)."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.model import spec_from_hf_config
    from ndplan.strategy import Strategy
    from ndplan.strategy.batch import StrategyBatch

    spec = spec_from_hf_config(config, name="m")
    for record in run_census(config, seq_length=SEQ):
        if record.layer_kind == "output":
            continue
        kind = "moe" if "moe" in record.layer_kind else "dense"
        for recompute, measured in (("none", record.saved_bytes_per_token),
                                    ("full", record.full_recompute.saved_bytes_per_token)):
            acts = layer_activations(spec, StrategyBatch.of(Strategy(seq_length=SEQ, recompute=recompute)),
                                     MemoryOptions(runtime="pytorch", include_overhead=False))
            priced = (acts.full if recompute == "none" else acts.recomputed)[kind][0]
            assert priced == measured, (record.layer_kind, recompute)


_NORMS_DENSE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=1000)


@needs_torch
@pytest.mark.parametrize("config", [
    # post-norm, q/k norms over the projection, the weight multiplied in fp32
    dict(model_type="olmo2", **_NORMS_DENSE),
    # the same with a rotary per layer type and sliding layers (the window beyond the sequence)
    dict(model_type="olmo3", **{**_NORMS_DENSE, "num_hidden_layers": 4}, sliding_window=4 * SEQ),
    # four norms a layer, per-head q/k norms, GELU (tanh)
    dict(model_type="gemma3_text", **_NORMS_DENSE, head_dim=32, sliding_window=4 * SEQ),
])
def test_the_pytorch_profile_prices_post_and_sandwich_norm_layers_as_the_census_measures(config):
    """OLMo 2/3 put their norms after attention and MLP, Gemma 3 before and after (four a layer),
    and both multiply a norm's weight in fp32 before casting, so each norm keeps its normalised
    input in fp32 (4 bytes an element, Llama's 2): the formulas equal the census to the byte,
    with no, selective and full recompute (OLMo 3 and Gemma 3 were not measurable before: their
    rotary takes the layer's type)."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.model import spec_from_hf_config
    from ndplan.strategy import Strategy
    from ndplan.strategy.batch import StrategyBatch

    spec = spec_from_hf_config(config, name="m")
    records = [r for r in run_census(config, seq_length=SEQ) if r.layer_kind != "output"]
    # (the sliding layers a kind apart: below the window they keep what a full layer keeps)
    assert {r.layer_kind for r in records} <= {"dense", "dense-sliding"}
    for record in records:
        for recompute, measured in (("none", record.saved_bytes_per_token),
                                    ("selective", record.selective.saved_bytes_per_token),
                                    ("full", record.full_recompute.saved_bytes_per_token)):
            acts = layer_activations(spec, StrategyBatch.of(Strategy(seq_length=SEQ, recompute=recompute)),
                                     MemoryOptions(runtime="pytorch", include_overhead=False))
            assert (acts.full if recompute == "none" else acts.recomputed)["dense"][0] == measured, recompute


@needs_torch
@pytest.mark.parametrize("config,kinds", [
    (dict(model_type="gemma3_text", head_dim=32), [("dense-sliding", 5), ("dense", 1)]),  # five of six slide
    (dict(model_type="mistral"), [("dense", 6)]),  # every layer slides: one kind
    # one KV head: repeat_kv's reshape is a view, and no repeated K/V is kept
    (dict(model_type="gemma3_text", head_dim=32, num_key_value_heads=1), [("dense-sliding", 5), ("dense", 1)]),
])
def test_sliding_layers_are_measured_with_their_mask_and_priced_from_their_record(config, kinds):
    """The census hands a sliding layer the sliding-window mask the model would (it was given the
    causal one), and measures it apart where other layers attend in full: from the window on,
    transformers' SDPA keeps the mask as a bias and K/V repeated per head there (the profile's
    sdpa_masked). Whichever side of the window the census ran on, the estimate from its records
    equals the formulas' at sequences on both sides, under SDPA and a flash kernel (which takes
    the window natively), with no, selective and full recompute."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.model import spec_from_hf_config
    from ndplan.strategy import Strategy
    from ndplan.strategy.batch import StrategyBatch

    hf = {**dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1000, sliding_window=64), **config}
    spec = spec_from_hf_config(hf, name="m")
    for census_seq in (32, 128):
        records = run_census(hf, seq_length=census_seq)
        assert [(r.layer_kind, r.num_layers) for r in records if r.layer_kind != "output"] == kinds
        for attention in ("sdpa", "flash"):
            for seq in (32, 128, 256):
                for recompute in ("none", "selective", "full"):
                    batch = StrategyBatch.of(Strategy(seq_length=seq, recompute=recompute))
                    priced = [layer_activations(spec, batch, MemoryOptions(runtime="pytorch", include_overhead=False,
                                                                           attention=attention, census=census))
                              for census in ((), records)]
                    formula, measured = ((a.full if recompute == "none" else a.recomputed)["dense"][0] for a in priced)
                    assert measured == pytest.approx(formula, abs=1e-6), (census_seq, attention, seq, recompute)
    by_kind = {r.layer_kind: r for r in records}  # measured at 128, past the window: the mask kept
    if "dense-sliding" in by_kind:
        kv = hf["num_key_value_heads"]
        repeated = 2 * (2 * (8 - kv) * 32) if kv > 1 else 0  # K/V repeated to 8 heads of 32 (a view from one)
        assert by_kind["dense-sliding"].saved_bytes_per_token == (
            by_kind["dense"].saved_bytes_per_token + 2 * 128 + repeated)  # the bias: a bf16 element per key


_MOE_BASE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)


@needs_torch
@pytest.mark.parametrize("config", [
    # a gated shared expert (its output kept by the gate's product)
    dict(model_type="qwen2_moe", **_MOE_BASE, intermediate_size=512, moe_intermediate_size=128,
         shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2),
    dict(model_type="mixtral", **_MOE_BASE, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    # MLA, an fp32 router and a shared expert
    dict(model_type="deepseek_v3", hidden_size=256, num_hidden_layers=2, num_attention_heads=8, vocab_size=1000,
         intermediate_size=512, moe_intermediate_size=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
         v_head_dim=32, q_lora_rank=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
         first_k_dense_replace=1, n_group=1, topk_group=1),
])
def test_moe_layers_under_selective_recompute_price_as_the_census_measures(config):
    """Selective recompute keeps every matmul's output: the MoE block's input (a norm's output) is
    rebuilt unless a shared expert's down output needs a stand-in, the router's logits are kept
    (fp32 where it upcasts), MLA's kv down-projection keeps its rope key. Every layer to the byte
    under selective and full recompute (Mixtral's MoE layer read 11% over, Qwen2-MoE's 4.5% under
    without recompute); without recompute within the router's top-k weights, 4·(k + 1) bytes a
    token, which a router that does not renormalise them leaves out."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.model import spec_from_hf_config
    from ndplan.strategy import Strategy
    from ndplan.strategy.batch import StrategyBatch

    spec = spec_from_hf_config(config, name="m")
    options = MemoryOptions(runtime="pytorch", include_overhead=False)
    seq = 64  # (at 32 tokens the census keeps 32 B a token less in MLA's dense layer under selective: not priced)
    for record in run_census(config, seq_length=seq):
        if record.layer_kind == "output":
            continue
        kind = "moe" if "moe" in record.layer_kind else "dense"
        priced = {recompute: layer_activations(spec, StrategyBatch.of(Strategy(seq_length=seq, recompute=recompute)),
                                               options) for recompute in ("none", "selective", "full")}
        assert priced["selective"].recomputed[kind][0] == record.selective.saved_bytes_per_token, record.layer_kind
        assert priced["full"].recomputed[kind][0] == record.full_recompute.saved_bytes_per_token, record.layer_kind
        assert abs(priced["none"].full[kind][0] - record.saved_bytes_per_token) <= 4 * (2 + 1), record.layer_kind


@needs_torch
def test_olmoe_layer_prices_as_the_census_measures():
    """OLMoE's q/k norms span the projection (one statistic a token) and are hidden_size wide in
    transformers whatever the heads, so the census's TP-2 rank narrows them to its heads' share
    (it failed to build before). Its router does not renormalise the top-k weights (no
    norm_topk_prob), keeping 4·(k + 1) bytes a token fewer than the formulas' Qwen3 router: within
    that, and equal under full recompute."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.model import spec_from_hf_config
    from ndplan.strategy import Strategy
    from ndplan.strategy.batch import StrategyBatch

    config = dict(model_type="olmoe", **{**_NORMS_DENSE, "num_key_value_heads": 4}, num_experts=4,
                  num_experts_per_tok=2)
    spec = spec_from_hf_config(config, name="m")
    record = next(r for r in run_census(config, seq_length=SEQ) if r.layer_kind == "moe")
    options = MemoryOptions(runtime="pytorch", include_overhead=False)
    plain = layer_activations(spec, StrategyBatch.of(Strategy(seq_length=SEQ)), options).full["moe"][0]
    full = layer_activations(spec, StrategyBatch.of(Strategy(seq_length=SEQ, recompute="full")), options)
    assert 0 <= plain - record.saved_bytes_per_token <= 4 * (2 + 1)
    assert full.recomputed["moe"][0] == record.full_recompute.saved_bytes_per_token


@needs_torch
def test_deepseek_v3_mla_moe_measures():
    from ndplan.census import run_census

    # seq 64 (and 32): the efficient kernel pads its logsumexp to a multiple of 32 positions.
    recs = _by_kind(run_census(TINY_DEEPSEEK_V3, seq_length=64))
    assert set(recs) == {"mla-dense", "mla-moe", "output"}
    assert recs["mla-dense"].num_layers == 1 and recs["mla-moe"].num_layers == 2
    for kind in ("mla-dense", "mla-moe"):
        r = recs[kind]
        assert r.saved_bytes_per_token > 0
        # MLA's value head dim differs from q/k's: the GPU's memory-efficient kernel, linear in s.
        assert r.attention_kernel == "aten._scaled_dot_product_efficient_attention"
        assert r.saved_bytes_per_token_per_seq == 0.0
        # The kernel's RNG seed and offset, and the grouped-mm offsets: per layer, not per token.
        assert 0 < r.saved_constant_bytes < 100
        assert r.full_recompute.saved_bytes_per_token == 2 * 64
        assert r.full_recompute.saved_bytes_per_token < r.selective.saved_bytes_per_token < r.saved_bytes_per_token
    # Layer records JSON round-trip with their measured values and op lists.
    assert from_json(to_json(list(recs.values()))) == list(recs.values())


@needs_torch
def test_cli_writes_a_census_file(tmp_path, capsys):
    from ndplan.census.__main__ import main

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "census.json"
    assert main([str(cfg), "--seq", "16", "--out", str(out)]) == 0
    recs = load_census_file(out)
    assert [r.layer_kind for r in recs] == ["dense", "output"]
    assert recs[0].model == "tiny" and recs[0].seq_length == 16
    assert main(["no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_record_replace_keeps_schema():
    r = replace(_record(), notes="x")
    assert r.to_dict()["schema_version"] == SCHEMA_VERSION


@needs_torch
@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_instruments_on_a_tiny_graph(policy):
    """relu(x @ w) by hand: mm saves x (w is a parameter), relu saves its output; backward holds
    the incoming grad, makes relu's grad (2n per token) and, while that is alive, mm's grad for x (2h)."""
    import torch

    from ndplan.census import _engine as E

    T, h, n = 16, 8, 24

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(h, n, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.w)

    with E.FakeTensorMode():
        m = Tiny()
        x = torch.empty(T, h, dtype=torch.bfloat16, requires_grad=True)
        r = E.measure_once(m, x, root=m, params=E.module_storages(m), shared=set(), policy=policy, tokens=T)
    saved = {i.op: i.nbytes for i in r.saved.values()}
    if policy == "none":
        assert saved == {"input": 2 * T * h, "aten.relu": 2 * T * n}
        assert r.backward_peak_extra == 2 * T * n + 2 * T * h
    elif policy == "full":
        assert saved == {"input": 2 * T * h}
        # Recompute: mm's output and relu's recomputed output (2n + 2n) are alive together; then
        # relu's grad (2n) with that recomputed output, which is released once relu's backward ran,
        # before mm's grad for x (2h) is made.
        assert r.backward_peak_extra == 2 * T * n + 2 * T * n
    else:  # selective keeps the mm output, recomputes relu
        assert saved == {"input": 2 * T * h, "aten.mm": 2 * T * n}
        assert r.live_only == 1


TINY_GPT_OSS = dict(
    model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=8,
)


@needs_torch
def test_a_model_without_an_sdpa_path_says_to_run_eager():
    """transformers builds gpt-oss with eager attention only: the census says so, no traceback."""
    from ndplan.census import run_census

    with pytest.raises(NdplanError, match="cannot build 'gpt_oss' with attention 'sdpa'; try --attention eager"):
        run_census(TINY_GPT_OSS, seq_length=SEQ)


@needs_torch
def test_gpt_oss_measures_selective_recompute_with_its_expert_biases():
    """transformers adds gpt-oss's expert biases into the grouped matmul's output in place, which
    torch's selective checkpointing refuses once that output is kept ("Tensor cached ... has been
    mutated": the census failed on every gpt-oss model). Under selective recompute the census adds
    them out of place, the runnable form of the layer, and its MoE layers then price as the
    formulas do, at TP 1 and 2."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.memory.options import MemoryOptions
    from ndplan.model.hf import spec_from_hf_config
    from ndplan.strategy import Strategy, StrategyBatch

    records = run_census(TINY_GPT_OSS, seq_length=16, attention="eager", name="go")
    spec = spec_from_hf_config(TINY_GPT_OSS, name="go")
    for tp in (1, 2):
        batch = StrategyBatch.of(Strategy(tp=tp, dp=1, seq_length=16, micro_batch_size=1, global_batch_size=1,
                                          recompute="selective"))
        priced, measured = (layer_activations(spec, batch, MemoryOptions(
            runtime="pytorch", include_overhead=False, attention="eager", census=tuple(census),
            selective_policy="keep-matmuls")) for census in ((), records))
        assert measured.recomputed["moe"][0] == priced.recomputed["moe"][0] > 0, tp


@needs_torch
def test_torchtitan_per_op_checkpointing_keeps_the_odd_matmuls():
    """torchtitan's per-op selective checkpointing (selective_ac_option "op") saves the attention
    kernel's outputs and every second matmul's, counting from the first of each layer: of a
    Llama layer q, v, gate and down; k, o_proj's output and up are rebuilt. Measured on the
    transformers layer, and the pytorch profile's op_keep flags give the same bytes."""
    from ndplan.census.measure import measure_policy
    from ndplan.memory.activations import layer_activations
    from ndplan.memory.options import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.model.hf import spec_from_hf_config
    from ndplan.strategy import Strategy, StrategyBatch

    measured = measure_policy(TINY_LLAMA, "torchtitan-op", seq_length=SEQ)["dense"]
    kept_matmuls = (NH * HD + NKV * HD + FFN + H) * 2  # q, v, gate, down
    assert measured == 2 * H + kept_matmuls + 2 * NH * HD + 4 * NH  # + the input, SDPA's output and logsumexp
    model = spec_from_hf_config(TINY_LLAMA, name="tiny-llama")
    acts = layer_activations(model, StrategyBatch.of(Strategy(recompute="selective", seq_length=SEQ)),
                             MemoryOptions(selective_policy="torchtitan-op"))
    assert acts.recomputed["dense"][0] == measured
    # ... less than torch's keep-every-matmul policy (the census's own), by k, o_proj's output and up
    everything = layer_activations(model, StrategyBatch.of(Strategy(recompute="selective", seq_length=SEQ)),
                                   MemoryOptions())
    assert everything.recomputed["dense"][0] - measured == (NKV * HD + H + FFN) * 2
    # A MoE model's layers take matmuls in another order and grouped expert GEMMs torchtitan's list
    # leaves out: priced as the runtime's own policy, an upper bound.
    moe = get_preset("qwen3-30b-a3b")
    batch = StrategyBatch.of(Strategy(recompute="selective", seq_length=SEQ))
    assert (layer_activations(moe, batch, MemoryOptions(selective_policy="torchtitan-op")).recomputed["moe"][0]
            == layer_activations(moe, batch, MemoryOptions()).recomputed["moe"][0])
    # So does Phi-3's fused q/k/v projection (its every other matmul is another): an upper bound
    # over what the census measures (the flags read it under)
    phi_config = {**TINY_LLAMA, "model_type": "phi3", "pad_token_id": 0, "eos_token_id": 1}
    phi = spec_from_hf_config(phi_config, name="tiny-phi")
    priced = layer_activations(phi, batch, MemoryOptions(selective_policy="torchtitan-op")).recomputed["dense"][0]
    assert priced == layer_activations(phi, batch, MemoryOptions()).recomputed["dense"][0]
    assert priced >= measure_policy(phi_config, "torchtitan-op", seq_length=SEQ)["dense"]


@needs_torch
def test_a_census_prices_only_the_sharding_it_measured(llama):
    """A review: a census was applied under sequence parallelism (its TP-2 run has none: --sp
    changed nothing) and to a loss on whole logits as if vocabulary-parallel. Where a strategy
    shards otherwise, the formulas price its layers; the output keeps its TP-1 bytes on whole logits."""
    from ndplan.memory.activations import layer_activations
    from ndplan.memory.options import MemoryOptions
    from ndplan.model.hf import spec_from_hf_config
    from ndplan.strategy import Strategy, StrategyBatch

    model = spec_from_hf_config(TINY_LLAMA, name="tiny-llama")
    census = MemoryOptions(census=tuple(llama.values()), attention="sdpa")
    formulas = MemoryOptions(attention="sdpa")
    plain = StrategyBatch.of(Strategy(tp=2, seq_length=SEQ))
    sharded = StrategyBatch.of(Strategy(tp=2, sequence_parallel=True, seq_length=SEQ))
    assert layer_activations(model, plain, census).full["dense"][0] == llama["dense"].saved_at(tp=2)
    assert (layer_activations(model, sharded, census).full["dense"][0]
            == layer_activations(model, sharded, formulas).full["dense"][0])
    whole = layer_activations(model, plain, census).output[0]  # the pytorch runtime: whole logits
    split = layer_activations(model, plain, MemoryOptions(census=tuple(llama.values()), attention="sdpa",
                                                          loss_parallel=True)).output[0]
    assert whole == llama["output"].saved_bytes_per_token and split == llama["output"].saved_at(tp=2) < whole
    # and says so beside the estimate
    from ndplan.memory.report import known_gaps

    said = known_gaps(Strategy(tp=2, sequence_parallel=True, seq_length=SEQ), census, model)
    assert any("otherwise than the census's TP-2 run did (sequence parallelism): the formulas price" in g for g in said)
    assert not any("census's TP-2 run" in g for g in known_gaps(Strategy(tp=2, seq_length=SEQ), census, model))


@needs_torch
def test_a_census_keeps_megatrons_selective_recompute_to_the_formulas(llama):
    """A review: under the megatron runtime a census put torch's keep-every-matmul figures where
    Megatron's core-attention recompute was asked for; its selective figures apply to that policy only."""
    from ndplan.memory.activations import layer_activations
    from ndplan.memory.options import MemoryOptions
    from ndplan.model.hf import spec_from_hf_config
    from ndplan.strategy import Strategy, StrategyBatch

    model = spec_from_hf_config(TINY_LLAMA, name="tiny-llama")
    batch = StrategyBatch.of(Strategy(recompute="selective", seq_length=SEQ))
    megatron = layer_activations(model, batch, MemoryOptions(runtime="megatron", attention="sdpa",
                                                             census=tuple(llama.values())))
    formulas = layer_activations(model, batch, MemoryOptions(runtime="megatron", attention="sdpa"))
    assert megatron.recomputed["dense"][0] == formulas.recomputed["dense"][0]
    torch_sac = layer_activations(model, batch, MemoryOptions(attention="sdpa", census=tuple(llama.values())))
    assert torch_sac.recomputed["dense"][0] == llama["dense"].selective.saved_bytes_per_token


@needs_torch
def test_one_model_failing_keeps_the_others_census(tmp_path, capsys):
    """A review: one model transformers cannot run (GPT-OSS under SDPA) aborted the whole census
    and discarded the models already measured; they are written, and the command fails naming it."""
    from ndplan.cli import main

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "census.json"
    assert main(["census", "--seq", str(SEQ), str(config), "gpt-oss-20b", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "census of 1 model failed (the others' records are in" in err and "gpt-oss-20b: census:" in err
    assert {r.layer_kind for r in load_census_file(out)} == {"dense", "output"}


@needs_torch
def test_an_eager_census_prices_its_s2_term_once_and_splits_it_by_tp():
    """A review: the estimator added ``saved_bytes_per_token_per_seq * seq`` to the headline
    bytes per token, which already hold that term at the measured length (the s^2 attention
    probabilities counted twice), and did not split it by TP. Priced at the measured length the
    estimate is the record's own figure; elsewhere, ``saved_at``'s slope."""
    from ndplan.census import run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.memory.options import MemoryOptions
    from ndplan.model.hf import spec_from_hf_config
    from ndplan.strategy import Strategy, StrategyBatch

    records = run_census(TINY_LLAMA, seq_length=SEQ, attention="eager")
    dense = _by_kind(records)["dense"]
    assert dense.saved_bytes_per_token_per_seq > 0
    model = spec_from_hf_config(TINY_LLAMA, name="tiny-llama")
    options = MemoryOptions(census=tuple(records), attention="eager")
    for tp, seq in ((1, SEQ), (2, SEQ), (1, 2 * SEQ), (2, 2 * SEQ)):
        acts = layer_activations(model, StrategyBatch.of(Strategy(tp=tp, seq_length=seq)), options)
        assert acts.full["dense"][0] == pytest.approx(dense.saved_at(tp=tp, seq_length=seq))
    at_measured = layer_activations(model, StrategyBatch.of(Strategy(seq_length=SEQ)), options)
    assert at_measured.full["dense"][0] == pytest.approx(dense.saved_bytes_per_token)


@needs_torch
def test_a_model_type_transformers_lacks_is_one_short_line():
    """A review: transformers' 'Unrecognized model identifier' lists all of its ~900 model types,
    and the census quoted the 10 KB list whole as its one-line error."""
    from ndplan.census import run_census

    with pytest.raises(NdplanError) as error:
        run_census({**TINY_LLAMA, "model_type": "nosuch"}, seq_length=SEQ)
    message = str(error.value)
    assert "transformers cannot build a 'nosuch' config: Unrecognized model identifier: nosuch" in message
    assert len(message) < 400, len(message)


def test_a_yaml_model_spec_is_named_as_not_measurable(tmp_path):
    """A review: `ndplan census spec.yaml` said 'cannot read spec.yaml: Expecting value: line 1
    column 1 (char 0)', a JSON parser's words for a file ndplan itself reads as a model."""
    from ndplan.census.measure import load_hf_config

    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\nhidden_size: 64\n")
    with pytest.raises(NdplanError, match="not a Hugging Face config.json .*line 1"):
        load_hf_config(str(spec))


def test_a_model_folder_is_read_as_its_config_json(tmp_path):
    """A review: `ndplan census|measure|verify FOLDER` said "census: no config file or preset named
    'FOLDER'" where estimate, search and models read a Hugging Face model folder's config.json."""
    from ndplan.census.measure import load_hf_config

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert load_hf_config(str(folder)) == ("tiny-llama", TINY_LLAMA)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NdplanError, match="a model folder needs a config.json"):
        load_hf_config(str(empty))


def test_python_m_census_out_to_a_missing_folder_is_an_error_line(tmp_path, monkeypatch, capsys):
    """A review: `python -m ndplan.census MODEL --out missing/x.json` measured, printed its table,
    then ended in a FileNotFoundError traceback; save_census_file now raises an NdplanError."""
    from ndplan.census import __main__ as census_main
    from ndplan.census.record import save_census_file

    with pytest.raises(NdplanError, match="cannot write census file .*missing"):
        save_census_file(tmp_path / "missing" / "x.json", [])
    monkeypatch.setattr(census_main, "run_census", lambda *a, **k: [])
    assert census_main.main(["llama-3.1-8b", "--out", str(tmp_path / "missing" / "x.json")]) == 2
    assert "cannot write census file" in capsys.readouterr().err


def test_a_shipped_census_backward_working_set_shrinks_with_tp():
    """A review: the shipped llama-3.1-8b record's backward working set, measured at TP 1 (57,344
    B/token: two ffn-wide bf16 gradients), replaced the formula at every tp. Its census's TP-2 run
    measures 28,672 (fake tensors, torch 2.13, seq 1024): at tp it takes the formula's 1/tp."""
    from ndplan.memory.activations import layer_activations
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy, StrategyBatch

    model = get_preset("llama-3.1-8b")
    for tp, sp, expected in ((1, False, 57344.0), (2, False, 28672.0), (8, False, 7168.0), (8, True, 7168.0)):
        batch = StrategyBatch.of(Strategy(tp=tp, sequence_parallel=sp, seq_length=4096))
        assert layer_activations(model, batch, MemoryOptions()).backward_extra["dense"][0] == expected, (tp, sp)


@needs_torch
def test_a_census_backward_working_set_at_tp_2_is_its_tp_2_run(monkeypatch: pytest.MonkeyPatch):
    """The record keeps the TP-1 run's backward working set alone; the estimate at TP 2 is what
    the census's own TP-2 run (halved heads and widths) measures."""
    from ndplan.census import measure, run_census
    from ndplan.memory.activations import layer_activations
    from ndplan.model.hf import spec_from_hf_config
    from ndplan.strategy import Strategy, StrategyBatch

    seen: dict[str, float] = {}
    figures = measure._figures

    def spy(runs, policy, s_main, s_half, b):
        for tp in (1, 2):
            seen.setdefault(f"{policy}-{tp}", runs[(tp, s_main, policy)].backward_peak_extra / (b * s_main))
        return figures(runs, policy, s_main, s_half, b)

    monkeypatch.setattr(measure, "_figures", spy)
    config = dict(TINY_LLAMA, intermediate_size=512)  # the MLP's gradients the largest working set
    records = run_census(config, seq_length=SEQ, name="tiny-llama")
    dense = _by_kind(records)["dense"]
    assert dense.backward_peak_extra_bytes_per_token == seen["none-1"] == 2 * 512 * 2
    options = MemoryOptions(census=tuple(records), attention="sdpa")
    acts = layer_activations(spec_from_hf_config(config, name="tiny-llama"),
                             StrategyBatch.of(Strategy(tp=2, seq_length=SEQ)), options)
    assert acts.backward_extra["dense"][0] == seen["none-2"] == 512 * 2
