"""What the device holds beyond the tensors a framework allocates.

    allocated += workspace_bytes                          math libraries' workspaces, in every phase
               + expert_workspace_bytes                   and a grouped GEMM's own, on stages with MoE layers
    reserved = allocated · (1 + allocator_slack)          caching-allocator segments not in use
    device   = reserved + context_bytes + communicators · communicator_bytes

``torch.cuda.max_memory_allocated`` reports ``allocated``; ``max_memory_reserved`` reports
``reserved``; nvidia-smi / npu-smi show ``device``. The workspaces (cuBLAS/cuBLASLt) are allocated
through the caching allocator, so a real run's ``allocated`` holds them while a fake-tensor
measurement (which sees only the tensors ops return) does not: without the overhead the estimate
is the fake measurement's figure. The constants are per runtime (in the
profile's ``overhead`` section), documented there with their source, and can be switched off.
One communicator is counted per parallel group of size > 1 that a rank belongs to (tp, cp, dp,
pp, ep, and the expert-data group).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ndplan.memory.profile import RuntimeProfile
from ndplan.strategy.batch import StrategyBatch

DEFAULTS = {"allocator_slack": 0.0, "context_bytes": 0.0, "communicator_bytes": 0.0, "workspace_bytes": 0.0,
            "expert_workspace_bytes": 0.0}


@dataclass(frozen=True)
class RuntimeOverhead:
    allocator_slack: float
    fixed_bytes: np.ndarray  # per strategy: context + communicator buffers
    workspace_bytes: float = 0.0  # allocated, in every phase of the step
    expert_workspace_bytes: float = 0.0  # allocated too, where a stage runs experts' grouped GEMMs

    def reserved(self, allocated: np.ndarray) -> np.ndarray:
        return allocated * (1.0 + self.allocator_slack)


def communicator_count(batch: StrategyBatch) -> np.ndarray:
    groups = [batch.tp, batch.cp, batch.dp * batch.cp, batch.pp, batch.ep]
    expert_data = batch.dp * batch.cp * batch.tp // np.maximum(batch.ep * batch.etp, 1)
    groups.append(np.where(batch.ep > 1, expert_data, 1))
    return sum((g > 1).astype(np.int64) for g in groups)


def overhead_model(profile: RuntimeProfile, batch: StrategyBatch, include: bool) -> RuntimeOverhead:
    constants = {**DEFAULTS, **profile.overhead}
    if not include:
        return RuntimeOverhead(0.0, np.zeros(len(batch)))
    fixed = constants["context_bytes"] + communicator_count(batch) * constants["communicator_bytes"]
    return RuntimeOverhead(constants["allocator_slack"], np.asarray(fixed, dtype=float),
                           float(constants["workspace_bytes"]), float(constants["expert_workspace_bytes"]))
