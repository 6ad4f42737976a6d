"""``write_html``: one self-contained HTML file with every figure of a plan.

No network at view time: the stylesheet, the script and the data are inlined, and a
Content-Security-Policy (``default-src 'none'``) makes the browser refuse anything else. Every
string from the result is escaped (``html.escape`` in markup; the JSON data block has ``<``,
``>`` and ``&`` as ``\\u`` escapes; the script writes text with ``textContent`` only).
"""

from __future__ import annotations

import html
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ndplan.report import style
from ndplan.report.assets import CSS, JS
from ndplan.report.data import ROW_HIDDEN, ROW_PRIORITY, as_dict, jsonable, prepare, row_peak, strategy_short

GIB = style.GIB
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
       "base-uri 'none'; form-action 'none'")


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _gib(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value / GIB, digits)


def _sig(value: float, digits: int = 5) -> float:
    return float(f"{value:.{digits}g}") if math.isfinite(value) else 0.0


def fmt_gib(value: float | None) -> str:
    return "–" if value is None else f"{value / GIB:,.2f} GiB"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 100:
        return f"{value:,.0f} s"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"


def fmt_rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:,.2f}M tok/s"
    return f"{value:,.0f} tok/s"


def fmt_number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.4g}"


# ------------------------------------------------------------------ chart specs
def memory_specs(memory: Mapping[str, Any], title_suffix: str = "") -> list[dict[str, Any]]:
    """Two stacked-bar specs (by category, by layer kind) for one memory source."""
    stages = memory["stages"]
    capacity = memory.get("capacity_bytes")
    hline = None
    if capacity:
        hline = {"value": _gib(capacity), "label": f"device capacity {capacity / GIB:,.2f} GiB",
                 "legend": "device capacity", "color": style.CAPACITY_COLOR}
    marks = [
        {"key": "allocated", "label": "allocated peak", "color": style.ALLOCATED_COLOR},
        {"key": "reserved", "label": "reserved peak (allocator)", "color": style.RESERVED_COLOR, "dash": "4 3"},
    ]
    bars_cat, bars_kind = [], []
    for st in stages:
        label = f"stage {st['stage']}"
        sub = f"{st['layers']} layers" if st.get("layers") is not None else None
        mk = {"allocated": _gib(st.get("allocated_bytes")), "reserved": _gib(st.get("reserved_bytes"))}
        bars_cat.append({"label": label, "sub": sub, "marks": mk,
                         "values": {k: _gib(v) for k, v in st["categories"].items()}})
        bars_kind.append({"label": label, "sub": sub, "marks": mk,
                          "values": {k: _gib(v) for k, v in st["kinds"].items()}})
    common = {"type": "stacked", "ylabel": "memory per device (GiB)", "xlabel": "pipeline stage", "unit": "GiB",
              "marks": marks, "hline": hline}
    specs = [{**common, "title": f"Memory per stage by category{title_suffix}",
              "series": [{"key": k, "label": label, "color": c} for k, label, c in style.MEMORY_CATEGORIES],
              "bars": bars_cat,
              "note": "Each bar stacks to the stage's device peak. Solid black tick: allocated peak "
                      "(what tensors hold); dashed tick: reserved by the caching allocator."
              if any(st.get("allocated_bytes") for st in stages) else
              "Peak per stage as the result gives it (no breakdown by category)."}]
    if any(set(st["kinds"]) - {"unbroken"} for st in stages):
        specs.append({**common, "title": f"Memory per stage by layer kind{title_suffix}",
                      "series": [{"key": k, "label": label, "color": c} for k, label, c in style.LAYER_KINDS],
                      "bars": bars_kind,
                      "note": "Parameters, gradients, optimizer states and activations of each layer kind; "
                              "buffers, optimizer-step temporaries and overhead on top as in the category chart."})
    return specs


def time_spec(bars: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "type": "hstacked", "title": "Step time breakdown", "xlabel": "time per training step (s)", "unit": "s",
        "series": [{"key": k, "label": label, "color": c} for k, label, c in style.TIME_SEGMENTS],
        "bars": [{"label": b["label"], "values": {k: _sig(v) for k, v in b["segments"].items()},
                  "step": _sig(b["step_s"]) if b.get("step_s") else None} for b in bars],
        "note": "Exposed communication is the part not hidden behind compute, per parallel dimension; "
                "the bar's end is the step time.",
    }


