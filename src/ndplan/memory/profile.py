"""Runtime profiles: what a training runtime keeps for backward, as data.

A profile (``profiles/<name>.yaml``) lists, per block of a decoder layer, the tensors saved for
backward with their size per token as an expression of the model's widths. ``block_coefficients``
evaluates them once per model into bytes per token, split by how tensor parallelism divides
them, so that pricing a batch of strategies is a handful of array operations.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ndplan.errors import NdplanError, did_you_mean, parse_nested, read_text
from ndplan.model.spec import ModelSpec
from ndplan.strategy.strategy import OFFLOAD_MODULES, RECOMPUTE_MODULES, SCHEDULES

#: How tensor parallelism divides a saved tensor. ``linear_input`` resolves to the profile's
#: ``linear_input_shard`` (Megatron keeps a linear's input sequence-sharded, DTensor keeps it whole).
#: ``etp``: an expert tensor over every routed copy of the sequence, its width split by etp.
#: ``expert_tokens`` / ``expert_width``: the same where each rank routes only its own sequence
#: shard under SP and the expert-TP group gathers what it routed (Megatron-Core's dispatchers):
#: a rank's experts see s·etp/tp routed copies, so a copy of full width (h) divides by tp/etp and
#: an etp-split width (the expert's ffn) by tp; without SP, as ``none`` and ``etp``.
#: ``gathered``: the tokens Megatron's allgather dispatcher gathers over the expert-TP x EP group,
#: of which a rank keeps what concerns its own E/ep experts: per expert, etp/tp of the sequence's
#: tokens where each rank routes its own shard (under SP, or without TP), whatever the routing.
#: ``kv``: a tensor over the KV heads, split by min(tp, KV heads): with more TP ranks than KV
#: heads each rank keeps one whole head (``RuntimeProfile.tp_above_kv_heads``). ``kv_gathered``:
#: a tensor a rank holds whole only where tp exceeds the KV heads (the QKV output Megatron-Core
#: gathers then), none elsewhere. ``attended_kv``: K or V as the attention kernel reads and keeps
#: them, as ``kv``, or as wide as the queries where MindSpeed repeats a rank's KV heads before a
#: Ulysses all-to-all whose group outnumbers them (``model.heads.ulysses_kv_repeat``).
SHARDS: tuple[str, ...] = ("tp", "sp", "etp", "expert_tokens", "expert_width", "gathered", "vocab", "kv", "kv_gathered",
                           "attended_kv", "none")
#: libyaml's safe loader where PyYAML was built with it (the shipped profile parses ~10x faster,
#: which is most of ``ndplan estimate``'s start-up), else the pure-Python one. Both are safe.
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: The blocks every layer has: a profile must say what each keeps.
REQUIRED_BLOCKS: tuple[str, ...] = ("norm", "attention", "mlp", "layer_input", "output")
BLOCKS: tuple[str, ...] = (
    "norm", "attention", "attention_mla", "linear_attention", "eager_scores", "sdpa_masked", "sdpa_math", "sdpa_repeated_kv",
    "eager_backward_extra",
    "sdpa_math_backward_extra", "softmax_backward_product", "mlp", "moe", "layer_input", "embedding",
    "output", "output_transient", "backward_extra", "moe_backward_extra", "output_backward_extra",
    "loss_parallel_backward_extra", "weight_grad_outputs", "moe_weight_grad_outputs", "moe_allgather",
    "qkv_gather_backward_extra",
)

#: The blocks of the final norm, LM head and loss: torch.compile of the decoder layers leaves them.
LOSS_BLOCKS = frozenset({"output", "output_transient", "output_backward_extra", "loss_parallel_backward_extra"})
#: Those a compiled loss prices (``block_coefficients``' ``compiled_loss``): not the vocabulary-parallel one's.
COMPILED_LOSS_BLOCKS = LOSS_BLOCKS - {"loss_parallel_backward_extra"}
#: The model types whose Hugging Face router casts its input to fp32 before the gate matmul (the
#: copy the pytorch profile's router_fp32_input keeps for backward).
FP32_ROUTER_INPUT_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite"})
#: The model types whose Hugging Face attention keeps one more query-sized copy for backward than
#: Llama's (the pytorch profile's query_copy; measured by the census, see there).
#: The model types whose Hugging Face MoE block weighs the experts' outputs by fp32 routing weights
#: (gathered per routed copy, the pytorch profile's routing_weights_gathered; bf16 elsewhere).
FP32_ROUTING_WEIGHTS_MODEL_TYPES = FP32_ROUTER_INPUT_MODEL_TYPES | {"mixtral", "minimax_m2"}
#: The model types whose experts run a clamped SwiGLU (gpt-oss: gate and up clamped, up + 1),
#: keeping three more tensors a routed copy than a SwiGLU (the pytorch profile's clamped_swiglu).
CLAMPED_SWIGLU_MODEL_TYPES = frozenset({"gpt_oss"})
QUERY_COPY_MODEL_TYPES = frozenset({"glm4_moe", "minimax_m2", "phi3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
#: The model types whose Hugging Face attention projects q, k and v in one linear and keeps its
#: whole output for backward (v is a view of it), not v alone (the pytorch profile's fused_qkv).
FUSED_QKV_MODEL_TYPES = frozenset({"phi3"})
#: The model types whose Hugging Face RMSNorm multiplies its weight in fp32 and casts after
#: ((w · x̂).to(dtype); Llama casts first, w · x̂.to(dtype)): the product keeps the fp32
#: normalised input for the weight's gradient (the pytorch profile's norm_fp32_weight).
FP32_NORM_WEIGHT_MODEL_TYPES = frozenset({"olmo2", "olmo3", "gemma3_text", "gemma2", "gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})


def model_symbols(model: ModelSpec) -> dict[str, float]:
    """Widths a profile expression may use, in elements per token (unsharded)."""
    heads = model.num_attention_heads
    kv_heads = model.split_kv_heads
    moe_ffn = model.moe_ffn_hidden_size
    topk = model.num_experts_per_tok
    shared_ffn = model.num_shared_experts * model.shared_expert_ffn_hidden_size
    return {
        "h": model.hidden_size,
        "q": heads * model.qk_head_dim,
        "k": kv_heads * model.qk_head_dim,
        "v": kv_heads * model.value_head_dim,
        "o": heads * model.value_head_dim,
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn": model.ffn_hidden_size,
        "moe_ffn": moe_ffn,
        "topk": topk,
        "experts": model.num_experts,
        "shared_ffn": shared_ffn,
        "ffn_or_moe": max(model.ffn_hidden_size, topk * moe_ffn + shared_ffn),
        "kv_up": heads * (model.qk_nope_head_dim + model.v_head_dim),
        "qk_norm": 1 if model.qk_norm else 0,
        # per-head q/k norms keep one statistic per head; projection-wide ones one per token
        "qk_norm_head": 1 if model.qk_norm and model.qk_norm_width == "head" else 0,
        "qk_norm_projection": 1 if model.qk_norm and model.qk_norm_width == "projection" else 0,
        "has_q_lora": 1 if model.q_lora_rank else 0,
        "has_shared": 1 if model.num_shared_experts else 0,
        "fc1_widths": 2 if model.gated_mlp else 1,
        "hidden_dropout_on": 1 if model.hidden_dropout > 0 else 0,
        "attention_dropout_on": 1 if model.attention_dropout > 0 else 0,
        # DeepSeek's HF router casts its input to fp32 before the gate matmul; so does the same
        # router in Kimi K2 (DeepSeek-V3's code), GLM-4.5 and GLM-4.7-Flash (the same router).
        "router_upcast": model.hidden_size if model.model_type in FP32_ROUTER_INPUT_MODEL_TYPES else 0,
        "router_fp32": 1 if model.model_type in FP32_ROUTER_INPUT_MODEL_TYPES else 0,
        "shared_gate": 1 if model.num_experts and model.shared_expert_gate else 0,
        "query_copy": 1 if model.model_type in QUERY_COPY_MODEL_TYPES else 0,
        "norm_fp32_weight": 1 if model.model_type in FP32_NORM_WEIGHT_MODEL_TYPES else 0,
        "fused_qkv": 1 if model.model_type in FUSED_QKV_MODEL_TYPES else 0,
        "norms": model.norms_per_layer,
        "q_lora": model.q_lora_rank,
        "kv_lora": model.kv_lora_rank,
        "rope": model.qk_rope_head_dim,
        "vocab": model.vocab_size,
        # Gated DeltaNet layers: key and value widths over their heads, and the heads
        "linear_key": model.linear_key_width,
        "linear_value": model.linear_value_width,
        "linear_key_heads": model.linear_num_key_heads,
        "linear_value_heads": model.linear_num_value_heads,
        # q and k repeated to every value head where there are more (Megatron-Core's GatedDeltaNet
        # repeat_interleaves them before the kernel); 0 where the heads match (no copy)
        "linear_key_repeated": (model.linear_key_width * model.linear_num_value_heads // model.linear_num_key_heads
                                if model.linear_num_value_heads > model.linear_num_key_heads else 0),
        "output_gate": 1 if model.attention_output_gate else 0,
        # norms before the attention and the MLP alone (Llama's), not after (OLMo 2) or both (Gemma 3)
        "pre_norm": 1 if model.norm_placement == "pre" else 0,
        "sandwich_norm": 1 if model.norm_placement == "sandwich" else 0,
        # soft-capped attention scores and logits (Gemma 2): tanh keeps its output
        "attention_softcap": 1 if model.attention_softcap else 0,
        "attention_sinks": 1 if model.attention_sinks else 0,
        "clamped_swiglu": 1 if model.model_type in CLAMPED_SWIGLU_MODEL_TYPES else 0,
        "routing_fp32": 1 if model.model_type in FP32_ROUTING_WEIGHTS_MODEL_TYPES else 0,
        "norm_topk": 1 if model.norm_topk_prob else 0,
        "final_softcap": 1 if model.final_softcap else 0,
    }


SYMBOLS: tuple[str, ...] = (
    "h", "q", "k", "v", "o", "heads", "kv_heads", "ffn", "moe_ffn", "topk", "experts", "shared_ffn",
    "ffn_or_moe", "kv_up", "qk_norm", "qk_norm_head", "qk_norm_projection", "has_q_lora", "has_shared", "fc1_widths", "hidden_dropout_on", "attention_dropout_on", "router_upcast", "query_copy",
    "norm_fp32_weight", "norms", "fused_qkv", "router_fp32", "shared_gate",
    "q_lora", "kv_lora", "rope", "vocab", "linear_key", "linear_value", "linear_key_heads", "linear_value_heads",
    "linear_key_repeated",
    "output_gate", "pre_norm", "sandwich_norm", "attention_softcap", "attention_sinks", "clamped_swiglu", "routing_fp32", "norm_topk", "final_softcap", "seq",
    # the runtime's modules, not the model's (``MemoryOptions.modules``): 1 under 'te'
    "fused_norm", "weighted_experts",
)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str, symbols: dict[str, float]) -> float:
    """Evaluate +, -, *, / over numbers and known symbols (nothing else is allowed)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name):
            if node.id not in symbols:
                raise NdplanError(f"unknown symbol '{node.id}' in '{expression}'; known: {', '.join(SYMBOLS)}")
            return float(symbols[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return float(_OPERATORS[type(node.op)](walk(node.left), walk(node.right)))
        raise NdplanError(f"unsupported expression '{expression}': use numbers, symbols, + - * /")

    try:
        tree = ast.parse(str(expression), mode="eval")
    except SyntaxError:
        raise NdplanError(f"malformed expression '{expression}'") from None
    return walk(tree)


@dataclass(frozen=True)
class SavedTensor:
    name: str
    elements: str
    bytes: str | int
    shard: str
    keep: bool
    weight_input: bool
    read_last: bool = False
    past_weights: bool = False
    #: Recompute modules (``Strategy.recompute_modules``) any one of which rebuilds this tensor in
    #: backward instead of keeping it.
    recomputed_by: frozenset[str] = frozenset()
    #: Offload modules (``Strategy.offload_modules``) any one of which copies this tensor to host
    #: memory after the forward and back before its backward (Megatron-Core's saved-tensor hooks
    #: around the module: what the module saves moves, where it is kept at all).
    offloaded_by: frozenset[str] = frozenset()
    #: Bytes per element when the layer's GEMMs run in fp8, where that differs from ``bytes``:
    #: Transformer Engine's fp8 linears keep the quantised copy of their input for the weight
    #: gradient (1 byte), not the bf16 one.
    fp8_bytes: str | float | None = None
    #: Bytes per element (a number or ``act``) when the loss runs on the activation dtype
    #: instead of upcasting the logits to fp32 (``MemoryOptions.loss_upcast`` off): 0 for the
    #: upcast copy itself, ``act`` for what the loss then keeps or makes at that width.
    no_upcast_bytes: str | float | None = None
    #: Whether torchtitan's per-op selective checkpointing (``torchtitan-op``) keeps it, where
    #: that differs from ``keep`` (None: as ``keep``).
    op_keep: bool | None = None
    #: Bytes per element (a number or ``act``) where torch.compile compiles the decoder layers
    #: (``MemoryOptions.compiled_layers``), where that differs: Inductor's partitioner keeps a
    #: norm's bf16 input and statistic and rebuilds its fp32 copies, and rebuilds the MLP's
    #: activation, in the fused backward (0 for what it does not keep).
    compiled_bytes: str | float | None = None
    #: Whether selective recompute keeps it in compiled layers, under any policy, where that
    #: differs from the policy's own flag (None: as the policy says).
    compiled_keep: bool | None = None
    #: Bytes per element in compiled layers whose GEMMs run in fp8 (torchao's Float8 linears),
    #: without recompute, where that differs: the compiled graph rebuilds the linears' inputs
    #: for their fp8 casts rather than keep them. What selective recompute keeps is the compiled
    #: bf16 layer's (measured the same).
    compiled_fp8_bytes: str | float | None = None


@dataclass(frozen=True, eq=False)  # identity hash: profiles are cached singletons
class RuntimeProfile:
    """A runtime's saved-tensor table and its overhead constants (see ``overhead.py``)."""

    name: str
    description: str
    linear_input_shard: str
    loss_parallel: bool
    blocks: dict[str, tuple[SavedTensor, ...]]
    optimizer_temp_copies: float
    weight_grad_holds: str = "weight_inputs"
    pipeline_stage_output: bool = False
    selective_keeps_layer_input: bool = False
    grads_created_in_backward: bool = False
    pipeline_defers_fsdp_reduce: bool = False
    #: How its data-parallel gradient reduce is bucketed (the step-time model's last exposed
    #: bucket): 'megatron' (Megatron-Core's DDP) or 'ddp' (PyTorch DDP, ``ddp_bucket_cap_mb``).
    grad_buckets: str = "megatron"
    ddp_bucket_cap_mb: float = 25.0
    #: Whose launch rules turn gradient-accumulation fusion off for some strategies
    #: (``EfficiencyProfile.gradient_accumulation_rules``, ``perf.accumulation``): 'megatron', or
    #: None where every strategy runs as ``kernels``' gradient_accumulation_fusion says.
    gradient_accumulation_rules: str | None = None
    tp_accumulates_whole_embedding_grad: bool = False
    weight_grad_recomputes_per_group: bool = False
    first_stage_backward_at_w: bool = False
    #: Its split backward's B (input gradient alone) leaves each micro-batch's input gradient on
    #: the chunk's receive buffer until the next step starts (through the optimizer step).
    split_backward_keeps_input_grads: bool = False
    #: Bytes per linear-weight element of the quantised weight copies its fp8 linears keep from
    #: one micro-batch to the next (``static.linear_weight_elements``; 0: none kept).
    fp8_weight_cache_bytes: float = 0.0
    #: Copies of the gradients its DDP reducer keeps in buckets of its own (replicas without ZeRO
    #: or FSDP; 0: the gradients live in the buckets, or there are none).
    ddp_bucket_copies: float = 0.0
    #: What its selective recompute re-runs, for the step-time model
    #: (``EfficiencyProfile.selective_recompute``): 'megatron' the attention core, 'keep-matmuls'
    #: the elementwise ops alone, 'torchtitan-op' every second matmul and the elementwise ops.
    selective_policy: str = "megatron"
    #: The pipeline schedules the runtime runs: what the search may recommend for it.
    schedules: tuple[str, ...] = SCHEDULES
    #: Whether it runs more TP ranks than KV heads (Megatron-Core: each rank all-gathers the QKV
    #: output over TP and keeps one KV head and its tp/KV-heads share of that head's queries).
    tp_above_kv_heads: bool = False
    #: Whether it offloads whole layers' activations (Megatron-Core's --cpu-offloading-num-layers,
    #: ``Strategy.offload_layers``; ``memory.layer_offload``).
    layer_offload: bool = False
    #: Whether its distributed optimizer keeps the optimizer states and master weights on the host
    #: through the forward and backward (Megatron-Core's --offload-optimizer-states, MindSpeed's
    #: --swap-optimizer; ``Strategy.offload_optimizer_states``).
    optimizer_state_offload: bool = False
    overhead: dict[str, float] = field(default_factory=dict)
    #: The recompute modules its entries name (``recomputed_by``); empty where the runtime has
    #: only its own selective policy.
    recompute_modules: tuple[str, ...] = ()
    #: Whether the runtime offloads activations by module (its entries name ``offloaded_by``).
    offloads: bool = False
    #: The selective policies it can price: its own, and 'torchtitan-op' where entries state
    #: ``op_keep`` (``MemoryOptions.selective_policy``).
    selective_policies: tuple[str, ...] = ()
    #: Facts about its kernels for the step-time model (``ndplan.perf.efficiency``'s software
    #: facts: elementwise_passes, expert_gemm, optimizer_kernel, tp_overlap_backward,
    #: fsdp_stream_copies, fp8_tp_gather, expert_bias_add, sink_rescale, ring_merge, ring_exchange,
    #: mla_assembly, p2p_wait, gradient_accumulation_fusion), stated beside what it saves.
    kernels: dict[str, Any] = field(default_factory=dict)

    def uses_shard(self, shard: str) -> bool:
        """Whether any entry is sharded by ``shard`` (a rule the profile's tensors follow)."""
        return any(tensor.shard == shard for entries in self.blocks.values() for tensor in entries)

    def uses_symbols(self, names: tuple[str, ...]) -> bool:
        """Whether any entry's elements name one of ``names`` (a switch the profile describes)."""
        return any(re.search(rf"\b{name}\b", tensor.elements) for entries in self.blocks.values()
                   for tensor in entries for name in names)


def _parse_profile(data: Any, source: str) -> RuntimeProfile:
    if not isinstance(data, dict) or not isinstance(data.get("blocks"), dict):
        raise NdplanError(f"{source}: a runtime profile needs a 'blocks' mapping (block name: list of saved tensors)")
    # Without these the layers would keep nothing for backward: an estimate, silently far low.
    missing = [block for block in REQUIRED_BLOCKS if not data["blocks"].get(block)]
    if missing:
        raise NdplanError(f"{source}: blocks {', '.join(missing)} are missing or empty; every profile states what "
                          f"{', '.join(REQUIRED_BLOCKS)} keep")
    linear = data.get("linear_input_shard", "sp")
    blocks: dict[str, tuple[SavedTensor, ...]] = {}
    for block, entries in data["blocks"].items():
        if block not in BLOCKS:
            raise NdplanError(f"{source}: unknown block '{block}'; known: {', '.join(BLOCKS)}")
        if entries is not None and not (isinstance(entries, list) and all(isinstance(e, dict) for e in entries)):
            raise NdplanError(f"{source}: block '{block}' is a list of saved tensors ({{name, elements, bytes, shard, "
                              f"keep}} each), got {entries!r}")
        parsed = []
        for entry in entries or []:
            try:
                shard = linear if entry["shard"] == "linear_input" else entry["shard"]
                tensor = SavedTensor(
                    name=str(entry["name"]), elements=str(entry["elements"]), bytes=entry["bytes"],
                    shard=shard, keep=entry.get("keep", "keep") == "keep",
                    weight_input=bool(entry.get("weight_input", False)),
                    read_last=bool(entry.get("read_last", False)),
                    past_weights=bool(entry.get("past_weights", False)),
                    recomputed_by=frozenset(entry.get("recomputed_by") or ()),
                    offloaded_by=frozenset(entry.get("offloaded_by") or ()),
                    fp8_bytes=_width_or_act(entry.get("fp8_bytes"), source, str(entry.get("name"))),
                    no_upcast_bytes=_width_or_act(entry.get("no_upcast_bytes"), source, str(entry.get("name"))),
                    op_keep=_op_keep(entry.get("op_keep"), source, str(entry.get("name"))),
                    compiled_bytes=_width_or_act(entry.get("compiled_bytes"), source, str(entry.get("name"))),
                    compiled_keep=_op_keep(entry.get("compiled_keep"), source, str(entry.get("name")), "compiled_keep"),
                    compiled_fp8_bytes=_width_or_act(entry.get("compiled_fp8_bytes"), source, str(entry.get("name"))),
                )
            except (KeyError, TypeError) as error:
                raise NdplanError(f"{source}: block '{block}' entry {entry!r} lacks field {error}") from None
            if tensor.shard not in SHARDS:
                raise NdplanError(f"{source}: entry '{tensor.name}' has shard '{tensor.shard}'; known: {', '.join(SHARDS)}")
            unknown = sorted(tensor.recomputed_by - set(RECOMPUTE_MODULES))
            if unknown:
                raise NdplanError(f"{source}: entry '{tensor.name}' is recomputed by unknown module(s) "
                                  f"{', '.join(unknown)}; known: {', '.join(RECOMPUTE_MODULES)}")
            unknown = sorted(tensor.offloaded_by - set(OFFLOAD_MODULES))
            if unknown:
                raise NdplanError(f"{source}: entry '{tensor.name}' is offloaded by unknown module(s) "
                                  f"{', '.join(unknown)}; known: {', '.join(OFFLOAD_MODULES)}")
            parsed.append(tensor)
        blocks[block] = tuple(parsed)
    return RuntimeProfile(
        name=str(data.get("name", Path(source).stem)),
        description=str(data.get("description", "")),
        linear_input_shard=linear,
        loss_parallel=bool(data.get("loss_parallel", False)),
        blocks=blocks,
        optimizer_temp_copies=float(data.get("optimizer_temp_copies", 0.0)),
        weight_grad_holds=str(data.get("weight_grad_holds", "weight_inputs")),
        pipeline_stage_output=bool(data.get("pipeline_stage_output", False)),
        selective_keeps_layer_input=bool(data.get("selective_keeps_layer_input", False)),
        grads_created_in_backward=bool(data.get("grads_created_in_backward", False)),
        pipeline_defers_fsdp_reduce=bool(data.get("pipeline_defers_fsdp_reduce", False)),
        grad_buckets=_grad_buckets(data.get("grad_buckets", "megatron"), source),
        ddp_bucket_cap_mb=_positive(data.get("ddp_bucket_cap_mb", 25.0), "ddp_bucket_cap_mb", source),
        gradient_accumulation_rules=_accumulation_rules(data.get("gradient_accumulation_rules"), source),
        tp_accumulates_whole_embedding_grad=bool(data.get("tp_accumulates_whole_embedding_grad", False)),
        weight_grad_recomputes_per_group=bool(data.get("weight_grad_recomputes_per_group", False)),
        first_stage_backward_at_w=bool(data.get("first_stage_backward_at_w", False)),
        split_backward_keeps_input_grads=bool(data.get("split_backward_keeps_input_grads", False)),
        fp8_weight_cache_bytes=float(data.get("fp8_weight_cache_bytes", 0.0)),
        ddp_bucket_copies=float(data.get("ddp_bucket_copies", 0.0)),
        selective_policy=_selective_policy(data.get("selective_policy", "megatron"), source),
        schedules=_schedules(data.get("schedules", list(SCHEDULES)), source),
        tp_above_kv_heads=bool(data.get("tp_above_kv_heads", False)),
        layer_offload=bool(data.get("layer_offload", False)),
        optimizer_state_offload=bool(data.get("optimizer_state_offload", False)),
        overhead=_overhead(data.get("overhead"), source),
        recompute_modules=tuple(m for m in RECOMPUTE_MODULES
                                if any(m in t.recomputed_by for entries in blocks.values() for t in entries)),
        offloads=any(t.offloaded_by for entries in blocks.values() for t in entries),
        kernels=_kernels(data.get("kernels"), source),
        selective_policies=tuple(dict.fromkeys(
            [_selective_policy(data.get("selective_policy", "megatron"), source)]
            + (["torchtitan-op"] if any(t.op_keep is not None for entries in blocks.values() for t in entries) else []))),
    )


def _grad_buckets(raw: Any, source: str) -> str:
    if raw not in ("megatron", "ddp"):
        raise NdplanError(f"{source}: grad_buckets must be 'megatron' or 'ddp', got {raw!r}")
    return str(raw)


def _accumulation_rules(raw: Any, source: str) -> str | None:
    if raw not in (None, "megatron"):
        raise NdplanError(f"{source}: gradient_accumulation_rules must be 'megatron' or left out, got {raw!r}")
    return None if raw is None else str(raw)


def _positive(raw: Any, key: str, source: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise NdplanError(f"{source}: {key} must be a positive number, got {raw!r}")
    return value


#: The software facts a profile's ``kernels`` may state (the rest follow from other settings).
KERNEL_FACTS = ("elementwise_passes", "expert_gemm", "optimizer_kernel", "tp_overlap_backward", "fsdp_stream_copies",
                "fsdp_cpu_offload", "fp8_tp_gather", "expert_bias_add", "sink_rescale", "ring_merge", "ring_exchange",
                "mla_assembly", "p2p_wait", "gradient_accumulation_fusion")


def _kernels(raw: Any, source: str) -> dict[str, Any]:
    """The profile's ``kernels`` section, each fact checked as the step-time model takes it."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise NdplanError(f"{source}: kernels must be a mapping of {', '.join(KERNEL_FACTS)}")
    unknown = sorted(set(raw) - set(KERNEL_FACTS))
    if unknown:
        raise NdplanError(f"{source}: unknown kernel fact {unknown[0]!r}; known: {', '.join(KERNEL_FACTS)}")
    from ndplan.perf.efficiency import FAMILY_DEFAULTS

    try:
        checked = FAMILY_DEFAULTS["generic"].replace(**raw)
    except NdplanError as error:
        raise NdplanError(f"{source}: kernels: {error}") from None
    return {key: getattr(checked, key) for key in raw}  # as the model takes them ("4.5" -> 4.5)


SELECTIVE_POLICIES = ("megatron", "keep-matmuls", "torchtitan-op")


def _overhead(raw: Any, source: str) -> dict[str, float]:
    """The profile's ``overhead`` section: known constants, each a finite number >= 0."""
    from ndplan.memory.overhead import DEFAULTS

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise NdplanError(f"{source}: overhead must be a mapping of {', '.join(DEFAULTS)}")
    out = {}
    for key, value in raw.items():
        if key not in DEFAULTS:
            raise NdplanError(f"{source}: unknown overhead constant {key!r}; known: {', '.join(DEFAULTS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise NdplanError(f"{source}: overhead {key} must be a finite number >= 0, got {value!r}")
        out[key] = float(value)
    return out


def _schedules(value: Any, source: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or any(v not in SCHEDULES for v in value):
        raise NdplanError(f"{source}: schedules is {value!r}; a list of some of {', '.join(SCHEDULES)}")
    return tuple(value)


def _selective_policy(value: Any, source: str) -> str:
    if value not in SELECTIVE_POLICIES:
        raise NdplanError(f"{source}: selective_policy is {value!r}; allowed: {', '.join(SELECTIVE_POLICIES)}")
    return str(value)


def profile_names() -> tuple[str, ...]:
    folder = resources.files("ndplan.memory").joinpath("profiles")
    return tuple(sorted(e.name.removesuffix(".yaml") for e in folder.iterdir() if e.name.endswith(".yaml")))


@lru_cache(maxsize=16)
def get_profile(name: str) -> RuntimeProfile:
    """A shipped profile by name, or a path to a profile YAML."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
        if not path.is_file():
            raise NdplanError(f"{path}: " + ("not a file" if path.exists() else "no such runtime profile file"))
        try:
            data = parse_nested(lambda text: yaml.load(text, Loader=_SAFE_LOADER), read_text(path), path, "YAML")
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f":{where.line + 1}" if where is not None else ""
            raise NdplanError(f"{path}{line}: malformed runtime profile YAML "
                              f"({getattr(error, 'problem', None) or error})") from None
        return _parse_profile(data, str(path))
    if name not in profile_names() and Path(name).is_file():
        raise NdplanError(f"{name}: a runtime profile is a YAML file (.yaml or .yml); known runtimes: "
                          f"{', '.join(profile_names())}")
    if name not in profile_names():
        raise NdplanError(f"unknown runtime '{name}'{did_you_mean(name, profile_names())}; known: "
                          f"{', '.join(profile_names())} (or a profile YAML path)")
    text = resources.files("ndplan.memory").joinpath("profiles", f"{name}.yaml").read_text()
    return _parse_profile(yaml.load(text, Loader=_SAFE_LOADER), f"runtime profile {name}")


@dataclass(frozen=True)
class BlockBytes:
    """Bytes per token of one block, per shard rule: ``base[r] + per_seq[r]·seq`` where seq is the
    attended sequence length (only eager attention scores depend on it). ``kept`` is the part
    selective recompute keeps; ``weight_input`` the inputs of weights (linear layers, and in a
    profile that flags them the norms' normalized inputs): what a weight gradient reads."""

    base: dict[str, float]
    per_seq: dict[str, float]
    kept: dict[str, float]
    weight_input: dict[str, float]
    #: What the layer's last weight gradients read (its MLP's last projection, the norms' weights).
    read_last: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))
    #: What ops no weight's gradient path runs through save (the router's probabilities, the
    #: experts' weighting): past the weights, on the way to the layer's output only.
    past_weights: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))
    #: What the offload modules move to the host: of every saved tensor (no recompute), and of
    #: those selective recompute keeps (a rebuilt tensor is never saved, so never moved).
    offloaded: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))
    offloaded_kept: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))
    #: The parts of ``kept``, ``offloaded`` and ``offloaded_kept`` that grow with the attended
    #: sequence, as ``per_seq`` is ``base``'s (attention scores: eager's, SDPA's math path's).
    kept_per_seq: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))
    offloaded_per_seq: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))
    offloaded_kept_per_seq: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHARDS, 0.0))

    def seq_part(self, part: str) -> dict[str, float] | None:
        """The per-sequence companion of the table ``part`` (None where it has none)."""
        return {"base": self.per_seq, "kept": self.kept_per_seq, "offloaded": self.offloaded_per_seq,
                "offloaded_kept": self.offloaded_kept_per_seq}.get(part)


