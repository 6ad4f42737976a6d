"""See the plan: a self-contained HTML report and matplotlib figures of a result.

``write_html(result, path)`` writes one HTML file (inline SVG charts, no network at view time);
``plot_memory``, ``plot_time``, ``plot_timeline``, ``plot_pareto`` and ``write_plots`` draw the
same figures as PNG/SVG with matplotlib (the optional ``plot`` extra, imported only when
called). A result is a plain dict: the ``--json`` output of estimate, search or balance, or the
same built in process; see :mod:`ndplan.report.data` for the keys read.
"""

from ndplan.report.data import downsample, pareto_front, prepare, schedule_to_dict
from ndplan.report.html import render_html, write_html
from ndplan.report.plots import plot_memory, plot_pareto, plot_time, plot_timeline, write_plots

__all__ = [
    "downsample",
    "pareto_front",
    "plot_memory",
    "plot_pareto",
    "plot_time",
    "plot_timeline",
    "prepare",
    "render_html",
    "schedule_to_dict",
    "write_html",
    "write_plots",
]
