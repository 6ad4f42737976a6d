"""Memory estimator: hand-derived terms on a tiny model, conservation, and monotonicity."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.memory import MemoryOptions, estimate, stage_memory
from ndplan.model import ModelSpec, count_parameters, get_preset
from ndplan.strategy import Strategy, StrategyBatch, check_strategy
from ndplan.strategy.precision import PrecisionPolicy

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=256)
NO_OVERHEAD = MemoryOptions(include_overhead=False)


def test_tiny_static_terms_by_hand():
    report = estimate(TINY, Strategy(seq_length=8), options=NO_OVERHEAD)
    total = count_parameters(TINY).total
    stage = report.stages[0]
    # megatron-bf16: 2 B weights, 4 B gradients, 2·4 + 4 B optimizer per parameter, no ZeRO.
    assert stage.params_bytes == 2 * total
    assert stage.grads_bytes == 4 * total
    assert stage.optimizer_bytes == 12 * total


def test_tiny_activations_by_hand():
    """PyTorch profile, flash attention, one micro-batch of 8 tokens, 2 layers (h=64, q=64, k=v=32,
    heads=4, ffn=128, vocab=256, bf16 activations), per token:
      norm      = 4h (fp32 input) + 4 (inverse rms) + 2h (normalized)              = 388
      attention = 2h (input) + 2q + 2k + 2v (rotary q/k, v) + 4·heads (logsumexp) + 2o = 528
      mlp       = 2h + 4 · 2·ffn (gate, up, silu, product)                          = 1152
      layer     = 2·norm + attention + mlp                                          = 2456
      output    = norm + 2h (head input) + 4·vocab (log-softmax) + 8 (shifted label) = 1548
      embedding = 8 (int64 token id)
    held = 8 tokens × (2·2456 + 1548 + 8) = 51744 bytes."""
    report = estimate(TINY, Strategy(seq_length=8), options=NO_OVERHEAD)
    assert report.stages[0].activations_bytes == 8 * (2 * 2456 + 1548 + 8) == 51744
    kinds = report.stages[0].activations_by_kind
    assert kinds["mlp"] == 8 * 2 * 1152 and kinds["attention"] == 8 * 2 * 528 and kinds["norm"] == 8 * 2 * 2 * 388


def test_tiny_selective_recompute_keeps_its_kinds_apart():
    """The pytorch profile's selective policy keeps every matmul's and the attention kernel's
    output and re-runs the elementwise ops (per token, the tiny layer of the test above):
      attention = 2h (input) + 2q + 2k + 2v + 4·heads + 2o, all kept                  = 528
      mlp       = 2h (input) + 2·ffn (gate) + 2·ffn (up)                             = 640
                  (silu's output and the product, down's input, re-run: not kept)
      norm      = 0 (its input, the layer input and the residual, is another tensor's)
      recompute = 2h, the layer input the checkpoint keeps                           = 128
    By kind, not as one 'recompute' total (once, every byte of a selectively recomputed layer
    was reported there)."""
    report = estimate(TINY, Strategy(seq_length=8, recompute="selective"), options=NO_OVERHEAD)
    kinds = report.stages[0].activations_by_kind
    assert kinds["attention"] == 8 * 2 * 528 and kinds["mlp"] == 8 * 2 * 640
    assert kinds.get("norm", 0) == 0 and kinds["recompute"] == 8 * 2 * 128
    assert report.stages[0].activations_bytes == sum(kinds.values())


def test_tiny_full_recompute_keeps_layer_inputs():
    report = estimate(TINY, Strategy(seq_length=8, recompute="full"), options=NO_OVERHEAD)
    # each layer keeps its bf16 input (2h bytes per token); output and embedding as before
    assert report.stages[0].activations_bytes == 8 * (2 * 2 * 64 + 1548 + 8)


def test_pipeline_in_flight_scales_first_stage():
    # 1F1B: stage s holds min(m, pp - s) micro-batches; 4 layers over pp=2, 8 micro-batches.
    # torch.distributed.pipelining also keeps each stage's output until its backward: the hidden
    # state (2h bytes per token) on the first stage, the bf16 logits (2·vocab) on the last (the
    # input it received is its receive buffer, a communication buffer).
    model = TINY.model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    report = estimate(model, Strategy(seq_length=8, pp=2, num_micro_batches=8), options=NO_OVERHEAD)
    first, last = report.stages
    assert first.activations_bytes == 2 * 8 * (2 * 2456 + 8 + 2 * 64)
    assert last.activations_bytes == 1 * 8 * (2 * 2456 + 1548 + 2 * 256)


def test_gpipe_holds_every_micro_batch():
    model = TINY.model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    report = estimate(model, Strategy(seq_length=8, pp=2, num_micro_batches=8, schedule="gpipe"), options=NO_OVERHEAD)
    assert report.stages[0].activations_bytes == 8 * 8 * (2 * 2456 + 8 + 2 * 64)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b"])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_stage_parameters_add_up_to_the_model(name, pp):
    model = get_preset(name)
    assert not model.tie_word_embeddings  # tied tables are copied on two stages: tested below
    memory = stage_memory(model, StrategyBatch.of(Strategy(pp=pp)), NO_OVERHEAD)
    assert memory.params.sum() / 2 == pytest.approx(count_parameters(model).total_with_mtp, rel=1e-12)


def test_tied_embedding_is_copied_on_the_last_stage():
    model = get_preset("qwen3-8b").model_copy(update={"tie_word_embeddings": True})
    one = stage_memory(model, StrategyBatch.of(Strategy(pp=1)), NO_OVERHEAD).params.sum() / 2
    two = stage_memory(model, StrategyBatch.of(Strategy(pp=2)), NO_OVERHEAD).params.sum() / 2
    assert two - one == model.vocab_size * model.hidden_size


def test_zero_stages_shard_the_right_states():
    model = get_preset("llama-3.1-8b")
    total = count_parameters(model).total
    reports = [estimate(model, Strategy(dp=8, zero=z), options=NO_OVERHEAD).stages[0] for z in range(4)]
    assert reports[1].optimizer_bytes == pytest.approx(12 * total / 8)
    assert reports[1].grads_bytes == 4 * total
    assert reports[2].grads_bytes == pytest.approx(4 * total / 8)
    assert reports[3].params_bytes == pytest.approx(2 * total / 8)


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
@pytest.mark.parametrize("settings", [
    {"dp": 2, "tp": 8, "pp": 4, "num_micro_batches": 8, "zero": 1},  # PyTorch: the whole embedding gradient
    {"dp": 2, "tp": 8, "pp": 4, "num_micro_batches": 1, "zero": 1},
    {"dp": 4, "tp": 2, "pp": 2, "vpp": 2, "schedule": "interleaved", "num_micro_batches": 4, "zero": 2},
    {"dp": 8, "tp": 2, "zero": 3, "fsdp": True, "num_micro_batches": 4},
    {"dp": 2, "tp": 2, "pp": 4, "num_micro_batches": 16, "schedule": "gpipe", "recompute": "full"},
    {"dp": 2, "tp": 2, "pp": 4, "vpp": 2, "num_micro_batches": 8, "schedule": "zbv", "sequence_parallel": True},
])
def test_by_layer_kind_sums_to_the_stage_totals(runtime, settings):
    """Every byte of params, grads and optimizer states, and of the held activations (the
    pipeline runtime's kept stage inputs and outputs too), is some layer kind's, on every stage."""
    model = get_preset("llama-3.1-70b")
    options = MemoryOptions(include_overhead=False, runtime=runtime)
    for stage in estimate(model, Strategy(seq_length=2048, **settings), options=options).stages:
        assert sum(stage.static_by_kind.values()) == pytest.approx(
            stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes, rel=1e-12)
        assert sum(stage.activations_by_kind.values()) == pytest.approx(stage.activations_bytes, rel=1e-12)


def test_whole_embedding_gradient_is_explained():
    """PyTorch's accumulated vocabulary-parallel embedding gradient is whole: the grads line says
    so with its bytes, and they are the embedding's."""
    model = get_preset("llama-3.1-70b")
    strategy = Strategy(dp=2, tp=8, pp=4, num_micro_batches=8, zero=1, seq_length=2048)
    report = estimate(model, strategy, options=MemoryOptions(include_overhead=False, runtime="pytorch"))
    first, middle = report.stages[0], report.stages[1]
    table = model.vocab_size * model.hidden_size
    layers_grads = middle.grads_bytes  # stage 1 holds the same 20 layers and no table
    assert first.grads_bytes == pytest.approx(layers_grads + 4 * table, rel=1e-12)
    line = next(line for line in report.explain() if line.startswith("grads"))
    assert "the whole embedding gradient" in line and "vocab·h·(1 − 1/tp) × 4 B = 3.42 GiB" in line


def test_expert_parallel_divides_experts():
    model = get_preset("mixtral-8x7b")
    one = estimate(model, Strategy(dp=8), options=NO_OVERHEAD).stages[0].static_by_kind["moe"]
    eight = estimate(model, Strategy(dp=8, ep=8), options=NO_OVERHEAD).stages[0].static_by_kind["moe"]
    router = model.num_layers * model.num_experts * model.hidden_size * 18
    assert eight - router == pytest.approx((one - router) / 8)


def test_eager_attention_is_quadratic_flash_linear():
    model = get_preset("llama-3.1-8b")

    def acts(attention, seq):
        options = MemoryOptions(include_overhead=False, attention=attention)
        return estimate(model, Strategy(seq_length=seq), options=options).stages[0].activations_bytes

    assert acts("flash", 8192) == pytest.approx(2 * acts("flash", 4096), rel=1e-9)
    assert acts("eager", 8192) > 2.5 * acts("eager", 4096)


def test_attention_backward_working_set_where_the_scores_are_materialised():
    """Per token, per head·seq element (measured on an H200: tests/data/measured/cuda): eager
    attention's backward holds the probabilities' gradient in fp32, softmax's fp32 gradient and
    CUDA's fp32 temporary product (4 + 4 + 4 B) once the bf16 probabilities (2 B) are freed, 10 B;
    the fp32 math path (fp32, grouped KV heads) 12 B; flash kernels none. TP divides the heads.
    The product is a CUDA kernel's scratch: counted with the overhead, like cuBLAS's workspace."""
    from ndplan.memory.activations import layer_activations

    def working(attention: str, tp: int = 1, precision: str = "bf16-pure", overhead: bool = True) -> float:
        batch = StrategyBatch.of(Strategy(seq_length=8, tp=tp, precision=precision))
        acts = layer_activations(TINY, batch, MemoryOptions(attention=attention, include_overhead=overhead))
        return float(acts.attention_backward["dense"][0])

    heads_seq = TINY.num_attention_heads * 8
    assert working("eager") == 10 * heads_seq
    assert working("eager", tp=2) == 10 * heads_seq / 2
    assert working("sdpa", precision="fp32") == 12 * heads_seq
    assert working("sdpa") == working("flash") == working("flash", precision="fp32") == 0
    # without overhead, as fake tensors measure it: no CUDA product (4 B)
    assert working("eager", overhead=False) == 6 * heads_seq
    assert working("sdpa", precision="fp32", overhead=False) == 8 * heads_seq


def test_attention_backward_sets_the_peak_of_long_eager_sequences():
    """Llama-3.1-8B, 8k tokens, eager, full recompute, one micro-batch: the peak is the attention
    backward of a layer, ~24 GiB of s² working set beyond the rebuilt scores, far above the MLP's."""
    model = get_preset("llama-3.1-8b")
    s = Strategy(seq_length=8192, recompute="full", precision="bf16-pure")
    flash = estimate(model, s, options=MemoryOptions(attention="flash")).stages[0]
    eager = estimate(model, s, options=MemoryOptions(attention="eager")).stages[0]
    working = 10 * model.num_attention_heads * 8192 * 8192
    assert eager.forward_backward_bytes - flash.forward_backward_bytes > working


def test_offload_removes_optimizer_states():
    s = Strategy(dp=2, zero=1, optimizer_offload=True)
    assert estimate(TINY, s, options=NO_OVERHEAD).stages[0].optimizer_bytes == 0


def test_invalid_strategy_is_refused_with_reasons():
    with pytest.raises(NdplanError, match="tp=3 does not divide num_attention_heads=4"):
        estimate(TINY, Strategy(tp=3))


def test_report_json_shape_and_fit():
    report = estimate(get_preset("llama-3.1-8b"), Strategy(dp=8, zero=1), get_device("h100-sxm"))
    data = report.to_dict()
    assert {"peak_bytes", "peak_stage", "fits", "capacity_bytes", "stages"} <= set(data)
    stage = data["stages"][0]
    assert {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "comm_bytes",
            "transient_bytes", "overhead_bytes", "by_layer_kind"} <= set(stage)
    assert data["fits"] == (data["peak_bytes"] <= data["capacity_bytes"])
    assert stage["overhead_bytes"] > 0


def test_batch_equals_single_evaluations():
    model = get_preset("deepseek-v2-lite")
    strategies = [
        Strategy(dp=4, tp=2, pp=2, ep=8, etp=1, sequence_parallel=True, num_micro_batches=8, zero=1),
        Strategy(dp=2, tp=1, pp=4, vpp=2, schedule="interleaved", num_micro_batches=8, recompute="full"),
        Strategy(dp=16, ep=4, zero=3, fsdp=True, recompute="selective", micro_batch_size=2),
        Strategy(dp=2, pp=4, vpp=2, schedule="zbv", num_micro_batches=8),
        Strategy(dp=2, pp=4, vpp=2, schedule="interleaved", num_micro_batches=4, pipeline_runs=2, zero=3, fsdp=True),
        Strategy(dp=2, pp=4, num_micro_batches=4, pipeline_runs=3, reshard_after_forward=False, zero=3, fsdp=True),
    ]
    together = stage_memory(model, StrategyBatch.of(strategies))
    for i, s in enumerate(strategies):
        alone = stage_memory(model, StrategyBatch.of(s))
        np.testing.assert_allclose(together.device[i, : s.pp], alone.device[0], rtol=1e-12)



@pytest.mark.parametrize("schedule, pp, vpp, stage_layers", [
    ("1f1b", 4, 1, (5, 8, 8, 6)),            # the two middle stages share one pattern
    ("interleaved", 4, 2, (2, 4, 4, 3, 3, 4, 4, 3)),
    ("zbv", 4, 2, (3, 4, 4, 3, 3, 4, 4, 2)),
])
def test_shared_stage_patterns_expand_to_every_stage(schedule, pp, vpp, stage_layers):
    """Stages with the same layers and neighbours are priced once and copied; the breakdown
    path prices every stage on its own. Both must give every stage the same bytes."""
    model = get_preset("deepseek-v2-lite")
    strategies = [Strategy(dp=2, pp=pp, vpp=vpp, schedule=schedule, num_micro_batches=m, recompute=r)
                  for m in (4, 8) for r in ("none", "full")]
    batch = StrategyBatch.of(strategies)
    shared = stage_memory(model, batch, stage_layers=stage_layers)
    each = stage_memory(model, batch, breakdown=True, stage_layers=stage_layers)
    for name in ("params", "activations", "device"):
        np.testing.assert_allclose(getattr(shared, name), getattr(each, name), rtol=1e-12)
    # Uneven layers must show: the stages do not all hold the same parameters.
    assert len(np.unique(np.round(shared.params[0, :pp]))) > 1

@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_peak_memory_prices_only_the_stages_that_can_be_the_peak(runtime):
    """peak_memory prices, of the stages sharing a pattern in a 1F1B, GPipe or Seq1F1B pipeline,
    those no earlier stage of the pattern outweighs (``pattern_leaders``: deepseek-v2-lite's
    interior stages over pp 8 hold fewer micro-batches stage after stage, and price as one):
    the same peaks and peak stages, bit for bit, as the largest of every stage's device total,
    the first of equal ones (where the optimizer step is the peak, every stage of a pattern ties)."""
    from ndplan.memory.shape import group_shape
    from ndplan.memory.stages import _sorted_groups, peak_memory
    from ndplan.strategy.batch import CODES

    strategies = [
        Strategy(dp=dp, tp=8 // dp, pp=pp, schedule=schedule, vpp=2 if schedule in ("interleaved", "zbv") else 1,
                 seq_chunks=2 if schedule == "seq1f1b" else 1, num_micro_batches=m, recompute=recompute, zero=zero,
                 micro_batch_size=mbs, seq_length=4096)
        for schedule in ("1f1b", "gpipe", "seq1f1b", "zb-h1", "interleaved", "zbv") for pp in (4, 8)
        for dp in (2, 8) for m in (1, 3, 8, 16) for recompute in ("none", "full") for zero in (0, 3) for mbs in (1, 4)
    ]
    batch = StrategyBatch.of([s for s in strategies if not check_strategy(s, MODEL, s.dp * s.tp * s.pp)])
    options = MemoryOptions(runtime=runtime)
    every = stage_memory(MODEL, batch, options).device
    peak, stage = peak_memory(MODEL, batch, options)
    np.testing.assert_array_equal(peak, every.max(axis=1))
    np.testing.assert_array_equal(stage, every.argmax(axis=1))
    # Ties among the stages to break.
    assert np.any(np.sum(every == peak[:, None], axis=1) > 1)
    # Each pattern of 1F1B, GPipe and Seq1F1B prices one stage (an earlier one holds as much or
    # more); the other schedules every stage.
    for key, _, out, _ in _sorted_groups(MODEL, batch, options, None, device_only=True):
        schedule, pp = CODES["schedule"][key[0]], key[1]
        shape = group_shape(MODEL, schedule, pp, key[2], None, bool(key[4]), bool(key[5]),
                             bool(options.profile.pipeline_stage_output), True)
        priced = out["stages"].tolist() if "stages" in out else list(range(pp))
        assert priced == (shape.reps.tolist() if schedule in ("1f1b", "gpipe", "seq1f1b") else list(range(pp)))
    # (zb-h1's stage 2 shares stage 1's pattern, and is the peak of some.)
    assert np.any(stage[batch.is_("schedule", "zb-h1")] == 2)


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_peak_memory_with_a_limit_flags_the_same_rows_over_it_and_prices_the_rest_the_same(runtime):
    """peak_memory(limit=...) prices a strategy no further once the static state at its held
    peak puts it certainly over the limit (stage -1, its peak a lower bound above the limit);
    every other strategy gets the figures it gets without a limit, bit for bit. Limits at a
    strategy's peak (it fits), just under it (over by one unit in the last place: inside the
    rounding margin, so priced in full) and just over it, and at the median peak, where many
    strategies are cut. One micro-batch under PyTorch (the gradients appear in the backward:
    a maximum of two sums) is never cut."""
    from ndplan.memory.stages import peak_memory

    strategies = [
        Strategy(dp=dp, tp=8 // dp, pp=pp, schedule=schedule, vpp=2 if schedule in ("interleaved", "zbv") else 1,
                 num_micro_batches=m, recompute=recompute, zero=zero, micro_batch_size=mbs, seq_length=4096)
        for schedule in ("1f1b", "gpipe", "interleaved", "zbv") for pp in (2, 4) for dp in (2, 8)
        for m in (1, 4, 16) for recompute in ("none", "full") for zero in (0, 3) for mbs in (1, 4)
    ]
    batch = StrategyBatch.of([s for s in strategies if not check_strategy(s, MODEL, s.dp * s.tp * s.pp)])
    options = MemoryOptions(runtime=runtime)
    peak, stage = peak_memory(MODEL, batch, options)
    pivot = int(np.argsort(peak)[len(peak) // 3])  # a strategy near the smaller peaks
    single = batch.micro_batches_per_step == 1
    cuts = {}
    for limit in (float(np.median(peak)), peak[pivot], np.nextafter(peak[pivot], 0), np.nextafter(peak[pivot], np.inf)):
        limited, limited_stage = peak_memory(MODEL, batch, options, limit=limit)
        cut = limited_stage < 0
        np.testing.assert_array_equal(limited > limit, peak > limit)
        np.testing.assert_array_equal(limited[~cut], peak[~cut])
        np.testing.assert_array_equal(limited_stage[~cut], stage[~cut])
        assert np.all(limited[cut] <= peak[cut])
        assert not cut[pivot] and limited[pivot] == peak[pivot]
        if runtime == "pytorch":
            assert not np.any(cut & single) and np.any(single & (peak > limit))
        cuts[limit] = int(np.count_nonzero(cut))
    # At the median most of the strategies over the limit are cut, FSDP ones among them.
    median = float(np.median(peak))
    limited, limited_stage = peak_memory(MODEL, batch, options, limit=f"{median:.0f}")
    assert cuts[median] > np.count_nonzero(peak > median) // 2
    assert np.any((limited_stage < 0) & (batch.zero == 3))
    with pytest.raises(NdplanError, match="limit must be > 0"):
        peak_memory(MODEL, batch, options, limit=-1)


# Monotonicity over random valid strategies of a MoE model with dense first layers.
MODEL = get_preset("deepseek-v2-lite")
values = st.fixed_dictionaries({
    "dp": st.sampled_from([1, 2, 4, 8]), "tp": st.sampled_from([1, 2, 4]), "pp": st.sampled_from([1, 2, 3]),
    "ep": st.sampled_from([1, 2, 4]), "zero": st.integers(0, 3), "num_micro_batches": st.sampled_from([1, 4, 8]),
    "recompute": st.sampled_from(["none", "selective", "full"]), "sequence_parallel": st.booleans(),
    "micro_batch_size": st.sampled_from([1, 2]),
})


def _memory(**kw):
    s = Strategy(seq_length=2048, etp=1, **kw)
    if check_strategy(s, MODEL):
        return None
    return stage_memory(MODEL, StrategyBatch.of(s), NO_OVERHEAD)


@settings(max_examples=60, deadline=None)
@given(values)
def test_more_tp_never_raises_parameter_memory(v):
    if v["tp"] == 4:
        return
    base, more = _memory(**v), _memory(**{**v, "tp": v["tp"] * 2})
    if base is None or more is None:
        return
    assert np.all(more.params[0] <= base.params[0] + 1e-6)
    assert np.all(more.activations[0] <= base.activations[0] + 1e-6)


@settings(max_examples=60, deadline=None)
@given(values)
def test_more_zero_or_ep_never_raises_static_memory(v):
    base = _memory(**v)
    if base is None:
        return
    static = base.params + base.grads + base.optimizer
    for change in ({"zero": min(v["zero"] + 1, 3)}, {"ep": v["ep"] * 2}):
        other = _memory(**{**v, **change})
        if other is not None:
            assert np.all(other.params + other.grads + other.optimizer <= static + 1e-6)


def test_deferred_fsdp_reduce_holds_the_unsharded_gradients_as_buffers():
    """ZeRO-3 under a two-stage pipeline (PyTorch): the deferred reduce-scatter leaves each
    stage's unsharded gradients in FSDP's buffers until the step's end (comm, as FSDP's memory
    tracker counts them; at least the whole stage's gradients), the sharded gradients are not
    yet made at that peak, and the categories less them add up to the peak."""
    from ndplan.memory import estimate

    strategy = Strategy(dp=8, pp=2, zero=3, num_micro_batches=8, seq_length=2048)
    report = estimate(MODEL, strategy, "h100-sxm")
    unsharded = estimate(MODEL, Strategy(dp=8, pp=2, zero=0, num_micro_batches=8, seq_length=2048), "h100-sxm")
    for stage, reference in zip(report.stages, unsharded.stages, strict=True):
        assert stage.comm_bytes >= reference.grads_bytes
        listed = (stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes + stage.activations_bytes
                  + stage.comm_bytes + stage.transient_bytes)
        assert listed - stage.grads_bytes == pytest.approx(stage.forward_backward_bytes, rel=1e-9)
        assert stage.step_peak_bytes < stage.forward_backward_bytes


@settings(max_examples=60, deadline=None)
@given(values)
def test_recompute_never_raises_held_activations(v):
    levels = [_memory(**{**v, "recompute": r}) for r in ("none", "selective", "full")]
    if any(level is None for level in levels):
        return
    none, selective, full = (level.activations[0] for level in levels)
    assert np.all(selective <= none + 1e-6) and np.all(full <= selective + 1e-6)


@settings(max_examples=40, deadline=None)
@given(values)
def test_more_pp_never_raises_the_largest_stage_static(v):
    base = _memory(**{**v, "pp": 1})
    more = _memory(**{**v, "pp": 2})
    if base is None or more is None:
        return
    assert (more.params + more.grads + more.optimizer).max() <= (base.params + base.grads + base.optimizer).max() + 1e-6


@pytest.mark.parametrize("schedule,pp,vpp,seq_chunks", [
    ("1f1b", 4, 1, 1), ("interleaved", 4, 2, 1), ("interleaved", 2, 4, 1), ("zb-h1", 4, 1, 1),
    ("zbv", 4, 2, 1), ("dualpipev", 4, 2, 1), ("seq1f1b", 4, 1, 2), ("1f1b", 1, 1, 1),
])
def test_steady_state_cap_gives_the_same_peaks(schedule, pp, vpp, seq_chunks):
    """Held-activation peaks stop growing past the warm-up; the capped simulation equals the full one."""
    from ndplan.memory.frontier import steady_micro_batches
    from ndplan.schedule import in_flight

    rng = np.random.default_rng(0)
    for m in (8 * pp * vpp, 12 * pp * vpp):
        full = in_flight(schedule, pp, vpp, m, seq_chunks)
        capped = in_flight(schedule, pp, vpp, steady_micro_batches(schedule, pp, vpp, m), seq_chunks)
        for _ in range(5):
            per_b, per_w = rng.random((pp, vpp)), rng.random((pp, vpp))
            np.testing.assert_allclose(full.peak_weighted(per_b, per_w), capped.peak_weighted(per_b, per_w))


def test_skyline_of_a_time_series_equals_brute_force():
    """The neighbour pre-filter and the sort keep exactly the distinct rows no other row beats in
    every column (ties kept once), in lexicographic order, as ``np.unique`` orders them."""
    from ndplan.memory.frontier import _undominated

    rng = np.random.default_rng(2)
    for trial in range(40):
        steps = rng.integers(-1, 2, size=(int(rng.integers(2, 80)), int(rng.integers(3, 6))))
        steps[:, rng.integers(0, steps.shape[1])] = 0  # an unused column, kept in the width
        rows = np.maximum(np.cumsum(steps, axis=0), 0).astype(float)
        if trial % 3 == 0:
            rows = np.vstack([rows, rows[::2]])  # repeats, apart and adjacent
        distinct = np.unique(rows, axis=0)
        beaten = [any(np.all(o >= r) and np.any(o > r) for o in distinct) for r in distinct]
        expected = distinct[~np.asarray(beaten)]
        got = _undominated(rows)
        if np.count_nonzero(rows.any(axis=0)) > 2:  # the one- and two-column paths order by value
            np.testing.assert_array_equal(got, expected)
        else:
            assert {tuple(r) for r in got} == {tuple(r) for r in expected}


def test_skylines_of_stages_together_equal_each_stage_alone():
    """The skylines of several stages' series, pruned, sorted and compared together, are each
    stage's own: its distinct undominated rows, lexicographic (or by the first used column
    descending where at most two columns are used), whatever the other stages hold."""
    from ndplan.memory.frontier import _skylines

    rng = np.random.default_rng(3)
    for trial in range(30):
        stages, length, width = int(rng.integers(1, 6)), int(rng.integers(2, 60)), int(rng.integers(2, 6))
        steps = rng.integers(-1, 2, size=(stages, length, width))
        steps[:, :, rng.integers(0, width)] *= trial % 2  # sometimes a column unused everywhere
        series = np.maximum(np.cumsum(steps, axis=1), 0).astype(float)
        series[0, :, 1:] *= trial % 3 != 0  # sometimes a stage that uses one column only
        rows = series.reshape(-1, width)
        stage = np.repeat(np.arange(stages), length)
        got = _skylines(rows, stage, stages)
        for s in range(stages):
            distinct = np.unique(series[s], axis=0)
            beaten = [any(np.all(o >= r) and np.any(o > r) for o in distinct) for r in distinct]
            expected = distinct[~np.asarray(beaten)]
            if np.count_nonzero(series[s].any(axis=0)) <= 2:
                expected = expected[::-1]
            np.testing.assert_array_equal(got[s], expected)


@pytest.mark.parametrize("schedule,pp,vpp", [("zbv", 4, 2), ("dualpipev", 4, 2), ("dualpipev", 2, 2), ("zb-h1", 4, 1)])
def test_v_frontier_past_the_steady_count_equals_the_full_simulation(schedule, pp, vpp):
    """A split schedule's frontier is derived past its warm-up, its growing columns (input
    gradients kept; a V's hand-overs) shifted for the rest; every non-negative weighting peaks
    as over the full simulation."""
    from ndplan.memory.frontier import frontier, steady_micro_batches
    from ndplan.schedule import in_flight

    rng = np.random.default_rng(1)
    for m in (6 * pp * vpp, 10 * pp * vpp):
        assert steady_micro_batches(schedule, pp, vpp, m) == m  # derived, not simulated (below)
        flight = in_flight(schedule, pp, vpp, m)
        for stage, rows in enumerate(frontier(schedule, pp, vpp, m, 1)):
            series = flight.stages[stage]
            handovers = series.forwards_done[:, :1] + series.backwards_done[:, 1:2]
            columns = [series.held_until_b, series.held_until_w, series.grads_ready, series.starts_w,
                       series.starts_first_w, series.inputs_kept]
            if schedule == "zbv":  # (EVERY_BACKWARD_SPLIT: the W's gradients pending)
                columns.append(series.grads_pending)
            if schedule in ("zbv", "dualpipev"):
                columns.append(handovers if stage == pp - 1 else 0 * handovers)
            held = np.hstack(columns)
            assert rows.shape[1] == held.shape[1] and len(rows) < len(held)
            for _ in range(20):
                weights = rng.random(held.shape[1]) * (rng.random(held.shape[1]) < 0.7)
                assert np.max(rows @ weights) == pytest.approx(np.max(held @ weights), rel=1e-12)


@pytest.mark.parametrize("schedule,pp,vpp,m,seq_chunks", [("gpipe", 4, 1, 16, 1), ("1f1b", 1, 1, 8, 1), ("seq1f1b", 1, 1, 4, 4),
                                                         ("zb-h1", 1, 1, 4, 1)])
def test_closed_form_frontiers_equal_the_simulation(schedule, pp, vpp, m, seq_chunks):
    from ndplan.memory.frontier import frontier
    from ndplan.schedule import in_flight

    flight = in_flight(schedule, pp, vpp, m, seq_chunks)
    for stage, rows in enumerate(frontier(schedule, pp, vpp, m, seq_chunks)):
        series = flight.stages[stage]
        columns = [series.held_until_b, series.held_until_w, series.grads_ready]
        if rows.shape[1] > 3:  # a split backward: the weight-gradient steps (any, then the first), inputs kept
            columns += [series.starts_w, series.starts_first_w, series.inputs_kept]
        held = np.hstack(columns)
        for weights in (np.array([1.0, 0.5, 0.0]), np.array([0.5, 1.0, 0.0]), np.array([1.0, 0.5, 2.0]),
                        np.array([1.0, 0.0, 0.3])):
            weights = np.concatenate([weights, [3.0, 1.5, 0.7][: rows.shape[1] - 3]])
            assert np.max(rows @ weights) == pytest.approx(np.max(held @ weights))


@pytest.mark.parametrize("schedule,vpp,seq_chunks,steady", [
    ("interleaved", 2, 1, lambda pp: 3 * pp), ("interleaved", 3, 1, lambda pp: 3 * pp),
    ("interleaved", 4, 1, lambda pp: 3 * pp),
    ("seq1f1b", 1, 2, lambda pp: pp + 1), ("seq1f1b", 1, 4, lambda pp: pp + 1),
    ("1f1b", 1, 1, lambda pp: pp + 1),
])
def test_frontier_at_the_steady_count_is_the_simulated_one_at_every_count_past_it(schedule, vpp, seq_chunks, steady):
    """Past ``steady_micro_batches`` the frontier is the one simulated at that count (a V
    schedule's hand-overs at the turn shifted by two per micro-batch more), bit for bit, at every
    count up to the few pipeline depths (4·pp·vpp) it once simulated: the search's frontiers of
    counts past it are one simulation."""
    from ndplan.memory.frontier import _simulated_frontier, frontier, steady_micro_batches

    for pp in (1, 2, 3, 4, 5, 8, 12):
        cap = steady(pp)
        assert steady_micro_batches(schedule, pp, vpp, 10 * pp * vpp) == cap
        counts = [m for m in range(cap, 4 * pp * vpp + 1, pp if schedule == "interleaved" else 1)]
        for m in counts if pp <= 5 else counts[:3] + counts[-2:]:
            assert steady_micro_batches(schedule, pp, vpp, m) == cap
            for got, simulated in zip(frontier(schedule, pp, vpp, m, seq_chunks),
                                      _simulated_frontier(schedule, pp, vpp, m, seq_chunks), strict=True):
                assert got.shape == simulated.shape and got.tobytes() == simulated.tobytes(), (pp, m)


@pytest.mark.parametrize("schedule,vpp", [("zbv", 2), ("dualpipev", 2), ("zb-h1", 1)])
def test_v_frontier_past_its_warm_up_is_the_simulated_one_bit_for_bit(schedule, vpp):
    """A split schedule's frontier past 2·pp + 3 micro-batches comes from the three simulated
    from 2·pp + 1 (the input gradients kept growing by one per micro-batch, and a V's last
    stage's hand-overs by two, on the rows past the warm-up, by none on the others): the
    simulation's own rows at every count up to 10·pp, the search's path (``frontier``) too.
    Before, a ZB-V count past 4·pp·vpp shifted the whole column, the warm-up's rows included."""
    from ndplan.memory.frontier import _simulated_frontier, _steady_frontier, frontier

    grew_on_some_rows_only = False
    for pp, counts in [(pp, range(2 * pp + 1, 10 * pp + 1)) for pp in (1, 2, 3, 4, 5, 6, 8)] + [(16, (35, 64, 100, 160))]:
        for m in counts:
            simulated = _simulated_frontier(schedule, pp, vpp, m, 1)
            for derived in (_steady_frontier(schedule, pp, vpp, m, 1), frontier(schedule, pp, vpp, m, 1)):
                for a, b in zip(derived, simulated, strict=True):
                    assert a.shape == b.shape and a.tobytes() == b.tobytes(), (pp, m)
        if schedule == "zb-h1":
            continue
        at = _steady_frontier(schedule, pp, 2, 2 * pp + 1, 1)[-1]
        growth = _steady_frontier(schedule, pp, 2, 2 * pp + 2, 1)[-1][:, -1] - at[:, -1]
        assert set(growth.tolist()) <= {0.0, 2.0}
        grew_on_some_rows_only |= 0.0 in growth and 2.0 in growth
    # ZB-V's warm-up rows keep theirs (not a shift of the whole column); DualPipeV's skyline
    # keeps no row of its warm-up, so there every row grows.
    assert grew_on_some_rows_only == (schedule == "zbv")
    if schedule == "zb-h1":  # (the ZB-H1 rows above: every count simulated and derived alike)
        assert frontier(schedule, 4, 1, 40, 1)[0][:, 5].max() == 40.0  # every B of the run kept (inputs_kept)


def test_one_f_one_b_frontier_in_closed_form_is_the_simulated_one_bit_for_bit():
    """1F1B's frontier is written in closed form: for every pipeline depth and micro-batch count
    (fewer than the stages, as many, and past the steady count), each stage's rows are those the
    simulation and its skyline give, same values, shape and order."""
    from ndplan.memory.frontier import _simulated_frontier, _steady_frontier

    checked = 0
    for pp in (*range(1, 13), 16, 24, 31, 32):
        for m in sorted({*range(1, 2 * pp + 3), 4 * pp - 1, 4 * pp}):
            closed, simulated = _steady_frontier("1f1b", pp, 1, m, 1), _simulated_frontier("1f1b", pp, 1, m, 1)
            assert len(closed) == len(simulated) == pp
            for a, b in zip(closed, simulated, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes(), (pp, m, a, b)
            checked += 1
    assert checked > 400
    # the two forms of a stage's rows, as the docstring gives them: pp 4, m 3 (stage 0: m < pp)
    rows = _steady_frontier("1f1b", 4, 1, 3, 1)
    np.testing.assert_array_equal(rows[0], [[3, 0, 0], [2, 0, 1]])
    np.testing.assert_array_equal(rows[3], [[1, 0, 1]])  # the last stage: 1 held, made again after a B


def test_weight_gradient_steps_are_marked_where_they_start():
    """ZB-H1 on one stage runs F, B, W per micro-batch: each W starts right after its B, and only
    the first finds no gradient yet."""
    from ndplan.schedule import in_flight

    stage = in_flight("zb-h1", 1, 1, 3).stages[0]
    starts = np.flatnonzero(stage.starts_w[:, 0])
    assert len(starts) == 3
    # At each start the micro-batch's graph still waits for its W.
    assert all(stage.held_until_w[r, 0] >= 1 for r in starts)
    assert np.flatnonzero(stage.starts_first_w[:, 0]).tolist() == starts[:1].tolist()


def test_gradients_appear_with_the_first_backward():
    """A chunk's gradients exist from its first B (its first W when the backward is split)."""
    from ndplan.schedule import in_flight

    one_f_one_b = in_flight("1f1b", 2, 1, 4).stages[0]
    first_b = int(np.argmax(np.diff(one_f_one_b.held_until_b[:, 0]) < 0)) + 1  # row after the first B
    assert one_f_one_b.grads_ready[:first_b, 0].max() == 0.0
    assert one_f_one_b.grads_ready[first_b:, 0].min() == 1.0
    zero_bubble = in_flight("zb-h1", 2, 1, 4).stages[0]
    first_w = int(np.argmax(np.diff(zero_bubble.held_until_w[:, 0]) < 0)) + 1
    assert zero_bubble.grads_ready[:first_w, 0].max() == 0.0
    assert zero_bubble.grads_ready[first_w:, 0].min() == 1.0


STEPS = sorted((Path(__file__).parent / "data" / "measured" / "steps").glob("*.json"))


@pytest.mark.parametrize("path", STEPS, ids=[p.stem for p in STEPS])
def test_estimate_matches_measured_steps(path):
    """Every whole training step of docs/accuracy.md, as `ndplan measure` recorded it (one device,
    FSDP2, TP, pipelines of five schedules, MoE and MLA models): each stage's peak within 3% and
    never more than 2% under, the memory issue's target."""
    from ndplan.census.measurement import load_measurement
    from ndplan.census.verify import verify
    from ndplan.model import get_preset

    measurement = load_measurement(path)
    result = verify(get_preset(measurement.model), measurement).to_dict()
    for stage in result["stages"]:
        if not stage["measured_ranks"]:
            continue
        peak = {row["key"]: row for row in stage["rows"]}["allocated"]
        assert -2.0 <= peak["error_pct"] <= 3.0, (path.stem, stage["stage"], peak["error_pct"])


def test_gpipe_peak_comes_before_any_gradient():
    """GPipe holds all m micro-batches before its first backward, when (set_to_none) no gradient
    exists yet; after it, m - 1 and the gradients. The forward/backward peak is the larger:
    static - grads + max(m·a, (m - 1)·a + grads) + comm + transient."""
    strategy = Strategy(pp=2, schedule="gpipe", num_micro_batches=4, seq_length=8, global_batch_size=4)
    report = estimate(TINY, strategy, options=NO_OVERHEAD)
    for stage in report.stages:
        per_micro_batch = stage.activations_bytes / 4
        held = max(4 * per_micro_batch, 3 * per_micro_batch + stage.grads_bytes)
        expected = (stage.params_bytes + stage.optimizer_bytes + held + stage.comm_bytes + stage.transient_bytes)
        assert stage.forward_backward_bytes == pytest.approx(expected)
        assert stage.allocated_bytes == pytest.approx(
            max(expected, stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes + stage.optimizer_step_bytes))


def test_capacity_factor_scales_routed_expert_tokens_linearly():
    """A token-dropping MoE pads every expert's buffer to capacity_factor × its balanced share:
    routed-expert activations grow linearly in the factor, and 1.0 is balanced routing."""
    from ndplan.model import get_preset

    model = get_preset("qwen3-30b-a3b")
    strategy = Strategy(ep=8, dp=8, seq_length=4096)
    held = {cf: estimate(model, strategy, options=MemoryOptions(include_overhead=False, moe_capacity_factor=cf),
                         num_devices=8).stages[0].activations_bytes for cf in (1.0, 2.0, 3.0)}
    balanced = estimate(model, strategy, options=NO_OVERHEAD, num_devices=8).stages[0].activations_bytes
    assert held[1.0] == pytest.approx(balanced)
    assert held[2.0] - held[1.0] == pytest.approx(held[3.0] - held[2.0])
    assert held[2.0] > held[1.0]
    with pytest.raises(NdplanError, match="moe_capacity_factor must be a finite number > 0"):
        MemoryOptions(moe_capacity_factor=0.0)


def test_measured_gaps_are_told_beside_the_estimate():
    """Strategies the measurements found the estimator (or PyTorch) wrong for carry a caveat in
    the report and its JSON; others carry none."""
    from ndplan.model import get_preset

    model = get_preset("qwen3-8b")
    plain = estimate(model, Strategy(pp=2, num_micro_batches=4, seq_length=2048), options=NO_OVERHEAD)
    assert plain.caveats == [] and plain.to_dict()["caveats"] == []
    v_full = estimate(model, Strategy(pp=2, vpp=2, schedule="dualpipev", num_micro_batches=8, seq_length=2048,
                                      recompute="full"), options=NO_OVERHEAD)
    assert any("once per parameter group" in c and "-1.9...+2.2%" in c for c in v_full.caveats)
    split_selective = estimate(model, Strategy(pp=2, vpp=2, schedule="zbv", num_micro_batches=8, seq_length=2048,
                                               recompute="selective"), options=NO_OVERHEAD)
    assert any("cannot run" in c for c in split_selective.caveats)
    # What published or functional-test measurements found: torchtitan's FSDP runs read low, and
    # Megatron's MoE tests (one caveat each, where it applies)
    fsdp = estimate(model, Strategy(dp=8, zero=3, fsdp=True, seq_length=2048), options=NO_OVERHEAD)
    assert any("estimates 5-17% less than their measured peak reserved memory" in c for c in fsdp.caveats)
    moe = get_preset("qwen3-30b-a3b")
    megatron = estimate(moe, Strategy(seq_length=2048), options=MemoryOptions(runtime="megatron"))
    assert any("1.6-5.6% low" in c for c in megatron.caveats)
    priced = estimate(moe, Strategy(dp=8, ep=8, seq_length=2048), options=MemoryOptions(runtime="megatron", moe_imbalance=1.2))
    assert not any("1.6-5.6% low" in c for c in priced.caveats)  # uneven routing priced: no advice to price it
    assert not any("1.6-5.6% low" in c for c in estimate(model, Strategy(seq_length=2048),
                                                          options=MemoryOptions(runtime="megatron")).caveats)


def test_weight_gradient_groups_of_a_layer():
    """The parameter groups torch.distributed.pipelining's weight-gradient step runs one autograd
    call each for (traced: a Qwen3-8B layer gave 11 groups, in the order q, k, v, o, q_norm,
    k_norm, gate, up, down, input norm, post-attention norm)."""
    from ndplan.model.params import weight_grad_groups

    assert weight_grad_groups(get_preset("qwen3-8b"))["dense"] == 11
    assert weight_grad_groups(get_preset("llama-3.1-8b"))["dense"] == 9  # no q/k norms
    # MLA (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o) + router + fused experts (gate_up, down)
    # + shared experts (gate, up, down) + two norms.
    assert weight_grad_groups(get_preset("deepseek-v3"))["moe"] == 7 + 1 + 2 + 3 + 2
    # Traced: a DeepSeek-V2-Lite MoE layer (no query compression) gave 13.
    assert weight_grad_groups(get_preset("deepseek-v2-lite"))["moe"] == 13


def test_weight_gradient_step_peaks_at_the_down_projection():
    """Traced peaks: Qwen3-8B at its MLP's down (group 9 of 11); Mixtral (router first) at its
    experts' down (group 7 of 9); Qwen3-30B-A3B and DeepSeek-V2-Lite (experts first) at their
    experts' down (groups 8 of 11 and 7 of 13), before the router and shared experts."""
    from ndplan.model.params import weight_grad_peak_group

    assert weight_grad_peak_group(get_preset("qwen3-8b"))["dense"] == 9
    assert weight_grad_peak_group(get_preset("mixtral-8x7b"))["moe"] == 7
    assert weight_grad_peak_group(get_preset("qwen3-30b-a3b"))["moe"] == 8
    assert weight_grad_peak_group(get_preset("deepseek-v2-lite"))["moe"] == 7


def test_weight_gradient_step_shows_in_the_breakdown():
    """Under DualPipeV with full recompute (PyTorch), the weight-gradient step's copies are part
    of the forward/backward peak, reported with the transient: the categories add up to it."""
    model = get_preset("qwen3-8b")
    report = estimate(model, Strategy(pp=2, vpp=2, schedule="dualpipev", num_micro_batches=8, seq_length=2048,
                                      recompute="full", precision="bf16-pure"), options=NO_OVERHEAD)
    for stage in report.stages:
        parts = (stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes + stage.activations_bytes
                 + stage.comm_bytes + stage.transient_bytes)
        assert parts == pytest.approx(stage.forward_backward_bytes, rel=0.01)
    # 18 layers a stage, 9 a chunk: each chunk's step keeps 11 rebuilt copies of every layer's
    # unread bytes (272 MiB at 2k tokens), tens of GiB beside a layer backward's few hundred MiB.
    assert report.stages[1].transient_bytes > 20 * 2**30


@pytest.mark.parametrize("schedule, vpp", [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
def test_weight_gradient_step_is_torch_pipelining_only(schedule, vpp):
    """Megatron's split backward has no per-group rebuild: under its profile the same strategy
    prices no weight-gradient step (and gradients are static), under PyTorch's it does."""
    model = get_preset("qwen3-8b")
    strategy = Strategy(pp=2, vpp=vpp, schedule=schedule, num_micro_batches=8, seq_length=2048, recompute="full")
    megatron = estimate(model, strategy, options=MemoryOptions(runtime="megatron", include_overhead=False))
    pytorch = estimate(model, strategy, options=NO_OVERHEAD)
    assert max(s.transient_bytes for s in megatron.stages) < 4 * 2**30
    assert max(s.transient_bytes for s in pytorch.stages) > 10 * 2**30


def test_megatron_routes_each_ranks_sequence_shard_under_sp():
    """Megatron-Core's MoE layer takes [s/tp, b, h] under SP and its dispatcher gathers only over
    the expert-TP group, so a rank's experts see s·etp/tp routed copies: the full-width copies
    (the permuted tokens, k·h per routed token, and the probabilities the experts weight by, k
    fp32 values) divide by tp/etp, the ffn-wide ones by tp whatever etp. Mixtral (k = 2, h = 4096),
    bf16, tp 4 with SP."""
    from ndplan.memory.activations import layer_activations

    model = get_preset("mixtral-8x7b")
    options = MemoryOptions(runtime="megatron")
    strategies = [Strategy(tp=4, sequence_parallel=True, ep=2, etp=etp, dp=2) for etp in (1, 4)]
    moe = layer_activations(model, StrategyBatch.of(strategies), options).full["moe"]
    copies = 2 * 4096 * 2 + 2 * 4  # permuted tokens k · h · 2 B and probabilities k · 4 B per token
    # etp 4 gathers the 4 ranks' shards (s routed copies a rank), etp 1 routes its own (s/4); the
    # ffn-wide tensors are the same bytes either way, so the whole difference is the copies.
    assert moe[1] - moe[0] == pytest.approx(copies * (1 - 1 / 4))


@pytest.mark.parametrize("model_name,settings", [
    ("deepseek-v2-lite", {"dp": 2, "tp": 8, "zero": 3, "fsdp": True, "recompute": "full", "num_micro_batches": 1}),
    ("mixtral-8x7b", {"dp": 2, "tp": 2, "cp": 2, "ep": 4, "zero": 3, "fsdp": True, "recompute": "full",
                      "micro_batch_size": 2, "num_micro_batches": 1}),
])
def test_no_category_reads_below_zero(model_name, settings):
    """FSDP's moments credit a freed micro-batch's activations against their buffers: where the
    credit is the larger, comm stays at zero and the working set takes it (the sum unchanged)."""
    report = estimate(get_preset(model_name), Strategy(seq_length=2048, **settings), options=NO_OVERHEAD)
    for stage in report.stages:
        for value in (stage.params_bytes, stage.grads_bytes, stage.optimizer_bytes, stage.activations_bytes,
                      stage.comm_bytes, stage.transient_bytes):
            assert value >= 0


def test_cublas_workspace_is_allocated_in_every_phase_where_overhead_is_counted():
    """The pytorch profile's 64 MiB workspace (measured on an H200: tests/data/measured/cuda) adds
    to the forward/backward and optimizer-step peaks alike; without overhead (what a fake-tensor
    step sees) it is absent. The megatron profile's adds Transformer Engine's own 32 MiB (Hopper)."""
    model = get_preset("llama-3.1-8b")
    one_micro_batch = [  # the backward's end bounds the peak: the whole embedding gradient (tp), FSDP's last unit
        Strategy(tp=2, pp=2, schedule="gpipe", zero=1, precision="fp32", seq_length=512),
        Strategy(dp=8, zero=3, fsdp=True, precision="fsdp-bf16", seq_length=2048, recompute="full", global_batch_size=8),
    ]
    for strategy in (Strategy(pp=2, num_micro_batches=4, global_batch_size=4), Strategy(seq_length=2048),
                     *one_micro_batch):
        with_ws = estimate(model, strategy, None, MemoryOptions())
        without = estimate(model, strategy, None, MemoryOptions(include_overhead=False))
        for a, b in zip(with_ws.stages, without.stages, strict=True):
            assert a.allocated_bytes - b.allocated_bytes == 64 * 2**20
            assert a.forward_backward_bytes - b.forward_backward_bytes == 64 * 2**20
            assert a.step_peak_bytes - b.step_peak_bytes == 64 * 2**20
        megatron = estimate(model, strategy, None, MemoryOptions(runtime="megatron"))
        bare = estimate(model, strategy, None, MemoryOptions(runtime="megatron", include_overhead=False))
        assert [a.allocated_bytes - b.allocated_bytes for a, b in zip(megatron.stages, bare.stages, strict=True)] == [
            96 * 2**20] * len(bare.stages)


def test_grouped_gemm_workspaces_count_on_stages_with_experts():
    """The megatron profile adds Transformer Engine's four grouped-GEMM workspaces (128 MiB) where a
    stage runs MoE layers: DeepSeek-V2-Lite's first layer is dense, so with its one-layer first
    stage only the later stages hold them."""
    model = get_preset("deepseek-v2-lite")
    layers = (1, 13, 13)
    strategy = Strategy(pp=3, ep=1, num_micro_batches=3, global_batch_size=3, stage_layers=layers, seq_length=1024)
    megatron = estimate(model, strategy, None, MemoryOptions(runtime="megatron"))
    bare = estimate(model, strategy, None, MemoryOptions(runtime="megatron", include_overhead=False))
    extra = [a.allocated_bytes - b.allocated_bytes for a, b in zip(megatron.stages, bare.stages, strict=True)]
    assert extra == [96 * 2**20, (96 + 128) * 2**20, (96 + 128) * 2**20]


@pytest.mark.parametrize("overhead, needle", [
    ("{worksapce_bytes: 1}", "unknown overhead constant 'worksapce_bytes'; known: allocator_slack, context_bytes"),
    ("{workspace_bytes: -1}", "overhead workspace_bytes must be a finite number >= 0, got -1"),
    ("{workspace_bytes: true}", "overhead workspace_bytes must be a finite number >= 0, got True"),
    ("[1, 2]", "overhead must be a mapping of allocator_slack"),
])
def test_profile_overhead_constants_are_checked(tmp_path: Path, overhead: str, needle: str):
    from ndplan.memory.profile import get_profile

    shipped = Path(__file__).parents[1] / "src" / "ndplan" / "memory" / "profiles" / "pytorch.yaml"
    text = shipped.read_text().split("\noverhead:")[0] + f"\noverhead: {overhead}\n"
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(NdplanError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        get_profile(str(path))


@pytest.mark.parametrize("text, needle", [
    ("foo: [1, 2\n", r"mine.yaml:2: malformed runtime profile YAML \(did not find expected ',' or '\]'\)"),
    ("blocks: 5\n", "a runtime profile needs a 'blocks' mapping"),
    ("blocks: {}\n", "blocks norm, attention, mlp, layer_input, output are missing or empty"),
])
def test_a_malformed_runtime_profile_is_refused_by_name(tmp_path: Path, text: str, needle: str):
    """A --runtime YAML that does not parse, or states no blocks, is refused naming the file (it
    raised yaml's and Python's own errors, or priced layers that keep nothing)."""
    from ndplan.memory.profile import get_profile

    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(NdplanError, match=needle):
        get_profile(str(path))


def test_a_profile_block_is_a_list_of_saved_tensors(tmp_path: Path):
    import yaml

    from ndplan.memory.profile import get_profile

    shipped = Path(__file__).parents[1] / "src" / "ndplan" / "memory" / "profiles" / "pytorch.yaml"
    data = yaml.safe_load(shipped.read_text())
    data["blocks"]["sdpa_masked"] = 7
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(NdplanError, match="block 'sdpa_masked' is a list of saved tensors"):
        get_profile(str(path))


def test_scores_backward_moment_counts_only_the_gradients_made_by_then():
    """Eager attention at 8k under full recompute, one micro-batch, pp2: on stage 0 the embedding's
    gradient is made after every layer's backward, tied table or not (the head keeps its own copy
    on stage 1), so stage 0's peak is the same either way; ZeRO-2 keeps the gradients made by
    then sharded, so its peak is below ZeRO-1's."""
    model = get_preset("llama-3.1-8b")
    options = MemoryOptions(attention="eager")
    s = Strategy(pp=2, seq_length=8192, recompute="full", precision="bf16-pure")
    tied = model.model_copy(update={"tie_word_embeddings": True})
    untied_stage0 = estimate(model, s, options=options).stages[0].forward_backward_bytes
    assert estimate(tied, s, options=options).stages[0].forward_backward_bytes == untied_stage0
    z1 = Strategy(dp=8, zero=1, seq_length=8192, recompute="full", precision="bf16-pure")
    z2 = z1.model_copy(update={"zero": 2})
    one, two = (estimate(model, z, options=options, num_devices=8).stages[0] for z in (z1, z2))
    assert two.forward_backward_bytes < one.forward_backward_bytes


@pytest.mark.parametrize("ep", [8, 2])
def test_fsdp_kept_gathered_parameters_are_the_stage_elements_whole(ep):
    """FSDP without resharding after forward keeps every parameter of the stage gathered: the
    non-expert ones whole, the routed experts as ep splits them (E/ep experts), at the gather
    width (2 B), whatever group each kind is sharded over: experts over dp·cp·tp/(ep·etp) =
    8/ep ranks, the rest over 8. (It read the experts' bytes times the non-expert divisor: 8x
    the local experts when ep = 8.)"""
    model = get_preset("qwen3-30b-a3b").model_copy(update={"num_layers": 2, "layer_mlp_kinds": ("moe", "moe")})
    counts = count_parameters(model)
    common = dict(dp=8, ep=ep, zero=3, fsdp=True, seq_length=1024, precision="fsdp-bf16")
    kept = estimate(model, Strategy(**common, reshard_after_forward=False), options=NO_OVERHEAD).stages[0]
    resharded = estimate(model, Strategy(**common, reshard_after_forward=True), options=NO_OVERHEAD).stages[0]
    whole = counts.total - counts.routed_experts + counts.routed_experts / ep
    assert kept.comm_bytes - resharded.comm_bytes == pytest.approx(2 * whole, rel=1e-12)


def test_hsdp_shards_experts_over_the_expert_ranks_of_a_shard_group():
    """HSDP with expert parallelism: expert parallelism is carved out of the shard group, so the
    experts shard over shard_group·tp/(ep·etp) ranks (torchtitan's dp_shard_mod_ep mesh,
    Megatron's expert group per distributed-optimizer instance) and the rest over shard_group.
    dp 8, ep 2, shard_group 4: non-expert /4, experts /ep /2; fsdp-bf16 keeps 4 B parameters.
    (The experts were sharded over gcd(shard_group, dp·tp/(ep·etp)) = 4 ranks.)"""
    model = get_preset("qwen3-30b-a3b").model_copy(update={"num_layers": 2, "layer_mlp_kinds": ("moe", "moe")})
    counts = count_parameters(model)
    strategy = Strategy(dp=8, ep=2, zero=3, fsdp=True, shard_group=4, seq_length=1024, precision="fsdp-bf16")
    stage = estimate(model, strategy, options=NO_OVERHEAD).stages[0]
    non_expert = counts.total - counts.routed_experts
    assert stage.params_bytes == pytest.approx(4 * (non_expert / 4 + counts.routed_experts / 2 / 2), rel=1e-12)
    assert check_strategy(strategy.model_copy(update={"ep": 8}), model, 8)[0].rule == "shard_group_holds_expert_groups"


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_a_later_pipeline_run_starts_with_the_gradients_the_first_made(runtime):
    """Gradient accumulation outside the pipeline (torchtitan, AutoModel): a step runs GPipe twice
    over 4 micro-batches. The first run's peak, every forward held, has no gradients where the
    backward creates them (pytorch); the second run starts with the first's: its peak is that
    peak plus the stage's gradients exactly. Where gradients are static (megatron) nothing moves.
    The held micro-batches are one run's either way."""
    model = TINY.model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    options = MemoryOptions(include_overhead=False, runtime=runtime)
    one, two = (estimate(model, Strategy(seq_length=256, pp=2, num_micro_batches=4, pipeline_runs=runs, schedule="gpipe"),
                         options=options) for runs in (1, 2))
    assert two.strategy.global_batch_size == 2 * one.strategy.global_batch_size
    for a, b in zip(one.stages, two.stages, strict=True):
        assert b.activations_bytes == a.activations_bytes
        added = a.grads_bytes if runtime == "pytorch" else 0.0
        assert a.grads_bytes > 0 and b.forward_backward_bytes == a.forward_backward_bytes + added


@pytest.mark.parametrize(("schedule", "vpp"), [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_fsdp_under_a_pipeline_holds_its_sharded_gradients_from_the_second_run(schedule, vpp):
    """torch.distributed.pipelining defers FSDP's reduce to a run's end: in the first run a stage
    holds its unsharded gradients (in comm) and no sharded ones; from the second run the sharded
    ones the first run's reduce made stay beside them. The peak grows by exactly those."""
    model = get_preset("llama-3.1-8b")
    one, two = (estimate(model, Strategy(dp=4, pp=2, vpp=vpp, schedule=schedule, zero=3, fsdp=True, num_micro_batches=4,
                                         pipeline_runs=runs, seq_length=4096), options=NO_OVERHEAD) for runs in (1, 2))
    for a, b in zip(one.stages, two.stages, strict=True):
        assert b.comm_bytes == a.comm_bytes and b.grads_bytes == a.grads_bytes > 0
        assert b.forward_backward_bytes == a.forward_backward_bytes + a.grads_bytes


def test_megatron_keeps_fp8_copies_of_linear_inputs_under_fp8_gemms():
    """Transformer Engine's fp8 linears keep their input quantised (1 byte): per token of a
    Llama-3.1-8B layer (h = q = 4096, ffn 14336), tp 1, the QKV and fc1 inputs (the norm-fused
    linears' normalised input) and fc2's input save a byte an element each, 4096 + 4096 + 14336
    = 22528 bytes; the attention output stays the core's bf16 tensor (non-delayed recipes).
    DeepSeek-V3's MoE layer (h 7168, top-8 of experts 2048 wide, one shared expert 2048 wide,
    MLA latents 1536 and 512): the permuted tokens 8·7168 and the experts' fc2 input 8·2048, the
    shared expert's fc2 input 2048 and the latents' normed copies 1536 + 512 save a byte each;
    the shared expert's fc1 keeps a 1-byte copy of the router's input (+7168); the two
    down-projections keep a byte each of the normed input (2 bytes, as bf16). torchao's float8
    linears (the pytorch profile) save the high-precision input: no change."""
    from ndplan.memory.activations import layer_activations

    strategies = [Strategy(precision="megatron-bf16-grad16"), Strategy(precision="megatron-fp8-grad16")]
    for name, kind, megatron_saves in (("llama-3.1-8b", "dense", 22528.0),
                                       ("deepseek-v3", "moe", 8 * 7168 + 8 * 2048 + 2048 + 1536 + 512 - 7168)):
        for runtime, saved in (("megatron", megatron_saves), ("pytorch", 0.0)):
            per_token = [layer_activations(get_preset(name), StrategyBatch.of(s), MemoryOptions(runtime=runtime)).full[kind][0]
                         for s in strategies]
            assert per_token[0] - per_token[1] == pytest.approx(saved)


def test_bf16_gradient_presets_halve_the_gradient_buffer():
    """NVIDIA's performance recipes reduce gradients in bf16 (grad_reduce_in_fp32 = False):
    2 bytes a gradient instead of 4, parameters and optimizer as megatron-bf16's."""
    model = get_preset("llama-3.1-8b")
    fp32, bf16 = (estimate(model, Strategy(precision=name), options=NO_OVERHEAD).stages[0]
                  for name in ("megatron-bf16", "megatron-bf16-grad16"))
    assert bf16.grads_bytes == pytest.approx(fp32.grads_bytes / 2)
    assert (bf16.params_bytes, bf16.optimizer_bytes) == (fp32.params_bytes, fp32.optimizer_bytes)


def test_distinct_rows_bit_for_bit():
    """FSDP moments are priced once per distinct row of their inputs: rows equal bit for bit
    share one (0.0 and -0.0 do not), and each row's own reproduces it."""
    from ndplan.memory.fsdp import _distinct_rows

    a = np.array([1.0, 2.0, 1.0, 0.0, -0.0, 2.0])
    b = np.array([5.0, 5.0, 5.0, 5.0, 5.0, 6.0])
    kept = np.array([True, True, True, True, True, False])
    found = _distinct_rows([a, b, kept])
    assert found is not None
    first, inverse = found
    assert len(first) == 5
    for column in (a, b, kept):
        assert np.array_equal(column[first][inverse].view(np.uint8), column.view(np.uint8))
    assert _distinct_rows([]) is None


def test_the_breakdown_prices_a_batch_in_any_order():
    """A batch not sorted by micro-batch count reaches the held peak as index arrays, not slices;
    its per-kind breakdown once wrote each such strategy's peak into a copy (``out=`` on a fancy
    index) and kept whatever was in the array: [m2, m1] read 787 MB of a 1,179 MB peak."""
    from ndplan.memory.stages import peak_memory

    strategies = [Strategy(dp=8, cp=2, micro_batch_size=1, num_micro_batches=2, seq_length=8192),
                  Strategy(dp=16, micro_batch_size=1, num_micro_batches=1, seq_length=8192),
                  Strategy(dp=4, tp=2, cp=2, micro_batch_size=2, num_micro_batches=1, seq_length=8192)]
    batch = StrategyBatch.of(strategies)
    peak, _ = peak_memory(MODEL, batch)
    by_kind = stage_memory(MODEL, batch, breakdown=True)
    np.testing.assert_array_equal(by_kind.peak()[0], peak)
    for i, strategy in enumerate(strategies):
        alone = stage_memory(MODEL, StrategyBatch.of(strategy), breakdown=True)
        for name in ("activations", "device"):
            np.testing.assert_array_equal(getattr(by_kind, name)[i], getattr(alone, name)[0], err_msg=name)


def test_seq1f1b_ops_run_on_one_sub_sequence():
    """Seq1F1B runs every forward, backward and loss on one of the seq_chunks sub-sequences of a
    micro-batch, so each op's working set and its exchange buffers are a sub-sequence's, while
    the held activations stay counted per micro-batch (a held sub-sequence is 1/k of one).
    Megatron profile, no overhead; 4 dense layers over pp 2 (h 64, ffn 128, vocab 1024, bf16),
    64 tokens a micro-batch, k sub-sequences of 64/k tokens:
      loss (last stage)  the logits, 2·vocab = 2048 B a token          → 64/k · 2048
      layer backward     fc1's gradient 2·ffn + fc2's input's ffn, ×2 B = 768 B a token → 64/k · 768
      pipeline buffers   send + receive of the hidden states, 2 · 2h    → 64/k · 256
    Before, every k read the whole micro-batch's: 131072, 49152 and 16384 B."""
    model = TINY.model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4, "vocab_size": 1024})
    options = MemoryOptions(runtime="megatron", include_overhead=False)
    for k in (1, 2, 4):
        report = estimate(model, Strategy(pp=2, schedule="seq1f1b", seq_chunks=k, num_micro_batches=4, seq_length=64),
                          options=options)
        first, last = report.stages
        assert last.transient_bytes == 64 // k * 2048
        assert first.comm_bytes == last.comm_bytes == 64 // k * 256
        if k < 4:
            # (At k = 4 the first stage's worst moment is the embedding's backward: a new bf16 table
            # gradient, 1024·64·2 B, beside what it holds less the one sub-sequence it has freed.)
            assert first.transient_bytes == 64 // k * 768
    held = [estimate(model, Strategy(pp=2, schedule="seq1f1b", seq_chunks=k, num_micro_batches=4, seq_length=64),
                     options=options).stages[1].activations_bytes for k in (1, 4)]
    assert held[0] == held[1]  # the last stage holds its one micro-batch's sub-sequences all at once


def test_seq1f1b_search_path_prices_as_the_estimate_does():
    """The search's path (one batch, strategies alike priced once) and ``estimate`` give each
    Seq1F1B strategy the same bytes, with sequence, context and expert parallelism and FSDP
    reading per-op tokens or micro-batch tokens as the estimate does."""
    from ndplan.memory.stages import peak_memory

    strategies = [
        Strategy(dp=2, tp=2, pp=2, ep=4, etp=1, sequence_parallel=True, schedule="seq1f1b", seq_chunks=k,
                 num_micro_batches=4, seq_length=4096, recompute=r, cp=cp, cp_kind=kind, zero=zero, fsdp=zero == 3)
        for k in (1, 2, 4) for r in ("none", "full") for cp, kind in ((1, "ring"), (2, "ring"), (2, "ulysses"))
        for zero in (1, 3)
    ]
    for runtime in ("pytorch", "megatron"):
        options = MemoryOptions(runtime=runtime)
        valid = [s for s in strategies if not check_strategy(s, MODEL)]
        assert len(valid) == len(strategies)
        peak, _ = peak_memory(MODEL, StrategyBatch.of(valid), options)
        alone = [estimate(MODEL, s, get_device("h100-sxm"), options).peak_bytes for s in valid]
        np.testing.assert_array_equal(peak, np.array(alone), err_msg=runtime)


def test_chunk_activations_count_only_the_layers_recompute_layers_recomputes():
    """The per-chunk figure (``--json`` chunks) holds what ``stage_memory`` holds: under full
    recompute limited to N layers, a chunk's first N layers keep their input and the others every
    activation. PyTorch profile, 4 layers over pp 2 (2 per chunk), 8 tokens, per token a plain
    layer 2456 B and a recomputed one its 2h = 128 B input (test_tiny_activations_by_hand):
      recompute_layers 1  8 · (128 + 2456) = 20672   (before: 8 · 2 · 128 = 2048, as if both were)
      recompute_layers 2  8 · 2 · 128      = 2048
    and the first stage's two micro-batches in flight add its token ids and the hidden state
    torch pipelining keeps (8 + 2h a token): 2 · (20672 + 8 · (8 + 128)) = 43520."""
    model = TINY.model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    for layers, per_micro_batch in ((1, 8 * (128 + 2456)), (2, 8 * 2 * 128), (0, 8 * 2 * 128)):
        report = estimate(model, Strategy(seq_length=8, pp=2, num_micro_batches=8, recompute="full",
                                          recompute_layers=layers), options=NO_OVERHEAD)
        for stage in report.stages:
            assert stage.chunks[0].activation_bytes_per_micro_batch == per_micro_batch
        first = report.stages[0]
        assert first.chunks[0].peak_in_flight == 2
        assert first.activations_bytes == 2 * (per_micro_batch + 8 * (8 + 128))


def test_expert_groups_of_their_own_hold_a_communicator_each():
    """A rank holds a communicator per group of size > 1 it runs collectives in; the experts run
    theirs over the expert-tensor group and reduce their gradients over the expert-data group
    (dp·cp·tp / (ep·etp)). Those are groups of their own where the experts are laid out
    otherwise than the dense layers; before, the expert-TP group was never counted and the
    expert-data group only with ep > 1.
      dp 4, tp 1, ep 1, etp 2: dp 4, expert-TP 2, expert-data 4·1/2 = 2       → 3 (was 1)
      dp 4, tp 1, ep 2, etp 2: dp 4, ep 2, expert-TP 2, expert-data 4/4 = 1   → 3 (was 2)
      dp 4, tp 2, ep 1, etp 1: tp 2, dp 4, expert-data 4·2/1 = 8              → 3 (was 2)
      dp 8, tp 2, ep 2, etp 1: tp 2, dp 8, ep 2, expert-data 8·2/2 = 8        → 4 (as before)
      dp 4, tp 2, ep 1, etp 2: tp 2, dp 4; the expert groups are TP's and DP's → 2 (as before)"""
    from ndplan.memory.overhead import communicator_count

    cases = [(dict(dp=4, tp=1, ep=1, etp=2), 3), (dict(dp=4, tp=1, ep=2, etp=2), 3), (dict(dp=4, tp=2, ep=1, etp=1), 3),
             (dict(dp=8, tp=2, ep=2, etp=1), 4), (dict(dp=4, tp=2, ep=1, etp=2), 2)]
    batch = StrategyBatch.of([Strategy(**settings) for settings, _ in cases])
    assert communicator_count(batch).tolist() == [count for _, count in cases]
    # On the device: the Megatron profile's 512 MiB context and 64 MiB a communicator, beside
    # what the allocator reserves.
    model = get_preset("qwen3-30b-a3b")
    report = estimate(model, Strategy(dp=4, tp=1, ep=1, etp=2), get_device("h100-sxm"), MemoryOptions(runtime="megatron"))
    stage = report.stages[0]
    assert stage.peak_bytes - stage.reserved_bytes == 512 * 2**20 + 3 * 64 * 2**20


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recomputing_k_of_a_stages_layers_saves_k_shares_of_recomputing_all(schedule: str):
    """Each layer a chunk recomputes swaps its full activations for its checkpoint in every
    micro-batch the stage holds, until B or (split backward) until W: recomputing k of a stage's
    L equal layers saves k/L of what recomputing all of them saves. Under PyTorch's split
    backward the plain layers' graphs were dropped from what waits for W (recompute 1 of 8
    layers of Llama-3.1-8B over pp 4, ZB-H1: 47% of the saving, the last stage 9 GiB low)."""
    model = get_preset("llama-3.1-8b")  # 32 equal layers: 8 a stage over pp 4

    def activations(recompute: str, layers: int) -> np.ndarray:
        strategy = Strategy(dp=2, tp=2, sequence_parallel=True, pp=4, schedule=schedule, num_micro_batches=32,
                            seq_length=4096, recompute=recompute, recompute_layers=layers)
        report = estimate(model, strategy, "h100-sxm", MemoryOptions(runtime="pytorch"))
        return np.array([stage.activations_bytes for stage in report.stages], dtype=float)

    plain, every = activations("none", 0), activations("full", 0)
    # Recomputing the first layer also drops one copy of the stage's received input (its
    # checkpoint is the receive buffer): a fixed credit on every stage but the first.
    one, two = activations("full", 1), activations("full", 2)
    credit = (plain - one) - (one - two)
    assert credit[0] == pytest.approx(0.0, abs=1.0) and np.all(credit[1:] > 0)
    for k in (1, 2, 4):
        assert np.allclose(plain - activations("full", k) - credit, k / 8 * (plain - every - credit), rtol=0.01)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_caches_the_fp8_copy_of_each_linear_weight(tp):
    """Megatron passes is_first_microbatch to Transformer Engine's linears (unless
    disable_parameter_transpose_cache), which then keep the weight's fp8 workspace, row-wise and
    column-wise (the transpose), from the first micro-batch on: 2 bytes per element of every TE
    linear's weight on the rank, whatever ZeRO-1 shards. TINY (h 64, q 64, k = v 32, ffn 128):
    QKV 64·128 + O 64·64 + fc1 64·256 + fc2 128·64 = 36864 per layer, 2 layers, / tp; the
    embedding, output head and norms are not TE fp8 modules. bf16 GEMMs keep no copy, nor do
    torchao's float8 linears (the pytorch profile)."""
    def params(runtime: str, precision: str) -> float:
        strategy = Strategy(tp=tp, dp=2, zero=1, seq_length=8, precision=precision)
        return estimate(TINY, strategy, options=MemoryOptions(include_overhead=False, runtime=runtime)).stages[0].params_bytes

    assert params("megatron", "megatron-fp8") - params("megatron", "megatron-bf16") == 2 * 2 * 36864 / tp
    assert params("pytorch", "megatron-fp8") == params("pytorch", "megatron-bf16")
    stage = estimate(TINY, Strategy(tp=tp, seq_length=8, precision="megatron-fp8"),
                     options=MemoryOptions(include_overhead=False, runtime="megatron")).stages[0]
    assert sum(stage.static_by_kind.values()) == pytest.approx(
        stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes, rel=1e-12)


def _mla_moe_proxy(h: int) -> ModelSpec:
    """Megatron's DeepSeek-like functional test's model (MLA, 32 experts, one shared, MTP 1)."""
    return ModelSpec(name="proxy", num_layers=16, hidden_size=h, ffn_hidden_size=4096, num_attention_heads=32,
                     num_kv_heads=32, head_dim=192, vocab_size=51712, q_lora_rank=1536, kv_lora_rank=512,
                     qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts=32, num_experts_per_tok=4,
                     moe_ffn_hidden_size=1024, num_shared_experts=1, shared_expert_ffn_hidden_size=1024,
                     layer_mlp_kinds=("dense",) + ("moe",) * 15, mtp_depth=1)


def test_fp8_weight_cache_of_an_mla_moe_stage_by_hand():
    """Megatron's DeepSeek-like functional test (MLA q 1536 / kv 512 latents, 32 heads of
    192/128, 32 experts of 1024 over ep 4, one shared expert 1024 wide, tp 2, etp 1, MTP 1) on its
    last stage (8 MoE layers and the MTP module): per MoE layer the duplicated q and kv
    down-projections 1024·1536 + 1024·576, the TP-split q_up 1536·6144/2, kv_up 512·8192/2 and
    o 4096·1024/2, the shared expert 3·1024·1024/2 and 8 local experts 8·3·1024·1024:
    37,814,272 elements; MTP's eh_proj adds 2048·1024/2. At 2 bytes: 682,754,048 bytes, what
    the goldens' memory allocated after the step grows by from the bf16 run
    (gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed) to the fp8 run of the same arguments
    (..._mtp_resume_torch_dist_fp8): 6,632,031,744 -> 7,316,095,488, +684,063,744 bytes."""
    h = 1024
    model = _mla_moe_proxy(h)
    common = dict(dp=2, tp=2, pp=2, vpp=4, schedule="interleaved", ep=4, etp=1, zero=1, num_micro_batches=4,
                  seq_length=256)
    options = MemoryOptions(include_overhead=False, runtime="megatron")
    bf16, fp8 = (estimate(model, Strategy(**common, precision=p), options=options).stages[-1].params_bytes
                 for p in ("megatron-bf16", "megatron-fp8"))
    per_layer = h * 1536 + h * 576 + 1536 * 6144 // 2 + 512 * 8192 // 2 + 4096 * h // 2 + 3 * h * h // 2 + 8 * 3 * h * h
    assert per_layer == 37_814_272
    assert fp8 - bf16 == 2 * (9 * per_layer + 2 * h * h // 2)


def test_fp8_parameters_take_the_bf16_weight_out_of_that_stage_by_hand():
    """The same stage with Megatron's --fp8-param-gather (megatron-fp8-param): each linear weight
    is kept in fp8 (1 byte) and its transposed fp8 copy (1 byte) beside it, where megatron-fp8
    keeps a 2-byte weight and 2 bytes of copies: 2 bytes less per linear weight element, the
    whole 682,754,048 the copies added, so the stage's parameters read as bf16's. Norms, the
    routers and the embedding stay at 2 bytes. Under ZeRO-3 no copies are kept and the fp8 shards
    are priced at 2 bytes (a shard's byte over): the same as megatron-fp8."""
    h = 1024
    model = _mla_moe_proxy(h)
    common = dict(dp=2, tp=2, pp=2, vpp=4, schedule="interleaved", ep=4, etp=1, num_micro_batches=4, seq_length=256)
    options = MemoryOptions(include_overhead=False, runtime="megatron")

    def params(precision: str, zero: int) -> float:
        return estimate(model, Strategy(**common, zero=zero, precision=precision), options=options).stages[-1].params_bytes

    per_layer = 37_814_272
    assert params("megatron-fp8", 1) - params("megatron-fp8-param", 1) == 2 * (9 * per_layer + 2 * h * h // 2)
    assert params("megatron-fp8-param", 1) == params("megatron-bf16", 1)
    assert params("megatron-fp8-param", 3) == params("megatron-fp8", 3)
    with pytest.raises(ValueError, match="fp8_params keeps the linear weights for fp8 GEMMs"):
        PrecisionPolicy(param_bytes=2, grad_bytes=4, master_weight_bytes=4, optimizer_state_bytes=4, fp8_params=True)


def test_expert_tensor_parallelism_keeps_each_experts_down_bias_whole():
    """A routed expert's down projection is row-parallel over etp: its weight splits, its bias
    (h, added after the reduction) does not, as a dense MLP's down bias and Megatron's
    RowParallelLinear / TE's row-parallel grouped linear keep it. gpt-oss-like experts (h 64,
    8 experts 32 wide with biases) over ep 2, etp 2: 4 experts of (3·64·32 + 2·32)/2 + 64 each."""
    from ndplan.memory.static import layer_elements

    model = ModelSpec(name="oss", num_layers=1, hidden_size=64, ffn_hidden_size=0, num_attention_heads=4, num_kv_heads=2,
                      head_dim=16, vocab_size=256, num_experts=8, num_experts_per_tok=2, moe_ffn_hidden_size=32,
                      expert_bias=True)
    one = np.ones(1)
    experts = layer_elements(model, 2 * one, 2 * one, 2 * one).expert["moe"]
    assert experts[0] == 4 * ((3 * 64 * 32 + 2 * 32) / 2 + 64)


def test_torch_ddp_keeps_its_reducer_buckets_beside_the_gradients():
    """Without ZeRO or FSDP the pytorch runtime's replicas run DDP (torchtitan's ``replicate``,
    bucket_cap_mb=100, gradient_as_bucket_view left False): the reducer's buckets are flat
    tensors as large as all the gradients, allocated when DDP wraps the model and kept, and each
    parameter's .grad is a copy out of them (PyTorch PR 41954: making .grad a view of its bucket
    saved ~1 GB on a 1 GB-gradient model). TINY's 2·(36864 + 2·64 + ...) elements: the buckets
    hold grad_bytes per element, through the forward/backward and the optimizer step alike. One
    replica (dp 1) runs no DDP; Megatron's DDP keeps the gradients in its buffer alone."""
    elements = count_parameters(TINY).total

    def stage(runtime: str, dp: int):
        return estimate(TINY, Strategy(dp=dp, seq_length=8), options=MemoryOptions(include_overhead=False,
                                                                                    runtime=runtime)).stages[0]

    ddp, single = stage("pytorch", 2), stage("pytorch", 1)
    assert ddp.comm_bytes - single.comm_bytes == 4 * elements
    assert ddp.optimizer_step_bytes - single.optimizer_step_bytes == 4 * elements
    assert ddp.allocated_bytes - single.allocated_bytes == 4 * elements
    assert stage("megatron", 2).comm_bytes == stage("megatron", 1).comm_bytes


def test_megatron_mtp_module_keeps_three_norms_by_hand():
    """Megatron-Core's MultiTokenPredictionLayer (megatron/core/transformer/multi_token_prediction.py)
    runs enorm on the shifted tokens' embedding, hnorm on the decoder's output, eh_proj on their
    concatenation (2h), its transformer layer and its final_layernorm, then the shared head and
    loss: three norms, the last being the one before the head. Megatron profile, TINY (h=64),
    flash, no dropout, per token:
      norm   = 2h (input) + 4 (rsigma)                                             = 132
      layer  = 2·norm + attention 528 + mlp 896                                    = 1688
      output = norm + 2h (head input) + 4·vocab (fp32 softmax) + 8 (labels)        = 1292
      MTP    = enorm + hnorm + 2·2h (eh_proj input) + layer + output               = 3500
    8 tokens: 28,000 bytes (a fourth norm read 29,056)."""
    options = MemoryOptions(include_overhead=False, runtime="megatron")
    model = TINY.model_copy(update={"mtp_depth": 1})
    stage = estimate(model, Strategy(seq_length=8), options=options).stages[0]
    assert stage.activations_by_kind["output"] == 8 * 1292
    assert stage.activations_by_kind["mtp"] == 8 * (2 * 132 + 2 * 2 * 64 + 1688 + 1292) == 28000


@pytest.mark.parametrize(("recompute_layers", "per_token"), [
    # uniform: the module checkpointed whole keeps its two inputs (2h each) and the head and loss
    # outside it (output less the final_layernorm it rebuilds): 2·128 + 1292 - 132
    (0, 2 * 128 + 1292 - 132),
    # block: Megatron skips the MTP module's recompute, so it keeps what it keeps without recompute
    (1, 2 * 132 + 2 * 2 * 64 + 1688 + 1292),
])
def test_megatron_mtp_module_under_full_recompute(recompute_layers, per_token):
    """MultiTokenPredictionLayer.forward checkpoints the module (_checkpointed_forward) under
    --recompute-granularity full: with --recompute-method uniform all of _proj_and_transformer_layer
    (eh_proj, the layer, the final_layernorm), with block not at all ("not supported for MTP yet.
    Skipping recompute."). Figures per token as in the test above."""
    options = MemoryOptions(include_overhead=False, runtime="megatron")
    model = TINY.model_copy(update={"mtp_depth": 1})
    strategy = Strategy(seq_length=8, recompute="full", recompute_layers=recompute_layers)
    stage = estimate(model, strategy, options=options).stages[0]
    assert stage.activations_by_kind["mtp"] == 8 * per_token


def test_megatron_mtp_module_rebuilt_whole_in_its_backward():
    """Under full recompute (uniform) the MTP checkpoint's backward rebuilds the whole module
    at once: its layer (1688 per token), enorm's and hnorm's statistics, their 2h concatenation
    (eh_proj's input) and the final_layernorm's input (3 norms' bytes, 3·132), beside the layer's
    working set (fc1's gradient 2·2·ffn and fc2's input gradient 2·ffn: 768). 8 tokens:
    8·(3·132 + 1688 + 768) = 22,816 bytes, above a decoder layer's rebuild
    8·(1688 - 128 + 768) = 18,624 (the transient without MTP, and with it before)."""
    options = MemoryOptions(include_overhead=False, runtime="megatron")
    strategy = Strategy(seq_length=8, recompute="full")
    plain = estimate(TINY, strategy, options=options).stages[0]
    assert plain.transient_bytes == 8 * (1688 - 128 + 768) == 18624
    with_mtp = estimate(TINY.model_copy(update={"mtp_depth": 1}), strategy, options=options).stages[0]
    assert with_mtp.transient_bytes == 8 * (3 * 132 + 1688 + 768) == 22816


def test_torchtitan_expert_tp_1_splits_the_routed_tokens_over_the_tp_ranks():
    """torchtitan with EP borrowing the TP ranks (expert TP 1, sequence parallel) applies
    ReordererSequenceParallel: each TP rank dispatches 1/tp of the router's tokens, so every
    routed tensor is halved at tp 2; with expert TP = tp each rank routes all of them through
    experts half as wide. PyTorch profile, a MoE layer (h 64, 4 experts top-2 of width 32), bf16,
    per token: routed = expert input 2·64·2 + the routing weights gathered 2·2 + gate/up 2·2·32·2
    + activation and down input 2·(2·32·2) + weighted output 2·64·2 = 1028; the rest (MoE input 128,
    router probabilities 16, top-k ids 16, weights 12, sort keys 48) = 220 on every rank. tp 1:
    1248; tp 2 etp 1: 220 + 1028/2 = 734 (read 1248 before: nothing split); tp 2 etp 2:
    220 + 516 + 256 = 992."""
    from ndplan.memory.activations import layer_activations

    model = ModelSpec(name="tm", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=256, num_experts=4, num_experts_per_tok=2,
                      moe_ffn_hidden_size=32, layer_mlp_kinds=("moe",))

    def moe_bytes(**fields):
        acts = layer_activations(model, StrategyBatch.of(Strategy(seq_length=8, ep=2, **fields)), NO_OVERHEAD)
        return acts.moe_blocks["moe"][0], acts.backward_extra["moe"][0]

    assert moe_bytes(dp=2) == (1248, 3 * 2 * 64 * 2)
    assert moe_bytes(tp=2, etp=1, sequence_parallel=True) == (734, 3 * 2 * 64 * 2 / 2)
    assert moe_bytes(tp=2, etp=2, sequence_parallel=True, dp=2) == (992, 3 * 2 * 64 * 2)


@pytest.mark.parametrize("etp", [1, 2])
def test_fsdp_expert_weight_gradient_working_set_takes_the_ranks_routed_tokens(etp):
    """Under FSDP the fused experts' gate_up weight gradient is made beside the gradient of their
    output: per routed token on the rank k·2f/etp elements. Under sequence parallelism a rank's
    routed tokens are its sequence shard's, gathered over the expert-TP group (etp/tp of them),
    so that gradient is k·2f/tp per token whatever etp. 1024 tokens, k 2, f 512, tp 2, bf16:
    1024 · 2·2·2·512/2 = 2,097,152 bytes (etp 1 read 4,194,304: every token of the sequence)."""
    model = ModelSpec(name="tm", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=256, num_experts=4, num_experts_per_tok=2,
                      moe_ffn_hidden_size=512, layer_mlp_kinds=("moe", "moe"))
    strategy = Strategy(seq_length=1024, tp=2, ep=2, etp=etp, sequence_parallel=True, dp=2, zero=3, fsdp=True)
    assert estimate(model, strategy, options=NO_OVERHEAD).stages[0].transient_bytes == 1024 * 2 * 2 * 2 * 512 / 2


def test_megatron_expert_tp_without_tp_gathers_the_routed_tokens():
    """Megatron's all-to-all dispatcher gathers the routed tokens over the expert-TP group
    (gather_from_sequence_parallel_region on its tp_group, the etp ranks) whatever the attention's
    TP: at tp 1, etp 2 each rank runs the tokens of two ranks through experts half as wide (the
    step-time model's expert GEMMs take tokens·k·etp/tp likewise). Megatron profile, a MoE layer
    (h 64, 4 experts top-2 of 32), bf16, per token: router input 128 + logits 2·4·4 = 32, then
    routed: permuted tokens 2·64·2 = 256, fc1 output 2·2·32·2 = 256, fc2 input 128, probabilities
    2·4 = 8. etp 1: 808; etp 2: 160 + 2·256 + 256 + 128 + 2·8 = 1072 (read 616: the tokens
    unsplit and the widths halved)."""
    from ndplan.memory.activations import layer_activations

    model = ModelSpec(name="tm", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=256, num_experts=4, num_experts_per_tok=2,
                      moe_ffn_hidden_size=32, layer_mlp_kinds=("moe",))
    options = MemoryOptions(include_overhead=False, runtime="megatron")

    def moe_bytes(etp):
        batch = StrategyBatch.of(Strategy(seq_length=8, tp=1, ep=2, etp=etp, dp=4))
        return layer_activations(model, batch, options).moe_blocks["moe"][0]

    assert moe_bytes(1) == 808
    assert moe_bytes(2) == 128 + 32 + 2 * 256 + 256 + 128 + 2 * 8 == 1072


@pytest.mark.parametrize(("etp", "weights"), [(1, 2 * 2 * 512 * 64 * 2), (2, 2 * 2 * 512 * 64 * 2 // 2)])
def test_new_expert_gradient_beside_the_kept_one_takes_the_ranks_routed_tokens(etp, weights):
    """From a step's second micro-batch torch makes the fused experts' gate_up weight gradient
    anew beside the kept one (2 local experts · 2f·h/etp, 2 bytes), from the gradient of their
    output: the rank's routed tokens through experts 1/etp wide, k·2f/tp per token under SP
    whatever etp (torchtitan's ReordererSequenceParallel at etp 1). First of two stages, 1024
    tokens, k 2, f 512, tp 2: weights + 1024·2·2·512·2/2 = weights + 2,097,152 (etp 1 read
    4,194,304 for the gradient: every token of the sequence)."""
    model = ModelSpec(name="tm", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=256, num_experts=4, num_experts_per_tok=2,
                      moe_ffn_hidden_size=512, layer_mlp_kinds=("moe", "moe"))
    strategy = Strategy(seq_length=1024, tp=2, ep=2, etp=etp, sequence_parallel=True, dp=2, num_micro_batches=2, pp=2)
    first = estimate(model, strategy, options=NO_OVERHEAD).stages[0]
    assert first.transient_bytes == weights + 1024 * 2 * 2 * 512 * 2 / 2


# Megatron's allgather token dispatcher (MemoryOptions.moe_dispatcher): a tiny MoE layer by hand.
ALLGATHER_MOE = ModelSpec(name="ag-moe", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                          num_kv_heads=2, head_dim=16, vocab_size=256, num_experts=8, num_experts_per_tok=2,
                          moe_ffn_hidden_size=32, layer_mlp_kinds=("moe", "moe"))


def test_allgather_dispatcher_buffers_and_kept_tensors_by_hand():
    """tp 2 with SP, ep 2, etp 2, one micro-batch of 16 tokens, h 64, 8 experts, top-2. A rank
    routes its own r = 16/2 = 8 tokens; the dispatcher gathers G = r·etp·ep = 32 over the
    expert-TP x EP group:
      persistent global buffer   G·h·2                       =  4,096 B (comm, for the run)
      combine working set        G·h·(2 + 4) + r·h·4         = 14,336 B (bf16 un-permuted, its fp32
                                 cast, the fp32 reduce-scatter output), against the all-to-all's
                                 2·16·k·h·2 = 8,192 B (both above the SP gather's 16·h·2 = 2,048)
      kept per layer: the gathered fp32 probabilities of the 4 local experts 4·G·4 = 512 B, their
      bool mask 4·G = 128 B, the int64 source row of each local copy G·k/2·8 = 256 B: 896 B."""
    strategy = Strategy(dp=2, tp=2, sequence_parallel=True, ep=2, etp=2, seq_length=16, global_batch_size=2)
    plain = estimate(ALLGATHER_MOE, strategy, options=MemoryOptions(runtime="megatron", include_overhead=False))
    gathered = estimate(ALLGATHER_MOE, strategy, options=MemoryOptions(runtime="megatron", include_overhead=False,
                                                                       moe_dispatcher="allgather"))
    a, g = plain.stages[0], gathered.stages[0]
    assert a.comm_bytes == 8192
    assert g.comm_bytes == 14336 + 4096
    assert g.activations_bytes - a.activations_bytes == 2 * 896
    assert g.activations_by_kind["moe"] - a.activations_by_kind["moe"] == 2 * 896
    # the buffer stays through the optimizer step
    assert g.optimizer_step_bytes - a.optimizer_step_bytes == 4096


def test_allgather_dispatcher_is_megatron_and_not_node_dedup():
    from ndplan.perf import OverlapConfig

    with pytest.raises(NdplanError, match="allgather"):
        MemoryOptions(moe_dispatcher="allgather")  # the pytorch profile has no such dispatcher
    with pytest.raises(NdplanError, match="node_dedup"):
        MemoryOptions(runtime="megatron", moe_dispatcher="allgather", overlap=OverlapConfig(ep_dispatch="node_dedup"))
    with pytest.raises(NdplanError, match="moe_dispatcher must be one of"):
        MemoryOptions(runtime="megatron", moe_dispatcher="flex")  # type: ignore[arg-type]


def test_zbv_with_fsdp_resharding_after_forward_carries_the_dropped_gradient_caveat():
    """torch 2.13's ZB-V under FSDP2 with reshard after forward never makes some weight gradients
    (traced on the fake-tensor step: the first stage's head-chunk decoder layer ends the step with
    no gradient; tests/data/measured/llama8b-pp2-fsdp2-zbv-m4-s4k-dropped-grads.json): told beside
    the estimate, and not where the units stay gathered or the schedule does not split so."""
    from ndplan.model import get_preset

    model = get_preset("llama-3.1-8b")

    def told(**fields: object) -> bool:
        strategy = Strategy(dp=2, pp=2, vpp=2, zero=3, fsdp=True, num_micro_batches=4, seq_length=4096,
                            precision="fsdp-bf16", **fields)
        return any("drops weight gradients" in c for c in estimate(model, strategy, options=NO_OVERHEAD).caveats)

    assert told(schedule="zbv")
    assert not told(schedule="zbv", reshard_after_forward=False)
    assert not told(schedule="interleaved")


def test_the_runtime_states_its_gradient_buckets_to_the_step_time(tmp_path: Path):
    """The pytorch runtime (torchtitan's replicate, bucket_cap_mb=100) hands the step time PyTorch
    DDP's 100 MiB buckets; Megatron's its own rule; a profile naming another is refused."""
    from ndplan.memory.profile import get_profile

    torch_software = MemoryOptions(runtime="pytorch").time_keywords()["software"]
    assert (torch_software["grad_buckets"], torch_software["ddp_bucket_cap_mb"]) == ("ddp", 100.0)
    assert MemoryOptions(runtime="megatron").time_keywords()["software"]["grad_buckets"] == "megatron"
    shipped = Path(__file__).parents[1] / "src" / "ndplan" / "memory" / "profiles" / "pytorch.yaml"
    for line, needle in (("grad_buckets: deepspeed", "grad_buckets must be 'megatron' or 'ddp', got 'deepspeed'"),
                         ("ddp_bucket_cap_mb: 0", "ddp_bucket_cap_mb must be a positive number, got 0")):
        path = tmp_path / "mine.yaml"
        path.write_text(shipped.read_text().replace(line.split(":")[0] + ": " + ("ddp" if "grad" in line else "100"),
                                                    line))
        with pytest.raises(NdplanError, match=re.escape(needle)):
            get_profile(str(path))


def test_taken_activation_figures_by_kind_equal_an_eager_gather() -> None:
    """LayerActivations.take gathers a layer kind's figures on first read: whatever is read, in
    any order, and its copy, hold every kind's rows at the index."""
    from ndplan.memory.activations import layer_activations

    model = get_preset("mixtral-8x7b")
    strategies = [Strategy(dp=8, tp=tp, ep=ep, micro_batch_size=mbs, num_micro_batches=8, seq_length=4096,
                           recompute=recompute)
                  for tp in (1, 2) for ep in (1, 8) for mbs in (1, 2) for recompute in ("none", "selective")]
    acts = layer_activations(model, StrategyBatch.of(strategies), MemoryOptions())
    index = np.array([5, 0, 5, 3, 12])
    taken = acts.take(index)
    assert taken.full["moe"].tolist() == acts.full["moe"][index].tolist()  # one kind read first
    for name in ("full", "recomputed", "attention_backward"):
        eager = {kind: values[index] for kind, values in getattr(acts, name).items()}
        lazy = getattr(taken, name)
        # its copy first (before anything else reads it: only "full"'s moe rows are gathered yet)
        assert {kind: rows.tolist() for kind, rows in lazy.copy().items()} == {
            kind: rows.tolist() for kind, rows in eager.items()}
        assert sorted(lazy) == sorted(eager) and len(lazy) == len(eager)
    assert taken.full.copy().keys() == acts.full.keys()


def test_torchs_ring_holds_its_all_gathered_keys_and_values_and_fp32_gradients():
    """torch's context parallelism (the pytorch profile's ``ring_exchange: allgather``) holds,
    while a layer's backward runs, K and V all-gathered from the ring's c ranks at the query
    heads' width, their contiguous copy, fp32 accumulators of the Q, K and V gradients and the
    fp32 K, V gradients received, updated and sent on: ((c + 1)·β + 16)·(q_w + o_w) + 4·q_w
    bytes a token over tp. Llama-3.1-8B (q_w = o_w = 4096), bf16, cp 2, T = 4096 tokens a
    device, no SP: (3·2 + 16)·8192 + 4·4096 = 196,608 B a token -> 805,306,368 B, where
    Ulysses' exchange is 2·(4096 + 1024 + 1024 + 4096)·2 = 40,960 -> 167,772,160 B; both are the
    largest buffer alive there, so the stage's communication differs by 637,534,208 B. The
    megatron profile keeps Transformer Engine's ring (2·(K + V) at the KV width)."""
    model = get_preset("llama-3.1-8b")
    strategies = {kind: Strategy(dp=4, cp=2, cp_kind=kind, seq_length=8192) for kind in ("ring", "ulysses")}
    torch = {kind: estimate(model, s, options=MemoryOptions(runtime="pytorch")).stages[0].comm_bytes
             for kind, s in strategies.items()}
    assert torch["ring"] - torch["ulysses"] == 805_306_368 - 167_772_160
    megatron = {kind: estimate(model, s, options=MemoryOptions(runtime="megatron")).stages[0].comm_bytes
                for kind, s in strategies.items()}
    assert megatron["ulysses"] - megatron["ring"] == 167_772_160 - 2 * (1024 + 1024) * 4096 * 2
    # --explain's comm line says which ring it priced.
    said = "CP K/V is torch's ring"
    assert any(said in line for line in estimate(model, strategies["ring"], options=MemoryOptions(runtime="pytorch")).explain())
    assert not any(said in line for line in estimate(model, strategies["ring"], options=MemoryOptions(runtime="megatron")).explain())


def test_sandwich_norms_keep_two_more_norm_blocks_a_layer():
    """Gemma 3's four norms a layer each keep what a norm keeps: under the pytorch profile its
    fp32 input, its statistic and (Gemma multiplying its weight in fp32) its fp32 normalised
    input, 4·h + 4 + 4·h bytes a token; Megatron's standalone norm its input and statistic,
    2·h + 4. Two more a layer than the pre-norm model, in activations and parameters (2·h)."""
    from ndplan.memory.activations import layer_activations
    from ndplan.memory.static import layer_elements

    gemma = get_preset("gemma-3-1b")
    pre = gemma.model_copy(update={"norm_placement": "pre"})
    h = gemma.hidden_size
    batch = StrategyBatch.of(Strategy(seq_length=128))
    for runtime, one_norm in (("pytorch", 4 * h + 4 + 4 * h), ("megatron", 2 * h + 4)):
        options = MemoryOptions(runtime=runtime, include_overhead=False)
        four, two = (layer_activations(m, batch, options) for m in (gemma, pre))
        assert four.full["dense"][0] - two.full["dense"][0] == 2 * one_norm, runtime
        assert four.dense_blocks["norm"][0] == 4 * one_norm, runtime
    tp = np.array([1.0])
    extra = layer_elements(gemma, tp, tp, tp).by_kind["dense"]["norm"] - layer_elements(pre, tp, tp, tp).by_kind["dense"]["norm"]
    assert extra[0] == 2 * h


def test_megatron_refuses_post_norm_layers():
    """OLMo 2's norms follow attention and MLP; Megatron-Core builds its norms first, fused into
    the next linear, so its profile cannot say what such a layer keeps: the estimate says so."""
    with pytest.raises(NdplanError, match=r"olmo-2-7b puts its norms after attention and MLP \(norm_placement "
                                          r"'post'\), which Megatron-Core's layers do not build .* price it under "
                                          r"runtime 'pytorch'"):
        estimate(get_preset("olmo-2-7b"), Strategy(seq_length=4096), get_device("h100-sxm"),
                 MemoryOptions(runtime="megatron"))
    assert estimate(get_preset("olmo-2-7b"), Strategy(seq_length=4096), get_device("h100-sxm"),
                    MemoryOptions(runtime="pytorch")).peak_bytes > 0
