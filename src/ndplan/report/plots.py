"""The report's figures as PNG/SVG/PDF files with matplotlib (the optional ``plot`` extra).

matplotlib is imported inside the functions, and figures are drawn on the Agg canvas directly
(``Figure`` + ``FigureCanvasAgg``), never through pyplot, so the caller's backend and global
state are left alone. The output format follows the file suffix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ndplan.errors import NdplanError
from ndplan.report import style
from ndplan.report.data import (
    CANDIDATE_KEYS,
    prepare,
    schedule_to_dict,
)

GIB = style.GIB


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise NdplanError("plots need matplotlib: pip install 'ndplan[plot]'") from exc
    fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    suffix = out.suffix.lower().lstrip(".")
    supported = fig.canvas.get_supported_filetypes()
    if suffix not in supported:
        raise NdplanError(f"cannot write a plot as '{out.name}': use a suffix of {', '.join(sorted(supported))}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=suffix)
    return out


def _style_axes(ax: Any) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e6e9ed", linewidth=0.8)
    ax.set_axisbelow(True)


def _context(data: Mapping[str, Any]) -> str:
    title = data.get("title") or ""
    short = data.get("strategy_short") or ""
    return f"{title} — {short}" if short else str(title)


# ------------------------------------------------------------------ memory
def _draw_memory(fig: Any, memory: Mapping[str, Any], context: str, user_limit: bool = False) -> None:
    """``user_limit``: the capacity line is a --memory-limit, not the device's memory."""
    stages = memory["stages"]
    capacity = memory.get("capacity_bytes")
    panels = [("by category", style.MEMORY_CATEGORIES, "categories")]
    if any(set(st["kinds"]) - {"unbroken"} for st in stages):
        panels.append(("by layer kind", style.LAYER_KINDS, "kinds"))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    x = np.arange(len(stages))
    width = 0.62
    for ax, (name, series, key) in zip(axes, panels, strict=True):
        bottom = np.zeros(len(stages))
        for skey, label, color in series:
            values = np.array([st[key].get(skey, 0.0) for st in stages]) / GIB
            if not values.any():
                continue
            ax.bar(x, values, width, bottom=bottom, color=color, label=label, edgecolor="white", linewidth=0.5)
            bottom += values
        allocated = [st.get("allocated_bytes") for st in stages]
        reserved = [st.get("reserved_bytes") for st in stages]
        if any(v is not None for v in allocated):
            ax.hlines([v / GIB if v is not None else np.nan for v in allocated], x - width / 2 - 0.08,
                      x + width / 2 + 0.08, colors=style.ALLOCATED_COLOR, linewidth=2, label="allocated peak")
        if any(v is not None for v in reserved):
            ax.hlines([v / GIB if v is not None else np.nan for v in reserved], x - width / 2 - 0.08,
                      x + width / 2 + 0.08, colors=style.RESERVED_COLOR, linewidth=2, linestyles="--",
                      label="reserved peak")
        if capacity:
            ax.axhline(capacity / GIB, color=style.CAPACITY_COLOR, linestyle="--", linewidth=1.6,
                       label=f"{'memory limit' if user_limit else 'device capacity'} ({capacity / GIB:,.1f} GiB)")
            ax.annotate(f"{'limit' if user_limit else 'capacity'} {capacity / GIB:,.1f} GiB", (1.0, capacity / GIB), xycoords=("axes fraction", "data"),
                        xytext=(0, 3), textcoords="offset points", ha="right", va="bottom", fontsize=8,
                        color=style.CAPACITY_COLOR)
        if len(stages) <= 16:
            for xi, total in zip(x, bottom, strict=True):
                ax.text(xi, total, f"{total:,.1f}", ha="center", va="bottom", fontsize=7.5)
        ax.set_xticks(x, [str(st["stage"]) for st in stages] if len(stages) <= 32 else None)
        if len(stages) > 32:
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("pipeline stage")
        ax.set_title(f"Memory per stage {name}", fontsize=11)
        _style_axes(ax)
        handles, labels = ax.get_legend_handles_labels()
        from matplotlib.container import BarContainer

        bars = [i for i, h in enumerate(handles) if isinstance(h, BarContainer)]
        order = bars + [i for i in range(len(handles)) if i not in bars]
        ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper center",
                  bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    axes[0].set_ylabel("memory per device (GiB)")
    top = max([*(st["peak_bytes"] for st in stages), capacity or 0.0]) / GIB
    axes[0].set_ylim(0, top * 1.1 if top > 0 else 1)
    fig.suptitle(context, fontsize=11.5, fontweight="bold")


