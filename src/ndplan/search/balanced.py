"""Rank every fitting candidate of a search by its balanced plan, without balancing them all.

A pipeline candidate's composed step is its step without recompute × the balancer's composed
time of its plan / of the uniform plan without recompute (the balancer's heuristic plan: layers
per stage and chunk, and recompute per layer; about a millisecond each, interleaved and V
schedules included). The reference is the same for every recompute setting of a layout, so one
plan gets one step, and one row (``plan_key``).

A candidate takes its plan where the plan's composed step is below its own step and what --emit
writes of it (the fastest plan one recompute setting expresses) fits by the full memory
estimator; where that plan is one recompute setting (the plan itself is written), also only where
the full time estimator (``estimate_time``, the pipeline simulated) gives it a step below the
candidate's own, and where it recomputes per layer, only where its step with the schedule
simulated (``per_layer_step_s``) is. Otherwise the candidate keeps its uniform form and its search step. Where the
written setting runs over the limit by the full estimator, the next settings saving more on the
same placement are tried first (``balance.build.step_up_settings``: rc-full:k to k + 1, ...) and
the first that fits is written instead (a plan that was that setting becomes the stepped one;
``balanced_settings.stepped_up_from`` says so).

A row's figures are the full estimators' (``estimate_time``, ``plan_stage_bytes``) wherever the
plan is one recompute setting (``"figures": "estimated"``, the composed ones beside them as
``composed_*``); a plan that mixes recompute settings per layer is not one strategy the full
estimators price, so its row keeps the balancer's figures (``"figures": "composed"``): its peak
the balancer's, its step the balancer's stage times through the schedule simulator
(``per_layer_step_s``), not the composition, which reads fast on unequal interleaved chunks.

Ranking: ``balance.bound`` gives every pipeline candidate a lower bound of its composed step at
once, so candidates are balanced in order of their bound, queued by their composed step, and
taken fastest first once no unwalked bound is below it; a plan is checked by the full
estimators when it is the fastest queued (a rejected one goes back at its candidate's own step,
never below the composed one). The walk stops at ``walk = top + max(top, 10)`` rows: those rows
equal what balancing and checking every candidate would give, by the composed step (ties by
index). They are then re-ranked by the step each row shows and cut to ``top``. The full estimate
of a one-setting plan is not bounded by the composed bound, so a candidate outside the walk's
rows whose full estimate would place it within the ``top`` is missed: the ranking by the shown
step is exact among the walk's rows only.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ndplan.balance import evaluate, simulated_step_s, solve_heuristic, uniform_plan
from ndplan.balance.bound import balanced_step_lower_bound
from ndplan.balance.build import (
    baseline_option,
    best_settings_plan,
    build_problems,
    plan_stage_bytes,
    plan_strategy,
    plans_expressible,
    settings_label,
    step_up_settings,
)
from ndplan.balance.problem import BalanceProblem, Plan
from ndplan.hardware import Cluster, Device
from ndplan.memory import MemoryOptions
from ndplan.memory.stages import peak_memory
from ndplan.model.spec import ModelSpec
from ndplan.perf.efficiency import device_family
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
    them, how many were left as they are because their schedule is too long to simulate
    (more than ``MAX_SIMULATED_PASSES`` micro-batch passes: a balancing problem simulates it),
    how many fastest by the composed step were re-ranked by the shown step (``walk``), and how
    many candidates kept their uniform form because the full estimators found their plan over the
    memory limit (``over_limit``) or no faster than the candidate (``slower``)."""

    rows: list[dict[str, Any]]
    balanced: int
    unsimulated: int
    walk: int = 0
    over_limit: int = 0
    slower: int = 0


