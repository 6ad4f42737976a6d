"""`ndplan check`: validate a strategy for a model and cluster, and print every rule it breaks (and,
with --runtime or a Megatron launch read with --from, what that runtime cannot run).

Wired into ``ndplan.cli.build_parser`` with ``add_check_command(sub)``; errors are raised as
:class:`NdplanError`, which ``ndplan.cli.main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from ndplan.cli_args import add_strategy_arguments, device_from, strategy_from_settings
from ndplan.cli_common import console, emit_json, settings_and_model
from ndplan.strategy import check_strategy


def add_check_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ndplan check`` on the subparsers of the ``ndplan`` parser; returns its parser."""
    from ndplan.io.cli import add_from_argument

    p: argparse.ArgumentParser = subparsers.add_parser(
        "check", help="validate a strategy for a model and cluster; print every violated rule")
    add_strategy_arguments(p)
    add_from_argument(p)
    from ndplan.memory.profile import profile_names

    p.add_argument("--runtime", help=f"also check what this runtime runs, as the search does: {', '.join(profile_names())} "
                                     "or a YAML path (default: megatron for a Megatron config read with --from, else "
                                     "none)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)
    return p


def cmd_check(args: argparse.Namespace) -> int:
    settings, model, read = settings_and_model(args)
    device = None
    if settings.get("hardware"):
        device = device_from(settings["hardware"], settings.get("efficiency"))  # a bad device is an input error here too
    strategy = strategy_from_settings(settings)
    violations = check_strategy(strategy, model, settings.get("devices"))
    # What the runtime (--runtime, else a Megatron launch's own) cannot run, as the search refuses it.
    runtime = args.runtime or ((read.runtime_settings or {}).get("runtime") if read is not None else None)
    if runtime:
        from ndplan.memory import MemoryOptions
        from ndplan.search.run import NOT_RUNNABLE, runtime_refusals
        from ndplan.strategy.rules import Violation

        refusals = runtime_refusals(strategy, MemoryOptions(runtime=runtime), model, device)
        violations += [Violation(NOT_RUNNABLE, reason) for reason in refusals]
    if args.json:
        emit_json({
            "valid": not violations,
            "model": model.name,
            "strategy": strategy.model_dump(mode="json"),
            "violations": [{"rule": v.rule, "message": v.message} for v in violations],
        })
    elif violations:
        console.print(f"[bold red]invalid[/] {strategy.short()} for {model.name}:")
        for v in violations:
            console.print(f"  ✗ [bold]{v.rule}[/]: {v.message}")
    else:
        console.print(f"[bold green]valid[/] {strategy.short()} for {model.name}")
    return 2 if violations else 0
