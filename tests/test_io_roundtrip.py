"""Round trips: read(emit(s)) is s, for random valid strategies in what each format can express.

Equality is up to ndplan's normal form (``canonical_strategy``: the same layer placement,
shard groups, resharding and recompute limit, however a format spells them) and precision
policies compare by their bytes. What each format cannot express is kept out of its
strategy space below, and listed in docs/io.md.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ndplan.errors import NdplanError
from ndplan.io import emit, read_config
from ndplan.io.common import EXTRA_POLICIES, canonical_strategy, policy_of
from ndplan.model import ModelSpec, count_parameters, get_preset, preset_names
from ndplan.perf.accumulation import strategy_code
from ndplan.strategy import PRECISION_PRESETS, PrecisionPolicy, Strategy, check_strategy
from ndplan.strategy.strategy import OFFLOAD_MODULES, OFFLOAD_SCHEDULES, RECOMPUTE_MODULES

MODELS = [get_preset(n) for n in ("llama-3.1-8b", "mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3")]
SUFFIX = {"megatron": ".sh", "torchtitan": ".toml", "hyperparallel": ".yaml", "mindformers": ".yaml"}

HYPER_BF16_FP32_MAIN = PrecisionPolicy(name="hyperparallel-bf16-fp32main", param_bytes=2, grad_bytes=2,
                                       master_weight_bytes=4, optimizer_state_bytes=4)

#: What each format can express (the rest is documented as lost in docs/io.md).
SPACES: dict[str, dict[str, Any]] = {
    "megatron": {
        "schedules": ("1f1b", "interleaved", "dualpipev"), "cp_kinds": ("ring", "ulysses", "hybrid", "allgather"),
        "zero": (0, 1, 2, 3), "precisions": (PRECISION_PRESETS["megatron-bf16"], PRECISION_PRESETS["megatron-fp8"],
                                             PRECISION_PRESETS["megatron-bf16-grad16"],
                                             PRECISION_PRESETS["megatron-fp8-grad16"],
                                             PRECISION_PRESETS["fp32"], EXTRA_POLICIES["megatron-fp16"]),
        "recompute_layers": ("full",), "offload": True, "activation_offload": True,
    },
    "torchtitan": {
        "schedules": ("1f1b", "gpipe", "interleaved", "zbv", "dualpipev"), "cp_kinds": ("ring",), "zero": (0, 3),
        "precisions": (PRECISION_PRESETS["fsdp-bf16"], PRECISION_PRESETS["fp32"], PRECISION_PRESETS["bf16-pure"]),
        "recompute_layers": (), "offload": False, "activation_offload": False,
    },
    "hyperparallel": {
        "schedules": ("1f1b", "interleaved", "gpipe", "zb-h1", "zbv", "dualpipev", "seq1f1b"),
        "cp_kinds": ("ring", "ulysses", "hybrid"), "zero": (0, 3),
        "precisions": (PRECISION_PRESETS["bf16-pure"], PRECISION_PRESETS["fsdp-bf16"], PRECISION_PRESETS["fp32"],
                       HYPER_BF16_FP32_MAIN),
        "recompute_layers": (), "offload": False, "activation_offload": False,
    },
    "mindformers": {
        "schedules": ("1f1b", "interleaved", "gpipe", "seq1f1b", "zbv"), "cp_kinds": ("ring", "ulysses", "hybrid"),
        "zero": (0, 1, 3),
        "precisions": (PRECISION_PRESETS["fsdp-bf16"], PRECISION_PRESETS["fp32"], PRECISION_PRESETS["bf16-pure"]),
        "recompute_layers": ("full", "selective"), "offload": False, "activation_offload": False,
    },
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def strategies(draw: st.DrawFn, fmt: str) -> tuple[ModelSpec, Strategy]:
    space = SPACES[fmt]
    model = draw(st.sampled_from(MODELS))
    tp = draw(st.sampled_from((1, 2, 4)))
    cp = draw(st.sampled_from((1, 2)))
    dp = draw(st.sampled_from((1, 2, 4)))
    pp = draw(st.sampled_from((1, 2, 4)))
    fields: dict[str, Any] = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    fields["seq_length"] = draw(st.sampled_from((2048, 4096)))
    fields["sequence_parallel"] = tp > 1 if fmt == "torchtitan" else (tp > 1 and draw(st.booleans()))
    if cp > 1:
        kind = draw(st.sampled_from(space["cp_kinds"]))
        fields["cp_kind"] = kind
        if kind == "hybrid":
            fields["ulysses_degree"] = draw(st.sampled_from((1, 2)))
    if model.is_moe:
        if fmt == "torchtitan":
            etp_choices = (1, tp)
        else:
            etp_choices = (1, 2, 4)
        etp = draw(st.sampled_from(etp_choices))
        eps = [e for e in (1, 2, 4, 8) if model.num_experts % e == 0 and (dp * cp * tp) % (e * etp) == 0]
        assume(eps)
        ep = draw(st.sampled_from(eps))
        if fmt == "torchtitan" and ep == 1:
            etp = tp
        fields.update(ep=ep, etp=etp)

    # Pipeline: schedule, chunks per stage, micro-batches, placement.
    schedules = [s for s in space["schedules"] if pp > 1 or s == "1f1b"]
    schedule = draw(st.sampled_from(schedules))
    vpp = {"interleaved": draw(st.sampled_from((2, 3))), "zbv": 2, "dualpipev": 2}.get(schedule, 1)
    stages = pp * vpp
    assume(stages <= model.num_layers)
    k = draw(st.integers(1, 4))
    fields["num_micro_batches"] = pp * k if schedule == "interleaved" else (2 * pp * k if schedule == "dualpipev" else k)
    fields["micro_batch_size"] = draw(st.sampled_from((1, 2)))
    fields.update(schedule=schedule, vpp=vpp)
    if schedule == "seq1f1b":
        fields["seq_chunks"] = draw(st.sampled_from((1, 2, 4)))
    if fmt == "megatron" and schedule == "dualpipev":
        assume(model.num_layers % stages == 0)  # MindSpeed splits DualPipeV chunks evenly
    elif pp > 1:
        placement = draw(st.sampled_from(("even", "flags", "explicit")))
        if placement == "flags":
            fields["embedding_as_layer"] = draw(st.booleans())
            fields["output_as_layer"] = draw(st.booleans())
        elif placement == "explicit":
            cuts = draw(st.lists(st.integers(1, model.num_layers - 1), min_size=stages - 1, max_size=stages - 1,
                                 unique=True).map(sorted))
            bounds = [0, *cuts, model.num_layers]
            fields["stage_layers"] = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))

    # Sharding.
    zero = draw(st.sampled_from(space["zero"]))
    if fmt == "torchtitan" and zero == 0:
        assume(cp == 1)  # torchtitan shards with FSDP over the CP ranks
    fields["zero"] = zero
    fields["fsdp"] = zero == 3 and fmt != "mindformers"
    if zero:
        replicas = dp * cp
        groups = [g for g in _divisors(replicas) if g < replicas]
        if fmt == "torchtitan":  # (a group of one: FSDP over one rank, said in the header; see test_round_trip)
            groups = [g for g in groups if g % cp == 0 and (g // cp > 1 or g == 1)]
        if groups and draw(st.booleans()):
            fields["shard_group"] = draw(st.sampled_from(groups))
        if zero == 3 and fmt != "mindformers":
            reshard = draw(st.booleans())
            if fmt == "megatron" and not reshard:
                # Only torch FSDP2 keeps parameters gathered, and Megatron runs it beside no pipeline
                # or experts, over all of dp·cp (test_megatron_torch_fsdp2_only_where_megatron_runs_it).
                assume(pp == 1 and fields.get("ep", 1) == 1 and not fields.get("shard_group"))
            fields["reshard_after_forward"] = reshard
    if space["offload"]:
        fields["optimizer_offload"] = draw(st.booleans())

    recompute = draw(st.sampled_from(("none", "selective", "full")))
    fields["recompute"] = recompute
    if recompute in space["recompute_layers"]:
        fields["recompute_layers"] = draw(st.integers(0, -(-model.num_layers // stages)))
    if space["activation_offload"] and schedule in OFFLOAD_SCHEDULES and recompute != "full" and draw(st.booleans()):
        # Megatron-Core's fine-grained activation offload, in the pairs it runs (``offload_conflict``).
        offload = set(draw(st.sets(st.sampled_from(OFFLOAD_MODULES), min_size=1)))
        if "attn_proj" in offload:
            offload.add("core_attn")
        if recompute == "selective":  # Megatron's default selective recompute re-runs the attention core
            offload -= {"core_attn", "attn_proj"}
        fields["offload_modules"] = tuple(offload)
    fields["precision"] = draw(st.sampled_from(space["precisions"]))
    if fmt == "torchtitan" and (zero == 0 or (fields.get("shard_group") or dp * cp) == 1) and (tp > 1 or pp > 1):
        # torchtitan applies bf16 mixed precision through FSDP: TP or PP without it trains in fp32
        # (maybe_enable_amp; said in the header: test_torchtitan_emit_says_bf16_without_fsdp_under_tp_runs_fp32).
        assume(fields["precision"].name != "fsdp-bf16")
    if fmt == "megatron" and not fields.get("reshard_after_forward", True):
        assume(fields["precision"].compute_dtype != "fp16")  # nor torch FSDP2 under fp16
    strategy = Strategy(**fields)
    assume(check_strategy(strategy, model) == [])
    return model, strategy


def comparable(strategy: Strategy, model: ModelSpec) -> dict[str, Any]:
    data = canonical_strategy(strategy, model).model_dump()
    data["precision"].pop("name")  # compare policies by their bytes
    return data


def one_rank_sharding(fmt: str, strategy: Strategy) -> bool:
    """torchtitan's and HyperParallel's FSDP over one rank (dp·cp = 1, or a shard group of 1):
    their degree of 1 runs no FSDP, while ndplan prices it (a MoE model's experts sharded over
    their expert-data-parallel ranks, FSDP's gathers)."""
    return fmt in ("torchtitan", "hyperparallel") and strategy.zero > 0 and (strategy.shard_group or
                                                                               strategy.dp * strategy.cp) == 1


def round_trip(fmt: str, model: ModelSpec, strategy: Strategy) -> Strategy:
    text = emit(model, strategy, fmt)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"config{SUFFIX[fmt]}"
        path.write_text(text)
        result = read_config(path, model=model)
    return result.strategy()


@pytest.mark.parametrize("fmt", list(SPACES))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(fmt: str, data: st.DataObject) -> None:
    model, strategy = data.draw(strategies(fmt))
    if fmt == "megatron":
        # Megatron refuses expert parallelism under fp16, and runs grouped-GEMM experts only under
        # bf16 (test_megatron_launch_passes_megatrons_argument_checks): both said in the header.
        assume(not (strategy.ep > 1 and policy_of_strategy(strategy) == "fp16"))
        assume(not (strategy.ep > 1 and strategy.tp > 1 and not strategy.sequence_parallel))
        # Megatron's optimizer offload runs only with its distributed optimizer (Megatron-FSDP's too).
        assume(not strategy.optimizer_offload or strategy.zero in (1, 2)
               or (strategy.zero == 3 and strategy.reshard_after_forward))
        text = emit(model, strategy, fmt, grouped_gemm=policy_of_strategy(strategy) in ("bf16", "fp8"))
    else:
        text = emit(model, strategy, fmt)
    if one_rank_sharding(fmt, strategy):
        # Said in the header (it once read back as ZeRO-0 silently: mixtral-8x7b dp1 tp8 pp8 ep2
        # etp1 fsdp3, 29.7 GiB priced, 57.2 GiB run); the rest comes back.
        lost = [line for line in text.splitlines() if "not expressible" in line]
        assert len(lost) == 1 and "over one rank" in lost[0] and "read back as ZeRO-0" in lost[0], text
        strategy = strategy.model_copy(update={"zero": 0, "fsdp": False, "shard_group": 0,
                                               "reshard_after_forward": True})
    else:
        assert "not expressible" not in text, text
    assert comparable(round_trip(fmt, model, strategy), model) == comparable(strategy, model)


@pytest.mark.parametrize("name", preset_names())
def test_megatron_model_flags_round_trip(name: str, tmp_path: Path) -> None:
    """Every preset Megatron can express comes back from its flags alone with the same parameters."""
    model = get_preset(name)
    text = emit(model, Strategy(dp=2, micro_batch_size=1, num_micro_batches=2), "megatron")
    path = tmp_path / "run.sh"
    path.write_text(text)
    result = read_config(path)
    assert result.model is not None
    if "not expressible" in text and (model.norm_placement != "pre" or model.qk_norm_width == "projection"):
        # OLMo's and Gemma's norms and OLMo's q/k norms over the projection: said, not written
        assert model.norm_placement == "pre" or f"{model.norm_placement} norms" in text
        assert model.qk_norm_width == "head" or "q/k norms over the whole projection" in text
        return
    if "not expressible" in text:
        assert name.startswith("gpt-oss") and "router bias" in text
        # The rest comes back: gpt-oss's sinks (--softmax-type learnable) and expert biases.
        assert count_parameters(result.model).total == count_parameters(model).total - (
            model.num_moe_layers * model.num_experts if model.router_bias else 0)
        return
    assert count_parameters(result.model).total == count_parameters(model).total
    assert result.model.layer_mlp_kinds == model.layer_mlp_kinds and result.model.mtp_depth == model.mtp_depth
    assert result.model.sliding_window == model.sliding_window  # Mistral's 4,096 keys: --window-size 4095,0
    assert result.model.layer_attention_spans == model.layer_attention_spans
    assert result.model.attention_output_gate == model.attention_output_gate
    # Qwen2-MoE's, Qwen3-Next's and Qwen3.5's shared-expert gate: --moe-shared-expert-gate
    assert result.model.shared_expert_gate == (model.shared_expert_gate and model.num_shared_experts > 0)
    # Dropout stated at 0 (Megatron's defaults are 0.1, whose masks the estimate would then miss).
    assert (result.model.hidden_dropout, result.model.attention_dropout) == (0.0, 0.0)
    assert "--hidden-dropout 0 " in text or "--hidden-dropout 0\n" in text
    assert result.warnings == []


def test_megatron_launch_keeps_dropout_and_the_attention_kernel(tmp_path: Path) -> None:
    """A model with dropout, estimated with eager attention, emits both; read back, the same."""
    model = get_preset("llama-3.1-8b").model_copy(update={"hidden_dropout": 0.1, "attention_dropout": 0.05})
    text = emit(model, Strategy(dp=2, micro_batch_size=1, num_micro_batches=2), "megatron", attention="eager")
    assert "--attention-backend unfused" in text
    path = tmp_path / "run.sh"
    path.write_text(text)
    result = read_config(path)
    assert result.model is not None and (result.model.hidden_dropout, result.model.attention_dropout) == (0.1, 0.05)
    assert result.runtime_settings["attention"] == "eager"
    assert "--attention-backend" not in emit(model, Strategy(dp=2, micro_batch_size=1, num_micro_batches=2), "megatron")


def test_megatron_launch_runs_the_experts_as_priced(tmp_path: Path) -> None:
    """A MoE launch runs its experts as one grouped GEMM, as ndplan prices them by default: the
    launch lacked --moe-grouped-gemm, so it read back as SequentialMLP (0.13 GiB less)."""
    model, strategy = get_preset("qwen3-30b-a3b"), Strategy(dp=2, ep=2, micro_batch_size=1, num_micro_batches=2)
    for grouped in (True, False):
        text = emit(model, strategy, "megatron", grouped_gemm=grouped)
        assert ("--moe-grouped-gemm" in text) is grouped
        path = tmp_path / "run.sh"
        path.write_text(text)
        assert read_config(path).runtime_settings.get("grouped_gemm", True) is grouped


@pytest.mark.parametrize("spans", [("sliding", "sliding", "sliding", "full") * 2, ("full",) * 4 + ("sliding",) * 4])
def test_megatron_window_pattern_round_trips(spans: tuple[str, ...], tmp_path: Path) -> None:
    """A mix of sliding and full layers: --window-size with --window-attn-skip-freq's list."""
    base = get_preset("llama-3.1-8b")
    model = base.model_copy(update={"num_layers": 8, "layer_mlp_kinds": ("dense",) * 8, "sliding_window": 1024,
                                    "layer_attention_spans": spans})
    text = emit(model, Strategy(dp=2, micro_batch_size=1, num_micro_batches=2), "megatron")
    assert "--window-size 1023,0" in text and "--window-attn-skip-freq" in text
    path = tmp_path / "run.sh"
    path.write_text(text)
    read = read_config(path).model
    assert read is not None and read.sliding_window == 1024 and read.layer_attention_spans == spans


def test_megatron_window_skip_frequency_reads_every_nth_layer_full(tmp_path: Path) -> None:
    """--window-attn-skip-freq 4: layers 4, 8, … (1-based) attend in full, as Megatron-Core's."""
    path = tmp_path / "run.sh"
    path.write_text("torchrun pretrain_gpt.py --num-layers 8 --hidden-size 256 --num-attention-heads 4 "
                    "--window-size 127,0 --window-attn-skip-freq 4 --padded-vocab-size 1000 "
                    "--tensor-model-parallel-size 1\n")
    model = read_config(path).model
    assert model is not None and model.sliding_window == 128
    assert model.layer_attention_spans == ("sliding", "sliding", "sliding", "full") * 2
    path.write_text(path.read_text().replace("127,0", "127,5"))
    with pytest.raises(NdplanError, match="only a causal window"):
        read_config(path)
    # Every layer full (skip frequency 1), or TransformerEngine's unlimited window -1: no window at all
    # (a pattern without a sliding layer once came back as every layer sliding).
    for flags in ("--window-size 127,0 --window-attn-skip-freq 1", "--window-size -1,0"):
        path.write_text(path.read_text().replace("--window-size 127,5 --window-attn-skip-freq 4", flags))
        model = read_config(path).model
        assert model is not None and model.sliding_window == 0 and set(model.layer_attention_spans) == {"full"}
        path.write_text(path.read_text().replace(flags, "--window-size 127,5 --window-attn-skip-freq 4"))
    # A pattern is refused before it is built (this one once ran out of memory), and its entries are 0/1.
    for pattern, words in (('"[1]*100000000000"', "pattern of over 100,000 layers"), ('"[2]*8"', "entries are 0 or 1")):
        path.write_text(path.read_text().replace("127,5", "127,0").replace("--window-attn-skip-freq 4",
                                                                          f"--window-attn-skip-freq {pattern}"))
        with pytest.raises(NdplanError, match=re.escape(words)):
            read_config(path)
        path.write_text(path.read_text().replace(f"--window-attn-skip-freq {pattern}", "--window-attn-skip-freq 4"))


def test_megatron_gated_deltanet_flags_read_every_nth_layer_full(tmp_path: Path) -> None:
    """--experimental-attention-variant gated_delta_net with --linear-attention-freq 4: layers 4, 8,
    … (1-based) softmax attention, the others Gated DeltaNet, their widths Megatron-LM's defaults
    where not given; --attention-output-gate doubles q_proj. Without a frequency Megatron-LM
    fails, and so does the reader; a window beside these layers is not modelled."""
    path = tmp_path / "run.sh"
    path.write_text("torchrun pretrain_gpt.py --num-layers 8 --hidden-size 256 --num-attention-heads 4 "
                    "--experimental-attention-variant gated_delta_net --linear-attention-freq 4 "
                    "--linear-num-value-heads 48 --attention-output-gate --padded-vocab-size 1000\n")
    model = read_config(path).model
    assert model is not None and model.layer_attention_spans == ("linear", "linear", "linear", "full") * 2
    assert (model.linear_num_key_heads, model.linear_num_value_heads, model.linear_key_head_dim,
            model.linear_value_head_dim, model.linear_conv_kernel) == (16, 48, 128, 128, 4)
    assert model.attention_output_gate
    text = path.read_text()
    path.write_text(text.replace("--linear-attention-freq 4 ", ""))
    with pytest.raises(NdplanError, match="needs --linear-attention-freq"):
        read_config(path)
    path.write_text(text.replace("--linear-attention-freq 4", "--linear-attention-freq 4 --window-size 127,0"))
    with pytest.raises(NdplanError, match="sliding windows beside Gated DeltaNet layers are not modelled"):
        read_config(path)


@pytest.mark.parametrize("overlap", [
    "megatron", "plain", "megatron,tp=on", "megatron,ep=on,ep_dispatch=node_dedup", "megatron,ep_dispatch=all_to_all",
    "megatron,dp_bucket_params=80000000",
])
def test_megatron_overlap_flags_round_trip(overlap: str, tmp_path: Path) -> None:
    """What the step time was priced hiding is written as Megatron's overlap flags and read back
    as the same switches, for the communication the strategy has."""
    from ndplan.perf import parse_overlap

    model = get_preset("qwen3-30b-a3b")
    # (interleaved: Megatron-Core overlaps the expert all-to-all under a pipeline only with virtual stages)
    strategy = Strategy(dp=4, tp=2, pp=2, vpp=2, schedule="interleaved", ep=4, sequence_parallel=True, zero=1,
                        num_micro_batches=4)
    config = parse_overlap(overlap)
    path = tmp_path / "run.sh"
    path.write_text(emit(model, strategy, "megatron", overlap=config))
    read = parse_overlap(read_config(path).runtime_settings["overlap"])
    assert read is not None
    for switch in ("dp_grad_reduce", "dp_param_gather", "tp", "ep_dispatch", "dp_bucket_params"):
        assert getattr(read, switch) == getattr(config, switch), switch
    assert read.ep is (True if config.ep is True else None)


def test_megatron_softmax_type_reads_sinks(tmp_path: Path) -> None:
    """--softmax-type learnable: a learned sink logit per head (gpt-oss); other kinds are refused by name."""
    path = tmp_path / "run.sh"
    flags = ("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 "
             "--padded-vocab-size 1000 --tensor-model-parallel-size 1 --softmax-type {}\n")
    path.write_text(flags.format("learnable"))
    model = read_config(path).model
    assert model is not None and model.attention_sinks
    assert count_parameters(model).attention == 2 * (4 * 256 * 256 + 4 * 256 + 4)  # q k v o with biases, 4 sinks
    path.write_text(flags.format("off-by-one"))  # Megatron's third kind: no parameter
    model = read_config(path).model
    assert model is not None and not model.attention_sinks
    path.write_text(flags.format("bogus"))
    with pytest.raises(NdplanError, match="--softmax-type.*must be vanilla, off-by-one or learnable"):
        read_config(path)


def test_formats_naming_a_preset_say_when_they_lose_its_window() -> None:
    """torchtitan names a flavour, HyperParallel a Hub repo: a window the named model lacks is
    listed as lost; Mistral's own window travels with its repo's config."""
    strategy = Strategy(dp=2, micro_batch_size=1, num_micro_batches=2)
    base = get_preset("llama-3.1-8b")
    windowed = base.model_copy(update={"sliding_window": 4096, "layer_attention_spans": ("sliding",) * base.num_layers})
    assert "sliding-window attention (32 of 32 layers, 4,096 keys)" in emit(windowed, strategy, "torchtitan")
    assert "sliding-window attention" in emit(windowed, strategy, "hyperparallel")
    assert "sliding-window" not in emit(get_preset("mistral-7b"), strategy, "hyperparallel")
    assert "sliding-window" not in emit(base, strategy, "torchtitan")
    # The other way round: the named model has a window the planned one lacks.
    mistral = get_preset("mistral-7b")
    full = mistral.model_copy(update={"sliding_window": 0, "layer_attention_spans": ("full",) * mistral.num_layers})
    assert ("full attention on every layer: the config of mistralai/Mistral-7B-v0.1 builds mistral-7b's "
            "sliding-window attention (32 of 32 layers, 4,096 keys)") in emit(full, strategy, "hyperparallel")


def test_hyperparallel_says_zero3_without_fsdp_becomes_fsdp() -> None:
    """HyperParallel shards parameters with FSDP only: ZeRO-3 without the fsdp flag (priced the
    same) is written as FSDP, which the header says, as Megatron's and MindFormers' say theirs."""
    model = get_preset("llama-3.1-8b")
    text = emit(model, Strategy(dp=4, zero=3, fsdp=False, precision="fsdp-bf16"), "hyperparallel")
    assert [line for line in text.splitlines() if "not expressible" in line] == [
        "# ndplan: not expressible in HyperParallel, left out: ZeRO-3 without FSDP (HyperParallel shards parameters "
        "with FSDP; priced the same)"]
    assert "not expressible" not in emit(model, Strategy(dp=4, zero=3, fsdp=True, precision="fsdp-bf16"), "hyperparallel")


# ---------------------------------------------------------------- Megatron-LM's argument checks
def megatron_launch(text: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The flags of an emitted launch (as ndplan's reader sees them) and its exported variables."""
    from ndplan.io.common import Source
    from ndplan.io.megatron_args import flag_entries, parse_script

    src = Source(Path("run.sh"))
    entries = flag_entries(src, parse_script(src, text).arguments, [])
    return {flag: arg.values for flag, arg in entries.items()}, dict(re.findall(r"^export (\w+)=(\S+)$", text, re.M))


def megatron_refusals(text: str) -> list[str]:
    """What Megatron-LM's validate_args (megatron/training/arguments.py, NVIDIA/Megatron-LM
    000c4ac) asserts against, for the flags ndplan writes: a launch that trips one stops before
    its first step."""
    flags, env = megatron_launch(text)
    given = flags.__contains__

    def value(flag: str, default: str | None = None) -> str | None:
        return flags[flag][0] if flags.get(flag) else default

    tp, pp, cp, ep = (int(value(flag, "1") or 1) for flag in (
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
        "--expert-model-parallel-size"))
    etp = int(value("--expert-tensor-parallel-size", str(tp)) or tp)
    fsdp = given("--use-torch-fsdp2") or given("--use-megatron-fsdp")
    out = []
    if given("--overlap-param-gather"):
        if not (given("--use-distributed-optimizer") or given("--use-megatron-fsdp")):
            out.append("--overlap-param-gather only supported with distributed optimizer or megatron fsdp")
        if not given("--overlap-grad-reduce"):
            out.append("Must use --overlap-param-gather with --overlap-grad-reduce")
    if given("--use-torch-fsdp2"):
        if pp > 1 or ep > 1:
            out.append("--use-torch-fsdp2 is not supported with pipeline or expert parallelism")
        if given("--use-distributed-optimizer"):
            out.append("--use-torch-fsdp2 is not supported with MCore's distributed optimizer")
        if not given("--no-gradient-accumulation-fusion"):
            out.append("--use-torch-fsdp2 is not supported with gradient accumulation fusion")
        if value("--ckpt-format", "torch_dist") not in ("torch_dist", "torch_dcp"):
            out.append("--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp")
        if not given("--untie-embeddings-and-output-weights"):
            out.append("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
        if given("--fp16"):
            out.append("--use-torch-fsdp2 not supported with fp16 yet")
    if given("--fp8-param-gather") and not (given("--use-distributed-optimizer") or fsdp):
        out.append("--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or "
                   "inference mode")
    if value("--moe-token-dispatcher-type") == "flex" and given("--moe-pad-expert-input-to-capacity"):
        out.append("Flex token dispatcher does not support moe_pad_expert_input_to_capacity")  # TransformerConfig
    # megatron/core/transformer/transformer_config.py, __post_init__ (ETP defaults to TP):
    if given("--num-experts") and not given("--disable-bias-linear") and etp > 1:
        out.append("Bias in Moe is only supported when ETP==1")
    if given("--use-megatron-fsdp") and value("--ckpt-format") != "fsdp_dtensor":
        out.append("Megatron FSDP only supports fsdp_dtensor checkpoint format")
    # megatron/core/distributed/fsdp/mcore_fsdp_adapter.py (00caa53), FullyShardedDataParallel.__init__:
    # an expert data-parallel group (world / (pp·ep·etp); etp defaults to tp) of one rank alone.
    launch = re.search(r"torchrun --nproc_per_node (\d+) --nnodes (\d+)", text)
    world = int(launch.group(1)) * int(launch.group(2)) if launch else 1
    if (given("--use-megatron-fsdp") and given("--num-experts") and not given("--no-gradient-accumulation-fusion")
            and world // (pp * ep * etp) > 1):
        out.append("Megatron-FSDP with gradient_accumulation_fusion does not support data parallelism when expert "
                   "parallelism is enabled.")
    if given("--tp-comm-overlap") and not (given("--sequence-parallel") and tp > 1):
        out.append("Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled")
    if given("--moe-grouped-gemm") and not given("--bf16"):
        out.append("Currently GroupedGEMM for MoE only supports bf16 dtype.")
    if ep > 1 and given("--fp16"):
        out.append("Expert parallelism is not supported with fp16 training.")
    if ep > 1 and tp > 1 and not given("--sequence-parallel"):  # megatron/core/model_parallel_config.py
        out.append("When using expert parallelism and tensor parallelism, sequence parallelism must be used")
    if given("--optimizer-cpu-offload") and not given("--use-precision-aware-optimizer"):
        out.append("The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`")
    if given("--use-precision-aware-optimizer"):  # megatron/core/optimizer/optimizer_config.py, __post_init__
        if value("--optimizer", "adam") != "adam":
            out.append("--use-precision-aware-optimizer only supported with adam")
        if not given("--use-distributed-optimizer"):
            out.append("--use-precision-aware-optimizer only supported with distributed optimizer")
    if value("--recompute-granularity") == "selective" and given("--recompute-method"):
        out.append("recompute method is not yet supported for selective recomputing granularity")
    # megatron/core/transformer/transformer_config.py, __post_init__:
    modules = set(flags.get("--recompute-modules", ["core_attn"])) if value("--recompute-granularity") == "selective" \
        else set()
    if "moe_act" in modules and not given("--moe-grouped-gemm"):
        out.append("moe_act in recompute_modules is only supported with moe_grouped_gemm.")
    if "mla_up_proj" in modules and not given("--multi-latent-attention"):
        out.append("mla_up_proj in recompute_modules is only supported with multi_latent_attention.")
    if given("--fp8-format") and {"moe_act", "layernorm"} & modules and value("--fp8-recipe", "delayed") == "delayed":
        out.append("Delayed scaling does not support moe_act and layernorm recompute for fp8.")
    if given("--overlap-moe-expert-parallel-comm"):  # TransformerConfig.__post_init__
        from ndplan.io.megatron import parse_layout

        layout = value("--pipeline-model-parallel-layout")
        virtual = (given("--num-layers-per-virtual-pipeline-stage") or given("--num-virtual-stages-per-pipeline-rank")
                   or given("--schedules-method") or (layout is not None and len(parse_layout(layout)) > pp))
        if pp > 1 and not virtual:
            out.append("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
                       "pipeline_model_parallel_size > 1")
        if ep == 1:
            out.append("overlap_moe_expert_parallel_comm is only supported with expert model parallelism")
        if value("--moe-token-dispatcher-type", "allgather") not in ("alltoall", "flex"):
            out.append("overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher")
        if value("--recompute-granularity") == "full" or given("--recompute-method"):
            out.append("disable full recomputation when enabling overlap_moe_expert_parallel_comm")
        if not (given("--bf16") or given("--fp16")):
            out.append("overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model")
        if int(value("--mtp-num-layers", "0") or 0) > 1:
            out.append("MTP layernum only supports 1 when enabling overlap_moe_expert_parallel_comm.")
        if "moe" in modules:
            out.append("disable moe recompute when enabling overlap_moe_expert_parallel_comm")
    # Megatron-Core's TransformerConfig under Transformer Engine 2.10 and later (Megatron-Bridge's
    # and the MoE model zoo's launches export it beside --fine-grained-activation-offloading).
    if given("--fine-grained-activation-offloading") and env.get("NVTE_CPU_OFFLOAD_V1") != "1":
        out.append("fine-grained activation offloading needs NVTE_CPU_OFFLOAD_V1=1")
    if fsdp and env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        out.append("FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one")
    if (tp > 1 or cp > 1) and not fsdp and not given("--overlap-moe-expert-parallel-comm") \
            and env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        out.append("Using tensor model parallelism or context parallelism require setting the environment "
                   "variable CUDA_DEVICE_MAX_CONNECTIONS to 1")
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_megatron_launch_passes_megatrons_argument_checks(data: st.DataObject) -> None:
    """A written launch runs past Megatron's argument checks (each one an assert in validate_args),
    with the overlap the step time was priced with; what Megatron refuses outright (expert
    parallelism under fp16) is said in the header."""
    from ndplan.perf import parse_overlap

    model, strategy = data.draw(strategies("megatron"))
    overlap = parse_overlap(data.draw(st.sampled_from(
        ("megatron", "plain", "megatron,tp=on", "megatron,dp_grad_reduce=off", "megatron,ep=on"))))
    if strategy.recompute == "selective" and data.draw(st.booleans()):
        modules = data.draw(st.sets(st.sampled_from(RECOMPUTE_MODULES), min_size=1))
        with_modules = strategy.model_copy(update={"recompute_modules": tuple(sorted(modules))})
        if check_strategy(with_modules, model) == []:
            strategy = with_modules
    text = emit(model, strategy, "megatron", overlap, grouped_gemm=data.draw(st.booleans()))
    refused = megatron_refusals(text)
    if strategy.ep > 1 and policy_of_strategy(strategy) == "fp16":
        assert "Expert parallelism is not supported with fp16 training." in refused
        assert "Megatron-LM refuses expert parallelism under --fp16" in text, text
        refused.remove("Expert parallelism is not supported with fp16 training.")
    if strategy.ep > 1 and strategy.tp > 1 and not strategy.sequence_parallel:
        why = "When using expert parallelism and tensor parallelism, sequence parallelism must be used"
        assert why in refused
        assert "Megatron-Core refuses expert and tensor parallelism without sequence parallelism" in text, text
        refused.remove(why)
    why = "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or inference mode"
    if why in refused:  # fp8 weights without ZeRO: said, written as planned
        assert policy_of(strategy.precision).fp8_params and strategy.zero == 0, text
        assert "fp8 weights (--fp8-param-gather)" in text, text
        refused.remove(why)
    why = "Bias in Moe is only supported when ETP==1"
    if why in refused:  # a MoE model with linear biases over expert TP: said, written as planned
        assert model.biases_beyond_qkv and strategy.etp > 1 and "Bias in Moe is only supported when ETP==1" in text, text
        refused.remove(why)
    why = "--use-precision-aware-optimizer only supported with distributed optimizer"
    if why in refused:  # optimizer offload without the distributed optimizer: said, written as planned
        assert strategy.optimizer_offload and "without the distributed optimizer" in text, text
        refused.remove(why)
    assert refused == [], text
    # The fusion is off exactly where Megatron refuses it, by the rule the step time prices with.
    fused = "\n".join(line for line in text.splitlines() if "--no-gradient-accumulation-fusion" not in line)
    refuses_fusion = any("gradient accumulation fusion" in why or "gradient_accumulation_fusion" in why
                         for why in megatron_refusals(fused))
    assert refuses_fusion == ("    --no-gradient-accumulation-fusion" in text), text
    assert refuses_fusion == (strategy_code(model, strategy, policy_of_strategy(strategy) == "fp16", False) > 0), text


def policy_of_strategy(strategy: Strategy) -> str:
    from ndplan.io.common import policy_of

    return policy_of(strategy.precision).compute_dtype


def test_megatron_module_offload_exports_transformer_engines_v1_offload() -> None:
    """Megatron's fine-grained activation offloading runs Transformer Engine's v1 offload path,
    which its newer releases assert (NVTE_CPU_OFFLOAD_V1=1, as Megatron-Bridge's recipes and the
    MoE model zoo's launcher export): the launch exports it, and only then."""
    model = get_preset("qwen3-30b-a3b")
    offloaded = emit(model, Strategy(dp=8, ep=8, offload_modules=("expert_fc1",), num_micro_batches=2), "megatron")
    assert "export NVTE_CPU_OFFLOAD_V1=1" in offloaded and megatron_refusals(offloaded) == []
    assert megatron_refusals(offloaded.replace("export NVTE_CPU_OFFLOAD_V1=1", "")) == [
        "fine-grained activation offloading needs NVTE_CPU_OFFLOAD_V1=1"]
    assert "NVTE_CPU_OFFLOAD_V1" not in emit(model, Strategy(dp=8, ep=8, num_micro_batches=2), "megatron")


def test_megatron_deepep_launch_with_a_capacity_factor_does_not_pad() -> None:
    """Token dropping priced with DeepEP's deduplicated dispatch: Megatron-Core's flex dispatcher
    refuses padding to capacity, so the launch writes the capacity factor alone and says that
    each expert then gets at most its capacity (priced padded, an upper bound); the all-to-all
    dispatcher pads. Read back, both price the same padded buffers."""
    from ndplan.perf import parse_overlap

    model = get_preset("qwen3-30b-a3b")
    s = Strategy(dp=8, ep=8, num_micro_batches=2)
    deepep = emit(model, s, "megatron", parse_overlap("megatron,ep_dispatch=node_dedup"), moe_capacity_factor=1.25)
    assert "--moe-token-dispatcher-type flex" in deepep and "--moe-expert-capacity-factor 1.25" in deepep
    assert "--moe-pad-expert-input-to-capacity" not in deepep.replace(
        "# ndplan: --moe-pad-expert-input-to-capacity left out", "")
    assert "each expert then gets at most its capacity, priced as padded to it (an upper bound)" in deepep
    assert megatron_refusals(deepep) == []
    a2a = emit(model, s, "megatron", parse_overlap("megatron"), moe_capacity_factor=1.25)
    assert "    --moe-pad-expert-input-to-capacity" in a2a and megatron_refusals(a2a) == []
    padded = deepep.replace("    --moe-expert-capacity-factor 1.25", "    --moe-expert-capacity-factor 1.25\n"
                            "    --moe-pad-expert-input-to-capacity")
    assert megatron_refusals(padded) == ["Flex token dispatcher does not support moe_pad_expert_input_to_capacity"]


def test_megatron_fsdp_with_expert_data_parallelism_turns_gradient_accumulation_fusion_off() -> None:
    """Megatron-Core's Megatron-FSDP refuses gradient-accumulation fusion beside expert data
    parallelism, and MindSpeed's runs without it: the launch turns it off there and says what
    that costs; a dense model on GPUs, or experts with no expert data parallelism, keep it."""
    moe = get_preset("qwen3-30b-a3b")
    spread = Strategy(dp=16, ep=8, zero=3, fsdp=True, num_micro_batches=1)
    text = emit(moe, spread, "megatron")
    assert "--no-gradient-accumulation-fusion" in text and megatron_refusals(text) == []
    assert ("--no-gradient-accumulation-fusion: Megatron-Core's Megatron-FSDP refuses gradient-accumulation fusion "
            "beside expert data parallelism (2 ranks)") in text
    fused = "\n".join(line for line in text.splitlines() if "--no-gradient-accumulation-fusion" not in line)
    assert megatron_refusals(fused) == ["Megatron-FSDP with gradient_accumulation_fusion does not support data "
                                        "parallelism when expert parallelism is enabled."]
    for model, s in ((moe, Strategy(dp=8, ep=8, zero=3, fsdp=True, num_micro_batches=1)),
                     (get_preset("llama-3.1-8b"), Strategy(dp=8, zero=3, fsdp=True, num_micro_batches=1))):
        assert "--no-gradient-accumulation-fusion" not in emit(model, s, "megatron")
    npu = emit(get_preset("llama-3.1-8b"), Strategy(dp=8, zero=3, fsdp=True, num_micro_batches=1), "megatron",
               device_runtime="cann")
    assert "MindSpeed's Megatron-FSDP runs without gradient-accumulation fusion" in npu
    assert "    --no-gradient-accumulation-fusion" in npu


def test_megatron_torch_fsdp2_only_where_megatron_runs_it(tmp_path: Path) -> None:
    """FSDP that keeps parameters gathered after forward is torch FSDP2 in Megatron, which runs
    only without gradient-accumulation fusion, untied, outside fp16, and over the whole
    data-parallel group (Megatron builds its mesh from dp·cp: no HSDP); elsewhere the launch is
    Megatron-FSDP (which reshards), said in the header."""
    model = get_preset("llama-3.1-8b")
    fsdp2 = Strategy(dp=8, zero=3, fsdp=True, reshard_after_forward=False, num_micro_batches=2)
    text = emit(model, fsdp2, "megatron")
    assert "--use-torch-fsdp2" in text and "--no-gradient-accumulation-fusion" in text
    assert "not expressible" not in text and megatron_refusals(text) == []
    tied = model.model_copy(update={"tie_word_embeddings": True})
    for variant, strategy, words in (
        (tied, fsdp2, "tied embeddings"),
        (model, fsdp2.model_copy(update={"precision": "megatron-fp16"}), "fp16"),
        (model, fsdp2.model_copy(update={"shard_group": 4}), "shard group"),
    ):
        text = emit(variant, strategy, "megatron")
        assert "--use-torch-fsdp2" not in text and "--use-megatron-fsdp" in text, words
        lost = [line for line in text.splitlines() if "not expressible" in line]
        assert len(lost) == 1 and "without resharding after forward" in lost[0] and words in lost[0], lost
        assert megatron_refusals(text) == [], text
    # Reading: torch FSDP2 shards over all of dp·cp, whatever --num-distributed-optimizer-instances says.
    path = tmp_path / "run.sh"
    path.write_text(emit(model, fsdp2, "megatron").replace(
        "--use-torch-fsdp2", "--use-torch-fsdp2 --num-distributed-optimizer-instances 2"))
    result = read_config(path)
    assert result.strategy().shard_group == 0
    assert any("--num-distributed-optimizer-instances 2" in w and "torch FSDP2" in w for w in result.warnings)


def test_megatron_reader_names_the_overlap_megatron_refuses(tmp_path: Path) -> None:
    """--overlap-param-gather without --overlap-grad-reduce or a sharded optimizer, and
    --tp-comm-overlap without --sequence-parallel, stop Megatron at its argument check: each is
    a warning naming the flag and its line."""
    path = tmp_path / "run.sh"
    base = ("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 "
            "--padded-vocab-size 1000 --tensor-model-parallel-size 2 --micro-batch-size 1 --seq-length 128 {}\n")
    for flags, words in (
        ("--use-distributed-optimizer --overlap-param-gather", "without --overlap-grad-reduce"),
        ("--overlap-grad-reduce --overlap-param-gather", "without --use-distributed-optimizer or --use-megatron-fsdp"),
        ("--tp-comm-overlap", "without --sequence-parallel"),
    ):
        path.write_text(base.format(flags))
        warnings = read_config(path).warnings
        assert any(w.startswith(f"{path}:1:") and "Megatron-LM refuses" in w and words in w for w in warnings), warnings
    path.write_text(base.format("--sequence-parallel --tp-comm-overlap --use-distributed-optimizer "
                                "--overlap-grad-reduce --overlap-param-gather"))
    assert not [w for w in read_config(path).warnings if "refuses" in w]


def test_megatron_reader_names_an_expert_overlap_without_ep_or_an_all_to_all(tmp_path: Path) -> None:
    """TransformerConfig asserts --overlap-moe-expert-parallel-comm only with expert parallelism
    and the alltoall or flex dispatcher: the reader warned of neither (allgather, Megatron's
    default dispatcher, and ep 1 went through as an overlap priced on)."""
    path = tmp_path / "run.sh"
    base = ("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 "
            "--padded-vocab-size 1000 --num-experts 8 --moe-router-topk 2 --bf16 --micro-batch-size 1 "
            "--seq-length 128 --overlap-moe-expert-parallel-comm {}\n")
    for flags, words in (("--expert-model-parallel-size 2", "--moe-token-dispatcher-type allgather (Megatron's default)"),
                         ("--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather",
                          "--moe-token-dispatcher-type allgather: "),
                         ("--moe-token-dispatcher-type alltoall", "--expert-model-parallel-size 1")):
        path.write_text(base.format(flags))
        warnings = read_config(path).warnings
        assert any("--overlap-moe-expert-parallel-comm with " + words in w and "Megatron-Core refuses" in w
                   for w in warnings), (flags, warnings)
    path.write_text(base.format("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"))
    assert not [w for w in read_config(path).warnings if "--overlap-moe-expert-parallel-comm" in w]


@pytest.mark.parametrize("stage_layers", [(0, 16, 16, 0), (0, 32), (16, 16, 0), (1, 15, 15, 1)])
def test_megatron_uneven_edges_are_written_as_megatron_core_takes_them(stage_layers: tuple[int, ...],
                                                                       tmp_path: Path) -> None:
    """Megatron-Core refuses --decoder-first/last-pipeline-num-layers 0 ("must be larger than 0",
    TransformerConfig): a stage that holds no decoder layer is written in the layout instead,
    and reads back as planned."""
    model = get_preset("llama-3.1-8b")
    strategy = Strategy(pp=len(stage_layers), stage_layers=stage_layers, num_micro_batches=8)
    assert check_strategy(strategy, model) == []
    text = emit(model, strategy, "megatron")
    flags, _ = megatron_launch(text)
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        assert int(flags.get(flag, ["1"])[0]) > 0, text
    path = tmp_path / "run.sh"
    path.write_text(text)
    assert comparable(read_config(path).strategy(), model) == comparable(strategy, model)


def test_megatron_reader_refuses_the_edges_megatron_core_refuses(tmp_path: Path) -> None:
    """--decoder-first/last-pipeline-num-layers must be > 0 and do not mix with the
    embedding/loss accounting (TransformerConfig raises for both): errors naming the flag."""
    path = tmp_path / "run.sh"
    base = ("torchrun --nproc_per_node 4 pretrain_gpt.py --num-layers 8 --hidden-size 256 --num-attention-heads 4 "
            "--padded-vocab-size 1000 --pipeline-model-parallel-size 4 --micro-batch-size 1 --seq-length 128 {}\n")
    for flags, words in (
        ("--decoder-first-pipeline-num-layers 0", "--decoder-first-pipeline-num-layers: must be >= 1"),
        ("--decoder-last-pipeline-num-layers 0 --decoder-first-pipeline-num-layers 4",
         "--decoder-last-pipeline-num-layers: must be >= 1"),
        ("--decoder-first-pipeline-num-layers 2 --account-for-embedding-in-pipeline-split",
         "--decoder-first-pipeline-num-layers: Megatron-Core does not mix it with "
         "--account-for-embedding-in-pipeline-split"),
        ("--decoder-last-pipeline-num-layers 2 --account-for-loss-in-pipeline-split",
         "--decoder-last-pipeline-num-layers: Megatron-Core does not mix it with --account-for-loss-in-pipeline-split"),
    ):
        path.write_text(base.format(flags))
        with pytest.raises(NdplanError, match=re.escape(f"{path}:1: {words}")):
            read_config(path)


def test_megatron_reader_names_expert_and_tensor_parallelism_without_sp(tmp_path: Path) -> None:
    """Megatron-Core's ModelParallelConfig raises for EP > 1 with TP > 1 and no sequence parallelism."""
    path = tmp_path / "run.sh"
    text = ("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 "
            "--padded-vocab-size 1000 --num-experts 8 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
            "--micro-batch-size 1 --seq-length 128 {}\n")
    path.write_text(text.format(""))
    assert any(w.startswith(f"{path}:1: --expert-model-parallel-size 2") and "Megatron-Core refuses" in w
               for w in read_config(path).warnings)
    path.write_text(text.format("--sequence-parallel"))
    assert not [w for w in read_config(path).warnings if "refuses" in w]


def test_experts_under_tensor_parallelism_without_sequence_parallelism_are_refused(tmp_path: Path) -> None:
    """MoELayer.forward raises in training where tp > 1 without sequence parallelism, whatever the
    expert parallelism (ModelParallelConfig already refuses it with ep > 1): the reader warns and
    --emit megatron says the launch stops; a dense model, or SP on, is fine."""
    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 128 --padded-vocab-size 256 --micro-batch-size 1 --global-batch-size 8 --bf16 "
            "--tensor-model-parallel-size 2 ")
    moe = "--num-experts 8 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-grouped-gemm "
    refused = "without --sequence-parallel on a model with experts: Megatron-Core's MoE layer refuses"
    for flags, expected in ((moe, True), (moe + "--sequence-parallel", False), ("", False)):
        script.write_text(base + flags + "\n")
        result = read_config(script, devices=2)
        assert any(refused in w for w in result.warnings) == expected, flags
        assert ("Megatron-LM will refuse this launch: experts with tp=2 without sequence parallelism"
                in emit(result.model, result.strategy(), "megatron")) == expected, flags


@pytest.mark.parametrize("name, seq", [("llama-2-7b", 8192), ("kimi-k2", 4096), ("llama-3.1-8b", 8192)])
def test_megatron_max_position_embeddings_covers_the_sequence(name: str, seq: int, tmp_path: Path) -> None:
    """validate_args requires --max-position-embeddings (required_args) and asserts it is at least
    --seq-length; with RoPE it sizes no table, so the launch states the larger of the two, and
    the model reads back with the same parameters."""
    model = get_preset(name)
    strategy = Strategy(dp=64, ep=64 if model.is_moe else 1, seq_length=seq, micro_batch_size=1, num_micro_batches=1)
    text = emit(model, strategy, "megatron")
    flags, _ = megatron_launch(text)
    assert "--max-position-embeddings" in flags, text
    assert int(flags["--max-position-embeddings"][0]) == max(seq, model.max_position_embeddings)
    path = tmp_path / "run.sh"
    path.write_text(text)
    result = read_config(path, model=model)
    assert result.model is not None and count_parameters(result.model).total == count_parameters(model).total
    assert not [w for w in result.warnings if "max_position" in w], result.warnings


def test_megatron_recompute_modules_megatron_core_runs(tmp_path: Path) -> None:
    """TransformerConfig raises for moe_act without --moe-grouped-gemm, mla_up_proj without MLA,
    and moe_act/layernorm under fp8's delayed scaling: the launch leaves the first two out (said)
    and writes per-tensor current scaling for the third; the reader warns for each."""
    mixtral, llama = get_preset("mixtral-8x7b"), get_preset("llama-3.1-8b")
    selective = Strategy(dp=8, ep=8, recompute="selective", recompute_modules=("layernorm", "moe_act"))
    text = emit(mixtral, selective, "megatron", grouped_gemm=False)
    assert "--recompute-modules layernorm\n" in text and "left out: recompute module moe_act" in text
    assert megatron_refusals(text) == []
    text = emit(llama, Strategy(dp=8, recompute="selective", recompute_modules=("mla_up_proj",)), "megatron")
    assert "--recompute-granularity" not in text and "mla_up_proj without multi-latent attention" in text
    fp8 = selective.model_copy(update={"precision": "megatron-fp8"})
    text = emit(mixtral, fp8, "megatron")
    assert "--fp8-recipe tensorwise" in text and megatron_refusals(text) == []
    path = tmp_path / "run.sh"
    path.write_text(text)
    assert read_config(path).strategy().recompute_modules == ("layernorm", "moe_act")
    # Reading: each refusal is a warning at the --recompute-modules line.
    for old, new, words in (
        ("    --moe-grouped-gemm\n", "", "moe_act without --moe-grouped-gemm"),
        ("    --fp8-recipe tensorwise\n", "", "under --fp8-format with delayed scaling"),
    ):
        path.write_text(text.replace(old, new))
        warnings = read_config(path).warnings
        assert any("--recompute-modules" in w and words in w and "Megatron-Core refuses" in w for w in warnings), warnings


def test_megatron_expert_overlap_only_where_megatron_core_runs_it(tmp_path: Path) -> None:
    """--overlap-moe-expert-parallel-comm: TransformerConfig refuses it beside full recompute, a
    pipeline without virtual stages, fp32 and more than one MTP layer; the launch leaves it out
    there (said), and the reader warns at its line."""
    from ndplan.perf import parse_overlap

    model = get_preset("mixtral-8x7b")
    ep_on = parse_overlap("megatron,ep=on")
    runs = Strategy(dp=8, ep=8, pp=2, vpp=2, schedule="interleaved", num_micro_batches=4)
    assert "--overlap-moe-expert-parallel-comm" in megatron_launch(emit(model, runs, "megatron", ep_on))[0]
    for update, words in (({"recompute": "full"}, "with full recompute"),
                          ({"vpp": 1, "schedule": "1f1b"}, "with a pipeline of one chunk per stage"),
                          ({"precision": "fp32"}, "outside bf16/fp16")):
        text = emit(model, runs.model_copy(update=update), "megatron", ep_on)
        assert "--overlap-moe-expert-parallel-comm" not in megatron_launch(text)[0]
        assert f"expert all-to-all overlapped {words}" in text
        assert megatron_refusals(text) == []
    path = tmp_path / "run.sh"
    text = emit(model, runs.model_copy(update={"recompute": "full"}), "megatron")
    path.write_text(text.replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 2 "
                                                                      "--overlap-moe-expert-parallel-comm"))
    warnings = read_config(path).warnings
    assert any("--overlap-moe-expert-parallel-comm with --recompute-granularity full" in w for w in warnings), warnings


def test_megatron_squared_relu_with_biases_runs_without_the_gelu_fusion(tmp_path: Path) -> None:
    """TransformerConfig refuses bias_activation_fusion (--bias-gelu-fusion, on by default and off
    only without biases) for an activation other than gelu, swiglu or quick_geglu: a squared-ReLU
    model with biases gets --no-bias-gelu-fusion, which reads back as the same model."""
    base = get_preset("llama-3.1-8b")
    relu2 = base.model_copy(update={"activation": "relu2", "gated_mlp": False, "qkv_bias": True, "o_bias": True,
                                    "mlp_bias": True, "expert_bias": True})
    text = emit(relu2, Strategy(dp=8), "megatron")
    flags, _ = megatron_launch(text)
    assert "--squared-relu" in flags and "--disable-bias-linear" not in flags and "--no-bias-gelu-fusion" in flags
    path = tmp_path / "run.sh"
    path.write_text(text)
    result = read_config(path, model=relu2)
    assert result.warnings == [] and result.model == relu2
    without = relu2.model_copy(update={"qkv_bias": False, "o_bias": False, "mlp_bias": False, "expert_bias": False})
    assert "--no-bias-gelu-fusion" not in megatron_launch(emit(without, Strategy(dp=8), "megatron"))[0]


def test_megatron_precision_aware_optimizer_needs_the_distributed_optimizer_and_adam(tmp_path: Path) -> None:
    """Megatron-Core's OptimizerConfig asserts the distributed optimizer and Adam for
    --use-precision-aware-optimizer, which --optimizer-cpu-offload needs: a launch that cannot
    have them says so in its header, and the reader warns."""
    model = get_preset("llama-3.1-8b")
    offload = Strategy(dp=8, zero=0, optimizer_offload=True)
    text = emit(model, offload, "megatron")
    assert "optimizer offload without the distributed optimizer: Megatron-Core runs its precision-aware" in text
    assert "not expressible" not in emit(model, offload.model_copy(update={"zero": 1}), "megatron")
    one_state = PrecisionPolicy(name="megatron-bf16-sgd", param_bytes=2, grad_bytes=4, master_weight_bytes=4,
                                optimizer_state_bytes=4, optimizer_states=1)
    text = emit(model, offload.model_copy(update={"zero": 1, "precision": one_state}), "megatron")
    assert "with one optimizer state (--optimizer sgd): Megatron-Core runs its precision-aware optimizer only" in text
    path = tmp_path / "run.sh"
    path.write_text(text.replace("    --use-distributed-optimizer\n", ""))
    warnings = read_config(path).warnings
    for words in ("--use-precision-aware-optimizer without --use-distributed-optimizer",
                  "--use-precision-aware-optimizer with --optimizer sgd"):
        assert any(words in w and "Megatron-Core" in w for w in warnings), warnings
