"""Colours and labels shared by the HTML report and the matplotlib figures.

One palette for both, so a PNG in a slide and the HTML report read the same way. The colours
are Tableau-10 hues (distinguishable for the common colour-vision deficiencies when paired with
the legend's order); greys are reserved for what is not model state (overhead, bubble).
"""

from __future__ import annotations

GIB = 1024**3

#: Memory categories, bottom to top of a stacked bar: (key, label, colour).
MEMORY_CATEGORIES: tuple[tuple[str, str, str], ...] = (
    ("params", "parameters", "#4E79A7"),
    ("grads", "gradients", "#A0CBE8"),
    ("optimizer", "optimizer states", "#F28E2B"),
    ("activations", "activations", "#59A14F"),
    ("comm", "comm buffers", "#B07AA1"),
    ("transient", "transient (backward / loss)", "#EDC948"),
    ("optimizer_step", "optimizer-step temporaries", "#FFBE7D"),
    ("overhead", "runtime overhead + allocator slack", "#BAB0AC"),
    ("unbroken", "peak (no breakdown given)", "#86BCB6"),
)

#: Layer kinds (static + activations of each), then what no layer kind owns.
LAYER_KINDS: tuple[tuple[str, str, str], ...] = (
    ("embedding", "embedding", "#76B7B2"),
    ("attention", "attention", "#4E79A7"),
    ("norm", "norms", "#EDC948"),
    ("mlp", "MLP", "#59A14F"),
    ("moe", "MoE experts + router", "#E15759"),
    ("recompute", "recomputed layers (saved inputs)", "#FF9DA7"),
    ("output", "output head + loss", "#9C755F"),
    ("mtp", "MTP", "#B07AA1"),
    ("pipeline", "pipeline stage inputs/outputs", "#A0CBE8"),
    ("other", "other (unattributed)", "#D7B5A6"),
    ("buffers", "comm + transient", "#8FA3B8"),
    ("optimizer_step", "optimizer-step temporaries", "#FFBE7D"),
    ("overhead", "runtime overhead + allocator slack", "#BAB0AC"),
    ("unbroken", "peak (no breakdown given)", "#86BCB6"),
)

#: Step-time segments, left to right: (key, label, colour). Exposed comm is per dimension.
TIME_SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("compute", "compute", "#4E79A7"),
    ("tp", "exposed comm: TP", "#F28E2B"),
    ("cp", "exposed comm: CP", "#EDC948"),
    ("ep", "exposed comm: EP", "#E15759"),
    ("dp", "exposed comm: DP", "#76B7B2"),
    ("offload", "exposed host copies: activation offload", "#8CD17D"),
    ("pp", "exposed comm: PP", "#B07AA1"),
    ("comm_other", "exposed comm: other", "#D4A6C8"),
    ("bubble", "pipeline bubble", "#BAB0AC"),
    ("optimizer", "optimizer step", "#9C755F"),
    ("other", "other / unattributed", "#D7B5A6"),
)

#: Pipeline op kinds: F forward, B backward (input grad when split), W weight grad.
OP_KINDS: tuple[tuple[str, str, str], ...] = (
    ("F", "F: forward", "#4E79A7"),
    ("B", "B: backward", "#F28E2B"),
    ("W", "W: weight gradient", "#59A14F"),
)

CAPACITY_COLOR = "#D62728"
ALLOCATED_COLOR = "#222222"
RESERVED_COLOR = "#555555"
PARETO_COLOR = "#D62728"
CANDIDATE_COLOR = "#4E79A7"
INFEASIBLE_COLOR = "#B0B0B0"
TOP_COLOR = "#111111"


def lighten(color: str, amount: float) -> str:
    """Mix a #RRGGBB colour with white; amount 0 keeps it, 1 gives white."""
    amount = min(max(amount, 0.0), 1.0)
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * amount) for c in (r, g, b))
    return f"#{r:02X}{g:02X}{b:02X}"


def chunk_color(kind: str, chunk: int, vpp: int) -> str:
    """Colour of an op: its kind's hue, lighter for later local chunks (chunk 0 is the full hue)."""
    base = dict((k, c) for k, _, c in OP_KINDS)[kind]
    if vpp <= 1:
        return base
    return lighten(base, 0.5 * chunk / (vpp - 1))
