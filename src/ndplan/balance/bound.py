"""A lower bound of every pipeline candidate's balanced step, for millions at once.

The balancer composes a plan's step as (``problem.evaluate``, seconds per micro-batch)

    step(plan) = (m − 1/v) · max_s T_s + (1/v) · Σ_s T_s,    T_s = Σ_(layers on s) t(kind, option) + ends on s

(v chunks per stage) and the search scales a candidate's step by step(balanced) / step(uniform),
the uniform plan keeping the candidate's recompute option on every layer. Whatever a plan does,
each layer costs at least its cheapest option and the largest stage at least the mean, so with

    S_min = Σ_layers min_option t(kind, option) + t(embedding) + t(head)

    step(plan) ≥ S_min / v + (m − 1/v) · S_min / pp

and the candidate's balanced step is at least its step × that / step(uniform). The piece times
are the balancer's own (``perf.layer.piece_times``), evaluated for the whole batch at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ndplan.balance.build import OPTIONS, piece_seconds
from ndplan.hardware import Cluster
from ndplan.model.spec import ModelSpec
from ndplan.perf.overlap import OverlapConfig
from ndplan.placement import place_layers
from ndplan.strategy.batch import CODES, StrategyBatch


def _option_seconds(model: ModelSpec, batch: StrategyBatch, cluster: Cluster, option: str,
                    weight_grad_rebuilds: bool = False, overlap: OverlapConfig | None = None,
                    software: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Seconds per micro-batch of each piece with every layer under ``option``: the layer kinds
    with their rebuild added (as ``build_problem`` prices them), the two ends."""
    code = CODES["recompute"].index(option)
    variant = dataclasses.replace(batch, recompute=np.full(len(batch), code, dtype=batch.recompute.dtype),
                                  recompute_layers=np.zeros(len(batch), dtype=batch.recompute_layers.dtype))
    seconds = piece_seconds(model, variant, cluster, weight_grad_rebuilds=weight_grad_rebuilds, overlap=overlap,
                            software=software)
    out = {"emb": seconds["emb"], "head": seconds["head"]}
    for kind in ("dense", "moe"):
        out[kind] = seconds[kind] + (seconds[f"rc_{kind}"] if option != "none" else 0.0)
    return out


def balanced_step_lower_bound(
    model: ModelSpec, batch: StrategyBatch, cluster: Cluster, step_s: np.ndarray, *, weight_grad_rebuilds: bool = False,
    overlap: OverlapConfig | None = None, software: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """Per strategy of ``batch`` (pipelines of one chunk per stage or more), a lower bound of the
    step the search reports for it once balanced (``step_s`` is its uniform step; the layer
    prices as ``build_problem`` makes them for the runtime: ``weight_grad_rebuilds``, ``overlap``,
    ``software``)."""
    lower, uniform = composed_bounds(model, batch, cluster, weight_grad_rebuilds=weight_grad_rebuilds, overlap=overlap,
                                     software=software)
    return np.asarray(step_s, dtype=float) * lower / uniform


def composed_bounds(model: ModelSpec, batch: StrategyBatch, cluster: Cluster, *, weight_grad_rebuilds: bool = False,
                    overlap: OverlapConfig | None = None, software: Mapping[str, Any] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per strategy, in the balancer's composed seconds: the lower bound of any plan's step, and
    the step of the uniform plan with the strategy's recompute on every layer (what
    ``evaluate(problem, uniform_plan(problem, recompute))`` gives)."""
    seconds = {option: _option_seconds(model, batch, cluster, option, weight_grad_rebuilds, overlap, software)
               for option in OPTIONS}
    cheapest = {kind: np.minimum.reduce([seconds[o][kind] for o in OPTIONS]) for kind in ("dense", "moe")}
    kinds = model.layer_mlp_kinds
    s_min = (kinds.count("dense") * cheapest["dense"] + kinds.count("moe") * cheapest["moe"]
             + seconds["none"]["emb"] + seconds["none"]["head"])
    m = batch.num_micro_batches.astype(float)
    pp = batch.pp.astype(float)
    v = batch.vpp.astype(float)  # chunks per stage (V schedules run vpp = 2)
    bound = s_min / v + (m - 1 / v) * s_min / pp
    uniform = np.zeros(len(batch))
    for key, index in batch.groups(("pp", "vpp", "schedule", "recompute")):
        pp_g, vpp_g, schedule_code, recompute_code = key
        placement = place_layers(model, pp_g, vpp_g, CODES["schedule"][schedule_code])
        option = seconds[CODES["recompute"][recompute_code]]
        stage_time = np.zeros((len(index), pp_g))
        for virtual in range(placement.num_virtual_stages):
            s = int(placement.stage_of[virtual])
            stage_time[:, s] += (placement.dense_layers[virtual] * option["dense"][index]
                                 + placement.moe_layers[virtual] * option["moe"][index])
        stage_time[:, int(placement.stage_of[0])] += seconds["none"]["emb"][index]
        stage_time[:, int(placement.stage_of[-1])] += seconds["none"]["head"][index]
        chunks = placement.num_virtual_stages // pp_g
        uniform[index] = stage_time.sum(axis=1) / chunks + (m[index] - 1 / chunks) * stage_time.max(axis=1)
    return bound, uniform


__all__ = ["balanced_step_lower_bound", "composed_bounds"]
