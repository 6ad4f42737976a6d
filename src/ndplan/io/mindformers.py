"""Read and write MindFormers training YAML (MindSpore).

Understood: ``parallel_config`` (data_parallel, model_parallel, pipeline_stage, context_parallel
with its algorithm, expert_parallel, micro_batch_num, use_seq_parallel, vocab_emb_dp,
seq_split_num), ``parallel`` (enable_parallel_optimizer and its gradient_accumulation_shard /
optimizer_weight_shard_size, pipeline_config interleave and scheduler), ``recompute_config``
(recompute / select_recompute as switches, per-stage counts or per-chunk lists),
``runner_config`` (batch_size, gradient_accumulation_steps), ``model.model_config`` (the
architecture, seq_length, pp_interleave_num, offset, param_init_type, compute_dtype) and
``moe_config``. MindSpore's parallel optimizer shards parameters and optimizer states;
ndplan prices it as ZeRO-1, or ZeRO-3 with gradient_accumulation_shard.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from ndplan.io.common import (
    MAX_DEGREE,
    ReadResult,
    Section,
    Source,
    Stated,
    document_source,
    layer_counts,
    load_yaml,
    make_policy,
    merge_model,
    policy_of,
    precision_setting,
    set_placement,
)
from ndplan.model.spec import MAX_LAYERS, ModelSpec
from ndplan.strategy.strategy import Strategy

FORMAT = "mindformers"

_PARALLEL_CONFIG = {
    "data_parallel", "model_parallel", "pipeline_stage", "context_parallel", "expert_parallel", "micro_batch_num",
    "seq_split_num", "recompute", "use_seq_parallel", "optimizer_shard", "gradient_aggregation_group",
    "vocab_emb_dp", "context_parallel_algo", "ulysses_degree_in_cp", "mem_coeff", "use_pipeline_zero",
}
_RECOMPUTE = {"recompute", "select_recompute", "select_comm_recompute", "parallel_optimizer_comm_recompute",
              "mp_comm_recompute", "recompute_slice_activation", "select_recompute_exclude",
              "select_comm_recompute_exclude"}
_TOP_LEVEL = {
    "seed", "output_dir", "load_checkpoint", "load_ckpt_format", "src_strategy_path_or_dir", "auto_trans_ckpt",
    "only_save_strategy", "resume_training", "use_parallel", "run_mode", "trainer", "runner_config", "optimizer",
    "lr_schedule", "train_dataset", "train_dataset_task", "eval_dataset", "eval_dataset_task", "context",
    "parallel_config", "micro_batch_interleave_num", "parallel", "recompute_config", "model", "moe_config",
    "gradient_accumulation_steps",
    "callbacks", "runner_wrapper", "profile", "profile_start_step", "profile_stop_step", "init_start_profile",
    "profile_communication", "profile_memory", "metric", "processor", "do_eval", "eval_step_interval",
    "eval_epoch_interval", "transform_process_num", "remove_redundancy", "swap_config", "monitor_config",
    "tensorboard", "use_legacy", "pretrained_model_dir", "load_ckpt_async", "ignore_data_skip", "data_skip_steps",
    "train_precision_sync", "infer_precision_sync", "postprocess_use_numpy", "print_separate_loss",
    "use_graceful_exit", "check_for_nan_in_loss_and_grad", "local_rank", "device_num", "save_file",
    "ckpt_use_legacy_format", "layer_scale", "layer_decay", "lr_scale", "lr_scale_factor", "filepath_prefix",
    "autoresume_filepath", "skip_trainer_ckpt",
}
#: model_config keys with no effect on memory or time as ndplan models them.
_MODEL_QUIET = {
    "type", "auto_register", "batch_size", "rms_norm_eps", "norm_eps", "layernorm_epsilon", "bos_token_id",
    "eos_token_id", "pad_token_id", "ignore_token_id", "layernorm_compute_type", "softmax_compute_type",
    "rotary_dtype", "router_dense_type", "use_past", "extend_method", "use_flash_attention", "use_fused_swiglu",
    "use_fused_rope", "input_sliced_sig", "checkpoint_name_or_path", "theta", "rope_theta", "return_extra_loss",
    "mtp_loss_factor", "scaling_factor", "is_dynamic", "repetition_penalty", "max_decode_length", "top_k", "top_p",
    "do_sample", "block_size", "num_blocks", "use_rope_slice", "fused_rms_norm", "rmsnorm_compute_2d",
    "qkv_concat", "init_method_std", "initializer_range", "hidden_dropout_rate", "attention_dropout_rate",
    "fine_grain_interleave", "residual_dtype", "embedding_init_type", "calculate_per_token_loss", "llm_backend",
    "chunk_prefill", "return_hidden_states", "use_attn_mask_compression", "use_eod_attn_mask_compression",
    "use_ring_attention", "rope_scaling", "rotary_emb_base", "use_fused_ops_permute", "pipeline_stage",
    "parallel_optimizer", "max_position_embedding", "model_name", "compute_in_2d", "mtp_depth",
    "num_nextn_predict_layers", "offset", "pp_interleave_num", "seq_length", "param_init_type", "params_dtype",
    "compute_dtype", "use_gmm",
}
_MOE_QUIET = {
    "expert_group_size", "aux_loss_factor", "routing_policy", "balance_via_topk_bias", "topk_bias_update_rate",
    "use_fused_ops_topkrouter", "routed_scaling_factor", "norm_topk_prob", "aux_loss_factors", "aux_loss_types",
    "use_gating_sigmoid", "callback_moe_droprate", "use_gmm", "use_fused_ops_permute", "enable_gmm_safe_tokens",
    "enable_deredundency", "npu_nums_per_device", "router_dense_type", "z_loss_factor", "topk_method", "n_group",
    "topk_group", "group_wise_a2a", "enable_sdrop", "comp_comm_parallel", "comp_comm_parallel_degree",
    "use_allgather_dispatcher", "shared_expert_gate",
}
_SCHEDULERS = {"1f1b": "1f1b", "gpipe": "gpipe", "seqpipe": "seq1f1b", "seqvpp": "seq1f1b",
               "seqsmartvpp": "seq1f1b", "zero_bubble_v": "zbv"}
_CP_ALGOS = {"colossalai_cp": "ring", "ulysses_cp": "ulysses", "hybrid_cp": "hybrid"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------- offsets (shared with HyperParallel)
def counts_from_offset(section: Section, key: str, offset: Any, units: int, pp: int, vpp: int) -> list[int]:
    """Layers per virtual stage (model order) from MindFormers' ``offset``: every (mini-)stage holds
    units // (pp·vpp) layers plus its offset; an int or per-stage list is broadcast over chunks."""
    stages = pp * vpp
    base = units // stages
    if isinstance(offset, bool) or offset is None:
        raise section.error(key, f"expected an int or a list of ints, got {offset!r}")
    if isinstance(offset, int):
        grid = [[offset] * pp for _ in range(vpp)]
    elif isinstance(offset, list) and all(isinstance(o, int) and not isinstance(o, bool) for o in offset):
        if len(offset) != pp:
            raise section.error(key, f"has {len(offset)} entries but pipeline_stage is {pp}")
        grid = [list(offset) for _ in range(vpp)]
    elif isinstance(offset, list) and all(isinstance(row, list) for row in offset):
        if len(offset) != vpp or any(len(row) != pp for row in offset):
            raise section.error(key, f"expected {vpp} rows of {pp} offsets (pp_interleave_num × pipeline_stage)")
        if not all(isinstance(o, int) and not isinstance(o, bool) for row in offset for o in row):
            raise section.error(key, "expected integers")
        grid = [list(row) for row in offset]
    else:
        raise section.error(key, f"expected an int or a list of ints, got {offset!r}")
    total = sum(sum(row) for row in grid)
    if total != units % stages:
        raise section.error(key, f"offsets sum to {total} but must sum to {units} % (pp·vpp = {stages}) = {units % stages}")
    counts = [base + o for row in grid for o in row]
    if min(counts) < 0:
        raise section.error(key, f"gives a stage a negative layer count: {counts}")
    return counts


