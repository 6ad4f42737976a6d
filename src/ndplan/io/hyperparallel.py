"""Read and write HyperParallel (AutoModels-style) training YAML.

Understood: ``accelerator`` degrees (tp/pp/cp/ep sizes, expert_tensor_parallel_degree,
dp_replicate, pp_interleave_num, pp_micro_batch_num, pp_schedule, sequence_parallel,
loss_parallel, the CP algorithm and Ulysses degree); ``fsdp_config`` (dp_shard_size over the
DP×CP ranks, edp_shard_size, reshard_after_forward, mix_precision); ``context.device_num``;
``training`` (global/micro batch, micro_batch_num); ``optimizer`` (Muon, fp32_main_params);
``activation_checkpoint.mode`` (or ``gradient_checkpointing``); the sequence length from the
dataset sections; the model from ``model.pretrained_model_name_or_path``/``config_path``
(a local Hugging Face directory or a Hub id of an ndplan preset), ``config_overrides`` and
``offset``. FSDP/HSDP: dp_shard_size ranks shard each parameter; the DP×CP ranks split into
dp_shard_size-sized shard groups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ndplan.errors import parse_nested, read_text
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
    micro_batches,
    one_rank_sharding,
    policy_of,
    precision_setting,
    set_placement,
    window_lost,
)
from ndplan.io.mindformers import counts_from_offset, offsets_for
from ndplan.memory.static import shard_groups
from ndplan.model.hf import spec_from_hf_config
from ndplan.model.presets import get_preset, preset_index
from ndplan.model.spec import ModelSpec
from ndplan.strategy.strategy import Strategy

FORMAT = "hyperparallel"

_ACCELERATOR = {
    "tp_size", "tp_degree", "tensor_parallel_degree", "pp_size", "pp_degree", "pipeline_parallel_degree",
    "cp_size", "cp_degree", "context_parallel_degree", "ep_size", "ep_degree", "expert_parallel_degree",
    "etp_size", "expert_tensor_parallel_degree", "dp_replicate", "dp_replicate_size", "dp_shard", "dp_shard_size",
    "pp_interleave_num", "pp_vpp", "pp_micro_batch_num", "pp_schedule", "pipeline_scheduler", "sequence_parallel",
    "use_seq_parallel", "loss_parallel", "context_parallel_algo", "cp_algorithm", "ulysses_degree",
    "enable_parallel_optimizer", "optimizer_weight_shard_size", "gradient_accumulation_shard", "seq_split_num",
}
_FSDP = {
    "dp_shard_size", "edp_shard_size", "replicate_params", "reshard_after_forward", "reshard_after_backward",
    "defer_fsdp_grad_sync", "requires_grad_sync", "forward_prefetch_depth", "backward_prefetch_depth", "comm_fusion",
    "mix_precision", "recompute_slice_activation", "cpu_offload",
}
_TRAINING_QUIET = {
    "max_steps", "num_train_epochs", "train_iters", "train_samples", "eval_iters", "backend", "init_device",
    "loss_aggregation", "max_grad_norm", "seed", "enable_full_determinism", "save_steps", "log_steps",
    "eval_steps", "output_dir",
}
_MODEL_KEYS = {
    "_target_", "pretrained_model_name_or_path", "config_path", "config_overrides", "torch_dtype",
    "attn_implementation", "force_hf", "local_files_only", "trust_remote_code", "ignore_mismatched_sizes",
    "validate_placement", "revision", "cache_dir", "subfolder", "token", "offset", "model_init_dtype",
}
#: Hugging Face config keys an override may set, and the ModelSpec field each one is.
_HF_OVERRIDES = {
    "num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_kv_heads", "vocab_size": "vocab_size",
    "head_dim": "head_dim", "moe_intermediate_size": "moe_ffn_hidden_size", "num_experts": "num_experts",
    "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "tie_word_embeddings": "tie_word_embeddings", "max_position_embeddings": "max_position_embeddings",
}
_SCHEDULES = {
    "1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved", "1f1b_interleaved": "interleaved",
    "interleaved1f1b": "interleaved", "vpp": "interleaved", "zbv": "zbv", "zero_bubble_v": "zbv",
    "zbvzerobubble": "zbv", "dualpipev": "dualpipev", "dualpipe_v": "dualpipev", "seqpipe": "seq1f1b",
    "seq1f1b": "seq1f1b", "zb-h1": "zb-h1", "zbh1": "zb-h1", "zero_bubble_h1": "zb-h1",
}
_CP_ALGOS = {"ulysses": "ulysses", "ulysses_cp": "ulysses", "ring": "ring", "ring_cp": "ring",
             "colossal": "ring", "colossalai_cp": "ring", "hybrid": "hybrid", "hybrid_cp": "hybrid"}
_DTYPES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _hub_preset(name: str) -> str | None:
    for preset, info in preset_index().items():
        if str(info.get("hf_repo", "")).lower() == name.lower():
            return preset
    return None


def _model(section: Section, path: Path, base: ModelSpec | None, warnings: list[str], notes: list[str]) -> ModelSpec | None:
    src = section.src
    where = section.first("pretrained_model_name_or_path", "config_path")
    overrides = section.get("config_overrides") or {}
    if not isinstance(overrides, dict):
        raise section.error("config_overrides", "expected a mapping of Hugging Face config keys")
    labelled = {key: (value, f"model.config_overrides.{key}") for key, value in overrides.items()}
    for key in list(section.data):
        if key in _HF_OVERRIDES:  # HF keys written beside _target_ override the config too
            section.used.add(key)
            labelled[key] = (section.data[key], f"model.{key}")
    model = base
    if model is None and where is not None:
        name = str(section.data[where])
        config_file = None
        for folder in (path.parent / name, Path(name)):
            if (folder / "config.json").is_file():
                config_file = folder / "config.json"
                break
            if folder.suffix == ".json" and folder.is_file():
                config_file = folder
                break
        if config_file is not None:
            try:
                config = parse_nested(json.loads, read_text(config_file), config_file, "JSON")
            except json.JSONDecodeError as error:
                raise src.error(section.label(where), f"{config_file}:{error.lineno}: malformed JSON: {error.msg}",
                                section.line(where)) from None
            model = spec_from_hf_config(config, name=config_file.parent.name, source=str(config_file))
        elif (preset := _hub_preset(name)) is not None:
            model = get_preset(preset)
        else:
            warnings.append(f"{src.where(section.line(where))}: {section.label(where)} {name!r}: not a local Hugging "
                            "Face directory nor the Hub id of an ndplan preset; give --model")
    if model is not None and model.mtp_depth:
        # AutoModels builds the transformers causal LM, which has no MTP module.
        model = model.model_copy(update={"mtp_depth": 0})
        notes.append("HyperParallel AutoModels builds no multi-token-prediction module; MTP is left out")
    stated: Stated = {}
    for key, (value, label) in labelled.items():
        if key in _HF_OVERRIDES:
            stated[_HF_OVERRIDES[key]] = (value, label)
        elif key not in ("offset", "seq_length", "full_rec", "sel_rec", "use_gmm", "gmm"):
            warnings.append(f"{src.where(section.line('config_overrides'))}: model.config_overrides.{key}: "
                            "not applied by ndplan")
    if stated and model is not None:
        # merge_model cuts the layer kinds to a new num_layers itself.
        model = merge_model(src, stated, model, name=model.name, model_type=model.model_type, defaults=None,
                            warnings=warnings, origin="the YAML")
    elif stated:
        warnings.append(f"{src.name}: model.config_overrides without a base model; give --model")
    return model


def read(path: Path, text: str, base: ModelSpec | None, devices: int | None) -> ReadResult:
    data = load_yaml(path, text)
    src = document_source(path, text, "yaml")
    if not isinstance(data, dict):
        raise src.error("document", f"expected a mapping, got {type(data).__name__}")
    warnings: list[str] = []
    notes: list[str] = []
    root = Section(src, data, ())
    legacy = root.sub("train")
    training = root.sub("training") if "training" in data or "train" not in data else legacy
    acc = root.sub("accelerator") if "accelerator" in data else legacy.sub("accelerator")
    fsdp = root.sub("fsdp_config")
    context = root.sub("context")
    model_section = root.sub("model")
    model = _model(model_section, path, base, warnings, notes)
    settings: dict[str, Any] = {}

    tp = acc.integer("tp_size", "tp_degree", "tensor_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    pp = acc.integer("pp_size", "pp_degree", "pipeline_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    cp = acc.integer("cp_size", "cp_degree", "context_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    ep = acc.integer("ep_size", "ep_degree", "expert_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    etp = acc.integer("etp_size", "expert_tensor_parallel_degree", maximum=MAX_DEGREE)
    settings.update(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp if etp is not None else (1 if ep > 1 else tp))
    _data_parallel(src, acc, fsdp, context, settings, devices, warnings)
    settings["sp"] = bool(acc.boolean("sequence_parallel", "use_seq_parallel", default=False)) and tp > 1
    algo = acc.text("context_parallel_algo", "cp_algorithm")
    degree = acc.integer("ulysses_degree")
    if cp > 1:
        if algo is None:
            algo, wrapper_degree = _cp_from_overrides(data)
            degree = degree or wrapper_degree
        if algo is None:
            algo = "ring"
            notes.append("no context-parallel algorithm stated; priced as ring attention")
        if algo not in _CP_ALGOS:
            raise acc.error("context_parallel_algo", f"unknown algorithm {algo!r}; known: {', '.join(_CP_ALGOS)}")
        settings["cp_kind"] = _CP_ALGOS[algo]
        if algo.startswith("colossal"):
            warnings.append(f"{src.where(acc.line('context_parallel_algo'))}: {algo} all-gathers K/V over the CP "
                            "group; ndplan prices ring attention")
        if settings["cp_kind"] == "hybrid":
            if degree is None:
                raise acc.error("context_parallel_algo", "hybrid context parallelism needs accelerator.ulysses_degree")
            settings["ulysses_degree"] = degree
    _pipeline(acc, model_section, settings, model, warnings)
    _recompute(root, fsdp, settings, warnings)
    settings["precision"] = precision_setting(_precision(root, fsdp, model_section, warnings))
    settings["optimizer_offload"] = False
    if fsdp.boolean("cpu_offload", default=False):
        settings["optimizer_offload"] = True
        warnings.append(f"{src.where(fsdp.line('cpu_offload'))}: fsdp_config.cpu_offload offloads parameters and "
                        "gradients too; ndplan prices only the optimizer state on the host")
    _batch(root, training, acc, settings, model, warnings)
    loss_parallel = bool(acc.boolean("loss_parallel", default=False))
    runtime: dict[str, Any] = {"loss_parallel": loss_parallel}
    attention = _attention(model_section, warnings)
    if attention is not None:
        runtime["attention"] = attention
    fsdp.get("replicate_params", "reshard_after_backward", "defer_fsdp_grad_sync", "requires_grad_sync",
             "forward_prefetch_depth", "backward_prefetch_depth", "comm_fusion")
    acc.check_known(_ACCELERATOR)
    fsdp.check_known(_FSDP)
    for key in training.unused(_TRAINING_QUIET):
        warnings.append(f"{src.where(training.line(key))}: {training.label(key)}: unknown to ndplan; ignored")
    for key in model_section.unused(_MODEL_KEYS):
        warnings.append(f"{src.where(model_section.line(key))}: model.{key}: unknown to ndplan; ignored")
    world = settings["dp"] * tp * pp * cp if "dp" in settings else devices
    return ReadResult(format=FORMAT, source=src.name, model=model, strategy_settings=settings, devices=world,
                      warnings=warnings, notes=notes, runtime_settings=runtime)


def _attention(model_section: Section, warnings: list[str]) -> str | None:
    """The attention kernel ``model.attn_implementation`` (transformers' names) runs: eager keeps
    the s x s scores, sdpa is PyTorch's SDPA as transformers calls it, the flash kernels are
    flash, flex_attention is flex (PyTorch's FlexAttention: flash's memory, its own speed); None
    where the YAML has none (priced as flash). A name ndplan does not know is priced as flash,
    with a warning."""
    name = model_section.text("attn_implementation")
    if name is None:
        return None
    key = name.lower()
    if key in ("eager", "sdpa"):
        return key
    if key.startswith("flex"):
        return "flex"
    if "flash" in key:
        return "flash"
    warnings.append(f"{model_section.src.where(model_section.line('attn_implementation'))}: model.attn_implementation "
                    f"{name!r} is not one ndplan knows (eager, sdpa, flash_attention_2/3, flex_attention); priced as "
                    "flash attention")
    return None


def _cp_from_overrides(data: dict[str, Any]) -> tuple[str | None, int | None]:
    """The CP algorithm a plan_overrides attention wrapper or the batch builder names."""
    for entry in data.get("plan_overrides") or []:
        wrapper = entry.get("inner_wrapper") if isinstance(entry, dict) else None
        target = wrapper.get("_target_", "") if isinstance(wrapper, dict) else str(wrapper or "")
        degree = wrapper.get("ulysses_degree") if isinstance(wrapper, dict) else None
        for name in ("hybrid", "ulysses", "ring", "colossal"):
            if name in target.lower():
                return name, int(degree) if isinstance(degree, int) else None
    loader = data.get("dataloader")
    batch = loader.get("get_batch") if isinstance(loader, dict) else None
    if isinstance(batch, dict) and isinstance(batch.get("cp_algorithm"), str):
        return batch["cp_algorithm"], None
    return None, None


def _data_parallel(src: Source, acc: Section, fsdp: Section, context: Section, settings: dict[str, Any],
                   devices: int | None, warnings: list[str]) -> None:
    tp, pp, cp = settings["tp"], settings["pp"], settings["cp"]
    device_num = context.integer("device_num")
    if device_num and devices and device_num != devices:
        raise context.error("device_num", f"{device_num} but --devices is {devices}")
    world = device_num or devices
    if "dp_shard_size" in fsdp:
        shard_section, shard_key = fsdp, "dp_shard_size"
    else:
        shard_section, shard_key = acc, ("dp_shard_size" if "dp_shard_size" in acc else "dp_shard")
    shard = shard_section.integer(shard_key)
    replicate = acc.integer("dp_replicate", "dp_replicate_size")
    ranks: int | None = None  # the DP×CP ranks
    if world:
        if world % (tp * pp):
            field = "device_num" if device_num else "tp_size"
            section = context if device_num else acc
            raise section.error(field, f"{world} devices are not divisible by tp·pp = {tp * pp}")
        ranks = world // (tp * pp)
        if shard is not None:
            if ranks % shard:
                raise shard_section.error(shard_key, f"{shard} does not divide the {ranks} DP×CP ranks of {world} devices")
            if replicate is not None and replicate * shard != ranks:
                raise acc.error("dp_replicate", f"dp_replicate·dp_shard_size = {replicate}·{shard} but the world has "
                                f"{ranks} DP×CP ranks")
        elif replicate is not None:
            if ranks % replicate:
                raise acc.error("dp_replicate", f"{replicate} does not divide the {ranks} DP×CP ranks")
            shard = ranks // replicate
        else:
            shard = ranks
    elif shard is not None:
        ranks = (replicate or 1) * shard
    else:
        warnings.append(f"{src.name}: no context.device_num and no fsdp_config.dp_shard_size; give --devices so "
                        "ndplan can derive the data-parallel degree")
    if ranks is not None:
        if ranks % cp:
            raise shard_section.error(shard_key, f"the {ranks} DP×CP ranks are not divisible by cp={cp}")
        settings["dp"] = ranks // cp
    if shard is None or shard > 1:
        # FSDP over the DP×CP ranks, in groups of dp_shard_size (HSDP) when that is fewer.
        settings.update(zero=3, fsdp=True, shard_group=shard if shard and ranks and shard < ranks else 0)
    else:
        settings.update(zero=0, fsdp=False, shard_group=0)
    if acc.boolean("enable_parallel_optimizer", default=False):
        settings.update(zero=max(settings["zero"], 1))
        warnings.append(f"{src.where(acc.line('enable_parallel_optimizer'))}: the legacy MindSpore parallel "
                        "optimizer is priced as ZeRO-1")
    acc.get("optimizer_weight_shard_size", "gradient_accumulation_shard")
    settings["reshard"] = bool(fsdp.boolean("reshard_after_forward", default=True)) if settings["zero"] == 3 else True
    edp = fsdp.integer("edp_shard_size")
    if edp is not None and settings["zero"] == 3 and "dp" in settings:
        _, expert_shards = shard_groups(settings["dp"], cp, tp, settings["ep"], settings["etp"], settings["shard_group"])
        ndplan_shards = int(expert_shards)
        if edp != ndplan_shards:
            warnings.append(f"{src.where(fsdp.line('edp_shard_size'))}: fsdp_config.edp_shard_size {edp}: ndplan "
                            f"shards expert parameters over {ndplan_shards} ranks")


def _pipeline(acc: Section, model_section: Section, settings: dict[str, Any], model: ModelSpec | None,
              warnings: list[str]) -> None:
    pp = settings["pp"]
    vpp = acc.integer("pp_interleave_num", "pp_vpp", default=1, maximum=MAX_DEGREE) or 1
    name = (acc.text("pp_schedule", "pipeline_scheduler", default="1f1b") or "1f1b").lower()
    if name not in _SCHEDULES:
        raise acc.error("pp_schedule", f"unknown schedule {name!r}; known: {', '.join(sorted(set(_SCHEDULES)))}")
    schedule = _SCHEDULES[name]
    chunks = acc.integer("seq_split_num", default=1) or 1
    if pp == 1:
        settings.update(vpp=1, schedule="1f1b")
        set_placement(settings, None, model.num_layers if model else None)
        return
    if schedule == "1f1b" and vpp > 1:
        schedule = "interleaved"
    if schedule in ("zbv", "dualpipev"):
        vpp = 2 if vpp == 1 else vpp
    settings.update(vpp=vpp, schedule=schedule)
    if schedule == "seq1f1b":
        settings["seq_chunks"] = chunks
    overrides = model_section.get("config_overrides") or {}
    offset_key = "offset" if "offset" in model_section else None
    offset = model_section.get("offset") if offset_key else overrides.get("offset")
    if model is None:
        if offset not in (None, 0):
            warnings.append(f"{acc.src.name}: model offset needs the model's layer count; give --model")
        set_placement(settings, None, None)
        return
    counts = counts_from_offset(model_section, "offset", 0 if offset is None else offset, model.num_layers, pp, vpp)
    set_placement(settings, counts, model.num_layers)


def _recompute(root: Section, fsdp: Section, settings: dict[str, Any], warnings: list[str]) -> None:
    ac = root.sub("activation_checkpoint")
    legacy = root.sub("gradient_checkpointing")
    mode: Any = ac.get("mode") if "mode" in ac else legacy.get("activation_checkpoint", default="none")
    if mode is False or mode is None:
        mode = "none"
    if mode is True:
        mode = "full"
    mode = str(mode).lower()
    if mode in ("none", "off", "false"):
        settings["recompute"] = "none"
    elif mode in ("full", "true", "on"):
        settings["recompute"] = "full"
    elif mode == "selective":
        settings["recompute"] = "selective"
    else:
        section, key = (ac, "mode") if "mode" in ac else (legacy, "activation_checkpoint")
        raise section.error(key, f"expected none, selective or full, got {mode!r}")
    settings["recompute_layers"] = 0
    if fsdp.boolean("recompute_slice_activation", default=False):
        warnings.append(f"{fsdp.src.where(fsdp.line('recompute_slice_activation'))}: recompute_slice_activation "
                        "(recompute inputs split over TP) is not modelled")


def _dtype(section: Section, key: str, value: Any) -> int:
    text = str(value).replace("torch.", "").lower()
    if text not in _DTYPES:
        raise section.error(key, f"expected float32, bfloat16 or float16, got {value!r}")
    return _DTYPES[text]


def _precision(root: Section, fsdp: Section, model: Section, warnings: list[str]) -> Any:
    mixed = root.sub("mixed_precision")
    fsdp_mixed = fsdp.sub("mix_precision")
    stored = _dtype(model, "torch_dtype", model.get("model_init_dtype", "torch_dtype", default="float32"))
    enabled = bool(mixed.boolean("enabled", default=False)) or "param_dtype" in fsdp_mixed
    compute_width = stored
    if enabled:
        section = fsdp_mixed if "param_dtype" in fsdp_mixed else mixed
        compute_width = _dtype(section, "param_dtype", section.get("param_dtype", default="bfloat16"))
    mixed.get("reduce_dtype")
    fsdp_mixed.get("reduce_dtype")
    optimizer = root.sub("optimizer")
    target = str(optimizer.get("_target_", "type", default="AdamW"))
    states = 1 if "muon" in target.lower() else 2
    if states == 1:
        warnings.append(f"{root.src.where(optimizer.line('_target_'))}: {target}: Muon keeps one state for matrices "
                        "and AdamW's two for the rest; ndplan prices one state everywhere")
    fp32_main = bool(optimizer.boolean("fp32_main_params", default=False))
    compute = {4: "fp32", 2: "bf16"}[compute_width]
    if fp32_main:
        state, master = 4, (4 if stored < 4 else 0)
    else:
        state, master = stored, 0
    return make_policy(
        f"hyperparallel-{'fp32' if stored == 4 else 'bf16'}{'-fp32main' if master else ''}",
        param_bytes=stored, grad_bytes=stored, master_weight_bytes=master, optimizer_state_bytes=state,
        optimizer_states=states, activation_bytes=compute_width, compute_dtype=compute, param_gather_bytes=compute_width,
    )


def _seq_length(root: Section) -> tuple[int | None, bool]:
    paths = [("dataset", "data_config", "seq_length"), ("data_transform", "seq_len"),
             ("data_transform", "max_seq_len"), ("dataset", "data_transform", "max_seq_len"),
             ("data", "max_seq_len"), ("dataset", "seq_len"), ("model", "config_overrides", "seq_length")]
    for path in paths:
        node: Any = root.data
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            try:
                return int(node), True
            except (TypeError, ValueError):
                raise root.src.key_error(path, f"expected an integer sequence length, got {node!r}") from None
    return None, False


def _batch(root: Section, training: Section, acc: Section, settings: dict[str, Any], model: ModelSpec | None,
           warnings: list[str]) -> None:
    mbs = training.integer("micro_batch_size", default=1) or 1
    gbs = training.integer("global_batch_size")
    micro = training.integer("micro_batch_num") or acc.integer("pp_micro_batch_num")
    settings["mbs"] = mbs
    seq, found = _seq_length(root)
    if found and seq:
        settings["seq"] = seq
    else:
        warnings.append(f"{root.src.name}: no sequence length (dataset.data_config.seq_length or "
                        "data_transform.seq_len); ndplan uses its default unless --seq is given")
    dp = settings.get("dp")
    if dp is None:
        if gbs is not None:
            settings["gbs"] = gbs
        if micro is not None:
            settings["num_micro_batches"] = micro
        return
    if micro is not None:
        if gbs is not None and gbs != dp * mbs * micro:
            raise training.error("global_batch_size", f"{gbs} but dp·micro_batch_size·micro_batch_num = "
                                 f"{dp}·{mbs}·{micro} = {dp * mbs * micro}")
        settings["num_micro_batches"] = micro
        settings["gbs"] = dp * mbs * micro
    elif gbs is not None:
        settings["num_micro_batches"] = micro_batches(training.src, gbs=gbs, dp=dp, mbs=mbs,
                                                      gbs_field=training.label("global_batch_size"),
                                                      gbs_line=training.line("global_batch_size"))
        settings["gbs"] = gbs
    else:
        settings["num_micro_batches"] = settings["pp"]
        settings["gbs"] = dp * mbs * settings["pp"]


# ---------------------------------------------------------------- writing
def emit(model: ModelSpec | None, s: Strategy, *, attention: str = "flash", loss_parallel: bool | None = None) -> str:
    """HyperParallel training YAML: ``attention`` eager or sdpa as ``model.attn_implementation``
    (flash: none, as the reader prices a config without one), ``loss_parallel`` (None: not
    stated) as ``accelerator.loss_parallel`` under TP."""
    lost: list[str] = []
    if s.pipeline_runs > 1:
        lost.append(f"pipeline_runs={s.pipeline_runs} (its micro_batch_num schedules all of a step's micro-batches "
                    "in one pipeline run)")
    doc: dict[str, Any] = {}
    model_doc: dict[str, Any] = {}
    repo = preset_index().get(model.name, {}).get("hf_repo") if model is not None else None
    if repo:
        model_doc["pretrained_model_name_or_path"] = repo
        assert model is not None  # a repo comes from the model's preset
        windows = window_lost(model, model.name, f"the config of {repo}")
        if windows:
            lost.append(windows)
    p = policy_of(s.precision)
    mixed: dict[str, Any] = {"enabled": False}
    fp32_main = False
    if p.param_bytes == 2 and p.grad_bytes == 2 and p.master_weight_bytes == 0 and p.optimizer_state_bytes == 2:
        model_doc["torch_dtype"] = "bfloat16"
    elif p.param_bytes == 2 and p.grad_bytes == 2 and p.master_weight_bytes == 4 and p.optimizer_state_bytes == 4:
        model_doc["torch_dtype"] = "bfloat16"
        fp32_main = True
    elif p.param_bytes == 4 and p.grad_bytes == 4 and p.master_weight_bytes == 0 and p.optimizer_state_bytes == 4:
        model_doc["torch_dtype"] = "float32"
        if p.compute_dtype == "bf16":
            mixed = {"enabled": True, "param_dtype": "bfloat16"}
    else:
        lost.append(f"precision {p.name!r}")
        model_doc["torch_dtype"] = "bfloat16"
    if p.compute_dtype not in ("bf16", "fp32") or (p.compute_dtype == "fp32" and p.param_bytes != 4):
        lost.append(f"{p.compute_dtype} compute")
    if s.pp > 1 and model is not None:
        counts = list(layer_counts(s, model.num_layers))
        offsets = offsets_for(counts, 0, s.pp, s.vpp)
        if any(o != 0 for row in (offsets if s.vpp > 1 else [offsets]) for o in row):
            model_doc["offset"] = offsets
    elif s.pp > 1 and (s.stage_layers is not None or s.embedding_as_layer or s.output_as_layer):
        lost.append("the uneven layer placement (offsets need the model's layer count)")
    if attention != "flash":  # transformers' "eager", "sdpa" and "flex_attention"
        model_doc["attn_implementation"] = "flex_attention" if attention == "flex" else attention
    doc["model"] = model_doc
    doc["context"] = {"device_num": s.world_size}
    doc["training"] = {"global_batch_size": s.global_batch_size, "micro_batch_size": s.micro_batch_size,
                       "micro_batch_num": s.micro_batches_per_step}
    acc: dict[str, Any] = {"tp_size": s.tp, "cp_size": s.cp, "ep_size": s.ep, "pp_size": s.pp}
    if s.etp != (1 if s.ep > 1 else s.tp):
        acc["expert_tensor_parallel_degree"] = s.etp
    if s.pp > 1:
        acc["pp_interleave_num"] = s.vpp
        acc["pp_schedule"] = {"interleaved": "1f1b"}.get(s.schedule, s.schedule)
        if s.schedule == "seq1f1b":
            acc["seq_split_num"] = s.seq_chunks
    acc["sequence_parallel"] = s.sequence_parallel
    if s.tp > 1 and loss_parallel is not None:
        acc["loss_parallel"] = loss_parallel
    if s.cp > 1:
        acc["context_parallel_algo"] = "ring" if s.cp_kind == "allgather" else s.cp_kind
        if s.cp_kind == "allgather":
            lost.append("all-gather context parallelism (cp_kind allgather: Transformer Engine's and MindSpeed's); "
                        "written as ring")
        if s.cp_kind == "hybrid":
            acc["ulysses_degree"] = s.ulysses_degree
    doc["accelerator"] = acc
    fsdp: dict[str, Any] = {}
    if s.zero == 0:
        fsdp["dp_shard_size"] = 1
    else:
        shard = s.shard_group or s.dp * s.cp
        if shard == 1:
            lost.append(one_rank_sharding(model, s, "fsdp_config.dp_shard_size 1 applies no FSDP"))
        elif s.zero != 3:
            lost.append(f"ZeRO-{s.zero} (HyperParallel shards with FSDP: ZeRO-3)")
        elif not s.fsdp:
            lost.append("ZeRO-3 without FSDP (HyperParallel shards parameters with FSDP; priced the same)")
        fsdp["dp_shard_size"] = shard
        fsdp["reshard_after_forward"] = s.reshard_after_forward
    doc["fsdp_config"] = fsdp
    doc["mixed_precision"] = mixed
    doc["optimizer"] = {"fp32_main_params": fp32_main}
    doc["activation_checkpoint"] = {"mode": s.recompute}
    if s.recompute_modules:
        lost.append(f"Megatron's recompute modules ({' '.join(s.recompute_modules)})")
    if s.recompute_layers:
        lost.append(f"recompute limited to {s.recompute_layers} layers per stage")
    if s.optimizer_offload:
        lost.append("optimizer-only offload")
    if s.offload_modules:
        lost.append(f"activation offload (Megatron-Core only): {' '.join(s.offload_modules)}")
    if s.offload_layers:
        lost.append(f"layer offload (Megatron-Core only): the first {s.offload_layers} layers' activations")
    if s.offload_optimizer_states:
        lost.append("the optimizer states on the host between steps (Megatron-Core's --offload-optimizer-states, "
                    "MindSpeed's --swap-optimizer only)")
    doc["dataset"] = {"data_config": {"seq_length": s.seq_length}}
    header = ["# HyperParallel training settings written by ndplan" + (f" for {model.name}" if model else "")
              + f": {s.short()}"]
    if model is not None and not repo:
        header.append("# model: set pretrained_model_name_or_path to this model's Hugging Face directory")
    header += [f"# ndplan: not expressible in HyperParallel, left out: {item}" for item in lost]
    return "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
