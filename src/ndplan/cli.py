"""The `ndplan` command: one subcommand per question, rich tables for people, --json for programs.

Exit codes: 0 success, 2 bad input (one line on stderr, never a traceback), 1 a check that ran
and failed (e.g. a strategy that does not fit).

This module holds the parser, ``main`` and the listing commands (models, hardware); the others
live with their areas: check in ``strategy/cli.py``, estimate in ``estimate_cli.py``, balance in
``balance/cli.py``, search in ``search/cli.py``, inspect in ``io/cli.py``, calibrate in
``perf/cli.py``, census, measure and verify in ``census/cli.py``, report in ``report/cli.py``;
what several share in ``cli_args.py`` (flags), ``cli_common.py`` and ``cli_emit.py`` (--emit).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from pydantic import ValidationError
from rich.table import Table

from ndplan import __version__
from ndplan.cli_args import HOST_MEMORY_HELP, add_runtime_arguments, add_strategy_arguments
from ndplan.cli_common import console, emit_json
from ndplan.errors import NdplanError
from ndplan.model import ModelSpec, count_parameters, load_model, preset_names
from ndplan.model.hf import first_validation_error
from ndplan.model.presets import preset_index
from ndplan.units import format_bytes, format_count


# ---------------------------------------------------------------- models
def model_summary(spec: ModelSpec) -> dict[str, Any]:
    counts = count_parameters(spec)
    published = preset_index().get(spec.name, {})
    return {
        "name": spec.name,
        "model_type": spec.model_type,
        "attention": spec.attention_kind,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_kv_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_moe_layers": spec.num_moe_layers,
        "mtp_depth": spec.mtp_depth,
        "total_params": counts.total,
        "active_params": counts.active,
        "mtp_params": counts.mtp,
        "blocks": counts.blocks(),
        "published_total_params": published.get("published_total_params"),
        "hf_repo": published.get("hf_repo"),
        "spec": spec.model_dump(mode="json"),
    }


def cmd_models(args: argparse.Namespace) -> int:
    specs = [load_model(args.model)] if args.model else [load_model(n) for n in preset_names()]
    rows = [model_summary(s) for s in specs]
    if args.json:
        emit_json(rows if not args.model else rows[0])
        return 0
    table = Table(title="Models (parameter counts exact, as transformers builds them)")
    for col in ["name", "type", "attention", "layers", "hidden", "heads/kv", "experts (top-k)", "total params", "active params", "MTP params"]:
        table.add_column(col, justify="right" if col not in {"name", "type", "attention"} else "left")
    for r in rows:
        experts = f"{r['num_experts']} ({r['num_experts_per_tok']})" if r["num_experts"] else "-"
        table.add_row(
            r["name"], r["model_type"], r["attention"], str(r["num_layers"]), str(r["hidden_size"]),
            f"{r['num_attention_heads']}/{r['num_kv_heads']}", experts, format_count(r["total_params"]),
            format_count(r["active_params"]), format_count(r["mtp_params"]) if r["mtp_params"] else "-",
        )
    # Vendors count "active" differently (OpenAI's GPT-OSS figures leave the input embedding out).
    table.caption = ("active: every parameter a token's step reads, all but the routed experts it skips "
                     "(the input embedding included); MTP: the multi-token prediction modules, beside the total")
    console.print(table)
    return 0


# ---------------------------------------------------------------- hardware
def cmd_hardware(args: argparse.Namespace) -> int:
    from ndplan.hardware import list_devices, resolve_device

    devices = [resolve_device(args.name)] if args.name else list_devices()
    if args.json:
        # One device asked for is its object, as `models --model` gives one model's.
        emit_json(devices[0].model_dump(mode="json") if args.name else [d.model_dump(mode="json") for d in devices])
        return 0
    table = Table(title="Accelerators (dense peak FLOP/s; link bandwidths one way per device, as NVIDIA's 900 GB/s NVLink is 450 each way; sources in hardware/devices.yaml)")
    for col in ["name", "memory", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB/s", "scale-up GB/s ×domain", "scale-out GB/s", "per node", "host memory/node"]:
        table.add_column(col, justify="left" if col == "name" else "right")
    for d in devices:
        fp8 = d.peak_flops.get("fp8")
        table.add_row(
            d.name,
            format_bytes(d.memory_bytes),
            f"{d.peak_flops['bf16'] / 1e12:,.0f}",
            f"{fp8 / 1e12:,.0f}" if fp8 else "-",
            f"{d.hbm_bandwidth_bytes_per_s / 1e9:,.0f}",
            f"{d.scaleup_bandwidth_bytes_per_s / 1e9:,.0f} ×{d.scaleup_domain_size}",
            f"{d.scaleout_bandwidth_bytes_per_s / 1e9:,.0f}",
            str(d.devices_per_node),
            format_bytes(d.node_host_memory_bytes) if d.node_host_memory_bytes else "-",
        )
    console.print(table)
    return 0


# ---------------------------------------------------------------- balance
def _cmd_balance(args: argparse.Namespace) -> int:
    """`ndplan balance` (``ndplan.balance.cli``), imported as it runs: importing ``ndplan.balance``
    loads its solvers, which every other command's start would pay for."""
    from ndplan.balance.cli import cmd_balance

    return cmd_balance(args)


