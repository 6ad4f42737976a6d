"""Step-time model: FLOPs, communication and pipeline schedules, in seconds.

``estimate_time`` prices one strategy (simulated pipeline, with ``explain()``);
``step_time_batch`` prices millions for the search (closed-form pipelines); both run
``step.evaluate``. ``calibrate`` fits the efficiency figures to measured step times.
"""

from ndplan.perf.calibrate import CalibrationReport, MeasuredRun, calibrate, load_runs
from ndplan.perf.efficiency import (
    FAMILY_DEFAULTS,
    EfficiencyProfile,
    default_efficiency,
    device_family,
    dump_efficiency,
    load_efficiency,
)
from ndplan.perf.overlap import OVERLAP_PRESETS, OverlapConfig, default_overlap, get_overlap, parse_overlap
from ndplan.perf.report import TimeReport, estimate_time
from ndplan.perf.step import evaluate, step_time_batch

__all__ = [
    "FAMILY_DEFAULTS",
    "OVERLAP_PRESETS",
    "CalibrationReport",
    "EfficiencyProfile",
    "MeasuredRun",
    "OverlapConfig",
    "TimeReport",
    "calibrate",
    "default_efficiency",
    "default_overlap",
    "device_family",
    "dump_efficiency",
    "estimate_time",
    "evaluate",
    "get_overlap",
    "load_efficiency",
    "load_runs",
    "parse_overlap",
    "step_time_batch",
]
