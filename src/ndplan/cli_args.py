"""Command-line arguments shared by the subcommands that take a model, a cluster and a strategy.

The same keys can come from a YAML plan file (``--plan``); flags given on the command line win.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ndplan.errors import NdplanError, did_you_mean
from ndplan.io.common import PLAN_TO_FIELD, derive_batch
from ndplan.model.hf import first_validation_error
from ndplan.model.presets import read_structured_file
from ndplan.strategy.precision import PRECISION_PRESETS
from ndplan.strategy.strategy import (
    CP_KINDS,
    MAX_DEGREE,
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    RECOMPUTES,
    SCHEDULES,
    Strategy,
)
from ndplan.units import format_bytes

#: Plan-file keys and the Strategy field each maps to (CLI flags use the same names with dashes);
#: the framework readers produce settings in the same keys.
_STRATEGY_KEYS = PLAN_TO_FIELD
_PLAN_KEYS = set(_STRATEGY_KEYS) | {"model", "hardware", "efficiency", "devices", "overlap"}
EFFICIENCY_HELP = ("step-time efficiency profile YAML (what `ndplan calibrate` writes): its figures replace "
                   "the device family's")
#: Options that stay flags (the runtime's and the output's), which a plan file refuses by name.
_FLAG_ONLY = {
    "memory_limit", "runtime", "attention", "loss_parallel", "loss_upcast", "selective_policy", "census",
    "no_overhead", "moe_imbalance", "moe_dispatcher", "moe_capacity_factor", "emit", "explain", "plot", "json",
    "compile", "modules", "experts_outside_fsdp", "ulysses_kv_repeat",
}
#: Plan keys that hold whole numbers (ndplan does arithmetic on some before the Strategy
#: validates them, so a plan file's value is checked as it is read).
_WHOLE_NUMBER_KEYS = {
    "devices", "dp", "tp", "pp", "cp", "ep", "etp", "vpp", "ulysses_degree", "seq_chunks", "zero", "shard_group",
    "recompute_layers", "offload_layers", "mbs", "num_micro_batches", "pipeline_runs", "gbs", "seq",
}


class OnOff(argparse.Action):
    """One of a pair of switches (``--sp`` / ``--no-sp``) that set the same ``dest`` on or off
    (``const``): given both, argparse let the last win silently; this refuses the second, naming
    both. The flags given are remembered per namespace, the same flag twice being no conflict."""

    def __init__(self, option_strings: list[str], dest: str, const: bool = True, default: Any = None,
                 help: str | None = None) -> None:  # noqa: A002 (argparse's keyword)
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given: dict[str, tuple[str, bool]] = getattr(namespace, "_switches_given", None) or {}
        earlier = given.get(self.dest)
        if earlier is not None and earlier[1] != self.const:
            parser.error(f"{earlier[0]} and {option_string} contradict each other; give one of them")
        given[self.dest] = (option_string or self.dest, bool(self.const))
        namespace._switches_given = given
        setattr(namespace, self.dest, self.const)


def add_switch(group: Any, on: str, off: str, dest: str, on_help: str | None = None,
               off_help: str | None = None) -> None:
    """``on`` / ``off`` setting ``dest`` True / False (None where neither is given); both given is
    an error naming them (``OnOff``)."""
    group.add_argument(on, dest=dest, action=OnOff, const=True, default=None, help=on_help)
    group.add_argument(off, dest=dest, action=OnOff, const=False, default=None, help=off_help)


def add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the model, the cluster and every strategy dimension."""
    group = parser.add_argument_group("model and cluster")
    group.add_argument("--model", help="preset name (see `ndplan models`), a config.json / spec YAML path, or a model folder with a config.json")
    group.add_argument("--hardware", help="device preset (see `ndplan hardware`) or a device YAML path")
    group.add_argument("--efficiency", help=EFFICIENCY_HELP)
    group.add_argument("--devices", type=device_count,
                       help="number of devices in the cluster (default: dp·tp·pp·cp, or a --from config's world size)")
    group.add_argument("--plan", type=Path, help="YAML/JSON file with any of these settings (flags win)")

    par = parser.add_argument_group("parallelism")
    for flag, text in [
        ("dp", "data parallel degree (default: devices / (tp·pp·cp))"),
        ("tp", "tensor parallel degree (default 1)"),
        ("pp", "pipeline parallel degree (default 1)"),
        ("cp", "context parallel degree (default 1)"),
        ("ep", "expert parallel degree (default 1)"),
        ("etp", "expert tensor parallel degree (default: tp)"),
        ("vpp", "virtual pipeline chunks per stage (default 1; 2 for zbv and dualpipev)"),
        ("ulysses-degree", "Ulysses part of hybrid context parallelism, dividing --cp (default 1)"),
        ("seq-chunks", "Seq1F1B sub-sequences per micro-batch (default 1)"),
    ]:
        par.add_argument(f"--{flag}", type=int, help=text)
    par.add_argument("--cp-kind", choices=CP_KINDS,
                     help="how context parallelism splits attention: ring passes K/V blocks around the ranks, "
                          "ulysses swaps sequence for heads by all-to-all, hybrid does both (--ulysses-degree), "
                          "allgather gathers the whole K/V before attention (Megatron's --cp-comm-type allgather) "
                          "(default ring)")
    add_switch(par, "--sp", "--no-sp", "sp", "sequence parallelism (needs tp > 1)",
               "no sequence parallelism (the default; overrides a --from config or plan file)")
    par.add_argument("--schedule", choices=SCHEDULES,
                     help="pipeline schedule (default 1f1b): interleaved takes --vpp, zbv and dualpipev two "
                          "chunks a stage (--vpp 2), seq1f1b --seq-chunks")
    par.add_argument("--stage-layers", type=_int_list, help="layers per virtual stage, comma-separated, e.g. 18,20,21,21 (default: even, the "
                          "remainder on the first chunks)")

    mem = parser.add_argument_group("sharding, recompute and precision")
    mem.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                     help="ZeRO stage over dp·cp: 1 shards optimizer states (Megatron's distributed optimizer), "
                          "2 also gradients, 3 also parameters (default 0)")
    mem.add_argument("--fsdp", action="store_true", default=None, help="torch FSDP (implies --zero 3)")
    mem.add_argument("--shard-group", type=int,
                     help="HSDP: shard within groups of this many ranks (default 0: all dp·cp ranks)")
    mem.add_argument("--no-reshard", dest="reshard", action="store_false", default=None,
                     help="FSDP keeps parameters gathered after forward (default: resharded)")
    mem.add_argument("--optimizer-offload", action="store_true", default=None,
                     help="optimizer states in host memory, the update run by Adam on the CPU")
    mem.add_argument("--optimizer-offload-fraction", type=float, metavar="SHARE",
                     help="with --optimizer-offload, the share of the rank's parameters updated on the CPU, the rest "
                          "on the device beside it (Megatron-Core's --optimizer-offload-fraction; runtime megatron) "
                          "(default 1: all)")
    mem.add_argument("--offload-optimizer-states", action="store_true", default=None,
                     help="optimizer states and master weights in host memory through the forward and backward, "
                          "back on the device for its step (Megatron-Core's --offload-optimizer-states, MindSpeed's "
                          "--swap-optimizer; runtime megatron, distributed optimizer)")
    mem.add_argument("--recompute", choices=RECOMPUTES,
                     help="activation recompute of the decoder layers (default none): selective re-runs the "
                          "runtime's selective policy in backward, full the whole layer from its input")
    mem.add_argument("--recompute-layers", type=int,
                     help="recompute only this many layers per (virtual) stage, each chunk's first ones (default 0: every layer)")
    mem.add_argument("--recompute-modules", nargs="+", action="extend", choices=RECOMPUTE_MODULES, metavar="MODULE",
                     help="what selective recompute re-runs, as Megatron-Core's --recompute-modules "
                          f"({', '.join(RECOMPUTE_MODULES)}; runtime megatron); default: the runtime's own policy")
    mem.add_argument("--offload-modules", nargs="+", action="extend", choices=OFFLOAD_MODULES, metavar="MODULE",
                     help="modules whose saved activations go to host memory, as Megatron-Core's "
                          "--fine-grained-activation-offloading --offload-modules "
                          f"({', '.join(OFFLOAD_MODULES)}; schedules 1f1b/interleaved, not with full recompute)")
    mem.add_argument("--offload-layers", type=int, metavar="N",
                     help="the first N decoder layers' saved activations go to host memory each micro-batch, as "
                          "Megatron-Core's --cpu-offloading-num-layers (runtime megatron; no pipeline, no recompute; "
                          "default 0)")
    mem.add_argument("--precision", choices=sorted(PRECISION_PRESETS),
                     help="bytes per parameter, gradient and optimizer state (default megatron-bf16: bf16 "
                          "weights, fp32 gradients, fp32 master weights and Adam moments; or what a --from "
                          "config states); fsdp-bf16: FSDP2's fp32 shards gathered in bf16; bf16-pure: all "
                          "bf16; fp32: all fp32; -grad16: bf16 gradients; megatron-fp8: fp8 GEMMs")

    batch = parser.add_argument_group("batch")
    batch.add_argument("--seq", type=int, help="sequence length in tokens (default 4096)")
    batch.add_argument("--mbs", type=int, help="micro-batch size in sequences (default 1)")
    batch.add_argument("--gbs", type=sequence_count,
                       help="global batch size in sequences (default: dp·mbs·micro-batches, one micro-batch "
                            "without --num-micro-batches)")
    batch.add_argument("--num-micro-batches", type=int,
                       help="micro-batches per pipeline run (default: gbs / (dp·mbs·pipeline runs))")
    batch.add_argument("--pipeline-runs", type=non_negative_int,
                       help="times the pipeline schedule runs per step, its gradients accumulated (torchtitan and "
                            "NeMo AutoModel with gradient accumulation and pp > 1; default 1: every micro-batch in "
                            "one schedule, as Megatron runs it; 0: as many as --gbs needs with "
                            "--num-micro-batches per run)")


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """The runtime flags (--runtime, and the kernels, loss, recompute policy, overlap and routing it
    prices) that estimate, balance, search and report take."""
    from ndplan.memory.profile import profile_names

    group = parser.add_argument_group("runtime")
    group.add_argument("--runtime", help=f"runtime profile: {', '.join(profile_names())} or a YAML path "
                                         "(default: megatron for a Megatron config read with --from, else pytorch)")
    group.add_argument("--attention", choices=["flash", "sdpa", "eager", "flex"], default=None,
                       help="attention kernel: flash keeps O(s) statistics (a sliding window built in); sdpa is "
                            "PyTorch's SDPA as transformers calls it (flash, but a sliding window becomes an s² mask "
                            "and fp32 with grouped KV heads runs the math path); eager keeps s² scores; flex is "
                            "PyTorch's FlexAttention (kept as flash, priced at its developer's speed against the "
                            "flash kernel on A100/H100) (default: flash, or what a --from config states)")
    add_switch(group, "--loss-parallel", "--no-loss-parallel", "loss_parallel",
               "keep logits vocab-sharded through the loss (under TP; changes nothing at tp 1) (default: the "
               "runtime's own, on for megatron, off for pytorch; or what a --from config states)",
               "the loss on whole logits, gathered over the TP ranks")
    add_switch(group, "--loss-upcast", "--no-loss-upcast", "loss_upcast",
               "the loss works on an fp32 copy of the logits (the default; overrides a --from config)",
               "the loss works on the logits' own dtype, no fp32 copy (NeMo AutoModel's "
               "MaskedCrossEntropy(fp32_upcast=False); Megatron's --cross-entropy-fusion-impl te)")
    add_switch(group, "--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion",
               "gradient_accumulation_fusion",
               "the weight-gradient GEMM adds into the gradient buffer itself (Megatron's default; overrides a "
               "--from launch)",
               "each weight gradient written, then added to its buffer by a kernel of its own (step time; "
               "Megatron's --no-gradient-accumulation-fusion, which MindSpeed-LLM's scripts pass)")
    group.add_argument("--selective-policy", choices=["megatron", "keep-matmuls", "torchtitan-op"], default=None,
                       help="what selective recompute keeps, where the runtime can run more than its own policy: "
                            "torchtitan-op is torchtitan's per-op checkpointing (every second matmul rebuilt; "
                            "pytorch runtime) (default: the runtime's own, or what a --from config states)")
    group.add_argument("--census", help="census JSON: measured activations replace the formulas for its layer kinds")
    group.add_argument("--no-overhead", action="store_true", help="leave out runtime context, communicators, allocator slack, and CUDA kernels' own scratch "
                       "(cuBLAS workspace, softmax backward's product)")
    group.add_argument("--moe-imbalance", type=float, default=None,
                       help="routed tokens on the busiest rank relative to balanced routing (default: an "
                            "--efficiency profile's, else 1.0): its expert activations and its expert compute "
                            "and all-to-all")
    group.add_argument("--overlap", metavar="SPEC",
                       help="what communication hides (step time): a preset (megatron, megatron-tp-overlap, torchtitan, "
                            "deepspeed, plain) and/or switches, e.g. 'tp=on,ep=on,ep_dispatch=node_dedup' "
                            "(default: the runtime's defaults, or what a --from config states)")
    group.add_argument("--moe-dispatcher", choices=["alltoall", "allgather"], default=None,
                       help="Megatron-Core's token dispatcher (megatron runtime): alltoall sends the routed copies; "
                            "allgather gathers every token of the expert-TP x EP group into a persistent buffer and "
                            "reduce-scatters the experts' output in fp32 (default: alltoall, or what a --from "
                            "Megatron launch runs: allgather where it states no --moe-token-dispatcher-type)")
    group.add_argument("--ulysses-kv-repeat", choices=["needed", "always"], default=None,
                       help="when the runtime repeats a tensor-parallel rank's KV heads to its query heads before a "
                            "Ulysses all-to-all (megatron runtime): needed, where the group outnumbers them "
                            "(MindSpeed), or always, on every GQA layer (MindSpeed-LLM's "
                            "--kv-head-repeat-before-uly-alltoall; default: needed, or what a --from launch states)")
    group.add_argument("--compile", dest="torch_compile", choices=["off", "model", "model+loss", "loss"], default=None,
                       help="what torch.compile fuses: model runs each decoder layer's elementwise ops as one fused "
                            "pass, leaving the final norm and loss eager, and prices what compiled layers keep for "
                            "backward (dense layers; others as eager); model+loss fuses the loss too and prices "
                            "what a compiled loss keeps (not a vocabulary-parallel one) (default: off, or what a "
                            "--from torchtitan config's [compile] states)")
    group.add_argument("--modules", choices=["eager", "te"], default=None,
                       help="what the pytorch runtime's modules keep for backward: eager (transformers' and "
                            "torchtitan's modules) or te (NeMo AutoModel's Transformer Engine backend: TE's RMSNorm "
                            "keeps its bf16 input and one statistic; the experts' activation, weighted by the routing "
                            "probabilities before the down projection, keeps its input and the probabilities); "
                            "memory only (default: eager)")
    group.add_argument("--experts-outside-fsdp", action="store_true", default=None,
                       help="under FSDP, the routed experts whose shard group is one rank (EP over the whole "
                            "data-parallel group) are left out of FSDP, as NeMo AutoModel's MoE parallelizer does: "
                            "no gathered copy or unsharded gradient of theirs, gradients in the parameters' dtype")
    group.add_argument("--moe-capacity-factor", type=float, default=None, metavar="CF",
                       help="token-dropping MoE: every expert's buffer holds CF × its balanced share "
                            "(replaces --moe-imbalance for memory)")