def timeline_spec(tl: Mapping[str, Any]) -> dict[str, Any]:
    makespan = float(tl["makespan_s"]) or 1.0
    decimals = max(0, 6 - math.floor(math.log10(makespan)))
    vpp = int(tl["vpp"])
    kinds = [k for k, _, _ in style.OP_KINDS]
    rows = []
    for s, st in enumerate(tl["stages"]):
        steps = np.asarray(st["step"], dtype=np.int64)
        row: dict[str, Any] = {
            "label": f"stage {s}",
            "k": [kinds.index(k) for k in st["kind"]],
            "mb": st["micro_batch"],
            "c": st["chunk"],
            "t0": [round(t, decimals) for t in st["start_s"]],
            "t1": [round(t, decimals) for t in st["end_s"]],
        }
        if len(steps) and len(np.unique(steps)) < len(steps):
            _, first, counts = np.unique(steps, return_index=True, return_counts=True)
            lanes = np.repeat(counts, counts)
            starts = np.repeat(first, counts)
            row["lane"] = (np.arange(len(steps)) - starts).tolist()
            row["lanes"] = lanes.tolist()
        if any(st["seq_chunk"]):
            row["q"] = st["seq_chunk"]
        rows.append(row)
    present = {k for st in tl["stages"] for k in st["kind"]}
    legend = [{"label": label, "color": c} for k, label, c in style.OP_KINDS if k in present]
    if vpp > 1:
        legend.append({"label": f"lighter shade: later local chunk (0…{vpp - 1})",
                       "color": style.lighten(style.OP_KINDS[0][2], 0.5)})
    legend.append({"label": "idle", "color": "#EEF0F3"})
    seconds = tl.get("unit", "s") == "s"
    unit = "s" if seconds else "× forward"
    xlabel = "time from the start of the step (s)" if seconds else \
        "time (unit: one micro-batch forward on one chunk)"
    ratios = "F:B:W = 1:1:1" if tl["schedule"] in ("zb-h1", "zbv", "dualpipev") else "F:B = 1:2"
    how = {
        "chunks": "simulated with the step-time model's forward, backward, weight-gradient and p2p times "
                  "of every stage's chunks, as its step time was"
                  + ("; the runtime waits for its sends, so each pass that sends on holds its transfer"
                     if tl.get("sends_waited") else ""),
        "durations": "simulated with the step-time model's forward, backward, weight-gradient and p2p times "
                     "of the bottleneck stage",
        "scaled": f"simulated with {ratios}, scaled so the busiest stage computes as long as the step-time model says",
        "ratios": f"simulated with {ratios} (no step-time model in this result)",
    }.get(str(tl.get("how")), "timeline as given in the result")
    return {
        "type": "gantt",
        "title": f"Pipeline timeline: {tl['schedule']}, pp={tl['pp']}, vpp={vpp}, "
                 f"{tl['num_micro_batches']} micro-batches"
                 + (f" (one of the step's {tl['pipeline_runs']} runs)" if int(tl.get("pipeline_runs") or 1) > 1 else ""),
        "xlabel": xlabel, "unit": unit, "makespan": round(makespan, decimals), "vpp": vpp, "kinds": kinds,
        "colors": [[style.chunk_color(k, c, vpp) for c in range(vpp)] for k in kinds],
        "rows": rows, "legend": legend,
        "note": f"Stages idle {100 * tl['bubble_fraction']:.1f}% of pp × makespan (the schedule's bubble and the "
                "lighter stages' waits for the slowest; the step breakdown's bubble is the slowest stage's idle "
                f"time alone); {how}. "
                "Numbers in blocks are micro-batch indices; hover a block for its op.",
    }


