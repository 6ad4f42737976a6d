"""`ndplan calibrate runs.yaml -o profile.yaml`: fit efficiency figures to measured runs.

The lead wires it into ndplan.cli with ``add_calibrate_command(sub)``; the handler returns an
exit code and raises NdplanError for bad input (the main CLI prints it on one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ndplan.errors import NdplanError
from ndplan.hardware.presets import resolve_device
from ndplan.outputs import made_folder, output_path
from ndplan.perf.calibrate import calibrate, load_runs
from ndplan.perf.efficiency import FITTABLE, dump_efficiency, load_efficiency


def add_calibrate_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``calibrate`` subcommand on an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        help="fit the step-time efficiency figures to measured runs; write a profile YAML",
        description=(
            "Fit a device family's efficiency figures (GEMM, attention, HBM, network efficiencies ...) "
            "to measured step times by bounded least squares, and write them as a profile that "
            "estimate, search, balance and report take with --efficiency PROFILE (or paste under a device "
            "YAML's 'efficiency:'). Runs use the format of benchmarks/published_runs.yaml."
        ),
    )
    p.add_argument("runs", type=Path, help="YAML/JSON file of measured runs")
    p.add_argument("-o", "--output", type=Path, required=True, help="profile YAML to write")
    p.add_argument("--device", help="fit this device's family (default: the most common device in the runs)")
    p.add_argument("--fit", help="comma-separated figures to fit (default: gemm, attention, HBM, scale-up and scale-out "
                                 "efficiencies, and fp8 GEMM efficiency where a run computes in fp8); any of: "
                                 f"{', '.join(FITTABLE)}")
    p.add_argument("--initial", type=Path, help="start from this profile YAML instead of the family defaults")
    p.add_argument("--prior-weight", type=float, default=0.0,
                   help="pull each figure toward its starting value, a weight of 0 or more (default 0: plain "
                        "least squares)")
    p.add_argument("--json", action="store_true", help="print the fit report as JSON")
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    # Checked before the fit (tens of seconds over published runs), not found unwritable after it.
    output_path(args.output, "-o", "profile YAML file")
    runs = load_runs(args.runs)
    if args.device:
        device = resolve_device(args.device)
    else:
        name, _ = Counter(r.device_spec().name for r in runs).most_common(1)[0]
        device = next(r.device_spec() for r in runs if r.device_spec().name == name)
    fit = [f.strip() for f in args.fit.split(",") if f.strip()] if args.fit else None
    initial = load_efficiency(args.initial) if args.initial else None
    if not args.prior_weight >= 0 or args.prior_weight == float("inf"):  # NaN fails the first test
        raise NdplanError(f"--prior-weight must be a finite number >= 0, got {args.prior_weight}")
    from ndplan.progress import working

    with working(f"calibrating: fitting {len(runs)} run{'s' if len(runs) != 1 else ''} on {device.name}",
                 quiet=args.json):
        profile, report = calibrate(runs, device, fit=fit, initial=initial, prior_weight=args.prior_weight)
    comment = (
        f"ndplan calibrate {args.runs} (device family {report.device_family})\n{report.summary()}\n"
        f"runs: {', '.join(r['id'] for r in report.runs)}"
        + "".join(f"\nwarning: {warning}" for warning in report.warnings)
    )
    dump_efficiency(profile, made_folder(args.output, "-o"), comment)
    if args.json:
        print(json.dumps({
            "profile": str(args.output), "device_family": report.device_family, "fitted": report.fitted,
            "initial": report.initial, "median_abs_error_before": report.median_abs_error_before,
            "median_abs_error_after": report.median_abs_error_after, "max_abs_error_after": report.max_abs_error_after,
            "runs": report.runs, "skipped": report.skipped,
            "not_fitted_regressed": report.regressed, "success": report.success, "warnings": report.warnings,
        }, indent=2))
        return 0
    console = Console(highlight=False)
    table = Table(title=f"calibration on {len(report.runs)} run{'s' if len(report.runs) != 1 else ''} "
                        f"({report.device_family})")
    for col in ("run", "runtime", "measured s", "before s", "after s", "error after"):
        # A run's id is what the reader looks for: folded onto more lines where the terminal is
        # narrow, never cut to an ellipsis (two ids that share a prefix read alike cut).
        table.add_column(col, justify="left" if col in ("run", "runtime") else "right",
                         overflow="fold" if col == "run" else "ellipsis", no_wrap=col != "run")
    for r in report.runs:
        table.add_row(r["id"], r["runtime"], f"{r['measured_step_s']:.3f}", f"{r['predicted_before_s']:.3f}",
                      f"{r['predicted_after_s']:.3f}", f"{r['error_after']:+.1%}")
    console.print(table)
    console.print(report.summary())
    if report.skipped:
        console.print(f"skipped (other device families): {', '.join(report.skipped)}")
    if report.regressed:
        console.print(f"not fitted (their software is reported as regressed): {', '.join(report.regressed)}")
    for warning in report.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}")
    console.print(f"wrote {args.output}")
    return 0