def _kept(tensor: SavedTensor, modules: tuple[str, ...], policy: str | None = None, compiled: bool = False) -> bool:
    """Whether selective recompute keeps ``tensor``: with modules named, unless one of them
    rebuilds it; in compiled layers its ``compiled_keep`` where the profile states one; under
    torchtitan's per-op policy (``policy`` 'torchtitan-op') its ``op_keep`` where the profile
    states one; else the runtime's own policy (its ``keep`` flag)."""
    if modules:
        return not (tensor.recomputed_by & set(modules))
    if compiled and tensor.compiled_keep is not None:
        return tensor.compiled_keep
    if policy == "torchtitan-op" and tensor.op_keep is not None:
        return tensor.op_keep
    return tensor.keep


def _op_keep(value: Any, source: str, name: str, field_name: str = "op_keep") -> bool | None:
    """An entry's ``op_keep`` (or ``compiled_keep``): keep or recompute (None where not given)."""
    if value is None:
        return None
    if value not in ("keep", "recompute"):
        raise NdplanError(f"{source}: entry '{name}' has {field_name} {value!r}; give keep or recompute")
    return bool(value == "keep")


def _width_or_act(value: Any, source: str, name: str) -> str | float | None:
    """A width given as ``act`` or a number of bytes (None: not given)."""
    if value is None or value == "act":
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NdplanError(f"{source}: entry '{name}' has width {value!r}; give a number of bytes or 'act'") from None