def scatter_spec(search: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    labels = {int(r.get("rank", i + 1)): strategy_short(r) for i, r in enumerate(rows)}
    limit = search.get("limit_bytes")
    if search["n_given"]:
        note = f"{search['n_shown']:,} of {search['n_given']:,} candidates drawn"
        if search["n_given"] < search["n_total"]:
            note += f" (the result saved {search['n_given']:,} of the {search['n_total']:,} evaluated)"
        note += " (thinned on a grid, keeping each cell's fastest; every Pareto point exact)."
    else:
        note = ("This result carries no candidate cloud: only its Pareto points and ranked strategies are drawn "
                f"({search['n_total']:,} candidates were evaluated).")
    if search["n_feasible"] is not None:
        note += f" {search['n_feasible']:,} fit in memory."
    if search["n_dropped"]:
        note += f" {search['n_dropped']:,} without a finite step time or peak are left out."
    return {
        "type": "scatter",
        "title": "Step time vs peak memory of every evaluated candidate",
        "xlabel": "peak memory per device, worst stage (GiB)" + (" — log scale" if search["logx"] else ""),
        "ylabel": "step time (s)" + (" — log scale" if search["logy"] else ""),
        "x": [_sig(v / GIB, 4) for v in search["peak_bytes"].tolist()],
        "y": [_sig(v, 4) for v in search["step_s"].tolist()],
        "fx": [float(v) / GIB for v in np.asarray(search["front_peak_bytes"]).tolist()],
        "fy": [float(v) for v in np.asarray(search["front_step_s"]).tolist()],
        "top": [{"rank": t["rank"], "x": t["peak_bytes"] / GIB, "y": t["step_s"], "label": labels.get(t["rank"], "")}
                for t in search["top"]],
        "limit": limit / GIB if limit else None,
        "limit_label": f"memory limit {limit / GIB:,.2f} GiB" if limit else "",
        "logx": search["logx"], "logy": search["logy"],
        "colors": {"candidate": style.CANDIDATE_COLOR, "infeasible": style.INFEASIBLE_COLOR,
                   "pareto": style.PARETO_COLOR, "top": style.TOP_COLOR, "limit": style.CAPACITY_COLOR},
        "note": note,
    }


# ------------------------------------------------------------------ tables
_LABELS = {
    "rank": "#", "micro_batch_size": "mbs", "num_micro_batches": "micro-batches", "seq_length": "seq",
    "tokens_per_s": "tokens/s", "tokens_per_s_per_device": "tokens/s/device", "mfu": "MFU", "hfu": "HFU",
    "step_s": "step (s)", "peak_bytes": "peak (GiB)", "sequence_parallel": "sp", "global_batch_size": "gbs",
    # search's fraction of the device a caveat asks to leave free (memory.report.headroom)
    "headroom": "headroom to leave",
}


def column_label(key: str, sample: Any = None) -> str:
    if key in _LABELS:
        return _LABELS[key]
    if key.endswith("_bytes") or ("bytes" in key and isinstance(sample, list)):
        return key.replace("_bytes", "").replace("_", " ") + " (GiB)"
    if key.endswith("_s"):
        return key[:-2].replace("_", " ") + " (s)"
    return key.replace("_", " ")


def _key(number: float) -> str:
    """A sort key: integers without a fraction, floats exactly."""
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e15 else repr(float(number))


def cell(key: str, value: Any) -> tuple[str, str, str]:
    """(display text, sort value, title) of one table cell; all unescaped."""
    if value is None:
        return "–", "", ""
    if isinstance(value, bool):
        return ("yes" if value else "no"), str(int(value)), ""
    if isinstance(value, list):
        numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if "bytes" in key and numbers and len(numbers) == len(value):
            per_stage = " / ".join(f"{v / GIB:.2f}" for v in numbers)
            return f"{max(numbers) / GIB:,.2f}", _key(max(numbers)), f"per stage (GiB): {per_stage}"
        return ", ".join(str(v) for v in value), "", ""
    if isinstance(value, (int, float)):
        number = float(value)
        if not math.isfinite(number):
            return "–", "", ""
        if key.endswith("_bytes") and abs(number) < 1024:  # a width per element (precision.param_bytes)
            return f"{number:g} B", _key(number), ""
        if key.endswith("_bytes"):
            return f"{number / GIB:,.2f}", _key(number), f"{number:,.0f} bytes"
        if key.startswith("tokens"):
            return f"{number:,.0f}", _key(number), ""
        if key.endswith("_s"):
            text = f"{number:,.1f}" if abs(number) >= 100 else f"{number:.3f}" if abs(number) >= 1 else f"{number:.4g}"
            return text, _key(number), ""
        if key == "headroom":  # a fraction of the device, as `ndplan search` prints it
            return f"{100 * number:.0f}%", _key(number), ""
        if key in ("mfu", "hfu") or key.endswith("_fraction"):
            return (f"{100 * number:.1f}%" if abs(number) <= 1.5 else f"{number:.4g}"), _key(number), ""
        return fmt_number(number), _key(number), ""
    return str(value), str(value), ""


def _table(headers: Sequence[tuple[str, str]], rows: Sequence[Sequence[tuple[str, str, str, str]]],
           *, sortable: bool, row_classes: Sequence[str] | None = None, table_id: str = "", caption: str = "") -> str:
    """headers: (label, class); cells: (display, sort value, title, class)."""
    out = [f'<table class="ndp{" sortable" if sortable else ""}"{f" id={chr(34)}{esc(table_id)}{chr(34)}" if table_id else ""}>',
           *([f"<caption>{esc(caption)}</caption>"] if caption else []), "<thead><tr>"]
    out += [f'<th class="{esc(cls)}" scope="col">{esc(label)}</th>' for label, cls in headers]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        cls = row_classes[i] if row_classes else ""
        out.append(f'<tr class="{esc(cls)}">' if cls else "<tr>")
        for display, sort_value, title, c in row:
            attrs = f' data-v="{esc(sort_value)}"' if sort_value != "" else ""
            attrs += f' title="{esc(title)}"' if title else ""
            attrs += f' class="{esc(c)}"' if c else ""
            out.append(f"<td{attrs}>{esc(display)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def stage_table(memory: Mapping[str, Any]) -> str:
    cap = memory.get("capacity_bytes")
    keys = ["params", "grads", "optimizer", "activations", "comm", "transient"]
    has_breakdown = any(st["categories"].keys() - {"unbroken"} for st in memory["stages"])
    headers = [("stage", ""), ("layers", "")]
    if has_breakdown:
        headers += [(k, "") for k in keys] + [("allocated", ""), ("reserved", "")]
    headers.append(("peak", ""))
    if cap:
        headers.append(("of capacity", ""))
    host = any(st.get("host_bytes") for st in memory["stages"])
    if host:
        headers.append(("host (offload)", ""))
    peak_max = max((st["peak_bytes"] for st in memory["stages"]), default=0.0)
    rows, classes = [], []
    for st in memory["stages"]:
        row = [(str(st["stage"]), str(st["stage"]), "", ""), (str(st.get("layers") or "–"), "", "", "")]

        def gib(v: float | None) -> tuple[str, str, str, str]:
            return (fmt_gib(v), repr(v) if v is not None else "", f"{v:,.0f} bytes" if v is not None else "", "")

        if has_breakdown:
            row += [gib(st["categories"].get(k, 0.0)) for k in keys]
            row += [gib(st.get("allocated_bytes")), gib(st.get("reserved_bytes"))]
        row.append(gib(st["peak_bytes"]))
        if cap:
            row.append((f"{100 * st['peak_bytes'] / cap:.1f}%", repr(st["peak_bytes"] / cap), "", "m"))
        if host:
            row.append(gib(st.get("host_bytes")))
        rows.append(row)
        cls = "peak" if st["peak_bytes"] == peak_max else ""
        if cap and st["peak_bytes"] > cap:
            cls += " over"
        classes.append(cls.strip())
    # where a result has several memory sources (balanced and as given), which one this is
    return _table(headers, rows, sortable=False, row_classes=classes, caption=str(memory.get("name") or ""))


def rows_table(rows: Sequence[Mapping[str, Any]], limit: float | None) -> tuple[str, str]:
    """The ranked rows as a sortable table, and a line naming the columns equal in every row."""
    keys: list[str] = []
    for row in rows:
        for key in row:
            if key not in keys and key not in ROW_HIDDEN:
                keys.append(key)
    ordered = [k for k in ROW_PRIORITY if k in keys]
    ordered += [k for k in keys if k not in ordered and k != "candidate"]
    ordered += ["candidate"] if "candidate" in keys else []
    always = {"rank", "peak_bytes", "step_s", "tokens_per_s", "mfu"}
    nested = {k for row in rows for k in row.get("_nested", [])}
    ordered = [k for k in ordered if k != "_nested"]
    constant = []
    if len(rows) > 1:
        for key in list(ordered):
            values = [json.dumps(row.get(key), sort_keys=True) for row in rows]
            if key in always or "peak" in key or len(set(values)) > 1:
                continue
            ordered.remove(key)
            value = rows[0].get(key)
            if key not in nested and value not in (None, 0, 0.0, False, "none", "") and value != []:
                constant.append(f"{column_label(key)}={cell(key, value)[0]}")
    headers = [(column_label(k, rows[0].get(k) if rows else None),
                "t" if rows and isinstance(rows[0].get(k), str) else "") for k in ordered]
    body, classes = [], []
    for row in rows:
        cells = []
        for k in ordered:
            display, sort_value, title = cell(k, row.get(k))
            cells.append((display, sort_value, title, "t" if isinstance(row.get(k), str) else ""))
        body.append(cells)
        peak = row_peak(row)
        classes.append("over" if limit and peak and peak > limit else "")
    return _table(headers, body, sortable=True, row_classes=classes, table_id="ndp-top"), ", ".join(constant)


def kv_table(items: Mapping[str, Any]) -> str:
    out = ['<table class="kv">']
    for key, value in items.items():
        if value is None or value == {}:
            continue
        text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        if key.endswith("_bytes") and isinstance(value, (int, float)) and not isinstance(value, bool):
            # A total in GiB beside its bytes; a per-element width (precision.param_bytes 2) as bytes.
            text = f"{value:,.0f} ({value / GIB:,.2f} GiB)" if value >= 1024 else f"{value:g} B"
        elif key.endswith(("_s", "_seconds")) and isinstance(value, (int, float)) and not isinstance(value, bool):
            text = f"{value:g} s"  # a balance's estimated_step_s, solve_seconds
        out.append(f"<tr><th>{esc(key)}</th><td>{esc(text)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _flat_strategy(strategy: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in strategy.items():
        if isinstance(value, Mapping):
            for sub, item in value.items():
                flat[f"{key}.{sub}"] = item
        else:
            flat[key] = value
    return flat


# ------------------------------------------------------------------ reproduce
_FLAGS = {
    "dp": "--dp", "tp": "--tp", "pp": "--pp", "cp": "--cp", "cp_kind": "--cp-kind", "ulysses_degree": "--ulysses-degree",
    "ep": "--ep", "etp": "--etp", "vpp": "--vpp", "schedule": "--schedule", "seq_chunks": "--seq-chunks",
    "zero": "--zero", "shard_group": "--shard-group", "recompute": "--recompute", "recompute_layers": "--recompute-layers",
    "offload_layers": "--offload-layers", "optimizer_offload_fraction": "--optimizer-offload-fraction",
    "micro_batch_size": "--mbs", "num_micro_batches": "--num-micro-batches", "pipeline_runs": "--pipeline-runs",
    "global_batch_size": "--gbs", "seq_length": "--seq",
}
_ALWAYS = {"dp", "tp", "pp", "micro_batch_size", "num_micro_batches", "seq_length"}


def reproduce_command(inputs: Mapping[str, Any]) -> tuple[str, list[str]]:
    """An `ndplan estimate` command line for these inputs, and what it cannot carry."""
    strategy = inputs.get("strategy") or {}
    defaults: dict[str, Any] = {}
    try:
        from ndplan.strategy import Strategy

        defaults = {k: f.default for k, f in Strategy.model_fields.items()}
    except Exception:  # pragma: no cover - the reproduce line is a courtesy, never a failure
        defaults = {}
    args = ["ndplan", "estimate"]
    for key, flag in (("model", "--model"), ("hardware", "--hardware"), ("efficiency", "--efficiency"),
                      ("devices", "--devices")):
        if inputs.get(key) is not None:
            args += [flag, str(inputs[key])]
    missing: list[str] = []
    for key, value in strategy.items():
        default = defaults.get(key, object())
        if key in _FLAGS:
            if key in _ALWAYS or value != default:
                args += [_FLAGS[key], str(value)]
        elif key == "sequence_parallel":
            if value:
                args.append("--sp")
        elif key == "fsdp":
            if value:
                args.append("--fsdp")
        elif key == "optimizer_offload":
            if value:
                args.append("--optimizer-offload")
        elif key == "offload_optimizer_states":
            if value:
                args.append("--offload-optimizer-states")
        elif key == "reshard_after_forward":
            if value is False:
                args.append("--no-reshard")
        elif key == "stage_layers":
            if value:
                args += ["--stage-layers", ",".join(str(v) for v in value)]
        elif key == "recompute_modules":
            if value:
                args += ["--recompute-modules", *(str(v) for v in value)]
        elif key == "offload_modules":
            if value:
                args += ["--offload-modules", *(str(v) for v in value)]
        elif key == "precision":
            name = value.get("name") if isinstance(value, Mapping) else value
            default_name = getattr(default, "name", None)
            if name and name != default_name:
                args += ["--precision", str(name)]
        elif value != default:
            missing.append(f"{key}={value}")
    if inputs.get("runtime") not in (None, "pytorch"):
        args += ["--runtime", str(inputs["runtime"])]
    if inputs.get("attention") not in (None, "flash"):
        args += ["--attention", str(inputs["attention"])]
    if inputs.get("include_overhead") is False:
        args.append("--no-overhead")
    if inputs.get("loss_parallel") is not None:
        args.append("--loss-parallel" if inputs["loss_parallel"] else "--no-loss-parallel")
    if inputs.get("loss_upcast") is False:
        args.append("--no-loss-upcast")
    if inputs.get("moe_imbalance") not in (None, 1, 1.0):
        args += ["--moe-imbalance", str(inputs["moe_imbalance"])]
    if inputs.get("moe_capacity_factor") is not None:
        args += ["--moe-capacity-factor", str(inputs["moe_capacity_factor"])]
    if inputs.get("selective_policy") is not None:
        args += ["--selective-policy", str(inputs["selective_policy"])]
    if inputs.get("modules") not in (None, "eager"):
        args += ["--modules", str(inputs["modules"])]
    if inputs.get("experts_outside_fsdp"):
        args.append("--experts-outside-fsdp")
    if inputs.get("gradient_accumulation_fusion") is not None:
        args.append("--gradient-accumulation-fusion" if inputs["gradient_accumulation_fusion"]
                    else "--no-gradient-accumulation-fusion")
    overlap = inputs.get("overlap")
    if isinstance(overlap, Mapping):  # every switch as priced, whatever the runtime's defaults
        args += ["--overlap", ",".join(f"{key}={_overlap_word(key, value)}" for key, value in overlap.items())]
    if inputs.get("census_records"):
        missing.append(f"a census of {inputs['census_records']} records (give it with --census FILE)")
    return " ".join(shlex.quote(a) for a in args), missing


def _overlap_word(key: str, value: Any) -> str:
    """An overlap switch's value as ``--overlap`` reads it back (``perf.overlap.parse_overlap``)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none" if key == "ep_node_limit" else "auto"
    return str(value)


# ------------------------------------------------------------------ page
def _kpi(label: str, value: str, detail: str = "", cls: str = "") -> str:
    return (f'<div class="kpi"><div class="k">{esc(label)}</div><div class="v {esc(cls)}">{esc(value)}</div>'
            + (f'<div class="d">{esc(detail)}</div>' if detail else "") + "</div>")


def _section(sid: str, title: str, how: str, body: str) -> str:
    return (f'<section class="card" id="{esc(sid)}"><h2>{esc(title)}</h2>'
            + (f'<p class="how">{esc(how)}</p>' if how else "") + body + "</section>")


def _chart(cid: str) -> str:
    return f'<div class="ndp-chart" id="{esc(cid)}" data-spec="{esc(cid)}"></div>'


def render_html(result: Any, *, top: int = 50, max_points: int = 4000, title: str | None = None) -> str:
    """The report of one result as an HTML string (see :func:`write_html`)."""
    d = prepare(result, top=top, max_points=max_points, title=title)
    charts: dict[str, Any] = {}
    sections: list[tuple[str, str, str]] = []  # (id, nav label, html)
    kpis: list[tuple[str, str]] = []  # (group, html)

    limit = d["limit_bytes"]
    perf = d["perf"]
    if d["memory"]:
        first = d["memory"][0]
        peak = max(first["stages"], key=lambda s: s["peak_bytes"])
        cap = first.get("capacity_bytes")
        detail = f"stage {peak['stage']} of {len(first['stages'])}"
        kpis.append(("memory", _kpi("peak memory" + (f" of {first['name']}" if first["name"] else ""),
                         fmt_gib(peak["peak_bytes"]), detail)))
        if cap:
            margin = cap - peak["peak_bytes"]
            kpis.append(("memory", _kpi("fits: headroom" if margin >= 0 else "does not fit: over by",
                                        fmt_gib(abs(margin)),
                                        f"of {fmt_gib(cap)} {'memory limit' if d['user_limit'] else 'device memory'}",
                                        "ok" if margin >= 0 else "bad")))
        host = max(first["stages"], key=lambda s: s.get("host_bytes") or 0.0)
        host_bytes, host_cap = host.get("host_bytes") or 0.0, first.get("host_capacity_bytes")
        if host_bytes:
            kpis.append(("memory", _kpi(
                "pinned host memory (offload)", fmt_gib(host_bytes),
                f"stage {host['stage']}; " + (f"of its {fmt_gib(host_cap)} share of the node's"
                                              if host_cap else "the device states no host memory"),
                ("ok" if host_bytes <= host_cap else "bad") if host_cap else "")))
    if perf:
        if perf.get("step_s") is not None:
            kpis.append(("perf", _kpi("step time", fmt_seconds(perf.get("step_s")))))
        if perf.get("tokens_per_s") is not None:
            per_dev = perf.get("tokens_per_s_per_device")
            kpis.append(("perf", _kpi("throughput", fmt_rate(perf["tokens_per_s"]),
                                      f"{per_dev:,.0f} tok/s per device" if per_dev is not None else "")))
        if perf.get("mfu") is not None:
            hfu = perf.get("hfu")
            kpis.append(("perf", _kpi("MFU", f"{100 * perf['mfu']:.1f}%", f"HFU {100 * hfu:.1f}%" if hfu is not None else "")))
    if d["timeline"] is not None:
        # Idle share of all stages' time in the simulated schedule, not the step breakdown's bubble
        # (the critical path's idle time, a share of the whole step): the two differ, so say which.
        kpis.append(("timeline", _kpi("pipeline idle", f"{100 * d['timeline']['bubble_fraction']:.1f}%",
                                      f"of pp × makespan; {d['timeline']['schedule']}, "
                                      f"{d['timeline']['num_micro_batches']} micro-batches")))
    search = d["search"]
    if search is not None:
        kpis.append(("search", _kpi("candidates evaluated", f"{search['n_total']:,}",
                                    f"{search['n_feasible']:,} fit in memory" if search["n_feasible"] is not None else "")))
        kpis.append(("search", _kpi("Pareto front", f"{len(search['front_step_s']):,} points",
                                    "step time vs peak memory")))
    if d["rows"]:
        best = d["rows"][0]
        if best.get("step_s") is not None:
            kpis.append(("best", _kpi("best step time", fmt_seconds(best["step_s"]), "#1: " + strategy_short(best))))
        if best.get("tokens_per_s") is not None:
            kpis.append(("best", _kpi("best throughput", fmt_rate(best["tokens_per_s"]))))
        if best.get("mfu") is not None:
            kpis.append(("best", _kpi("best MFU", f"{100 * best['mfu']:.1f}%")))

    # memory
    parts = []
    for i, mem in enumerate(d["memory"]):
        suffix = f" — {mem['name']}" if mem["name"] else ""
        for j, spec in enumerate(memory_specs(mem, suffix)):
            cid = f"chart-memory-{i}-{j}"
            charts[cid] = spec
            parts.append(_chart(cid))
        parts.append('<div class="scroll" style="max-height:none">' + stage_table(mem) + "</div>")
    if parts:
        sections.append(("memory", "Memory", _section(
            "memory", "Memory per pipeline stage",
            "Peak memory of one device in each pipeline stage (every device of a stage holds the same). "
            "A stage fits when its bar stays under the red capacity line. Hover a segment for its size.",
            "".join(parts))))

    # step time
    if d["perf_bars"]:
        charts["chart-time"] = time_spec(d["perf_bars"])
        body = _chart("chart-time")
        sections.append(("time", "Step time", _section(
            "time", "Step time", "Where one training step's time goes on the critical device.", body)))

    # timeline
    if d["timeline"] is not None:
        charts["chart-timeline"] = timeline_spec(d["timeline"])
        sections.append(("timeline", "Pipeline", _section(
            "timeline", "Pipeline schedule timeline",
            f"{d['timeline']['label']}: each row is a pipeline stage, each block one op of one micro-batch. "
            "Grey gaps are the bubble: time a stage waits for its neighbours.",
            _chart("chart-timeline"))))
    elif d["timeline_note"]:
        sections.append(("timeline", "Pipeline", _section("timeline", "Pipeline schedule timeline",
                                                          d["timeline_note"], "")))

    # search
    if search is not None or d["rows"]:
        body = ""
        if search is not None:
            charts["chart-pareto"] = scatter_spec(search, d["rows"])
            body += _chart("chart-pareto")
        if d["rows"]:
            table, constant = rows_table(d["rows"], limit)
            shown = f"top {len(d['rows'])} of {d['n_rows_total']} ranked" if d["n_rows_total"] > len(d["rows"]) \
                else f"{len(d['rows'])} ranked"
            body += f"<h3>Ranked strategies ({esc(shown)}; click a column header to sort)</h3>"
            if constant:
                body += f'<p class="ndp-note">Same in every row: {esc(constant)}</p>'
            body += f'<div class="scroll">{table}</div>'
        sections.append(("search", "Search", _section(
            "search", "Strategy search",
            "Every evaluated strategy as step time against peak memory. The Pareto front joins the "
            "strategies no other beats in both; left of the red line they fit on the device.", body)))

    # inputs
    inputs = d["inputs"]
    body = '<div class="cols"><div><h3>Run</h3>' + kv_table({
        "model": inputs["model"], "hardware": inputs["hardware"], "devices": inputs["devices"],
        "runtime profile": inputs["runtime"], "attention kernel": inputs["attention"], "report kind": d["kind"],
        "ndplan version": d["version"], "generated": d["generated"], "python": d["python"],
        **{k: v for k, v in d["result_scalars"].items() if k not in ("peak_bytes", "peak_stage", "fits", "kind")},
    }) + "</div>"
    if inputs["strategy"]:
        body += "<div><h3>Strategy</h3>" + kv_table(_flat_strategy(inputs["strategy"])) + "</div>"
    for key, value in d["result_settings"].items():
        body += f"<div><h3>{esc(key)}</h3>" + kv_table(_flat_strategy(value)) + "</div>"
    for key in ("model_detail", "hardware_detail"):
        if d[key]:
            body += f"<div><h3>{esc(key.split('_')[0])}</h3>" + kv_table(_flat_strategy(d[key])) + "</div>"
    body += "</div>"
    if inputs["strategy"] and inputs["model"] and inputs["hardware"]:
        command, missing = reproduce_command(inputs)
        body += f"<h3>Reproduce (ndplan {esc(d['version'])})</h3><pre class=\"cmd\">{esc(command)}</pre>"
        if missing:
            body += f'<p class="ndp-note">Not expressible as flags: {esc(", ".join(missing))}.</p>'
    body += ("<details><summary>Result as given (large arrays left out)</summary><pre>"
             + esc(json.dumps(_small(result), indent=2)) + "</pre></details>")
    sections.append(("inputs", "Inputs", _section(
        "inputs", "Inputs", "Everything this report was computed from, to reproduce it.", body)))

    first = ["best", "search", "perf", "memory", "timeline"] if search is not None else \
        ["memory", "perf", "timeline", "best", "search"]
    kpis.sort(key=lambda item: first.index(item[0]))
    order = ["search", "time", "memory", "timeline", "inputs"] if search is not None else \
        ["memory", "time", "timeline", "search", "inputs"]
    sections.sort(key=lambda item: order.index(item[0]))
    payload = {"charts": charts}
    data_json = (json.dumps(jsonable(payload), separators=(",", ":"), allow_nan=False)
                 .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    nav = "".join(f'<a href="#{esc(sid)}">{esc(label)}</a>' for sid, label, _ in sections)
    sub = [f"{d['kind']} report"]
    if d["strategy_short"]:
        sub.append(f"<code>{esc(d['strategy_short'])}</code>")
    sub.append(f"ndplan {esc(d['version'])}")
    sub.append(esc(d["generated"]))
    page = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="ndplan {esc(d["version"])}">',
        f"<title>{esc('ndplan: ' + d['title'])}</title>",
        f"<style>{CSS}</style></head><body>",
        f'<header class="ndp-head"><h1>{esc(d["title"])}</h1><div class="sub">{" · ".join(sub)}</div></header>',
        f'<nav class="ndp-nav">{nav}</nav><main>',
        '<pre id="ndp-errors" class="ndp-error" hidden></pre>',
        f'<div class="kpis">{"".join(tile for _, tile in kpis)}</div>' if kpis else "",
        ('<section class="card cautions" id="cautions"><h2>Cautions</h2><p class="how">What the estimators are '
         "known to miss for this strategy, from measured and published runs.</p><ul>"
         + "".join(f"<li>{esc(c)}</li>" for c in d["cautions"]) + "</ul></section>") if d["cautions"] else "",
        ('<section class="card notes"><h2>Notes</h2><ul>' + "".join(f"<li>{esc(n)}</li>" for n in d["notes"])
         + "</ul></section>") if d["notes"] else "",
        *(html_ for _, _, html_ in sections),
        f'<footer>Generated by ndplan {esc(d["version"])} on {esc(d["generated"])}. '
        "Self-contained: no network needed to view.</footer></main>",
        '<div id="ndp-tip" role="tooltip"></div>',
        f'<script type="application/json" id="ndplan-data">{data_json}</script>',
        f"<script>{JS}</script>",
        "</body></html>",
    ]
    return "\n".join(page)


def _small(result: Any, limit: int = 50) -> Any:
    """The result with long arrays cut to their length, for the collapsible raw view."""
    value = result
    if hasattr(value, "to_dict") or hasattr(value, "model_dump"):
        value = as_dict(value)
    if isinstance(value, Mapping):
        return {str(k): _small(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) > limit:
            return f"<{len(value):,} items>"
        return [_small(v, limit) for v in value]
    return jsonable(value)


def write_html(result: Any, path: str | Path, *, top: int = 50, max_points: int = 4000,
               title: str | None = None) -> Path:
    """Write the self-contained HTML report of ``result`` (an estimate, search or balance dict).

    ``top``: ranked rows kept in the table; ``max_points``: candidates drawn in the scatter
    (the Pareto front is always drawn whole). Returns the path written.
    """
    out = Path(path)
    text = render_html(result, top=top, max_points=max_points, title=title)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
