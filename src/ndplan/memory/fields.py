"""Which fields of a strategy each part of the memory model reads.

Strategies alike in those fields share that part's figures, which are then priced once: the
pipeline shape (a placement and a schedule simulation), the static state (parameters, gradients,
optimizer states), the layer activations. No figure reads ``UNREAD_FIELDS``.
"""

from __future__ import annotations

import numpy as np

from ndplan.strategy.batch import StrategyBatch

#: Strategies with the same values of these fields share a placement and a schedule simulation.
PIPELINE_SHAPE = ("schedule", "pp", "vpp", "seq_chunks", "embedding_as_layer", "output_as_layer")
#: The fields of a strategy that the static state (parameters, gradients, optimizer states) and
#: the runtime overhead read, and with them ``static_lower_bound`` (a test perturbs the others).
STATIC_FIELDS = (
    *PIPELINE_SHAPE, "tp", "cp", "dp", "ep", "etp", "zero", "shard_group", "optimizer_offload", "offload_optimizer_states",
    "num_micro_batches", "pipeline_runs",
)
#: What the static state reads of STATIC_FIELDS: all but the micro-batch counts, of which it reads
#: only whether a step runs more than one (``static_state``: the embedding gradient a DTensor
#: runtime makes whole from the second micro-batch on, the gradients accumulated, the FSDP units'
#: gradients counted with a single one), ``several_micro_batches``. Its tables are priced per
#: combination of these (``SharedStatic``; 1M mixed DeepSeek-V3 strategies: 25,824 priced,
#: against 102,188 of STATIC_FIELDS).
STATE_FIELDS = (*(name for name in STATIC_FIELDS if name not in ("num_micro_batches", "pipeline_runs")),
                "several_micro_batches")


def state_field_columns(batch: StrategyBatch) -> list[np.ndarray]:
    """The columns of STATE_FIELDS (``several_micro_batches``: micro-batches per step > 1)."""
    return [batch.micro_batches_per_step > 1 if name == "several_micro_batches" else getattr(batch, name)
            for name in STATE_FIELDS]


#: The fields of a strategy that no figure of the memory model reads: FSDP is priced as the
#: ZeRO-3 that a valid strategy with ``fsdp`` has, and the global batch is dp · micro-batch size ·
#: micro-batches per step. Strategies that differ only in these are priced once (``group_alike``;
#: a test perturbs them). (A hybrid context-parallel group's Ulysses degree is read: it sets
#: whether the KV heads are repeated before its all-to-all.)
UNREAD_FIELDS = ("fsdp", "global_batch_size")


#: The fields of a strategy that ``layer_activations`` reads (besides the batch's precision).
ACTIVATION_FIELDS = ("tp", "etp", "sequence_parallel", "seq_length", "recompute")
