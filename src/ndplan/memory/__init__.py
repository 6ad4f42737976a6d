"""Memory per pipeline stage: static states, activations across the schedule, buffers, overhead."""

from ndplan.memory.options import MemoryOptions
from ndplan.memory.report import MemoryReport, StageReport, estimate
from ndplan.memory.result import StageMemory
from ndplan.memory.stages import stage_memory

__all__ = ["MemoryOptions", "MemoryReport", "StageMemory", "StageReport", "estimate", "stage_memory"]
