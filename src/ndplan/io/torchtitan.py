"""Read and write torchtitan job TOML files.

Understood: ``[model]`` name/flavor (through ``FLAVOURS``) and converters (float8/mx → fp8
GEMMs); ``[parallelism]`` degrees, FSDP/HSDP (dp_shard = -1 takes the rest of the world),
fsdp_reshard_after_forward, pipeline schedule/micro-batch size/layers per stage/explicit module
lists/first-and-last-stage weights, CP, EP/ETP, loss parallel; ``[training]`` local/global batch,
seq_len, mixed_precision_param, dtype, enable_cpu_offload; ``[activation_checkpoint]``.
Sections without memory effect (job, metrics, optimizer settings, checkpoint, comm, compile,
validation...) are accepted as they are; an optimizer other than Adam's and
``early_step_in_backward`` (which frees each gradient as it is made) are warnings. torchtitan always applies sequence parallelism with TP
and ring attention for CP, so those are not separate settings.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ndplan.io.common import (
    MAX_DEGREE,
    ReadResult,
    Section,
    canonical_placement,
    document_source,
    layer_counts,
    load_toml,
    make_policy,
    micro_batches,
    one_rank_sharding,
    policy_of,
    precision_setting,
    set_placement,
    window_lost,
)
from ndplan.model.presets import get_preset
from ndplan.model.spec import ModelSpec
from ndplan.placement import uniform_layer_counts
from ndplan.strategy.strategy import Strategy

FORMAT = "torchtitan"

#: torchtitan (model.name, model.flavor) → ndplan preset. torchtitan's DeepSeek-V3 builds no MTP
#: module, so its flavours map to the presets without one (see ``_torchtitan_variant``).
FLAVOURS: dict[tuple[str, str], str] = {
    ("llama3", "8B"): "llama-3.1-8b",
    ("llama3", "70B"): "llama-3.1-70b",
    ("llama3", "405B"): "llama-3.1-405b",
    ("deepseek_v3", "16B"): "deepseek-v2-lite",
    ("deepseek_v3", "671B"): "deepseek-v3",
    ("qwen3", "8B"): "qwen3-8b",
    ("qwen3", "32B"): "qwen3-32b",
    ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
    ("qwen3", "235B-A22B"): "qwen3-235b-a22b",
}

#: torchtitan's pipeline schedule names (torch.distributed.pipelining), lower-cased → ndplan.
SCHEDULES: dict[str, str] = {
    "1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved", "zbvzerobubble": "zbv",
    "dualpipev": "dualpipev", "loopedbfs": "interleaved", "interleavedzerobubble": "interleaved",
    "flexibleinterleaved1f1b": "interleaved",
    # The base classes, named with pipeline_parallel_schedule_csv: one stage per rank, or several.
    "pipelineschedulesingle": "1f1b", "pipelineschedulemulti": "interleaved",
}
_CSV_ONLY = {"pipelineschedulesingle", "pipelineschedulemulti"}
_WRITE_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
                    "dualpipev": "DualPipeV"}
_MULTI_STAGE = {"interleaved", "zbv", "dualpipev"}

#: Sections whose content does not change memory or time as ndplan models them.
QUIET_SECTIONS = {
    "job", "profiling", "metrics", "optimizer", "lr_scheduler", "checkpoint", "comm", "compile", "validation",
    "experimental", "fault_tolerance", "debug", "memory_estimation", "float8", "mx", "quantize", "dataloader",
}
_KNOWN = {
    "model": {"name", "flavor", "tokenizer_path", "hf_assets_path", "converters", "print_after_conversion"},
    "training": {"dataset", "dataset_path", "local_batch_size", "batch_size", "global_batch_size", "seq_len",
                 "max_norm", "steps", "max_steps", "enable_cpu_offload", "dtype", "mixed_precision_param",
                 "mixed_precision_reduce", "compile", "gc_freq", "gc_debug", "seed", "deterministic",
                 "warmup_steps", "dataloader", "data_parallel_replicate_degree", "data_parallel_shard_degree",
                 "tensor_parallel_degree", "pipeline_parallel_degree", "enable_loss_parallel"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "pipeline_parallel_split_points", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_rotate_method", "context_parallel_load_balancer", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend", "enable_compiled_autograd",
                    "enable_sequence_parallel"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto",
                              "preserve_rng_state", "determinism_check", "debug"},
}


def _torchtitan_variant(preset: str) -> ModelSpec:
    spec = get_preset(preset)
    if spec.model_type.startswith("deepseek") and spec.mtp_depth:
        # torchtitan's DeepSeek-V3 model has no multi-token-prediction module.
        return spec.model_copy(update={"mtp_depth": 0})
    return spec


def _model(model: Section, base: ModelSpec | None, warnings: list[str], notes: list[str]) -> ModelSpec | None:
    name = model.text("name", default="llama3") or "llama3"
    flavor = model.text("flavor", default="debugmodel") or "debugmodel"
    preset = FLAVOURS.get((name, flavor))
    if base is not None:
        if preset is not None and get_preset(preset).num_layers != base.num_layers:
            warnings.append(f"{model.src.where(model.line('flavor'))}: model {name} {flavor} has "
                            f"{get_preset(preset).num_layers} layers but --model {base.name} has {base.num_layers}; "
                            "using --model")
        if base.mtp_depth and name in {n for n, _ in FLAVOURS}:
            # torchtitan's model classes build no multi-token-prediction module, whatever --model says.
            warnings.append(f"{model.src.where(model.line('name'))}: torchtitan's {name} model builds no MTP module; "
                            f"--model {base.name}'s mtp_depth {base.mtp_depth} is left out (priced with mtp_depth 0)")
            return base.model_copy(update={"mtp_depth": 0})
        return base
    if preset is None:
        warnings.append(f"{model.src.where(model.line('flavor'))}: model.flavor: no ndplan preset for torchtitan "
                        f"{name} {flavor}; give --model with a preset or its config.json")
        return None
    notes.append(f"torchtitan {name} {flavor} is ndplan's {preset}"
                 + (" without MTP" if _torchtitan_variant(preset).mtp_depth != get_preset(preset).mtp_depth else ""))
    return _torchtitan_variant(preset)


def read(path: Path, text: str, base: ModelSpec | None, devices: int | None) -> ReadResult:
    data = load_toml(path, text)
    src = document_source(path, text, "toml")
    warnings: list[str] = []
    notes: list[str] = []
    job = data.get("job")
    custom = isinstance(job, dict) and bool(job.get("custom_config_module") or job.get("custom_args_module"))
    for key in data:
        if key not in QUIET_SECTIONS and key not in _KNOWN:
            if not custom:
                raise src.key_error((key,), "unknown section (a typo? torchtitan would reject it too)")
            warnings.append(f"{src.where(src.lines.line((key,)))}: [{key}]: custom section, not read")
    root = Section(src, data, ())
    model_section = root.sub("model")
    training = root.sub("training")
    parallel = root.sub("parallelism")
    ac = root.sub("activation_checkpoint")
    model = _model(model_section, base, warnings, notes)
    settings: dict[str, Any] = {}

    def degree(key: str, default: int, minimum: int = 1) -> tuple[int, Section]:
        # Old torchtitan versions kept the degrees under [training].
        for section in (parallel, training):
            value = section.integer(key, minimum=minimum, maximum=MAX_DEGREE)
            if value is not None:
                return value, section
        return default, parallel

    replicate, _ = degree("data_parallel_replicate_degree", 1)
    shard, shard_section = degree("data_parallel_shard_degree", -1, minimum=-1)
    tp, _ = degree("tensor_parallel_degree", 1)
    pp, _ = degree("pipeline_parallel_degree", 1)
    cp = parallel.integer("context_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    ep = parallel.integer("expert_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    etp = parallel.integer("expert_tensor_parallel_degree", default=1, maximum=MAX_DEGREE) or 1
    if shard == 0:
        raise shard_section.error("data_parallel_shard_degree", "must be -1 or >= 1, got 0")
    if shard == -1:
        rest = replicate * tp * pp * cp
        if devices is not None:
            if devices % rest:
                raise shard_section.error("data_parallel_shard_degree",
                                          f"-1 takes the rest, but {devices} devices are not divisible by "
                                          f"replicate·tp·pp·cp = {rest}")
            shard = devices // rest
        elif replicate > 1:
            raise shard_section.error("data_parallel_shard_degree",
                                      "-1 takes the rest of the world size, which the file does not state; give --devices")
        else:
            warnings.append(f"{src.name}: data_parallel_shard_degree -1 takes the rest of the world size; "
                            "give --devices so ndplan can derive the data-parallel degree")
    elif devices is not None and devices != replicate * shard * tp * pp * cp:
        raise shard_section.error("data_parallel_shard_degree",
                                  f"replicate·shard·tp·pp·cp = {replicate * shard * tp * pp * cp} "
                                  f"but --devices is {devices}")
    settings.update(tp=tp, pp=pp, cp=cp, ep=ep, sp=tp > 1, cp_kind="ring")
    # With ep=1 the experts are tensor-parallel like every other layer; with EP, etp is 1 or tp.
    settings["etp"] = tp if ep == 1 else etp
    if shard > 0:
        settings["dp"] = replicate * shard
    # torchtitan applies FSDP2 whenever dp_shard > 1 or cp > 1 (ParallelDims.fsdp_enabled).
    fsdp = shard > 1 or shard == -1 or cp > 1
    reshard_policy = parallel.text("fsdp_reshard_after_forward", default="default")
    if reshard_policy not in ("default", "always", "never"):
        raise parallel.error("fsdp_reshard_after_forward", f"expected default, always or never, got {reshard_policy!r}")
    if fsdp:
        # The default policy keeps parameters gathered between micro-batches under PP.
        reshard = reshard_policy == "always" or (reshard_policy == "default" and pp == 1)
        group = shard * cp if replicate > 1 and shard > 0 else 0
        settings.update(zero=3, fsdp=True, shard_group=group, reshard=reshard)
    else:
        settings.update(zero=0, fsdp=False, shard_group=0, reshard=True)
    loss_parallel = tp > 1 and not parallel.boolean("disable_loss_parallel", default=False)
    # Async TP overlaps the tensor-parallel collectives with the GEMMs; FSDP2 prefetches (on by default).
    overlap: dict[str, Any] = {"tp": tp > 1 and bool(parallel.boolean("enable_async_tensor_parallel", default=False))}
    if overlap["tp"] and not _model_compiled(root, training):
        # torchtitan's parallelize functions: "Async TP requires torch.compile" (a RuntimeError).
        raise parallel.error("enable_async_tensor_parallel", "torchtitan runs async TP only on a compiled model: "
                             "set [compile] enable = true with \"model\" in components (the default), or "
                             "enable_async_tensor_parallel = false")
    if parallel.boolean("pipeline_parallel_expert_parallel_overlap", default=False):
        overlap["ep"] = True
    parallel.get("context_parallel_rotate_method", "context_parallel_load_balancer", "expert_parallel_comm_backend",
                 "enable_compiled_autograd", "enable_sequence_parallel")

    _pipeline(parallel, settings, model, warnings)
    selective_policy = _recompute(ac, settings, model, warnings, notes)
    _precision(model_section, training, root, settings, warnings)
    _batch(training, parallel, settings, warnings, notes)
    # training.enable_cpu_offload is FSDP2's CPUOffloadPolicy: the parameter and gradient shards and
    # the optimizer states on the host, Adam on the CPU (the pytorch runtime's fsdp_cpu_offload).
    settings["optimizer_offload"] = False
    if training.boolean("enable_cpu_offload", default=False):
        if settings.get("zero") == 3:
            settings["optimizer_offload"] = True
        else:
            warnings.append(f"{src.where(training.line('enable_cpu_offload'))}: training.enable_cpu_offload is FSDP2's "
                            "CPU offload, and this job shards nothing (no FSDP): ignored")
    for section, name in ((model_section, "model"), (training, "training"), (parallel, "parallelism"),
                          (ac, "activation_checkpoint")):
        section.check_known(_KNOWN[name])
    compiled = _compiled(root, training)
    if compiled != "off":
        notes.append(f"torch.compile of the {compiled.replace('+', ' and ')}: priced as fused elementwise kernels in the "
                     "step time (--compile), and in memory as compiled dense layers and a compiled loss keep "
                     "(other layers, and a vocabulary-parallel loss, as the eager modules)")
    world = settings["dp"] * tp * pp * cp if "dp" in settings else devices
    return ReadResult(
        format=FORMAT, source=src.name, model=model, strategy_settings=settings, devices=world,
        warnings=warnings, notes=notes,
        runtime_settings={"loss_parallel": loss_parallel, "overlap": {"preset": "torchtitan", **overlap},
                          "torch_compile": compiled,
                          **({"selective_policy": selective_policy} if selective_policy else {})},
    )


def _pipeline(parallel: Section, settings: dict[str, Any], model: ModelSpec | None, warnings: list[str]) -> None:
    pp = settings["pp"]
    name = parallel.text("pipeline_parallel_schedule", default="1F1B") or "1F1B"
    csv = parallel.text("pipeline_parallel_schedule_csv")
    first_w = parallel.integer("pipeline_parallel_first_stage_less_layers", default=1, minimum=0)
    last_w = parallel.integer("pipeline_parallel_last_stage_less_layers", default=1, minimum=0)
    per_stage = parallel.integer("pipeline_parallel_layers_per_stage")
    parts = parallel.get("module_fqns_per_model_part")
    splits = parallel.names("pipeline_parallel_split_points")
    if pp == 1:
        settings.update(vpp=1, schedule="1f1b")
        settings["embedding_as_layer"] = settings["output_as_layer"] = False
        return
    key = name.lower()
    if key not in SCHEDULES:
        key = key.replace("schedule", "")
    if key not in SCHEDULES:
        raise parallel.error("pipeline_parallel_schedule", f"unknown schedule {name!r}; known: "
                             f"{', '.join(_WRITE_SCHEDULES.values())}, LoopedBFS, InterleavedZeroBubble, and "
                             "PipelineScheduleSingle or PipelineScheduleMulti with pipeline_parallel_schedule_csv")
    if key in _CSV_ONLY and not csv:
        raise parallel.error("pipeline_parallel_schedule", f"{name} is a base class that runs the actions of "
                             "pipeline_parallel_schedule_csv, which is not set")
    schedule = SCHEDULES[key]
    if csv:
        warnings.append(f"{parallel.src.where(parallel.line('pipeline_parallel_schedule_csv'))}: a CSV schedule is "
                        f"priced as {schedule}")
    if key in ("loopedbfs", "interleavedzerobubble"):
        warnings.append(f"{parallel.src.where(parallel.line('pipeline_parallel_schedule'))}: {name} is priced as "
                        "interleaved 1F1B")
    layers = model.num_layers if model else None
    counts: list[int] | None = None
    if parts is not None:
        if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
            raise parallel.error("module_fqns_per_model_part", "expected a list of lists of module names")
        counts = [sum(1 for name_ in part if re.fullmatch(r"layers\.\d+", str(name_))) for part in parts]
        stages = len(parts)
    elif splits is not None:
        indices = [int(m.group(1)) for s in splits if (m := re.fullmatch(r"layers\.(\d+)", s))]
        if len(indices) != len(splits) or indices != sorted(indices):
            raise parallel.error("pipeline_parallel_split_points", f"expected increasing 'layers.N' names, got {splits}")
        if layers is None:
            raise parallel.error("pipeline_parallel_split_points", "needs the model's layer count; give --model")
        bounds = [0, *indices, layers]
        counts = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        stages = len(counts)
    elif per_stage is not None:
        if layers is None:
            raise parallel.error("pipeline_parallel_layers_per_stage", "needs the model's layer count; give --model")
        stages = math.ceil((layers + (first_w or 0) + (last_w or 0)) / per_stage)
    else:
        stages = pp * (2 if schedule in _MULTI_STAGE else 1)
    if stages % pp:
        raise parallel.error("pipeline_parallel_degree", f"{stages} pipeline stages are not a multiple of pp={pp}")
    vpp = stages // pp
    if schedule == "1f1b" and vpp > 1 or schedule == "gpipe" and vpp > 1:
        raise parallel.error("pipeline_parallel_schedule", f"{name} runs one stage per rank, got {vpp}")
    if schedule in ("zbv", "dualpipev") and vpp != 2:
        raise parallel.error("pipeline_parallel_schedule", f"{name} runs two stages per rank, got {vpp}")
    if schedule == "interleaved" and vpp < 2:
        raise parallel.error("pipeline_parallel_schedule", f"{name} needs two or more stages per rank")
    settings.update(vpp=vpp, schedule=schedule)
    if counts is None:
        if first_w not in (0, 1) or last_w not in (0, 1):
            if layers is None:
                raise parallel.error("pipeline_parallel_first_stage_less_layers", "needs the model's layer count; give --model")
            counts = _weighted_counts(layers, stages, first_w or 0, last_w or 0)
        else:
            set_placement(settings, None, layers, embedding_as_layer=bool(first_w), output_as_layer=bool(last_w))
            return
    if layers is not None and sum(counts) != layers:
        raise parallel.error("module_fqns_per_model_part", f"places {sum(counts)} layers but the model has {layers}")
    set_placement(settings, counts, layers)


def _weighted_counts(layers: int, stages: int, first: int, last: int) -> list[int]:
    """torchtitan's generate_llm_fqn_per_model_part with integer weights for the embedding/output."""
    effective = layers + first + last
    base, extra = divmod(effective, stages)
    counts = [base + (1 if i < extra else 0) for i in range(stages)]
    counts[0] -= first
    counts[-1] -= last
    return [max(c, 0) for c in counts]


