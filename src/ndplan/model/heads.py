"""How a rank's attention heads meet Ulysses context parallelism.

Ulysses scatters heads over its all-to-all group: each rank of the group computes attention for
a share of the heads over the whole sequence. A tensor-parallel rank holds H/tp query heads and
H_kv / min(tp, H_kv) key/value heads (one, where tp exceeds them: Megatron-Core gathers the QKV
output then). Where the group has more ranks than the rank has KV heads, they cannot be
scattered as they are; MindSpeed repeats them first (UlyssesContextAttention, RepeatAll2AllComm:
``seq_world_size > key heads``), Transformer Engine's all-to-all attention refuses
(``search.run``'s runtime limits).
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from ndplan.model.spec import ModelSpec


def rank_kv_heads(model: ModelSpec, tp: np.ndarray | float) -> np.ndarray:
    """Key/value heads on a tensor-parallel rank: H_kv / min(tp, H_kv) (MLA: its up-projected
    keys and values have a head per query head, H/tp)."""
    heads = float(model.split_kv_heads)
    return np.asarray(heads / np.minimum(tp, heads))


#: When the runtime repeats a rank's KV heads before a Ulysses all-to-all: 'needed', where the
#: group outnumbers them (MindSpeed's UlyssesContextAttention), or 'always' (MindSpeed-LLM's
#: --kv-head-repeat-before-uly-alltoall, on by default there: every GQA layer under Ulysses or
#: hybrid CP).
KvRepeat = Literal["needed", "always"]
KV_REPEATS: tuple[str, ...] = get_args(KvRepeat)


def ulysses_kv_repeat(model: ModelSpec, tp: np.ndarray | float, ulysses: np.ndarray | float,
                      when: KvRepeat = "needed") -> np.ndarray:
    """Times each key/value head of a rank is repeated before a Ulysses all-to-all over ``ulysses``
    ranks (1: no Ulysses): MindSpeed repeat_interleaves the rank's K and V up to its query heads
    where the group outnumbers its KV heads (``when`` 'needed'; MindSpeed-LLM wherever there is a
    group: 'always'), and sums the copies' gradients after the backward's all-to-all, so the
    all-to-alls move, and the attention kernel reads and keeps, K and V as wide as the queries:

        repeat = (H/tp) / kv   where u > kv = rank_kv_heads(tp) ('always': u > 1), else 1.
    """
    u = np.asarray(ulysses)
    if model.is_mla or not np.any(u > 1):
        return np.ones(())  # (one, broadcast: a search's batch without Ulysses pays one pass)
    kv = rank_kv_heads(model, tp)
    repeats = (u > 1) if when == "always" else (u > 1) & (u > kv)
    return np.where(repeats, model.num_attention_heads / np.asarray(tp, dtype=np.float64) / kv, 1.0)


def kv_repeat_note(model: ModelSpec, tp: int, ulysses: int, when: KvRepeat = "needed") -> str | None:
    """A line saying that a Ulysses group of ``ulysses`` ranks repeats a tensor-parallel rank's KV
    heads (None where it does not)."""
    repeat = float(ulysses_kv_repeat(model, tp, ulysses, when))
    if repeat <= 1:
        return None
    kv = int(rank_kv_heads(model, tp))
    if when == "always":
        why = ("MindSpeed-LLM (--kv-head-repeat-before-uly-alltoall) repeats every GQA layer's to its query heads "
               f"before the Ulysses all-to-all over {ulysses} ranks")
    else:
        why = (f"fewer than the Ulysses all-to-all's {ulysses} ranks, so MindSpeed's UlyssesContextAttention repeats "
               "them to its query heads first")
    return f"KV heads repeated {repeat:g}x: a tensor-parallel rank holds {kv}, {why} (K and V moved and kept as wide as Q)"
