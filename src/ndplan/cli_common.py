"""What the commands share: the console they print to and their JSON output; for the planning
commands (check, estimate, balance, search), the settings and model their flags, --plan file
and --from config give, the runtime options they price with, and the lines they add about those
(flags that change nothing for the strategy, the kernels the step time prices).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console

from ndplan.cli_args import gather_settings, runtime_options
from ndplan.errors import NdplanError
from ndplan.model import ModelSpec, load_model
from ndplan.strategy import Strategy

# Pipes and CI logs get a wide console so tables are not squeezed into 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def require(settings: dict[str, Any], key: str, flag: str, elsewhere: str = " or in the --plan file") -> Any:
    """``elsewhere``: where else the command reads the setting from (each command its own)."""
    if settings.get(key) is None:
        raise NdplanError(f"missing {flag} (give it as a flag{elsewhere})")
    return settings[key]


def settings_and_model(args: argparse.Namespace) -> tuple[dict[str, Any], ModelSpec, Any]:
    """Settings from --from CONFIG (a framework's launch config), a --plan file and flags, in
    rising priority, and the model they name."""
    from ndplan.io.cli import merge_settings, model_for, print_messages, read_from_args

    result = read_from_args(args)
    settings = merge_settings(result, gather_settings(args))
    if result is not None and result.format != "hf" and "dp" not in settings and not settings.get("devices"):
        # A launch config with no world size (torchtitan's data_parallel_shard_degree -1, a script
        # without torchrun's counts): the strategy is incomplete, as `inspect` says, not dp 1.
        raise NdplanError(f"{result.source}: the data-parallel degree depends on the world size, which the file "
                          "does not state; give --devices (or --dp)")
    print_messages(result)
    if result is None:
        return settings, load_model(require(settings, "model", "--model")), None
    return settings, model_for(settings, result), result


def memory_options(args: argparse.Namespace, settings: dict[str, Any], read: Any, device: Any = None) -> Any:
    """The runtime options of a command (``cli_args.runtime_options``), with what a --from config
    stated where no flag sets it. Where the command writes a torchtitan config (``--emit
    torchtitan``), selective recompute is priced as the per-op policy that config runs. Where it
    writes a torchtitan, Megatron or MindFormers config, the loss is priced vocabulary-parallel
    under TP (torchtitan's default; Megatron's and MindFormers' only loss), unless a flag or the
    config chose otherwise."""
    from dataclasses import replace

    options = runtime_options(args, settings, read.runtime_settings if read is not None else None, device)
    fmt = getattr(args, "emit", None)
    if fmt == "torchtitan" and (options.selective_policy is None and not options.census
                                and "torchtitan-op" in options.profile.selective_policies):
        options = replace(options, selective_policy="torchtitan-op")
    if fmt in ("torchtitan", "megatron", "mindformers") and options.loss_parallel is None:
        options = replace(options, loss_parallel=True)
    return options


def dispatcher_note(options: Any, model: Any) -> str:
    """What the overlap line adds where Megatron's allgather token dispatcher is priced."""
    if options.moe_dispatcher != "allgather" or not model.is_moe:
        return ""
    return "; token dispatcher allgather (all-gather + reduce-scatter over etp×ep, not the all-to-all)"


def runtime_cautions(strategy: Strategy, options: Any, model: Any, device: Any) -> list[str]:
    """What the runtime priced cannot run of the strategy (``search.run.runtime_refusals``: the
    search leaves such candidates out), said beside an estimate rather than refusing it: the
    figures are still what the strategy would hold and take."""
    from ndplan.search.run import runtime_refusals

    return [f"the {options.runtime} runtime cannot run this strategy: {reason}"
            for reason in runtime_refusals(strategy, options, model, device)]


def inert_flags(args: argparse.Namespace, strategy: Strategy, recompute_chosen: bool = False) -> list[str]:
    """Settings given as flags (or, --cp-kind, in a --plan file) that change nothing for this
    strategy, said as --moe-imbalance on a dense model is (``memory.report``'s inert settings):
    a user who set them expects them priced. (A --from config's own settings, and what --emit
    turns on, are not the user's flags.) ``recompute_chosen``: the command chooses the recompute
    (balance), so a selective policy may apply whatever the strategy's own."""
    out = []
    loss_parallel = getattr(args, "loss_parallel", None)
    if loss_parallel is not None and strategy.tp == 1:
        out.append(f"{'--loss-parallel' if loss_parallel else '--no-loss-parallel'} changes nothing at tp 1: the "
                   "loss is vocabulary-parallel across tensor-parallel ranks only")
    policy = getattr(args, "selective_policy", None)
    if policy is not None and strategy.recompute != "selective" and not recompute_chosen:
        out.append(f"--selective-policy {policy} changes nothing: the strategy has no selective recompute "
                   f"(recompute {strategy.recompute}; the policy applies to --recompute selective)")
    cp_kind = getattr(args, "cp_kind", None) or (gather_settings(args).get("cp_kind") if getattr(args, "plan", None)
                                                 else None)
    if cp_kind is not None and strategy.cp == 1:
        out.append(f"--cp-kind {cp_kind} changes nothing at cp 1: it says how context parallelism splits the "
                   f"sequence (give --cp 2 or more)")
    return out


def _fact_text(value: Any) -> str:
    """A kernel fact as the flags write switches: on/off for a yes/no one."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _compiled_memory_text(options: Any, model: Any) -> str:
    """What --compile does to the memory priced: what compiled layers and a compiled loss were
    measured keeping, or why the eager modules' figures stand (docs/memory.md)."""
    parts = []
    if "model" in options.torch_compile:
        gap = options.compiled_layers_gap(model) if model is not None else ""
        parts.append(f"the layers keep what eager ones do ({gap})" if gap else
                     "the layers keep what compiled layers were measured keeping (norms their bf16 input, "
                     "no MLP activation)")
    if "loss" in options.torch_compile:
        parts.append("the loss its bf16 logits (a compiled cross-entropy)" if options.compiled_loss() else
                     "the loss what an eager one keeps (vocabulary-parallel, not measured compiled)")
    return "in memory " + "; ".join(parts) + " (docs/memory.md)"


def print_kernels(options: Any, strategy: Strategy | None = None, recompute_chosen: bool = False,
                  model: Any = None) -> None:
    """The kernels the runtime's step time prices (its profile's ``kernels``), where it states any,
    and the selective policy and the loss where they are not the runtime's own; of one
    ``strategy``, only where they price something in it (the policy under selective recompute,
    unless the command chooses the recompute, ``recompute_chosen``; the vocabulary-parallel loss
    under TP)."""
    if options.profile.kernels:
        kernels = ", ".join(f"{name} {_fact_text(value)}" for name, value in options.profile.kernels.items())
        console.print(f"kernels ({options.profile.name} runtime; another runtime with --runtime): {kernels}", markup=False)
    if options.torch_compile != "off":
        software = options.time_keywords()["software"]
        console.print(f"torch.compile of the {options.torch_compile.replace('+', ' and ')} (--compile): elementwise_passes "
                      f"{software['elementwise_passes']:g} in the decoder layers, {software['loss_elementwise_passes']:g} "
                      f"in the final norm and loss; {_compiled_memory_text(options, model)}", markup=False)
    if options.modules == "te":
        console.print("modules te: in memory, Transformer Engine's RMSNorm (its bf16 input and one statistic) and "
                      "experts weighted by their fp32 routing probabilities before the down projection (its input "
                      "and the probabilities), NeMo AutoModel's; the step time prices the kernels above "
                      "(docs/memory.md)", markup=False)
    own_wait = str(options.profile.kernels.get("p2p_wait", "1f1b"))
    if options.p2p_wait is not None and options.p2p_wait != own_wait:
        console.print(f"pipeline sends waited for in the {options.p2p_wait.replace('+', ' and ')} schedules "
                      f"(the launch's; the {options.profile.name} runtime's own: {own_wait.replace('+', ' and ')})",
                      markup=False)
    own_fusion = bool(options.profile.kernels.get("gradient_accumulation_fusion", True))
    if options.gradient_accumulation_fusion is not None and options.gradient_accumulation_fusion != own_fusion:
        console.print("weight gradients accumulated " + ("in the GEMM (--gradient-accumulation-fusion)"
                      if options.gradient_accumulation_fusion else "by a kernel of their own after the GEMM "
                      "(--no-gradient-accumulation-fusion)"), markup=False)
    if strategy is not None and strategy.recompute != "selective" and not recompute_chosen:
        pass  # no policy priced
    elif options.selective_policy not in (None, options.profile.selective_policy):
        console.print(f"selective recompute priced as {options.selective_policy} (the {options.profile.name} "
                      f"runtime's own: {options.profile.selective_policy}; set with --selective-policy)", markup=False)
    if options.loss_parallel not in (None, options.profile.loss_parallel) and (strategy is None or strategy.tp > 1):
        # --emit torchtitan/megatron/mindformers turns it on: a peak that moves with the output
        # flag says why.
        def kind(parallel: bool) -> str:
            return "vocabulary-parallel under TP" if parallel else "on whole logits"

        console.print(f"loss priced {kind(options.loss_parallel)} (the {options.profile.name} runtime's own: "
                      f"{kind(options.profile.loss_parallel)}; set with --loss-parallel/--no-loss-parallel)",
                      markup=False)


def efficiency_entry(path: str | None) -> dict[str, str]:
    """The JSON entry naming an --efficiency profile, where one was given."""
    return {"efficiency": str(path)} if path else {}
