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
pp, ep, and where the experts are laid out otherwise than the dense layers the expert-tensor and
expert-data groups: ``communicator_count``).
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

    def reserved(self, allocated: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """allocated · (1 + allocator_slack), into ``out`` where given (it may be ``allocated``)."""
        return np.multiply(allocated, 1.0 + self.allocator_slack, out=out)


def communicator_count(batch: StrategyBatch) -> np.ndarray:
    """[n] NCCL communicators a rank holds: one per group of size > 1 among tp, cp, dp·cp, pp,
    ep, the expert-tensor group (etp) and the expert-data group (dp·cp·tp / (ep·etp)).

    A communicator and its buffers exist once the group runs a collective (PyTorch creates them
    lazily, as Megatron-Core's parallel_state notes), and a MoE model's experts run theirs over
    the expert groups: the token dispatcher and expert MLPs over expert-TP, the expert
    gradients' reduce over expert-data (Megatron-Core's ``pg_collection.expt_tp``/``expt_dp``).
    Where the experts are laid out as the dense layers are (ep = 1, etp = tp) those groups hold
    TP's and DP·CP's ranks, and are not counted again; with ep > 1, or etp ≠ tp (and ep = 1: then
    dp·cp·tp/etp ≠ dp·cp), the expert-data group is a group of its own, and the expert-TP group
    is one where etp > 1 and etp ≠ tp (with Megatron-Core's layout, etp = tp is TP's ranks).
    Megatron-Core builds its expert groups as process groups of their own even over TP's or
    DP·CP's ranks (parallel_state: EXPERT_TENSOR_PARALLEL_GROUP, EXPERT_DATA_PARALLEL_GROUP),
    which may hold one more communicator each there; torchtitan reuses its meshes. Not counted
    either: the combined groups a runtime also uses (Megatron's model-parallel group for the
    gradient norm, the embedding group, tp-ep-pp), unmeasured."""
    groups = [batch.tp, batch.cp, batch.dp * batch.cp, batch.pp, batch.ep]
    own_layout = (batch.ep > 1) | (batch.etp != batch.tp)
    groups.append(np.where(batch.etp != batch.tp, batch.etp, 1))
    expert_data = batch.dp * batch.cp * batch.tp // np.maximum(batch.ep * batch.etp, 1)
    groups.append(np.where(own_layout, expert_data, 1))
    return sum((g > 1).astype(np.int64) for g in groups)


def overhead_model(profile: RuntimeProfile, batch: StrategyBatch, include: bool) -> RuntimeOverhead:
    constants = {**DEFAULTS, **profile.overhead}
    if not include:
        return RuntimeOverhead(0.0, np.zeros(len(batch)))
    fixed = constants["context_bytes"] + communicator_count(batch) * constants["communicator_bytes"]
    return RuntimeOverhead(constants["allocator_slack"], np.asarray(fixed, dtype=float),
                           float(constants["workspace_bytes"]), float(constants["expert_workspace_bytes"]))