def offsets_for(counts: list[int], units_extra_last: int, pp: int, vpp: int) -> list[Any]:
    """The ``offset`` that reproduces ``counts`` (MTP units, if counted, ride on the last stage)."""
    units = [*counts]
    units[-1] += units_extra_last
    base = sum(units) // len(units)
    offsets = [u - base for u in units]
    if vpp == 1:
        return offsets
    return [offsets[v * pp:(v + 1) * pp] for v in range(vpp)]


# ---------------------------------------------------------------- model
def _model(cfg: Section, moe: Section, base: ModelSpec | None, src: Source, name: str, warnings: list[str]) -> ModelSpec | None:
    stated: Stated = {}

    def put(key: str, value: Any, label: str) -> None:
        if value is not None:
            stated[key] = (value, f"{cfg.label(label) if label in cfg.data else label}")

    layers = cfg.integer("num_layers", "num_hidden_layers", maximum=MAX_LAYERS)
    hidden = cfg.integer("hidden_size")
    heads = cfg.integer("num_heads", "num_attention_heads")
    put("num_layers", layers, "num_layers")
    put("hidden_size", hidden, "hidden_size")
    put("num_attention_heads", heads, "num_heads")
    put("vocab_size", cfg.integer("vocab_size"), "vocab_size")
    put("max_position_embeddings", cfg.integer("max_position_embeddings", minimum=0), "max_position_embeddings")
    kv_lora = cfg.integer("kv_lora_rank", minimum=0) or 0
    if kv_lora:
        rope = cfg.integer("qk_rope_head_dim", default=64) or 64
        nope = cfg.integer("qk_nope_head_dim", default=128) or 128
        put("kv_lora_rank", kv_lora, "kv_lora_rank")
        put("q_lora_rank", cfg.integer("q_lora_rank", default=0, minimum=0), "q_lora_rank")
        put("qk_rope_head_dim", rope, "qk_rope_head_dim")
        put("qk_nope_head_dim", nope, "qk_nope_head_dim")
        put("v_head_dim", cfg.integer("v_head_dim", default=128), "v_head_dim")
        put("head_dim", rope + nope, "qk_nope_head_dim")
        put("num_kv_heads", heads, "num_heads")
        cfg.get("n_kv_heads", "num_key_value_heads")  # MLA: every head has its own latent K/V
    else:
        put("num_kv_heads", cfg.integer("n_kv_heads", "num_key_value_heads"), "n_kv_heads")
        head_dim = cfg.integer("head_dim")
        if head_dim is None and hidden and heads:
            head_dim = hidden // heads
        put("head_dim", head_dim, "head_dim")
    ffn = cfg.integer("intermediate_size", "ffn_hidden_size")
    multiple = cfg.integer("multiple_of", default=256) or 256
    fdm = cfg.get("ffn_dim_multiplier")
    if ffn is None and hidden and base is None:
        # Llama's rule: 2/3 of 4h, scaled by ffn_dim_multiplier, rounded up to multiple_of.
        dense = int(2 * 4 * hidden / 3)
        if fdm:
            dense = int(float(fdm) * dense)
        ffn = multiple * math.ceil(dense / multiple)
    put("ffn_hidden_size", ffn, "intermediate_size")
    bias = cfg.boolean("qkv_has_bias", "qkv_bias", "attention_bias")
    put("qkv_bias", bias, "qkv_has_bias")
    put("o_bias", cfg.boolean("attn_proj_has_bias"), "attn_proj_has_bias")
    put("tie_word_embeddings", cfg.boolean("tie_word_embeddings"), "tie_word_embeddings")
    if not kv_lora:
        put("qk_norm", cfg.boolean("qk_layernorm", "qk_norm", "use_qk_norm"), "qk_layernorm")
    mtp = cfg.integer("mtp_depth", "num_nextn_predict_layers", minimum=0, maximum=MAX_LAYERS)
    put("mtp_depth", mtp, "mtp_depth")
    activation = cfg.text("hidden_act")
    if activation is not None:
        if activation.lower() == "swiglu":  # MindFormers' name for the gated SiLU of Llama/Qwen MLPs
            put("activation", "silu", "hidden_act swiglu")
            put("gated_mlp", True, "hidden_act swiglu")
        else:
            put("activation", activation, "hidden_act")

    experts = moe.integer("expert_num", minimum=0) or 0
    if experts > 1:
        stated["num_experts"] = (experts, moe.label("expert_num"))
        topk = moe.integer("num_experts_chosen", default=1) or 1
        stated["num_experts_per_tok"] = (topk, moe.label("num_experts_chosen"))
        width = moe.integer("moe_intermediate_size") or ffn
        if width:
            stated["moe_ffn_hidden_size"] = (width, moe.label("moe_intermediate_size"))
        shared = moe.integer("shared_expert_num", default=0, minimum=0) or 0
        stated["num_shared_experts"] = (shared, moe.label("shared_expert_num"))
        stated["shared_expert_ffn_hidden_size"] = (width if shared else 0, moe.label("shared_expert_num"))
        count = layers or (base.num_layers if base else None)
        if count:
            first = moe.integer("first_k_dense_replace", default=0, minimum=0) or 0
            stated["layer_mlp_kinds"] = (tuple("dense" if i < first else "moe" for i in range(count)),
                                         moe.label("first_k_dense_replace"))
        capacity = moe.get("capacity_factor")
        if capacity is not None and float(capacity) > 0:
            warnings.append(f"{src.where(moe.line('capacity_factor'))}: moe_config.capacity_factor={capacity}: "
                            "expert capacity is not modelled; ndplan assumes dropless, balanced routing")
    moe.get("expert_model_parallel")

    def defaults(values: dict[str, Any]) -> dict[str, Any]:
        return {"num_kv_heads": values["num_attention_heads"], "norm": "rmsnorm", "activation": "silu",
                "gated_mlp": True, "head_dim": values["hidden_size"] // values["num_attention_heads"]}

    model = merge_model(src, stated, base, name=name, model_type="mindformers", defaults=defaults,
                        warnings=warnings, origin="the YAML")
    for key in cfg.unused(_MODEL_QUIET | {"multiple_of", "ffn_dim_multiplier", "head_dim"}):
        warnings.append(f"{src.where(cfg.line(key))}: {cfg.label(key)}: unknown to ndplan; ignored")
    for key in moe.unused(_MOE_QUIET | {"capacity_factor", "first_k_dense_replace"}):
        warnings.append(f"{src.where(moe.line(key))}: {moe.label(key)}: unknown to ndplan; ignored")
    return model


# ---------------------------------------------------------------- recompute
def _recompute_layers(section: Section, key: str, value: Any, counts: list[int], pp: int, vpp: int,
                      warnings: list[str]) -> str | int:
    """'none', 'all', or layers per virtual stage from a MindFormers recompute value: a switch,
    per-stage counts (split over a stage's chunks) or per-chunk lists ``[vpp][pp]``."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "all"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return "all"
    if isinstance(value, dict):
        return "all" if value else "none"
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) != vpp or any(len(row) != pp for row in value):
            raise section.error(key, f"expected {vpp} rows of {pp} counts (pp_interleave_num × pipeline_stage)")
        raw, totals, per_chunk = [v for row in value for v in row], counts, 1
    elif isinstance(value, list) and all(isinstance(v, (bool, int)) for v in value):
        if len(value) != pp:
            raise section.error(key, f"has {len(value)} entries but pipeline_stage is {pp}")
        raw, per_chunk = list(value), vpp
        totals = [sum(counts[v * pp + i] for v in range(vpp)) for i in range(pp)]
    else:
        raise section.error(key, f"expected true/false, a per-stage list or per-chunk lists, got {value!r}")
    wanted = [total if v is True else 0 if v is False else int(v) for v, total in zip(raw, totals, strict=True)]
    # A count at or above a stage's layers means "all of them" and fits any larger limit.
    exact = {v for v, total in zip(wanted, totals, strict=True) if v < total}
    if not exact:
        return "all"
    limit = min(exact)
    if len(exact) == 1 and all(v < total or total <= limit for v, total in zip(wanted, totals, strict=True)):
        return math.ceil(limit / per_chunk) or "none"  # one count is every stage's
    # Not one count: the first stage's, where 1F1B keeps the most micro-batches (the peak's stage).
    first = "all" if wanted[0] >= totals[0] else math.ceil(wanted[0] / per_chunk) or "none"
    warnings.append(f"{section.src.where(section.line(key))}: {section.label(key)}: per-stage counts {value} are not "
                    f"representable; ndplan recomputes {'no' if first == 'none' else first} layers on every stage "
                    "(the first stage's count, where 1F1B keeps the most micro-batches)")
    return first


def read(path: Path, text: str, base: ModelSpec | None, devices: int | None) -> ReadResult:
    data = load_yaml(path, text)
    src = document_source(path, text, "yaml")
    if not isinstance(data, dict):
        raise src.error("document", f"expected a mapping, got {type(data).__name__}")
    warnings: list[str] = []
    notes: list[str] = []
    root = Section(src, data, ())
    pc = root.sub("parallel_config")
    par = root.sub("parallel")
    rc = root.sub("recompute_config")
    runner = root.sub("runner_config")
    model_section = root.sub("model")
    cfg = model_section.sub("model_config")
    moe = root.sub("moe_config")
    context = root.sub("context")
    trainer = root.sub("trainer")
    name = str(trainer.get("model_name") or cfg.get("type") or path.stem)
    model = _model(cfg, moe, base, src, name, warnings)
    settings: dict[str, Any] = {}

    dp = pc.integer("data_parallel", default=1, maximum=MAX_DEGREE) or 1
    tp = pc.integer("model_parallel", default=1, maximum=MAX_DEGREE) or 1
    pp = pc.integer("pipeline_stage", default=1, maximum=MAX_DEGREE) or 1
    cp = pc.integer("context_parallel", default=1, maximum=MAX_DEGREE) or 1
    ep = pc.integer("expert_parallel", default=1, maximum=MAX_DEGREE) or 1
    world = dp * tp * pp * cp
    if devices is not None and devices != world:
        raise pc.error("data_parallel", f"data·model·pipeline·context parallel = {world} but --devices is {devices}")
    etp = moe.integer("expert_model_parallel", maximum=MAX_DEGREE)
    settings.update(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp if etp is not None else tp)
    sp = bool(pc.boolean("use_seq_parallel", default=False))
    if sp and tp == 1:
        notes.append("use_seq_parallel has no effect with model_parallel=1")
        sp = False
    settings["sp"] = sp
    if pc.boolean("vocab_emb_dp", default=True) and tp > 1:
        warnings.append(f"{src.where(pc.line('vocab_emb_dp'))}: "
                        "parallel_config.vocab_emb_dp (default true) keeps the embedding whole across "
                        "model_parallel ranks; ndplan shards it over tp")
    if cp > 1:
        algo = pc.text("context_parallel_algo", default="colossalai_cp") or "colossalai_cp"
        if algo not in _CP_ALGOS:
            raise pc.error("context_parallel_algo", f"unknown algorithm {algo!r}; known: {', '.join(_CP_ALGOS)}")
        settings["cp_kind"] = _CP_ALGOS[algo]
        if algo == "colossalai_cp":
            notes.append("context_parallel_algo colossalai_cp is priced as ring attention")
        if algo == "hybrid_cp":
            # TransformerOpParallelConfig's default ulysses_degree_in_cp is 1.
            settings["ulysses_degree"] = pc.integer("ulysses_degree_in_cp", default=1, maximum=MAX_DEGREE) or 1
    pc.get("context_parallel_algo", "ulysses_degree_in_cp", "gradient_aggregation_group", "mem_coeff",
           "optimizer_shard", "use_pipeline_zero")

    _pipeline(pc, par, cfg, settings, model, warnings)
    _sharding(par, settings, warnings)
    _recompute(rc, pc, settings, _virtual_counts(settings, model), warnings)
    settings["precision"] = precision_setting(_precision(cfg))
    settings["optimizer_offload"] = False
    interleave = root.integer("micro_batch_interleave_num", default=1, maximum=MAX_DEGREE) or 1
    _batch(pc, runner, root, cfg, settings, warnings, interleave)

    runtime: dict[str, Any] = {}
    if cfg.boolean("use_flash_attention") is False:
        runtime["attention"] = "eager"
        notes.append("use_flash_attention false: attention keeps its s x s softmax (--attention eager)")
    # MindFormers' head shards the logits over model_parallel unless vocab_emb_dp keeps the
    # embedding (and head) whole, and its cross-entropy works on them sharded (dp·cp, mp).
    runtime["loss_parallel"] = not pc.boolean("vocab_emb_dp", default=True)
    if interleave > 1:
        warnings.append(f"{src.where(root.line('micro_batch_interleave_num'))}: micro_batch_interleave_num "
                        f"{interleave} feeds batch_size·{interleave} samples per micro-batch and splits them "
                        f"{interleave} ways inside one graph for overlap; priced as micro-batches of "
                        f"{settings['mbs']} (the overlap is not modelled)")
    swap = root.get("swap_config")
    if isinstance(swap, dict) and swap.get("swap"):
        warnings.append(f"{src.where(root.line('swap_config'))}: swap_config: activation swapping to the host is "
                        "not modelled")
    memory = context.get("max_device_memory")
    if memory:
        notes.append(f"context.max_device_memory {memory} caps the device memory MindSpore may use")
    pc.check_known(_PARALLEL_CONFIG)
    rc.check_known(_RECOMPUTE)
    for key in data:
        if key not in _TOP_LEVEL:
            warnings.append(f"{src.where(root.line(key))}: {key}: unknown section; ignored")
    return ReadResult(format=FORMAT, source=src.name, model=model, strategy_settings=settings, devices=world,
                      warnings=warnings, notes=notes, runtime_settings=runtime)


def _pipeline(pc: Section, par: Section, cfg: Section, settings: dict[str, Any], model: ModelSpec | None,
              warnings: list[str]) -> None:
    pp = settings["pp"]
    pipeline = par.sub("pipeline_config")
    interleave = pipeline.boolean("pipeline_interleave", default=False)
    vpp = cfg.integer("pp_interleave_num", default=1, maximum=MAX_DEGREE) or 1
    if vpp > 1 and not interleave:
        warnings.append(f"{cfg.src.where(cfg.line('pp_interleave_num'))}: pp_interleave_num {vpp} without "
                        "parallel.pipeline_config.pipeline_interleave: MindSpore ignores it")
        vpp = 1
    scheduler = pipeline.text("pipeline_scheduler", default="1f1b") or "1f1b"
    if scheduler not in _SCHEDULERS:
        raise pipeline.error("pipeline_scheduler", f"unknown scheduler {scheduler!r}; known: {', '.join(_SCHEDULERS)}")
    schedule = _SCHEDULERS[scheduler]
    chunks = pc.integer("seq_split_num") or pipeline.integer("seq_split_num", default=1) or 1
    if pp == 1:
        settings.update(vpp=1, schedule="1f1b")
        set_placement(settings, None, model.num_layers if model else None)
        return
    if schedule == "1f1b" and vpp > 1:
        schedule = "interleaved"
    if schedule == "zbv" and vpp != 2:
        raise cfg.error("pp_interleave_num", f"zero_bubble_v runs two chunks per stage, got {vpp}")
    if schedule == "seq1f1b":
        settings["seq_chunks"] = chunks
        if vpp > 1:
            warnings.append(f"{pipeline.src.where(pipeline.line('pipeline_scheduler'))}: {scheduler} with "
                            f"pp_interleave_num {vpp}: ndplan prices Seq1F1B on one chunk per stage")
            vpp = 1
    settings.update(vpp=vpp, schedule=schedule)
    offset = cfg.get("offset")
    if model is None:
        if offset not in (None, 0):
            warnings.append(f"{cfg.src.where(cfg.line('offset'))}: model_config.offset needs the model's layer count; "
                            "give --model")
        set_placement(settings, None, None)
        return
    mtp = cfg.integer("mtp_depth", minimum=0, maximum=MAX_LAYERS) or 0  # counted in the offsets (num_nextn_predict_layers is not)
    units = model.num_layers + mtp
    counts = counts_from_offset(cfg, "offset", 0 if offset is None else offset, units, pp, vpp)
    counts[-1] -= mtp
    if counts[-1] < 0:
        raise cfg.error("offset", "leaves no room for the MTP layers on the last stage")
    set_placement(settings, counts, model.num_layers)


def _sharding(par: Section, settings: dict[str, Any], warnings: list[str]) -> None:
    opt = par.sub("parallel_optimizer_config")
    enabled = par.boolean("enable_parallel_optimizer", default=False)
    grad_shard = opt.boolean("gradient_accumulation_shard", default=False)
    group = opt.integer("optimizer_weight_shard_size", minimum=-1)
    zero = 0
    if enabled:
        zero = 3 if grad_shard else 1
        if not grad_shard:
            warnings.append(f"{par.src.where(par.line('enable_parallel_optimizer'))}: MindSpore's parallel optimizer "
                            "also shards the parameters; without gradient_accumulation_shard ndplan prices ZeRO-1")
    settings.update(zero=zero, fsdp=False, reshard=True)
    replicas = settings["dp"] * settings["cp"]
    if zero and group and group > 0 and group < replicas:
        if replicas % group:
            raise opt.error("optimizer_weight_shard_size", f"{group} does not divide the {replicas} data-parallel ranks")
        where = par.src.where(opt.line("optimizer_weight_shard_size"))
        expert_width = settings["ep"] * settings["etp"]
        expert_ranks = replicas * settings["tp"] // expert_width
        if expert_width > 1 and (group * settings["tp"]) % expert_width:
            # ndplan's shard groups hold whole expert groups (torchtitan, Megatron); MindSpore
            # shards each parameter over its own data-parallel group instead. The smallest group
            # that holds them and divides the replicas prices closest.
            tp = settings["tp"]
            larger = math.lcm(group * tp, expert_width) // tp
            fits = larger < replicas and replicas % larger == 0
            priced = f"shard groups of {larger}" if fits else f"all {replicas} data-parallel ranks"
            warnings.append(f"{where}: optimizer_weight_shard_size {group}: ndplan shards over whole expert groups "
                            f"(shard_group·tp a multiple of ep·etp = {expert_width}); priced over {priced}, which "
                            "under-states the sharded states per device (optimizer states; with "
                            "gradient_accumulation_shard also parameters and gradients)")
            if fits:
                settings["shard_group"] = larger
            return
        settings["shard_group"] = group
        if expert_width > 1:
            mindspore = group if expert_ranks % group == 0 else expert_ranks
            ndplan = group * settings["tp"] // expert_width
            if mindspore != ndplan:
                warnings.append(f"{where}: MindSpore shards the experts' states over {mindspore} of their "
                                f"{expert_ranks} data-parallel ranks (optimizer_weight_shard_size {group}); ndplan "
                                f"prices {ndplan}, shard_group·tp/(ep·etp)")


def _virtual_counts(settings: dict[str, Any], model: ModelSpec | None) -> list[int]:
    pp, vpp = settings["pp"], settings["vpp"]
    if model is None:
        return [10 ** 9] * (pp * vpp)
    s = Strategy(pp=pp, vpp=vpp, schedule=settings["schedule"], stage_layers=settings.get("stage_layers"),
                 embedding_as_layer=settings.get("embedding_as_layer", False),
                 output_as_layer=settings.get("output_as_layer", False))
    return list(layer_counts(s, model.num_layers))


def _recompute(rc: Section, pc: Section, settings: dict[str, Any], counts: list[int], warnings: list[str]) -> None:
    pp, vpp = settings["pp"], settings["vpp"]
    source, key = (rc, "recompute") if "recompute" in rc else (pc, "recompute")
    full = _recompute_layers(source, key, source.get(key), counts, pp, vpp, warnings)
    selective = _recompute_layers(rc, "select_recompute", rc.get("select_recompute"), counts, pp, vpp, warnings)
    if selective != "none":
        warnings.append(f"{rc.src.where(rc.line('select_recompute'))}: recompute_config.select_recompute recomputes "
                        "chosen operators (default: the SwiGLU activation); ndplan prices selective recompute of "
                        "the attention core")
    rc.get("select_comm_recompute", "parallel_optimizer_comm_recompute", "mp_comm_recompute",
           "select_recompute_exclude", "select_comm_recompute_exclude")
    if rc.get("recompute_slice_activation"):
        warnings.append(f"{rc.src.where(rc.line('recompute_slice_activation'))}: recompute_slice_activation splits "
                        "the saved recompute inputs over the model-parallel group; not modelled (ndplan keeps them whole)")
    if full != "none":
        if selective != "none" and full != "all":
            warnings.append(f"{rc.src.where(rc.line('select_recompute'))}: select_recompute on the layers not fully "
                            "recomputed is not represented")
        settings.update(recompute="full", recompute_layers=0 if full == "all" else full)
    elif selective != "none":
        settings.update(recompute="selective", recompute_layers=0 if selective == "all" else selective)
    else:
        settings.update(recompute="none", recompute_layers=0)


def _precision(cfg: Section) -> Any:
    param = cfg.text("param_init_type", "params_dtype", default="float32") or "float32"
    compute = cfg.text("compute_dtype", default="bfloat16") or "bfloat16"
    param_key = cfg.first("param_init_type", "params_dtype") or "param_init_type"
    for key, value in ((param_key, param), ("compute_dtype", compute)):
        if value not in _DTYPE_BYTES:
            raise cfg.error(key, f"expected float32, bfloat16 or float16, got {value!r}")
    width = _DTYPE_BYTES[param]
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[compute]
    if width == 4:
        return make_policy(f"mindspore-{dtype}", param_bytes=4, grad_bytes=4, master_weight_bytes=0,
                           optimizer_state_bytes=4, activation_bytes=4 if dtype == "fp32" else 2,
                           compute_dtype=dtype, param_gather_bytes=4 if dtype == "fp32" else 2)
    return make_policy(f"mindspore-{dtype}-pure", param_bytes=2, grad_bytes=2, master_weight_bytes=0,
                       optimizer_state_bytes=2, compute_dtype=dtype)


def _batch(pc: Section, runner: Section, root: Section, cfg: Section, settings: dict[str, Any],
           warnings: list[str], interleave: int) -> None:
    # MindFormers' global batch is batch_size · data_parallel · micro_batch_interleave_num times
    # micro_batch_num (pipeline) or gradient_accumulation_steps (base_trainer
    # _check_global_batch_size_for_auto_parallel): MicroBatchInterleaved splits each micro-batch
    # of batch_size·n into n slices run within the same graph, whose activations live together.
    mbs = (runner.integer("batch_size", default=1) or 1) * interleave
    settings["mbs"] = mbs
    accumulation = runner.integer("gradient_accumulation_steps") or root.integer("gradient_accumulation_steps", default=1) or 1
    micro = pc.integer("micro_batch_num", default=1) or 1
    if settings["pp"] > 1:
        # MindFormers' gradient accumulation does not take effect under pipeline parallelism, where
        # micro_batch_num plays its part (docs/feature_cards/Training_Algorithms.md).
        if accumulation > 1:
            key = "gradient_accumulation_steps"
            where = runner if key in runner else root
            warnings.append(f"{where.src.where(where.line(key))}: {where.label(key)} {accumulation} does not take "
                            "effect with pipeline parallelism (MindFormers: micro_batch_num sets the micro-batches); "
                            f"the step has {micro} micro-batches")
        settings["num_micro_batches"] = micro
    else:
        settings["num_micro_batches"] = accumulation
    settings["gbs"] = settings["dp"] * mbs * settings["num_micro_batches"]
    seq = cfg.integer("seq_length")
    if seq is None:
        dataset = root.get("train_dataset")
        try:
            seq = int(dataset["data_loader"]["config"]["seq_length"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            seq = None
    if seq is not None:
        settings["seq"] = seq
    else:
        warnings.append(f"{cfg.src.name}: no model_config.seq_length; ndplan uses its default unless --seq is given")


# ---------------------------------------------------------------- writing
def emit(model: ModelSpec | None, s: Strategy, *, attention: str = "flash", loss_parallel: bool | None = None) -> str:
    """MindFormers training YAML: ``attention`` as ``use_flash_attention`` (eager: false; sdpa,
    PyTorch's kernel, has no MindSpore counterpart and is said); MindFormers' loss is
    vocabulary-parallel over model_parallel (with vocab_emb_dp false, as written), so
    ``loss_parallel`` False under TP is said."""
    lost: list[str] = []
    notes: list[str] = []
    if attention in ("sdpa", "flex"):
        what = "PyTorch's SDPA as transformers calls it" if attention == "sdpa" else "PyTorch's FlexAttention"
        lost.append(f"{attention} attention (--attention {attention}, {what}); MindFormers runs "
                    "its flash attention (use_flash_attention)")
    if loss_parallel is False and s.tp > 1:
        lost.append("the loss on whole logits (--no-loss-parallel); MindFormers' cross-entropy is vocabulary-parallel "
                    "over model_parallel (vocab_emb_dp false)")
    pc: dict[str, Any] = {"data_parallel": s.dp, "model_parallel": s.tp, "pipeline_stage": s.pp}
    if s.cp > 1:
        pc["context_parallel"] = s.cp
        pc["context_parallel_algo"] = {"ring": "colossalai_cp", "ulysses": "ulysses_cp", "hybrid": "hybrid_cp",
                                       "allgather": "colossalai_cp"}[s.cp_kind]
        if s.cp_kind == "allgather":
            lost.append("all-gather context parallelism (cp_kind allgather: Transformer Engine's and MindSpeed's); "
                        "written as colossalai_cp, which ndplan reads as ring attention")
        if s.cp_kind == "hybrid":
            pc["ulysses_degree_in_cp"] = s.ulysses_degree
    if s.ep > 1:
        pc["expert_parallel"] = s.ep
    pc["micro_batch_num"] = s.micro_batches_per_step if s.pp > 1 else 1
    if s.pipeline_runs > 1:
        lost.append(f"pipeline_runs={s.pipeline_runs} (MindFormers schedules all of a step's micro-batches in one "
                    "pipeline run)")
    pc["use_seq_parallel"] = s.sequence_parallel
    pc["vocab_emb_dp"] = False
    if s.schedule == "seq1f1b":
        pc["seq_split_num"] = s.seq_chunks
    runner: dict[str, Any] = {"batch_size": s.micro_batch_size}
    if s.pp == 1 and s.num_micro_batches > 1:
        runner["gradient_accumulation_steps"] = s.num_micro_batches

    par: dict[str, Any] = {"enable_parallel_optimizer": s.zero > 0}
    if s.zero:
        opt: dict[str, Any] = {"gradient_accumulation_shard": s.zero == 3}
        if s.shard_group:
            opt["optimizer_weight_shard_size"] = s.shard_group
        par["parallel_optimizer_config"] = opt
    if s.zero == 2 or s.fsdp:
        lost.append(f"ZeRO-{s.zero}{' as torch FSDP' if s.fsdp else ''} (MindSpore's parallel optimizer is "
                    "priced as ZeRO-1, or ZeRO-3 with gradient_accumulation_shard)")
    if s.zero == 3 and not s.reshard_after_forward:
        lost.append("keeping parameters gathered after forward")
    if s.optimizer_offload:
        lost.append("optimizer offload")
    if s.pp > 1:
        scheduler = {"1f1b": "1f1b", "interleaved": "1f1b", "gpipe": "gpipe", "seq1f1b": "seqpipe",
                     "zbv": "zero_bubble_v"}.get(s.schedule)
        if scheduler is None:
            lost.append(f"schedule {s.schedule!r}")
            scheduler = "1f1b"
        par["pipeline_config"] = {"pipeline_interleave": s.vpp > 1, "pipeline_scheduler": scheduler}

    rc: dict[str, Any] = {"recompute": False, "select_recompute": False}
    key = "recompute" if s.recompute == "full" else "select_recompute"
    if s.recompute != "none":
        if s.recompute_layers:
            rc[key] = [s.recompute_layers * s.vpp] * s.pp if s.vpp == 1 else [[s.recompute_layers] * s.pp] * s.vpp
        else:
            rc[key] = True
    if s.recompute == "selective":
        notes.append("select_recompute stands for ndplan's selective recompute (MindSpore picks the operators)")
    if s.recompute_modules:
        lost.append(f"Megatron's recompute modules ({' '.join(s.recompute_modules)})")
    if s.offload_modules:
        lost.append(f"activation offload (Megatron-Core only): {' '.join(s.offload_modules)}")
    if s.offload_layers:
        lost.append(f"layer offload (Megatron-Core only): the first {s.offload_layers} layers' activations")
    if s.offload_optimizer_states:
        lost.append("the optimizer states on the host between steps (Megatron-Core's --offload-optimizer-states, "
                    "MindSpeed's --swap-optimizer only)")
    if model is not None and s.tp > model.split_kv_heads:
        lost.append(f"tp={s.tp} above the model's {model.num_kv_heads} KV heads (MindFormers' attention needs "
                    "n_kv_head a multiple of model_parallel; Megatron-Core runs it)")

    cfg: dict[str, Any] = {"seq_length": s.seq_length, "use_flash_attention": attention != "eager"}
    p = policy_of(s.precision)
    if p.param_bytes == 4 and p.master_weight_bytes == 0 and p.grad_bytes == 4 and p.optimizer_state_bytes == 4:
        cfg["param_init_type"] = "float32"
    elif p.param_bytes == 2 and p.master_weight_bytes == 0 and p.grad_bytes == 2 and p.optimizer_state_bytes == 2:
        cfg["param_init_type"] = "bfloat16" if p.compute_dtype != "fp16" else "float16"
    else:
        lost.append(f"precision {p.name!r} (MindSpore keeps parameters, gradients and states in one dtype)")
        cfg["param_init_type"] = "float32"
    cfg["compute_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}[p.compute_dtype]
    if p.compute_dtype == "fp8":
        lost.append("fp8 compute")
    if s.vpp > 1:
        cfg["pp_interleave_num"] = s.vpp
    if s.pp > 1:
        if model is not None:
            counts = list(layer_counts(s, model.num_layers))
            cfg["offset"] = offsets_for(counts, model.mtp_depth, s.pp, s.vpp)
            if model.mtp_depth:
                cfg["mtp_depth"] = model.mtp_depth
        elif s.stage_layers is not None or s.embedding_as_layer or s.output_as_layer:
            lost.append("the uneven layer placement (offsets need the model's layer count)")
    doc: dict[str, Any] = {"runner_config": runner, "parallel_config": pc, "parallel": par, "recompute_config": rc,
                           "model": {"model_config": cfg}}
    if s.etp != s.tp:
        doc["moe_config"] = {"expert_model_parallel": s.etp}
    header = ["# MindFormers parallel settings written by ndplan" + (f" for {model.name}" if model else "")
              + f": {s.short()}", f"# world size: {s.world_size} (msrun --worker_num)"]
    header += [f"# ndplan: not expressible in MindFormers, left out: {item}" for item in lost]
    header += [f"# ndplan: {item}" for item in notes]
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
    return "\n".join(header) + "\n" + body

