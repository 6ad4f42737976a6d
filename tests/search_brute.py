"""A search's ranking by brute force: every candidate of a space priced one by one with the
single-strategy API (``estimate`` and the step-time function), for tests to hold ``run_search``
to."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from pydantic import ValidationError

from ndplan.hardware.device import Cluster, Device
from ndplan.memory import MemoryOptions, estimate
from ndplan.model.spec import ModelSpec
from ndplan.search.space import SearchSpace
from ndplan.strategy import Strategy, StrategyBatch, check_strategy


def brute_force_ranking(model: ModelSpec, device: Device, space: SearchSpace, step_time: Callable, limit: float,
                        options: MemoryOptions, check: Callable[[int, Strategy], None] | None = None) -> list[int]:
    """The candidates of ``space`` that fit ``limit`` (and the device's share of its node's host
    memory, where it states one), fastest first (ties: less memory, then the
    index): those Strategy refuses as it is built, duplicates, those a rule refuses and schedules
    the runtime does not run left out. ``check(candidate, strategy)`` sees each one priced."""
    cluster = Cluster(device=device, num_devices=space.num_devices)
    duplicates = space.duplicates(np.arange(space.size))
    expected = []
    for candidate in range(space.size):
        try:
            strategy = space.strategy(candidate)
        except ValidationError:  # what Strategy itself refuses
            continue
        if duplicates[candidate] or check_strategy(strategy, model, space.num_devices):
            continue
        if strategy.schedule not in options.profile.schedules:
            continue
        if check is not None:
            check(candidate, strategy)
        report = estimate(model, strategy, device, options, num_devices=space.num_devices)
        peak = report.peak_bytes
        if peak <= limit and report.fits_host is not False:
            step = float(step_time(model, StrategyBatch.of(strategy), cluster)["step_s"][0])
            expected.append((step, peak, candidate))
    return [candidate for _, _, candidate in sorted(expected)]
