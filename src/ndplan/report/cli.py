"""`ndplan report`: the HTML report (and figures) of a saved result or of estimate's flags.

Wired into ``ndplan.cli.build_parser`` with ``add_report_command(sub)``; errors are raised as
:class:`NdplanError`, which ``ndplan.cli.main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ndplan.errors import NdplanError, parse_nested, read_text


def add_report_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ndplan report`` on the subparsers of the ``ndplan`` parser; returns its parser."""
    from ndplan.cli_args import HOST_MEMORY_HELP, add_runtime_arguments, add_strategy_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="self-contained HTML report (memory, step time, pipeline timeline, search) and figures",
        description="Write one self-contained HTML file (no network needed to view) with every figure of a plan: "
                    "memory per stage, step-time breakdown, pipeline timeline, and for a search the step time "
                    "vs peak memory of all candidates with the Pareto front and the ranked table. The input is "
                    "a saved `--json` result of estimate, search or balance, or the same flags as estimate.",
    )
    p.add_argument("input", nargs="?", help="a saved --json result of estimate/search/balance ('-' reads stdin); "
                                            "without it the strategy given by the flags below is estimated")
    p.add_argument("-o", "--output", type=Path,
                   help="HTML file to write (default: plan.html, unless only --plot-dir is given)")
    p.add_argument("--plot-dir", type=Path, help="also write the figures as files in this folder (needs matplotlib)")
    p.add_argument("--plot-format", choices=["png", "svg", "pdf"], default="png", help="format of --plot-dir figures (default png)")
    p.add_argument("--top", type=int, default=50, help="ranked strategies kept in the table (default 50)")
    p.add_argument("--max-points", type=int, default=4000,
                   help="candidates drawn in the scatter; the Pareto front is always drawn whole (default 4000)")
    p.add_argument("--title", help="page title (default: model on devices× hardware)")
    add_strategy_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--memory-limit", help="with strategy flags: the per-device limit the report's headroom and fits "
                                         "are against, e.g. 70GiB (default: the device's memory)")
    p.add_argument("--host-memory", help="with strategy flags: " + HOST_MEMORY_HELP)
    p.set_defaults(func=cmd_report)
    return p


def load_result(source: str) -> dict[str, Any]:
    """A saved result: a JSON object from a file, or from stdin for '-'."""
    try:
        text = sys.stdin.read() if source == "-" else read_text(source)
    except OSError as error:
        raise NdplanError(f"cannot read {source}: {error.strerror or error}") from None
    try:
        data = parse_nested(json.loads, text, source, "JSON")
    except json.JSONDecodeError as error:
        raise NdplanError(f"{source} is not valid JSON (line {error.lineno}: {error.msg})") from None
    if not isinstance(data, dict):
        raise NdplanError(f"{source} is not a result of estimate, search or balance (expected a JSON object, "
                          f"got {type(data).__name__})")
    from ndplan.report.data import shows_something

    if "ranks" in data and "stages" not in data:  # what `ndplan measure` writes, not a result
        raise NdplanError(f"{source} is a measured-memory file (per-rank peaks); `ndplan verify --measured "
                          f"{source}` compares it with the estimate, and `ndplan report` draws a result of "
                          "estimate, search or balance --json")
    stages = data.get("stages")
    if isinstance(stages, list) and stages and isinstance(stages[0], dict) and "rows" in stages[0] \
            and "measured_ranks" in stages[0]:  # `ndplan verify --json`: estimate-vs-measured rows per stage
        raise NdplanError(f"{source} is a result of ndplan verify (the estimate against a measurement, per stage), "
                          "not of estimate, search or balance: `ndplan verify` prints it; `ndplan report` draws "
                          "`ndplan estimate --json` of the same model and strategy")
    if not shows_something(data):
        raise NdplanError(f"{source} is not a result of estimate, search or balance (it has no per-stage memory "
                          f"'stages', no ranked rows, no candidates and no model with a strategy; save one with `ndplan estimate|search|balance "
                          f"--json`)")
    return data


