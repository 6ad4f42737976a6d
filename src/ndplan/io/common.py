"""What every config reader shares: the result type, located errors, typed field access,
precision policies by their bytes, canonical layer placement and model merging.

Errors name the file, the line where one applies, and the field, on one line
(``train.sh:41: --global-batch-size: ...``), so a user can jump straight to the culprit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ndplan.errors import NdplanError, parse_nested
from ndplan.model.hf import first_validation_error
from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.placement import uniform_layer_counts
from ndplan.strategy.precision import PRECISION_PRESETS, PrecisionPolicy
from ndplan.strategy.strategy import MAX_DEGREE as MAX_DEGREE  # the readers' bound on degrees (see there)
from ndplan.strategy.strategy import Strategy

#: Plan-file keys (as ``cli_args`` and plan files read them) and the Strategy field each one sets.
PLAN_TO_FIELD: dict[str, str] = {
    "dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "cp_kind": "cp_kind", "ulysses_degree": "ulysses_degree",
    "ep": "ep", "etp": "etp", "vpp": "vpp", "sp": "sequence_parallel", "schedule": "schedule",
    "seq_chunks": "seq_chunks", "stage_layers": "stage_layers", "zero": "zero", "fsdp": "fsdp",
    "shard_group": "shard_group", "reshard": "reshard_after_forward", "optimizer_offload": "optimizer_offload",
    "optimizer_offload_fraction": "optimizer_offload_fraction", "offload_optimizer_states": "offload_optimizer_states",
    "recompute": "recompute", "recompute_layers": "recompute_layers", "recompute_modules": "recompute_modules",
    "offload_modules": "offload_modules", "offload_layers": "offload_layers", "mbs": "micro_batch_size",
    "num_micro_batches": "num_micro_batches", "pipeline_runs": "pipeline_runs", "gbs": "global_batch_size",
    "seq": "seq_length",
    "precision": "precision", "embedding_as_layer": "embedding_as_layer", "output_as_layer": "output_as_layer",
}
FIELD_TO_PLAN: dict[str, str] = {v: k for k, v in PLAN_TO_FIELD.items()}


def derive_batch(fields: dict[str, Any]) -> None:
    """Resolve ``pipeline_runs`` 0, "as many runs as the global batch needs" (torchtitan's
    gradient-accumulation steps, each one run over the local batch's micro-batches), in Strategy
    keyword arguments: gbs / (dp·micro_batch_size·num_micro_batches), at least 1 (a remainder is
    left for the global_batch rule to name); 1 where the global batch or the per-run micro-batch
    count is not stated (every micro-batch in one run), or where there is no pipeline (its
    micro-batches run one after another: one run of them all)."""
    if fields.get("pipeline_runs") != 0:
        return
    gbs, m = fields.get("global_batch_size"), fields.get("num_micro_batches")
    per_run = int(fields.get("dp", 1)) * int(fields.get("micro_batch_size", 1)) * int(m or 1)
    fields["pipeline_runs"] = max(1, int(gbs) // per_run) if gbs and m and per_run >= 1 else 1
    if int(fields.get("pp", 1)) <= 1 and fields["pipeline_runs"] > 1:
        # Without a pipeline the runs are micro-batches one after another: one run of them all.
        fields["num_micro_batches"] = int(m or 1) * fields["pipeline_runs"]
        fields["pipeline_runs"] = 1


@dataclass
class ReadResult:
    """What ndplan understood from one config file.

    ``strategy_settings`` uses plan-file keys (``tp``, ``sp``, ``mbs``, ``gbs`` ...) so it overlays
    a plan file's settings directly; a key is absent when the file does not state it and no
    documented default of the format applies (``dp`` is absent when the world size is unknown).
    ``warnings`` name every setting ndplan read but cannot represent; ``notes`` say how a
    documented default or an approximation was applied.
    """

    format: str
    source: str
    model: ModelSpec | None = None
    strategy_settings: dict[str, Any] = field(default_factory=dict)
    devices: int | None = None
    devices_per_node: int | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runtime_settings: dict[str, Any] = field(default_factory=dict)

    def strategy_fields(self, devices: int | None = None) -> dict[str, Any]:
        """The settings as Strategy keyword arguments, with dp from the device count if needed."""
        fields = {PLAN_TO_FIELD[k]: v for k, v in self.strategy_settings.items() if k in PLAN_TO_FIELD}
        world = self.devices or devices
        if "dp" not in fields and world:
            model_ranks = int(fields.get("tp", 1)) * int(fields.get("pp", 1)) * int(fields.get("cp", 1))
            if world % model_ranks:
                raise NdplanError(
                    f"{self.source}: {world} devices are not a multiple of tp·pp·cp = {model_ranks}"
                )
            fields["dp"] = world // model_ranks
        if "dp" not in fields:
            raise NdplanError(f"{self.source}: the data-parallel degree depends on the world size, which the file "
                              "does not state; give --devices")
        gbs = fields.get("global_batch_size")
        if gbs and fields.get("pipeline_runs") == 0 and "num_micro_batches" in fields:
            per_run = int(fields["dp"]) * int(fields.get("micro_batch_size", 1)) * int(fields["num_micro_batches"])
            if gbs % per_run:
                raise NdplanError(f"{self.source}: global batch {gbs} is not a multiple of "
                                  f"dp·micro_batch_size·num_micro_batches = {per_run}")
        derive_batch(fields)
        if gbs and "num_micro_batches" not in fields:
            runs = int(fields.get("pipeline_runs", 1))
            per_step = int(fields.get("dp", 1)) * int(fields.get("micro_batch_size", 1)) * runs
            if gbs % per_step:
                names = "dp·micro_batch_size" + ("·pipeline_runs" if runs > 1 else "")
                raise NdplanError(f"{self.source}: global batch {gbs} is not a multiple of {names} = {per_step}")
            fields["num_micro_batches"] = gbs // per_step
        return fields

    def strategy(self, devices: int | None = None) -> Strategy:
        """The Strategy the file describes (dp from ``devices`` when the file has no world size)."""
        try:
            return Strategy(**self.strategy_fields(devices))
        except ValidationError as error:
            raise NdplanError(f"{self.source}: {first_validation_error(error)}") from None


# ---------------------------------------------------------------- located errors and fields
class LineIndex:
    """Line numbers of keys in a structured document, looked up by key path."""

    def __init__(self, lines: Mapping[tuple[str, ...], int] | None = None):
        self._lines: dict[tuple[str, ...], int] = dict(lines or {})

    def line(self, path: Sequence[str]) -> int | None:
        """The line of ``path``, else of its nearest stated parent."""
        path = tuple(path)
        while path:
            if path in self._lines:
                return self._lines[path]
            path = path[:-1]
        return None

    @classmethod
    def from_yaml(cls, text: str) -> LineIndex:
        """Walk the composed YAML node tree (JSON is YAML too) and record each key's line."""
        lines: dict[tuple[str, ...], int] = {}
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except (yaml.YAMLError, RecursionError):  # the loader reports it
            return cls()

        def walk(node: Any, path: tuple[str, ...]) -> None:
            if isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    sub = (*path, str(key.value))
                    lines.setdefault(sub, key.start_mark.line + 1)
                    walk(value, sub)
            elif isinstance(node, yaml.SequenceNode):
                for i, item in enumerate(node.value):
                    sub = (*path, str(i))
                    lines.setdefault(sub, item.start_mark.line + 1)
                    walk(item, sub)

        walk(root, ())
        return cls(lines)

    @classmethod
    def from_toml(cls, text: str) -> LineIndex:
        """Table headers and ``key =`` lines; enough to point at any key a reader looks up."""
        lines: dict[tuple[str, ...], int] = {}
        table: tuple[str, ...] = ()
        for number, raw in enumerate(text.splitlines(), start=1):
            stripped = raw.strip()
            header = re.match(r"^\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$", stripped)
            if header:
                table = tuple(_toml_key_parts(header.group(1)))
                lines.setdefault(table, number)
                continue
            assignment = re.match(r"^([A-Za-z0-9_.\"' -]+?)\s*=", stripped)
            if assignment and not stripped.startswith("#"):
                lines.setdefault((*table, *_toml_key_parts(assignment.group(1))), number)
        return cls(lines)


def _toml_key_parts(dotted: str) -> list[str]:
    return [part.strip().strip("\"'") for part in dotted.split(".")]


@dataclass
class Source:
    """One input file: its name for messages and the line index of its keys."""

    path: Path
    lines: LineIndex = field(default_factory=LineIndex)

    @property
    def name(self) -> str:
        return str(self.path)

    def where(self, line: int | None) -> str:
        return f"{self.path}:{line}" if line else str(self.path)

    def error(self, field_name: str, message: str, line: int | None = None) -> NdplanError:
        """``file:line: field: message`` as one NdplanError."""
        return NdplanError(f"{self.where(line)}: {field_name}: {message}")

    def key_error(self, path: Sequence[str], message: str) -> NdplanError:
        return self.error(".".join(path), message, self.lines.line(path))


def as_int(src: Source, value: Any, field_name: str, line: int | None = None, *, minimum: int | None = 1,
           maximum: int | None = None) -> int:
    """An integer field; strings of digits are accepted (shell arguments are strings)."""
    if isinstance(value, bool):
        raise src.error(field_name, f"expected an integer, got {value!r}", line)
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"[+-]?\d+", text):
            raise src.error(field_name, f"expected an integer, got {value!r}", line)
        value = int(text)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise src.error(field_name, f"expected an integer, got {value!r}", line)
    if minimum is not None and value < minimum:
        raise src.error(field_name, f"must be >= {minimum}, got {value}", line)
    if maximum is not None and value > maximum:
        raise src.error(field_name, f"must be <= {maximum:,}, got {value}", line)
    return value