def walk_width(top: int) -> int:
    """How many candidates, fastest by the composed step, are re-ranked by the shown step."""
    return top + max(top, 10)


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
    """The ``top`` candidates of ``result`` by the step their rows show, among the
    ``walk_width(top)`` fastest by the composed balanced step (rows as the search's, pipelines
    with their balanced plan; the module docstring says what each figure is), and how many
    pipeline candidates were balanced to know it. A
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
    # Candidates walked, a min-heap by (step, candidate): a plan's composed step until the full
    # estimators check it (``pending``), then its step for good (the composed step where the plan
    # stands, the candidate's own where it does not: never below the composed step).
    queue: list[tuple[float, int, int]] = []
    pending: dict[int, tuple[dict[str, Any], Strategy]] = {}
    keys: dict[int, tuple[Any, ...]] = {}  # a pipeline's plan_key, as it runs for now
    plans: dict[int, dict[str, Any]] = {}
    listed: list[int] = []
    balanced = over_limit = slower = walked = 0
    seen: set[tuple[Any, ...]] = set()
    walk = walk_width(top)
    while len(listed) < walk:
        # Walk every candidate whose bound is not above the best step queued: none left unwalked
        # can come before it.
        while walked < len(order) and (not queue or lower[order[walked]] <= queue[0][0]):
            position = int(order[walked])
            walked += 1
            value = float(step[position])
            candidate = int(index[position])
            if pipeline[position]:
                if position not in built:
                    positions = ahead[next_ahead:next_ahead + chunk]
                    next_ahead, chunk = next_ahead + len(positions), min(2 * chunk, _LAST_CHUNK)
                    built.update(_build_chunk(model, space, cluster, index[positions], positions,
                                              memory_limit_bytes, options))
                problem, strategy = built.pop(position)
                found = solve_heuristic(problem)
                balanced += 1
                modules = space.selective_modules(candidate)
                if found is not None and one_setting:
                    found = best_settings_plan(problem, found[0], uniform_plan(problem, baseline_option(problem)),
                                               plans_expressible(expressible, strategy, modules))
                keys[candidate] = plan_key(strategy, uniform_plan(problem, strategy.recompute), modules)
                if found is not None:
                    # seconds per composed second: the reference over the uniform plan without recompute
                    uniform_s = evaluate(problem, uniform_plan(problem, "none")).step_s
                    scale = float(reference[position]) / uniform_s
                    # else balancing gains nothing on the candidate as it is (a plan that is the
                    # candidate's own layout and recompute reads a rounding below it)
                    # (as a ratio: a plan that is the uniform one scales the reference by exactly 1,
                    # so it ties with the candidate that runs it as it is, which stands by index)
                    composed = float(reference[position]) * (found[1].step_s / uniform_s)
                    if composed < value and plan_key(strategy, found[0], modules) != keys[candidate]:
                        value = composed
                        pending[candidate] = ({"step_s": value, "scale": scale, "plan": found[0], "cost": found[1],
                                               "problem": problem, "reference_s": float(reference[position])},
                                              strategy)
            heapq.heappush(queue, (value, candidate, position))
        if not queue:
            break
        value, candidate, position = heapq.heappop(queue)
        if candidate in pending:
            # The fastest queued is a plan not yet checked: the full estimators check it now.
            plan, strategy = pending.pop(candidate)
            modules = space.selective_modules(candidate)
            verdict = _check(model, strategy, plan, cluster, options, memory_limit_bytes, float(step[position]),
                             plans_expressible(expressible, strategy, modules), modules)
            if verdict is not None:  # the candidate keeps its uniform form, and its step
                over_limit += verdict == "over_limit"
                slower += verdict == "slower"
                heapq.heappush(queue, (float(step[position]), candidate, position))
                continue
            plans[candidate] = plan
            keys[candidate] = plan_key(strategy, plan["plan"], modules)
        # One row per plan: the same layout reached from several starting recompute settings
        # (balanced, or a candidate that already is the plan) has one step; the first by step,
        # then index, stands for them.
        if candidate in keys:
            if keys[candidate] in seen:
                continue
            seen.add(keys[candidate])
        listed.append(candidate)
    rows = _rows(model, space, listed, plans, cluster, time_function, options)
    # The walk's candidates re-ranked by the step each row shows (the full estimate of a
    # one-setting plan), then cut to the top.
    rows.sort(key=lambda row: (row["step_s"], row["candidate"]))
    return BalancedRanking(rows[:top], balanced, unsimulated, walk, over_limit, slower)


def _check(model: ModelSpec, strategy: Strategy, plan: dict[str, Any], cluster: Cluster, options: MemoryOptions,
           memory_limit_bytes: float, step_s: float, expressible: Callable[[Plan], bool] | None,
           modules: tuple[str, ...]) -> str | None:
    """The full estimators' check of a candidate's plan (adding what they found to ``plan``):
    "over_limit" where what --emit writes (the fastest plan one recompute setting expresses) runs
    over the memory limit, "slower" where that is the plan itself and its step, the pipeline
    simulated, is not below the candidate's own ``step_s``; None where the plan stands."""
    problem = plan["problem"]
    settings, settings_cost = best_settings_plan(problem, plan["plan"], uniform_plan(problem, baseline_option(problem)),
                                                 expressible)
    written = plan_strategy(strategy, settings, modules)
    estimated = plan_stage_bytes(model, strategy, settings, options, modules)
    if float(estimated.max()) > memory_limit_bytes:
        # The balancer's memory model missed near the limit: a setting saving more, if one fits.
        stepped = step_up_settings(model, strategy, problem, settings, memory_limit_bytes, options, modules, expressible)
        if stepped is None:
            plan.update(settings=settings, settings_cost=settings_cost, written=written, estimated_bytes=estimated)
            return "over_limit"
        plan["stepped_from"] = (settings_label(written), float(estimated.max()))
        if settings == plan["plan"]:  # the plan is the setting written: it becomes the stepped one
            plan["plan"] = stepped[0]
            plan["cost"] = evaluate(problem, stepped[0])
            plan["step_s"] = plan["scale"] * plan["cost"].step_s
        settings, estimated = stepped
        settings_cost = evaluate(problem, settings)
        written = plan_strategy(strategy, settings, modules)
    plan.update(settings=settings, settings_cost=settings_cost, written=written, estimated_bytes=estimated)
    if settings == plan["plan"]:
        plan["estimate"] = estimate_time(model, written, cluster, **options.time_keywords())
        # Faster than the candidate's step (the search's, closed-form pipelines) and than the
        # candidate's own estimate (simulated, as the plan's is): the closed forms can read a
        # candidate slow, which its plan's simulated step alone would pass off as a gain.
        if plan["estimate"].step_s >= min(step_s, estimate_time(model, strategy, cluster,
                                                                **options.time_keywords()).step_s):
            return "slower"
    else:
        plan["simulated_step_s"] = per_layer_step_s(problem, plan["plan"], strategy.schedule, plan["reference_s"])
        if plan["simulated_step_s"] >= step_s:
            return "slower"
    return None


