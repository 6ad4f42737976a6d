"""`ndplan estimate`: the memory of one strategy per stage and device, its step time, and what
it rests on (--explain: every term with its formula; --emit: the strategy as a framework's
settings; --plot: the memory per stage as a chart).

Wired into ``ndplan.cli.build_parser`` with ``add_estimate_command(sub)``; errors are raised as
:class:`NdplanError`, which ``ndplan.cli.main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from ndplan.cli_args import (
    HOST_MEMORY_HELP,
    add_runtime_arguments,
    add_strategy_arguments,
    device_from,
    memory_limit,
    strategy_from_settings,
    with_host_memory,
)
from ndplan.cli_common import (
    console,
    dispatcher_note,
    efficiency_entry,
    emit_json,
    inert_flags,
    memory_options,
    print_kernels,
    require,
    runtime_cautions,
    settings_and_model,
)
from ndplan.cli_emit import emit_settings
from ndplan.model.heads import kv_repeat_note
from ndplan.units import format_bytes


def host_verdict(report: Any) -> str:
    """The line that says how much pinned host memory the offloads fill per device, and whether
    it fits the device's share of its node's host memory."""
    peak = report.host_peak_bytes
    stage = max(report.stages, key=lambda st: st.host_bytes)
    parts = [name for name, value in (("activations", stage.host_activation_bytes),
                                      ("optimizer", stage.host_optimizer_bytes)) if value]
    what = f"{format_bytes(peak)} of pinned host memory per device ({' and '.join(parts)}, stage {stage.stage})"
    device = report.device
    capacity = report.host_capacity_bytes
    if capacity is None:
        return (f"[bold yellow]host memory not checked[/]: offloads fill {what}; {device.name} states no host memory "
                "(give --host-memory)")
    share = (f"its {format_bytes(capacity)} share of a node's {format_bytes(device.node_host_memory_bytes)} over "
             f"{device.devices_per_node} devices")
    if report.fits_host:
        return f"[bold green]host fits[/]: offloads fill {what} of {share} ({format_bytes(capacity - peak)} free)"
    return f"[bold red]host memory does not fit[/]: offloads fill {what}, over {share} by {format_bytes(peak - capacity)}"


def add_estimate_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ndplan estimate`` on the subparsers of the ``ndplan`` parser; returns its parser."""
    from ndplan.io import EMIT_FORMATS
    from ndplan.io.cli import add_from_argument

    p: argparse.ArgumentParser = subparsers.add_parser(
        "estimate", help="per-stage memory of a strategy (and step time)")
    add_strategy_arguments(p)
    add_from_argument(p)
    add_runtime_arguments(p)
    p.add_argument("--memory-limit", help="per-device limit the fits line and --json's fits are against, e.g. "
                                          "70GiB (default: the device's memory)")
    p.add_argument("--host-memory", help=HOST_MEMORY_HELP)
    p.add_argument("--explain", action="store_true", help="print every term of the peak stage with its formula")
    p.add_argument("--plot", help="write a stacked-bar chart of memory per stage (PNG/SVG)")
    p.add_argument("--emit", choices=EMIT_FORMATS,
                   help="print the strategy as that framework's settings")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_estimate)
    return p


