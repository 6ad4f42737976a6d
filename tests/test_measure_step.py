"""ndplan measure: a whole training step on fake tensors, checked against hand-derived bytes.

The pure-Python parts (JSON format, what can be measured, trimming) run everywhere; the
measurements need torch and transformers (the ``census`` extra) and are skipped without them.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from ndplan.census.measure_step import (
    check_measurable,
    stage_to_rank,
    trimmed_hf_config,
    trimmed_spec,
    virtual_stage_layers,
)
from ndplan.census.measurement import (
    MEASURED_SCHEMA,
    RankMemory,
    StepMeasurement,
    load_measurement,
    measurement_from_dict,
)
from ndplan.errors import NdplanError
from ndplan.model import get_preset, hf_config
from ndplan.schedule import model_chunk_table
from ndplan.strategy import Strategy

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs the census extra (torch, transformers)")

DATA = Path(__file__).parent / "data" / "measured"

# A tiny llama: h=64, 4 heads of 16, 2 KV heads, FFN 160, vocab 100 (every width even: FSDP 2
# shards every tensor without padding).
H, NH, NKV, HD, FFN, VOCAB = 64, 4, 2, 16, 160, 100
TINY = dict(model_type="llama", hidden_size=H, intermediate_size=FFN, num_attention_heads=NH,
            num_key_value_heads=NKV, head_dim=HD, num_hidden_layers=2, vocab_size=VOCAB)
SEQ = 32


def tiny_params(layers: int) -> tuple[int, int]:
    """(elements, parameter tensors) of the tiny llama: embedding, per layer q/k/v/o + gate/up/down
    + two norms, final norm, untied LM head."""
    per_layer = H * NH * HD + 2 * H * NKV * HD + NH * HD * H + 3 * H * FFN + 2 * H
    return VOCAB * H + layers * per_layer + H + VOCAB * H, 1 + 9 * layers + 2


def tiny_layer_saved_per_token() -> int:
    """What one transformers 5 LlamaDecoderLayer keeps for backward per token (bf16, SDPA, no
    recompute): each RMSNorm keeps its fp32 input (4h), rsqrt (4), the bf16 cast (2h) and its
    output (2h, the next linears' input); attention keeps rotated q and k, v, the SDPA output and
    its fp32 logsumexp; the MLP keeps gate, up, silu(gate) and silu(gate)*up."""
    norm = 4 * H + 4 + 2 * H + 2 * H
    attention = 2 * NH * HD + 2 * NKV * HD + 2 * NKV * HD + 2 * NH * HD + 4 * NH
    mlp = 4 * 2 * FFN
    return 2 * norm + attention + mlp


# ------------------------------------------------------------------------------ pure Python
def test_json_round_trip() -> None:
    m = StepMeasurement(
        model="llama-3.1-8b", strategy=Strategy(pp=2, num_micro_batches=2, precision="bf16-pure"),
        ranks=(RankMemory(stage=0, rank=0, allocated_bytes=10, categories={"params": 4}),
               RankMemory(stage=1, rank=1, allocated_bytes=12, reserved_bytes=14)),
        num_layers=4, source="test",
    )
    data = json.loads(json.dumps(m.to_dict()))
    assert data["schema"] == MEASURED_SCHEMA
    back = measurement_from_dict(data)
    assert back.strategy == m.strategy
    assert back.ranks == m.ranks
    assert back.num_layers == 4 and back.allocated_bytes == 12


def test_notes_that_are_not_a_list_are_named() -> None:
    """A fuzzing review: ``notes: 1`` in a measure --out file was a TypeError traceback in verify."""
    m = StepMeasurement(model="llama-3.1-8b", strategy=Strategy(precision="bf16-pure"),
                        ranks=(RankMemory(stage=0, rank=0, allocated_bytes=10),), num_layers=4, source="test")
    data = json.loads(json.dumps(m.to_dict()))
    data["notes"] = 1
    with pytest.raises(NdplanError, match=r"m.json: 'notes' must be a list of text, got 1"):
        measurement_from_dict(data, "m.json")
    data["notes"] = "one note"
    assert measurement_from_dict(data).notes == ("one note",)


def test_committed_examples_load() -> None:
    cluster = load_measurement(DATA / "example-cluster.json")
    assert cluster.strategy.pp == 2 and cluster.strategy.dp == 2
    # no "stage": derived from the rank, pipeline ranks outermost (world 4 / pp 2 = 2 per stage)
    assert [r.stage for r in cluster.ranks] == [0, 0, 1, 1]
    assert cluster.ranks[3].reserved_bytes is None
    fake = load_measurement(DATA / "llama-3.1-8b-2layers-pp2-fake.json")
    assert {r.stage for r in fake.ranks} == {0, 1}
    assert all(r.categories["params"] > 0 for r in fake.ranks)


@pytest.mark.parametrize(("patch", "needle"), [
    ({"schema": "other"}, "'schema'"),
    ({"model": None}, "'model'"),
    ({"strategy": {"dp": 0}}, "strategy"),
    ({"ranks": []}, "'ranks'"),
    ({"ranks": [{"rank": 0}]}, "allocated_bytes"),
    ({"ranks": [{"allocated_bytes": 1}]}, "'stage' (pipeline stage) or 'rank'"),
    ({"ranks": [{"stage": 3, "allocated_bytes": 1}]}, "stage 3 does not exist"),
    ({"ranks": [{"stage": 0, "allocated_bytes": -5}]}, "non-negative"),
    # a rank or stage is not bytes; a strategy of the wrong type is not missing; ranks the strategy
    # does not have name it (they said "stage 1 does not exist with pp=1")
    ({"ranks": [{"rank": -1, "allocated_bytes": 1}]}, "ranks[0]: 'rank' must be a whole number >= 0, got -1"),
    ({"ranks": [{"stage": 0.5, "allocated_bytes": 1}]}, "ranks[0]: 'stage' must be a whole number >= 0, got 0.5"),
    ({"strategy": "x"}, "'strategy' must be an object of Strategy fields (dp, tp, pp, ...), got str"),
    ({"strategy": {"tp": 3}, "ranks": [{"rank": 3, "allocated_bytes": 1}]},
     "ranks[0]: rank 3 is not among the 3 ranks (dp·tp·pp·cp) of the file's 'strategy' (dp1 tp3 pp1 "),
    ({"ranks": [{"stage": 2, "allocated_bytes": 1}]}, "stage 2 does not exist with pp=2, the file's 'strategy' (dp1 tp1 pp2"),
    ({"schema_version": 2}, "schema_version"),
    # a review found these crashing (ValueError, TypeError, AttributeError) or read silently
    ({"ranks": [{"stage": 0, "allocated_bytes": 1, "categories": {"params": "x"}}]},
     "ranks[0]: categories: 'params' must be a number of bytes, got 'x'"),
    ({"ranks": [{"stage": 0, "allocated_bytes": 1, "categories": {"params": None}}]},
     "ranks[0]: categories: 'params' must be a number of bytes, got None"),
    ({"ranks": [{"stage": 0, "allocated_bytes": 1, "at_peak": "x"}]}, "'at_peak' must be an object of bytes by name"),
    ({"ranks": [{"stage": 0, "allocated_bytes": 1, "virtual_stages": [0, "a"]}]},
     "'virtual_stages' must be a list of whole numbers >= 0"),
    ({"ranks": [{"stage": 0, "allocated_bytes": 10, "reserved_bytes": 5}]},
     "'reserved_bytes' 5 is below 'allocated_bytes' 10"),
    ({"attention": "bogus"}, "'attention' must be one of flash, sdpa, eager"),
    ({"model": ["x"]}, "'model' must be a name or a path, got ['x']"),
])
def test_malformed_measurement_names_the_field(patch: dict, needle: str) -> None:
    data = {"model": "llama-3.1-8b", "strategy": {"pp": 2}, "ranks": [{"stage": 0, "allocated_bytes": 1}]}
    data.update(patch)
    with pytest.raises(NdplanError, match=re.escape(needle)):
        measurement_from_dict(data, "m.json")


@pytest.mark.parametrize(("strategy", "needle"), [
    (Strategy(precision="megatron-bf16"), "not a PyTorch eager recipe"),
    (Strategy(dp=2, precision="bf16-pure"), "needs --fsdp|without FSDP"),
    (Strategy(cp=2, precision="bf16-pure"), "context parallelism"),
    (Strategy(precision="fsdp-bf16"), "needs --fsdp"),
    (Strategy(pp=2, schedule="zb-h1", precision="bf16-pure"), "zb-h1"),
    (Strategy(dp=2, zero=1, precision="bf16-pure"), "zero=1"),
    (Strategy(num_micro_batches=2, pipeline_runs=2, precision="bf16-pure"), "num_micro_batches=4"),
    # torch refused it mid-run, at the first stage
    (Strategy(pp=2, num_micro_batches=1, precision="bf16-pure"), r"give --num-micro-batches >= 2 \(got 1\)"),
])
def test_unmeasurable_strategies_are_refused(strategy: Strategy, needle: str) -> None:
    with pytest.raises(NdplanError, match=needle):
        check_measurable(strategy, 4, dict(TINY))


def test_tensor_parallel_moe_is_refused() -> None:
    with pytest.raises(NdplanError, match="MoE"):
        check_measurable(Strategy(tp=2, precision="bf16-pure"), 2, hf_config("qwen3-30b-a3b"))


def test_trimming_keeps_layer_kinds_and_drops_mtp() -> None:
    cfg = trimmed_hf_config(hf_config("deepseek-v3"), 4)
    assert cfg["num_hidden_layers"] == 4 and cfg["num_nextn_predict_layers"] == 0
    spec = trimmed_spec(get_preset("deepseek-v3"), 4)
    assert spec.layer_mlp_kinds == ("dense", "dense", "dense", "moe") and spec.mtp_depth == 0
    with pytest.raises(NdplanError, match="exceeds"):
        trimmed_hf_config(hf_config("llama-3.1-8b"), 33)


@pytest.mark.parametrize(("schedule", "pp", "vpp"), [("1f1b", 4, 1), ("interleaved", 2, 2), ("interleaved", 4, 2),
                                                      ("zbv", 2, 2), ("zbv", 4, 2), ("dualpipev", 4, 2)])
def test_stage_ranks_match_the_estimator_placement(schedule: str, pp: int, vpp: int) -> None:
    s = Strategy(pp=pp, vpp=vpp, schedule=schedule, num_micro_batches=2 * pp, precision="bf16-pure")
    owner = stage_to_rank(s)
    for stage, chunks in enumerate(model_chunk_table(schedule, pp, vpp)):
        assert all(owner[v] == stage for v in chunks)
    assert sum(virtual_stage_layers(s, 8)) == 8


# ------------------------------------------------------------------------------ measurements
@needs_torch
def test_single_device_step_matches_hand_derivation() -> None:
    from ndplan.census.measure_step import measure_step

    n, tensors = tiny_params(2)
    s = Strategy(seq_length=SEQ, precision="bf16-pure")
    r = measure_step(dict(TINY), s, num_layers=2).ranks[0]
    c = r.categories
    buffers = 2 * (HD // 2) * 4  # rotary inv_freq and original_inv_freq, fp32
    assert c["params"] == 2 * n + buffers
    assert c["grads"] == 2 * n
    assert c["optimizer"] == 2 * 2 * n + 4 * tensors  # bf16 exp_avg, exp_avg_sq; fp32 step per tensor
    assert c["optimizer_step"] == 2 * n  # foreach AdamW: one temporary, sqrt(exp_avg_sq), per parameter
    assert r.optimizer_step_peak_bytes == 2 * n + buffers + 2 * n + c["optimizer"] + 2 * n
    assert r.allocated_bytes == max(r.forward_backward_peak_bytes, r.optimizer_step_peak_bytes)
    assert sum(v for k, v in c.items() if k != "optimizer_step") == r.forward_backward_peak_bytes
    assert c["comm"] == 0
    # held activations: one more decoder layer holds exactly one layer's saved tensors
    one = measure_step(dict(TINY), s, num_layers=1).ranks[0].categories["activations"]
    assert c["activations"] - one == tiny_layer_saved_per_token() * SEQ


@needs_torch
def test_full_recompute_holds_only_layer_inputs() -> None:
    from ndplan.census.measure_step import measure_step

    s = Strategy(seq_length=SEQ, recompute="full", precision="bf16-pure")
    two = measure_step(dict(TINY), s, num_layers=2).ranks[0].categories["activations"]
    one = measure_step(dict(TINY), s, num_layers=1).ranks[0].categories["activations"]
    assert two - one == 2 * H * SEQ  # the checkpointed layer's bf16 input


@needs_torch
def test_fsdp2_shards_params_grads_and_optimizer_exactly() -> None:
    from ndplan.census.measure_step import measure_step

    n, tensors = tiny_params(2)
    s = Strategy(dp=2, fsdp=True, zero=3, seq_length=SEQ, precision="fsdp-bf16")
    r = measure_step(dict(TINY), s, num_layers=2).ranks[0]
    c = r.categories
    buffers = 2 * (HD // 2) * 4
    assert c["params"] == 4 * n // 2 + buffers  # fp32 shards
    assert c["grads"] == 4 * n // 2  # fp32 sharded gradients (reduce_dtype fp32)
    assert c["optimizer"] == 8 * n // 2 + 4 * tensors
    assert c["optimizer_step"] == 4 * n // 2
    # unsharded bf16 parameters and all-gather / reduce-scatter buffers appear while a group runs
    largest_group = 2 * VOCAB * H  # the untied LM head group, bf16 (+ final norm)
    assert c["comm"] >= largest_group
    assert r.tracker_at_peak  # FSDPMemTracker's own labels


@needs_torch
def test_pipeline_ranks_hold_their_own_stages() -> None:
    from ndplan.census.measure_step import measure_step

    s = Strategy(pp=2, num_micro_batches=4, seq_length=SEQ, precision="bf16-pure")
    m = measure_step(dict(TINY), s, num_layers=2)
    assert [r.stage for r in m.ranks] == [0, 1] and [r.layers for r in m.ranks] == [1, 1]
    n, _ = tiny_params(2)
    per_layer = (n - 2 * VOCAB * H - H) // 2
    buffers = 2 * (HD // 2) * 4
    assert m.ranks[0].categories["params"] == 2 * (VOCAB * H + per_layer) + buffers
    assert m.ranks[1].categories["params"] == 2 * (per_layer + H + VOCAB * H) + buffers
    only_last = measure_step(dict(TINY), s, num_layers=2, stages=[1])
    assert only_last.ranks[0].to_dict() == m.ranks[1].to_dict()


@needs_torch
def test_tensor_parallel_with_fsdp_divides_the_linears() -> None:
    from ndplan.census.measure_step import measure_step

    n, _ = tiny_params(2)
    norms = 2 * 2 * H + H  # replicated over TP
    s = Strategy(dp=2, tp=2, fsdp=True, zero=3, seq_length=SEQ, precision="fsdp-bf16")
    c = measure_step(dict(TINY), s, num_layers=2).ranks[0].categories
    buffers = 2 * (HD // 2) * 4
    assert c["params"] == 4 * ((n - norms) // 4 + norms // 2) + buffers


@needs_torch
def test_timeline_records_the_step_up_to_its_peak(tmp_path: Path) -> None:
    """`ndplan measure --timeline` writes what was live on each rank as the step went: the
    largest total of a rank's rows is that rank's measured peak, and the forward/backward rows
    come before the optimizer's."""
    import csv

    from ndplan.census.measure_step import measure_step
    from ndplan.cli import main

    s = Strategy(seq_length=SEQ, pp=2, num_micro_batches=2, precision="bf16-pure")
    result = measure_step(dict(TINY), s, num_layers=2, timeline=True)
    for rank in result.ranks:
        assert max(live["total"] for _, _, live in rank.timeline) == rank.allocated_bytes
        phases = [phase for phase, _, _ in rank.timeline]
        assert phases.index("optimizer") > phases.index("forward_backward")
    assert "timeline" not in json.dumps(result.to_dict())
    out = tmp_path / "timeline.csv"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    assert main(["measure", str(config), "--layers", "2", "--pp", "2", "--num-micro-batches", "2",
                 "--seq", str(SEQ), "--precision", "bf16-pure", "--timeline", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert {row["stage"] for row in rows} == {"0", "1"}
    assert set(rows[0]) >= {"phase", "in_backward", "total_bytes", "activations_bytes", "comm_bytes"}


@needs_torch
@pytest.mark.parametrize("config, sliding", [
    (dict(model_type="mistral", sliding_window=8), [True] * 4),
    (dict(model_type="llama"), [False] * 4),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2), [False, False, True, True]),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=8, max_window_layers=2), [False] * 4),
    # Qwen2-MoE slides every other layer below max_window_layers; its attention has no layer_type
    (dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=8, max_window_layers=4, num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
     [True, False, True, False]),
])
def test_pipeline_stages_give_each_layer_the_mask_the_model_would(config: dict, sliding: list[bool]) -> None:
    from ndplan.census import _engine as E

    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=4, vocab_size=100, head_dim=16)
    hf = E.make_config({**base, **config}, attention="sdpa", experts="eager")
    model = E.build_meta_model(hf)
    assert [E.layer_slides(layer, hf) for layer in model.model.layers] == sliding