def per_layer_step_s(problem: BalanceProblem, plan: Plan, schedule: str, reference_s: float) -> float:
    """The step a plan that recomputes per layer shows: ``reference_s`` (the layout's step without
    recompute, by the search's time model) × the plan's simulated step / the uniform plan's
    without recompute, both simulated on the balancer's stage times (``simulated_step_s``).

    No full estimator prices a per-layer mix; the composed step (``evaluate``) prices the schedule
    in closed form and read up to 15% fast on interleaved plans with unequal chunks (DeepSeek-V3
    pp8 vpp4: composed 6.573 s, simulated 7.550 s), so the row shows the simulated ratio."""
    uniform = simulated_step_s(problem, uniform_plan(problem, "none"), schedule)
    return reference_s * simulated_step_s(problem, plan, schedule) / uniform


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


def _rows(model: ModelSpec, space: SearchSpace, listed: list[int], plans: dict[int, dict[str, Any]],
          cluster: Cluster, time_function: Callable[..., dict[str, Any]], options: MemoryOptions) -> list[dict[str, Any]]:
    if not listed:
        return []
    candidates = np.array(listed, dtype=np.int64)
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
                   {k: float(np.asarray(v)[i]) for k, v in times.items()}, options, model,
                   device_family(cluster.device))
        found = plans.get(int(candidate))
        if found is not None:
            # The uniform candidate's figures the plan does not determine (the step's parts,
            # hardware FLOPs: the plan recomputes other layers) are kept beside it as unbalanced_*,
            # never mixed with the plan's.
            for key in [k for k in row if k in _UNBALANCED_ONLY or (k.endswith("_s") and k not in ("step_s", "tokens_per_s"))]:
                row[f"unbalanced_{key}"] = row.pop(key)
            for key in ("step_s", "tokens_per_s", "mfu", "peak_bytes", "peak_stage", "recompute", "strategy"):
                row[f"unbalanced_{key}"] = row.pop(key)
            # The balancer's composed figures: the uniform step × the composed ratio and what follows
            # from it, the peak by its per-layer figures.
            per_device = row.pop("tokens_per_s_per_device")
            plan_bytes = found["cost"].stage_memory_bytes
            composed = {**_at_step(row, per_device, found["step_s"]), "peak_bytes": round(float(plan_bytes.max())),
                        "peak_stage": int(np.argmax(plan_bytes))}
            settings, estimated, written = found["settings"], found["estimated_bytes"], found["written"]
            estimate = found.get("estimate")
            if estimate is None:  # a plan that mixes settings: only what --emit writes of it is priced
                estimate = estimate_time(model, written, cluster, **options.time_keywords())
            if settings == found["plan"]:
                # The plan is one recompute setting, what --emit writes: the full estimators' figures.
                row["figures"] = "estimated"
                row.update(step_s=estimate.step_s, tokens_per_s=estimate.tokens_per_s,
                           tokens_per_s_per_device=estimate.tokens_per_s_per_device, mfu=estimate.mfu,
                           hfu=estimate.hfu, peak_bytes=round(float(estimated.max())),
                           peak_stage=int(np.argmax(estimated)))
            else:
                # Recompute per layer: one strategy each, the full estimators cannot price it; the
                # balancer's figures with the schedule simulated (``per_layer_step_s``).
                row["figures"] = "composed"
                row.update(composed, **_at_step(row, per_device, found["simulated_step_s"]))
            row.update({f"composed_{k}": v for k, v in composed.items()})
            row["recompute"] = "per-layer"
            # The plan is balanced_stage_layers with balanced_recompute, and the settings one
            # recompute setting writes balanced_settings'.
            row["balanced_stage_layers"] = list(found["plan"].stage_layers)
            row["balanced_recompute"] = [{"first": a, "count": n, "option": o} for a, n, o in found["plan"].ranges()]
            # What --emit writes: the fastest plan one recompute setting expresses, priced alike.
            row["balanced_settings"] = {
                "label": written.short(), "stage_layers": list(settings.stage_layers),
                # the full estimator's peak of these settings (what --emit writes), and its stage
                "estimated_peak_bytes": round(float(estimated.max())), "estimated_peak_stage": int(np.argmax(estimated)),
                # the balancer's composed step of these settings, and `ndplan estimate`'s (simulated)
                "step_s": found["scale"] * found["settings_cost"].step_s,
                "estimated_step_s": estimate.step_s,
                "strategy": written.model_dump(mode="json", exclude={"precision"}),
                "is_the_plan": settings == found["plan"],  # the plan took one setting already
            }
            if "stepped_from" in found:
                # The balancer's setting ran over the limit by the full estimator: this one saves more.
                stepped_label, stepped_peak = found["stepped_from"]
                row["balanced_settings"]["stepped_up_from"] = {"label": stepped_label,
                                                            "estimated_peak_bytes": round(stepped_peak)}
            row["label"] = _balanced_label(strategy, found["plan"].recompute, modules)
        rows.append(row)
    return rows


