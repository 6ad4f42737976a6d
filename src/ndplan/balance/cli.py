"""`ndplan balance`: layers per stage and recompute per layer that fit a memory limit and run
fastest, before and after per stage, beside the strategy as given; and (--emit) the settings one
recompute setting writes, read back and priced again.

Registered in ``ndplan.cli.build_parser``, which imports this module only when the command runs
(importing ``ndplan.balance`` loads its solvers, time every other command would pay at start).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.table import Table

from ndplan.cli_args import device_from, memory_limit, strategy_from_settings, with_host_memory
from ndplan.cli_common import (
    console,
    efficiency_entry,
    emit_json,
    inert_flags,
    memory_options,
    print_kernels,
    require,
    runtime_cautions,
    settings_and_model,
)
from ndplan.cli_emit import emit_settings, read_back, round_trips, runtime_note, written_precision
from ndplan.estimate_cli import host_verdict
from ndplan.search.cli import module_sets_argument
from ndplan.strategy import Strategy
from ndplan.units import format_bytes


def cmd_balance(args: argparse.Namespace) -> int:
    from ndplan.balance import balance, plan_strategy
    from ndplan.hardware import Cluster
    from ndplan.io.common import policy_of

    settings, model, read = settings_and_model(args)
    device = with_host_memory(args.host_memory,
                              device_from(require(settings, "hardware", "--hardware"), settings.get("efficiency")))
    options = memory_options(args, settings, read, device)
    if args.emit and settings.get("precision") is None:
        # Balanced as the framework will run it: in the precision its settings state (as search).
        # The strategy's own: torchtitan runs TP or PP without FSDP in fp32 (balanced in its
        # bf16, the file written read back 51.48 GiB over a 44 GiB limit the plan fit).
        settings["precision"] = written_precision(model, args.emit, options, device, strategy_from_settings(settings))
    strategy = strategy_from_settings(settings)
    limit = memory_limit(args.memory_limit, device) or device.memory_bytes
    cluster = Cluster(device=device, num_devices=strategy.world_size)
    policies = module_sets_argument(model, args.recompute_module_sets) if args.recompute_module_sets else ()
    expressible = round_trips(model, args.emit, cluster, options) if args.emit else None
    from ndplan.progress import working

    with working(f"balancing {strategy.short()}", quiet=args.json):
        result = balance(model, strategy, cluster, limit, options, exact=not args.heuristic,
                         selective_policies=policies, expressible=expressible)
    data = {"model": model.name, "hardware": device.name, **efficiency_entry(settings.get("efficiency")),
            "devices": strategy.world_size, "runtime": options.runtime, "loss_upcast": options.loss_upcast,
            "selective_policy": options.selective_policy,
            "strategy": strategy.model_dump(mode="json"), "memory_limit_bytes": limit, **result.to_dict()}
    emitted = plan_strategy(strategy, result.emitted_plan, result.emitted_modules)
    from ndplan.perf import estimate_time

    # The balancer's step is composed from stage times; the estimate adds DP, p2p and the optimizer.
    emitted_time = estimate_time(model, emitted, cluster, options=options)
    data["estimated_step_s"] = emitted_time.step_s
    # The strategy as given (its own recompute, uniform or its --stage-layers), by the same two
    # estimators: the reference a user compares with, beside the full-recompute baseline.
    from ndplan.memory import estimate

    given_report = estimate(model, strategy, device, options, num_devices=strategy.world_size)
    given_peak = given_report.peak_bytes
    data["given"] = {"step_s": estimate_time(model, strategy, cluster, options=options).step_s,
                     "peak_bytes": round(given_peak), "fits": given_peak <= limit,
                     "stages": given_report.to_dict()["stages"]}
    # The settings --emit writes, by the full estimators: what `ndplan report` draws for the plan.
    balanced_report = estimate(model, emitted, device, options, num_devices=strategy.world_size)
    data["balanced"] = {**balanced_report.to_dict(), "strategy": emitted.model_dump(mode="json"),
                        "time": emitted_time.to_dict()}
    data["kind"] = "balance"
    inert = inert_flags(args, strategy, recompute_chosen=True)  # balancing chooses the recompute
    inert += runtime_cautions(emitted, options, model, device)
    # What the memory and step-time models are known to miss for the balanced settings, as
    # `ndplan estimate` says them beside its figures, after the flags that change nothing.
    cautions = list(dict.fromkeys([*inert, *balanced_report.caveats, *emitted_time.caveats]))
    if cautions:
        data["caveats"] = cautions
    stepped_up = _stepped_up_line(strategy, result, limit)
    if stepped_up is not None:
        data["stepped_up"] = {**data["stepped_up"], "from": stepped_up[0], "to": stepped_up[1], "note": stepped_up[2]}
    if args.emit:
        data["emitted"] = emit_settings(model, emitted, args.emit, options, device)
        data["emitted_check"] = read_back(model, emitted, data["emitted"], args.emit, cluster, options, limit)
    # Balancing is worth running only where the full estimators agree it gains on the strategy as given
    # (and, with --emit, where the settings written fit as they read back).
    balanced_fits = result.estimated_stage_bytes is None or float(result.estimated_stage_bytes.max()) <= limit
    if args.emit and data["emitted_check"]["fits"] is False:
        balanced_fits = False
    data["recommended"] = ("given" if data["given"]["fits"] and (
        not balanced_fits or data["estimated_step_s"] >= data["given"]["step_s"])
        else "balanced" if balanced_fits else "neither")
    # The file written does not fit as it reads back: said, and the exit status says it too.
    written_unfit = bool(args.emit) and data["emitted_check"]["fits"] is False
    if args.json:
        emit_json(data)
        return 1 if written_unfit else 0
    table = Table(title=f"{model.name} — {strategy.short()} — balanced under {format_bytes(limit)} ({result.solver}, "
                        f"{result.solve_seconds:.2f} s)")
    for col in ["stage", "layers before", "memory before", "time before", "layers after", "memory after", "time after"]:
        table.add_column(col, justify="right")
    base_plan, base_cost = result.baseline
    virtual = result.problem.stage_of
    for s in range(result.problem.pp):
        before = sum(c for v, c in enumerate(base_plan.stage_layers) if virtual[v] == s)
        after = sum(c for v, c in enumerate(result.plan.stage_layers) if virtual[v] == s)
        table.add_row(str(s), str(before), format_bytes(base_cost.stage_memory_bytes[s]), f"{base_cost.stage_time_s[s] * 1e3:.1f} ms",
                      str(after), format_bytes(result.cost.stage_memory_bytes[s]), f"{result.cost.stage_time_s[s] * 1e3:.1f} ms")
    console.print(table)
    base_option = base_plan.recompute[0] if base_plan.recompute else "full"
    why = " (with activation offload a layer may not recompute fully)" if base_option != "full" else ""
    console.print(f"before: uniform placement, {base_option} recompute on every layer{why}; times are per micro-batch (F+B+W)")
    given = data["given"]
    console.print(f"as given ({strategy.short()}): step {given['step_s']:.3f} s, peak {format_bytes(given['peak_bytes'])} "
                  f"({'fits' if given['fits'] else 'over the limit'}), by the full estimators; after balancing: "
                  f"{data['estimated_step_s']:.3f} s ({_faster(given['step_s'], data['estimated_step_s'])})")
    console.print(f"layers per virtual stage: {list(result.plan.stage_layers)}")
    selective = (f"selective({'+'.join(result.selective_modules)})" if result.selective_modules
                 else "selective(default)" if result.selective_modules == () else "selective")
    console.print("recompute: " + ", ".join(f"{f'layer {a}' if n == 1 else f'layers {a}-{a + n - 1}'} "
                                            f"{selective if o == 'selective' else o}"
                                            for a, n, o in result.plan.ranges()))
    if result.policy_steps:
        console.print("selective policies balanced (step of the per-layer plan / as one setting): " + "; ".join(
            f"{policy} {_seconds_or_unfit(plan_s)} / {_seconds_or_unfit(settings_s)}"
            for policy, (plan_s, settings_s) in result.policy_steps.items()))
    unfit = "" if base_cost.fits else "; the baseline does not fit"
    # Against the balancer's own baseline, which is not the strategy as given (that is the line above).
    console.print(f"step {base_cost.step_s:.3f} s → {result.cost.step_s:.3f} s "
                  f"({_faster(base_cost.step_s, result.cost.step_s)} than the baseline, uniform {base_option} "
                  f"recompute{unfit}), composed from the stage times; the "
                  f"pipeline simulator gives {result.simulated_s[0]:.3f} s → {result.simulated_s[1]:.3f} s "
                  f"({_faster(*result.simulated_s)})"
                  + (f"; both of one pipeline run, {strategy.pipeline_runs} a step" if strategy.pipeline_runs > 1 else ""))
    if result.settings is not None:
        # --emit (and frameworks generally) take one recompute setting, not a per-layer mix.
        plan, cost, simulated = result.settings
        console.print(f"as one recompute setting, what --emit writes: {emitted.short()}, layers "
                      f"{list(plan.stage_layers)}: step {cost.step_s:.3f} s ({_faster(base_cost.step_s, cost.step_s)}; "
                      f"simulated {simulated:.3f} s), largest stage {format_bytes(float(cost.stage_memory_bytes.max()))} "
                      f"by the balancer's per-layer figures (the check below runs the full estimator); "
                      f"the per-layer mix above needs a framework that sets recompute layer by layer")
    if stepped_up is not None:
        console.print(stepped_up[2])
    if result.estimated_stage_bytes is not None:
        worst = float(result.estimated_stage_bytes.max())
        verdict = "fits" if worst <= limit else f"[bold red]over the limit by {format_bytes(worst - limit)}[/]"
        console.print(f"check: the full estimator, with the settings --emit writes "
                      f"({emitted.short()}), puts the largest stage at "
                      f"{format_bytes(worst)}: {verdict}; its step, with DP, p2p and the optimizer: "
                      f"{data['estimated_step_s']:.3f} s")
    versus = _faster(given["step_s"], data["estimated_step_s"])
    if data["recommended"] == "given":
        console.print(f"[bold]verdict: keep the strategy as given[/]: it fits, and by the full estimators the balanced "
                      f"settings are {'over the limit' if not balanced_fits else versus} "
                      f"(the balancer's composed figures above compare with its own baseline, uniform "
                      f"{base_option} recompute)")
    elif data["recommended"] == "neither":
        checked_fits = result.estimated_stage_bytes is None or float(result.estimated_stage_bytes.max()) <= limit
        if written_unfit and checked_fits:  # the check fits: what does not is the file as it reads back
            why = (f": the {args.emit} settings written run over the limit as they read back "
                   f"({format_bytes(data['emitted_check']['peak_bytes'])}; below)")
        else:
            why = " by the full estimators (see the check)"
        console.print(f"[bold red]verdict: neither the strategy as given nor the balanced settings fit[/]{why}; "
                      "give more memory, devices or pipeline stages")
    else:
        console.print(f"verdict: the balanced settings, {versus} than the strategy as given"
                      + ("" if given["fits"] else ", which does not fit"))
    check = data.get("emitted_check")
    if check and not check["same"]:
        console.print(f"[bold red]the {args.emit} settings written run {check['strategy']}[/], not as priced "
                      f"({emitted.short()} in {policy_of(emitted.precision).name}, layers "
                      f"{list(emitted.stage_layers or ())}): {'; '.join(check['differs'])}; by the full "
                      f"estimators, peak {format_bytes(check['peak_bytes'])} "
                      f"({'fits' if check['fits'] else 'over the limit'}), step {check['step_s']:.3f} s")
    if args.emit and (note := runtime_note(options, args.emit)):
        console.print(note)
    if balanced_report.host_peak_bytes:  # the balanced settings' offloads, as `ndplan estimate` says them
        console.print("balanced settings' " + host_verdict(balanced_report))
    for caveat in cautions:
        console.print(f"[bold yellow]caution[/]: {caveat}")
    # what the step is priced with, and what --emit changed in it (the loss)
    print_kernels(options, strategy, recompute_chosen=True, model=model)
    if emitted_time.unfused_why:
        from ndplan.perf.accumulation import unfused_note

        console.print(unfused_note(emitted_time.unfused_why, bool(options.gradient_accumulation_fusion)), markup=False)
    if data.get("emitted"):
        console.print(f"\n[bold]{args.emit}[/] settings:")
        console.print(data["emitted"], markup=False, soft_wrap=True)  # settings to paste: never wrapped
    if written_unfit:
        check = data["emitted_check"]
        print(f"ndplan: warning: the {args.emit} settings written run over the limit as they read back (peak "
              f"{format_bytes(check['peak_bytes'])} of {format_bytes(limit)} by the full estimators); exit status 1",
              file=sys.stderr)
        return 1
    return 0


def _stepped_up_line(strategy: Strategy, result: Any, limit: float) -> tuple[str, str, str] | None:
    """(from, to, what to say) where the balancer's one-setting plan ran over the limit by the full
    estimator and a setting saving more was written instead (``balance.build.step_up_settings``)."""
    from ndplan.balance import plan_strategy
    from ndplan.balance.build import settings_label

    if result.stepped_from is None:
        return None
    plan, peak = result.stepped_from
    before = settings_label(plan_strategy(strategy, plan, result.emitted_modules))
    after = settings_label(plan_strategy(strategy, result.emitted_plan, result.emitted_modules))
    return before, after, (f"stepped up from {before} to {after}: the balancer's plan was {format_bytes(peak - limit)} "
                           f"over by the full estimator ({format_bytes(peak)} of {format_bytes(limit)}; the "
                           f"balancer's memory model approximates it)")


def _faster(before_s: float, after_s: float) -> str:
    """'12.3% faster' or '4.5% slower': after against before."""
    change = after_s / before_s - 1
    return f"{100 * abs(change):.1f}% {'faster' if change <= 0 else 'slower'}"


def _seconds_or_unfit(value: float | None) -> str:
    return "does not fit" if value is None else f"{value:.3f} s"