def _memory_width(memory: Mapping[str, Any]) -> float:
    return max(12.0, min(20.0, 6.0 + 1.2 * len(memory["stages"])))


def plot_memory(report_or_dict: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Stacked bars of memory per stage, by category and by layer kind, with the capacity line.

    ``report_or_dict``: a :class:`MemoryReport`, its ``to_dict()`` / estimate ``--json`` output,
    or any result with stages (see :mod:`ndplan.report.data`).
    """
    data = prepare(report_or_dict, simulate_schedule=False, title=title)
    if not data["memory"]:
        raise NdplanError("no per-stage memory in this result to plot")
    memory = data["memory"][0]
    fig = _figure(_memory_width(memory), 6.4)
    _draw_memory(fig, memory, _context(data), bool(data.get("user_limit")))
    return _save(fig, path)


# ------------------------------------------------------------------ step time
def _draw_time(fig: Any, bars: Sequence[Mapping[str, Any]], context: str) -> None:
    ax = fig.subplots()
    y = np.arange(len(bars))
    left = np.zeros(len(bars))
    for key, label, color in style.TIME_SEGMENTS:
        values = np.array([b["segments"].get(key, 0.0) for b in bars])
        if not values.any():
            continue
        ax.barh(y, values, 0.6, left=left, color=color, label=label, edgecolor="white", linewidth=0.5)
        left += values
    for yi, b, total in zip(y, bars, left, strict=True):
        ax.text(total, yi, f"  {b.get('step_s') or total:.3g} s", va="center", fontsize=8)
    ax.set_yticks(y, [b["label"] if len(b["label"]) <= 40 else b["label"][:39] + "…" for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time per training step (s)")
    ax.set_xlim(0, float(left.max()) * 1.15 if left.max() > 0 else 1)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", color="#e6e9ed", linewidth=0.8)
    ax.set_axisbelow(True)
    fig.legend(loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    ax.set_title("Step time breakdown", fontsize=11)
    fig.suptitle(context, fontsize=11.5, fontweight="bold")


def plot_time(perf_or_result: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Horizontal stacked bar(s) of the step time: compute, exposed comm per dimension, bubble, optimizer.

    ``perf_or_result``: a step-time report dict (``step_s``, ``breakdown``), or a result holding
    one (``perf``) or ranked rows with breakdowns (one bar per row, up to 10).
    """
    data = prepare(perf_or_result, simulate_schedule=False, title=title)
    bars = data["perf_bars"]
    if not bars:
        raise NdplanError("no step-time breakdown in this result to plot")
    fig = _figure(10.0, 2.4 + 0.42 * len(bars))
    _draw_time(fig, bars, _context(data))
    return _save(fig, path)


# ------------------------------------------------------------------ timeline
def _draw_timeline(fig: Any, tl: Mapping[str, Any], context: str) -> None:
    ax = fig.subplots()
    vpp = int(tl["vpp"])
    makespan = float(tl["makespan_s"]) or 1.0
    n_ops = sum(len(st["kind"]) for st in tl["stages"])
    label_width = makespan / 70
    for s, st in enumerate(tl["stages"]):
        ax.broken_barh([(0.0, makespan)], (s - 0.42, 0.84), facecolors="#EEF0F3")
        steps = np.asarray(st["step"])
        _, first, counts = np.unique(steps, return_index=True, return_counts=True)
        lanes = dict(zip(steps[first].tolist(), counts.tolist(), strict=True))
        seen: dict[int, int] = {}
        groups: dict[str, list[tuple[float, float, float, float]]] = {}
        for i, (kind, chunk, t0, t1) in enumerate(zip(st["kind"], st["chunk"], st["start_s"], st["end_s"],
                                                       strict=True)):
            n = lanes[st["step"][i]]
            lane = seen.get(st["step"][i], 0)
            seen[st["step"][i]] = lane + 1
            h = 0.84 / n
            y0 = s - 0.42 + lane * h
            groups.setdefault(style.chunk_color(kind, chunk, vpp), []).append((t0, t1 - t0, y0, h))
            if t1 - t0 >= label_width and n_ops <= 3000:
                color = style.chunk_color(kind, chunk, vpp)
                dark = int(color[1:3], 16) * 0.299 + int(color[3:5], 16) * 0.587 + int(color[5:7], 16) * 0.114 < 150
                ax.text((t0 + t1) / 2, y0 + h / 2, str(st["micro_batch"][i]), ha="center", va="center",
                        fontsize=6.5 if n == 1 else 5, color="white" if dark else "#1f2328")
        for color, blocks in groups.items():
            by_lane: dict[tuple[float, float], list[tuple[float, float]]] = {}
            for t0, w, y0, h in blocks:
                by_lane.setdefault((y0, h), []).append((t0, w))
            for (y0, h), spans in by_lane.items():
                ax.broken_barh(spans, (y0, h), facecolors=color, edgecolor="white", linewidth=0.4 if n_ops < 4000 else 0)
    from matplotlib.patches import Patch

    present = {k for st in tl["stages"] for k in st["kind"]}
    handles = [Patch(color=c, label=label) for k, label, c in style.OP_KINDS if k in present]
    if vpp > 1:
        handles.append(Patch(color=style.lighten(style.OP_KINDS[0][2], 0.5), label="lighter: later local chunk"))
    handles.append(Patch(color="#EEF0F3", label="idle"))
    # Below the x-axis label, placed by the constrained layout: an offset in axes units (it was
    # -0.22) grows with the number of stages and left an inch of blank page at pp 16.
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    pp = len(tl["stages"])
    ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)] if pp <= 32 else None)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    seconds = tl.get("unit", "s") == "s"
    ax.set_xlabel("time from the start of the step (s)" if seconds
                  else "time (unit: one micro-batch forward on one chunk)")
    ax.spines[["top", "right"]].set_visible(False)
    runs = int(tl.get("pipeline_runs") or 1)
    # The idle share of every stage's time: the schedule's bubble and the lighter stages' waits
    # for the bottleneck. The step breakdown's bubble is the bottleneck's idle time alone, a
    # share of the step; named "bubble" here too, the two read as one figure that disagrees.
    ax.set_title(f"Pipeline timeline: {tl['schedule']}, pp={tl['pp']}, vpp={vpp}, {tl['num_micro_batches']} "
                 f"micro-batches{f' (one of {runs} runs)' if runs > 1 else ''}; stages idle "
                 f"{100 * tl['bubble_fraction']:.1f}% of pp × makespan",
                 fontsize=11)
    if context:
        fig.suptitle(context, fontsize=11.5, fontweight="bold")


