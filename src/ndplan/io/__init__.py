"""Read the training configs users already have, and write ndplan's strategies back as them.

``read_config(path)`` recognises a Megatron-LM / MindSpeed-LLM launch script or argument
file, a torchtitan job TOML, a HyperParallel or MindFormers training YAML, or a Hugging Face
``config.json``, and returns a :class:`ReadResult`: the model, the strategy settings in
plan-file keys, the device count and a warning for everything it cannot represent.
``emit(model, strategy, fmt)`` writes a strategy as ``megatron`` arguments, a ``torchtitan``
TOML section set, or ``hyperparallel`` / ``mindformers`` YAML.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ndplan.errors import NdplanError
from ndplan.io.common import (
    FIELD_TO_PLAN,
    PLAN_TO_FIELD,
    ReadResult,
    canonical_strategy,
    load_json,
    load_yaml,
    precision_setting,
    read_text,
)
from ndplan.model.presets import load_model, load_model_file
from ndplan.model.spec import ModelSpec
from ndplan.strategy.strategy import Strategy

__all__ = [
    "EMIT_FORMATS", "PLAN_TO_FIELD", "READ_FORMATS", "ReadResult", "canonical_strategy", "detect_format", "emit",
    "read_config",
]

READ_FORMATS: tuple[str, ...] = ("megatron", "torchtitan", "hyperparallel", "mindformers", "hf")
EMIT_FORMATS: tuple[str, ...] = ("megatron", "torchtitan", "hyperparallel", "mindformers")

def _emitters() -> dict[str, Callable[..., str]]:
    # The framework modules load on first use: the CLI imports this package for its plan-file
    # keys on every command, and most commands read or write no framework config.
    from ndplan.io import hyperparallel, mindformers, torchtitan
    from ndplan.io.megatron_emit import emit_megatron

    return {
        "megatron": emit_megatron,
        "torchtitan": torchtitan.emit,
        "hyperparallel": hyperparallel.emit,
        "mindformers": mindformers.emit,
    }

_MINDFORMERS_KEYS = {"parallel_config", "recompute_config", "runner_config", "moe_config", "runner_wrapper"}
_HYPERPARALLEL_KEYS = {"accelerator", "fsdp_config", "plan_overrides", "activation_checkpoint", "gradient_checkpointing"}
_MEGATRON_HINTS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                   "global_batch_size", "num_layers", "seq_length", "use_distributed_optimizer"}


def _structured(path: Path, text: str, kind: str) -> Any:
    return load_json(path, text) if kind == "json" else load_yaml(path, text)


def detect_format(path: str | Path, text: str | None = None) -> tuple[str, str]:
    """(format, syntax) of a config file: by extension, then by the keys it holds."""
    path = Path(path)
    text = read_text(path) if text is None else text
    suffix = path.suffix.lower()
    if suffix in (".sh", ".bash", ".zsh"):
        return "megatron", "shell"
    if suffix == ".toml":
        return "torchtitan", "toml"
    if suffix in (".json", ".yaml", ".yml"):
        kind = "json" if suffix == ".json" else "yaml"
        data = _structured(path, text, kind)
        if isinstance(data, dict):
            keys = set(data)
            model = data.get("model")
            if keys & _MINDFORMERS_KEYS or (isinstance(model, dict) and "model_config" in model):
                return "mindformers", kind
            if keys & _HYPERPARALLEL_KEYS or (isinstance(model, dict) and "_target_" in model):
                return "hyperparallel", kind
            if "model_type" in keys and ("num_hidden_layers" in keys or "architectures" in keys or "text_config" in keys):
                return "hf", kind
            flat = {str(k).lstrip("-").replace("-", "_") for k in keys}
            if flat & _MEGATRON_HINTS:
                return "megatron", kind
        raise NdplanError(
            f"{path}: cannot tell which framework this {kind.upper()} file configures (no parallel_config, "
            "accelerator, model_type or Megatron argument names); pass --from-format"
        )
    if text.startswith("#!") or "torchrun" in text or "pretrain_" in text or "--tensor-model-parallel-size" in text:
        return "megatron", "shell"
    # Lines of --flags (an argument file): any known Megatron argument among them.
    flags = {word.lstrip("-").split("=")[0].replace("-", "_") for word in text.split() if word.startswith("--")}
    if flags & _MEGATRON_HINTS:
        return "megatron", "shell"
    raise NdplanError(f"{path}: unknown config file type {suffix or '(no extension)'}; "
                      f"known: .sh (Megatron), .toml (torchtitan), .yaml/.json (HyperParallel, MindFormers, "
                      "Megatron arguments, Hugging Face config.json)")


def read_config(
    path: str | Path, model: ModelSpec | str | None = None, devices: int | None = None, fmt: str | None = None,
) -> ReadResult:
    """Read a framework config. ``model`` (a ModelSpec, preset name or config path) completes or
    overrides the model the file describes; ``devices`` gives the world size where the file
    has none (and must agree with it where it has one)."""
    path = Path(path)
    text = read_text(path)
    base = load_model(model) if isinstance(model, str) else model
    if fmt is None:
        fmt, kind = detect_format(path, text)
    else:
        if fmt not in READ_FORMATS:
            raise NdplanError(f"unknown config format '{fmt}'; known: {', '.join(READ_FORMATS)}")
        suffix = path.suffix.lower()
        kind = {".toml": "toml", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(suffix, "shell")
    from ndplan.io import hyperparallel, megatron, mindformers, torchtitan

    if fmt == "megatron":
        result = megatron.read(path, text, kind, base, devices)
    elif fmt == "torchtitan":
        result = torchtitan.read(path, text, base, devices)
    elif fmt == "hyperparallel":
        result = hyperparallel.read(path, text, base, devices)
    elif fmt == "mindformers":
        result = mindformers.read(path, text, base, devices)
    else:
        described = load_model_file(path)  # read (and checked) even where --model replaces it
        result = ReadResult(format="hf", source=str(path), model=base if base is not None else described)
        if base is not None and base.model_copy(update={"name": described.name}) != described:
            result.warnings.append(f"{path}: the model given ({base.name}) replaces the one this config describes "
                                   f"({described.name}, {described.num_layers} layers, hidden {described.hidden_size}); "
                                   "leave out --model to price the file's")
    _normalise(result)
    return result


def _normalise(result: ReadResult) -> None:
    """Write the settings in ndplan's normal form (see ``canonical_strategy``) when they are complete."""
    if result.model is None or not result.strategy_settings:
        return
    try:
        strategy = result.strategy()
    except (NdplanError, ValidationError):
        return  # incomplete (no world size) or inconsistent: leave it for the caller's checks
    normal = canonical_strategy(strategy, result.model)
    for name in ("stage_layers", "embedding_as_layer", "output_as_layer", "shard_group", "reshard_after_forward",
                 "recompute_layers"):
        key = FIELD_TO_PLAN[name]
        value = getattr(normal, name)
        if name == "stage_layers" and value is None:
            result.strategy_settings.pop(key, None)
        elif key in result.strategy_settings or value != getattr(Strategy(), name):
            result.strategy_settings[key] = value
    if "precision" in result.strategy_settings:
        result.strategy_settings["precision"] = precision_setting(normal.precision)