def estimate_result(args: argparse.Namespace) -> dict[str, Any]:
    """The same dict `ndplan estimate --json` prints, for the strategy the flags give."""
    from ndplan.cli_args import (
        device_from,
        gather_settings,
        memory_limit,
        runtime_options,
        strategy_from_settings,
        with_host_memory,
    )
    from ndplan.cli_common import runtime_cautions
    from ndplan.memory import estimate
    from ndplan.model import load_model

    settings = gather_settings(args)
    for key, flag in (("model", "--model"), ("hardware", "--hardware")):
        if settings.get(key) is None:
            raise NdplanError(f"missing {flag} (give a saved result, or the model, hardware and strategy as flags)")
    model = load_model(settings["model"])
    device = with_host_memory(getattr(args, "host_memory", None), device_from(settings["hardware"], settings.get("efficiency")))
    strategy = strategy_from_settings(settings)
    options = runtime_options(args, settings, device=device)
    report = estimate(model, strategy, device, options, num_devices=settings.get("devices"))
    result: dict[str, Any] = {"model": model.name, "hardware": device.name}
    if settings.get("efficiency"):
        result["efficiency"] = str(settings["efficiency"])
    if settings.get("devices"):
        result["devices"] = settings["devices"]
    result = {**result, "strategy": strategy.model_dump(mode="json"), **report.to_dict()}
    refused = runtime_cautions(strategy, options, model, device)
    if refused:  # as `ndplan estimate` says them
        result["caveats"] = [*result.get("caveats", []), *refused]
    limit = memory_limit(getattr(args, "memory_limit", None), device)
    if limit is not None:  # as `ndplan estimate --memory-limit --json` gives it
        result.update(fits=report.peak_bytes <= limit, memory_limit_bytes=limit)
    perf, note = step_time(model, strategy, device, settings.get("devices"), options)
    if perf is not None:
        result["perf"] = perf
    elif note:
        result["report_notes"] = [note]
    return result


def step_time(model: Any, strategy: Any, device: Any, devices: int | None,
              options: Any = None) -> tuple[dict[str, Any] | None, str]:
    """The step-time report of one strategy (with the bottleneck stage's op times for the timeline),
    or None and why; ``options`` the runtime's MemoryOptions (what it re-runs and hides, and its
    step-time cautions). The step-time model is optional to the report: any failure leaves it out."""
    try:
        from ndplan.hardware import Cluster
        from ndplan.perf import estimate_time

        world = strategy.dp * strategy.tp * strategy.pp * strategy.cp
        report = estimate_time(model, strategy, Cluster(device=device, num_devices=devices or world), options=options)
        perf: dict[str, Any] = dict(report.to_dict())
        keep = ("stage_forward_s", "stage_backward_s", "stage_weight_grad_s", "p2p_s", "makespan_s", "bottleneck_stage")
        perf["details"] = {k: float(report.details[k]) for k in keep if k in report.details}
        return perf, ""
    except NdplanError as error:
        return None, f"step time not shown: {error}"
    except Exception as error:  # noqa: BLE001 - another model's failure must not cost the memory report
        return None, f"step time not shown: the step-time model failed ({type(error).__name__}: {error})"