# ---------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (usage is one `--help` away) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ndplan",
        description="Plan N-dimensional parallel LLM training: memory per stage, step time, best strategy.",
    )
    parser.add_argument("--version", action="version", version=f"ndplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("models", help="list model presets with exact parameter counts")
    p.add_argument("--model", help="show one preset or config file instead of all presets")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("hardware", help="list accelerator presets")
    p.add_argument("name", nargs="?", help="one preset name or a device YAML path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_hardware)

    from ndplan.strategy.cli import add_check_command

    add_check_command(sub)

    from ndplan.estimate_cli import add_estimate_command

    add_estimate_command(sub)

    from ndplan.io import EMIT_FORMATS
    from ndplan.io.cli import add_from_argument, add_inspect_arguments, cmd_inspect

    p = sub.add_parser("balance", help="layers per stage and recompute per layer that fit and run fastest")
    add_strategy_arguments(p)
    add_from_argument(p)
    add_runtime_arguments(p)
    p.add_argument("--memory-limit", help="per-device limit, e.g. 70GiB (default: the device's memory)")
    p.add_argument("--host-memory", help=HOST_MEMORY_HELP)
    p.add_argument("--heuristic", action="store_true", help="the fast heuristic instead of the exact solver (dynamic program, or MILP for interleaved pipelines of other layer-kind mixes)")
    p.add_argument("--recompute-module-sets", nargs="+", action="extend", metavar="SET",
                   help="selective policies to try besides the strategy's own (runtime megatron): module sets such "
                        "as 'layernorm+moe_act' or 'default', or 'common' / 'all' (as search); each is balanced "
                        "and the fastest plan wins")
    p.add_argument("--emit", choices=EMIT_FORMATS,
                   help="print the plan as that framework's settings")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_balance)

    from ndplan.perf.cli import add_calibrate_command

    add_calibrate_command(sub)

    from ndplan.census.cli import add_census_commands

    add_census_commands(sub)

    p = sub.add_parser("inspect", help="show the model, cluster and strategy ndplan reads from a framework config")
    add_inspect_arguments(p)
    p.set_defaults(func=cmd_inspect)

    from ndplan.report.cli import add_report_command

    add_report_command(sub)

    from ndplan.search.cli import add_search_command

    add_search_command(sub)
    return parser


def _signed_values_attached(argv: Sequence[str]) -> list[str]:
    """``--memory-limit -5GiB`` as ``--memory-limit=-5GiB``: argparse takes a token that starts
    with "-" and is not a plain number for an option and says only "expected one argument"; the
    option's own check then names the bad value."""
    out: list[str] = []
    for token in argv:
        if (out and re.match(r"-\d", token) and out[-1].startswith("--") and "=" not in out[-1]
                and out[-1] != "--"):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _refuse_empty_values(argv: Sequence[str], command: str) -> None:
    """An NdplanError naming the first option (or argument) given as "" (or blanks), as the user
    typed it: the commands read an empty value as a missing one (``if args.csv:``), so
    --memory-limit "" searched without a limit, --csv "" wrote nothing, `hardware ""` listed every
    device, and a path option read "" as the current folder."""
    for at, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if token.startswith("--") and equals and not value.strip():
            empty = name
        elif not token.strip():
            # The value of the nearest option before it (one of several, for --fix a b c), else an argument.
            options = [t.partition("=")[0] for t in argv[:at] if t.startswith("-") and t != "-"]
            empty = options[-1] if options else f"an argument of `ndplan {command}`"
        else:
            continue
        raise NdplanError(f"{empty} is empty; give a value (see `ndplan {command} --help`) or leave it out")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown option is refused by the subcommand's own parser:
    the error points to `ndplan COMMAND --help` (not the top level's, which lists no option) and
    suggests the option meant (``--memroy-limit`` is ``--memory-limit``)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command_parser = sub.choices[args.command]
        # Compared without the dashes (which made '--json' look like '--sp'), and closer than
        # did_you_mean's names need be: a flag the command lacks should not suggest a stranger.
        options = [o[2:] for action in command_parser._actions for o in action.option_strings if o.startswith("--")]
        first = next((e.partition("=")[0].lstrip("-") for e in extras if e.startswith("-")), "")
        close = difflib.get_close_matches(first, options, n=1, cutoff=0.75) if first else []
        hint = f" (did you mean '--{close[0]}'?)" if close else ""
        command_parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, _signed_values_attached(sys.argv[1:] if argv is None else argv))
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        _refuse_empty_values(list(sys.argv[1:] if argv is None else argv), args.command)
        return func(args)
    except NdplanError as error:
        print(f"ndplan: error: {error}", file=sys.stderr)
        return 2
    except ValidationError as error:
        print(f"ndplan: error: {first_validation_error(error)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`ndplan search --json | head`): stop quietly, as `cat` does, and
        # point stdout at nothing so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the status a shell reports for a writer its pipe closed on
    except OSError as error:  # a path that cannot be read or written: say which and why
        where = f"{error.filename}: " if error.filename else ""
        print(f"ndplan: error: {where}{error.strerror or error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ndplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