@needs_torch
def test_the_cuda_backend_reads_what_the_fake_step_measures() -> None:
    """``measure --backend cuda`` runs the step for real and reads the allocator's counters. Run
    on CPU with counters that track live storages (as the caching allocator counts its blocks),
    its categories match the fake-tensor step's to a few bytes: the AdamW step counters (fp32
    scalars the fake step counts on the device; a real run keeps them on the host) and the loss."""
    from ndplan.census import _engine as E
    from ndplan.census.measure_cuda import _run
    from ndplan.census.measure_step import measure_step

    class LiveCounters:  # torch.cuda's memory functions over E.LiveTracker
        def __init__(self, tracker: E.LiveTracker) -> None:
            self.tracker = tracker

        def synchronize(self) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def memory_allocated(self) -> int:
            return self.tracker.current

        def max_memory_allocated(self) -> int:
            return self.tracker.peak

        max_memory_reserved = max_memory_allocated

        def reset_peak_memory_stats(self) -> None:
            self.tracker.peak = self.tracker.current

    import torch

    s = Strategy(seq_length=SEQ, precision="bf16-pure", num_micro_batches=2, global_batch_size=2,
                 recompute="selective")
    tracker = E.LiveTracker(E.ModuleStack(), set())
    with tracker:
        real = _run(torch, trimmed_hf_config(dict(TINY), 2), s, "sdpa", "grouped_mm", 0, device="cpu",
                    counters=LiveCounters(tracker))
    fake = measure_step(dict(TINY), s, num_layers=2).ranks[0]
    for key in ("params", "grads", "optimizer", "activations", "optimizer_step"):
        assert abs(real.categories[key] - fake.categories[key]) <= 128, key
    assert real.forward_backward_peak_bytes == pytest.approx(fake.forward_backward_peak_bytes, abs=128)
    assert real.allocated_bytes == pytest.approx(fake.allocated_bytes, abs=128)


