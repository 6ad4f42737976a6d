"""Measured runs, and fitting the efficiency figures to them.

A measured run (YAML/JSON, see benchmarks/published_runs.yaml) names a model, a device, the
cluster size, the strategy and one measured quantity; ``measured_step_s`` turns that quantity
into seconds per step:

* ``step_s``: as measured;
* ``tokens_per_s_per_device``: step = global_batch · seq / (tokens/s/device · devices);
* ``tflops_per_device`` or ``mfu`` with the FLOP formula the source used (``flops_formula``):
  step = FLOPs per step / (TFLOP/s · 1e12 · devices), with TFLOP/s = mfu · peak[bf16] for MFU.
  Formulas: ``megatron-2021`` (Narayanan et al. 2021, eq. 3, with full recompute:
  96·B·s·l·h²·(1 + s/6h + V/16lh)), ``megatron-2022`` (Korthikanti et al. 2022 model FLOPs:
  72·B·s·l·h²·(1 + s/6h + V/12lh)), ``megatron-core`` (Megatron-Core's
  ``num_floating_point_operations`` of 2025 for GQA/MHA models, ``megatron_core_flops``),
  ``ndplan`` (this package's model FLOPs, 3× forward matmuls and causal attention).

``calibrate`` fits chosen EfficiencyProfile figures by bounded least squares on the log ratio
of predicted to measured step time (scipy.optimize.least_squares, trust-region reflective), so
every run weighs the same whatever its size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ndplan.errors import NdplanError, parse_nested, read_text
from ndplan.hardware.device import Cluster, Device
from ndplan.hardware.presets import get_device
from ndplan.model.presets import get_preset, load_model
from ndplan.model.spec import ModelSpec
from ndplan.perf.efficiency import (
    FAMILY_DEFAULTS,
    FITTABLE,
    SOFTWARE_FIELDS,
    UNSET_MEANS,
    EfficiencyProfile,
    default_efficiency,
    device_family,
    dump_efficiency,
)
from ndplan.perf.flops import model_flops_per_micro_batch
from ndplan.perf.overlap import OverlapConfig, parse_overlap
from ndplan.strategy.strategy import Strategy

FlopsFormula = Literal["megatron-2021", "megatron-2022", "megatron-core", "ndplan"]


class Measured(BaseModel):
    """One measured quantity of a run (exactly one of the four)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Finite: an infinite step time reached log() in the fit ("math domain error").
    step_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tokens_per_s_per_device: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tflops_per_device: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    mfu: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    flops_formula: FlopsFormula | None = None

    @model_validator(mode="after")
    def _one(self) -> Measured:
        given = [k for k in ("step_s", "tokens_per_s_per_device", "tflops_per_device", "mfu") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of step_s, tokens_per_s_per_device, tflops_per_device, mfu (got {given or 'none'})")
        if given[0] in ("tflops_per_device", "mfu") and self.flops_formula is None:
            raise ValueError(f"{given[0]} needs flops_formula (megatron-2021, megatron-2022, megatron-core or ndplan)")
        return self


class MeasuredRun(BaseModel):
    """A published or local training run with its configuration and a measured throughput."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    source: str = Field(description="table the run belongs to (rank correlation is per source)")
    url: str = ""
    model: str | dict[str, Any]
    device: str | dict[str, Any]
    num_devices: int = Field(gt=0)
    devices_per_node: int | None = None
    strategy: dict[str, Any]
    overlap: str | dict[str, Any] = "megatron"
    software: dict[str, Any] = Field(default_factory=dict, description="EfficiencyProfile fields that are facts of the run's software, e.g. flash_attention: false")
    runtime: str = Field(default="megatron", description="the memory profile of the run's framework "
                         "(ndplan.memory.profile: megatron, pytorch): what the memory check prices. Unlike "
                         "MemoryOptions (pytorch), a run defaults to megatron, as most published runs are")
    measured: Measured
    loss_parallel: bool | None = Field(default=None, description="the loss on vocab-sharded logits (torchtitan's "
                                       "default with TP), in memory and time; None: the runtime profile's in "
                                       "memory, the vocabulary-parallel loss in time")
    torch_compile: Literal["off", "model", "model+loss", "loss"] = Field(
        default="off", description="what torch.compile compiled (torchtitan's [compile] components), for the memory "
        "check's saved tensors (MemoryOptions.torch_compile); the step time's fused kernels are the software "
        "facts' elementwise_passes")
    modules: Literal["eager", "te"] = Field(
        default="eager", description="what the run's pytorch-runtime modules keep for backward "
        "(MemoryOptions.modules): te for NeMo AutoModel's Transformer Engine backend; memory only")
    experts_outside_fsdp: bool = Field(
        default=False, description="the routed experts whose FSDP shard group is one rank left out of FSDP "
        "(MemoryOptions.experts_outside_fsdp: NeMo AutoModel's MoE parallelizer)")
    reserved_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="memory the source measured: the caching "
                                       "allocator's peak reserved bytes, in GiB (max over ranks), where it says")
    notes: str = ""
    known_regression: str = Field(default="", description="where the run's own developers report this "
                                  "measurement as a performance regression of their software (a link and what it "
                                  "says): the run is priced and listed, but not fitted, since a fit would teach the "
                                  "figures the regression")

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, value: str) -> str:
        from ndplan.memory.profile import get_profile

        try:
            get_profile(value)
        except NdplanError as error:
            raise ValueError(str(error)) from None
        return value

    @field_validator("software")
    @classmethod
    def _software_facts(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(SOFTWARE_FIELDS))
        if unknown:
            raise ValueError(f"'{unknown[0]}' is not a software fact; allowed: {', '.join(SOFTWARE_FIELDS)} "
                             "(device figures belong in the efficiency profile)")
        try:
            FAMILY_DEFAULTS["generic"].replace(**value)
        except NdplanError as error:
            raise ValueError(str(error)) from None
        return value

    @model_validator(mode="after")
    def _policy_runtime(self) -> MeasuredRun:
        """torchtitan's per-op checkpointing (``selective_recompute: torchtitan-op``) is priced in
        memory by a runtime profile that states it: checked here, not at the first estimate."""
        from ndplan.memory.profile import get_profile

        if (self.software.get("selective_recompute") == "torchtitan-op"
                and "torchtitan-op" not in get_profile(self.runtime).selective_policies):
            raise ValueError(f"selective_recompute torchtitan-op needs a runtime whose profile prices it "
                             f"(pytorch), not {self.runtime}")
        return self

    def model_spec(self) -> ModelSpec:
        """The run's model: a preset's name or a config file's path (as ``--model`` takes them,
        a path from the current folder), a ModelSpec's fields, or ``{preset: name, ...}``, a preset
        with the fields the run's software changes (``mtp_depth: 0`` where the framework builds no
        MTP modules)."""
        if isinstance(self.model, str):
            return load_model(self.model)
        if "preset" in self.model:
            fields = dict(self.model)
            base = get_preset(str(fields.pop("preset")))
            layers = fields.get("num_layers", base.num_layers)
            if isinstance(layers, int) and layers != base.num_layers:
                # The preset's first layers, as a trimmed model keeps them.
                per_layer = ("layer_mlp_kinds", "layer_attention_spans")
                if layers > base.num_layers and not all(name in fields for name in per_layer):
                    raise NdplanError(f"model: num_layers={layers} is more than preset {base.name}'s "
                                      f"{base.num_layers}; give layer_mlp_kinds and layer_attention_spans too")
                for name in per_layer:
                    fields.setdefault(name, getattr(base, name)[:layers])
            return ModelSpec.model_validate(base.model_dump() | fields)
        return ModelSpec.model_validate(self.model)

    def device_spec(self) -> Device:
        if isinstance(self.device, str):
            return get_device(self.device)
        return Device.model_validate(self.device)

    def cluster(self) -> Cluster:
        return Cluster(device=self.device_spec(), num_devices=self.num_devices, devices_per_node=self.devices_per_node)

    def strategy_obj(self) -> Strategy:
        return Strategy(**self.strategy)

    def overlap_config(self) -> OverlapConfig:
        """The run's overlap switches, read as ``--overlap`` and a plan file read them."""
        config = parse_overlap(self.overlap)
        assert config is not None
        return config

    def efficiency(self, base: EfficiencyProfile) -> EfficiencyProfile:
        """``base`` with the run's software facts, and its loss vocabulary-parallel or not where
        the run says (``loss_parallel``, which memory reads too; unsaid: the profile's)."""
        facts = dict(self.software)
        if self.loss_parallel is not None:
            facts["loss_parallel"] = self.loss_parallel
        return base.replace(**facts) if facts else base

    def memory_options(self) -> Any:
        """The memory model's options for this run: its runtime profile, the software facts
        memory shares with time (the loss's upcast; torchtitan's per-op selective checkpointing),
        whether its loss is vocab-parallel, what torch.compile compiled and which modules it ran."""
        from ndplan.memory.options import MemoryOptions

        policy = self.software.get("selective_recompute")
        return MemoryOptions(runtime=self.runtime, loss_upcast=bool(self.software.get("loss_upcast", True)),
                             selective_policy=policy if policy == "torchtitan-op" else None,
                             loss_parallel=self.loss_parallel, torch_compile=self.torch_compile,
                             modules=self.modules, experts_outside_fsdp=self.experts_outside_fsdp)

    def memory_report(self) -> Any:
        """The run's memory estimate (``ndplan.memory.report.MemoryReport``) on its device."""
        from ndplan.memory.report import estimate

        return estimate(self.model_spec(), self.strategy_obj(), self.device_spec(), self.memory_options(),
                        num_devices=self.num_devices)

    def fullest_stage(self) -> Any:
        """The memory estimate (``ndplan.memory.report.StageReport``) of the run's stage with the
        highest peak: a run that ran fitted, so this must stay within its device's memory."""
        return max(self.memory_report().stages, key=lambda stage: stage.peak_bytes)


