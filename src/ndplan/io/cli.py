"""Command-line pieces for reading framework configs: ``--from`` for the planning commands, and
``ndplan inspect``, which shows what ndplan understood from a config (and can convert it).

The lead wires them in ``ndplan/cli.py``; nothing here registers itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ndplan.cli_args import device_count
from ndplan.errors import NdplanError
from ndplan.io import EMIT_FORMATS, READ_FORMATS, ReadResult, emit, read_config
from ndplan.model.hf import first_validation_error
from ndplan.model.presets import load_model
from ndplan.model.spec import ModelSpec
from ndplan.strategy.strategy import Strategy

#: Settings derived from others; a flag that changes their inputs makes the file's value stale.
_DERIVED = {
    "dp": {"tp", "pp", "cp", "devices"},
    "num_micro_batches": {"dp", "tp", "pp", "cp", "devices", "mbs", "gbs", "pipeline_runs"},
    "stage_layers": {"pp", "vpp"},  # --model is the read's base model: the file's split counts its layers
    "shard_group": {"dp", "tp", "pp", "cp", "devices"},
}


#: What ``--from`` reads, as every command's help says it.
_CONFIGS = ("a Megatron-LM/MindSpeed launch script or argument file, a torchtitan TOML, a HyperParallel or "
            "MindFormers YAML, or a config.json")
#: What each command does with the config beyond that (its --help; default: the planning commands').
FROM_HELP = {
    "plan": f"read model, strategy and cluster from {_CONFIGS} (flags and --plan settings win; a config with no "
            "world size needs --devices)",
    "search": f"read model, cluster and batch from {_CONFIGS} (flags win; with --dims, the dimensions not "
              "searched keep the file's values; the file's settings no dimension holds (HSDP shard "
              "group, reshard, recompute of some layers, Ulysses degree, optimizer offload, the optimizer "
              "states between steps unless searched, embedding and output as layers) are kept by every candidate where they mean something, and a "
              "candidate they are invalid for (a shard group not dividing dp·cp, a limit above its "
              "stages' layers) is rejected by the rule, counted; its stage_layers are dropped, named "
              "in a note)",
    "verify": f"read the model and the strategy settings no flag gives from {_CONFIGS} (flags win; a config "
              "running context, expert or sequence parallelism is refused, as a measured step runs none); with "
              "--measured, the model, strategy and runtime come from it (MODEL completing or overriding its "
              "model, as a script naming a tokenizer states no vocabulary size)",
}


def add_from_argument(parser: argparse.ArgumentParser, purpose: str = "plan") -> None:
    """``--from CONFIG`` (and ``--from-format``) for commands that take a strategy; ``purpose``
    a key of ``FROM_HELP`` (what the command does with the file, as its --help says)."""
    group = parser.add_argument_group("framework config")
    group.add_argument("--from", dest="from_config", type=Path, metavar="CONFIG", help=FROM_HELP[purpose])
    group.add_argument("--from-format", choices=READ_FORMATS, help="the config's format (default: detected)")


def read_from_args(args: argparse.Namespace) -> ReadResult | None:
    """Read ``--from`` with ``--model`` as the base model and ``--devices`` as the world size."""
    path = getattr(args, "from_config", None)
    if not path:
        return None
    model = getattr(args, "model", None)
    return read_config(path, model=model, devices=getattr(args, "devices", None),
                       fmt=getattr(args, "from_format", None))


def merge_settings(result: ReadResult | None, settings: dict[str, Any]) -> dict[str, Any]:
    """The file's settings overlaid with ``settings`` (plan file and flags, which win). A file
    value derived from something the flags change (dp from tp, micro-batches from the batch
    sizes...) is dropped so ``strategy_from_settings`` derives it again."""
    if result is None:
        return dict(settings)
    given = {k: v for k, v in settings.items() if v is not None}
    merged = dict(result.strategy_settings)
    if result.devices and "devices" not in given:
        merged["devices"] = result.devices
    # Only flags that change a value of the file's make its derived values stale.
    own = {**result.strategy_settings, **({"devices": result.devices} if result.devices else {})}
    changed = {k for k, v in given.items() if own.get(k) != v}
    local_batch = merged.get("pipeline_runs") == 0 and "pipeline_runs" not in given and "num_micro_batches" not in given
    for key, inputs in _DERIVED.items():
        if key == "num_micro_batches" and local_batch:
            continue  # the file's local batch, kept below
        if key not in given and inputs & changed:
            merged.pop(key, None)
    if local_batch:
        _keep_local_batch(result, merged, given)
    if given.get("recompute", "selective") != "selective" and "recompute_modules" not in given:
        merged.pop("recompute_modules", None)  # a recompute that is not selective re-runs no modules
    if given.get("zero", 3) != 3 and "fsdp" not in given:
        merged.pop("fsdp", None)  # --zero 1 over a file's FSDP: the flag wins (FSDP is ZeRO-3 only)
    merged.update(given)
    return merged


def _keep_local_batch(result: ReadResult, merged: dict[str, Any], given: dict[str, Any]) -> None:
    """Runs derived from the global batch (torchtitan's gradient-accumulation steps): each run is
    the file's local batch (micro-batch size × micro-batches), whatever the degrees or the global
    batch become; a new micro-batch size splits it anew, and without a pipeline a step is one run."""
    file = result.strategy_settings
    local = int(file.get("mbs", 1)) * int(file.get("num_micro_batches", 1))
    mbs = int(given.get("mbs", file.get("mbs", 1)))
    if int(given.get("pp", file.get("pp", 1))) <= 1:
        merged.pop("num_micro_batches", None)
        merged["pipeline_runs"] = 1
        return
    if mbs < 1 or local % mbs:
        raise NdplanError(f"{result.source}: --mbs {mbs} does not divide the config's local batch of {local} "
                          "sequences (local_batch_size), which each run of its pipeline schedule takes")
    merged["num_micro_batches"] = local // mbs


def model_for(settings: dict[str, Any], result: ReadResult | None) -> ModelSpec:
    """The model: the one the config described (over ``--model`` when both are given), else
    ``--model``/the plan file's model."""
    if result is not None and result.model is not None:
        return result.model
    name = settings.get("model")
    if isinstance(name, ModelSpec):
        return name
    if not name:
        where = f" and {result.source} does not describe one" if result is not None else ""
        raise NdplanError(f"missing --model (give it as a flag or in the --plan file){where}")
    return load_model(str(name))


def print_messages(result: ReadResult | None, stream: Any = None) -> None:
    """Each warning as ``ndplan: warning: ...`` on stderr (for the planning commands)."""
    if result is None:
        return
    stream = stream or sys.stderr
    for warning in result.warnings:
        print(f"ndplan: warning: {warning}", file=stream)


# ---------------------------------------------------------------- ndplan inspect
def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="a launch script, job TOML, training YAML or config.json")
    parser.add_argument("--model", help="preset or config.json completing or overriding the config's model")
    parser.add_argument("--devices", type=device_count, help="world size, when the config does not state it")
    parser.add_argument("--from-format", choices=READ_FORMATS, help="the config's format (default: detected)")
    parser.add_argument("--to", choices=EMIT_FORMATS, help="print the strategy in this framework's format instead")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def inspect_summary(result: ReadResult, devices: int | None = None) -> dict[str, Any]:
    """What ndplan understood, as plain data (the --json output of inspect)."""
    strategy: Strategy | None = None
    problem = None
    try:
        strategy = result.strategy(devices) if result.strategy_settings else None
    except (NdplanError, ValidationError) as error:
        problem = first_validation_error(error) if isinstance(error, ValidationError) else str(error)
    world = strategy.world_size if strategy is not None else (result.devices or devices)
    per_node = result.devices_per_node
    return {
        "config": result.source,
        "format": result.format,
        "model": None if result.model is None else {
            "name": result.model.name, "model_type": result.model.model_type,
            "spec": result.model.model_dump(mode="json"),
        },
        "cluster": {"devices": world, "devices_per_node": per_node,
                    "nodes": world // per_node if world and per_node and world % per_node == 0 else None},
        "strategy": None if strategy is None else {"short": strategy.short(), **strategy.model_dump(mode="json")},
        "strategy_problem": problem,
        "runtime": result.runtime_settings,
        "warnings": result.warnings,
        "notes": result.notes,
    }


def _setting(value: Any) -> str:
    """A runtime setting as inspect prints it: a mapping as key=value pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{key}={item}" for key, item in value.items()) or "(none)"
    return str(value)


#: Items of a list setting (stage_layers) the inspect table shows before it says how many more.
SHOWN_ITEMS = 64


def _shown(value: object) -> str:
    """A setting as the table shows it: a long list (a layer count per pipeline stage of a file
    with thousands of stages) cut to its first SHOWN_ITEMS items and a count, rather than pages."""
    if isinstance(value, (list, tuple)) and len(value) > SHOWN_ITEMS:
        return f"({', '.join(map(str, value[:SHOWN_ITEMS]))}, ... {len(value) - SHOWN_ITEMS:,} more: {len(value):,} in all)"
    return str(value)


def cmd_inspect(args: argparse.Namespace, console: Console | None = None) -> int:
    """``ndplan inspect CONFIG``: the model, cluster and strategy ndplan reads from a config."""
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    result = read_config(args.config, model=args.model, devices=args.devices, fmt=args.from_format)
    summary = inspect_summary(result, args.devices)
    if args.to:
        strategy = result.strategy(args.devices)
        print(emit(result.model, strategy, args.to, devices_per_node=result.devices_per_node), end="")
        for warning in result.warnings:
            print(f"ndplan: warning: {warning}", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    model = summary["model"]
    cluster = summary["cluster"]
    console.print(f"[bold]{result.source}[/] ({result.format})")
    console.print(f"model:    {model['name'] + ' (' + model['model_type'] + ')' if model else '[yellow]none[/] (give --model)'}")
    nodes = f" = {cluster['nodes']} nodes × {cluster['devices_per_node']}" if cluster["nodes"] else ""
    devices = f"{cluster['devices']} devices" if cluster["devices"] else "[yellow]device count unknown[/] (give --devices)"
    console.print(f"cluster:  {devices}{nodes}")
    strategy = summary["strategy"]
    if result.format == "hf":
        console.print("strategy: none (a model config; give the strategy as flags or --plan)")
        return 0
    if strategy is None:
        console.print(f"strategy: [yellow]incomplete[/]{': ' + summary['strategy_problem'] if summary['strategy_problem'] else ''}")
        shown = {k: v for k, v in result.strategy_settings.items()}
    else:
        console.print(f"strategy: [bold]{strategy['short']}[/]")
        shown = {k: v for k, v in strategy.items() if k != "short"}
    table = Table(show_header=True, header_style="bold")
    table.add_column("field")
    table.add_column("value")
    for key, value in shown.items():
        if key == "precision" and hasattr(value, "model_dump"):  # a policy no preset names (incomplete strategy)
            value = value.model_dump(mode="json")
        if key == "precision" and isinstance(value, dict):
            value = f"{value['name']} (param {value['param_bytes']} B, grad {value['grad_bytes']} B, master "\
                    f"{value['master_weight_bytes']} B, optimizer {value['optimizer_states']}×{value['optimizer_state_bytes']} B, "\
                    f"{value['compute_dtype']})"
        if key == "pipeline_runs" and value == 0:
            value = "0 (as many as the global batch needs, once dp is known)"
        table.add_row(key, _shown(value))
    console.print(table)
    if result.runtime_settings:
        # What the estimate prices beside the strategy: the runtime profile, attention kernel, loss,
        # selective policy and the overlap switches the config states.
        stated = "; ".join(f"{key} {_setting(value)}" for key, value in result.runtime_settings.items())
        console.print(f"runtime settings: {stated}", markup=False)
    for warning in result.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    return 0
