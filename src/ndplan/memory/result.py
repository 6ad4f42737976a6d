"""What the memory model returns: ``StageMemory``, arrays [strategies, max_pp] of bytes per
category, and the categories and layer kinds of its breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "transient")
STATIC_KINDS = ("embedding", "attention", "norm", "mlp", "moe", "output", "mtp")
#: ``pipeline``: the stage inputs and outputs a pipeline runtime keeps per micro-batch until its
#: backward (torch.distributed.pipelining), beside its layers' saved tensors.
ACTIVATION_KINDS = ("embedding", "attention", "norm", "mlp", "moe", "recompute", "output", "mtp", "pipeline")


@dataclass
class StageMemory:
    """Arrays [strategies, max_pp] per category in bytes; stages past a strategy's pp are 0.

    ``forward_backward`` is the forward/backward peak: static + activations + comm + transient
    less what does not exist yet at that moment (gradients made by the backward, under a
    runtime that creates them there).

    ``by_kind`` (only when asked for) maps category -> kind -> [strategies, max_pp].
    """

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    comm: np.ndarray
    transient: np.ndarray
    optimizer_step: np.ndarray
    forward_backward: np.ndarray
    allocated: np.ndarray
    reserved: np.ndarray
    device: np.ndarray
    by_kind: dict[str, dict[str, np.ndarray]] | None = None

    @property
    def overhead(self) -> np.ndarray:
        return self.device - self.allocated

    def peak(self) -> tuple[np.ndarray, np.ndarray]:
        """Per strategy: the largest device total over stages, and the stage where it is."""
        stage = np.argmax(self.device, axis=1)
        return self.device[np.arange(len(stage)), stage], stage