def _at_step(row: dict[str, Any], per_device: float, step_s: float) -> dict[str, float]:
    """A balanced row's throughput and MFU at ``step_s``: the uniform candidate's (its
    ``unbalanced_*`` figures and ``per_device`` tokens/s) scaled by its step over ``step_s``
    (the same tokens and model FLOPs a step)."""
    ratio = step_s / row["unbalanced_step_s"]
    return {"step_s": step_s, "tokens_per_s": row["unbalanced_tokens_per_s"] / ratio,
            "tokens_per_s_per_device": per_device / ratio, "mfu": row["unbalanced_mfu"] / ratio}


def _balanced_label(strategy: Strategy, recompute: tuple[str, ...], modules: tuple[str, ...]) -> str:
    """The candidate's label with its recompute replaced by the plan's, counted per option (the
    candidate's own setting is what the plan started from, not what it runs), e.g.
    'dp4 tp2 pp4 mbs1 m64 1f1b (balanced; recompute per layer: 61 none, 15 selective, 4 full)'."""
    named = {"none": "none", "selective": "selective" + (f"({'+'.join(modules)})" if modules else ""), "full": "full"}
    counts = ", ".join(f"{recompute.count(o)} {name}" for o, name in named.items() if o in recompute)
    return f"{strategy.with_recompute('none').short()} (balanced; recompute per layer: {counts})"


__all__ = ["BalancedRanking", "rank_balanced"]
