"""The census record: what one decoder-layer kind keeps for backward, per token, as measured.

Pure Python on purpose (no torch): the memory estimator reads census files without the optional
``census`` extra installed. ``ndplan.census.measure`` writes these records; see docs/census.md.

All measured values are BYTES PER TOKEN, where a token is one position of one sequence of the
micro-batch (tokens = micro_batch_size * seq_length).

Tensor-parallel split. The census measures each layer twice: at TP 1 (the real config) and at a
simulated TP 2 (attention heads, KV heads, FFN and expert widths halved; for the output layer the
vocabulary is halved, as vocab-parallel cross-entropy does). It models the saved bytes at TP t as

    saved(t) = replicated + tp_scaled / t

so that with S1 = saved(1) and S2 = saved(2):

    S1 - S2    = tp_scaled / 2        =>  tp_scaled  = 2 * (S1 - S2)
    replicated = S1 - tp_scaled        =  2 * S2 - S1

and, by construction, tp_scaled / 2 + replicated == S2. ``replicated`` is what every TP rank keeps
whole (norms, the residual stream, router logits, MLA latents); under sequence parallelism most of
it is split along the sequence as well, which is the estimator's business, not the census's.

Sequence-length dependence. Each value is measured at ``seq_length`` and at ``seq_length // 2``.
Per token it is modelled as ``a + c * s`` (total bytes = a*b*s + c*b*s^2): ``c`` (the
``*_per_seq`` coefficients) is about 0 for flash/SDPA attention, and the attention-probability term
for eager attention. The headline values are the ones at ``seq_length``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ndplan.errors import NdplanError, parse_nested, read_text

SCHEMA_VERSION = 1

#: Layer kinds the census knows by name. Other names are allowed (suffixes such as "-sliding" for
#: models that mix attention types), these are the ones ndplan's presets produce.
KNOWN_LAYER_KINDS = ("dense", "moe", "mla-dense", "mla-moe", "output")


@dataclass(frozen=True)
class SavedOp:
    """One storage kept for backward: which op produced it, in which submodule, and its size."""

    op: str  # the aten op that produced the storage, e.g. "aten.mm", or "input" for the layer input
    bytes_per_token: float
    module: str = ""  # submodule path inside the layer, e.g. "self_attn.q_proj"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    # How its size grows with the sequence: "token" (linear in b*s), "token*seq" (b*s^2, eager
    # attention probabilities) or "constant" (per layer; counted in saved_constant_bytes, not per token).
    scaling: str = "token"


@dataclass(frozen=True)
class Recompute:
    """The measured values under one recompute policy (none, full, or selective)."""

    saved_bytes_per_token: float
    saved_tp_scaled_bytes_per_token: float
    saved_replicated_bytes_per_token: float
    backward_peak_extra_bytes_per_token: float
    # c in "per token = a + c * s" (bytes per token per position of sequence length); ~0 unless eager.
    saved_bytes_per_token_per_seq: float = 0.0
    backward_peak_extra_bytes_per_token_per_seq: float = 0.0
    # Saved storages whose size does not depend on the tokens (bytes per layer, not per token).
    saved_constant_bytes: float = 0.0


@dataclass(frozen=True)
class CensusRecord:
    """What one layer kind of one model keeps for backward, per token."""

    model: str
    model_type: str
    layer_kind: str
    num_layers: int  # how many of the model's layers are of this kind (1 for "output")
    hidden_size: int
    seq_length: int
    micro_batch_size: int
    dtype: str
    attention: str  # the transformers attn_implementation: "sdpa" or "eager"
    torch_version: str
    transformers_version: str
    # No recompute: what autograd keeps.
    saved_bytes_per_token: float
    saved_tp_scaled_bytes_per_token: float
    saved_replicated_bytes_per_token: float
    backward_peak_extra_bytes_per_token: float
    full_recompute: Recompute
    selective: Recompute
    saved_bytes_per_token_per_seq: float = 0.0
    backward_peak_extra_bytes_per_token_per_seq: float = 0.0
    saved_constant_bytes: float = 0.0  # per layer, not per token (see Recompute)
    # Saved once per model, not per layer: tensors every layer shares (rotary cos/sin, masks).
    shared_saved_bytes_per_token: float = 0.0
    experts: str = ""  # the transformers experts_implementation for MoE kinds ("grouped_mm"), else ""
    attention_kernel: str = ""  # the aten attention op that ran, e.g. "aten._scaled_dot_product_flash_attention_for_cpu"
    saved_ops: tuple[SavedOp, ...] = ()
    notes: str = ""
    #: The measured model's ``ModelSpec.layer_architecture()``: what decides whether the record
    #: prices another model's layers, whatever its name. () where the census could not read the
    #: config as a ModelSpec (the name decides then).
    architecture: tuple[tuple[str, Any], ...] = ()
    schema_version: int = SCHEMA_VERSION

    @property
    def no_recompute(self) -> Recompute:
        """The no-recompute values as a ``Recompute``, like ``full_recompute`` and ``selective``."""
        return Recompute(
            saved_bytes_per_token=self.saved_bytes_per_token,
            saved_tp_scaled_bytes_per_token=self.saved_tp_scaled_bytes_per_token,
            saved_replicated_bytes_per_token=self.saved_replicated_bytes_per_token,
            backward_peak_extra_bytes_per_token=self.backward_peak_extra_bytes_per_token,
            saved_bytes_per_token_per_seq=self.saved_bytes_per_token_per_seq,
            backward_peak_extra_bytes_per_token_per_seq=self.backward_peak_extra_bytes_per_token_per_seq,
            saved_constant_bytes=self.saved_constant_bytes,
        )

    def saved_at(self, tp: int = 1, seq_length: int | None = None, policy: str = "none") -> float:
        """Saved bytes per token under ``policy`` ("none", "full", "selective") at TP ``tp``.

        ``seq_length`` moves the per-token value along its measured sequence-length slope (the eager
        attention term: attention probabilities are per head, so that term is split by TP too).
        """
        r = self.policy(policy)
        if tp < 1:
            raise NdplanError(f"tp must be >= 1, got {tp}")
        s = self.seq_length if seq_length is None else seq_length
        base = r.saved_replicated_bytes_per_token + r.saved_tp_scaled_bytes_per_token / tp
        return base + r.saved_bytes_per_token_per_seq * (s - self.seq_length) / tp

    def policy(self, name: str) -> Recompute:
        if name == "none":
            return self.no_recompute
        if name == "full":
            return self.full_recompute
        if name == "selective":
            return self.selective
        raise NdplanError(f"unknown recompute policy {name!r}: expected none, full or selective")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["saved_ops"] = [
            {k: (list(v) if k == "shape" else v) for k, v in asdict(op).items()} for op in self.saved_ops
        ]
        d["architecture"] = dict(self.architecture)
        # schema_version first, for humans reading the file.
        return {"schema_version": d.pop("schema_version"), **d}


# --------------------------------------------------------------------------------------------------
# JSON


def to_json(records: list[CensusRecord] | CensusRecord, *, indent: int | None = 2) -> str:
    """A census file's text: ``{"schema_version": 1, "records": [...]}``."""
    recs = [records] if isinstance(records, CensusRecord) else list(records)
    return json.dumps(
        {"schema_version": SCHEMA_VERSION, "records": [r.to_dict() for r in recs]}, indent=indent
    )