def _megatron_flops(model: ModelSpec, batch: float, seq: float, recompute_forward: float, vocab_div: float) -> float:
    """Megatron papers' GPT FLOPs per step: (24 + 24·r)·B·s·l·h²·(1 + s/6h + V/(vocab_div·l·h)),
    r = 1 with full recompute (96 = 4 passes·24), 0 without (72)."""
    layers, h, v = model.num_layers, model.hidden_size, model.vocab_size
    passes = 72.0 + 24.0 * recompute_forward
    return passes * batch * seq * layers * h * h * (1 + seq / (6 * h) + v / (vocab_div * layers * h))


def megatron_core_flops(model: ModelSpec, batch: float, seq: float) -> float:
    """Megatron-Core's FLOPs per step (``num_floating_point_operations``, 2025) for a GQA/MHA
    model: per token, 3 passes · 2 FLOPs per multiply-add of
    * each layer's attention, h·(q + 2·kv) + q·s/2·2 + q·h (q, kv the projection widths; the
      causal core counted as half the s² scores, QKᵀ and its product with V),
    * 2 GEMMs per MLP (2·2·3 = 12): 12·h·f·3/2 for a gated MLP (f the dense width on dense
      layers; top-k · expert width, plus the shared experts', on MoE layers),
    * the logits, 6·h·V,
    times batch · seq. Checked against Megatron-MoE-ModelZoo's Qwen3-235B rows, whose step times
    and TFLOP/s give 147.8 GFLOP per token against this formula's 148.0."""
    if model.attention_kind == "mla":
        raise NdplanError("flops_formula megatron-core: MLA models are not implemented (a different attention term)")
    h, layers = model.hidden_size, model.num_layers
    q = model.head_dim * model.num_attention_heads
    kv = model.head_dim * model.num_kv_heads
    attention = 6.0 * (h * (q + 2 * kv) + q * seq / 2 * 2 + q * h)
    gate = 1.5 if model.gated_mlp else 1.0
    moe_layers = sum(1 for kind in model.layer_mlp_kinds if kind == "moe")
    dense_width = model.ffn_hidden_size * (layers - moe_layers)
    moe_width = (model.moe_ffn_hidden_size * model.num_experts_per_tok
                 + model.num_shared_experts * model.shared_expert_ffn_hidden_size) * moe_layers
    mlp = 12.0 * h * (dense_width + moe_width) * gate
    logits = 6.0 * h * model.vocab_size
    return batch * seq * (mlp + layers * attention + logits)


