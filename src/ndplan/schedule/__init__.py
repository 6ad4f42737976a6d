"""Pipeline-schedule simulator shared by the memory model and the time model.

``simulate`` gives the timeline (op start/end, makespan, bubble) of one pipeline step
(``simulated_makespan_s`` its makespan alone);
``in_flight`` gives, from the op order alone and cached, how many micro-batch activations
each stage and chunk holds, which is what memory needs.
"""

from ndplan.schedule.memory import InFlight, StageInFlight, in_flight
from ndplan.schedule.ops import (
    EVERY_BACKWARD_SPLIT,
    KIND_NAMES,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPE,
    Op,
    model_chunk_table,
)
from ndplan.schedule.timeline import ScheduleResult, StageOps, simulate, simulated_makespan_s

__all__ = [
    "EVERY_BACKWARD_SPLIT",
    "KIND_NAMES",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "V_SHAPE",
    "InFlight",
    "Op",
    "ScheduleResult",
    "StageInFlight",
    "StageOps",
    "in_flight",
    "model_chunk_table",
    "simulate",
    "simulated_makespan_s",
]
