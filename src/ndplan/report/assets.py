"""The stylesheet and script inlined into every HTML report (no network at view time).

The script draws each ``<div class="ndp-chart" data-spec=ID>`` from ``DATA.charts[ID]`` (the JSON
in ``<script id="ndplan-data">``) as SVG, sets ``data-rendered="1"`` on success, or
``data-rendered="error"`` plus an entry in ``window.__errors`` and ``#ndp-errors`` on failure. When
done it writes ``data-render-ms`` (``performance.now()``) and ``data-errors`` on ``<html>``.
All text reaches the page through ``textContent`` and ``setAttribute``, never as markup.
"""

CSS = r"""
:root { --ink:#1f2328; --muted:#5b636e; --line:#d8dde3; --bg:#f5f6f8; --card:#fff; --accent:#2f5d8a;
        --ok:#1a7f37; --bad:#c62828; }
* { box-sizing: border-box; }
html { background: var(--bg); }
body { margin: 0; color: var(--ink); font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto,
       "Helvetica Neue", Arial, sans-serif; }
header.ndp-head { background: #1f2a37; color: #fff; padding: 22px 32px 18px; }
header.ndp-head h1 { margin: 0 0 4px; font-size: 22px; font-weight: 650; letter-spacing: .2px; }
header.ndp-head .sub { color: #c9d1d9; font-size: 13px; }
header.ndp-head .sub code { color: #fff; background: rgba(255,255,255,.1); padding: 1px 5px; border-radius: 4px; }
nav.ndp-nav { background: #fff; border-bottom: 1px solid var(--line); padding: 8px 32px; position: sticky; top: 0;
              z-index: 5; }
nav.ndp-nav a { color: var(--accent); text-decoration: none; margin-right: 18px; font-weight: 550; }
nav.ndp-nav a:hover { text-decoration: underline; }
main { max-width: 1240px; margin: 0 auto; padding: 18px 24px 40px; }
.kpis { display: grid; grid-template-columns: repeat(auto-fill, minmax(180px, 1fr)); gap: 12px; margin: 4px 0 18px; }
.kpi { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
.kpi .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .4px; }
.kpi .v { font-size: 20px; font-weight: 650; margin-top: 2px; font-variant-numeric: tabular-nums; }
.kpi .v.ok { color: var(--ok); } .kpi .v.bad { color: var(--bad); }
.kpi .d { color: var(--muted); font-size: 12px; }
section.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 16px 20px 18px;
               margin: 0 0 18px; }
section.card > h2 { margin: 0 0 4px; font-size: 18px; font-weight: 650; }
section.card.cautions { border-left: 4px solid #b7791f; }
p.how { color: var(--muted); margin: 2px 0 12px; max-width: 980px; }
.ndp-chart { margin: 10px 0 6px; }
.ndp-chart svg { display: block; width: 100%; height: auto; overflow: visible; }
.ndp-title { font-size: 15px; font-weight: 650; fill: var(--ink); }
.ndp-axis text, .ndp-tick { font-size: 11.5px; fill: #444; font-variant-numeric: tabular-nums; }
.ndp-axis-label { font-size: 12.5px; fill: #333; font-weight: 550; }
.ndp-grid { stroke: #e6e9ed; stroke-width: 1; }
.ndp-axis-line { stroke: #8b949e; stroke-width: 1; }
.ndp-val { font-size: 11px; fill: #333; font-weight: 600; font-variant-numeric: tabular-nums; }
.ndp-ref { font-size: 11.5px; font-weight: 650; }
.ndp-legend { display: flex; flex-wrap: wrap; gap: 6px 16px; margin: 6px 0 0 70px; font-size: 12.5px; color: #333; }
.ndp-legend span.it { display: inline-flex; align-items: center; gap: 6px; }
.ndp-legend i { display: inline-block; width: 13px; height: 13px; border-radius: 2px; }
.ndp-legend i.line { height: 0; border-top: 2.5px solid; border-radius: 0; width: 20px; }
.ndp-legend i.dash { height: 0; border-top: 2.5px dashed; border-radius: 0; width: 20px; }
.ndp-legend i.dot { border-radius: 50%; width: 9px; height: 9px; }
.ndp-legend i.ring { border-radius: 50%; width: 11px; height: 11px; background: none !important; border: 2px solid; }
.ndp-note { color: var(--muted); font-size: 12.5px; margin: 4px 0 0; }
.ndp-error { color: var(--bad); font-weight: 600; }
#ndp-tip { position: fixed; pointer-events: none; z-index: 20; background: rgba(24,28,33,.94); color: #fff;
           padding: 6px 9px; border-radius: 5px; font-size: 12px; white-space: pre-line; display: none;
           max-width: 420px; box-shadow: 0 2px 8px rgba(0,0,0,.25); }
table.ndp { border-collapse: collapse; width: 100%; font-size: 13px; font-variant-numeric: tabular-nums; }
table.ndp th, table.ndp td { padding: 5px 9px; border-bottom: 1px solid #eceff2; text-align: right; white-space: nowrap; }
table.ndp th { background: #f3f5f7; color: #333; font-weight: 600; border-bottom: 1px solid var(--line);
               position: sticky; top: 0; }
table.ndp td.t, table.ndp th.t { text-align: left; }
table.ndp tr.peak td { font-weight: 700; background: #fff8e6; }
table.ndp tr.over td.m { color: var(--bad); }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th::after { content: " \2195"; color: #aab; font-size: 11px; }
table.sortable th[aria-sort="ascending"]::after { content: " \25B2"; color: var(--accent); }
table.sortable th[aria-sort="descending"]::after { content: " \25BC"; color: var(--accent); }
table.sortable tbody tr:hover td { background: #f0f6ff; }
.scroll { overflow-x: auto; max-height: 640px; overflow-y: auto; border: 1px solid #eceff2; border-radius: 6px; }
table.kv { border-collapse: collapse; font-size: 13px; }
table.kv th { text-align: left; color: var(--muted); font-weight: 550; padding: 3px 18px 3px 0; vertical-align: top; }
table.kv td { padding: 3px 0; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
.cols { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 8px 32px; }
h3 { font-size: 14px; margin: 12px 0 6px; }
pre.cmd { background: #0f1720; color: #e6edf3; padding: 10px 12px; border-radius: 6px; overflow-x: auto;
          font-size: 12.5px; white-space: pre-wrap; word-break: break-all; }
details summary { cursor: pointer; color: var(--accent); font-weight: 550; margin-top: 10px; }
details pre { background: #f6f8fa; padding: 10px; border-radius: 6px; max-height: 420px; overflow: auto; font-size: 12px; }
footer { color: var(--muted); font-size: 12px; text-align: center; padding: 8px 0 24px; }
@media print { nav.ndp-nav { display: none; } section.card { break-inside: avoid; } }
"""

