"""The search space: candidate values per dimension, enumerated as strategy batches in blocks.

The space is the Cartesian product of the value lists (dp is derived from the device count,
the micro-batch count from the global batch), enumerated by index arithmetic in blocks so that
memory stays bounded whatever the size of the space.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from math import isqrt, prod
from numbers import Integral

import numpy as np

from ndplan.errors import NdplanError, did_you_mean
from ndplan.hardware import Device
from ndplan.memory.activations import applicable_modules, applicable_offload_modules
from ndplan.memory.options import MemoryOptions
from ndplan.model.spec import ModelSpec
from ndplan.perf.overlap import OFF_WORDS, ON_WORDS
from ndplan.strategy.batch import StrategyBatch, encode
from ndplan.strategy.precision import PrecisionPolicy, get_precision
from ndplan.strategy.strategy import (
    MAX_DEGREE,
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    RECOMPUTES,
    SCHEDULES,
    Strategy,
    canonical_modules,
    canonical_offload,
)

#: Dimensions a user can search or fix (``--dims`` / ``--fix``). The last three, how many runs of
#: the pipeline schedule a step takes, what selective recompute re-runs and what goes to host
#: memory, are searched only where asked for (see ``default_space``).
DIMENSIONS: tuple[str, ...] = (
    "tp", "sp", "cp", "cp_kind", "ep", "etp", "pp", "schedule", "zero", "mbs", "recompute", "pipeline_runs",
    "offload_layers", "offload_optimizer_states", "optimizer_offload", "recompute_modules", "offload_modules",
)
#: Dimensions searched only where ``dims`` names them.
OPT_IN_DIMENSIONS: tuple[str, ...] = ("pipeline_runs", "offload_layers", "offload_optimizer_states",
                                      "optimizer_offload", "recompute_modules", "offload_modules")
#: Dimensions whose values are module sets, one per batch (``StrategyBatch.recompute_modules``,
#: ``StrategyBatch.offload_modules``).
SET_DIMENSIONS: tuple[str, ...] = ("recompute_modules", "offload_modules")
#: What ``fixed`` may also set: the parts of a pipeline option besides its schedule.
PIPELINE_SHAPE: tuple[str, ...] = ("vpp", "seq_chunks")
#: The context-parallel kinds a search takes fixed (hybrid needs a Ulysses degree). It varies the
#: first two, and all-gather CP where the model has sliding-window layers (``default_space``);
#: elsewhere all-gather CP is what a launch file or ``--fix cp_kind=allgather`` asks for.
SEARCHED_CP_KINDS: tuple[str, ...] = ("ring", "ulysses", "allgather")

#: The order ``SearchSpace.blocks`` runs through the dimensions, slowest first: the module sets
#: first, as a batch shares them.
BLOCK_ORDER: tuple[str, ...] = (
    *SET_DIMENSIONS, "pp", "schedule",
    *(name for name in DIMENSIONS if name not in (*SET_DIMENSIONS, "pp", "schedule")),
)

ModuleSet = tuple[str, ...]

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


#: The dimensions each ``StrategyBatch`` field of a listed candidate is a function of
#: (``SearchSpace._assemble``); fields named nowhere here take one value in a whole space. The
#: search evaluates each rule on the combinations of the dimensions behind the fields it reads
#: (``search.screen``).
FIELD_DIMENSIONS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "sequence_parallel": ("sp",), "cp": ("cp",), "cp_kind": ("cp_kind",), "ep": ("ep",),
    "etp": ("etp", "tp"), "pp": ("pp",), "schedule": ("schedule",), "vpp": ("schedule",),
    "seq_chunks": ("schedule",), "zero": ("zero",), "fsdp": ("zero",), "reshard_after_forward": ("zero", "pp"),
    "micro_batch_size": ("mbs",), "recompute": ("recompute",), "pipeline_runs": ("pipeline_runs",),
    "dp": ("tp", "pp", "cp"), "num_micro_batches": ("tp", "pp", "cp", "mbs", "pipeline_runs"),
    "offload_layers": ("offload_layers",),
    # (a space that carries it applies it where zero is 1: ``_carried_columns``)
    "offload_optimizer_states": ("offload_optimizer_states", "zero"),
    "optimizer_offload": ("optimizer_offload",),
    # The settings a space carries (``SearchSpace.carried``) apply where the candidate's values give them a meaning.
    "shard_group": ("zero",), "recompute_layers": ("recompute",), "ulysses_degree": ("cp_kind",),
}

#: Strategy fields no dimension searches that a space may carry, one value for every candidate
#: (``SearchSpace.carried``: a launch file's, read by ``search --from``). Each applies where it
#: means something: the HSDP shard group to the candidates that shard (zero > 0), the recompute
#: limit to those that recompute, the Ulysses degree to hybrid context parallelism, resharding off
#: to ZeRO-3; where the candidate's other values make it invalid (a shard group that does not
#: divide dp·cp, a limit above a stage's layers, a Ulysses degree that does not divide cp) the
#: rules reject the candidate, counted under the rule's name.
CARRIED_FIELDS: tuple[str, ...] = (
    "shard_group", "reshard_after_forward", "optimizer_offload", "offload_optimizer_states", "recompute_layers",
    "ulysses_degree", "embedding_as_layer", "output_as_layer",
)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``limit`` (default ``n``), ascending: found in pairs (d, n/d)
    with d up to √n, since a scan up to the limit hung on a limit of 10^10 (a long --seq)."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return sorted(d for d in {*small, *(n // d for d in small)} if d <= (limit or n))


def whole_size(value: object, name: str, largest: int) -> int:
    """``value`` as an int where it is a whole number from 1 to ``largest`` (numpy's integers
    too, as ``estimate`` takes them); else an NdplanError naming ``name`` (an argument of
    ``default_space`` or the CLI's flag for it)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 1:
        raise NdplanError(f"{name} must be a whole number >= 1, got {value!r}")
    if int(value) > largest:
        raise NdplanError(f"{name} must be at most {largest:,}, got {value!r}")
    return int(value)


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
    #: Runs of the pipeline schedule a step takes (``Strategy.pipeline_runs``), each over
    #: gbs / (dp·mbs·runs) micro-batches; at pp = 1 every value but 1 is a duplicate of 1.
    pipeline_runs: tuple[int, ...]
    num_devices: int
    global_batch_size: int
    seq_length: int
    precision: PrecisionPolicy
    fixed: dict[str, int | str] = field(default_factory=dict)
    #: Decoder layers whose activations go to host memory (``Strategy.offload_layers``, Megatron-Core's
    #: --cpu-offloading-num-layers); 0 none. Candidates Megatron would not run with theirs (a
    #: pipeline, recompute) fail rule ``offload_layers_run``.
    offload_layers: tuple[int, ...] = (0,)
    #: Whether the optimizer states wait on the host between steps (``Strategy.offload_optimizer_states``,
    #: Megatron-Core's --offload-optimizer-states): 0, 1 or both. Candidates without the distributed
    #: optimizer fail rule ``optimizer_states_offload_needs_distributed_optimizer``.
    offload_optimizer_states: tuple[int, ...] = (0,)
    #: Whether the optimizer runs on the CPU, its states on the host (``Strategy.optimizer_offload``:
    #: Megatron-Core's --optimizer-cpu-offload on its distributed optimizer, FSDP2's CPU offload
    #: under the pytorch runtime): 0, 1 or both; what a runtime cannot run is not runnable there.
    optimizer_offload: tuple[int, ...] = (0,)
    #: What selective recompute re-runs (``Strategy.recompute_modules``; () is the runtime's own
    #: policy): one set, or several to search. A candidate that does not recompute selectively
    #: re-runs nothing, so it is listed under the first set alone (``duplicates``).
    recompute_modules: tuple[ModuleSet, ...] = ((),)
    #: What the candidates offload to host memory (``Strategy.offload_modules``; () nothing): one
    #: set, or several to search. Candidates Megatron-Core would not run with theirs (full
    #: recompute, other schedules) fail rule ``offload_runs``.
    offload_modules: tuple[ModuleSet, ...] = ((),)
    #: Whether FSDP candidates with a pipeline reshard parameters after forward; without one they
    #: always do. torchtitan's default policy does not under a pipeline (each micro-batch would
    #: gather again), which the pytorch runtime follows (``default_space``).
    reshard_under_pipeline: bool = True
    #: Settings no dimension searches, each one value for the whole space (``CARRIED_FIELDS``:
    #: Strategy field names, booleans as 0/1); absent ones take Strategy's defaults.
    carried: dict[str, int] = field(default_factory=dict)
    #: ``Strategy.optimizer_offload_fraction`` of the candidates that offload the optimizer (a
    #: launch's --optimizer-offload-fraction, carried: one share for the whole space).
    optimizer_offload_fraction: float = 1.0

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(getattr(self, name)) for name in DIMENSIONS)

    @property
    def may_use_host(self) -> bool:
        """Whether some candidate offloads to host memory (its optimizer, modules or layers)."""
        return bool(self.carried.get("optimizer_offload") or self.carried.get("offload_optimizer_states")
                    or any(self.offload_layers) or any(self.offload_optimizer_states) or any(self.optimizer_offload)
                    or any(self.offload_modules))

    @property
    def size(self) -> int:
        return prod(self.sizes)

    def blocks(self, block_size: int = 1 << 20) -> Iterator[tuple[np.ndarray, StrategyBatch]]:
        """(candidate indices, batch) for blocks that cover the product once each, but for the
        ``unlisted_duplicates``: every candidate built, duplicates included. The search takes
        ``search.screen.screened_blocks`` instead, the same blocks with only the candidates its
        checks let through built; this plain enumeration is what tests hold it to.

        Blocks run through the pipeline dimensions (pp, then the schedule) slowest, so that each
        holds a few pipeline shapes: the memory model pays a fixed cost per shape in a block,
        which in index order (where pp and the schedule vary faster than tp, sp, cp and ep) every
        block would pay for nearly every shape. A candidate's index is unchanged: its position in
        the product of ``DIMENSIONS``. Slower still run the module sets, one of each per block;
        under every recompute module set but the first only the selective candidates are listed
        (the others are duplicates, ``duplicates``, and counted as such without being listed).

        In that order each dimension's value changes every so many positions (the product of the
        faster dimensions' sizes), so a block's columns and indices are runs and repetitions of
        short tables, built by copying rather than by dividing every position into digits."""
        sizes = dict(zip(DIMENSIONS, self.sizes, strict=True))
        index_stride = dict(zip(DIMENSIONS, _strides([sizes[name] for name in DIMENSIONS]), strict=True))
        pipeline = self._pipeline_options()
        for digits in self.parts():
            block_stride = dict(zip(BLOCK_ORDER, _strides([len(digits[name]) for name in BLOCK_ORDER]), strict=True))
            total = prod(len(d) for d in digits.values())
            for start in range(0, total, block_size):
                stop = min(start + block_size, total)
                index = np.zeros(stop - start, dtype=np.int64)
                for name in DIMENSIONS:
                    index += _periodic(digits[name] * index_stride[name], block_stride[name], start, stop)
                column = {name: _periodic(self._codes(name)[digits[name]], block_stride[name], start, stop)
                          for name in DIMENSIONS if name != "schedule"}
                for name, values in zip(("schedule", "vpp", "seq_chunks"), pipeline[digits["schedule"]].T, strict=True):
                    column[name] = _periodic(values, block_stride["schedule"], start, stop)
                yield index, self._assemble(column)

    def parts(self) -> Iterator[dict[str, np.ndarray]]:
        """The parts of the product ``blocks`` lists, one per pair of module sets in index order:
        per dimension, the digits (positions in its value list) the part's candidates take. Under
        every recompute module set but the first only the selective recompute values are listed
        (the others are duplicates, ``unlisted_duplicates``)."""
        sizes = dict(zip(DIMENSIONS, self.sizes, strict=True))
        selective = [i for i, value in enumerate(self.recompute) if value == "selective"]
        for module_set, offload_set in np.ndindex(sizes["recompute_modules"], sizes["offload_modules"]):
            if module_set and not selective:
                continue
            digits = {name: np.arange(sizes[name], dtype=np.int64) for name in DIMENSIONS}
            digits["recompute_modules"] = np.array([module_set], dtype=np.int64)
            digits["offload_modules"] = np.array([offload_set], dtype=np.int64)
            if module_set:
                digits["recompute"] = np.array(selective, dtype=np.int64)
            yield digits

    @property
    def unlisted_duplicates(self) -> int:
        """Candidates ``blocks`` leaves out: those that do not recompute selectively, under every
        module set but the first (duplicates of the first's)."""
        sets = len(self.recompute_modules)
        per_set = self.size // sets
        listed = sum(1 for value in self.recompute if value == "selective") * per_set // len(self.recompute)
        return (sets - 1) * (per_set - listed)

    def batch(self, index: np.ndarray) -> StrategyBatch:
        """The candidates ``index`` as a batch; they must share their module sets (``batches``
        groups any candidates by theirs)."""
        return self.batch_at(dict(zip(DIMENSIONS, np.unravel_index(index, self.sizes), strict=True)))

    def batch_at(self, digits: dict[str, np.ndarray]) -> StrategyBatch:
        """The batch of the candidates whose digit in each dimension (the position of its value in
        the dimension's list) is ``digits[name]``, arrays of one length."""
        column = {name: self._codes(name)[d] for name, d in digits.items() if name != "schedule"}
        pipeline = self._pipeline_options()[digits["schedule"]]
        column |= {"schedule": pipeline[:, 0], "vpp": pipeline[:, 1], "seq_chunks": pipeline[:, 2]}
        return self._assemble(column)

    def batches(self, index: np.ndarray) -> Iterator[tuple[np.ndarray, StrategyBatch]]:
        """(positions in ``index``, their batch) per pair of module sets, in the order of the sets."""
        index = np.asarray(index, dtype=np.int64)
        pairs = len(self.recompute_modules) * len(self.offload_modules)
        pair = index % pairs  # the fastest digits of an index: (recompute set, offload set)
        for code in range(pairs):
            positions = np.flatnonzero(pair == code) if pairs > 1 else np.arange(len(index))
            if len(positions):
                yield positions, self.batch(index[positions])

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
        runs = column["pipeline_runs"]
        micro_batches = np.maximum(self.global_batch_size // (dp * mbs * runs), 1)
        etp = column.pop("etp")
        shared = {}
        for name in SET_DIMENSIONS:
            code = column.pop(name)
            if len(code) and code.min() != code.max():
                kind = name.removesuffix("_modules")
                raise ValueError(f"candidates of several {kind} module sets in one batch: use SearchSpace.batches")
            shared[name] = getattr(self, name)[int(code[0]) if len(code) else 0]
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
            "reshard_after_forward": 1 if self.reshard_under_pipeline else
            ((column["zero"] != 3) | (pp == 1)).astype(np.int64),
        }
        if self.carried:
            columns |= self._carried_columns(columns)
        return StrategyBatch.from_columns(columns, self.precision, owned=True,
                                          optimizer_offload_fraction=self.optimizer_offload_fraction, **shared)

    def _carried_columns(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray | int]:
        """The ``carried`` settings' columns for the candidates of ``columns``: each where it means
        something (``CARRIED_FIELDS``), else the default; the rules judge the rest."""
        out: dict[str, np.ndarray | int] = {}
        for name, value in self.carried.items():
            if name == "shard_group":
                out[name] = np.where(columns["zero"] > 0, value, 0)
            elif name == "recompute_layers":
                out[name] = np.where(columns["recompute"] != encode("recompute", "none"), value, 0)
            elif name == "ulysses_degree":
                out[name] = np.where(columns["cp_kind"] == encode("cp_kind", "hybrid"), value, 1)
            elif name == "offload_optimizer_states":  # on the distributed optimizer alone (zero 1)
                out[name] = np.where(columns["zero"] == 1, value, 0)
            elif name == "reshard_after_forward":  # on: every candidate; off: the ZeRO-3 ones keep parameters
                out[name] = value or (columns["zero"] != 3).astype(np.int64)
            else:
                out[name] = value
        return out

    def duplicates(self, index: np.ndarray) -> np.ndarray:
        """Candidates that are another candidate under a second name: etp "same as tp" when
        tp = 1 (etp = 1 is listed too), a Ulysses context group of size 1 (cp = 1 is ring), and
        a one-chunk pipeline schedule other than 1F1B at pp = 1 (without a pipeline a step is
        gradient accumulation, one micro-batch after another, which 1F1B at pp = 1 stands for;
        where the space lists 1F1B), several pipeline runs at pp = 1 (again gradient accumulation,
        which one run stands for, where the space lists one), and a recompute other than selective
        under any module set but the first (it re-runs no modules). (ZeRO 1 and 2 without a
        data-parallel group, dp·cp = 1, are ZeRO 0 too: dp is no dimension of the space, so
        ``run_search`` finds those by a check, charged as duplicates.)"""
        # Each condition is a per-value table of one dimension, looked up at the candidate's digit
        # of that dimension alone (not every dimension's: a search asks this of every candidate).
        stride = dict(zip(DIMENSIONS, _strides(list(self.sizes)), strict=True))
        index = np.asarray(index)

        def where(name: str, table: np.ndarray) -> np.ndarray | bool:
            """Per candidate, ``table`` at its value of dimension ``name``."""
            if not table.any() or table.all():
                return bool(table.any())
            return table[(index // stride[name]) % len(table)]

        found: np.ndarray | bool = False
        for term in self.duplicate_terms():
            holds: np.ndarray | bool = True
            for name, table in term.items():
                holds = holds & where(name, table)
            found = found | holds
        return np.broadcast_to(found, index.shape).copy()

    def duplicate_terms(self) -> list[dict[str, np.ndarray]]:
        """What ``duplicates`` says, as terms of which a duplicate meets at least one: each a
        table per value of a few dimensions, all of which the candidate's values must meet."""
        tp, etp, cp = self._codes("tp"), self._codes("etp"), self._codes("cp")
        ring = encode("cp_kind", "ring")
        # (Schedules of several chunks need pp >= 2 by a rule of their own, which counts them.)
        single = np.asarray([option[1] == 1 and option != ("1f1b", 1, 1) for option in self.schedule])
        runs = self._codes("pipeline_runs")
        no_pipeline = self._codes("pp") == 1
        selective = encode("recompute", "selective")
        return [
            {"etp": (etp == 0) & (1 in self.etp), "tp": tp == 1},
            {"cp": cp == 1, "cp_kind": (self._codes("cp_kind") != ring) & (ring in self._codes("cp_kind"))},
            {"pp": no_pipeline, "schedule": single & (("1f1b", 1, 1) in self.schedule)},
            {"pp": no_pipeline, "pipeline_runs": (runs > 1) & (1 in runs)},
            {"recompute": self._codes("recompute") != selective, "recompute_modules": self._codes("recompute_modules") > 0},
        ]

    def _codes(self, name: str) -> np.ndarray:
        """The dimension's values as integers (categorical names as their codes; the pipeline
        dimension as positions in ``schedule``)."""
        values = getattr(self, name)
        if name in ("schedule", *SET_DIMENSIONS):
            return np.arange(len(values))
        if name in ("cp_kind", "recompute"):
            return np.asarray(encode(name, list(values)), dtype=np.int64)
        return np.asarray(values, dtype=np.int64)

    def strategy(self, candidate: int) -> Strategy:
        """The strategy at index ``candidate`` of the space (enumeration order)."""
        return self.batch(np.asarray([candidate])).row(0)

    def strategies(self, index: np.ndarray) -> list[Strategy]:
        """The strategies at ``index`` (enumeration order), in that order: one batch per pair of
        module sets rather than one per candidate (building a batch costs ~0.1 ms however short)."""
        out: list[Strategy | None] = [None] * len(index)
        for positions, batch in self.batches(np.asarray(index, dtype=np.int64)):
            for i, position in enumerate(positions.tolist()):
                out[position] = batch.row(i)
        return [strategy for strategy in out if strategy is not None]

    def selective_modules(self, candidate: int) -> ModuleSet:
        """What selective recompute re-runs for ``candidate`` (where it recomputes otherwise, the
        first set's: a balancer's selective option for it)."""
        # The module sets are the last of DIMENSIONS: the fastest-varying digits of an index.
        return self.recompute_modules[candidate // len(self.offload_modules) % len(self.recompute_modules)]


def default_space(
    model: ModelSpec | str,
    device: Device | str,
    num_devices: int,
    global_batch_size: int,
    seq_length: int,
    precision: PrecisionPolicy | str | None = None,
    *,
    dims: Sequence[str] | None = None,
    fixed: dict[str, int | str] | None = None,
    recompute_modules: Sequence[str] | Sequence[Sequence[str]] = (),
    offload_modules: Sequence[str] | Sequence[Sequence[str]] = (),
    reshard_under_pipeline: bool = True,
    carried: Mapping[str, int | bool | float] | None = None,
) -> SearchSpace:
    """Every value the model and cluster allow for the searched dimensions; the others take their
    default (or the ``fixed`` value). TP stays inside the scale-up domain (across nodes it is
    never competitive), EP and ETP follow the expert count, PP the layer count. ``precision``
    defaults to Strategy's (megatron-bf16). ``dims``: the dimensions searched (one may be given
    as a str).

    ``recompute_modules``: what the selective-recompute candidates re-run (Megatron-Core's
    ``--recompute-modules``, runtime megatron): one set of names, or several sets to search
    (each validated as ``Strategy.recompute_modules``; () is the runtime's own policy; a str is
    one set's label, "layernorm+moe_act", as ``parse_module_set`` reads it). The
    module sets are searched where several are given, or where ``dims`` names
    "recompute_modules" (then ``module_sets(model, "common")``); without ``dims`` they are
    not, as each set prices the selective candidates again and the default runtime (pytorch)
    has no modules. ``offload_modules``, likewise: what the candidates offload to host memory
    (Megatron-Core's ``--offload-modules``, runtime megatron), one set of names or several sets
    to search (() offloads nothing); ``dims`` naming "offload_modules" searches
    ``offload_sets(model)``. ``reshard_under_pipeline``: whether FSDP candidates with a pipeline
    reshard parameters after forward (Megatron-FSDP does; torchtitan's default policy, and so the
    pytorch runtime, does not: ``runtime_reshard_under_pipeline``). ``carried``: settings no
    dimension searches, one value for every candidate (``CARRIED_FIELDS``, Strategy field names:
    a launch file's HSDP shard group, recompute limit, ...), each applied where the candidate's
    values give it a meaning; the rules reject the candidates it is invalid for."""
    from ndplan.hardware import as_device
    from ndplan.model import as_model

    model, device = as_model(model), as_device(device)
    # Strategy's caps (strategy.py says why): past them the space's int64 columns overflowed.
    num_devices = whole_size(num_devices, "num_devices", MAX_DEGREE)
    global_batch_size = whole_size(global_batch_size, "global_batch_size", MAX_SEQUENCES)
    seq_length = whole_size(seq_length, "seq_length", MAX_SEQ_LENGTH)
    # A name, as Strategy and the CLI take it (an unknown one is an error naming the known ones).
    precision = get_precision(precision) if isinstance(precision, str) else precision or Strategy().precision
    if not isinstance(precision, PrecisionPolicy):
        raise NdplanError(f"precision must be a precision policy or its name, got {precision!r}")
    if fixed is not None and not isinstance(fixed, Mapping):
        raise NdplanError(f"fixed must be a mapping of dimension names to values (e.g. {{'tp': 8}}), "
                          f"got {type(fixed).__name__}")
    fixed = dict(fixed or {})
    # The optimizer offload's share is a float, one for the space (``optimizer_offload_fraction``);
    # the other carried settings are ints.
    fraction: float = 1.0
    if isinstance(carried, Mapping) and "optimizer_offload_fraction" in carried:
        carried = dict(carried)
        share = carried.pop("optimizer_offload_fraction")
        try:  # (a share, as a strategy that offloads takes it)
            fraction = Strategy(optimizer_offload=True, optimizer_offload_fraction=share).optimizer_offload_fraction
        except ValueError as error:
            raise NdplanError(f"carried optimizer_offload_fraction={share!r}: {error}") from None
    constants = _carried(carried or {})
    given = _module_sets(recompute_modules)
    if "recompute_modules" in fixed:
        given = (parse_module_set(str(fixed["recompute_modules"])),)
    offloads = _offload_sets(offload_modules)
    if "offload_modules" in fixed:
        offloads = (parse_offload_set(str(fixed["offload_modules"])),)
    # A module the model does not have re-runs (or moves) nothing: its set would be ranked beside
    # the strategies without it, with the same figures.
    for what, sets, applicable in (("recompute", given, applicable_modules(model)),
                                   ("offload", offloads, applicable_offload_modules(model))):
        for module_set in sets:
            absent = [m for m in module_set if m not in applicable]
            if absent:
                raise NdplanError(f"{what} module set '{'+'.join(module_set)}': {absent[0]} {what}s nothing in "
                                  f"{model.name} (it has no such module); its modules: {', '.join(applicable)}")
    searched = set(DIMENSIONS if dims is None else (dims,) if isinstance(dims, str) else dims)  # "tp": one dimension
    if dims is None:
        searched -= set(OPT_IN_DIMENSIONS)
    unknown = (searched - set(DIMENSIONS)) | (set(fixed) - set(DIMENSIONS) - set(PIPELINE_SHAPE))
    if unknown:
        first = sorted(unknown)[0]
        known = (*DIMENSIONS, *PIPELINE_SHAPE) if first in fixed else DIMENSIONS
        raise NdplanError(f"unknown search dimension '{first}'{did_you_mean(first, known)}; known: {', '.join(known)}"
                          + ("" if first in fixed else f" (--fix also takes {' and '.join(PIPELINE_SHAPE)})"))
    # A pipeline option is (schedule, vpp, seq_chunks): a fixed vpp or seq_chunks narrows the
    # schedules to the options with it, or, with the schedule fixed too, makes that option (a
    # launch file's vpp 5 is no option of the searched ones).
    shape = {name: _fixed_degree(name, fixed[name]) for name in PIPELINE_SHAPE if name in fixed}
    domain = min(device.scaleup_domain_size, num_devices)
    moe = model.is_moe
    values: dict[str, tuple] = {
        # Values are limited by the cluster only; what the model forbids is left to the rules,
        # so the search can say how many candidates each rule removed.
        "tp": tuple(_divisors(num_devices, domain)),
        "sp": (0, 1),
        # Context parallelism up to 16 ranks, more for long sequences: as many as keep 8K tokens
        # each (a 1M-token sequence fits nowhere on 16).
        "cp": tuple(_divisors(num_devices, max(16, seq_length // 8192))),
        # All-gather CP too where the model has sliding-window layers: Transformer Engine runs
        # them under CP as Ulysses or all-gather alone (search.run.te_cp_kinds).
        "cp_kind": ("ring", "ulysses", "allgather") if model.sliding_layers()[0] else ("ring", "ulysses"),
        "ep": tuple(_divisors(num_devices, model.num_experts)) if moe else (1,),
        "etp": (1, 0) if moe else (0,),
        "pp": tuple(d for d in _divisors(num_devices, model.num_layers)),
        "schedule": PIPELINE_OPTIONS,
        "zero": (0, 1, 2, 3),
        "mbs": tuple(d for d in (1, 2, 4) if global_batch_size % d == 0),
        "recompute": ("none", "selective", "full"),
        # torchtitan and NeMo AutoModel accumulate gradients over runs of the schedule: fewer
        # micro-batches in flight and fewer receive buffers, a bubble per run.
        "pipeline_runs": tuple(d for d in (1, 2, 4, 8) if global_batch_size % d == 0),
        # Megatron-Core's layer offload: none, or an eighth of the layers up to three quarters.
        "offload_layers": offload_layer_counts(model),
        # The optimizer states on the device, or on the host between steps (back for the step).
        "offload_optimizer_states": (0, 1),
        # The optimizer on the device, or on the CPU with its states on the host.
        "optimizer_offload": (0, 1),
        "recompute_modules": given if len(given) > 1 else _distinct((*given, *module_sets(model, "common"))),
        "offload_modules": offloads if len(offloads) > 1 else _distinct((*offloads, *offload_sets(model))),
    }
    defaults: dict[str, tuple] = {
        "tp": (1,), "sp": (0,), "cp": (1,), "cp_kind": ("ring",), "ep": (1,), "etp": (0,), "pp": (1,),
        "schedule": (("1f1b", 1, 1),), "zero": (1,), "mbs": (1,), "recompute": ("none",), "pipeline_runs": (1,),
        "offload_layers": (0,), "offload_optimizer_states": (0,), "optimizer_offload": (0,),
        "recompute_modules": given,
        "offload_modules": offloads,
    }
    for name, sets in (("recompute_modules", given), ("offload_modules", offloads)):
        if len(sets) > 1:
            searched.add(name)
        if name in fixed:
            searched.discard(name)
    chosen = {name: values[name] if name in searched else defaults[name] for name in DIMENSIONS}
    for name, value in fixed.items():
        if name in SET_DIMENSIONS or name in PIPELINE_SHAPE:
            continue  # parsed above
        if name == "schedule":
            options = tuple(o for o in PIPELINE_OPTIONS if o[0] == value)
            if not options:
                raise NdplanError(f"--fix schedule={value}: known schedules: {', '.join(SCHEDULES)}")
            if shape:
                options = ((str(value), shape.get("vpp", options[0][1]), shape.get("seq_chunks", options[0][2])),)
            chosen[name] = options
        elif name in ("cp_kind", "recompute"):
            # Hybrid context parallelism needs a Ulysses degree, which the search does not vary.
            allowed = SEARCHED_CP_KINDS if name == "cp_kind" else RECOMPUTES
            if name == "cp_kind" and constants.get("ulysses_degree", 1) > 1:
                allowed = (*allowed, "hybrid")  # the carried Ulysses degree makes hybrid a whole setting
            if str(value) not in allowed:
                raise NdplanError(f"--fix {name}={value}: allowed values are {', '.join(allowed)}")
            chosen[name] = (str(value),)
        elif name in ("sp", "offload_optimizer_states", "optimizer_offload"):
            chosen[name] = (_switch(name, value),)
        else:
            chosen[name] = (_fixed_degree(name, value),)
    if shape and "schedule" not in fixed:
        options = chosen["schedule"]
        chosen["schedule"] = tuple(o for o in options
                                   if o[1] == shape.get("vpp", o[1]) and o[2] == shape.get("seq_chunks", o[2]))
        if not chosen["schedule"]:
            stated = " ".join(f"{name}={value}" for name, value in shape.items())
            listed = ", ".join(f"{o[0]} vpp {o[1]}" + (f", {o[2]} sub-sequences" if o[2] > 1 else "") for o in options)
            how = "fix the schedule too (e.g. schedule=interleaved)" if "schedule" in searched else "search the schedule"
            raise NdplanError(f"--fix {stated}: no pipeline option of this space has it ({listed}); {how}")
    # Module sets re-run modules only under selective recompute: chosen (fixed or searched) with
    # recompute neither searched nor fixed, selective joins; with recompute fixed otherwise, the
    # sets would be priced as nothing at all.
    sets_chosen = "recompute_modules" in fixed or "recompute_modules" in searched
    if sets_chosen and "selective" not in chosen["recompute"]:
        if "recompute" in fixed:
            raise NdplanError(f"recompute modules are re-run by selective recompute only, and recompute is fixed to "
                              f"{fixed['recompute']}: fix recompute=selective, or search recompute")
        chosen["recompute"] = ("selective",) if "recompute_modules" in fixed else (*chosen["recompute"], "selective")
    if chosen["cp"] == (1,):
        chosen["cp_kind"] = ("ring",)  # the kind means nothing without context parallelism
    empty = [name for name in DIMENSIONS if not chosen[name]]
    if empty:
        raise NdplanError(f"no valid value for '{empty[0]}' with {num_devices} devices and this model")
    return SearchSpace(
        **{name: tuple(chosen[name]) for name in DIMENSIONS},
        num_devices=num_devices, global_batch_size=global_batch_size, seq_length=seq_length,
        precision=precision, fixed=fixed, reshard_under_pipeline=reshard_under_pipeline, carried=constants,
        optimizer_offload_fraction=fraction,
    )


def _carried(carried: Mapping[str, int | bool | float]) -> dict[str, int]:
    """``carried`` as ints (booleans 0/1) in Strategy's ranges, leaving out Strategy's defaults;
    an unknown name or a bad value is an NdplanError."""
    if not isinstance(carried, Mapping):
        raise NdplanError(f"carried must be a mapping of Strategy field names to values, got {type(carried).__name__}")
    out: dict[str, int] = {}
    for name, value in carried.items():
        if name not in CARRIED_FIELDS:
            raise NdplanError(f"a search space carries none of '{name}'{did_you_mean(name, CARRIED_FIELDS)}; "
                              f"it carries {', '.join(CARRIED_FIELDS)}")
        # (checked on a strategy it can apply to: the states offload needs the distributed optimizer)
        context = {"zero": 1} if name == "offload_optimizer_states" else {}
        try:
            checked = getattr(Strategy(**context, **{name: value}), name)
        except ValueError as error:  # pydantic's ValidationError is a ValueError
            raise NdplanError(f"carried {name}={value!r}: {error}") from None
        # (Resharding on is the default of a strategy, not of a space: ``reshard_under_pipeline``.)
        if checked != getattr(Strategy(), name) or name == "reshard_after_forward":
            out[name] = int(checked)
    return out


def runtime_reshard_under_pipeline(options: MemoryOptions) -> bool:
    """Whether the runtime's FSDP reshards parameters after forward under a pipeline: not under
    torch.distributed.pipelining (torchtitan's default policy, where gathered parameters stay for
    the run anyway, ``pipeline_defers_fsdp_reduce``), else yes."""
    return not options.profile.pipeline_defers_fsdp_reduce


def offload_layer_counts(model: ModelSpec) -> tuple[int, ...]:
    """The layer-offload counts a search tries: 0, and 1/8 to 6/8 of the model's layers (each
    at least 1, below the layers, without repeats)."""
    layers = model.num_layers
    return tuple(dict.fromkeys([0, *(max(layers * k // 8, 1) for k in range(1, 7) if max(layers * k // 8, 1) < layers)]))


def _switch(name: str, value: int | str) -> int:
    """A --fix on/off value as 1 or 0, or an error naming the spellings."""
    text = str(value).strip().lower()
    if text not in ON_WORDS + OFF_WORDS:
        raise NdplanError(f"--fix {name}={value}: write one of {', '.join(ON_WORDS)} or {', '.join(OFF_WORDS)}")
    return int(text in ON_WORDS)


def _fixed_degree(name: str, value: int | str) -> int:
    """A --fix whole-number value in its range (zero 0–3, etp 0–2^20: 0 means tp; mbs and
    pipeline_runs 1–2^30, as Strategy's fields; other degrees 1–2^20, ``MAX_DEGREE``: a degree
    above the devices never holds, and past int64 it overflowed)."""
    low, high = {"zero": (0, 3), "etp": (0, MAX_DEGREE), "mbs": (1, MAX_SEQUENCES),
                 "pipeline_runs": (1, MAX_SEQUENCES), "offload_layers": (0, MAX_DEGREE)}.get(name, (1, MAX_DEGREE))
    try:
        number = int(str(value).strip())
    except ValueError:
        raise NdplanError(f"--fix {name}={value}: a whole number is needed") from None
    if not low <= number <= high:
        bounds = f"{low}–{high}" if name == "zero" else f"at least {low} and at most {high:,}"
        raise NdplanError(f"--fix {name}={value}: {name} must be {bounds}")
    return number


#: What ``parse_offload_set`` reads as offloading nothing.
NO_OFFLOAD_SET = "none"


def _offload_set(names: Sequence[str]) -> ModuleSet:
    """``names`` as ``Strategy.offload_modules`` spells them, or an error naming the allowed ones."""
    unknown = sorted(set(names) - set(OFFLOAD_MODULES))
    if unknown:
        raise NdplanError(f"unknown offload module '{unknown[0]}'; known: {', '.join(OFFLOAD_MODULES)}")
    return canonical_offload(names)


def parse_offload_set(text: str) -> ModuleSet:
    """An offload set from its label: names joined by '+' or ',' ("expert_fc1+moe_act"), or
    "none" for no offload. Unknown names raise ``NdplanError`` naming the known."""
    if text.strip() == NO_OFFLOAD_SET:
        return ()
    names = tuple(name.strip() for name in text.replace(",", "+").split("+") if name.strip())
    if not names:
        raise NdplanError(f"offload set '{text}': name modules ({', '.join(OFFLOAD_MODULES)}, joined by '+') "
                          f"or '{NO_OFFLOAD_SET}'")
    return _offload_set(names)


def _offload_sets(value: Sequence[str] | Sequence[Sequence[str]]) -> tuple[ModuleSet, ...]:
    """One offload set (names, or one label as ``parse_offload_set`` reads it: a str is not split
    into characters) or several (sequences of names) as distinct canonical sets."""
    if isinstance(value, str):
        return (parse_offload_set(value),)
    if all(isinstance(item, str) for item in value):
        return (_offload_set(value),)  # type: ignore[arg-type]
    return _distinct(tuple(_offload_set(names) for names in value))


def offload_sets(model: ModelSpec) -> tuple[ModuleSet, ...]:
    """Offload sets worth searching for ``model``, () (no offload) first: the routed experts'
    inputs (the largest tensors of a MoE layer, Megatron's documented example), the attention
    core's q, k, v and output, the two together, and every module that moves something in the
    model (``Strategy.offload_modules``; the norms only where they are their own modules)."""
    experts = ("expert_fc1", "moe_act") if model.is_moe else ()
    attention = ("core_attn", "attn_proj")
    every = applicable_offload_modules(model)
    return _distinct(((), *(_offload_set(s) for s in (experts, attention, (*attention, *experts), every) if s)))


#: Names ``parse_module_set`` reads as the runtime's own selective policy (no modules).
DEFAULT_MODULE_SET = "default"


def parse_module_set(text: str) -> ModuleSet:
    """A module set from its label: names joined by '+' or ',' ("layernorm+moe_act"), or
    "default" for the runtime's own policy. Unknown names raise ``NdplanError`` naming the known."""
    if text.strip() == DEFAULT_MODULE_SET:
        return ()
    names = tuple(name.strip() for name in text.replace(",", "+").split("+") if name.strip())
    unknown = [name for name in names if name not in RECOMPUTE_MODULES]
    if unknown or not names:
        raise NdplanError(f"recompute module set '{text}': unknown module '{unknown[0] if unknown else ''}'; known: "
                          f"{', '.join(RECOMPUTE_MODULES)} (joined by '+'), or '{DEFAULT_MODULE_SET}'")
    return canonical_modules(names)


def _module_sets(value: Sequence[str] | Sequence[Sequence[str]]) -> tuple[ModuleSet, ...]:
    """One set (names, or one label as ``parse_module_set`` reads it: a str is not split into
    characters) or several (sequences of names) as distinct canonical sets."""
    if isinstance(value, str):
        return (parse_module_set(value),)
    if all(isinstance(item, str) for item in value):
        sets: list[Sequence[str]] = [tuple(value)]  # type: ignore[arg-type]
    else:
        sets = [tuple(item) for item in value]
    for names in sets:
        unknown = [name for name in names if name not in RECOMPUTE_MODULES]
        if unknown:
            raise NdplanError(f"unknown recompute module '{unknown[0]}'; known: {', '.join(RECOMPUTE_MODULES)}")
    return _distinct(tuple(canonical_modules(names) for names in sets))


def _distinct(sets: tuple[ModuleSet, ...]) -> tuple[ModuleSet, ...]:
    return tuple(dict.fromkeys(sets))


def module_sets(model: ModelSpec, which: str = "common") -> tuple[ModuleSet, ...]:
    """Module sets worth searching for ``model``, () (the runtime's own policy) first.

    "common": the cheap modules together (the norms, the experts' activation, MLA's
    up-projections: memory-bound ops or small GEMMs that hold large tensors), then with the
    attention core, then with the whole MLP or MoE block, then all of those: 5 sets at most.
    "all": every subset of ``applicable_modules``, less those naming "moe" beside "moe_act" or
    "shared_experts" (the MoE block re-runs those already): 79 sets for DeepSeek-V3.
    ("core_attn",) alone is left out of both: it is the default, ()."""
    applicable = applicable_modules(model)
    # () is Megatron's default policy, the attention core alone: ("core_attn",) would price it twice.
    if which == "all":
        subsets = [tuple(c) for k in range(1, len(applicable) + 1) for c in combinations(applicable, k)]
        return ((), *(s for s in subsets if not ("moe" in s and {"moe_act", "shared_experts"} & set(s))
                      and s != ("core_attn",)))
    if which != "common":
        raise NdplanError(f"module sets '{which}': known: common, all")
    cheap = tuple(m for m in ("layernorm", "moe_act", "mla_up_proj") if m in applicable)
    block = tuple(m for m in ("mlp", "moe") if m in applicable)
    with_block = tuple(m for m in cheap if not ("moe" in block and m == "moe_act")) + block
    sets = (cheap, ("core_attn", *cheap), with_block, ("core_attn", *with_block))
    return _distinct(((), *(canonical_modules(s) for s in sets if s and s != ("core_attn",))))