def _recompute(ac: Section, settings: dict[str, Any], model: ModelSpec | None, warnings: list[str],
               notes: list[str]) -> str | None:
    """The strategy's recompute settings; returns the selective policy where the config names one
    (torchtitan's per-op checkpointing), else None."""
    mode = ac.get("mode", default="selective")
    if mode is False or mode is None:
        mode = "none"
    mode = str(mode)
    settings["recompute_layers"] = 0
    policy = None
    if mode == "none":
        settings["recompute"] = "none"
    elif mode == "full":
        settings["recompute"] = "full"
    elif mode == "memory_budget":
        settings["recompute"] = "selective"
        warnings.append(f"{ac.src.where(ac.line('mode'))}: activation_checkpoint.mode memory_budget lets the "
                        "compiler choose; ndplan prices selective recompute")
    elif mode == "selective":
        option = str(ac.get("selective_ac_option", default="2"))
        if option == "op":
            settings["recompute"] = "selective"
            notes.append("selective_ac_option op: torchtitan's per-op checkpointing, which keeps the attention "
                         "kernel's outputs and every second matmul's (--selective-policy torchtitan-op; MoE and "
                         "MLA layers priced as keeping every matmul's output)")
            policy = "torchtitan-op"
        elif re.fullmatch(r"\d+", option):
            # torchtitan checkpoints a layer where `not every or count % every == 0`, its count
            # running from 1 over the layers a rank builds: 0 checkpoints every layer.
            every = int(option)
            settings["recompute"] = "full"
            if every == 0:
                notes.append("selective_ac_option 0: torchtitan checkpoints every layer (full recompute)")
            if every > 1:
                if model is None:
                    warnings.append(f"{ac.src.where(ac.line('selective_ac_option'))}: "
                                    f"activation_checkpoint.selective_ac_option {every} checkpoints one layer in "
                                    f"{every}; pricing it needs the model's layer count: give --model (priced as "
                                    "full recompute of every layer meanwhile)")
                    return None
                counts = settings.get("stage_layers") or uniform_layer_counts(
                    model.num_layers, settings["pp"] * settings["vpp"],
                    embedding_as_layer=settings.get("embedding_as_layer", False),
                    output_as_layer=settings.get("output_as_layer", False))
                # A rank counts the layers of all its chunks (virtual stage v runs on rank v mod pp).
                per_rank = max(sum(counts[rank::settings["pp"]]) for rank in range(settings["pp"]))
                settings["recompute_layers"] = max(1, max(counts) // every)
                where = ac.src.where(ac.line('selective_ac_option'))
                if per_rank < every:
                    settings["recompute"], settings["recompute_layers"] = "none", 0
                    warnings.append(f"{where}: activation_checkpoint.selective_ac_option {every} checkpoints one layer "
                                    f"in {every}, counted on each rank, which holds at most {per_rank}: no layer "
                                    "is checkpointed; priced as no recompute")
                else:
                    warnings.append(f"{where}: activation_checkpoint.selective_ac_option {every} checkpoints one layer "
                                    f"in {every}; priced as full recompute of {settings['recompute_layers']} layers "
                                    "per stage")
        else:
            raise ac.error("selective_ac_option", f"expected 'op' or a whole number of layers, got {option!r}")
    else:
        raise ac.error("mode", f"expected none, selective, full or memory_budget, got {mode!r}")
    ac.get("per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop", "memory_budget",
           "visualize_memory_budget_pareto", "preserve_rng_state", "determinism_check", "debug")
    return policy


def _compiled(root: Section, training: Section) -> str:
    """What torchtitan compiles (``MemoryOptions.torch_compile``): ``[compile] enable`` with its
    ``components`` (default ["model", "loss"]), or ``training.compile`` in older versions, which
    compiled each transformer block and left the loss eager."""
    section = root.get("compile")
    if isinstance(section, dict) and section.get("enable") is True:
        components = section.get("components", ["model", "loss"])
        if isinstance(components, str):  # the command line's comma-separated form
            components = components.split(",")
        parts = [part for part in ("model", "loss") if isinstance(components, list) and part in components]
        return "+".join(parts) or "off"
    return "model" if training.get("compile") is True else "off"


def _model_compiled(root: Section, training: Section) -> bool:
    """torchtitan's model_compile_enabled (``_compiled`` names the model)."""
    return "model" in _compiled(root, training)


def _float8_all_gather(root: Section) -> bool:
    """``enable_fsdp_float8_all_gather`` under ``[float8]`` (older torchtitan) or
    ``[quantize.linear.float8]``."""
    sections = [root.get("float8")]
    quantize = root.get("quantize")
    if isinstance(quantize, dict) and isinstance(quantize.get("linear"), dict):
        sections.append(quantize["linear"].get("float8"))
    return any(isinstance(s, dict) and bool(s.get("enable_fsdp_float8_all_gather")) for s in sections)


def _precision(model: Section, training: Section, root: Section, settings: dict[str, Any], warnings: list[str]) -> None:
    converters = model.names("converters") or []
    fp8 = any(re.search(r"float8|mx", c) for c in converters)
    dtype = training.text("dtype", default="float32")
    param = training.text("mixed_precision_param", default="bfloat16")
    training.get("mixed_precision_reduce")
    if dtype == "bfloat16":
        policy = make_policy("bf16-pure", param_bytes=2, grad_bytes=2, master_weight_bytes=0, optimizer_state_bytes=2,
                             compute_dtype="fp8" if fp8 else "bf16")
    elif param == "float32" or (param == "bfloat16" and not settings["fsdp"] and (settings["tp"] > 1 or settings["pp"] > 1)):
        if param == "bfloat16":
            # torchtitan/distributed/utils.py maybe_enable_amp: FSDP applies the mixed precision;
            # without it, autocast only serves DDP or one device, and TP or PP trains in fp32.
            warnings.append(f"{training.src.where(training.line('mixed_precision_param'))}: "
                            "training.mixed_precision_param bfloat16 takes effect through FSDP (data_parallel_shard_degree "
                            "> 1 or context_parallel_degree > 1), or autocast without TP and PP: torchtitan disables "
                            "mixed precision for TP or PP without FSDP; priced as fp32")
        policy = make_policy("fp32", param_bytes=4, grad_bytes=4, master_weight_bytes=0, optimizer_state_bytes=4,
                             activation_bytes=4, compute_dtype="fp32", param_gather_bytes=4)
    elif param == "bfloat16":
        # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 sharded parameters.
        # enable_fsdp_float8_all_gather: FSDP2 gathers the float8 linears' weights at one byte
        # (the norms and the embedding, a few percent of the parameters, stay at two).
        gather = 1 if fp8 and _float8_all_gather(root) else 2
        policy = make_policy("fsdp-fp8" if fp8 else "fsdp-bf16", param_bytes=4, grad_bytes=4, master_weight_bytes=0,
                             optimizer_state_bytes=4, compute_dtype="fp8" if fp8 else "bf16", param_gather_bytes=gather)
    else:
        raise training.error("mixed_precision_param", f"expected bfloat16 or float32, got {param!r}")
    settings["precision"] = precision_setting(policy)
    optimizer = root.get("optimizer")
    name = str(optimizer.get("name", "AdamW")) if isinstance(optimizer, dict) else "AdamW"
    if name.lower() not in ("adamw", "adam"):
        warnings.append(f"{root.src.where(root.src.lines.line(('optimizer', 'name')))}: optimizer.name {name}: "
                        "ndplan prices Adam's two optimizer states")
    if isinstance(optimizer, dict) and optimizer.get("early_step_in_backward") is True:
        # torchtitan then steps each parameter from a hook as its gradient is accumulated and
        # drops the gradient: the step never holds the gradients together.
        warnings.append(f"{root.src.where(root.src.lines.line(('optimizer', 'early_step_in_backward')))}: "
                        "optimizer.early_step_in_backward: torchtitan steps each parameter as its gradient is "
                        "made and frees the gradient, where ndplan holds every gradient until the step: the "
                        "memory estimate is high by about the gradients' bytes")


def _batch(training: Section, parallel: Section, settings: dict[str, Any], warnings: list[str], notes: list[str]) -> None:
    local = training.integer("local_batch_size", "batch_size", default=8) or 8
    gbs = training.integer("global_batch_size", default=-1, minimum=-1)
    seq = training.integer("seq_len", default=2048)
    settings["seq"] = seq
    pp = settings["pp"]
    mbs = parallel.integer("pipeline_parallel_microbatch_size", default=1) if pp > 1 else local
    assert mbs is not None
    if pp > 1 and local % mbs:
        raise parallel.error("pipeline_parallel_microbatch_size",
                             f"training.local_batch_size {local} is not divisible by {mbs}")
    per_pipeline = local // mbs if pp > 1 else 1
    settings["mbs"] = mbs
    dp = settings.get("dp")
    if gbs == -1 or gbs is None:
        if dp is not None:
            settings["gbs"] = local * dp
            settings["num_micro_batches"] = per_pipeline
        return
    if pp > 1:
        # torchtitan's train step runs the pipeline schedule once per gradient-accumulation step,
        # over the local batch's micro-batches: the runs are gbs / (local·dp), derived once dp is
        # known (a flag may change it, or the global batch).
        settings["gbs"] = gbs
        settings["num_micro_batches"] = per_pipeline
        settings["pipeline_runs"] = 0
        if dp is not None:
            if gbs % (local * dp):
                raise training.error("global_batch_size",
                                     f"{gbs} is not divisible by local_batch_size·dp = {local}·{dp}")
            if gbs > local * dp:
                notes.append(f"{gbs // (local * dp)} gradient-accumulation steps, each one run of the pipeline "
                             f"schedule over {per_pipeline} micro-batches (pipeline_runs {gbs // (local * dp)})")
        return
    if dp is None:
        settings["gbs"] = gbs
        return
    if gbs % (local * dp):
        raise training.error("global_batch_size", f"{gbs} is not divisible by local_batch_size·dp = {local}·{dp}")
    settings["gbs"] = gbs
    settings["num_micro_batches"] = micro_batches(
        training.src, gbs=gbs, dp=dp, mbs=local, gbs_field="training.global_batch_size",
        gbs_line=training.line("global_batch_size"), accumulation=per_pipeline,
    )


# ---------------------------------------------------------------- writing
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)