def _width(value: str | float, activation_bytes: int) -> float:
    """Bytes per element of an entry's width: ``act`` (the activation dtype's) or a number."""
    return float(activation_bytes) if value == "act" else float(value)


def _block_bytes(entries: tuple[SavedTensor, ...], symbols: dict[str, float], activation_bytes: int,
                 modules: tuple[str, ...] = (), offload: tuple[str, ...] = (), fp8: bool = False,
                 loss_upcast: bool = True, policy: str | None = None, compiled: bool = False) -> BlockBytes:
    base = dict.fromkeys(SHARDS, 0.0)
    per_seq = dict.fromkeys(SHARDS, 0.0)
    kept = dict.fromkeys(SHARDS, 0.0)
    weight_input = dict.fromkeys(SHARDS, 0.0)
    read_last = dict.fromkeys(SHARDS, 0.0)
    past_weights = dict.fromkeys(SHARDS, 0.0)
    offloaded = dict.fromkeys(SHARDS, 0.0)
    offloaded_kept = dict.fromkeys(SHARDS, 0.0)
    kept_per_seq = dict.fromkeys(SHARDS, 0.0)
    offloaded_per_seq = dict.fromkeys(SHARDS, 0.0)
    offloaded_kept_per_seq = dict.fromkeys(SHARDS, 0.0)
    for tensor in entries:
        if not loss_upcast and tensor.no_upcast_bytes is not None:
            width = _width(tensor.no_upcast_bytes, activation_bytes)
        elif fp8 and tensor.fp8_bytes is not None:
            width = _width(tensor.fp8_bytes, activation_bytes)
        elif compiled and tensor.compiled_bytes is not None:
            width = _width(tensor.compiled_bytes, activation_bytes)
        else:
            width = _width(tensor.bytes, activation_bytes)
        # what is kept without recompute, where a compiled fp8 layer keeps less than it keeps under
        # selective recompute (``width``)
        whole = width
        if compiled and fp8 and tensor.compiled_fp8_bytes is not None:
            whole = _width(tensor.compiled_fp8_bytes, activation_bytes)
        at_zero = evaluate(tensor.elements, {**symbols, "seq": 0.0})
        slope = evaluate(tensor.elements, {**symbols, "seq": 1.0}) - at_zero
        base[tensor.shard] += at_zero * whole
        per_seq[tensor.shard] += slope * whole
        if _kept(tensor, modules, policy, compiled):
            kept[tensor.shard] += at_zero * width
            kept_per_seq[tensor.shard] += slope * width
        if tensor.weight_input:
            weight_input[tensor.shard] += at_zero * whole
        if tensor.read_last:
            read_last[tensor.shard] += at_zero * whole
        if tensor.past_weights:
            past_weights[tensor.shard] += at_zero * whole
        if tensor.offloaded_by & set(offload):
            offloaded[tensor.shard] += at_zero * width
            offloaded_per_seq[tensor.shard] += slope * width
            if _kept(tensor, modules, policy, compiled):
                offloaded_kept[tensor.shard] += at_zero * width
                offloaded_kept_per_seq[tensor.shard] += slope * width
    return BlockBytes(base, per_seq, kept, weight_input, read_last, past_weights, offloaded, offloaded_kept,
                      kept_per_seq, offloaded_per_seq, offloaded_kept_per_seq)