def _is_timeline(obj: Any) -> bool:
    """A ScheduleResult or its dict (stages of op arrays), not a result holding a strategy."""
    if hasattr(obj, "ops") and hasattr(obj, "makespan_s"):
        return True
    if isinstance(obj, Mapping) and "strategy" not in obj:
        stages = obj.get("stages", obj.get("ops"))
        if isinstance(stages, (list, tuple)) and stages:
            first = stages[0]
            if isinstance(first, Mapping):
                return "kind" in first and "start_s" in first
            if isinstance(first, (list, tuple)) and first:
                return isinstance(first[0], Mapping) and "kind" in first[0]
    return False


def plot_timeline(schedule_result: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Gantt chart of a pipeline schedule: stages by time, F/B/W blocks, micro-batch numbers.

    ``schedule_result``: a :class:`ScheduleResult`, its :func:`schedule_to_dict` form, or a
    result (estimate/search) whose schedule is then simulated.
    """
    context = title or ""
    if _is_timeline(schedule_result):
        tl = schedule_to_dict(schedule_result)
        tl.setdefault("unit", str(schedule_result.get("unit", "s")) if isinstance(schedule_result, Mapping) else "s")
    else:
        data = prepare(schedule_result, title=title)
        if data["timeline"] is None:
            raise NdplanError(data["timeline_note"] or "no pipeline schedule in this result to plot")
        tl = data["timeline"]
        context = _context(data)
    pp = len(tl["stages"])
    fig = _figure(12.0, 2.2 + 0.42 * min(pp, 32))
    _draw_timeline(fig, tl, context)
    return _save(fig, path)


# ------------------------------------------------------------------ search
def _draw_pareto(fig: Any, search: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], context: str) -> None:
    ax = fig.subplots()
    x = np.asarray(search["peak_bytes"]) / GIB
    y = np.asarray(search["step_s"])
    limit = search.get("limit_bytes")
    over = x > limit / GIB if limit else np.zeros(len(x), dtype=bool)
    if (~over).any():
        ax.scatter(x[~over], y[~over], s=5, color=style.CANDIDATE_COLOR, alpha=0.4, linewidths=0,
                   label="candidate that fits", rasterized=len(x) > 2000)
    if over.any():
        ax.scatter(x[over], y[over], s=5, color=style.INFEASIBLE_COLOR, alpha=0.5, linewidths=0,
                   label="candidate over the limit", rasterized=len(x) > 2000)
    fx = np.asarray(search["front_peak_bytes"]) / GIB
    fy = np.asarray(search["front_step_s"])
    if len(fx):
        ax.step(fx, fy, where="post", color=style.PARETO_COLOR, linewidth=1.6)
        ax.scatter(fx, fy, s=16, color=style.PARETO_COLOR, edgecolors="white", linewidths=0.5, zorder=3,
                   label=f"Pareto front ({len(fx)} points, exact)")
    _label_top(ax, search)
    if limit:
        ax.axvline(limit / GIB, color=style.CAPACITY_COLOR, linestyle="--", linewidth=1.6,
                   label=f"memory limit ({limit / GIB:,.1f} GiB)")
    from matplotlib.ticker import LogFormatter

    # Log axes labelled 400 and 20, not 4×10² and 2×10¹ (the same ticks, in plain numbers).
    if search["logx"]:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    if search["logy"]:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    ax.set_xlabel("peak memory per device, worst stage (GiB)")
    ax.set_ylabel("step time (s)")
    fit = f", {search['n_feasible']:,} fit" if search["n_feasible"] is not None else ""
    ax.set_title(f"Step time vs peak memory: {search['n_shown']:,} drawn of {search['n_total']:,} evaluated{fit}",
                 fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(color="#e6e9ed", linewidth=0.8)
    ax.set_axisbelow(True)
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False, markerscale=2)
    if context:
        fig.suptitle(context, fontsize=11.5, fontweight="bold")


def _label_top(ax: Any, search: Mapping[str, Any]) -> None:
    """Ring the top-ranked points; label one per neighbourhood (the best rank, with the others named)."""
    top = search["top"]
    if not top:
        return
    x = np.array([t["peak_bytes"] / GIB for t in top])
    y = np.array([t["step_s"] for t in top])
    ax.scatter(x, y, s=70, facecolors="none", edgecolors=style.TOP_COLOR, linewidths=1.4, zorder=4,
               label="top-ranked (#rank)")
    span = []
    for values, log in ((np.concatenate([x, np.asarray(search["peak_bytes"]) / GIB]), search["logx"]),
                        (np.concatenate([y, np.asarray(search["step_s"])]), search["logy"])):
        values = np.log10(values[values > 0]) if log else values
        span.append(float(values.max() - values.min()) or 1.0)
    groups: list[list[int]] = []
    for i in range(len(top)):
        px = np.log10(x[i]) if search["logx"] else x[i]
        py = np.log10(y[i]) if search["logy"] else y[i]
        for group in groups:
            j = group[0]
            qx = np.log10(x[j]) if search["logx"] else x[j]
            qy = np.log10(y[j]) if search["logy"] else y[j]
            if abs(px - qx) < 0.03 * span[0] and abs(py - qy) < 0.03 * span[1]:
                group.append(i)
                break
        else:
            groups.append([i])
    for group in groups:
        first = top[group[0]]
        rest = [f"#{top[i]['rank']}" for i in group[1:]]
        text = f"#{first['rank']}" + ((f" ({' '.join(rest)})" if len(rest) <= 3 else f" (+{len(rest)} more)")
                                      if rest else "")
        ax.annotate(text, (x[group[0]], y[group[0]]), xytext=(6, 6), textcoords="offset points", fontsize=8,
                    fontweight="bold")


def plot_pareto(
    result_or_candidates: Any, path: str | Path, *, pareto: Any = None, limit_bytes: float | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None, max_points: int = 20000, title: str | None = None,
) -> Path:
    """Scatter of step time vs peak memory of all candidates, the Pareto front and the memory limit.

    ``result_or_candidates``: a search result (``candidates``, ``pareto``, ``rows``, limit), or
    the candidates alone (``{"step_s", "peak_bytes"}``, ``(step_s, peak_bytes)`` pairs or an
    ``[n, 2]`` array) with ``pareto``, ``limit_bytes`` and ``rows`` given here. Candidates past
    ``max_points`` are thinned on a grid; the Pareto front is drawn exactly.
    """
    if isinstance(result_or_candidates, Mapping) and any(k in result_or_candidates for k in CANDIDATE_KEYS):
        result = dict(result_or_candidates)
    else:
        result = {"candidates": result_or_candidates}
    if pareto is not None:
        result["pareto"] = pareto
    if limit_bytes is not None:
        result["memory_limit_bytes"] = limit_bytes
    if rows is not None:
        result["rows"] = list(rows)
    data = prepare(result, max_points=max_points, simulate_schedule=False, title=title)
    if data["search"] is None:
        raise NdplanError("no candidates in this result to plot")
    fig = _figure(10.0, 6.4)
    _draw_pareto(fig, data["search"], data["rows"], _context(data) if title or result.get("model") else "")
    return _save(fig, path)


# ------------------------------------------------------------------ all of them
def write_plots(result: Any, directory: str | Path, *, fmt: str = "png", top: int = 50,
                max_points: int = 20000) -> list[Path]:
    """Every figure the result supports, as ``memory.<fmt>``, ``time``, ``timeline``, ``pareto``.

    A memory source other than the result's own stages (``baseline``, ``balanced``, ...) is
    written as ``memory-<name>.<fmt>``. Returns the paths written.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():  # mkdir said only "File exists"
        raise NdplanError(f"{out}: not a folder; the figures are written into one (give a new or existing folder)")
    out.mkdir(parents=True, exist_ok=True)
    data = prepare(result, top=top, max_points=max_points)
    written: list[Path] = []
    context = _context(data)
    for memory in data["memory"]:
        name = "memory" if not memory["name"] else "memory-" + "".join(
            c if c.isalnum() else "-" for c in memory["name"]).strip("-")
        fig = _figure(_memory_width(memory), 6.4)
        _draw_memory(fig, memory, context + (f" ({memory['name']})" if memory["name"] else ""),
                     bool(data.get("user_limit")))
        written.append(_save(fig, out / f"{name}.{fmt}"))
    if data["perf_bars"]:
        fig = _figure(10.0, 2.4 + 0.42 * len(data["perf_bars"]))
        _draw_time(fig, data["perf_bars"], context)
        written.append(_save(fig, out / f"time.{fmt}"))
    if data["timeline"] is not None:
        pp = len(data["timeline"]["stages"])
        fig = _figure(12.0, 2.2 + 0.42 * min(pp, 32))
        _draw_timeline(fig, data["timeline"], context)
        written.append(_save(fig, out / f"timeline.{fmt}"))
    if data["search"] is not None:
        fig = _figure(10.0, 6.4)
        _draw_pareto(fig, data["search"], data["rows"], context)
        written.append(_save(fig, out / f"pareto.{fmt}"))
    return written

