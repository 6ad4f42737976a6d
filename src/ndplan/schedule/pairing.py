"""Which forward passes an overlapping runtime can pair with another micro-batch's backward.

Expert-parallel overlap (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, DualPipe's
forward-backward chunks) hides one micro-batch's all-to-all under another micro-batch's
compute, so it needs a forward and a backward ready at the same time. The pipeline's warm-up
forwards and cool-down backwards have no partner and run their all-to-all exposed.

Counted from the schedule's op order (``build_plan``) on the first stage, which runs the
first forward and the last backward and so carries the whole step on its timeline (it also
has the longest warm-up of the 1F1B family):

* schedules that pair passes themselves (DualPipeV: steps holding a forward and a backward)
  pair exactly those forwards;
* the others are merged by the runtime in their steady phase, each backward with the forward
  next to it: the forwards before the first backward are unpaired except the last one (the
  steady phase's first forward, merged with that backward), unless that forward belongs to
  the same micro-batch and chunk as the backward, which cannot overlap it (the last stage of
  1F1B, no pipeline, GPipe).

The backward passes mirror this: as many backwards as forwards run unpaired (the cool-down).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ndplan.schedule.builders import build_plan

FORWARD, BACKWARD = 0, 1


def _steady_unpaired(schedule: str, pp: int, vpp: int, m: int) -> int | None:
    """The count ``_counted`` finds, in closed form where every stage reaches a steady phase
    (pp >= 2, m >= 2·pp, one sequence chunk; checked against the op order on a grid of shapes in
    the tests), else None: building a long schedule to count its warm-up costs tens of
    milliseconds, which a search would pay per distinct micro-batch count."""
    if pp < 2 or m < 2 * pp:
        return None
    closed_forms = {
        "1f1b": pp - 1,
        "zb-h1": pp - 1,
        "interleaved": (pp - 1) * 2 + (vpp - 1) * pp,  # Megatron's interleaved warm-up
        "zbv": 2 * pp,
        "dualpipev": 3 * pp - 1,  # DualPipeV's phases 1-3 on the first stage
        "gpipe": m - 1,
    }
    return closed_forms.get(schedule)


@lru_cache(maxsize=1024, typed=True)
def unpaired_forwards(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int = 1) -> tuple[int, int]:
    """(unpaired forwards, forwards) of the first stage of one step (see module docstring)."""
    steady = _steady_unpaired(schedule, pp, vpp, m) if seq_chunks == 1 else None
    if steady is not None:
        return steady, m * vpp
    return _counted(schedule, pp, vpp, m, seq_chunks)


def _counted(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[int, int]:
    """``unpaired_forwards`` counted from the schedule's op order."""
    stage = build_plan(schedule, pp, vpp, m, seq_chunks)[0]
    kind = stage.kind
    forwards = int(np.count_nonzero(kind == FORWARD))
    has_forward = np.bincount(stage.step[kind == FORWARD], minlength=len(stage.step_len)) > 0
    has_backward = np.bincount(stage.step[kind == BACKWARD], minlength=len(stage.step_len)) > 0
    paired_steps = has_forward & has_backward
    if paired_steps.any():
        # Pairs of the schedule's own (one forward per such step in DualPipeV).
        paired = int(np.count_nonzero(np.isin(stage.step[kind == FORWARD], np.flatnonzero(paired_steps))))
        return forwards - paired, forwards
    backward_at = np.flatnonzero(kind == BACKWARD)
    if not len(backward_at):
        return forwards, forwards
    first = int(backward_at[0])
    before = np.flatnonzero(kind[:first] == FORWARD)
    last = int(before[-1])
    same = all(int(a[last]) == int(a[first]) for a in (stage.micro_batch, stage.chunk, stage.seq_chunk))
    return len(before) - (0 if same else 1), forwards