def as_bool(src: Source, value: Any, field_name: str, line: int | None = None) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"true", "false"}:
        return value.strip().lower() == "true"
    raise src.error(field_name, f"expected true or false, got {value!r}", line)


def as_str(src: Source, value: Any, field_name: str, line: int | None = None) -> str:
    if isinstance(value, str):
        return value
    raise src.error(field_name, f"expected a string, got {value!r}", line)


class Section:
    """A mapping section of a structured config with located, typed access.

    Every key read is recorded; ``check_known`` then rejects the keys that are neither read nor
    listed as known, because in a section whose schema ndplan interprets an unknown key is
    almost always a typo that the framework itself would reject.
    """

    def __init__(self, src: Source, data: Any, path: tuple[str, ...]):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise src.key_error(path, f"expected a mapping, got {type(data).__name__}")
        self.src = src
        self.data: Mapping[str, Any] = data
        self.path = path
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def key_path(self, key: str) -> tuple[str, ...]:
        return (*self.path, key)

    def label(self, key: str) -> str:
        return ".".join(self.key_path(key))

    def line(self, key: str) -> int | None:
        return self.src.lines.line(self.key_path(key))

    def error(self, key: str, message: str) -> NdplanError:
        return self.src.error(self.label(key), message, self.line(key))

    def first(self, *keys: str) -> str | None:
        """The first of ``keys`` (aliases) that is stated."""
        for key in keys:
            self.used.add(key)
        for key in keys:
            if key in self:
                return key
        return None

    def get(self, *keys: str, default: Any = None) -> Any:
        key = self.first(*keys)
        return self.data[key] if key else default

    def integer(self, *keys: str, default: int | None = None, minimum: int | None = 1,
                maximum: int | None = None) -> int | None:
        """A whole number as the document's own type: ``8``, not ``"8"`` or ``8.0`` (the
        frameworks read these fields as ints, as they reject ``true``)."""
        key = self.first(*keys)
        if key is None:
            return default
        value = self.data[key]
        if not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        return as_int(self.src, value, self.label(key), self.line(key), minimum=minimum, maximum=maximum)

    def names(self, *keys: str) -> list[str] | None:
        """A list of strings, or one comma-separated string (as the frameworks' command lines give
        them); anything else (``nan``, ``[1]``) names the field."""
        key = self.first(*keys)
        if key is None:
            return None
        value = self.data[key]
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            return list(value)
        raise self.error(key, f"expected a list of names (strings) or one comma-separated string, got {value!r}")

    def boolean(self, *keys: str, default: bool | None = None) -> bool | None:
        key = self.first(*keys)
        if key is None:
            return default
        return as_bool(self.src, self.data[key], self.label(key), self.line(key))

    def text(self, *keys: str, default: str | None = None) -> str | None:
        key = self.first(*keys)
        if key is None:
            return default
        value = self.data[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return as_str(self.src, value, self.label(key), self.line(key))

    def sub(self, key: str) -> Section:
        self.used.add(key)
        return Section(self.src, self.data.get(key), self.key_path(key))

    def check_known(self, known: Iterable[str] = ()) -> None:
        allowed = self.used | set(known)
        for key in self.data:
            if key not in allowed:
                raise self.error(str(key), "unknown field (a typo? the framework would reject it too)")

    def unused(self, known: Iterable[str] = ()) -> list[str]:
        allowed = self.used | set(known)
        return [str(key) for key in self.data if key not in allowed]


# ---------------------------------------------------------------- documents
def read_text(path: Path) -> str:
    if path.is_dir():
        raise NdplanError(f"{path}: a folder; give the config file in it (a launch script, TOML, YAML or config.json)")
    if not path.is_file():
        raise NdplanError(f"{path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise NdplanError(f"{path}: not a text file ({error.reason})") from None


def load_yaml(path: Path, text: str) -> Any:
    try:
        return parse_nested(yaml.safe_load, text, path, "YAML")
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise NdplanError(f"{path}{line}: malformed YAML: {problem}") from None


def load_json(path: Path, text: str) -> Any:
    try:
        return parse_nested(json.loads, text, path, "JSON")
    except json.JSONDecodeError as error:
        raise NdplanError(f"{path}:{error.lineno}: malformed JSON: {error.msg}") from None


def load_toml(path: Path, text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return parse_nested(tomllib.loads, text, path, "TOML")
    except tomllib.TOMLDecodeError as error:
        message = str(error)
        found = re.search(r"\(at line (\d+), column \d+\)", message)
        line = f":{found.group(1)}" if found else ""
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", message).strip()
        raise NdplanError(f"{path}{line}: malformed TOML: {message}") from None


def document_source(path: Path, text: str, kind: str) -> Source:
    index = LineIndex.from_toml(text) if kind == "toml" else LineIndex.from_yaml(text)
    return Source(path, index)


# ---------------------------------------------------------------- precision
#: Policies the formats need that are not ndplan presets (matched by bytes before this is used).
EXTRA_POLICIES: dict[str, PrecisionPolicy] = {
    "megatron-fp16": PrecisionPolicy(
        name="megatron-fp16", param_bytes=2, grad_bytes=4, master_weight_bytes=4, optimizer_state_bytes=4,
        compute_dtype="fp16",
    ),
}

_POLICY_FIELDS = (
    "param_bytes", "grad_bytes", "master_weight_bytes", "optimizer_state_bytes", "optimizer_states",
    "activation_bytes", "compute_dtype", "param_gather_bytes", "fp8_params",
)


def same_bytes(a: PrecisionPolicy, b: PrecisionPolicy) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _POLICY_FIELDS)


#: Presets a reader's policy becomes only under their own name: their bytes are also those of
#: other frameworks' policies (HyperParallel's bf16 with fp32 main parameters), which keep theirs.
NAMED_ONLY = frozenset({"megatron-bf16-grad16", "megatron-fp8-grad16"})


def make_policy(name: str, **fields: Any) -> PrecisionPolicy:
    """A precision policy by its bytes: the preset with exactly these bytes if there is one (so
    files round-trip to preset names), else a policy named ``name``."""
    policy = PrecisionPolicy(name=name, **fields)
    for preset in (*PRECISION_PRESETS.values(), *EXTRA_POLICIES.values()):
        if same_bytes(policy, preset) and (preset.name not in NAMED_ONLY or preset.name == name):
            return preset
    return policy


def precision_setting(policy: PrecisionPolicy) -> str | PrecisionPolicy:
    """A preset's name (plan files and JSON carry names), else the policy itself."""
    preset = PRECISION_PRESETS.get(policy.name)
    return policy.name if preset is not None and same_bytes(preset, policy) else policy


def policy_of(value: Any) -> PrecisionPolicy:
    """The policy of a strategy's ``precision`` (a PrecisionPolicy or a preset name)."""
    if isinstance(value, PrecisionPolicy):
        return value
    if isinstance(value, str) and value in EXTRA_POLICIES:
        return EXTRA_POLICIES[value]
    return PRECISION_PRESETS[str(value)]


# ---------------------------------------------------------------- layer placement
def canonical_placement(
    counts: Sequence[int], num_layers: int, pp: int, vpp: int
) -> tuple[tuple[int, ...] | None, bool, bool]:
    """(stage_layers, embedding_as_layer, output_as_layer) in ndplan's normal form.

    Placement is the only thing these fields mean, so an explicit list that equals a uniform split
    is written as that split (flags tried from the plainest), and an even split carries no flags.
    Formats then round-trip the placement whichever way they spell it.
    """
    counts = tuple(int(c) for c in counts)
    stages = pp * vpp
    if len(counts) == stages and sum(counts) == num_layers:
        for emb, out in ((False, False), (True, True), (True, False), (False, True)):
            if uniform_layer_counts(num_layers, stages, embedding_as_layer=emb, output_as_layer=out) == counts:
                return None, emb, out
    return counts, False, False


def layer_counts(strategy: Strategy, num_layers: int) -> tuple[int, ...]:
    """Decoder layers per virtual stage, in model order."""
    if strategy.stage_layers is not None:
        return tuple(strategy.stage_layers)
    return uniform_layer_counts(
        num_layers, strategy.num_virtual_stages,
        embedding_as_layer=strategy.embedding_as_layer, output_as_layer=strategy.output_as_layer,
    )


def canonical_strategy(strategy: Strategy, model: ModelSpec | None) -> Strategy:
    """The strategy in ndplan's normal form (unchanged without a model): the placement as
    ``canonical_placement`` writes it, no shard group that spans every replica, resharding
    only meaningful under ZeRO-3, and no recompute limit that every stage stays under.
    Two strategies with the same normal form have the same memory and step time."""
    if model is None or (strategy.stage_layers is not None and len(strategy.stage_layers) != strategy.num_virtual_stages):
        return strategy
    counts = layer_counts(strategy, model.num_layers)
    stage_layers, emb, out = canonical_placement(counts, model.num_layers, strategy.pp, strategy.vpp)
    update: dict[str, Any] = {"stage_layers": stage_layers, "embedding_as_layer": emb, "output_as_layer": out}
    if strategy.shard_group == strategy.dp * strategy.cp:
        update["shard_group"] = 0  # a shard group of every replica is no group at all
    if strategy.zero < 3:
        update["reshard_after_forward"] = True  # only ZeRO-3 gathers parameters to reshard
    if strategy.recompute_layers and strategy.recompute_layers >= max(counts):
        update["recompute_layers"] = 0  # a limit no stage reaches recomputes every layer
    return strategy.model_copy(update=update)


def one_rank_sharding(model: ModelSpec | None, s: Strategy, runs: str) -> str:
    """What a format that shards only over more than one rank (torchtitan's and HyperParallel's
    FSDP degree 1 is no FSDP) loses of ZeRO/FSDP over a shard group of one rank: priced, such a
    strategy still shards a MoE model's experts over their expert-data-parallel ranks (and FSDP
    prices its gathers), which the written degree of 1 does not run. ``runs``: what the file
    runs instead."""
    from ndplan.memory.static import shard_groups

    one = "dp·cp = 1" if s.dp * s.cp == 1 else "shard_group 1"
    what = f"ZeRO-{s.zero}{' with FSDP' if s.fsdp else ''} over one rank ({one})"
    if model is not None and model.is_moe:
        _, experts = shard_groups(s.dp, s.cp, s.tp, s.ep, s.etp, s.shard_group)
        if int(experts) > 1:
            states = {1: "optimizer states", 2: "gradients and optimizer states"}.get(
                s.zero, "parameters, gradients and optimizer states")
            what += f", priced with the experts' {states} sharded over their {int(experts)} expert-data-parallel ranks"
    return f"{what}: {runs} (read back as ZeRO-0)"


def set_placement(
    settings: dict[str, Any], counts: Sequence[int] | None, num_layers: int | None, *,
    embedding_as_layer: bool = False, output_as_layer: bool = False,
) -> None:
    """Store a placement in plan keys, in normal form when the layer count is known."""
    pp, vpp = int(settings.get("pp", 1)), int(settings.get("vpp", 1))
    if counts is None:
        if num_layers is None:
            settings["embedding_as_layer"], settings["output_as_layer"] = embedding_as_layer, output_as_layer
            return
        counts = uniform_layer_counts(
            num_layers, pp * vpp, embedding_as_layer=embedding_as_layer, output_as_layer=output_as_layer
        )
    if num_layers is None:
        settings["stage_layers"] = tuple(counts)
        settings["embedding_as_layer"] = settings["output_as_layer"] = False
        return
    stage_layers, emb, out = canonical_placement(counts, num_layers, pp, vpp)
    settings["embedding_as_layer"], settings["output_as_layer"] = emb, out
    if stage_layers is not None:
        settings["stage_layers"] = stage_layers
    else:
        settings.pop("stage_layers", None)


# ---------------------------------------------------------------- batch
def micro_batches(
    src: Source, *, gbs: int, dp: int, mbs: int, gbs_field: str, gbs_line: int | None, accumulation: int = 1
) -> int:
    """Micro-batches per step: gbs / (dp·mbs); a remainder is a contradiction in the file."""
    per_step = dp * mbs
    if gbs % per_step:
        raise src.error(
            gbs_field,
            f"{gbs} is not divisible by dp·micro-batch size = {dp}·{mbs} = {per_step}", gbs_line,
        )
    return gbs // per_step * accumulation


# ---------------------------------------------------------------- models
Stated = dict[str, tuple[Any, str]]
"""ModelSpec field -> (value, the flag or key that stated it)."""


def resize_kinds(kinds: Sequence[MlpKind], num_layers: int) -> tuple[MlpKind, ...]:
    """Layer kinds for a model cut to ``num_layers`` (debug runs shrink a model this way):
    leading dense layers stay leading, the rest repeats the last kind."""
    if not kinds:
        return ()
    leading = 0
    while leading < len(kinds) and kinds[leading] == "dense":
        leading += 1
    if leading == len(kinds) or all(k == "moe" for k in kinds[leading:]):
        dense = min(leading, num_layers)
        head: list[MlpKind] = ["dense"] * dense
        return tuple(head + [kinds[-1]] * (num_layers - dense))
    return tuple(kinds[i] if i < len(kinds) else kinds[-1] for i in range(num_layers))


def _shared_total(fields: Mapping[str, Any]) -> int:
    return int(fields.get("num_shared_experts") or 0) * int(fields.get("shared_expert_ffn_hidden_size") or 0)


def window_lost(model: ModelSpec, preset_name: str, builds: str) -> str | None:
    """What a format that names its model by a preset (torchtitan's flavour, HyperParallel's
    Hub repo) loses of the model's sliding-window layers, where they differ from that preset's;
    None where they agree."""
    from ndplan.model import get_preset

    preset = get_preset(preset_name)
    if (model.sliding_window, model.layer_attention_spans) == (preset.sliding_window, preset.layer_attention_spans):
        return None

    def spans(spec: ModelSpec) -> str:
        sliding = spec.sliding_layers()[0]
        if not sliding:
            return "full attention on every layer"
        return f"sliding-window attention ({sliding} of {spec.num_layers} layers, {spec.sliding_window:,} keys)"
    return f"{spans(model)}: {builds} builds {preset_name}'s {spans(preset)}"


def merge_model(
    src: Source,
    stated: Stated,
    base: ModelSpec | None,
    *,
    name: str,
    model_type: str,
    defaults: Callable[[dict[str, Any]], dict[str, Any]] | None,
    required: Sequence[str] = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"),
    warnings: list[str],
    origin: str = "the file",
    tolerate: Callable[[str, Any, Any], bool] | None = None,
) -> ModelSpec | None:
    """A ModelSpec from what the file states over a base model (``--model``) or the format's
    documented defaults. Stated values win; each one that differs from the base is a warning.
    Returns None when the file states nothing and there is no base."""
    if not stated:
        return base
    values = {k: v for k, (v, _) in stated.items()}
    if base is not None:
        merged = base.model_dump()
        merged.update(values)
        _warn_conflicts(stated, base, warnings, origin, tolerate)
        if "layer_mlp_kinds" not in values and merged["num_layers"] != base.num_layers:
            merged["layer_mlp_kinds"] = resize_kinds(base.layer_mlp_kinds, merged["num_layers"])
        if "layer_attention_spans" not in values and merged["num_layers"] != base.num_layers:
            # The pattern repeats (Megatron's and transformers' patterns are periodic).
            spans = base.layer_attention_spans
            merged["layer_attention_spans"] = tuple(spans[i % len(spans)] for i in range(merged["num_layers"]))
        merged["name"] = base.name
    else:
        missing = [f for f in required if f not in values]
        if missing:
            labels = ", ".join(missing)
            warnings.append(
                f"{src.name}: the model is incomplete ({labels} not stated); give --model with a preset "
                "or config.json to complete it"
            )
            return None
        merged = {**(defaults(values) if defaults else {}), **values, "name": name, "model_type": model_type}
    if "moe" not in (merged.get("layer_mlp_kinds") or ()) and not merged.get("num_experts"):
        merged.pop("layer_mlp_kinds", None)
    spans = merged.get("layer_attention_spans") or ()
    if "sliding" not in spans:
        if spans:  # no layer slides: a window no layer uses
            merged["sliding_window"] = 0
        if "linear" not in spans:  # (Gated DeltaNet layers keep theirs)
            merged.pop("layer_attention_spans", None)
    try:
        return ModelSpec(**merged)
    except ValidationError as error:
        raise NdplanError(f"{src.name}: model: {first_validation_error(error)}") from None


def _warn_conflicts(
    stated: Stated, base: ModelSpec, warnings: list[str], origin: str,
    tolerate: Callable[[str, Any, Any], bool] | None,
) -> None:
    base_fields = base.model_dump()
    values = {k: v for k, (v, _) in stated.items()}
    skip: set[str] = set()
    if "num_shared_experts" in values or "shared_expert_ffn_hidden_size" in values:
        # One shared expert of width 2w holds what two of width w hold: compare the total width.
        merged = {**base_fields, **values}
        if _shared_total(merged) == _shared_total(base_fields):
            skip |= {"num_shared_experts", "shared_expert_ffn_hidden_size"}
    kinds = values.get("layer_mlp_kinds", base.layer_mlp_kinds)
    if "dense" not in kinds:
        skip.add("ffn_hidden_size")  # no dense layer uses it
    for key, (value, label) in stated.items():
        if key in skip or base_fields.get(key) == value or (tolerate and tolerate(key, value, base_fields.get(key))):
            continue
        per_layer = key in ("layer_mlp_kinds", "layer_attention_spans")
        shown = _kinds_text(value) if per_layer else value
        was = _kinds_text(base_fields[key]) if per_layer else base_fields.get(key)
        warnings.append(f"{label} sets {key}={shown} but {base.name} has {was}; using {origin}'s value")


def _kinds_text(kinds: Sequence[str]) -> str:
    runs: list[str] = []
    for kind in kinds:
        if runs and runs[-1].split("×")[0] == kind:
            head, count = runs[-1].split("×")
            runs[-1] = f"{head}×{int(count) + 1}"
        else:
            runs.append(f"{kind}×1")
    # A repeated group of runs once, with its count: [(linear×3, full×1)×16]
    for period in range(1, len(runs) // 2 + 1):
        if len(runs) % period == 0 and runs == runs[:period] * (len(runs) // period):
            group = ", ".join(runs[:period])
            return f"[({group})×{len(runs) // period}]" if period > 1 else f"[{group}]"
    return "[" + ", ".join(runs) + "]"


def pad_vocab(vocab: int, multiple: int) -> int:
    """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by · tp."""
    if multiple <= 1:
        return vocab
    return -(-vocab // multiple) * multiple