JS = r"""
(function () {
  "use strict";
  var errors = window.__errors = window.__errors || [];
  var errorBox = document.getElementById("ndp-errors");
  function report(msg) {
    errors.push(msg);
    if (errorBox) { errorBox.hidden = false; errorBox.textContent += msg + "\n"; }
    console.error("ndplan report: " + msg);
  }
  window.addEventListener("error", function (e) { report(String((e && e.message) || e)); });

  var NS = "http://www.w3.org/2000/svg";
  var DATA = JSON.parse(document.getElementById("ndplan-data").textContent);
  var tip = document.getElementById("ndp-tip");

  function svgEl(tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) { if (attrs[k] !== undefined && attrs[k] !== null) e.setAttribute(k, attrs[k]); }
    if (text !== undefined) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }
  function htmlEl(tag, cls, parent, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "\u2013";
    var a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    return String(parseFloat(v.toPrecision(3)));
  }
  function niceStep(span, n) {
    if (!(span > 0)) return 1;
    var raw = span / n, p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3 ? 2 : m < 7 ? 5 : 10) * p;
  }
  function linear(d0, d1, r0, r1, n) {
    var step = niceStep(d1 - d0, n || 6);
    var digits = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
    var f = function (v) { return r0 + (v - d0) / ((d1 - d0) || 1) * (r1 - r0); };
    f.invert = function (p) { return d0 + (p - r0) / ((r1 - r0) || 1) * (d1 - d0); };
    f.ticks = function () {
      var t = [];
      for (var i = Math.ceil(d0 / step - 1e-9); i * step <= d1 + step * 1e-9; i++) t.push(i * step + 0);
      return t;
    };
    f.label = function (v) {
      if (Math.abs(v) < step * 1e-6) v = 0;
      return v.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
    };
    f.step = step;
    return f;
  }
  function logarithmic(d0, d1, r0, r1) {
    var l0 = Math.log10(d0), l1 = Math.log10(d1);
    var f = function (v) { return r0 + (Math.log10(v) - l0) / ((l1 - l0) || 1) * (r1 - r0); };
    f.invert = function (p) { return Math.pow(10, l0 + (p - r0) / ((r1 - r0) || 1) * (l1 - l0)); };
    f.ticks = function () {
      var t = [], span = l1 - l0, mant = span > 6 ? [1] : span > 2.5 ? [1, 3] : [1, 2, 5];
      for (var e = Math.floor(l0); e <= Math.ceil(l1); e++) {
        mant.forEach(function (m) {
          var v = m * Math.pow(10, e);
          if (v >= d0 * (1 - 1e-9) && v <= d1 * (1 + 1e-9)) t.push(v);
        });
      }
      return t;
    };
    f.label = function (v) { return v >= 1 ? v.toLocaleString("en-US", {maximumFractionDigits: 0}) : String(+v.toPrecision(2)); };
    return f;
  }
  function domain(values, log) {
    var lo = Infinity, hi = -Infinity;
    values.forEach(function (v) { if (isFinite(v) && (!log || v > 0)) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    if (!isFinite(lo)) { lo = log ? 1 : 0; hi = log ? 10 : 1; }
    if (log) { var pad = hi === lo ? 2 : Math.pow(hi / lo, 0.04); return [lo / pad, hi * pad]; }
    var span = (hi - lo) || Math.abs(hi) || 1, lo2 = lo - span * 0.05;
    return [lo >= 0 && lo2 < 0 ? 0 : lo2, hi + span * 0.05];
  }
  function luminance(hex) {
    var r = parseInt(hex.substr(1, 2), 16), g = parseInt(hex.substr(3, 2), 16), b = parseInt(hex.substr(5, 2), 16);
    return (0.299 * r + 0.587 * g + 0.114 * b) / 255;
  }
  function toSvg(svg, e) {
    var pt = svg.createSVGPoint();
    pt.x = e.clientX; pt.y = e.clientY;
    return pt.matrixTransform(svg.getScreenCTM().inverse());
  }

  function showTip(text, e) {
    tip.textContent = text;
    tip.style.display = "block";
    var w = tip.offsetWidth, h = tip.offsetHeight;
    var x = e.clientX + 14, y = e.clientY + 14;
    if (x + w > window.innerWidth - 4) x = e.clientX - w - 10;
    if (y + h > window.innerHeight - 4) y = e.clientY - h - 10;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  document.addEventListener("mousemove", function (e) {
    if (e.ndpHandled) return;
    var t = e.target && e.target.closest ? e.target.closest("[data-tip]") : null;
    if (t) showTip(t.getAttribute("data-tip"), e); else hideTip();
  });

  function frame(host, spec, W, H) {
    var svg = svgEl("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": spec.title,
                            preserveAspectRatio: "xMinYMin meet"}, host);
    svgEl("text", {x: 2, y: 18, "class": "ndp-title"}, svg, spec.title);
    return svg;
  }
  function yAxis(svg, y, x0, x1, label, top, bottom) {
    var g = svgEl("g", {"class": "ndp-axis"}, svg);
    y.ticks().forEach(function (v) {
      var yy = y(v);
      svgEl("line", {x1: x0, x2: x1, y1: yy, y2: yy, "class": "ndp-grid"}, g);
      svgEl("text", {x: x0 - 7, y: yy + 4, "text-anchor": "end"}, g, y.label(v));
    });
    svgEl("line", {x1: x0, x2: x0, y1: top, y2: bottom, "class": "ndp-axis-line"}, g);
    var cy = (top + bottom) / 2;
    svgEl("text", {x: 14, y: cy, transform: "rotate(-90 14 " + cy + ")", "text-anchor": "middle",
                   "class": "ndp-axis-label"}, g, label);
  }
  function xAxis(svg, x, y0, top, left, right, label, H) {
    var g = svgEl("g", {"class": "ndp-axis"}, svg);
    x.ticks().forEach(function (v) {
      var xx = x(v);
      if (xx < left - 0.5 || xx > right + 0.5) return;
      svgEl("line", {x1: xx, x2: xx, y1: top, y2: y0, "class": "ndp-grid"}, g);
      svgEl("text", {x: xx, y: y0 + 16, "text-anchor": "middle"}, g, x.label(v));
    });
    svgEl("line", {x1: left, x2: right, y1: y0, y2: y0, "class": "ndp-axis-line"}, g);
    svgEl("text", {x: (left + right) / 2, y: H - 8, "text-anchor": "middle", "class": "ndp-axis-label"}, g, label);
  }
  function legend(host, items) {
    var box = htmlEl("div", "ndp-legend", host);
    items.forEach(function (it) {
      var span = htmlEl("span", "it", box);
      var i = htmlEl("i", it.shape || "", span);
      if (it.shape === "line" || it.shape === "dash" || it.shape === "ring") i.style.borderColor = it.color;
      else i.style.background = it.color;
      htmlEl("span", "", span, it.label);
    });
  }
  function note(host, text) { if (text) htmlEl("p", "ndp-note", host, text); }

  // ---- vertical stacked bars (memory per stage)
  function renderStacked(host, s) {
    var n = s.bars.length, W = 1000, H = 440, m = {l: 74, r: 22, t: 40, b: 62};
    var svg = frame(host, s, W, H), marks = s.marks || [];
    var ymax = 0;
    s.bars.forEach(function (b) {
      var tot = 0;
      s.series.forEach(function (se) { tot += b.values[se.key] || 0; });
      b.total = tot; ymax = Math.max(ymax, tot);
      marks.forEach(function (mk) { var v = b.marks && b.marks[mk.key]; if (v) ymax = Math.max(ymax, v); });
    });
    if (s.hline) ymax = Math.max(ymax, s.hline.value);
    var y = linear(0, ymax > 0 ? ymax * 1.1 : 1, H - m.b, m.t + 8, 7);
    yAxis(svg, y, m.l, W - m.r, s.ylabel, m.t + 8, H - m.b);
    var band = (W - m.l - m.r) / Math.max(n, 1), bw = Math.min(band * 0.66, 92);
    var every = Math.ceil(n / 20);
    s.bars.forEach(function (b, i) {
      var x = m.l + band * i + (band - bw) / 2, cum = 0;
      var g = svgEl("g", {}, svg);
      s.series.forEach(function (se) {
        var v = b.values[se.key] || 0;
        if (v <= 0) return;
        var y1 = y(cum + v), y0 = y(cum);
        svgEl("rect", {x: x, y: y1, width: bw, height: Math.max(0, y0 - y1), fill: se.color, stroke: "#fff",
                       "stroke-width": 0.5, "data-tip": b.label + " \u00b7 " + se.label + "\n" + fmt(v) + " " + s.unit +
                       " (" + (100 * v / b.total).toFixed(1) + "% of the stack)"}, g);
        cum += v;
      });
      marks.forEach(function (mk) {
        var v = b.marks && b.marks[mk.key];
        if (!v) return;
        var yy = y(v);
        svgEl("line", {x1: x - 6, x2: x + bw + 6, y1: yy, y2: yy, stroke: mk.color, "stroke-width": 2.4,
                       "stroke-dasharray": mk.dash || null, "data-tip": b.label + " \u00b7 " + mk.label + ": " +
                       fmt(v) + " " + s.unit}, g);
      });
      if (band >= 30) {
        svgEl("text", {x: x + bw / 2, y: y(b.total) - 6, "text-anchor": "middle", "class": "ndp-val"}, g, fmt(b.total));
      }
      if (i % every === 0) {
        svgEl("text", {x: x + bw / 2, y: H - m.b + 17, "text-anchor": "middle", "class": "ndp-tick"}, g, b.label);
        if (b.sub && band >= 44) {
          svgEl("text", {x: x + bw / 2, y: H - m.b + 31, "text-anchor": "middle", "class": "ndp-tick"}, g, b.sub);
        }
      }
    });
    svgEl("line", {x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, "class": "ndp-axis-line"}, svg);
    if (s.xlabel) svgEl("text", {x: (m.l + W - m.r) / 2, y: H - 6, "text-anchor": "middle", "class": "ndp-axis-label"}, svg, s.xlabel);
    var items = s.series.filter(function (se) { return s.bars.some(function (b) { return (b.values[se.key] || 0) > 0; }); })
      .map(function (se) { return {label: se.label, color: se.color}; });
    marks.forEach(function (mk) {
      if (s.bars.some(function (b) { return b.marks && b.marks[mk.key]; })) {
        items.push({label: mk.label, color: mk.color, shape: mk.dash ? "dash" : "line"});
      }
    });
    if (s.hline) {
      var yy = y(s.hline.value);
      svgEl("line", {x1: m.l, x2: W - m.r, y1: yy, y2: yy, stroke: s.hline.color, "stroke-width": 2,
                     "stroke-dasharray": "8 5", "data-tip": s.hline.label}, svg);
      svgEl("text", {x: W - m.r - 4, y: yy - 6, "text-anchor": "end", fill: s.hline.color, "class": "ndp-ref"}, svg, s.hline.label);
      items.push({label: s.hline.legend || s.hline.label, color: s.hline.color, shape: "dash"});
    }
    legend(host, items);
    note(host, s.note);
  }

  // ---- horizontal stacked bars (step-time breakdown)
  function renderHStacked(host, s) {
    var n = s.bars.length, rowH = 40, W = 1000, m = {l: 250, r: 96, t: 40, b: 50}, H = m.t + n * rowH + m.b;
    var svg = frame(host, s, W, H), xmax = 0;
    s.bars.forEach(function (b) {
      var tot = 0;
      s.series.forEach(function (se) { tot += b.values[se.key] || 0; });
      b.total = tot; xmax = Math.max(xmax, tot, b.step || 0);
    });
    var x = linear(0, xmax > 0 ? xmax * 1.04 : 1, m.l, W - m.r, 8);
    xAxis(svg, x, H - m.b, m.t, m.l, W - m.r, s.xlabel, H);
    s.bars.forEach(function (b, i) {
      var top = m.t + i * rowH + 7, h = rowH - 14, cum = 0, g = svgEl("g", {}, svg);
      var label = b.label.length > 38 ? b.label.slice(0, 37) + "\u2026" : b.label;
      svgEl("text", {x: m.l - 10, y: top + h / 2 + 4, "text-anchor": "end", "class": "ndp-tick", "data-tip": b.label}, g, label);
      s.series.forEach(function (se) {
        var v = b.values[se.key] || 0;
        if (v <= 0) return;
        var x0 = x(cum), x1 = x(cum + v);
        svgEl("rect", {x: x0, y: top, width: Math.max(0, x1 - x0), height: h, fill: se.color, stroke: "#fff", "stroke-width": 0.6,
                       "data-tip": b.label + "\n" + se.label + ": " + fmt(v) + " " + s.unit + " (" +
                       (100 * v / b.total).toFixed(1) + "% of the step)"}, g);
        if (x1 - x0 > 46) {
          svgEl("text", {x: (x0 + x1) / 2, y: top + h / 2 + 4, "text-anchor": "middle", "class": "ndp-val", style: "fill:" + (luminance(se.color) < 0.55 ? "#fff" : "#222")},
                g, fmt(v));
        }
        cum += v;
      });
      svgEl("text", {x: x(b.total) + 6, y: top + h / 2 + 4, "class": "ndp-val"}, g, fmt(b.step || b.total) + " " + s.unit);
    });
    legend(host, s.series.filter(function (se) { return s.bars.some(function (b) { return (b.values[se.key] || 0) > 0; }); })
      .map(function (se) { return {label: se.label, color: se.color}; }));
    note(host, s.note);
  }

  // ---- pipeline timeline (Gantt)
  function renderGantt(host, s) {
    var rows = s.rows, pp = rows.length, maxLanes = 1;
    rows.forEach(function (r) { (r.lanes || []).forEach(function (n) { if (n > maxLanes) maxLanes = n; }); });
    var rowH = pp <= 8 ? 32 + 10 * (maxLanes - 1) : Math.max(9, Math.floor(340 / pp));
    var W = 1000, m = {l: 74, r: 20, t: 40, b: 50}, H = m.t + pp * rowH + m.b;
    var svg = frame(host, s, W, H);
    var x = linear(0, s.makespan || 1, m.l, W - m.r, 10);
    xAxis(svg, x, H - m.b, m.t, m.l, W - m.r, s.xlabel, H);
    var paths = {}, texts = [];
    rows.forEach(function (r, si) {
      var top = m.t + si * rowH + 2, h = rowH - 4;
      svgEl("rect", {x: m.l, y: top, width: W - m.r - m.l, height: h, fill: "#eef0f3"}, svg);
      if (rowH >= 10 || si % Math.ceil(10 / rowH) === 0) {
        svgEl("text", {x: m.l - 8, y: top + h / 2 + 4, "text-anchor": "end", "class": "ndp-tick"}, svg, r.label);
      }
      for (var i = 0; i < r.k.length; i++) {
        var x0 = x(r.t0[i]), x1 = x(r.t1[i]), w = Math.max(x1 - x0, 0.4);
        var lanes = r.lanes ? r.lanes[i] : 1, lane = r.lane ? r.lane[i] : 0, lh = h / lanes, ly = top + lane * lh;
        var col = s.colors[r.k[i]][r.c[i]];
        (paths[col] = paths[col] || []).push("M" + x0.toFixed(2) + " " + ly.toFixed(2) + "h" + w.toFixed(2) + "v" +
                                             lh.toFixed(2) + "h" + (-w).toFixed(2) + "z");
        if (w >= 15 && lh >= 11) texts.push([x0 + w / 2, ly + lh / 2, r.mb[i], col, Math.min(11, lh * 0.72)]);
      }
    });
    Object.keys(paths).forEach(function (col) {
      svgEl("path", {d: paths[col].join(""), fill: col, stroke: "#fff", "stroke-width": w0(paths[col].length)}, svg);
    });
    function w0(count) { return count > 4000 ? 0 : 0.7; }
    var tg = svgEl("g", {"pointer-events": "none"}, svg);
    texts.forEach(function (t) {
      svgEl("text", {x: t[0].toFixed(1), y: (t[1] + t[4] * 0.36).toFixed(1), "text-anchor": "middle", "font-size": t[4].toFixed(1),
                     fill: luminance(t[3]) < 0.6 ? "#fff" : "#1f2328", "font-weight": 600}, tg, t[2]);
    });
    svg.addEventListener("mousemove", function (e) {
      var pt = toSvg(svg, e), si = Math.floor((pt.y - m.t) / rowH);
      if (si < 0 || si >= pp || pt.x < m.l || pt.x > W - m.r) return;
      var r = rows[si], t = x.invert(pt.x), lo = 0, hi = r.t0.length - 1, found = -1;
      while (lo <= hi) { var mid = (lo + hi) >> 1; if (r.t0[mid] <= t) { found = mid; lo = mid + 1; } else hi = mid - 1; }
      if (found < 0 || t > r.t1[found]) return;
      if (r.lanes && r.lanes[found] > 1) {
        var lane = Math.floor((pt.y - (m.t + si * rowH + 2)) / ((rowH - 4) / r.lanes[found]));
        found = found - r.lane[found] + Math.max(0, Math.min(r.lanes[found] - 1, lane));
      }
      e.ndpHandled = true;
      showTip(r.label + " \u00b7 " + s.kinds[r.k[found]] + " micro-batch " + r.mb[found] +
              (s.vpp > 1 ? " \u00b7 chunk " + r.c[found] : "") +
              (r.q ? " \u00b7 sub-sequence " + r.q[found] : "") + "\n" +
              fmt(r.t0[found]) + " \u2192 " + fmt(r.t1[found]) + " " + s.unit, e);
    });
    legend(host, s.legend);
    note(host, s.note);
  }

  // ---- scatter: step time vs peak memory, Pareto front, limit
  function renderScatter(host, s) {
    var W = 1000, H = 540, m = {l: 80, r: 26, t: 40, b: 54};
    var svg = frame(host, s, W, H);
    var xs = s.x.concat(s.fx), ys = s.y.concat(s.fy);
    s.top.forEach(function (p) { xs.push(p.x); ys.push(p.y); });
    if (s.limit) xs.push(s.limit);
    var dx = domain(xs, s.logx), dy = domain(ys, s.logy);
    var X = s.logx ? logarithmic(dx[0], dx[1], m.l, W - m.r) : linear(dx[0], dx[1], m.l, W - m.r, 10);
    var Y = s.logy ? logarithmic(dy[0], dy[1], H - m.b, m.t + 8) : linear(dy[0], dy[1], H - m.b, m.t + 8, 8);
    yAxis(svg, Y, m.l, W - m.r, s.ylabel, m.t + 8, H - m.b);
    xAxis(svg, X, H - m.b, m.t + 8, m.l, W - m.r, s.xlabel, H);
    var id = "clip-" + host.id;
    var cp = svgEl("clipPath", {id: id}, svgEl("defs", {}, svg));
    svgEl("rect", {x: m.l, y: m.t + 8, width: W - m.r - m.l, height: H - m.b - m.t - 8}, cp);
    var plot = svgEl("g", {"clip-path": "url(#" + id + ")"}, svg);
    if (s.limit) {
      var lx = X(s.limit);
      svgEl("rect", {x: lx, y: m.t + 8, width: Math.max(0, W - m.r - lx), height: H - m.b - m.t - 8, fill: s.colors.limit,
                     "fill-opacity": 0.05}, plot);
    }
    function cloud(filter, color, opacity, r) {
      var d = [];
      for (var i = 0; i < s.x.length; i++) {
        if (!filter(i)) continue;
        var px = X(s.x[i]), py = Y(s.y[i]);
        d.push("M" + (px - r).toFixed(1) + " " + py.toFixed(1) + "a" + r + " " + r + " 0 1 0 " + 2 * r + " 0a" + r + " " + r + " 0 1 0 " + -2 * r + " 0");
      }
      if (d.length) svgEl("path", {d: d.join(""), fill: color, "fill-opacity": opacity}, plot);
    }
    var over = function (i) { return s.limit && s.x[i] > s.limit; };
    cloud(function (i) { return over(i); }, s.colors.infeasible, 0.5, 2.3);
    cloud(function (i) { return !over(i); }, s.colors.candidate, 0.42, 2.3);
    if (s.fx.length) {
      var d = "M" + X(s.fx[0]).toFixed(1) + " " + Y(s.fy[0]).toFixed(1);
      for (var i = 1; i < s.fx.length; i++) d += "H" + X(s.fx[i]).toFixed(1) + "V" + Y(s.fy[i]).toFixed(1);
      svgEl("path", {d: d, fill: "none", stroke: s.colors.pareto, "stroke-width": 2}, plot);
      for (var j = 0; j < s.fx.length; j++) {
        svgEl("circle", {cx: X(s.fx[j]), cy: Y(s.fy[j]), r: 3.6, fill: s.colors.pareto, stroke: "#fff", "stroke-width": 0.8,
                         "data-tip": "Pareto point\npeak " + fmt(s.fx[j]) + " GiB \u00b7 step " + fmt(s.fy[j]) + " s"}, plot);
      }
    }
    var placed = [], hidden = [];
    s.top.forEach(function (p) {
      var px = X(p.x), py = Y(p.y);
      svgEl("circle", {cx: px, cy: py, r: 7, fill: "none", stroke: s.colors.top, "stroke-width": 1.8,
                       "data-tip": "#" + p.rank + (p.label ? " " + p.label : "") + "\npeak " + fmt(p.x) + " GiB \u00b7 step " + fmt(p.y) + " s"}, plot);
      var lx = px + 9, ly = py - 7;
      // one label per neighbourhood: the best rank there; the others are named beside it
      var near = placed.filter(function (q) { return Math.abs(q.x - lx) < 34 && Math.abs(q.y - ly) < 14; })[0];
      if (near) { near.more.push(p.rank); return; }
      var t = svgEl("text", {x: lx, y: ly, "class": "ndp-val"}, plot, "#" + p.rank);
      placed.push({x: lx, y: ly, el: t, rank: p.rank, more: []});
    });
    placed.forEach(function (q) {
      if (!q.more.length) return;
      var rest = q.more.length <= 3 ? q.more.map(function (r) { return "#" + r; }).join(" ") : "+" + q.more.length + " more";
      q.el.textContent = "#" + q.rank + " (" + rest + ")";
    });
    if (s.limit) {
      var lx2 = X(s.limit);
      svgEl("line", {x1: lx2, x2: lx2, y1: m.t + 8, y2: H - m.b, stroke: s.colors.limit, "stroke-width": 2, "stroke-dasharray": "8 5"}, svg);
      svgEl("text", {x: lx2 - 6, y: m.t + 22, "text-anchor": "end", fill: s.colors.limit, "class": "ndp-ref"}, svg, s.limit_label);
    }
    var items = [];
    if (s.x.some(function (v) { return !s.limit || v <= s.limit; })) items.push({label: "candidate that fits", color: s.colors.candidate, shape: "dot"});
    if (s.limit && s.x.some(function (v) { return v > s.limit; })) items.push({label: "candidate over the limit", color: s.colors.infeasible, shape: "dot"});
    if (s.fx.length) items.push({label: "Pareto front (exact)", color: s.colors.pareto, shape: "line"});
    if (s.top.length) items.push({label: "top-ranked (#rank)", color: s.colors.top, shape: "ring"});
    if (s.limit) items.push({label: "memory limit", color: s.colors.limit, shape: "dash"});
    legend(host, items);
    note(host, s.note);
  }

  // ---- sortable tables: click a header; numbers sort by data-v
  function initSort() {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
        th.setAttribute("tabindex", "0");
        var go = function () { sortTable(table, col, th); };
        th.addEventListener("click", go);
        th.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); go(); } });
      });
      table.setAttribute("data-sortable-ready", "1");
    });
  }
  function sortTable(table, col, th) {
    var asc = th.getAttribute("aria-sort") !== "ascending";
    Array.prototype.forEach.call(th.parentNode.cells, function (c) { c.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
    var key = function (r) { var c = r.cells[col]; return c ? (c.hasAttribute("data-v") ? c.getAttribute("data-v") : c.textContent) : ""; };
    rows.sort(function (a, b) {
      var va = key(a), vb = key(b), na = parseFloat(va), nb = parseFloat(vb), c;
      var numA = va !== "" && isFinite(na), numB = vb !== "" && isFinite(nb);
      if (numA && numB) c = na - nb; else if (numA !== numB) return numA ? -1 : 1; else c = String(va).localeCompare(String(vb));
      return asc ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }

  var RENDER = {stacked: renderStacked, hstacked: renderHStacked, gantt: renderGantt, scatter: renderScatter};
  Array.prototype.forEach.call(document.querySelectorAll(".ndp-chart"), function (host) {
    var spec = DATA.charts[host.getAttribute("data-spec")];
    try {
      if (!spec || !RENDER[spec.type]) throw new Error("no chart data");
      RENDER[spec.type](host, spec);
      host.setAttribute("data-rendered", "1");
    } catch (err) {
      host.setAttribute("data-rendered", "error");
      report(host.id + ": " + ((err && err.message) || err));
      htmlEl("p", "ndp-error", host, "This chart could not be drawn: " + ((err && err.message) || err));
    }
  });
  try { initSort(); } catch (err) { report("table sort: " + ((err && err.message) || err)); }
  document.documentElement.setAttribute("data-errors", String(errors.length));
  document.documentElement.setAttribute("data-render-ms", performance.now().toFixed(1));
})();
"""
