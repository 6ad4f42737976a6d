"""Write a strategy (and the model) as a Megatron-LM launch: bash arrays of flags and a torchrun line,
the style of Megatron-LM's own example scripts. What Megatron cannot express is listed in a
comment at the top instead of being dropped silently.
"""

from __future__ import annotations

import shlex
from typing import Any

from ndplan import __version__
from ndplan.io.common import canonical_placement, layer_counts, policy_of
from ndplan.io.megatron import MINDSPEED_ONLY
from ndplan.model.heads import rank_kv_heads, ulysses_kv_repeat
from ndplan.model.spec import ModelSpec
from ndplan.perf.accumulation import (
    MEGATRON_FSDP_EXPERT_DP,
    MEGATRON_FSDP_NPU,
    TORCH_FSDP2,
    expert_data_parallel,
    strategy_code,
    unfused_reason,
)
from ndplan.strategy.strategy import Strategy

Flags = list[tuple[str, Any]]  # (flag, value or None for a switch)


def _layout(counts: tuple[int, ...], mtp: int) -> str:
    """--pipeline-model-parallel-layout for per-stage decoder counts (model order)."""
    stages = []
    for i, count in enumerate(counts):
        text = ("E" if i == 0 else "") + ("t*" + str(count) if count > 1 else "t" * count)
        if i == len(counts) - 1:
            text += ("m*" + str(mtp) if mtp > 1 else "m" * mtp) + "L"
        stages.append(text)
    out: list[str] = []
    i = 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[i] and "E" not in stages[i] and "L" not in stages[i]:
            j += 1
        run = j - i + 1
        out.append(f"({stages[i]}|)*{run}" if run > 1 else stages[i] + "|")
        i = j + 1
    return "".join(out).rstrip("|")


