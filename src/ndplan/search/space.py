"""The search space: candidate values per dimension, enumerated as strategy batches in blocks.

The space is the Cartesian product of the value lists (dp is derived from the device count,
the micro-batch count from the global batch), enumerated by index arithmetic in blocks so that
memory stays bounded whatever the size of the space.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from math import prod

import numpy as np

from ndplan.errors import NdplanError
from ndplan.hardware import Device
from ndplan.model.spec import ModelSpec
from ndplan.strategy.batch import StrategyBatch, encode
from ndplan.strategy.precision import PrecisionPolicy
from ndplan.strategy.strategy import SCHEDULES, Strategy

#: Dimensions a user can search or fix (``--dims`` / ``--fix``).
DIMENSIONS: tuple[str, ...] = (
    "tp", "sp", "cp", "cp_kind", "ep", "etp", "pp", "schedule", "zero", "mbs", "recompute",
)

#: The order ``SearchSpace.blocks`` runs through the dimensions, slowest first.
BLOCK_ORDER: tuple[str, ...] = ("pp", "schedule", *(name for name in DIMENSIONS if name not in ("pp", "schedule")))

#: (schedule, vpp, seq_chunks) combinations the pipeline dimension draws from.
PIPELINE_OPTIONS: tuple[tuple[str, int, int], ...] = (
    ("1f1b", 1, 1), ("interleaved", 2, 1), ("interleaved", 4, 1), ("zb-h1", 1, 1), ("zbv", 2, 1),
    ("dualpipev", 2, 1), ("gpipe", 1, 1), ("seq1f1b", 1, 2), ("seq1f1b", 1, 4),
)


def _strides(sizes: list[int]) -> list[int]:
    """Positions between changes of each dimension's value in the product of ``sizes`` (the
    first slowest): the product of the sizes after it."""
    return [prod(sizes[i + 1:]) for i in range(len(sizes))]


def _periodic(values: np.ndarray, inner: int, start: int, stop: int) -> np.ndarray:
    """``values[(p // inner) % len(values)]`` for the positions p in [start, stop): the column of
    a dimension whose value changes every ``inner`` positions of a product enumerated in order.
    Runs longer than the block are repeated; a shorter period is tiled (copies of rows rather
    than a division per position)."""
    count, period = stop - start, len(values) * inner
    if period >= count:
        first, last = start // inner, (stop - 1) // inner
        lengths = np.full(last - first + 1, inner)
        lengths[0] -= start - first * inner
        lengths[-1] -= (last + 1) * inner - stop
        return np.repeat(values[np.arange(first, last + 1) % len(values)], lengths)
    one = np.repeat(values, inner)
    one = np.tile(one, max(1, 4096 // period))  # rows of a few values tile slowly: widen them first
    offset = start % len(one)
    return np.tile(one, -(-(offset + count) // len(one)))[offset:offset + count]


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """Value lists per dimension; see ``default_space`` for what the defaults cover."""

    tp: tuple[int, ...]
    sp: tuple[int, ...]
    cp: tuple[int, ...]
    cp_kind: tuple[str, ...]
    ep: tuple[int, ...]
    etp: tuple[int, ...]  # 0 means "the same as tp"
    pp: tuple[int, ...]
    schedule: tuple[tuple[str, int, int], ...]
    zero: tuple[int, ...]
    mbs: tuple[int, ...]
    recompute: tuple[str, ...]
    num_devices: int
    global_batch_size: int
    seq_length: int
    precision: PrecisionPolicy
    fixed: dict[str, int | str] = field(default_factory=dict)
    #: What selective recompute re-runs in every candidate (``Strategy.recompute_modules``).
    recompute_modules: tuple[str, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(getattr(self, name)) for name in DIMENSIONS)

    @property
    def size(self) -> int:
        return prod(self.sizes)

    def blocks(self, block_size: int = 1 << 20) -> Iterator[tuple[np.ndarray, StrategyBatch]]:
        """(candidate indices, batch) for blocks that cover the product once each.

        Blocks run through the pipeline dimensions (pp, then the schedule) slowest, so that each
        holds a few pipeline shapes: the memory model pays a fixed cost per shape in a block,
        which in index order (where pp and the schedule vary faster than tp, sp, cp and ep) every
        block would pay for nearly every shape. A candidate's index is unchanged: its position in
        the product of ``DIMENSIONS``.

        In that order each dimension's value changes every so many positions (the product of the
        faster dimensions' sizes), so a block's columns and indices are runs and repetitions of
        short tables, built by copying rather than by dividing every position into digits."""
        sizes = dict(zip(DIMENSIONS, self.sizes, strict=True))
        index_stride = dict(zip(DIMENSIONS, _strides([sizes[name] for name in DIMENSIONS]), strict=True))
        block_stride = dict(zip(BLOCK_ORDER, _strides([sizes[name] for name in BLOCK_ORDER]), strict=True))
        pipeline = self._pipeline_options()
        for start in range(0, self.size, block_size):
            stop = min(start + block_size, self.size)
            index = np.zeros(stop - start, dtype=np.int64)
            for name in DIMENSIONS:
                index += _periodic(np.arange(sizes[name], dtype=np.int64) * index_stride[name], block_stride[name],
                                   start, stop)
            column = {name: _periodic(self._codes(name), block_stride[name], start, stop)
                      for name in DIMENSIONS if name != "schedule"}
            for name, values in zip(("schedule", "vpp", "seq_chunks"), pipeline.T, strict=True):
                column[name] = _periodic(values, block_stride["schedule"], start, stop)
            yield index, self._assemble(column)

    def batch(self, index: np.ndarray) -> StrategyBatch:
        digits = np.unravel_index(index, self.sizes)
        column = {name: self._codes(name)[d] for name, d in zip(DIMENSIONS, digits, strict=True) if name != "schedule"}
        pipeline = self._pipeline_options()[digits[DIMENSIONS.index("schedule")]]
        column |= {"schedule": pipeline[:, 0], "vpp": pipeline[:, 1], "seq_chunks": pipeline[:, 2]}
        return self._assemble(column)

    def _pipeline_options(self) -> np.ndarray:
        """[options, 3]: each pipeline option's (schedule code, vpp, seq_chunks)."""
        return np.asarray([(SCHEDULES.index(s), v, k) for s, v, k in self.schedule], dtype=np.int64)

    def _assemble(self, column: dict[str, np.ndarray]) -> StrategyBatch:
        """The batch of the candidates whose searched values are ``column`` (per dimension, the
        pipeline option as schedule, vpp and seq_chunks; arrays the batch may keep)."""
        tp, pp, cp = column["tp"], column["pp"], column["cp"]
        # Where the devices or the batch do not divide, take the floor (at least 1): the world-size
        # and global-batch rules then reject the candidate and count it, and every index still
        # maps to a well-formed Strategy.
        dp = np.maximum(self.num_devices // (tp * pp * cp), 1)
        mbs = column.pop("mbs")
        micro_batches = np.maximum(self.global_batch_size // (dp * mbs), 1)
        etp = column.pop("etp")
        columns = {
            **column,
            "sequence_parallel": column.pop("sp"),
            "etp": np.where(etp == 0, tp, etp),
            "dp": dp,
            "micro_batch_size": mbs,
            "num_micro_batches": micro_batches,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "fsdp": (column["zero"] == 3).astype(np.int64),
        }
        return StrategyBatch.from_columns(columns, self.precision, owned=True, recompute_modules=self.recompute_modules)

    def duplicates(self, index: np.ndarray) -> np.ndarray:
        """Candidates that are another candidate under a second name: etp "same as tp" when
        tp = 1 (etp = 1 is listed too), a Ulysses context group of size 1 (cp = 1 is ring), and
        a one-chunk pipeline schedule other than 1F1B at pp = 1 (without a pipeline a step is
        gradient accumulation, one micro-batch after another, which 1F1B at pp = 1 stands for;
        where the space lists 1F1B)."""
        # Each condition is a per-value table of one dimension, looked up at the candidate's digit
        # of that dimension alone (not every dimension's: a search asks this of every candidate).
        stride = dict(zip(DIMENSIONS, _strides(list(self.sizes)), strict=True))
        index = np.asarray(index)

        def where(name: str, table: np.ndarray) -> np.ndarray | bool:
            """Per candidate, ``table`` at its value of dimension ``name``."""
            if not table.any() or table.all():
                return bool(table.any())
            return table[(index // stride[name]) % len(table)]

        tp, etp, cp = self._codes("tp"), self._codes("etp"), self._codes("cp")
        same_etp = where("etp", (etp == 0) & (1 in self.etp)) & where("tp", tp == 1)
        ring = encode("cp_kind", "ring")
        same_cp = where("cp", cp == 1) & where("cp_kind", (self._codes("cp_kind") != ring) & (ring in self._codes("cp_kind")))
        # (Schedules of several chunks need pp >= 2 by a rule of their own, which counts them.)
        single = np.asarray([option[1] == 1 and option != ("1f1b", 1, 1) for option in self.schedule])
        no_pipeline = where("pp", self._codes("pp") == 1) & where("schedule", single & (("1f1b", 1, 1) in self.schedule))
        return np.broadcast_to(same_etp | same_cp | no_pipeline, index.shape).copy()

    def _codes(self, name: str) -> np.ndarray:
        """The dimension's values as integers (categorical names as their codes; the pipeline
        dimension as positions in ``schedule``)."""
        values = getattr(self, name)
        if name == "schedule":
            return np.arange(len(values))
        if name in ("cp_kind", "recompute"):
            return np.asarray(encode(name, list(values)), dtype=np.int64)
        return np.asarray(values, dtype=np.int64)

    def strategy(self, candidate: int) -> Strategy:
        return self.batch(np.asarray([candidate])).row(0)


def default_space(
    model: ModelSpec,
    device: Device,
    num_devices: int,
    global_batch_size: int,
    seq_length: int,
    precision: PrecisionPolicy | None = None,
    *,
    dims: tuple[str, ...] | None = None,
    fixed: dict[str, int | str] | None = None,
    recompute_modules: tuple[str, ...] = (),
) -> SearchSpace:
    """Every value the model and cluster allow for the searched dimensions; the others take their
    default (or the ``fixed`` value). TP stays inside the scale-up domain (across nodes it is
    never competitive), EP and ETP follow the expert count, PP the layer count. ``precision``
    defaults to Strategy's (megatron-bf16); ``recompute_modules`` are what its selective-recompute
    candidates re-run (validated as ``Strategy.recompute_modules``)."""
    precision = precision or Strategy().precision
    fixed = dict(fixed or {})
    searched = set(DIMENSIONS if dims is None else dims)
    unknown = (searched | set(fixed)) - set(DIMENSIONS)
    if unknown:
        raise NdplanError(f"unknown search dimension '{sorted(unknown)[0]}'; known: {', '.join(DIMENSIONS)}")
    domain = min(device.scaleup_domain_size, num_devices)
    moe = model.is_moe
    values: dict[str, tuple] = {
        # Values are limited by the cluster only; what the model forbids is left to the rules,
        # so the search can say how many candidates each rule removed.
        "tp": tuple(_divisors(num_devices, domain)),
        "sp": (0, 1),
        "cp": tuple(_divisors(num_devices, 16)),
        "cp_kind": ("ring", "ulysses"),
        "ep": tuple(_divisors(num_devices, model.num_experts)) if moe else (1,),
        "etp": (1, 0) if moe else (0,),
        "pp": tuple(d for d in _divisors(num_devices, model.num_layers)),
        "schedule": PIPELINE_OPTIONS,
        "zero": (0, 1, 2, 3),
        "mbs": tuple(d for d in (1, 2, 4) if global_batch_size % d == 0),
        "recompute": ("none", "selective", "full"),
    }
    defaults: dict[str, tuple] = {
        "tp": (1,), "sp": (0,), "cp": (1,), "cp_kind": ("ring",), "ep": (1,), "etp": (0,), "pp": (1,),
        "schedule": (("1f1b", 1, 1),), "zero": (1,), "mbs": (1,), "recompute": ("none",),
    }
    chosen = {name: values[name] if name in searched else defaults[name] for name in DIMENSIONS}
    for name, value in fixed.items():
        if name == "schedule":
            options = tuple(o for o in PIPELINE_OPTIONS if o[0] == value)
            if not options:
                raise NdplanError(f"--fix schedule={value}: known schedules: {', '.join(SCHEDULES)}")
            chosen[name] = options
        elif name in ("cp_kind", "recompute"):
            chosen[name] = (str(value),)
        elif name == "sp":
            chosen[name] = (1 if str(value).lower() in ("1", "true", "yes", "on") else 0,)
        else:
            chosen[name] = (int(value),)
    if chosen["cp"] == (1,):
        chosen["cp_kind"] = ("ring",)  # the kind means nothing without context parallelism
    empty = [name for name in DIMENSIONS if not chosen[name]]
    if empty:
        raise NdplanError(f"no valid value for '{empty[0]}' with {num_devices} devices and this model")
    return SearchSpace(
        **{name: tuple(chosen[name]) for name in DIMENSIONS},
        num_devices=num_devices, global_batch_size=global_batch_size, seq_length=seq_length,
        precision=precision, fixed=fixed,
        recompute_modules=Strategy(recompute="selective", recompute_modules=recompute_modules).recompute_modules,
    )