def enrich(result: dict[str, Any]) -> dict[str, Any]:
    """What a saved search leaves out, recomputed: the #1 strategy's per-stage memory breakdown.

    Shown only when the recomputed peak matches the search's own (within 0.5 %): the saved JSON
    does not record every option the search ran with (precision, runtime flags).
    """
    rows = result.get("ranked") or result.get("rows")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict) or "best" in result:
        return result
    best = rows[0]
    if not isinstance(best.get("strategy"), dict) or not result.get("model") or not result.get("hardware"):
        return result
    notes = list(result.get("report_notes") or [])
    try:
        from ndplan.hardware import resolve_device
        from ndplan.memory import MemoryOptions, estimate
        from ndplan.model import load_model
        from ndplan.strategy import Strategy, get_precision

        fields = dict(best["strategy"])
        precision = result.get("precision")
        if isinstance(precision, str):
            fields["precision"] = get_precision(precision)
        elif isinstance(precision, dict):
            fields["precision"] = precision
        options = MemoryOptions(runtime=str(result.get("runtime") or "pytorch"),
                                attention=result.get("attention") or "flash",
                                loss_upcast=result.get("loss_upcast") is not False,
                                selective_policy=result.get("selective_policy"),
                                modules=result.get("modules") or "eager",
                                experts_outside_fsdp=bool(result.get("experts_outside_fsdp")))
        report = estimate(load_model(str(result["model"])), Strategy(**fields), resolve_device(str(result["hardware"])),
                          options, num_devices=result.get("devices"))
    except Exception as error:  # noqa: BLE001 - the report of the search stands without it
        notes.append(f"per-stage memory of #1 not shown: {type(error).__name__}: {error}")
        return {**result, "report_notes": notes}
    saved = best.get("peak_bytes")
    if isinstance(saved, (int, float)) and saved > 0 and abs(report.peak_bytes - saved) > 0.005 * saved:
        notes.append(f"per-stage memory of #1 not shown: recomputing it gives a peak of {report.peak_bytes:,.0f} B, "
                     f"the search found {saved:,.0f} B (options the saved result does not record differ)")
        return {**result, "report_notes": notes}
    capacity = result.get("memory_limit_bytes") or report.capacity_bytes
    return {**result, "best": {**report.to_dict(), "capacity_bytes": capacity}, "report_notes": notes}


def _given_strategy_flags(args: argparse.Namespace) -> list[str]:
    names = ("model", "hardware", "plan", "devices", "dp", "tp", "pp", "cp", "ep", "vpp", "schedule", "mbs", "gbs",
             "num_micro_batches", "pipeline_runs", "seq", "zero", "recompute", "memory_limit")
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) is not None]


def _file_in_the_way(folder: Path | None) -> Path | None:
    """The nearest existing path at or above ``folder`` where it is not a folder (the folder
    cannot be made there), else None."""
    if folder is None:
        return None
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def cmd_report(args: argparse.Namespace) -> int:
    from ndplan.report.html import write_html
    from ndplan.units import format_bytes

    if args.top < 1:
        raise NdplanError(f"--top must be at least 1, got {args.top}")
    if args.max_points < 10:
        raise NdplanError(f"--max-points must be at least 10, got {args.max_points}")
    output = args.output
    if output is None and args.plot_dir is None:
        output = Path("plan.html")
    # Checked before any work (a search may take minutes) and before anything is written: a
    # figure's suffix on the page, or a folder that is a file, would leave half the output behind
    # an error.
    if output is not None and output.suffix.lower() not in (".html", ".htm"):
        raise NdplanError(f"-o {output}: the report is one HTML page; name it .html "
                          "(figures as png, svg or pdf files: --plot-dir DIR --plot-format FORMAT)")
    for folder, what in ((args.plot_dir, "the figures are written into one"),
                         (output.parent if output is not None else None, "the page is written into one")):
        blocker = _file_in_the_way(folder)
        if blocker is not None:
            raise NdplanError(f"{blocker}: not a folder; {what} (give a new or existing folder)")
    if args.input is not None:
        given = _given_strategy_flags(args)
        if given:
            raise NdplanError(f"give either a saved result or strategy flags, not both ({given[0]} with {args.input})")
        result = enrich(load_result(args.input))
    else:
        result = estimate_result(args)
    if output is not None:
        path = write_html(result, output, top=args.top, max_points=args.max_points, title=args.title)
        print(f"wrote {path} ({format_bytes(path.stat().st_size)})")
    if args.plot_dir is not None:
        from ndplan.progress import working

        # matplotlib's import alone takes a second or two
        with working(f"drawing the figures into {args.plot_dir}"):
            from ndplan.report.plots import write_plots

            figures = write_plots(result, args.plot_dir, fmt=args.plot_format, top=args.top,
                                  max_points=args.max_points)
        for figure in figures:
            print(f"wrote {figure}")
    return 0