@lru_cache(maxsize=256)
def block_coefficients(model: ModelSpec, profile: RuntimeProfile, activation_bytes: int,
                       recompute_modules: tuple[str, ...] = (), offload_modules: tuple[str, ...] = (),
                       fp8: bool = False, loss_upcast: bool = True,
                       selective_policy: str | None = None, moe_dispatcher: str = "alltoall",
                       compiled: bool = False, compiled_loss: bool = False,
                       modules: str = "eager") -> dict[str, BlockBytes]:
    """Every block of the profile, evaluated for ``model`` (cached per model and profile); the
    bytes selective recompute keeps (``BlockBytes.kept``) are those of ``recompute_modules``,
    the bytes moved to the host (``BlockBytes.offloaded``) those of ``offload_modules``; with
    ``fp8`` (the GEMMs run in fp8) an entry's ``fp8_bytes`` replace its width, without
    ``loss_upcast`` its ``no_upcast_bytes``; ``selective_policy`` 'torchtitan-op' keeps the
    entries' ``op_keep`` where they state one. ``moe_dispatcher`` 'allgather' adds the
    ``moe_allgather`` block's tensors (what Megatron's allgather dispatcher keeps) to ``moe``'s.
    ``compiled`` (torch.compile of the decoder layers) prices the entries' ``compiled_bytes`` and
    ``compiled_keep`` where they state them (with ``fp8``, ``compiled_fp8_bytes`` too),
    ``compiled_loss`` (of the loss) those of the loss's own blocks (``COMPILED_LOSS_BLOCKS``).
    ``modules`` 'te' sets the profile's module symbols (``fused_norm``, ``weighted_experts``) to 1:
    Transformer Engine's norms and the fused, probability-weighted expert activation
    (``MemoryOptions.modules``)."""
    if recompute_modules and not profile.recompute_modules:
        raise NdplanError(f"recompute modules ({' '.join(recompute_modules)}) are Megatron-Core's --recompute-modules; "
                          f"runtime '{profile.name}' recomputes by its own selective policy only (use runtime megatron)")
    if offload_modules and not profile.offloads:
        raise NdplanError(f"offload modules ({' '.join(offload_modules)}) are Megatron-Core's fine-grained activation "
                          f"offloading; runtime '{profile.name}' has no such feature (use runtime megatron)")
    te = 1.0 if modules == "te" else 0.0
    symbols = {**model_symbols(model), "fused_norm": te, "weighted_experts": te}
    blocks = dict(profile.blocks)
    if moe_dispatcher == "allgather":
        blocks["moe"] = blocks.get("moe", ()) + blocks.get("moe_allgather", ())
    # (the loss is compiled apart from the layers, by its own flag: what it saves and its forward
    # and backward working sets; DTensor's vocabulary-parallel loss is not priced compiled)
    coefficients = {block: _block_bytes(entries, symbols, activation_bytes, recompute_modules, offload_modules, fp8,
                                        loss_upcast, selective_policy,
                                        compiled_loss if block in COMPILED_LOSS_BLOCKS
                                        else compiled and block not in LOSS_BLOCKS)
                    for block, entries in blocks.items()}
    # the final norm is a norm outside the layers, eager where they are compiled
    coefficients["final_norm"] = (_block_bytes(blocks["norm"], symbols, activation_bytes, recompute_modules,
                                               offload_modules, fp8, loss_upcast, selective_policy)
                                  if compiled else coefficients["norm"])
    return coefficients