def cmd_estimate(args: argparse.Namespace) -> int:
    from ndplan.memory import estimate

    settings, model, read = settings_and_model(args)
    device = with_host_memory(args.host_memory,
                              device_from(require(settings, "hardware", "--hardware"), settings.get("efficiency")))
    strategy = strategy_from_settings(settings)
    options = memory_options(args, settings, read, device)
    given_limit = memory_limit(args.memory_limit, device)
    report = estimate(model, strategy, device, options, num_devices=settings.get("devices"))
    from ndplan.hardware import Cluster
    from ndplan.perf import default_overlap, estimate_time

    overlap = options.overlap or default_overlap(device.runtime)
    timing = estimate_time(model, strategy, Cluster(device=device, num_devices=strategy.world_size), options=options)
    if args.plot:
        from ndplan.report.data import as_dict
        from ndplan.report.plots import plot_memory

        # the capacity line at the limit, where one is given
        plot_memory(report if given_limit is None else {**as_dict(report), "memory_limit_bytes": given_limit},
                    args.plot)
    emitted = emit_settings(model, strategy, args.emit, options, device) if args.emit else None
    inert = inert_flags(args, strategy) + runtime_cautions(strategy, options, model, device)
    if args.json:
        memory = report.to_dict()
        emit_json({"model": model.name, "hardware": device.name, **efficiency_entry(settings.get("efficiency")),
                   "devices": strategy.world_size,
                   "strategy": strategy.model_dump(mode="json"), **memory, "caveats": [*memory["caveats"], *inert],
                   # fits against --memory-limit where given (capacity_bytes stays the device's)
                   **({"fits": report.peak_bytes <= given_limit, "memory_limit_bytes": given_limit}
                      if given_limit is not None else {}),
                   "time": {**timing.to_dict(), "details": timing.details, "overlap": overlap.model_dump(mode="json")},
                   **({"emitted": emitted} if emitted else {})})
        return 0
    table = Table(title=f"{model.name} on {device.name} — {strategy.short()} — per-device memory per stage")
    columns = ["stage", "layers", "params", "grads", "optimizer", "activations", "comm", "transient",
               "allocated", "reserved", "peak (device)"]
    for col in columns:
        table.add_column(col, justify="right")
    for st in report.stages:
        table.add_row(
            str(st.stage), str(st.layers), *(format_bytes(v) for v in (
                st.params_bytes, st.grads_bytes, st.optimizer_bytes, st.activations_bytes, st.comm_bytes,
                st.transient_bytes, st.allocated_bytes, st.reserved_bytes, st.peak_bytes)),
            style="bold" if st.stage == report.peak_stage else None,
        )
    console.print(table)
    limit = device.memory_bytes if given_limit is None else given_limit
    margin = limit - report.peak_bytes
    of = format_bytes(limit) if given_limit is None else f"the {format_bytes(limit)} memory limit"
    verdict = (f"[bold green]fits[/]: peak {format_bytes(report.peak_bytes)} on stage {report.peak_stage} "
               f"of {of} ({format_bytes(margin)} free)") if margin >= 0 else (
               f"[bold red]does not fit[/]: stage {report.peak_stage} needs {format_bytes(report.peak_bytes)}, "
               f"over {of} by {format_bytes(-margin)}")
    console.print(verdict)
    if report.host_peak_bytes:
        console.print(host_verdict(report))
    for caveat in [*report.caveats, *inert]:
        console.print(f"[bold yellow]caution[/]: {caveat}", markup=True)
    exposed = dict(timing.breakdown["comm_exposed"])
    host_copies = exposed.pop("offload", 0.0)
    console.print(
        f"step {timing.step_s:.3f} s · {timing.tokens_per_s:,.0f} tokens/s "
        f"({timing.tokens_per_s_per_device:,.0f} per device) · MFU {100 * timing.mfu:.1f}% · HFU {100 * timing.hfu:.1f}% "
        # Against the compute dtype's peak: an fp8 step's MFU reads half a bf16 one's at the same speed.
        + ("(of the fp8 peak) " if strategy.precision.compute_dtype == "fp8" else "")
        + f"— compute {timing.breakdown['compute']:.3f} s, bubble {timing.breakdown['bubble']:.3f} s, "
        f"exposed comm {sum(exposed.values()):.3f} s"
        + (f", exposed offload copies {host_copies:.3f} s" if strategy.offload_modules else "")
        + f", optimizer {timing.breakdown['optimizer']:.3f} s"
    )
    for caveat in timing.caveats:
        console.print(f"[bold yellow]caution[/]: {caveat}", markup=True)
    console.print(f"overlap ({'as given' if options.overlap else 'defaults; set with --overlap'}): {overlap.describe()}"
                  + dispatcher_note(options, model), markup=False)
    print_kernels(options, strategy, model=model)
    repeated = kv_repeat_note(model, strategy.tp, strategy.ulysses_ranks, options.ulysses_kv_repeat)
    if repeated:
        console.print(repeated, markup=False)
    if timing.unfused_why:
        from ndplan.perf.accumulation import unfused_note

        console.print(unfused_note(timing.unfused_why, bool(options.gradient_accumulation_fusion)), markup=False)
    if emitted:
        console.print(f"\n[bold]{args.emit}[/] settings:")
        console.print(emitted, markup=False, soft_wrap=True)  # settings to paste: never wrapped
    if args.explain:
        console.print("memory, peak stage:")
        for line in report.explain():
            console.print("  " + line, markup=False)
        console.print("time:")
        for line in timing.explain():
            console.print("  " + line, markup=False)
    return 0