def from_json(text: str, *, source: str = "census JSON") -> list[CensusRecord]:
    """Parse a census file's text (the ``to_json`` form, a bare list of records, or one record)."""
    try:
        data = parse_nested(json.loads, text, source, "JSON")
    except json.JSONDecodeError as e:
        raise NdplanError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and "records" in data:
        version = data.get("schema_version", SCHEMA_VERSION)
        _check_version(version, f"{source}: field 'schema_version'")
        items = data["records"]
        if not isinstance(items, list):
            raise NdplanError(f"{source}: field 'records' must be a list, got {type(items).__name__}")
    elif isinstance(data, list):
        items = data
    elif isinstance(data, dict):
        items = [data]
    else:
        raise NdplanError(f"{source}: expected an object with 'records' or a list of records")
    return [_record_from_dict(item, f"{source}: record {i}") for i, item in enumerate(items)]


def load_census_file(path: str | Path) -> list[CensusRecord]:
    """Read a census JSON file; NdplanError (naming the field) if it is malformed."""
    p = Path(path)
    try:
        text = read_text(p)
    except OSError as e:
        raise NdplanError(f"cannot read census file {p}: {e.strerror or e}") from None
    records = from_json(text, source=f"census file {p}")
    if not records:  # priced as if no census were given, silently
        raise NdplanError(f"census file {p}: holds no records, so it would replace nothing (measure one with "
                          "`ndplan census MODEL --out FILE`)")
    return records