@needs_torch
def test_a_second_pipeline_run_starts_with_the_first_runs_gradients() -> None:
    """Measured on fake tensors: GPipe twice a step (pipeline_runs 2, torchtitan's gradient
    accumulation with a pipeline) over 2 micro-batches each. The last stage's peak, every forward
    held, grows by exactly its gradients, which the first run made; the first stage's by less (its
    first run's peak already came with some of them, the last layer's, made in its backward).
    ndplan adds the whole gradients to both: conservative, over the measured peaks by 0.6% and
    3.7% on one run, 1.5% and 3.6% on two."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    spec = spec_from_hf_config(TINY, name="tiny")
    measured, estimated = {}, {}
    for runs in (1, 2):
        s = Strategy(pp=2, num_micro_batches=2, pipeline_runs=runs, seq_length=256, precision="bf16-pure",
                     schedule="gpipe")
        m = measure_step(dict(TINY), s, num_layers=2)
        measured[runs] = [r.allocated_bytes for r in m.ranks]
        rows = [{row["key"]: row for row in stage["rows"]} for stage in verify(spec, m).to_dict()["stages"]]
        estimated[runs] = [r["allocated"]["estimate_bytes"] for r in rows]
        grads = [r["grads"]["measured_bytes"] for r in rows]
    assert measured[2][1] - measured[1][1] == grads[1]
    assert 0 < measured[2][0] - measured[1][0] < grads[0]
    assert [e2 - e1 for e1, e2 in zip(estimated[1], estimated[2], strict=True)] == grads
    for runs in (1, 2):
        assert all(0 <= e / m_ - 1 < 0.04 for e, m_ in zip(estimated[runs], measured[runs], strict=True))


@needs_torch
def test_fsdp_under_a_multi_chunk_schedule_keeps_three_chunks_gathered_either_way() -> None:
    """Measured on fake tensors: FSDP2 under torch's interleaved 1F1B (dp 2, pp 2, 8 layers, four
    chunks of one layer a rank). torch keeps every unit gathered after its backward whatever
    reshard_after_forward says, and at most three of a rank's chunks at once (schedule.unshard):
    the two settings peak within 1% of each other, and ndplan prices them alike (it had added
    the stage's gathered parameters once more without resharding: +13%/+19% over), within 4%."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    config = {**TINY, "hidden_size": 256, "intermediate_size": 640, "head_dim": 64, "num_hidden_layers": 8}
    measured, estimated = {}, {}
    for reshard in (False, True):
        s = Strategy(dp=2, pp=2, vpp=4, schedule="interleaved", zero=3, fsdp=True, reshard_after_forward=reshard,
                     num_micro_batches=4, seq_length=64, precision="fsdp-bf16")
        m = measure_step(dict(config), s, num_layers=8)
        rows = [{r["key"]: r for r in stage["rows"]}
                for stage in verify(spec_from_hf_config(config, name="tiny"), m).to_dict()["stages"]]
        measured[reshard] = [r["allocated"]["measured_bytes"] for r in rows]
        estimated[reshard] = [r["allocated"]["estimate_bytes"] for r in rows]
    for stage in range(2):
        assert abs(measured[False][stage] / measured[True][stage] - 1) < 0.01
        assert estimated[False][stage] == estimated[True][stage]
        for reshard in (False, True):
            assert abs(estimated[reshard][stage] / measured[reshard][stage] - 1) < 0.04


@needs_torch
def test_tied_pair_stays_one_table_under_tensor_parallelism() -> None:
    """parallelize_module gives the embedding and the LM head each its own sharded Parameter:
    the fake step trained two tables (two gradients, two optimizer states) where a tied model
    has one. Both are Shard(0) over the vocabulary; the head takes the embedding's again."""
    from ndplan.census.measure_step import measure_step

    s = Strategy(tp=2, seq_length=SEQ, precision="bf16-pure")
    tied = measure_step(dict(TINY, tie_word_embeddings=True), s, num_layers=2).ranks[0].categories
    untied = measure_step(dict(TINY, tie_word_embeddings=False), s, num_layers=2).ranks[0].categories
    table_shard = VOCAB * H // 2
    assert untied["params"] - tied["params"] == 2 * table_shard
    # the table's two bf16 moments and its fp32 step count
    assert untied["optimizer"] - tied["optimizer"] == 2 * 2 * table_shard + 4


@needs_torch
def test_tied_pair_apart_on_a_pipeline_each_stage_keeps_its_own_table() -> None:
    """The last stage of a pipeline holds the head but not the embedding: tying its head to the
    embedding there handed it a meta tensor and the stage's forward failed."""
    from ndplan.census.measure_step import measure_step

    s = Strategy(pp=2, num_micro_batches=2, seq_length=SEQ, precision="bf16-pure")
    last = measure_step(dict(TINY, tie_word_embeddings=True), s, num_layers=2, stages=[1]).ranks[0]
    n, _ = tiny_params(2)
    per_layer = (n - 2 * VOCAB * H - H) // 2
    assert last.categories["params"] == 2 * (per_layer + H + VOCAB * H) + 2 * (HD // 2) * 4


@needs_torch
def test_torchtitans_per_op_policy_keeps_every_second_matmul_and_verify_prices_it() -> None:
    """Selective recompute under torchtitan's per-op policy keeps fewer of a layer's tensors than
    the census's keep-matmuls policy; the measurement says which it ran, and verify estimates
    that policy: activations within 3% (a few small tensors at this size), the peak within 1%. A policy without selective recompute is refused."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    config = {**TINY, "hidden_size": 256, "intermediate_size": 640, "head_dim": 64}
    s = Strategy(seq_length=256, precision="bf16-pure", recompute="selective")
    held = {}
    for policy in ("keep-matmuls", "torchtitan-op"):
        m = measure_step(dict(config), s, num_layers=2, selective_policy=policy)
        assert m.provenance["selective_policy"] == policy
        rows = {r.key: r for r in verify(spec_from_hf_config(config, name="tiny"), m).stages[0].rows}
        held[policy] = rows["activations"].measured
        assert abs(rows["activations"].error_pct or 0) < 3 and abs(rows["allocated"].error_pct or 0) < 1, policy
    assert held["torchtitan-op"] < held["keep-matmuls"]
    with pytest.raises(NdplanError, match="goes with --recompute selective, not full"):
        measure_step(dict(config), Strategy(seq_length=256, precision="bf16-pure", recompute="full"), num_layers=2,
                     selective_policy="torchtitan-op")


@needs_torch
def test_sequence_parallelism_is_measured_and_verify_prices_it() -> None:
    """TP 2 with sequence parallelism on fake tensors (torchtitan's plan: norms on sequence
    shards, each block's input all-gathered, o/down reduce-scattered), one micro-batch and two,
    with and without FSDP: the estimate's peak within 1% of each. The residual stream is
    sharded, so the step keeps less than TP alone. With one micro-batch too, DTensor's
    vocabulary-parallel embedding keeps its whole [vocab, h] gradient (it was priced from the
    second micro-batch on: 21% low on a 4-layer Llama-3.1-8B's gradients)."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    config = {**TINY, "hidden_size": 256, "intermediate_size": 640, "head_dim": 64, "vocab_size": 2048}
    spec = spec_from_hf_config(config, name="tiny")
    held = {}
    for fields in ({"tp": 2}, {"tp": 2, "sequence_parallel": True},
                   {"tp": 2, "sequence_parallel": True, "num_micro_batches": 2, "global_batch_size": 2},
                   {"tp": 2, "sequence_parallel": True, "dp": 2, "zero": 3, "fsdp": True, "global_batch_size": 2,
                    "precision": "fsdp-bf16"}):
        s = Strategy(**{"seq_length": 512, "precision": "bf16-pure", **fields})
        rows = {r.key: r for r in verify(spec, measure_step(dict(config), s, num_layers=2)).stages[0].rows}
        assert abs(rows["allocated"].error_pct or 0) < 1, fields
        assert abs(rows["grads"].error_pct or 0) < 0.1, fields
        held[tuple(fields.items())] = rows["activations"].measured
    assert held[(("tp", 2), ("sequence_parallel", True))] < held[(("tp", 2),)]


@needs_torch
def test_loss_parallelism_is_measured_and_verify_prices_its_backward() -> None:
    """With --loss-parallel the LM head's logits stay sharded over the vocabulary and the loss
    runs under torch's loss_parallel, whose log-softmax backward (grad - exp(output)·sum(grad))
    holds exp(output) beside the two fp32 gradients a fused kernel makes: priced, the peak within
    1% with TP, SP and FSDP (it read 7% low). Under FSDP with TP the embedding's backward makes
    the whole [vocab, h] gradient beside its unit's reduce input and output, priced too."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    config = {**TINY, "hidden_size": 256, "intermediate_size": 640, "head_dim": 64, "vocab_size": 8192}
    spec = spec_from_hf_config(config, name="tiny")
    peaks = {}
    for fields in ({"tp": 2}, {"tp": 2, "sequence_parallel": True},
                   {"tp": 2, "sequence_parallel": True, "dp": 2, "zero": 3, "fsdp": True, "global_batch_size": 2,
                    "precision": "fsdp-bf16"}):
        for loss_parallel in (False, True):
            s = Strategy(**{"seq_length": 512, "precision": "bf16-pure", **fields})
            m = measure_step(dict(config), s, num_layers=2, loss_parallel=loss_parallel)
            assert m.provenance.get("loss_parallel", False) is loss_parallel
            rows = {r.key: r for r in verify(spec, m).stages[0].rows}
            assert abs(rows["allocated"].error_pct or 0) < 1, (fields, loss_parallel)
            peaks[(tuple(fields), loss_parallel)] = rows["forward_backward_peak"].measured
    assert peaks[(("tp",), True)] < peaks[(("tp",), False)]  # a shard of the logits, not all of them
    with pytest.raises(NdplanError, match="loss parallelism shards the logits"):
        measure_step(dict(config), Strategy(seq_length=512, precision="bf16-pure"), num_layers=2, loss_parallel=True)


@needs_torch
def test_a_deferred_fsdp_reduce_peaks_at_the_steps_closing_reduce_scatter() -> None:
    """Under torch.distributed.pipelining FSDP2 reduces at the end of the step: the first
    stage of an 8-layer Llama-3.1-8B (pp 2, FSDP 2 without resharding, full recompute, 4
    micro-batches of 2,048 tokens) peaks in that closing reduce, the embedding's reduce-scatter
    input (its gradient in fp32) beside every accumulated gradient and every gathered unit, with
    no activations left. Priced, the stage reads -0.4% (it read -5.0%)."""
    from ndplan.census.measure import load_hf_config
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model import load_model

    s = Strategy(dp=2, pp=2, zero=3, fsdp=True, reshard_after_forward=False, num_micro_batches=4,
                 global_batch_size=8, seq_length=2048, recompute="full", precision="fsdp-bf16")
    _, config = load_hf_config("llama-3.1-8b")
    m = measure_step(config, s, num_layers=8, stages=[0])
    row = verify(load_model("llama-3.1-8b"), m).stages[0].row("allocated")
    assert row is not None and row.error_pct is not None and -1 < row.error_pct < 1


def test_peak_blocks_are_the_blocks_live_at_the_largest_total() -> None:
    from ndplan.census.measure_step import peak_blocks

    events = [(1, 100, "parameters"), (2, 50, "mm"), (3, 50, "mm"), (2, 0, ""), (4, 300, "mm (backward)"),
              (3, 0, ""), (5, 10, "add")]
    # totals 100, 150, 200, 150, 450 (the peak: 1, 3 and 4 live), 400, 410
    assert peak_blocks(events) == (("mm (backward)", 1, 300), ("parameters", 1, 100), ("mm", 1, 50))
    assert peak_blocks([]) == ()


@needs_torch
def test_the_peak_by_op_adds_up_to_the_measured_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """``measure --peak-ops``: the blocks live at a rank's peak, by the op that allocated them,
    add up to the peak itself (FSDP's resized storages a free and a new block)."""
    from ndplan.census.measure_step import measure_step
    from ndplan.cli import main

    for fields in ({}, {"dp": 2, "zero": 3, "fsdp": True, "global_batch_size": 2, "precision": "fsdp-bf16"}):
        s = Strategy(**{"seq_length": SEQ, "precision": "bf16-pure", **fields})
        rank = measure_step(dict(TINY), s, num_layers=2).ranks[0]
        assert sum(n * size for _, n, size in rank.peak_blocks) == rank.allocated_bytes
    assert main(["measure", "llama-3.1-8b", "--layers", "1", "--seq", "256", "--peak-ops", "3"]) == 0
    out = capsys.readouterr().out
    assert "by the op that allocated each block" in out and "(the rest)" in out


@needs_torch
@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_a_tied_table_under_tensor_parallelism_keeps_its_shard(num_micro_batches: int) -> None:
    """With the embedding tied to the head on one rank, the head's backward (first) makes the
    accumulated gradient the rank's vocabulary shard and the embedding's whole gradient is added
    into it: the kept gradients are the shard, where an untied table keeps the whole [vocab, h]
    (it was priced whole tied too: 10% over a tiny model's gradients)."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    config = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "vocab_size": 1000}
    s = Strategy(seq_length=128, tp=2, num_micro_batches=num_micro_batches, global_batch_size=num_micro_batches,
                 precision="bf16-pure")
    for tied in (True, False):
        hf = {**config, "tie_word_embeddings": tied}
        report = verify(spec_from_hf_config(hf, name="tiny"), measure_step(dict(hf), s, num_layers=2))
        rows = {r.key: r for r in report.stages[0].rows}
        assert rows["grads"].measured == pytest.approx(rows["grads"].estimate, rel=1e-3), tied
        assert abs(rows["allocated"].error_pct or 0) < 1, tied


@needs_torch
@pytest.mark.parametrize("config", [
    dict(model_type="gemma3_text", sliding_window=64, head_dim=32),  # every layer sliding: no full rotary
    dict(model_type="olmo3", sliding_window=64),
])
def test_gemma_3_and_olmo_3_steps_are_measured_and_priced(config: dict) -> None:
    """Gemma 3's embedding scale is a scalar buffer that torch.tensor makes on the meta device,
    which the step's fake mode refused; its and OLMo 3's rotary takes the layer type, of which a
    stage may hold one alone. Both steps run, pipelined, and the estimate's peak is within 1.5%."""
    from ndplan.census.measure_step import measure_step
    from ndplan.census.verify import verify
    from ndplan.model.hf import spec_from_hf_config

    hf = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
              num_hidden_layers=4, vocab_size=1000, **config)
    s = Strategy(seq_length=128, pp=2, num_micro_batches=4, global_batch_size=4, precision="bf16-pure")
    report = verify(spec_from_hf_config(hf, name="tiny"), measure_step(dict(hf), s, num_layers=4))
    for stage in report.stages:
        rows = {r.key: r for r in stage.rows}
        assert abs(rows["allocated"].error_pct or 0) < 1.5, stage