def step_flops(run: MeasuredRun, formula: FlopsFormula) -> float:
    """FLOPs of one step by the formula the source used to report its throughput."""
    model = run.model_spec()
    s = run.strategy_obj()
    if formula == "megatron-2021":
        return _megatron_flops(model, s.global_batch_size, s.seq_length, 1.0, 16.0)
    if formula == "megatron-2022":
        return _megatron_flops(model, s.global_batch_size, s.seq_length, 0.0, 12.0)
    if formula == "megatron-core":
        return megatron_core_flops(model, s.global_batch_size, s.seq_length)
    per_seq = model_flops_per_micro_batch(model, 1.0, float(s.seq_length))
    return float(s.global_batch_size * per_seq.model)


def measured_step_s(run: MeasuredRun) -> float:
    """The run's measured quantity as seconds per step (see the module docstring)."""
    m, s = run.measured, run.strategy_obj()
    if m.step_s:
        return m.step_s
    if m.tokens_per_s_per_device:
        return s.global_batch_size * s.seq_length / (m.tokens_per_s_per_device * run.num_devices)
    assert m.flops_formula is not None
    flops = step_flops(run, m.flops_formula)
    tflops = m.tflops_per_device or (m.mfu or 0.0) * run.device_spec().peak_flops_for("bf16") / 1e12
    return flops / (tflops * 1e12 * run.num_devices)


