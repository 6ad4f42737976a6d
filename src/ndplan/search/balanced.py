"""Rank every fitting candidate of a search by its balanced plan, without balancing them all.

A pipeline candidate's balanced step is its step without recompute × the balancer's composed
time of its plan / of the uniform plan without recompute (the balancer's heuristic plan: layers
per stage and chunk, and recompute per layer; about a millisecond each, interleaved and V
schedules included), where that is below its own step; other candidates keep their step. The
reference is the same for every recompute setting of a layout, so one plan gets one step, and
one row (``plan_key``).
``balance.bound`` gives every pipeline candidate a lower bound of that balanced
step at once, so candidates are balanced in order of their bound and the walk stops once the
bound reaches the ``top``-th balanced step found: no candidate left can enter the top, and
the top equals what balancing every candidate would give.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ndplan.balance import evaluate, solve_heuristic, uniform_plan
from ndplan.balance.bound import balanced_step_lower_bound
from ndplan.balance.build import (
    baseline_option,
    best_settings_plan,
    build_problems,
    plan_stage_bytes,
    plan_strategy,
    plans_expressible,
)
from ndplan.balance.problem import BalanceProblem, Plan
from ndplan.hardware import Cluster, Device
from ndplan.memory import MemoryOptions
from ndplan.memory.stages import peak_memory
from ndplan.model.spec import ModelSpec
from ndplan.perf.report import estimate_time
from ndplan.schedule.ops import MAX_SIMULATED_PASSES, simulated_passes
from ndplan.search.run import SearchResult, _row
from ndplan.search.space import SearchSpace
from ndplan.strategy import Strategy, StrategyBatch
from ndplan.strategy.batch import CODES

_BLOCK = 1 << 16  # candidates per vectorised bound evaluation: bounds temporary memory
_FIRST_CHUNK, _LAST_CHUNK = 8, 128  # pipeline candidates whose problems are built in one batch
#: A uniform candidate's figures that a balanced plan does not share (besides its step's parts).
_UNBALANCED_ONLY = ("hfu", "hardware_flops")


class BalancedRanking(NamedTuple):
    """``rank_balanced``'s answer: the rows, how many pipeline candidates were balanced to know
    them, and how many were left as they are because their schedule is too long to simulate
    (more than ``MAX_SIMULATED_PASSES`` micro-batch passes: a balancing problem simulates it)."""

    rows: list[dict[str, Any]]
    balanced: int
    unsimulated: int


def rank_balanced(
    model: ModelSpec,
    device: Device,
    space: SearchSpace,
    result: SearchResult,
    time_function: Callable[..., dict[str, Any]],
    *,
    memory_limit_bytes: float,
    options: MemoryOptions | None = None,
    top: int = 10,
    one_setting: bool = False,
    expressible: Callable[[Strategy], bool] | None = None,
) -> BalancedRanking:
    """The ``top`` candidates of ``result`` by balanced step (rows as the search's, pipelines
    with their balanced plan), and how many pipeline candidates were balanced to know it. A
    pipeline whose schedule is too long to simulate keeps its uniform step (and is counted).
    With ``one_setting`` a pipeline's plan is the fastest one recompute setting expresses
    (``balance.build.best_settings_plan`` of the heuristic's plan): what Megatron and torchtitan
    run. Its step is never below the per-layer plan's, so the same lower bound prunes.
    ``expressible``: whether the format --emit writes can express a one-setting strategy; the
    one-setting plans are chosen among those (``balance.build.best_settings_plan``)."""
    options = options or MemoryOptions()
    cluster = Cluster(device=device, num_devices=space.num_devices)
    index = np.asarray(result.candidates_index, dtype=np.int64)
    step = np.asarray(result.candidates_time_s, dtype=float)
    if not len(index):
        return BalancedRanking([], 0, 0)
    lower = step.copy()
    # What a pipeline's balanced step scales: its step with no recompute, the same for every
    # recompute setting of one parallel layout, so that one plan reached from several starting
    # settings gets one step (scaling each candidate's own step, it got several, 0.3% apart).
    reference = step.copy()
    pipeline = np.zeros(len(index), dtype=bool)
    unsimulated = 0
    for start in range(0, len(index), _BLOCK):
        for positions, batch in space.batches(index[start:start + _BLOCK]):
            at = start + positions
            # The search priced these pipelines in closed form; a balancing problem simulates
            # the schedule, which the simulator refuses past its cap: those stay as they are.
            too_long = simulated_passes(batch.num_micro_batches, batch.pp, batch.vpp, batch.seq_chunks) > MAX_SIMULATED_PASSES
            piped = np.flatnonzero((batch.pp >= 2) & ~too_long)
            unsimulated += int(np.count_nonzero((batch.pp >= 2) & too_long))
            pipeline[at[piped]] = True
            if len(piped):
                plain = _without_recompute(batch.take(piped))
                reference[at[piped]] = time_function(model, plain, cluster)["step_s"]
                # A balanced step is the smaller of the candidate's own and its plan's, scaled.
                lower[at[piped]] = np.minimum(step[at[piped]], balanced_step_lower_bound(
                    model, plain, cluster, reference[at[piped]], **options.time_keywords()))
    order = np.lexsort((index, lower))
    # Problems are built ahead in growing chunks of the pipelines next in bound order: the
    # memory and time models price a chunk in one batch (``build_problems``), and a walk that
    # stops early wastes at most one chunk.
    ahead = order[pipeline[order]]
    built: dict[int, tuple[BalanceProblem, Strategy]] = {}
    next_ahead, chunk = 0, _FIRST_CHUNK
    kept: list[tuple[float, int, int]] = []  # max-heap by (−step, −candidate): the worst kept on top
    plans: dict[int, dict[str, Any]] = {}
    balanced = 0
    seen: set[tuple[Any, ...]] = set()
    for position in order:
        if len(kept) >= top and lower[position] > -kept[0][0]:
            break  # no remaining candidate can be faster than the top-th found
        value = float(step[position])
        candidate = int(index[position])
        if pipeline[position]:
            if int(position) not in built:
                positions = ahead[next_ahead:next_ahead + chunk]
                next_ahead, chunk = next_ahead + len(positions), min(2 * chunk, _LAST_CHUNK)
                built.update(_build_chunk(model, space, cluster, index[positions], positions,
                                          memory_limit_bytes, options))
            problem, strategy = built.pop(int(position))
            found = solve_heuristic(problem)
            balanced += 1
            if found is not None and one_setting:
                found = best_settings_plan(problem, found[0], uniform_plan(problem, baseline_option(problem)),
                                           plans_expressible(expressible, strategy, space.selective_modules(candidate)))
            if found is not None:
                # seconds per composed second: the reference over the uniform plan without recompute
                scale = float(reference[position]) / evaluate(problem, uniform_plan(problem, "none")).step_s
                if scale * found[1].step_s < value:  # else balancing gains nothing on the candidate as it is
                    value = scale * found[1].step_s
                    plans[candidate] = {"step_s": value, "scale": scale, "plan": found[0], "cost": found[1],
                                        "problem": problem}
            # One row per plan: the same layout reached from several starting recompute settings
            # (balanced, or a candidate that already is the plan) has one step; the first listed
            # (the lowest bound, then the lowest index) stands for them.
            ran = plans[candidate]["plan"] if candidate in plans else uniform_plan(problem, strategy.recompute)
            key = plan_key(strategy, ran, space.selective_modules(candidate))
            if key in seen:
                continue
            seen.add(key)
        entry = (-value, -candidate, int(position))
        if len(kept) < top:
            heapq.heappush(kept, entry)
        elif entry > kept[0]:
            heapq.heapreplace(kept, entry)
    best = sorted(kept, key=lambda e: (-e[0], -e[1]))
    return BalancedRanking(_rows(model, space, best, plans, cluster, time_function, options, expressible), balanced,
                           unsimulated)


def plan_key(strategy: Strategy, plan: Plan, modules: tuple[str, ...]) -> tuple[Any, ...]:
    """What a pipeline candidate runs once balanced: its layout without recompute, the plan's
    placement and recompute per layer (and what selective re-runs, where a layer does)."""
    return (strategy.with_recompute("none").short(), plan.stage_layers, plan.recompute,
            modules if "selective" in plan.recompute else ())


def _without_recompute(batch: StrategyBatch) -> StrategyBatch:
    """The batch with no recompute anywhere (the reference a balanced step scales)."""
    none = CODES["recompute"].index("none")
    return dataclasses.replace(batch, recompute=np.full(len(batch), none, dtype=batch.recompute.dtype),
                               recompute_layers=np.zeros(len(batch), dtype=batch.recompute_layers.dtype))


def _build_chunk(model: ModelSpec, space: SearchSpace, cluster: Cluster, candidates: np.ndarray, positions: np.ndarray,
                 memory_limit_bytes: float, options: MemoryOptions) -> dict[int, tuple[BalanceProblem, Strategy]]:
    """The balancing problems of ``candidates`` and their strategies, keyed by their
    ``positions``; one batch per selective policy and offload set (a batch shares them)."""
    groups: dict[tuple[Any, ...], list[tuple[int, Strategy]]] = {}
    for at, batch in space.batches(candidates):
        for i, where in enumerate(at):
            modules = space.selective_modules(int(candidates[where]))
            groups.setdefault((modules, batch.offload_modules), []).append((int(positions[where]), batch.row(i)))
    out: dict[int, tuple[BalanceProblem, Strategy]] = {}
    for (modules, _offload), members in groups.items():
        strategies = [s for _, s in members]
        problems = build_problems(model, strategies, cluster, memory_limit_bytes, options, modules, validate=False)
        out.update(zip((p for p, _ in members), zip(problems, strategies, strict=True), strict=True))
    return out


def _rows(model: ModelSpec, space: SearchSpace, best: list[tuple[float, int, int]], plans: dict[int, dict[str, Any]],
          cluster: Cluster, time_function: Callable[..., dict[str, Any]], options: MemoryOptions,
          expressible: Callable[[Strategy], bool] | None = None) -> list[dict[str, Any]]:
    if not best:
        return []
    candidates = np.array([-c for _, c, _ in best], dtype=np.int64)
    peak, stage = np.zeros(len(candidates)), np.zeros(len(candidates), dtype=np.int64)
    times: dict[str, np.ndarray] = {}
    for positions, batch in space.batches(candidates):
        peak[positions], stage[positions] = peak_memory(model, batch, options)
        for key, value in time_function(model, batch, cluster).items():
            times.setdefault(key, np.zeros(len(candidates)))[positions] = value
    rows = []
    for i, candidate in enumerate(candidates):
        strategy, modules = space.strategy(int(candidate)), space.selective_modules(int(candidate))
        row = _row(strategy, int(candidate), float(peak[i]), int(stage[i]),
                   {k: float(np.asarray(v)[i]) for k, v in times.items()}, options, model)
        found = plans.get(int(candidate))
        if found is not None:
            ratio = found["step_s"] / row["step_s"]
            # The row is the balanced plan's: its step (the uniform step × the composed ratio) and
            # what follows from it; the uniform candidate's figures the plan does not determine
            # (the step's parts, hardware FLOPs: the plan recomputes other layers) are kept beside
            # it as unbalanced_*, never mixed with the plan's.
            for key in [k for k in row if k in _UNBALANCED_ONLY or (k.endswith("_s") and k not in ("step_s", "tokens_per_s"))]:
                row[f"unbalanced_{key}"] = row.pop(key)
            row["unbalanced_step_s"] = row["step_s"]
            row["step_s"] = found["step_s"]
            row["tokens_per_s"] = row["tokens_per_s"] / ratio
            row["tokens_per_s_per_device"] = row["tokens_per_s_per_device"] / ratio
            row["mfu"] = row["mfu"] / ratio
            row["unbalanced_recompute"], row["recompute"] = row["recompute"], "per-layer"
            # The candidate before balancing, apart too: the plan is balanced_stage_layers with
            # balanced_recompute, and the settings one recompute setting writes balanced_settings'.
            row["unbalanced_strategy"] = row.pop("strategy")
            plan_bytes = found["cost"].stage_memory_bytes
            row["balanced_peak_bytes"] = round(float(plan_bytes.max()))
            # Its peak by the balancer's per-layer figures (the full estimator prices one recompute
            # setting only: balanced_settings has its check of what --emit writes).
            row["unbalanced_peak_bytes"], row["unbalanced_peak_stage"] = row["peak_bytes"], row["peak_stage"]
            row["peak_bytes"], row["peak_stage"] = row["balanced_peak_bytes"], int(np.argmax(plan_bytes))
            row["balanced_stage_layers"] = list(found["plan"].stage_layers)
            row["balanced_recompute"] = [{"first": a, "count": n, "option": o} for a, n, o in found["plan"].ranges()]
            # What --emit writes: the fastest plan one recompute setting expresses, priced alike.
            problem = found["problem"]
            settings, settings_cost = best_settings_plan(
                problem, found["plan"], uniform_plan(problem, baseline_option(problem)),
                plans_expressible(expressible, strategy, modules))
            written = plan_strategy(strategy, settings, modules)
            estimated = plan_stage_bytes(model, strategy, settings, options, modules)
            row["balanced_settings"] = {
                "label": written.short(), "stage_layers": list(settings.stage_layers),
                # the full estimator's peak of these settings (what --emit writes), and its stage
                "estimated_peak_bytes": round(float(estimated.max())), "estimated_peak_stage": int(np.argmax(estimated)),
                "step_s": found["scale"] * settings_cost.step_s,
                # The ranking scales the step without recompute by the balancer's composed ratio; what
                # `ndplan estimate` gives for these settings (the pipeline simulated) is beside it.
                "estimated_step_s": estimate_time(model, written, cluster, **options.time_keywords()).step_s,
                "strategy": written.model_dump(mode="json", exclude={"precision"}),
                "is_the_plan": settings == found["plan"],  # the plan took one setting already
            }
            row["label"] = _balanced_label(strategy, found["plan"].recompute, modules)
        rows.append(row)
    return rows


def _balanced_label(strategy: Strategy, recompute: tuple[str, ...], modules: tuple[str, ...]) -> str:
    """The candidate's label with its recompute replaced by the plan's, counted per option (the
    candidate's own setting is what the plan started from, not what it runs), e.g.
    'dp4 tp2 pp4 mbs1 m64 1f1b (balanced; recompute per layer: 61 none, 15 selective, 4 full)'."""
    named = {"none": "none", "selective": "selective" + (f"({'+'.join(modules)})" if modules else ""), "full": "full"}
    counts = ", ".join(f"{recompute.count(o)} {name}" for o, name in named.items() if o in recompute)
    return f"{strategy.with_recompute('none').short()} (balanced; recompute per layer: {counts})"


__all__ = ["BalancedRanking", "rank_balanced"]