def emit(model: ModelSpec | None, s: Strategy, *, attention: str = "flash", loss_parallel: bool | None = None,
         torch_compile: str = "off") -> str:
    """The [model], [training], [parallelism] and [activation_checkpoint] tables of a job TOML
    (and [compile] where ``torch_compile`` names what torch.compile fuses: model, loss or both).
    ``loss_parallel`` False under TP: ``disable_loss_parallel`` (torchtitan's loss is
    vocabulary-parallel by default). The attention kernel is the model's (torchtitan calls SDPA,
    which picks cuDNN/flash/memory-efficient kernels): the job config has no setting for it, so
    any other ``attention`` than flash is said in the header."""
    lost: list[str] = []
    if attention == "flex":
        lost.append("flex attention (--attention flex): torchtitan's job config has no attention setting; a model "
                    "flavour picks FlexAttention (its flex_attn flavours), the others call SDPA (read back as flash)")
    elif attention != "flash":
        lost.append(f"{attention} attention (--attention {attention}"
                    + ("; the s x s scores kept" if attention == "eager" else "")
                    + "): torchtitan's job config has no attention setting; its models call SDPA with "
                    "causal masking (fused kernels, read back as flash)")
    if model is not None and s.tp > model.split_kv_heads:
        lost.append(f"tp={s.tp} above the model's {model.num_kv_heads} KV heads (torchtitan's TP plan splits whole "
                    "heads; Megatron-Core runs it)")
    tables: dict[str, dict[str, Any]] = {}
    flavour = next(((n, f) for (n, f), preset in FLAVOURS.items() if model is not None and preset == model.name), None)
    notes: list[str] = []
    if flavour is not None and model is not None and model.mtp_depth:
        notes.append(f"torchtitan's {flavour[0]} {flavour[1]} builds no MTP module; {model.name}'s MTP is left out")
    if flavour is not None:
        tables["model"] = {"name": flavour[0], "flavor": flavour[1]}
        windows = window_lost(model, FLAVOURS[flavour], f"torchtitan's {flavour[0]} {flavour[1]}") if model else None
        if windows:
            lost.append(windows)
    p = policy_of(s.precision)
    training: dict[str, Any] = {}
    if p.name in ("fsdp-bf16", "fsdp-fp8") or (p.param_bytes == 4 and p.master_weight_bytes == 0 and p.compute_dtype in ("bf16", "fp8")
                                               and p.param_gather_bytes == (1 if p.compute_dtype == "fp8" else 2)):
        training["mixed_precision_param"] = "bfloat16"
    elif p.compute_dtype == "fp32" and p.param_bytes == 4:
        training["mixed_precision_param"] = "float32"
    elif p.param_bytes == 2 and p.master_weight_bytes == 0 and p.grad_bytes == 2:
        training["dtype"] = "bfloat16"
    else:
        lost.append(f"precision {p.name!r} (torchtitan keeps fp32 sharded parameters or pure bf16)")
    if p.compute_dtype == "fp8":
        tables.setdefault("model", {})["converters"] = ["quantize.linear.float8"]
        if p.param_gather_bytes == 1 and p.param_bytes == 4:
            tables["quantize.linear.float8"] = {"enable_fsdp_float8_all_gather": True}
    if p.optimizer_states != 2 or p.optimizer_state_bytes != p.param_bytes:
        lost.append(f"optimizer state bytes of {p.name!r}")
    if s.pp > 1:
        local = s.micro_batch_size * s.num_micro_batches
    else:
        local = s.micro_batch_size
    training.update(local_batch_size=local, global_batch_size=s.global_batch_size, seq_len=s.seq_length)
    if s.optimizer_offload and s.zero == 3:
        training["enable_cpu_offload"] = True  # FSDP2's CPUOffloadPolicy, as the pytorch runtime prices it
        if s.optimizer_offload_fraction < 1.0:
            lost.append(f"offloading {s.optimizer_offload_fraction:g} of the optimizer (FSDP2's CPU offload moves "
                        "all of it)")
    elif s.optimizer_offload:
        lost.append("optimizer offload without FSDP (torchtitan's enable_cpu_offload is FSDP2's CPU offload: the "
                    "parameter and gradient shards with the optimizer states)")
    tables["training"] = training

    par: dict[str, Any] = {}
    if s.zero == 0:
        par.update(data_parallel_replicate_degree=s.dp, data_parallel_shard_degree=1)
        if s.cp > 1:
            lost.append("no sharding with CP (torchtitan applies FSDP over the CP ranks)")
    else:
        group = s.shard_group or s.dp * s.cp
        if group == 1 and s.cp == 1:  # (a group of one with CP > 1 is not a multiple of cp: below)
            lost.append(one_rank_sharding(model, s, "data_parallel_shard_degree = 1 (with cp 1) applies no FSDP"))
        elif s.zero != 3 or not s.fsdp:
            lost.append(f"ZeRO-{s.zero}{'' if s.fsdp else ' without FSDP'} (torchtitan shards with FSDP2, ZeRO-3)")
        if group % s.cp:
            lost.append(f"shard_group={s.shard_group} not a multiple of cp")
            group = s.dp * s.cp
        shard = group // s.cp
        par.update(data_parallel_replicate_degree=s.dp // shard, data_parallel_shard_degree=shard)
        default = s.pp == 1
        if s.reshard_after_forward != default:
            par["fsdp_reshard_after_forward"] = "always" if s.reshard_after_forward else "never"
    par["tensor_parallel_degree"] = s.tp
    fsdp = par["data_parallel_shard_degree"] > 1 or s.cp > 1  # ParallelDims.fsdp_enabled
    if not fsdp and (s.tp > 1 or s.pp > 1) and training.get("mixed_precision_param") == "bfloat16":
        # torchtitan/distributed/utils.py maybe_enable_amp: without FSDP, TP or PP trains in fp32.
        lost.append(f"precision {p.name!r} without FSDP (torchtitan applies bf16 mixed precision through FSDP, "
                    "and disables it under TP or PP without FSDP: it trains in fp32)")
    if s.tp > 1 and loss_parallel is False:
        par["disable_loss_parallel"] = True
    if s.sequence_parallel != (s.tp > 1):
        lost.append(f"sequence_parallel={s.sequence_parallel} (torchtitan always shards sequences with TP)")
    par.update(_pipeline_keys(model, s, lost))
    par["context_parallel_degree"] = s.cp
    if s.cp > 1 and s.cp_kind != "ring":
        lost.append(f"{s.cp_kind} context parallelism (torchtitan runs ring attention)")
    if s.ep > 1:
        par["expert_parallel_degree"] = s.ep
        if s.etp not in (1, s.tp):
            lost.append(f"etp={s.etp} (torchtitan supports etp = 1 or tp)")
        par["expert_tensor_parallel_degree"] = s.etp if s.etp in (1, s.tp) else 1
    elif s.etp != s.tp:
        lost.append(f"etp={s.etp} without EP (torchtitan splits experts like other layers)")
    tables["parallelism"] = par

    ac: dict[str, Any] = {}
    if s.recompute == "none":
        ac["mode"] = "none"
    elif s.recompute == "full":
        ac["mode"] = "full"
        if s.recompute_layers:
            lost.append(f"full recompute of {s.recompute_layers} layers per stage")
    else:
        ac.update(mode="selective", selective_ac_option="op")
        if s.recompute_modules:
            lost.append(f"Megatron's recompute modules ({' '.join(s.recompute_modules)}): torchtitan's selective "
                        "recompute is its per-op policy")
        if s.recompute_layers:
            lost.append(f"selective recompute of {s.recompute_layers} layers per stage")
    tables["activation_checkpoint"] = ac
    if torch_compile != "off":
        tables["compile"] = {"enable": True, "components": torch_compile.split("+")}
    if s.offload_modules:
        lost.append(f"activation offload (Megatron-Core only): {' '.join(s.offload_modules)}")
    if s.offload_layers:
        lost.append(f"layer offload (Megatron-Core only): the first {s.offload_layers} layers' activations")
    if s.offload_optimizer_states:
        lost.append("the optimizer states on the host between steps (Megatron-Core's --offload-optimizer-states, "
                    "MindSpeed's --swap-optimizer only)")

    lines = ["# torchtitan job settings written by ndplan" + (f" for {model.name}" if model else "") + f": {s.short()}",
             f"# world size: {s.world_size} (NGPU × nodes)"]
    if flavour is None:
        lines.append("# [model]: no torchtitan flavour for this model; set name and flavor by hand")
    lines += [f"# ndplan: not expressible in torchtitan, left out: {item}" for item in lost]
    refused = refusal(tables, s.world_size)
    if refused:
        lines.append(f"# ndplan: torchtitan will refuse these settings: {refused}")
    lines += [f"# ndplan: {item}" for item in notes]
    for name, values in tables.items():
        lines.append("")
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def refusal(settings: dict[str, Any], devices: int) -> str:
    """Why torchtitan stops at job ``settings`` (a TOML's tables) on ``devices`` GPUs, or ''.
    Its ParallelDims._validate (torchtitan/distributed/parallel_dims.py) asserts "Currently we
    only support ETP=TP or ETP=1" and lays the experts over the data-parallel shards, so that with
    EP, etp = tp needs ep % cp == 0 and (dp_shard·cp) % ep == 0, and etp = 1 needs
    ep % (cp·tp) == 0 and (dp_shard·cp·tp) % ep == 0; its models' parallelize functions assert
    seq_len % (tp·2·cp) == 0 (ParallelDims.seq_len_divisor). ndplan's reader takes such layouts
    (experts over any dp·cp·tp ranks), so a read-back alone does not catch them."""
    par, seq = settings.get("parallelism", {}), settings.get("training", {}).get("seq_len")
    replicate, shard = par.get("data_parallel_replicate_degree", 1), par.get("data_parallel_shard_degree", -1)
    tp, pp, cp = (par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1),
                  par.get("context_parallel_degree", 1))
    ep, etp = par.get("expert_parallel_degree", 1), par.get("expert_tensor_parallel_degree", 1)
    if shard < 0:
        shard = devices // (replicate * cp * tp * pp)
    if seq is not None and seq % (tp * 2 * cp):
        return f"seq_len {seq}: torchtitan needs it divisible by tp·2·cp = {tp * 2 * cp}"
    if ep <= 1:
        return ""
    if etp not in (1, tp):
        return f"expert_tensor_parallel_degree {etp}: torchtitan supports 1 or tensor_parallel_degree ({tp})"
    borrowed, of = (cp, "cp") if etp == tp else (cp * tp, "cp·tp")
    if ep % borrowed or (shard * borrowed) % ep:
        return (f"expert_parallel_degree {ep} with etp {etp}: torchtitan's ParallelDims needs ep a multiple of "
                f"{of} = {borrowed} and dividing data_parallel_shard_degree·{of} = {shard * borrowed}")
    return ""


