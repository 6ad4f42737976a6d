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
from ndplan.search.run import SearchResult, runtime_refusals
from ndplan.search.space import SearchSpace
from ndplan.strategy import Strategy, StrategyBatch, check_strategy


def brute_force_ranking(model: ModelSpec, device: Device, space: SearchSpace, step_time: Callable, limit: float,
                        options: MemoryOptions, check: Callable[[int, Strategy], None] | None = None) -> list[int]:
    """The candidates of ``space`` that fit ``limit`` (and the device's share of its node's host
    memory, where it states one), fastest first (ties: less memory, then the
    index): those Strategy refuses as it is built, duplicates, those a rule refuses and those the
    runtime does not run left out. ``check(candidate, strategy)`` sees each one priced."""
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
        if runtime_refusals(strategy, options, model, device):  # (its schedules among them)
            continue
        if check is not None:
            check(candidate, strategy)
        report = estimate(model, strategy, device, options, num_devices=space.num_devices)
        peak = report.peak_bytes
        if peak <= limit and report.fits_host is not False:
            step = float(step_time(model, StrategyBatch.of(strategy), cluster)["step_s"][0])
            expected.append((step, peak, candidate))
    return [candidate for _, _, candidate in sorted(expected)]


def megatron_step_time(model: ModelSpec, batch: StrategyBatch, cluster: Cluster) -> dict:
    """The step-time model as the megatron runtime runs a split backward (no weight-gradient rebuilds)."""
    from ndplan.perf import step_time_batch

    return step_time_batch(model, batch, cluster, weight_grad_rebuilds=False)


def search_as_brute_force(model: ModelSpec, device: Device, space: SearchSpace, limit: float, options: MemoryOptions,
                          step_time: Callable = megatron_step_time, **search: int) -> SearchResult:
    """``run_search`` of the whole ranking, held to ``brute_force_ranking`` (not empty); the result."""
    from ndplan.search import run_search

    result = run_search(model, device, space, step_time, memory_limit_bytes=limit, options=options, top=10**9,
                        **search)
    expected = brute_force_ranking(model, device, space, step_time, limit, options)
    assert expected and [row["candidate"] for row in result.ranked] == expected
    return result