def emit(model: ModelSpec | Strategy | str | Path | None, strategy: Strategy | ModelSpec | None, fmt: str,
         overlap: Any = None, *, loss_upcast: bool = True, attention: str = "flash",
         selective_policy: str | None = None, grouped_gemm: bool = True, loss_parallel: bool | None = None,
         moe_capacity_factor: float | None = None, moe_imbalance: float = 1.0,
         moe_dispatcher: str = "alltoall", torch_compile: str = "off", devices_per_node: int | None = None,
         device_runtime: str | None = None, gradient_accumulation_fusion: bool | None = None,
         ulysses_kv_repeat: str = "needed") -> str:
    """The strategy written as ``fmt`` (megatron, torchtitan, hyperparallel, mindformers);
    with a model, the layer placement is exact and Megatron gets the architecture flags.
    ``overlap`` (an ``ndplan.perf.OverlapConfig``: what the step time was priced hiding) becomes
    Megatron's overlap flags, so that reading the launch back prices the same step.
    ``loss_upcast`` False (the loss on the bf16 logits) becomes Megatron's Transformer Engine
    cross-entropy; the other formats' frameworks upcast, which their header says. ``attention``
    (the kernel priced: flash, sdpa or eager, which keeps the s x s scores) becomes Megatron's
    ``--attention-backend unfused``, HyperParallel's ``model.attn_implementation`` and
    MindFormers' ``use_flash_attention``; torchtitan's job config has no such setting (its
    header says so). ``loss_parallel`` (the priced loss: True vocabulary-parallel over TP, False
    on whole logits; None: not stated, the format's default) becomes torchtitan's
    ``disable_loss_parallel`` and HyperParallel's ``accelerator.loss_parallel``; Megatron's and
    MindFormers' loss is always vocabulary-parallel (their header says where another was priced).
    ``selective_policy`` is what selective recompute was priced as (None: the runtime's own):
    torchtitan runs its per-op policy, and its header says so where another was priced.
    ``grouped_gemm`` (a MoE model's experts as one grouped GEMM) becomes ``--moe-grouped-gemm``.
    ``moe_capacity_factor`` (token dropping priced; None: dropless) becomes Megatron's
    ``--moe-expert-capacity-factor``; the other formats' headers say it is left out.
    ``moe_imbalance`` (the busiest rank's routed tokens over balanced routing, a pricing
    assumption no framework sets) is stated in a comment where it is not 1.
    ``moe_dispatcher`` (Megatron-Core's token dispatcher priced: alltoall or allgather) becomes
    ``--moe-token-dispatcher-type``; the other formats have no such setting.
    ``torch_compile`` (what torch.compile was priced fusing: off, model, model+loss, loss)
    becomes torchtitan's ``[compile]`` table; the other formats' headers say it is left out.
    ``devices_per_node`` (the cluster's; None: 8) sets a Megatron launch's torchrun
    ``--nproc_per_node`` and ``--nnodes``; the other formats state no launcher. ``device_runtime``
    'cann' (an Ascend NPU) writes the Megatron launch for MindSpeed: --use-flash-attn for its fused
    attention, --use-mc2 for TP overlap. ``gradient_accumulation_fusion`` False (each weight
    gradient added by a kernel of its own, priced) becomes Megatron's
    --no-gradient-accumulation-fusion; the other formats' frameworks have no such setting.
    ``ulysses_kv_repeat`` 'always' (every GQA layer's KV heads repeated before a Ulysses all-to-all,
    as MindSpeed-LLM runs it) becomes its --kv-head-repeat-before-uly-alltoall in a Megatron launch.
    What the format cannot express is listed in a comment at the top."""
    if isinstance(model, Strategy) and not isinstance(strategy, Strategy):
        model, strategy = strategy, model  # accept (strategy, model, fmt) too
    if not isinstance(strategy, Strategy):
        raise NdplanError("emit needs a Strategy")
    if fmt not in EMIT_FORMATS:
        raise NdplanError(f"unknown output format '{fmt}'; known: {', '.join(EMIT_FORMATS)}")
    if isinstance(model, (str, Path)):
        model = load_model(str(model))  # a preset name or a model file, as read_config takes it
    elif model is not None and not isinstance(model, ModelSpec):
        raise NdplanError(f"emit's model must be a ModelSpec, a preset name or a model file path, "
                          f"got {type(model).__name__}")
    # A pricing assumption, not a setting: said so that a read-back is priced alike.
    imbalance = (f"# ndplan: priced with --moe-imbalance {moe_imbalance:g} (the busiest rank's routed tokens over "
                 "balanced routing), an assumption no setting here holds: give it again to price this file\n"
                 if moe_imbalance != 1.0 and (model is None or model.is_moe) else "")
    compiled = (f"# ndplan: not expressible in {fmt}, left out: torch.compile of the "
                f"{torch_compile.replace('+', ' and ')} (--compile); its kernels are its own\n"
                if torch_compile != "off" and fmt != "torchtitan" else "")
    if fmt == "megatron":
        from ndplan.io.megatron_emit import emit_megatron

        text = emit_megatron(model, strategy, overlap, loss_upcast=loss_upcast, attention=attention,
                             grouped_gemm=grouped_gemm, loss_parallel=loss_parallel,
                             moe_capacity_factor=moe_capacity_factor, moe_dispatcher=moe_dispatcher,
                             devices_per_node=devices_per_node, npu=device_runtime == "cann",
                             gradient_accumulation_fusion=gradient_accumulation_fusion,
                             ulysses_kv_repeat=ulysses_kv_repeat)
        shebang, _, rest = text.partition("\n")  # the comments below the #! line
        return f"{shebang}\n{imbalance}{compiled}{rest}" if imbalance or compiled else text
    if fmt == "torchtitan":
        from ndplan.io.torchtitan import emit as emit_torchtitan

        text = imbalance + emit_torchtitan(model, strategy, attention=attention, loss_parallel=loss_parallel,
                                           torch_compile=torch_compile)
    else:
        text = compiled + imbalance + _emitters()[fmt](model, strategy, attention=attention, loss_parallel=loss_parallel)
    if moe_capacity_factor is not None and (model is None or model.is_moe):
        text = (f"# ndplan: not expressible in {fmt}, left out: an expert capacity factor of "
                f"{moe_capacity_factor:g} (--moe-capacity-factor, token dropping priced); the experts run dropless\n") + text
    if not loss_upcast:  # every other format is TOML or YAML: '#' comments
        text = (f"# ndplan: not expressible in {fmt}, left out: the loss on the bf16 logits (--no-loss-upcast); "
                "its loss upcasts them to fp32\n") + text
    if fmt == "torchtitan" and strategy.recompute == "selective" and selective_policy not in (None, "torchtitan-op"):
        text = (f"# ndplan: not expressible in torchtitan, left out: selective recompute as {selective_policy} "
                "(--selective-policy); torchtitan runs its per-op policy (selective_ac_option op)\n") + text
    return text