def save_census_file(path: str | Path, records: list[CensusRecord]) -> None:
    p = Path(path)
    try:
        p.write_text(to_json(records) + "\n", encoding="utf-8")
    except OSError as e:  # a missing folder was a traceback from `python -m ndplan.census --out`
        raise NdplanError(f"cannot write census file {p}: {e.strerror or e}") from None


# --------------------------------------------------------------------------------------------------
# validation

_RECOMPUTE_FIELDS = (
    "saved_bytes_per_token",
    "saved_tp_scaled_bytes_per_token",
    "saved_replicated_bytes_per_token",
    "backward_peak_extra_bytes_per_token",
)


def _check_version(v: Any, where: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise NdplanError(f"{where} must be an integer, got {v!r}")
    if v != SCHEMA_VERSION:
        raise NdplanError(f"{where} is {v}; this ndplan reads census schema version {SCHEMA_VERSION}")


def _get(d: dict[str, Any], key: str, where: str, *, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise NdplanError(f"{where}: missing field '{key}'")
        return default
    return d[key]


def _num(d: dict[str, Any], key: str, where: str, *, default: Any = ..., nonneg: bool = False) -> float:
    v = _get(d, key, where, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise NdplanError(f"{where}: field '{key}' must be a finite number, got {v!r}")
    if nonneg and v < 0:
        raise NdplanError(f"{where}: field '{key}' must be >= 0, got {v!r}")
    return float(v)


def _int(d: dict[str, Any], key: str, where: str, *, minimum: int = 1) -> int:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise NdplanError(f"{where}: field '{key}' must be an integer >= {minimum}, got {v!r}")
    return v


def _str(d: dict[str, Any], key: str, where: str, *, default: Any = ..., nonempty: bool = True) -> str:
    v = _get(d, key, where, default=default)
    if not isinstance(v, str) or (nonempty and not v):
        raise NdplanError(f"{where}: field '{key}' must be a non-empty string, got {v!r}")
    return v


def _recompute_from(d: dict[str, Any], where: str) -> Recompute:
    if not isinstance(d, dict):
        raise NdplanError(f"{where} must be an object, got {type(d).__name__}")
    return Recompute(
        saved_bytes_per_token=_num(d, "saved_bytes_per_token", where, nonneg=True),
        saved_tp_scaled_bytes_per_token=_num(d, "saved_tp_scaled_bytes_per_token", where),
        saved_replicated_bytes_per_token=_num(d, "saved_replicated_bytes_per_token", where),
        backward_peak_extra_bytes_per_token=_num(d, "backward_peak_extra_bytes_per_token", where),
        saved_bytes_per_token_per_seq=_num(d, "saved_bytes_per_token_per_seq", where, default=0.0),
        backward_peak_extra_bytes_per_token_per_seq=_num(
            d, "backward_peak_extra_bytes_per_token_per_seq", where, default=0.0
        ),
        saved_constant_bytes=_num(d, "saved_constant_bytes", where, default=0.0, nonneg=True),
    )


_SCALINGS = ("token", "token*seq", "constant")


def _op_from(d: Any, where: str) -> SavedOp:
    if not isinstance(d, dict):
        raise NdplanError(f"{where} must be an object, got {type(d).__name__}")
    shape = d.get("shape", [])
    if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
        raise NdplanError(f"{where}: field 'shape' must be a list of integers, got {shape!r}")
    return SavedOp(
        op=_str(d, "op", where),
        bytes_per_token=_num(d, "bytes_per_token", where, nonneg=True),
        module=_str(d, "module", where, default="", nonempty=False),
        shape=tuple(shape),
        dtype=_str(d, "dtype", where, default="", nonempty=False),
        scaling=_scaling_from(d, where),
    )


def _scaling_from(d: dict[str, Any], where: str) -> str:
    v = d.get("scaling", "token")
    if v not in _SCALINGS:
        raise NdplanError(f"{where}: field 'scaling' must be one of {', '.join(_SCALINGS)}, got {v!r}")
    return str(v)


def _record_from_dict(d: Any, where: str) -> CensusRecord:
    if not isinstance(d, dict):
        raise NdplanError(f"{where} must be an object, got {type(d).__name__}")
    _check_version(_get(d, "schema_version", where), f"{where}: field 'schema_version'")
    ops = _get(d, "saved_ops", where, default=[])
    if not isinstance(ops, list):
        raise NdplanError(f"{where}: field 'saved_ops' must be a list, got {type(ops).__name__}")
    return CensusRecord(
        model=_str(d, "model", where),
        model_type=_str(d, "model_type", where),
        layer_kind=_str(d, "layer_kind", where),
        num_layers=_int(d, "num_layers", where),
        hidden_size=_int(d, "hidden_size", where),
        seq_length=_int(d, "seq_length", where),
        micro_batch_size=_int(d, "micro_batch_size", where),
        dtype=_str(d, "dtype", where),
        attention=_str(d, "attention", where),
        torch_version=_str(d, "torch_version", where),
        transformers_version=_str(d, "transformers_version", where),
        saved_bytes_per_token=_num(d, "saved_bytes_per_token", where, nonneg=True),
        saved_tp_scaled_bytes_per_token=_num(d, "saved_tp_scaled_bytes_per_token", where),
        saved_replicated_bytes_per_token=_num(d, "saved_replicated_bytes_per_token", where),
        backward_peak_extra_bytes_per_token=_num(d, "backward_peak_extra_bytes_per_token", where),
        full_recompute=_recompute_from(_get(d, "full_recompute", where), f"{where}: field 'full_recompute'"),
        selective=_recompute_from(_get(d, "selective", where), f"{where}: field 'selective'"),
        saved_bytes_per_token_per_seq=_num(d, "saved_bytes_per_token_per_seq", where, default=0.0),
        backward_peak_extra_bytes_per_token_per_seq=_num(
            d, "backward_peak_extra_bytes_per_token_per_seq", where, default=0.0
        ),
        saved_constant_bytes=_num(d, "saved_constant_bytes", where, default=0.0, nonneg=True),
        shared_saved_bytes_per_token=_num(d, "shared_saved_bytes_per_token", where, default=0.0, nonneg=True),
        experts=_str(d, "experts", where, default="", nonempty=False),
        attention_kernel=_str(d, "attention_kernel", where, default="", nonempty=False),
        saved_ops=tuple(_op_from(op, f"{where}: saved_ops[{i}]") for i, op in enumerate(ops)),
        notes=_str(d, "notes", where, default="", nonempty=False),
        architecture=_architecture_from(d, where),
        schema_version=SCHEMA_VERSION,
    )


def _architecture_from(d: dict[str, Any], where: str) -> tuple[tuple[str, Any], ...]:
    value = _get(d, "architecture", where, default={})
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in value.items()):
        raise NdplanError(f"{where}: field 'architecture' must be an object of model fields to numbers, "
                          f"booleans or strings, got {value!r}")
    return tuple(sorted(value.items()))


__all__ = [
    "KNOWN_LAYER_KINDS",
    "SCHEMA_VERSION",
    "CensusRecord",
    "Recompute",
    "SavedOp",
    "from_json",
    "load_census_file",
    "save_census_file",
    "to_json",
]