def _placement(s: Strategy, model: ModelSpec | None, lost: list[str]) -> Flags:
    flags: Flags = []
    if s.schedule == "dualpipev":
        flags.append(("--schedules-method", "dualpipev"))
        if model is None and (s.stage_layers is not None or s.embedding_as_layer or s.output_as_layer):
            lost.append("the layer placement under DualPipeV without the model (MindSpeed splits evenly; with the "
                        "model, no-op layers pad it)")
        return flags
    if s.pp == 1:
        return flags
    if model is None:
        if s.stage_layers is not None:
            flags.append(("--pipeline-model-parallel-layout", _layout(tuple(s.stage_layers), 0)))
            return flags
        if s.vpp > 1:
            flags.append(("--num-virtual-stages-per-pipeline-rank", s.vpp))
        if s.embedding_as_layer:
            flags.append(("--account-for-embedding-in-pipeline-split", None))
        if s.output_as_layer:
            flags.append(("--account-for-loss-in-pipeline-split", None))
        return flags
    layers = model.num_layers
    counts = layer_counts(s, layers)
    stage_layers, emb, out = canonical_placement(counts, layers, s.pp, s.vpp)
    units = layers + int(emb) + int(out)
    stages = s.pp * s.vpp
    if stage_layers is None and units % stages == 0:
        # Megatron's own even split (it asserts divisibility), with the embedding/loss accounting.
        if emb:
            flags.append(("--account-for-embedding-in-pipeline-split", None))
        if out:
            flags.append(("--account-for-loss-in-pipeline-split", None))
        if s.vpp > 1:
            flags.append(("--num-layers-per-virtual-pipeline-stage", units // stages))
        return flags
    middle = counts[1:-1]
    # Megatron-Core takes only edge counts > 0 (TransformerConfig); an empty edge goes in the layout.
    if s.vpp == 1 and (not middle or len(set(middle)) == 1) and counts[0] > 0 and counts[-1] > 0:
        first, last = counts[0], counts[-1]
        flags.append(("--decoder-first-pipeline-num-layers", first))
        flags.append(("--decoder-last-pipeline-num-layers", last))
        return flags
    flags.append(("--pipeline-model-parallel-layout", _layout(counts, model.mtp_depth)))
    return flags


#: MindSpeed's --context-parallel-algo for each kind: MindSpeed picks its attention by it, and
#: leaves Megatron's --cp-comm-type unread.
_MINDSPEED_CP_ALGOS = {"ring": "megatron_cp_algo", "ulysses": "ulysses_cp_algo", "hybrid": "hybrid_cp_algo",
                       "allgather": "kvallgather_cp_algo"}


def _parallel(s: Strategy, model: ModelSpec | None, lost: list[str], refused: list[str], npu: bool = False) -> Flags:
    flags: Flags = [("--tensor-model-parallel-size", s.tp), ("--pipeline-model-parallel-size", s.pp)]
    if s.schedule in ("gpipe", "zb-h1", "zbv", "seq1f1b"):
        lost.append(f"schedule {s.schedule!r} (Megatron-LM runs 1F1B, interleaved 1F1B, or MindSpeed's DualPipeV)")
    if s.seq_chunks > 1:
        lost.append(f"seq_chunks={s.seq_chunks}")
    if s.pipeline_runs > 1:
        lost.append(f"pipeline_runs={s.pipeline_runs} (Megatron schedules all of a step's micro-batches in one "
                    "pipeline run)")
    flags += _placement(s, model, lost)
    if s.cp > 1 and npu:
        flags += [("--context-parallel-size", s.cp), ("--context-parallel-algo", _MINDSPEED_CP_ALGOS[s.cp_kind])]
        if s.cp_kind == "hybrid":
            flags.append(("--ulysses-degree-in-cp", s.ulysses_degree))
    elif s.cp > 1:
        flags.append(("--context-parallel-size", s.cp))
        if s.cp_kind == "ring":
            flags.append(("--cp-comm-type", "p2p"))
        elif s.cp_kind == "ulysses":
            flags.append(("--cp-comm-type", "a2a"))
        elif s.cp_kind == "allgather":
            flags.append(("--cp-comm-type", "allgather"))
        else:
            flags.append(("--cp-comm-type", "a2a+p2p"))
            flags.append(("--hierarchical-context-parallel-sizes", f"{s.ulysses_degree} {s.cp // s.ulysses_degree}"))
        if model is not None and ulysses_kv_repeat(model, s.tp, s.ulysses_ranks) > 1:
            refused.append(f"a Ulysses group of {s.ulysses_ranks} ranks over the {int(rank_kv_heads(model, s.tp))} KV head(s) "
                           f"a tensor-parallel rank holds: Transformer Engine's all-to-all attention asserts whole "
                           "heads ('The number of attention heads needs to be divisible by CP size!'); MindSpeed on "
                           "Ascend NPUs repeats them to the query heads first, as priced")
    if s.ep > 1:
        flags.append(("--expert-model-parallel-size", s.ep))
        if s.tp > 1 and not s.sequence_parallel:
            # megatron/core/model_parallel_config.py raises for this pair.
            refused.append(f"ep={s.ep} with tp={s.tp} without sequence parallelism: Megatron-Core refuses expert and "
                           "tensor parallelism without sequence parallelism (ModelParallelConfig); written as planned, "
                           "the launch stops building its config")
    elif model is not None and model.is_moe and s.tp > 1 and not s.sequence_parallel:
        # MoELayer.forward raises in training for tensor parallelism without sequence parallelism.
        refused.append(f"experts with tp={s.tp} without sequence parallelism: Megatron-Core's MoE layer refuses to "
                       "train under tensor parallelism without sequence parallelism (MoELayer.forward); written as "
                       "planned, the launch stops at its first forward")
    if s.etp != s.tp:
        flags.append(("--expert-tensor-parallel-size", s.etp))
    if model is not None and model.is_moe and model.biases_beyond_qkv and s.etp > 1:
        refused.append(f"etp={s.etp} with the model's linear biases (add_bias_linear): Megatron-Core's "
                       "TransformerConfig asserts 'Bias in Moe is only supported when ETP==1'; written as planned, the "
                       "launch stops building its config")
    if s.sequence_parallel:
        flags.append(("--sequence-parallel", None))
    return flags


def _torch_fsdp2_refusal(s: Strategy, model: ModelSpec | None) -> str | None:
    """Why Megatron cannot run this strategy's FSDP as torch FSDP2 (the only Megatron FSDP that
    keeps parameters gathered after forward), or None where it can. validate_args
    (megatron/training/arguments.py) refuses --use-torch-fsdp2 beside a pipeline or experts,
    with tied embeddings and under fp16; Megatron's wrapper (core/distributed/
    torch_fully_sharded_data_parallel.py) shards over the whole dp·cp group, so no HSDP."""
    if s.pp > 1 or s.ep > 1:
        return "together with pipeline or expert parallelism"
    if model is not None and model.tie_word_embeddings:
        return "with tied embeddings (it needs --untie-embeddings-and-output-weights)"
    if policy_of(s.precision).compute_dtype == "fp16":
        return "under fp16"
    if s.shard_group:
        return f"with a shard group of {s.shard_group} (it shards over the whole dp·cp group)"
    return None


def _fp16(s: Strategy) -> bool:
    return policy_of(s.precision).compute_dtype == "fp16"


def _uses_torch_fsdp2(s: Strategy, model: ModelSpec | None) -> bool:
    """Whether Megatron runs this strategy's FSDP as torch FSDP2 (``perf.accumulation``'s rule,
    which the step time prices by; ``_torch_fsdp2_refusal`` says why not in words)."""
    return strategy_code(model, s, _fp16(s), npu=False) == TORCH_FSDP2


def _megatron_fsdp_fusion_refusal(s: Strategy, model: ModelSpec | None, npu: bool) -> str | None:
    """Why a Megatron-FSDP launch of ``s`` must turn gradient-accumulation fusion off (on by
    default), or None where it runs with it (``perf.accumulation``: Megatron-Core's
    FullyShardedDataParallel refuses the fusion beside expert data parallelism; MindSpeed's
    Megatron-FSDP guide runs without it)."""
    code = strategy_code(model, s, _fp16(s), npu)
    if code in (MEGATRON_FSDP_EXPERT_DP, MEGATRON_FSDP_NPU):
        return unfused_reason(code, expert_data_parallel(s))
    return None


def _memory(s: Strategy, model: ModelSpec | None, lost: list[str], said: list[str], grouped: bool,
            npu: bool = False, fusion: bool | None = None) -> Flags:
    flags: Flags = []
    if s.zero == 1:
        flags.append(("--use-distributed-optimizer", None))
    elif s.zero == 2:
        flags += [("--use-distributed-optimizer", None), ("--use-megatron-fsdp", None),
                  ("--data-parallel-sharding-strategy", "optim_grads"), ("--ckpt-format", "fsdp_dtensor")]
    elif _uses_torch_fsdp2(s, model):
        # validate_args refuses torch FSDP2 with gradient-accumulation fusion, which is on by default.
        flags += [("--use-torch-fsdp2", None), ("--torch-fsdp2-no-reshard-after-forward", None),
                  ("--no-gradient-accumulation-fusion", None), ("--ckpt-format", "torch_dist")]
    elif s.zero == 3:
        if not s.reshard_after_forward:
            # Megatron refuses torch FSDP2 here: Megatron-FSDP instead, which reshards.
            lost.append(f"FSDP without resharding after forward {_torch_fsdp2_refusal(s, model)} (Megatron refuses "
                        "torch FSDP2 there; written as Megatron-FSDP, which reshards)")
        flags += [("--use-distributed-optimizer", None), ("--use-megatron-fsdp", None),
                  ("--data-parallel-sharding-strategy", "optim_grads_params"), ("--ckpt-format", "fsdp_dtensor")]
    megatron_fsdp = any(flag == "--use-megatron-fsdp" for flag, _ in flags)
    why = _megatron_fsdp_fusion_refusal(s, model, npu) if megatron_fsdp else None
    if fusion is False and not any(flag == "--no-gradient-accumulation-fusion" for flag, _ in flags):
        flags.append(("--no-gradient-accumulation-fusion", None))  # as priced
    elif why:
        flags.append(("--no-gradient-accumulation-fusion", None))
        said.append(f"--no-gradient-accumulation-fusion: {why}; each weight gradient is then added to its buffer "
                    "by a kernel of its own, as the megatron runtime prices such a plan")
    if s.zero == 3 and not s.fsdp:
        lost.append("ZeRO-3 without FSDP (Megatron shards parameters only through Megatron/torch FSDP)")
    if s.zero and s.shard_group:
        flags.append(("--num-distributed-optimizer-instances", s.dp * s.cp // s.shard_group))
    if s.optimizer_offload:
        flags += [("--optimizer-cpu-offload", None), ("--use-precision-aware-optimizer", None)]
        if s.optimizer_offload_fraction < 1.0:
            flags.append(("--optimizer-offload-fraction", f"{s.optimizer_offload_fraction:g}"))
    if s.offload_optimizer_states:
        flags.append(("--offload-optimizer-states", None))
        said.append("--offload-optimizer-states is Megatron-Core's optimizer-state offloader (a development-branch "
                    "flag when Megatron-MoE-ModelZoo's GB200 DeepSeek-V3 script used it; Transformer Engine's "
                    "FusedAdam); MindSpeed's is --swap-optimizer")
    if s.recompute == "full":
        flags.append(("--recompute-granularity", "full"))
        if s.recompute_layers:
            flags += [("--recompute-method", "block"), ("--recompute-num-layers", s.recompute_layers)]
        else:
            flags += [("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    elif s.recompute == "selective":
        modules = _recompute_modules(s, model, grouped, lost)
        if modules is not None:
            flags.append(("--recompute-granularity", "selective"))
            if modules:
                flags.append(("--recompute-modules", modules))
            if s.recompute_layers:
                lost.append(f"selective recompute limited to {s.recompute_layers} layers per stage")
    if s.offload_modules:
        flags += [("--fine-grained-activation-offloading", None), ("--offload-modules", tuple(s.offload_modules))]
    if s.offload_layers:  # (Megatron sets --cpu-offloading itself from a positive count)
        flags += [("--cpu-offloading-num-layers", s.offload_layers)]
    precision = _precision(s, lost)
    written = dict(flags)
    if "--fp8-format" in dict(precision) and {"moe_act", "layernorm"} & set(written.get("--recompute-modules", ())):
        # Megatron-Core refuses these recomputes under fp8's delayed scaling, --fp8-recipe's
        # default (TransformerConfig): per-tensor current scaling runs them; ndplan prices no recipe.
        precision.append(("--fp8-recipe", "tensorwise"))
        said.append("--fp8-recipe tensorwise: Megatron-Core refuses layernorm/moe_act recompute under fp8's default "
                    "delayed scaling; the recipe is not priced")
    return flags + precision


def _recompute_modules(s: Strategy, model: ModelSpec | None, grouped: bool,
                       lost: list[str]) -> tuple[str, ...] | None:
    """The --recompute-modules Megatron-Core runs for the strategy's (TransformerConfig refuses
    moe_act without --moe-grouped-gemm and mla_up_proj without MLA); each one left out is said.
    None: none is left, so no selective recompute is written."""
    kept: list[str] = []
    for name in s.recompute_modules:
        if name == "moe_act" and not grouped:
            lost.append("recompute module moe_act " + ("on a model without experts" if model is not None and not
                                                       model.is_moe else "without grouped-GEMM experts")
                        + " (Megatron-Core recomputes the expert activation only with --moe-grouped-gemm)")
        elif name == "mla_up_proj" and model is not None and not model.is_mla:
            lost.append("recompute module mla_up_proj without multi-latent attention (Megatron-Core refuses it; "
                        "the model has no MLA up-projection)")
        else:
            kept.append(name)
    if s.recompute_modules and not kept:
        lost.append("selective recompute: none of its modules runs here, so none is written")
        return None
    return tuple(kept)


def _precision(s: Strategy, lost: list[str]) -> Flags:
    p = policy_of(s.precision)
    flags: Flags = []
    if p.compute_dtype == "fp32" and p.param_bytes == 4 and p.master_weight_bytes == 0:
        if p.optimizer_states != 2 or p.optimizer_state_bytes != 4 or p.grad_bytes != 4:
            lost.append(f"precision {p.name!r}")
        return flags
    if p.param_bytes != 2 or p.master_weight_bytes not in (2, 4) or p.optimizer_state_bytes not in (1, 2, 4):
        lost.append(f"precision {p.name!r} (Megatron keeps 2-byte parameters with a separate main copy)")
        return [("--bf16", None)]
    flags.append(("--fp16", None) if p.compute_dtype == "fp16" else ("--bf16", None))
    if p.compute_dtype == "fp8":
        flags.append(("--fp8-format", "hybrid"))
        if p.fp8_params:
            flags.append(("--fp8-param-gather", None))
    if p.compute_dtype == "fp16" and p.grad_bytes == 4:
        flags.append(("--accumulate-allreduce-grads-in-fp32", None))  # fp16's gradients are fp16 otherwise
    elif p.compute_dtype != "fp16" and p.grad_bytes == 2:
        flags.append(("--grad-reduce-in-bf16", None))
    if p.master_weight_bytes != 4 or p.optimizer_state_bytes != 4:
        dtype = {1: "fp8", 2: "bf16", 4: "fp32"}[p.optimizer_state_bytes]
        flags += [("--use-precision-aware-optimizer", None), ("--main-params-dtype", "fp16" if p.master_weight_bytes == 2 else "fp32"),
                  ("--exp-avg-dtype", dtype), ("--exp-avg-sq-dtype", dtype)]
    if p.optimizer_states == 1:
        flags.append(("--optimizer", "sgd"))
    elif p.optimizer_states != 2:
        lost.append(f"{p.optimizer_states} optimizer states")
    if p.activation_bytes != 2:
        lost.append(f"{p.activation_bytes}-byte activations")
    return flags


def _dualpipev_noop(m: ModelSpec, s: Strategy) -> tuple[int, ...]:
    """MindSpeed's DualPipeV splits the layer slots evenly over its 2·pp chunks: a placement with
    fewer layers in some chunks (61 over 16, or the embedding or loss counted as layers) is
    written as that many more slots, the missing ones no-op layers (``--noop-layers``) at the
    end of their chunks, which MindSpeed builds as identities and the reader drops again."""
    if s.schedule != "dualpipev":
        return ()
    counts = layer_counts(s, m.num_layers)
    width = max(counts)
    return tuple(v * width + c + j for v, c in enumerate(counts) for j in range(width - c))


def _with_noop(kinds: tuple[str, ...], noop: tuple[int, ...]) -> tuple[str, ...]:
    """Per layer slot: the layers' kinds with each no-op slot taking its predecessor's (dropped
    by the reader)."""
    out: list[str] = []
    layers = iter(kinds)
    for slot in range(len(kinds) + len(noop)):
        out.append((out[-1] if out else kinds[0]) if slot in noop else next(layers))
    return tuple(out)


def _model(m: ModelSpec, lost: list[str], noop: tuple[int, ...] = (), seq_length: int = 0) -> Flags:
    flags: Flags = [("--num-layers", m.num_layers + len(noop)), ("--hidden-size", m.hidden_size)]
    if noop:
        flags.append(("--noop-layers", ",".join(str(slot) for slot in noop)))
    if m.ffn_hidden_size:
        flags.append(("--ffn-hidden-size", m.ffn_hidden_size))
    flags.append(("--num-attention-heads", m.num_attention_heads))
    if m.is_mla:
        flags.append(("--multi-latent-attention", None))
        if m.q_lora_rank:
            flags.append(("--q-lora-rank", m.q_lora_rank))
        flags += [("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_nope_head_dim),
                  ("--qk-pos-emb-head-dim", m.qk_rope_head_dim), ("--v-head-dim", m.v_head_dim),
                  ("--qk-layernorm", None)]
        if m.num_kv_heads != m.num_attention_heads:
            lost.append(f"num_kv_heads={m.num_kv_heads} with MLA")
    else:
        if m.num_kv_heads != m.num_attention_heads:
            flags += [("--group-query-attention", None), ("--num-query-groups", m.num_kv_heads)]
        flags.append(("--kv-channels", m.head_dim))
        if m.qk_norm:
            flags.append(("--qk-layernorm", None))
            if m.qk_norm_width == "projection":
                lost.append("q/k norms over the whole projection (--qk-layernorm normalises each head)")
    flags += [("--padded-vocab-size", m.vocab_size), ("--position-embedding-type", "rope")]
    # validate_args requires it and asserts it is >= --seq-length; RoPE sizes no table by it.
    flags.append(("--max-position-embeddings", max(m.max_position_embeddings, seq_length)))
    if m.norm == "rmsnorm":
        flags.append(("--normalization", "RMSNorm"))
    else:
        flags.append(("--normalization", "LayerNorm"))
    if m.norm_bias != (m.norm == "layernorm"):
        lost.append(f"norm_bias={m.norm_bias} with {m.norm}")
    if m.norm_placement != "pre":
        lost.append(f"{m.norm_placement} norms ({m.norms_per_layer} a layer; Megatron's layers norm before "
                    "attention and MLP alone)")
    if m.gated_mlp and m.activation == "silu":
        flags.append(("--swiglu", None))
    elif m.gated_mlp and m.activation == "quick_gelu":
        flags.append(("--quick-geglu", None))
    elif not m.gated_mlp and m.activation == "relu2":
        flags.append(("--squared-relu", None))
    elif m.gated_mlp or not m.activation.startswith("gelu"):
        lost.append(f"activation {m.activation}{' (gated)' if m.gated_mlp else ''}")
    # Megatron's add_bias_linear covers every linear layer, experts included: dense MLP biases
    # count where the model has dense layers, expert biases where it has experts.
    mlp_biases = ([m.mlp_bias] if m.num_dense_layers else []) + ([m.expert_bias] if m.is_moe else [])
    if not (m.qkv_bias or m.biases_beyond_qkv):
        flags.append(("--disable-bias-linear", None))
    elif m.qkv_bias and not m.biases_beyond_qkv:
        flags += [("--disable-bias-linear", None), ("--add-qkv-bias", None)]
    elif not (m.qkv_bias and m.o_bias and all(mlp_biases)):
        lost.append(f"biases qkv={m.qkv_bias} o={m.o_bias} mlp={m.mlp_bias} experts={m.expert_bias}")
    if ("--squared-relu", None) in flags and ("--disable-bias-linear", None) not in flags:
        # With biases the bias-GeLU fusion stays on (validate_args), which TransformerConfig
        # refuses for an activation other than gelu, swiglu or quick_geglu.
        flags.append(("--no-bias-gelu-fusion", None))
    if m.router_bias:
        lost.append("the router bias")
    if m.attention_sinks:
        flags.append(("--softmax-type", "learnable"))
    if not m.tie_word_embeddings:
        flags.append(("--untie-embeddings-and-output-weights", None))
    # Stated even at 0: Megatron's defaults are 0.1, whose masks the estimate would then miss.
    flags += [("--hidden-dropout", f"{m.hidden_dropout:g}"), ("--attention-dropout", f"{m.attention_dropout:g}")]
    if m.is_moe:
        flags += [("--num-experts", m.num_experts), ("--moe-router-topk", m.num_experts_per_tok),
                  ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size)]
        if m.num_shared_experts:
            flags.append(("--moe-shared-expert-intermediate-size", m.num_shared_experts * m.shared_expert_ffn_hidden_size))
        if m.shared_expert_gate and m.num_shared_experts:
            flags.append(("--moe-shared-expert-gate", None))
        if m.num_dense_layers:
            flags.append(("--moe-layer-freq", _pattern(_with_noop(m.layer_mlp_kinds, noop))))
    if m.has_linear_attention:
        # Megatron-LM's Gated DeltaNet layers (its Qwen3-Next support); a list pattern: 1 Gated
        # DeltaNet, 0 softmax attention.
        bits = tuple("moe" if span == "linear" else "dense" for span in m.layer_attention_spans)
        flags += [("--experimental-attention-variant", "gated_delta_net"),
                  ("--linear-attention-freq", _pattern(_with_noop(bits, noop))),
                  ("--linear-num-key-heads", m.linear_num_key_heads), ("--linear-num-value-heads", m.linear_num_value_heads),
                  ("--linear-key-head-dim", m.linear_key_head_dim), ("--linear-value-head-dim", m.linear_value_head_dim),
                  ("--linear-conv-kernel-dim", m.linear_conv_kernel)]
    if m.attention_output_gate:
        flags.append(("--attention-output-gate", None))
    if m.attention_softcap or m.final_softcap:
        lost.append("soft-capped attention scores and logits")
    if "sliding" in m.layer_attention_spans:
        # TransformerEngine's window (left, right): keys i − left … i + right, so w keys causal.
        flags.append(("--window-size", f"{m.sliding_window - 1},0"))
        if "full" in m.layer_attention_spans:
            bits = tuple("moe" if span == "sliding" else "dense" for span in m.layer_attention_spans)
            flags.append(("--window-attn-skip-freq", _pattern(_with_noop(bits, noop))))  # 1: slides, 0: full
    if m.mtp_depth:
        flags.append(("--mtp-num-layers", m.mtp_depth))
    return flags


def _pattern(kinds: tuple[str, ...]) -> str:
    """Megatron's --moe-layer-freq list expression, run-length encoded: ([0]*3+[1]*58)."""
    runs: list[list[int]] = []
    for kind in kinds:
        bit = 1 if kind == "moe" else 0
        if runs and runs[-1][0] == bit:
            runs[-1][1] += 1
        else:
            runs.append([bit, 1])
    return "(" + "+".join(f"[{bit}]*{count}" if count > 1 else f"[{bit}]" for bit, count in runs) + ")"


def _array(name: str, flags: Flags) -> list[str]:
    lines = [f"{name}=("]
    for flag, value in flags:
        if value is None:
            lines.append(f"    {flag}")
        elif isinstance(value, tuple):  # a flag of several values (nargs='+')
            lines.append(f"    {flag} {' '.join(shlex.quote(str(v)) for v in value)}")
        elif isinstance(value, str) and " " in value and flag == "--hierarchical-context-parallel-sizes":
            lines.append(f"    {flag} {value}")
        else:
            lines.append(f"    {flag} {shlex.quote(str(value))}")
    lines.append(")")
    return lines


def _ep_overlap_refusal(s: Strategy, model: ModelSpec | None, written: dict[str, Any]) -> str | None:
    """Where Megatron-Core's TransformerConfig refuses --overlap-moe-expert-parallel-comm for the
    launch written so far (None: it runs it)."""
    if s.pp > 1 and s.vpp == 1:
        return "with a pipeline of one chunk per stage (it needs virtual stages)"
    if written.get("--recompute-granularity") == "full":
        return "with full recompute"
    if "moe" in (written.get("--recompute-modules") or ()):
        return "with the MoE layer recomputed"
    if "--bf16" not in written and "--fp16" not in written:
        return "outside bf16/fp16"
    if model is not None and model.mtp_depth > 1:
        return f"with {model.mtp_depth} MTP layers (it takes at most one)"
    return None


def _overlap(s: Strategy, model: ModelSpec | None, overlap: Any, lost: list[str], written: Flags,
             moe_dispatcher: str = "alltoall", npu: bool = False) -> Flags:
    """Megatron's flags for what ``overlap`` (``ndplan.perf.OverlapConfig``) hides, where the
    strategy has that communication (the reader maps them back: ``megatron._overlap``), and
    where validate_args lets them run: --overlap-param-gather needs --overlap-grad-reduce and the
    distributed optimizer or Megatron-FSDP (torch FSDP2 prefetches on its own), --tp-comm-overlap
    needs --sequence-parallel. On an Ascend NPU (``npu``, MindSpeed) TP overlap is MC2,
    --use-mc2, which fuses the sequence-parallel linears alone too."""
    if overlap is None:
        return [("--moe-token-dispatcher-type", moe_dispatcher)] if model is not None and model.is_moe else []
    flags: Flags = []
    if overlap.dp_grad_reduce and s.dp * s.cp > 1:
        flags.append(("--overlap-grad-reduce", None))
        if overlap.dp_bucket_params is not None:  # the gradient bucket the step time priced
            flags.append(("--ddp-bucket-size", str(overlap.dp_bucket_params)))
    if overlap.dp_param_gather and s.dp * s.cp > 1 and s.zero >= 1 and not _uses_torch_fsdp2(s, model):
        if overlap.dp_grad_reduce:  # the distributed optimizer's gather
            flags.append(("--overlap-param-gather", None))
        elif s.zero < 3:  # (ZeRO-3 gathers per layer: priced by the FSDP prefetch, not this switch)
            lost.append("the parameter all-gather overlapped while the gradient reduce is not (Megatron's "
                        "--overlap-param-gather needs --overlap-grad-reduce)")
    if overlap.tp and s.tp > 1:
        if s.sequence_parallel:
            flags.append(("--use-mc2", None) if npu else ("--tp-comm-overlap", None))
        else:
            lost.append("tensor-parallel communication overlap without sequence parallelism ("
                        + ("MindSpeed's --use-mc2 fuses the sequence-parallel linears alone)" if npu
                           else "Megatron's --tp-comm-overlap needs --sequence-parallel)"))
    if s.ep > 1:
        if overlap.ep is True:
            refused = _ep_overlap_refusal(s, model, dict(written))
            if refused is None:
                flags.append(("--overlap-moe-expert-parallel-comm", None))
            else:
                lost.append(f"the expert all-to-all overlapped {refused} (Megatron-Core refuses "
                            "--overlap-moe-expert-parallel-comm there)")
        if overlap.ep_dispatch == "node_dedup":
            flags += [("--moe-token-dispatcher-type", "flex"), ("--moe-flex-dispatcher-backend", "deepep")]
        elif moe_dispatcher == "allgather":
            flags.append(("--moe-token-dispatcher-type", "allgather"))
        else:
            flags.append(("--moe-token-dispatcher-type", "alltoall"))
    elif model is not None and model.is_moe:
        # (stated: a launch without the flag runs Megatron's default, the allgather dispatcher)
        flags.append(("--moe-token-dispatcher-type", moe_dispatcher))
    return flags


def launcher_node_size(world: int, devices_per_node: int | None) -> int:
    """Processes per node of the launch (torchrun's --nproc_per_node): the cluster's devices per
    node (4 on a GB200/GB300 tray, 8 on an HGX board), a job smaller than one node on one node;
    without a cluster 8, the common server. A world the node size does not divide is written as
    one launch of all its processes (--nnodes 1), as no whole number of nodes holds it."""
    size = devices_per_node or 8
    if world <= size:
        return world
    return size if world % size == 0 else world


def emit_megatron(model: ModelSpec | None, strategy: Strategy, overlap: Any = None, *, loss_upcast: bool = True,
                  attention: str = "flash", grouped_gemm: bool = True, loss_parallel: bool | None = None,
                  moe_capacity_factor: float | None = None, moe_dispatcher: str = "alltoall",
                  devices_per_node: int | None = None, npu: bool = False,
                  gradient_accumulation_fusion: bool | None = None, ulysses_kv_repeat: str = "needed") -> str:
    """A bash launch for the strategy; the model's architecture flags too when a model is given;
    ``overlap``'s switches as Megatron's overlap flags (``_overlap``); without ``loss_upcast``
    Transformer Engine's cross-entropy, which works on the bf16 logits; eager ``attention`` as TE's
    unfused attention (Megatron's default picks a fused kernel); a MoE model's experts as one
    grouped GEMM (``--moe-grouped-gemm``) unless ``grouped_gemm`` is off (SequentialMLP).
    Megatron's cross-entropy is always vocabulary-parallel: ``loss_parallel`` False under TP (the
    loss priced on whole logits) is said in the header. ``moe_capacity_factor`` (token dropping,
    priced as every expert's buffer padded to capacity) becomes ``--moe-expert-capacity-factor``
    with ``--moe-pad-expert-input-to-capacity``. ``moe_dispatcher`` (the token dispatcher priced,
    ``MemoryOptions.moe_dispatcher``) becomes ``--moe-token-dispatcher-type``, written for every
    MoE model (a launch without it runs Megatron's default, allgather); the flex dispatcher where
    ``overlap`` sends node-deduplicated (DeepEP). ``devices_per_node`` (the cluster's) sets the
    launcher's processes per node (``launcher_node_size``). ``npu``: the launch runs MindSpeed on
    Ascend NPUs, whose fused attention needs --use-flash-attn and whose TP overlap is --use-mc2.
    ``gradient_accumulation_fusion`` False (priced with each weight gradient added by a kernel of
    its own) writes --no-gradient-accumulation-fusion, as Megatron-FSDP needs it anyway where it
    refuses the fusion (said in the header where the step was priced with it). ``ulysses_kv_repeat``
    'always' (priced with every GQA layer's KV heads repeated before a Ulysses all-to-all) writes
    MindSpeed-LLM's --kv-head-repeat-before-uly-alltoall where the strategy runs a Ulysses group."""
    lost: list[str] = []
    s = strategy
    if loss_parallel is False and s.tp > 1:
        lost.append("the loss on whole logits (--no-loss-parallel); Megatron's cross-entropy is always "
                    "vocabulary-parallel over TP")
    model_flags = _model(model, lost, _dualpipev_noop(model, s), s.seq_length) if model is not None else []
    refused: list[str] = []  # written as planned, though Megatron stops at it
    parallel = _parallel(s, model, lost, refused, npu)
    if ulysses_kv_repeat == "always" and s.ulysses_ranks > 1:
        parallel.append(("--kv-head-repeat-before-uly-alltoall", None))
    said: list[str] = []
    # Megatron's GroupedGEMM experts run only under --bf16 (validate_args).
    bf16 = ("--bf16", None) in _precision(s, [])
    grouped = model is not None and model.is_moe and grouped_gemm and bf16
    memory = _memory(s, model, lost, said, grouped, npu, gradient_accumulation_fusion)
    fp16 = ("--fp16", None) in memory
    written = dict(memory)
    if "--use-precision-aware-optimizer" in written:
        # megatron/core/optimizer/optimizer_config.py asserts both for the precision-aware
        # optimizer, which optimizer offload and low-precision optimizer states go through.
        needs = "optimizer offload" if s.optimizer_offload else "low-precision main parameters or optimizer states"
        if "--use-distributed-optimizer" not in written:
            refused.append(f"{needs} without the distributed optimizer: Megatron-Core runs its precision-aware "
                           "optimizer only with --use-distributed-optimizer (OptimizerConfig); written as planned, the "
                           "launch stops building its optimizer")
        if written.get("--optimizer") == "sgd":
            refused.append(f"{needs} with one optimizer state (--optimizer sgd): Megatron-Core runs its "
                           "precision-aware optimizer only with Adam; written as planned, the launch stops building "
                           "its optimizer")
    if policy_of(s.precision).fp8_params and s.zero == 0:
        refused.append("fp8 weights (--fp8-param-gather) without the distributed optimizer or FSDP: Megatron-LM runs "
                       "them only with one (validate_args); written as planned, the launch stops at its argument check")
    if s.ep > 1 and fp16:
        refused.append(f"ep={s.ep} under fp16: Megatron-LM refuses expert parallelism under --fp16 (validate_args); "
                       "written as planned, the launch stops at its argument check")
    if not loss_upcast:
        memory += [("--cross-entropy-loss-fusion", None), ("--cross-entropy-fusion-impl", "te")]
    if model is not None and model.is_moe and grouped_gemm:
        if grouped:
            memory.append(("--moe-grouped-gemm", None))
        else:  # validate_args: "Currently GroupedGEMM for MoE only supports bf16 dtype."
            lost.append("the experts' grouped GEMM outside bf16 (Megatron's --moe-grouped-gemm needs --bf16): "
                        "written as SequentialMLP, one GEMM per expert")
    if moe_capacity_factor is not None and (model is None or model.is_moe):
        memory.append(("--moe-expert-capacity-factor", f"{moe_capacity_factor:g}"))
        if overlap is not None and overlap.ep_dispatch == "node_dedup" and s.ep > 1:
            said.append("--moe-pad-expert-input-to-capacity left out: Megatron-Core's flex dispatcher (DeepEP) refuses "
                        "it (TransformerConfig: 'Flex token dispatcher does not support "
                        "moe_pad_expert_input_to_capacity'); each expert then gets at most its capacity, priced as "
                        "padded to it (an upper bound)")
        else:
            memory.append(("--moe-pad-expert-input-to-capacity", None))
    if attention == "eager":
        memory.append(("--attention-backend", "unfused"))
    elif attention == "flex":
        lost.append("flex attention (--attention flex, PyTorch's FlexAttention): Megatron runs its fused attention")
    overlap_flags = _overlap(s, model, overlap, lost, parallel + memory, moe_dispatcher, npu)
    mindspeed = sorted({flag for flag, _ in model_flags + parallel + memory + overlap_flags if flag in MINDSPEED_ONLY})
    if mindspeed:
        # Megatron-LM's parser rejects these flags: the launch is MindSpeed's (Ascend's Megatron).
        one = len(mindspeed) == 1
        said.append(f"{' and '.join(mindspeed)} {'is' if one else 'are'} MindSpeed's "
                    f"(Megatron-LM's parser refuses {'it' if one else 'them'}): run this launch under MindSpeed")
    elif npu:
        said.append("written for MindSpeed on Ascend NPUs (the hardware's runtime): its fused attention "
                    "needs --use-flash-attn")
    if attention != "eager" and (mindspeed or npu):
        # A launch with MindSpeed's flags (DualPipeV, no-op layers) or for an NPU runs on MindSpeed,
        # whose attention is fused only with --use-flash-attn (the reader reads it so too).
        memory.append(("--use-flash-attn", None))
    batch: Flags = [("--micro-batch-size", s.micro_batch_size), ("--global-batch-size", s.global_batch_size),
                    ("--seq-length", s.seq_length)]
    world = s.world_size
    per_node = launcher_node_size(world, devices_per_node)
    header = [
        "#!/bin/bash",
        f"# Megatron-LM arguments written by ndplan {__version__}"
        + (f" for {model.name}" if model is not None else "") + f": {s.short()}",
    ]
    if model is None:
        header.append("# No model given: add the architecture flags (--num-layers, --hidden-size, ...).")
    for item in lost:
        header.append(f"# ndplan: not expressible in Megatron-LM, left out: {item}")
    header += [f"# ndplan: Megatron-LM will refuse this launch: {item}" for item in refused]
    header += [f"# ndplan: {item}" for item in said]
    lines = header + [""]
    arrays = []
    if model_flags:
        lines += _array("MODEL_ARGS", model_flags) + [""]
        arrays.append("MODEL_ARGS")
    for name, flags in (("PARALLEL_ARGS", parallel), ("MEMORY_ARGS", memory), ("OVERLAP_ARGS", overlap_flags),
                        ("BATCH_ARGS", batch)):
        if flags:
            lines += _array(name, flags) + [""]
            arrays.append(name)
    given = {flag for array in (parallel, memory, overlap_flags) for flag, _ in array}
    if (s.tp > 1 or s.cp > 1) and not {"--use-torch-fsdp2", "--use-megatron-fsdp",
                                       "--overlap-moe-expert-parallel-comm"} & given:
        # validate_args asserts it before Blackwell under TP or CP (Megatron-LM's example scripts set it).
        lines += ["export CUDA_DEVICE_MAX_CONNECTIONS=1", ""]
    if "--fine-grained-activation-offloading" in given:
        # Transformer Engine's newer activation offloading asserts its v1 path for Megatron's
        # module offload (Megatron-Bridge's and the MoE model zoo's launches set it; older TE ignores it).
        lines += ["export NVTE_CPU_OFFLOAD_V1=1", ""]
    expansions = " ".join(f'"${{{name}[@]}}"' for name in arrays)
    lines.append(f"torchrun --nproc_per_node {per_node} --nnodes {world // per_node} pretrain_gpt.py {expansions}")
    return "\n".join(lines) + "\n"