def load_runs(path: str | Path) -> list[MeasuredRun]:
    """Read runs from YAML/JSON: a list, or a mapping with a ``runs:`` list."""
    source = str(path)
    try:
        text = read_text(path)
        data = (parse_nested(json.loads, text, source, "JSON") if source.endswith(".json")
                else parse_nested(yaml.safe_load, text, source, "YAML"))
    except OSError as exc:
        raise NdplanError(f"{source}: cannot read runs ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise NdplanError(f"{source}: malformed runs file ({exc})") from exc
    if isinstance(data, dict):
        data = data.get("runs")
    if not isinstance(data, list) or not data:
        raise NdplanError(f"{source}: expected a non-empty list of runs (or a mapping with 'runs:')")
    runs = []
    for i, entry in enumerate(data):
        try:
            runs.append(MeasuredRun.model_validate(entry))
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            label = entry.get("id", f"#{i + 1}") if isinstance(entry, dict) else f"#{i + 1}"
            raise NdplanError(f"{source}: run {label}: field '{where}': {first['msg']}") from None
        _check_run(runs[-1], f"{source}: run {runs[-1].id}")
    # One run listed twice would count as two pieces of evidence (and a fit of fewer figures).
    seen: dict[str, int] = {}
    for i, run in enumerate(runs, start=1):
        if run.id in seen:
            raise NdplanError(f"{source}: run id '{run.id}' is listed twice (runs #{seen[run.id]} and #{i}); "
                              "give each measured run once, with an id of its own")
        seen[run.id] = i
    return runs


def _check_run(run: MeasuredRun, where: str) -> None:
    """The run's model, device and strategy resolve, and the strategy runs on its cluster; else an
    error that names the run (what ``estimate_time`` would otherwise raise without it)."""
    from ndplan.strategy.rules import check_strategy

    def resolved(part: str, build: Callable[[], Any]) -> Any:
        try:
            return build()
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise NdplanError(f"{where}: field '{part}.{field}': {first['msg']}") from None
        except NdplanError as error:
            raise NdplanError(f"{where}: {error}") from None

    strategy = resolved("strategy", run.strategy_obj)
    model = resolved("model", run.model_spec)
    resolved("device", run.device_spec)
    resolved("overlap", run.overlap_config)
    broken = check_strategy(strategy, model, run.num_devices)
    if broken:
        raise NdplanError(f"{where}: {'; '.join(v.message for v in broken)}")
    # A measurement faster than the device's peak is a wrong unit or field, not a run.
    peak = run.device_spec().peak_flops_for(strategy.precision.compute_dtype)
    mfu = step_flops(run, "ndplan") / (measured_step_s(run) * run.num_devices * peak)
    if mfu > 1.0:
        raise NdplanError(f"{where}: the measured figure means {100 * mfu:,.0f}% of the device's peak "
                          f"({peak / 1e12:,.0f} TFLOP/s {strategy.precision.compute_dtype}): check its unit")


def predict_step_s(run: MeasuredRun, profile: EfficiencyProfile) -> float:
    """ndplan's step time for the run with ``profile`` (and the run's software facts)."""
    from ndplan.perf.report import estimate_time

    report = estimate_time(
        run.model_spec(), run.strategy_obj(), run.cluster(),
        efficiency=run.efficiency(profile), overlap=run.overlap_config(),
    )
    return report.step_s


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan for fewer than 3 points."""
    if len(x) < 3:
        return float("nan")

    def ranks(v: Sequence[float]) -> np.ndarray:
        arr = np.asarray(v, dtype=float)
        order = arr.argsort()
        r = np.empty(len(arr))
        r[order] = np.arange(len(arr), dtype=float)
        for value in np.unique(arr):
            same = arr == value
            r[same] = r[same].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass
class CalibrationReport:
    """What the fit did: figures before/after, per-run errors, summary statistics."""

    device_family: str
    fitted: dict[str, float]
    initial: dict[str, float]
    bounds: dict[str, tuple[float, float]]
    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: Runs on the family that were not fitted: their software is reported as regressed
    #: (``MeasuredRun.known_regression``).
    regressed: list[str] = field(default_factory=list)
    median_abs_error_before: float = float("nan")
    median_abs_error_after: float = float("nan")
    max_abs_error_after: float = float("nan")
    success: bool = True
    message: str = ""
    #: What makes the fitted figures untrustworthy, said with the fit (see ``_fit_warnings``).
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        changed = ", ".join(f"{k} {self.initial[k]:.4g} -> {v:.4g}" for k, v in self.fitted.items())
        # A run's step is priced under its runtime profile (a run that states none: megatron);
        # an estimate reproduces the fitted steps under the same (--runtime).
        runtimes = sorted({str(r.get("runtime", "megatron")) for r in self.runs})
        return (
            f"{len(self.runs)} run{'s' if len(self.runs) != 1 else ''} ({self.device_family}); median |error| {self.median_abs_error_before:.1%} -> "
            f"{self.median_abs_error_after:.1%}, worst {self.max_abs_error_after:.1%}; {changed}; priced under the "
            f"{' and '.join(runtimes)} runtime{'s' if len(runtimes) > 1 else ''} (estimate with --runtime "
            f"{runtimes[0]} to reproduce them)"
        )


#: The worst error a fit may leave before it is said: beyond, the figures absorb something the
#: model does not price (the step-time target's worst error, docs/accuracy_time.md).
WORST_FITTED_ERROR = 0.25


def _fit_warnings(names: Sequence[str], fitted: np.ndarray, lower: np.ndarray, upper: np.ndarray, runs: int,
                  prior_weight: float, worst_error: float) -> list[str]:
    """What a user must know before trusting a fitted profile: fewer runs than figures (without a
    prior the figures split the error arbitrarily), a figure ended at a bound of its range (the
    runs asked for a value outside it), and a worst error left above ``WORST_FITTED_ERROR``."""
    warnings = []
    if runs < len(names) and prior_weight <= 0:
        warnings.append(f"{runs} run{'s' if runs > 1 else ''} for {len(names)} figures: the fit is underdetermined "
                        f"and the figures share the error arbitrarily; fit fewer (--fit), add runs, or keep "
                        f"the figures near their defaults (--prior-weight)")
    # The optimiser stops a hair inside a bound (0.2 ends as 0.20000000000000007).
    margin = 1e-6 * (upper - lower)
    ends = [f"{name} {'lower' if value <= low + m else 'upper'} bound ({value:.3g})"
            for name, value, low, high, m in zip(names, fitted, lower, upper, margin, strict=True)
            if value <= low + m or value >= high - m]
    if ends:
        warnings.append(f"at the end of its range: {', '.join(ends)}; the runs ask for a figure outside it, so the "
                        f"model misses something they run (check each run's strategy, runtime and measurement)")
    if worst_error > WORST_FITTED_ERROR:
        warnings.append(f"the fit leaves an error of {worst_error:.1%} (more than {WORST_FITTED_ERROR:.0%}): the "
                        f"figures cannot explain every run")
    return warnings


def calibrate(
    runs: Iterable[MeasuredRun] | str | Path,
    device: Device | str,
    *,
    fit: Sequence[str] | None = None,
    initial: EfficiencyProfile | None = None,
    prior_weight: float = 0.0,
    max_nfev: int = 200,
    output: str | Path | None = None,
) -> tuple[EfficiencyProfile, CalibrationReport]:
    """Fit efficiency figures to measured step times of runs on ``device``'s family.

    fit: names from ``FITTABLE`` (default: gemm, attention, HBM, scale-up and scale-out
    efficiencies, plus fp8 GEMM efficiency when a run computes in fp8). Runs on other device
    families are skipped (listed in the report), and so are runs whose software is reported as
    regressed (``known_regression``; ``report.regressed``). Residual per run:
    log(predicted / measured).
    initial: the starting profile (default: the device family's); with ``prior_weight`` > 0
    each fitted figure also pays prior_weight·(x - x0)/x0 (x0 its initial value, or the bound
    width for a zero start), which keeps poorly determined figures near their documented
    values instead of letting them absorb effects they do not model.
    output: write the fitted profile there as YAML, the fit summary as its header comment.
    """
    from scipy.optimize import least_squares

    dev = get_device(device) if isinstance(device, str) else device
    family = device_family(dev)
    start = initial or default_efficiency(dev)
    if start.family != family:  # the fit would write the runs' figures under the other family's name
        raise NdplanError(f"the starting profile is of the {start.family} family, and the runs to fit are on "
                          f"{family} devices: start from a {family} profile (or none: the family's defaults)")
    all_runs = load_runs(runs) if isinstance(runs, (str, Path)) else list(runs)
    on_family = [r for r in all_runs if device_family(r.device_spec()) == family]
    skipped = [r.id for r in all_runs if device_family(r.device_spec()) != family]
    chosen = [r for r in on_family if not r.known_regression]
    regressed = [r.id for r in on_family if r.known_regression]
    if not chosen:
        raise NdplanError(f"no run is on a {family} device like '{dev.name}'"
                          + (f" except {len(regressed)} whose software is reported as regressed (known_regression)"
                             if regressed else "") + "; nothing to calibrate")
    names = list(fit) if fit else ["gemm_efficiency", "attention_efficiency", "hbm_efficiency",
                                   "scaleup_efficiency", "scaleout_efficiency"]
    if not fit and any(r.strategy_obj().precision.compute_dtype == "fp8" for r in chosen):
        names.append("fp8_gemm_efficiency")
    unknown = [n for n in names if n not in FITTABLE]
    if unknown:
        raise NdplanError(f"cannot fit '{unknown[0]}'; fittable: {', '.join(FITTABLE)}")
    measured = np.array([measured_step_s(r) for r in chosen])
    lo = np.array([FITTABLE[n][0] for n in names])
    # The masked kernel is priced no faster than the causal one: its fit ends at that figure, and
    # starts below it (at the cap the fit would see no slope).
    hi = np.array([min(FITTABLE[n][1], start.attention_efficiency) if n == "masked_attention_efficiency"
                   else FITTABLE[n][1] for n in names])
    x0 = np.clip(np.array([start.figure(n) if n in UNSET_MEANS else float(getattr(start, n)) for n in names]), lo, hi)
    x0 = np.where([n == "masked_attention_efficiency" for n in names], np.minimum(x0, 0.95 * hi), x0)

    def profile(x: np.ndarray) -> EfficiencyProfile:
        return start.replace(**{n: float(v) for n, v in zip(names, x, strict=True)})

    def residuals(x: np.ndarray) -> np.ndarray:
        p = profile(x)
        return np.array([math.log(predict_step_s(r, p) / t) for r, t in zip(chosen, measured, strict=True)])

    scale = np.where(x0 > 0, x0, hi - lo)

    def objective(x: np.ndarray) -> np.ndarray:
        if prior_weight <= 0:
            return residuals(x)
        return np.concatenate([residuals(x), prior_weight * (x - x0) / scale])

    before = residuals(x0)
    # The search starts a thousandth of the range inside a bound where a figure starts on one
    # (step_overhead_s at 0, moe_imbalance at 1): from the bound itself the trust-region method's
    # first step is as small as the distance to it, and it stops there with the ftol test met
    # (least_squares moved a fixed cost of 0 to 2e-10 s however far the runs asked). The prior
    # still pulls toward the start itself.
    inside = 1e-3 * (hi - lo)
    begin = np.clip(x0, lo + inside, hi - inside)
    result = least_squares(objective, begin, bounds=(lo, hi), method="trf", x_scale="jac", max_nfev=max_nfev)
    # A figure no run's step depends on at the fit (fp8 GEMMs in bf16 runs, routing imbalance in
    # dense ones, a scale-out efficiency past where the runs' DP traffic hides): the fit cannot
    # place it. Where the runs' steps are the same with it at its start, it is left there;
    # otherwise the fit moved it into a region where any further value fits as well, and says so.
    moves = np.any(np.abs(np.asarray(result.jac)[:len(chosen)]) > 1e-12, axis=0)
    x = np.array(result.x, dtype=float)
    idle_moved: list[str] = []
    if not moves.all():
        at_start = np.where(moves, x, x0)
        if np.allclose(residuals(at_start), residuals(x), rtol=0.0, atol=1e-9):
            x = at_start
        else:
            idle_moved = [n for n, m, a, b in zip(names, moves, x0, x, strict=True) if not m and a != b]
    fitted = profile(x)
    after = residuals(x)
    report = CalibrationReport(
        device_family=family,
        fitted={n: float(v) for n, v in zip(names, x, strict=True)},
        initial={n: float(v) for n, v in zip(names, x0, strict=True)},
        bounds={n: FITTABLE[n] for n in names},
        skipped=skipped,
        regressed=regressed,
        median_abs_error_before=float(np.median(np.abs(np.expm1(before)))),
        median_abs_error_after=float(np.median(np.abs(np.expm1(after)))),
        max_abs_error_after=float(np.max(np.abs(np.expm1(after)))),
        success=bool(result.success),
        message=str(result.message),
    )
    # An idle figure's bound is no message from the runs.
    report.warnings = _fit_warnings([n for n, m in zip(names, moves, strict=True) if m], x[moves], lo[moves],
                                    hi[moves], len(chosen), prior_weight, report.max_abs_error_after)
    idle = [n for n, m in zip(names, moves, strict=True) if not m and n not in idle_moved]
    if idle:
        report.warnings.append(f"{', '.join(idle)}: no run's step depends on {'it' if len(idle) == 1 else 'them'} "
                               "(none of the runs uses what it prices, or it is hidden there): left at the start, not fitted")
    for name in idle_moved:
        value = float(x[names.index(name)])
        report.warnings.append(
            f"{name}: fitted to {value:.3g}, where the runs' steps stop depending on it (what it prices is hidden "
            f"there): the runs fit any value {'above' if value > x0[names.index(name)] else 'below'} it as well, so "
            f"it is a bound, not a measurement")
    for run, t, r0, r1 in zip(chosen, measured, before, after, strict=True):
        report.runs.append({
            "id": run.id, "runtime": run.runtime, "measured_step_s": float(t),
            "predicted_before_s": float(t * math.exp(r0)), "predicted_after_s": float(t * math.exp(r1)),
            "error_after": float(math.expm1(r1)),
        })
    if output is not None:
        dump_efficiency(fitted, output, f"ndplan calibrate ({family})\n{report.summary()}")
    return fitted, report