def _whole_number(text: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"expected {minimum} to {maximum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number of at least 0."""
    return _whole_number(text, 0)


# The flags that do arithmetic before a Strategy validates anything (dp from --devices, the
# micro-batch count from --gbs, a search's space from them and --seq) are bounded as they are read,
# as the Strategy fields are (strategy.py says why), so that the error names the flag.
def device_count(text: str) -> int:
    """argparse type: a number of devices, 1 to ``MAX_DEGREE``."""
    return _whole_number(text, 1, MAX_DEGREE)


def sequence_count(text: str) -> int:
    """argparse type: a global batch in sequences, 1 to ``MAX_SEQUENCES``."""
    return _whole_number(text, 1, MAX_SEQUENCES)


def sequence_length(text: str) -> int:
    """argparse type: tokens per sequence, 1 to ``MAX_SEQ_LENGTH``."""
    return _whole_number(text, 1, MAX_SEQ_LENGTH)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def read_plan_file(path: Path) -> dict[str, Any]:
    data = read_structured_file(path)
    if not isinstance(data, dict):
        raise NdplanError(f"{path}: a plan file is a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - _PLAN_KEYS, key=str)
    if unknown:
        name = str(unknown[0])
        if name.replace("-", "_") in _FLAG_ONLY:  # as the README says: these stay flags
            raise NdplanError(f"{path}: '{name}' is a flag, not a plan setting: give --{name.replace('_', '-')} on "
                              "the command line (a plan file holds the model, the cluster and the strategy)")
        raise NdplanError(f"{path}: unknown setting '{name}'{did_you_mean(name, _PLAN_KEYS)}; known: "
                          f"{', '.join(sorted(_PLAN_KEYS))}")
    for key in sorted(_WHOLE_NUMBER_KEYS & set(data)):
        value = data[key]
        if value is None and key not in ("devices", "gbs"):  # (devices and gbs: null reads as not given)
            raise NdplanError(f"{path}: setting '{key}' must be a whole number, got null (leave it out for "
                              f"the default)")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise NdplanError(f"{path}: setting '{key}' must be a whole number, got {value!r}")
    for key, most in (("devices", MAX_DEGREE), ("gbs", MAX_SEQUENCES)):  # 0 would read as "not given"
        if isinstance(data.get(key), int) and data[key] < 1:
            raise NdplanError(f"{path}: setting '{key}' must be at least 1, got {data[key]}")
        if isinstance(data.get(key), int) and data[key] > most:  # the bounds of the flags
            raise NdplanError(f"{path}: setting '{key}' must be 1 to {most}, got {data[key]}")
    # fsdp decides the ZeRO stage before the Strategy validates it: a quoted "false" is not true.
    if data.get("fsdp") is not None and not isinstance(data["fsdp"], bool):
        raise NdplanError(f"{path}: setting 'fsdp' must be true or false, got {data['fsdp']!r}")
    layers = data.get("stage_layers")
    if isinstance(layers, str):  # "16,16", as --stage-layers takes it
        try:
            data["stage_layers"] = _int_list(layers)
        except argparse.ArgumentTypeError as error:
            raise NdplanError(f"{path}: setting 'stage_layers': {error}") from None
    elif layers is not None and (not isinstance(layers, list)
                                 or any(isinstance(v, bool) or not isinstance(v, int) for v in layers)):
        raise NdplanError(f"{path}: setting 'stage_layers' must be a list of whole numbers (or \"16,16\"), "
                          f"got {layers!r}")
    for key in sorted({"model", "hardware", "efficiency"} & set(data)):
        if data[key] is not None and not isinstance(data[key], str):
            raise NdplanError(f"{path}: setting '{key}' must be a name or a path, got {data[key]!r}")
    _check_named_values(path, data)
    return data


#: Plan keys whose values are names from a fixed list (precision: a preset's name, in any case,
#: or a mapping of a policy's fields); checked as the file is read so that the error names it.
_NAMED_VALUES: dict[str, tuple[str, ...]] = {
    "schedule": SCHEDULES, "recompute": RECOMPUTES, "cp_kind": CP_KINDS, "precision": tuple(PRECISION_PRESETS),
    "recompute_modules": RECOMPUTE_MODULES, "offload_modules": OFFLOAD_MODULES,
}


def _check_named_values(path: Path, data: dict[str, Any]) -> None:
    """A misspelt name in a plan file (``schedule: 1F1B``, ``recompute: fulll``) is an error naming
    the file, the setting, what is allowed and the name meant: the Strategy's own check said
    "field 'schedule': Input should be ..." with no word of the file."""
    for key, allowed in _NAMED_VALUES.items():
        value = data.get(key)
        if value is None or (key == "precision" and isinstance(value, dict)):
            continue
        many = key.endswith("_modules")
        names = [value] if isinstance(value, str) or not many else value
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            kind = "a name or a list of names from" if many else "one of"
            raise NdplanError(f"{path}: setting '{key}' must be {kind} {', '.join(allowed)}; got {value!r}")
        for name in names:
            if (name.lower() if key == "precision" else name) not in allowed:
                raise NdplanError(f"{path}: setting '{key}': {name!r} is not one of {', '.join(allowed)}"
                                  f"{did_you_mean(name, allowed)}")


def device_from(hardware: str, efficiency: str | None = None) -> Any:
    """The Device of ``--hardware``, with the figures of ``--efficiency`` where given (checked
    here, so that a bad profile is an input error before any work)."""
    from ndplan.hardware import resolve_device
    from ndplan.perf.efficiency import default_efficiency, device_with_efficiency

    device = resolve_device(hardware)
    if efficiency:
        device = device_with_efficiency(device, efficiency)
    default_efficiency(device)  # a device YAML's own efficiency mapping, checked as well
    return device


def memory_limit(text: str | None, device: Any) -> int | None:
    """--memory-limit in bytes (None where not given); a limit above the device's memory is
    allowed (a what-if) but said, since nothing that needs it runs on that device."""
    limit = _size_flag(text, "--memory-limit")
    if limit is None:
        return None
    if limit > device.memory_bytes:
        print(f"ndplan: warning: --memory-limit {format_bytes(limit)} is above the {device.name}'s "
              f"{format_bytes(device.memory_bytes)}: plans up to it will not run on that device", file=sys.stderr)
    return limit


def with_host_memory(text: str | None, device: Any) -> Any:
    """The device with --host-memory (one node's host memory, e.g. 2TB) as its
    ``node_host_memory_bytes``; the device as it is where not given."""
    node_bytes = _size_flag(text, "--host-memory")
    return device if node_bytes is None else device.model_copy(update={"node_host_memory_bytes": node_bytes})


def _size_flag(text: str | None, flag: str) -> int | None:
    """A size flag's value in bytes ("70GiB", "2TB"; None where not given), an error naming ``flag``."""
    from ndplan.units import parse_bytes

    if not text:
        return None
    try:
        return parse_bytes(text)
    except NdplanError as error:
        raise NdplanError(f"{flag}: {error}") from None


HOST_MEMORY_HELP = ("host (CPU) memory of one node, shared by its devices, that activation and optimizer offload "
                    "are checked against, e.g. 2TB (default: the hardware preset's, where it states one)")


def gather_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Plan-file settings overlaid with the flags that were given."""
    settings: dict[str, Any] = read_plan_file(args.plan) if getattr(args, "plan", None) else {}
    if getattr(args, "recompute", None) not in (None, "selective") and getattr(args, "recompute_modules", None) is None:
        settings.pop("recompute_modules", None)  # a recompute that is not selective re-runs no modules
    for key in _PLAN_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    return settings


def strategy_from_settings(settings: dict[str, Any]) -> Strategy:
    """Build a Strategy, deriving dp from the device count and the micro-batch count from gbs."""
    fields = {_STRATEGY_KEYS[k]: v for k, v in settings.items() if k in _STRATEGY_KEYS}
    devices = settings.get("devices")
    tp, pp, cp = (int(fields.get(k, 1)) for k in ("tp", "pp", "cp"))
    # (a degree below 1 derives nothing: the Strategy's own validation names it below)
    if "dp" not in fields and devices and min(tp, pp, cp) >= 1:
        fields["dp"] = max(1, devices // (tp * pp * cp)) if devices % (tp * pp * cp) == 0 else 1
    if fields.get("fsdp") and "zero" not in fields:
        fields["zero"] = 3
    derived_runs = fields.get("pipeline_runs") == 0
    derive_batch(fields)
    gbs = fields.get("global_batch_size")
    if gbs and "num_micro_batches" not in fields:
        per_micro = int(fields.get("dp", 1)) * int(fields.get("micro_batch_size", 1)) * int(fields.get("pipeline_runs", 1))
        if per_micro >= 1:
            fields["num_micro_batches"] = max(1, gbs // per_micro)
    if derived_runs and gbs and "num_micro_batches" in fields:
        # Said here, not by the global-batch rule: its message would quote a run count no one gave.
        per_run = int(fields.get("dp", 1)) * int(fields.get("micro_batch_size", 1)) * int(fields["num_micro_batches"])
        if per_run >= 1 and int(gbs) % per_run:
            raise NdplanError(f"pipeline_runs 0 runs the pipeline as often as the global batch needs, but "
                              f"global_batch_size={gbs} is not a whole number of runs of dp·micro_batch_size·"
                              f"num_micro_batches = {fields.get('dp', 1)}·{fields.get('micro_batch_size', 1)}·"
                              f"{fields['num_micro_batches']} = {per_run}")
    try:
        return Strategy(**fields)
    except ValidationError as error:
        raise NdplanError(first_validation_error(error)) from None


def runtime_options(args: argparse.Namespace, settings: dict[str, Any] | None = None,
                    runtime_settings: dict[str, Any] | None = None, device: Any = None) -> Any:
    """The MemoryOptions the runtime flags describe (``add_runtime_arguments``), with the overlap
    switches from ``--overlap``, else a plan file's ``overlap:``, else what a framework config
    stated (``runtime_settings["overlap"]``), else the device runtime's defaults; the runtime
    profile from ``--runtime``, else the config's (a Megatron launch: megatron), else pytorch.
    ``--moe-imbalance`` where given, else ``device``'s efficiency profile's (a calibrated one may
    hold it), so that memory and time price the same busiest rank. A selective policy a config
    states applies where its runtime prices it and no census replaces the formulas (the flag's is
    checked as given)."""
    from ndplan.memory import MemoryOptions
    from ndplan.memory.profile import get_profile
    from ndplan.perf.overlap import parse_overlap

    census: tuple[Any, ...] = ()
    if getattr(args, "census", None):
        from ndplan.census.record import load_census_file

        census = tuple(load_census_file(args.census))
    overlap = (settings or {}).get("overlap")
    if overlap is None:
        overlap = (runtime_settings or {}).get("overlap")
    stated = runtime_settings or {}
    # A flag wins; else what the config stated; else the default.
    loss_parallel = getattr(args, "loss_parallel", None)
    loss_upcast = getattr(args, "loss_upcast", None)
    runtime = getattr(args, "runtime", None) or stated.get("runtime") or "pytorch"
    policy = getattr(args, "selective_policy", None)
    if policy is None and stated.get("selective_policy") in get_profile(runtime).selective_policies and not census:
        policy = stated["selective_policy"]
    imbalance = getattr(args, "moe_imbalance", None)
    if imbalance is None:
        from ndplan.perf.efficiency import default_efficiency

        imbalance = default_efficiency(device).moe_imbalance if device is not None else 1.0
    return MemoryOptions(
        runtime=runtime,
        attention=getattr(args, "attention", None) or stated.get("attention") or "flash",
        loss_parallel=stated.get("loss_parallel") if loss_parallel is None else loss_parallel,
        include_overhead=not getattr(args, "no_overhead", False),
        loss_upcast=(stated.get("loss_upcast") if loss_upcast is None else loss_upcast) is not False,
        moe_imbalance=imbalance,
        moe_capacity_factor=(stated.get("moe_capacity_factor") if getattr(args, "moe_capacity_factor", None) is None
                             else args.moe_capacity_factor),
        census=census, overlap=parse_overlap(overlap),
        grouped_gemm=stated.get("grouped_gemm", True),
        selective_policy=policy,
        moe_dispatcher=_moe_dispatcher(args, stated, runtime),
        torch_compile=getattr(args, "torch_compile", None) or stated.get("torch_compile") or "off",
        # A launch's own pipeline sends, where it is priced as the runtime it launches.
        p2p_wait=stated.get("p2p_wait") if runtime == stated.get("runtime") else None,
        gradient_accumulation_fusion=_fusion(args, stated, runtime),
        modules=getattr(args, "modules", None) or stated.get("modules") or "eager",
        experts_outside_fsdp=bool(getattr(args, "experts_outside_fsdp", None) or stated.get("experts_outside_fsdp")),
        ulysses_kv_repeat=getattr(args, "ulysses_kv_repeat", None) or stated.get("ulysses_kv_repeat") or "needed",
    )


def _fusion(args: argparse.Namespace, stated: dict[str, Any], runtime: str) -> bool | None:
    """Whether weight gradients accumulate in the GEMM: the flag; else what a --from launch states,
    where it is priced as the runtime it launches; else None (the runtime's own)."""
    flag = getattr(args, "gradient_accumulation_fusion", None)
    if flag is not None:
        return bool(flag)
    return stated.get("gradient_accumulation_fusion") if runtime == stated.get("runtime") else None


def _moe_dispatcher(args: argparse.Namespace, stated: dict[str, Any], runtime: str) -> Any:
    """The token dispatcher to price: --moe-dispatcher; else what a --from launch runs (a
    Megatron launch's --moe-token-dispatcher-type, allgather where it states none) where the
    runtime prices that dispatcher (another --runtime prices its own, the all-to-all's); else
    alltoall."""
    from ndplan.memory.profile import get_profile

    flag = getattr(args, "moe_dispatcher", None)
    if flag is not None:
        return flag  # (MemoryOptions checks the value)
    launch = stated.get("moe_dispatcher", "alltoall")
    return launch if "moe_allgather" in get_profile(runtime).blocks else "alltoall"