def _pipeline_keys(model: ModelSpec | None, s: Strategy, lost: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"pipeline_parallel_degree": s.pp}
    if s.pp == 1:
        return out
    if s.schedule not in _WRITE_SCHEDULES:
        lost.append(f"schedule {s.schedule!r}")
    out["pipeline_parallel_schedule"] = _WRITE_SCHEDULES.get(s.schedule, "1F1B" if s.vpp == 1 else "Interleaved1F1B")
    out["pipeline_parallel_microbatch_size"] = s.micro_batch_size
    stages = s.pp * s.vpp
    default_vpp = 2 if s.schedule in _MULTI_STAGE else 1
    if model is None:
        if s.stage_layers is not None:
            lost.append("explicit stage_layers without a model (module names need the layer count)")
        if s.vpp != default_vpp:
            lost.append(f"vpp={s.vpp} without a model")
        out["pipeline_parallel_first_stage_less_layers"] = int(s.embedding_as_layer)
        out["pipeline_parallel_last_stage_less_layers"] = int(s.output_as_layer)
        return out
    layers = model.num_layers
    counts = layer_counts(s, layers)
    stage_layers, emb, last = canonical_placement(counts, layers, s.pp, s.vpp)
    if stage_layers is None:
        weights = {"pipeline_parallel_first_stage_less_layers": int(emb),
                   "pipeline_parallel_last_stage_less_layers": int(last)}
        if s.vpp == default_vpp:
            return {**out, **weights}
        per_stage = math.ceil((layers + emb + last) / stages)
        if math.ceil((layers + emb + last) / per_stage) == stages and \
                uniform_layer_counts(layers, stages, embedding_as_layer=emb, output_as_layer=last) == counts:
            return {**out, **weights, "pipeline_parallel_layers_per_stage": per_stage}
    parts: list[list[str]] = []
    start = 0
    for i, count in enumerate(counts):
        part = (["tok_embeddings"] if i == 0 else []) + [f"layers.{j}" for j in range(start, start + count)]
        if i == len(counts) - 1:
            part += ["norm", "output"]
        parts.append(part)
        start += count
    out["module_fqns_per_model_part"] = parts
    return out

