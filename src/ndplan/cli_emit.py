"""What --emit writes and what that runs, for estimate, balance and search: a strategy written as
a framework's settings as the command priced it, read back as --from reads a file, and priced
again by the full estimators (a format may not write every strategy as it was priced).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ndplan.cli_common import memory_options
from ndplan.errors import NdplanError
from ndplan.strategy import Strategy

#: What balancing sets in a strategy: a format must write these back for its plan to run.
_BALANCED_FIELDS = ("stage_layers", "recompute", "recompute_layers", "recompute_modules")


def round_trips(model: Any, fmt: str, cluster: Any, options: Any, *, by_shape: bool = False
                ) -> Callable[[Strategy], bool]:
    """Whether ``fmt`` writes a strategy so that reading it back gives the same strategy (the
    balanced settings are chosen among those, so that --emit writes what was checked).
    ``by_shape``: answer once per shape of setting (schedule, degrees, recompute, whether a
    limit and an uneven placement are set), as a search asks it of hundreds of plans and
    what a format can write depends on those, not on the layer counts."""
    from ndplan.io.common import canonical_strategy

    answers: dict[tuple[Any, ...], bool] = {}

    def comes_back(strategy: Strategy) -> bool:
        """What balancing changes comes back: the placement and the recompute setting (what the
        format cannot write of the rest, e.g. torchtitan's TP is always sequence-parallel, is
        the strategy's own and said with the written settings)."""
        normal = canonical_strategy(strategy, model)
        key = (normal.schedule, normal.pp, normal.vpp, normal.recompute, normal.recompute_modules,
               bool(normal.recompute_layers), normal.stage_layers is not None) if by_shape else None
        if key is not None and key in answers:
            return answers[key]
        try:
            written = written_strategy(model, strategy, emit_settings(model, strategy, fmt, options, cluster.device),
                                       fmt, cluster)
        except (NdplanError, ValidationError):  # the format's reader refuses what was written
            answer = False
        else:
            answer = all(getattr(written, name) == getattr(normal, name) for name in _BALANCED_FIELDS)
        if key is not None:
            answers[key] = answer
        return answer
    return comes_back


#: The runtime profile each --emit format's reader prices its settings under (a Megatron launch
#: states megatron; the other readers state none, so the default).
_FORMAT_RUNTIME = {"megatron": "megatron", "torchtitan": "pytorch", "hyperparallel": "pytorch", "mindformers": "pytorch"}


def runtime_note(options: Any, fmt: str) -> str | None:
    """What to say where the settings were priced under another runtime than ``fmt``'s reader
    prices them (their memory and step differ)."""
    theirs = _FORMAT_RUNTIME[fmt]
    if options.runtime == theirs:
        return None
    return (f"priced for the {options.runtime} runtime; {fmt}'s settings read back under the {theirs} runtime "
            f"(add --runtime {theirs} to price what they run)")


def emit_settings(model: Any, strategy: Strategy, fmt: str, options: Any, device: Any) -> str:
    """``fmt``'s settings for ``strategy`` as the options priced it: their overlap (else the
    device runtime's defaults), loss (its dtype, and vocabulary-parallel or not: the option, else
    the runtime profile's, as ``read_back`` resolves it), attention kernel, selective-recompute
    policy and experts' GEMM; a launch's processes per node and framework (MindSpeed on an NPU)
    from the device."""
    from ndplan.io import emit
    from ndplan.perf import default_overlap

    loss_parallel = options.vocab_parallel_loss
    return emit(model, strategy, fmt, options.overlap or default_overlap(device.runtime), loss_upcast=options.loss_upcast,
                attention=options.attention, selective_policy=options.selective_policy,
                grouped_gemm=options.grouped_gemm, loss_parallel=loss_parallel,
                moe_capacity_factor=options.moe_capacity_factor, moe_imbalance=options.moe_imbalance,
                moe_dispatcher=options.moe_dispatcher if fmt == "megatron" else "alltoall",
                torch_compile=options.torch_compile,
                devices_per_node=getattr(device, "devices_per_node", None),
                device_runtime=getattr(device, "runtime", None),
                gradient_accumulation_fusion=options.gradient_accumulation_fusion,
                ulysses_kv_repeat=options.ulysses_kv_repeat if fmt == "megatron" else "needed")


def written_strategy(model: Any, emitted: Any, text: str, fmt: str, cluster: Any, *, own_precision: bool = False) -> Any:
    """The strategy ``fmt`` settings ``text`` describe, read back as --from reads them (normal form),
    with ``emitted``'s precision (the structure compared) or, ``own_precision``, the file's."""
    from ndplan.io.common import canonical_strategy

    strategy = _read_written(model, text, fmt, cluster).strategy(cluster.num_devices)
    return canonical_strategy(strategy if own_precision else strategy.model_copy(update={"precision": emitted.precision}),
                              model)


def _read_written(model: Any, text: str, fmt: str, cluster: Any) -> Any:
    """``fmt`` settings ``text`` read as ``--from`` reads a file (``ndplan.io.ReadResult``)."""
    import tempfile

    from ndplan.io import read_config

    suffix = {"megatron": ".sh", "torchtitan": ".toml"}.get(fmt, ".yaml")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"emitted{suffix}"
        path.write_text(text)
        return read_config(path, model, cluster.num_devices, fmt)


def written_precision(model: Any, fmt: str, options: Any, device: Any, strategy: Any = None) -> Any:
    """The precision ``fmt`` writes where it cannot write Megatron's (torchtitan's FSDP keeps fp32
    shards, MindSpore one dtype for parameters, gradients and states): read back from the
    settings it writes for ``strategy`` (default: one device). The strategy matters where the
    format's precision follows the parallelism: torchtitan without FSDP trains TP or PP in fp32."""
    from ndplan.hardware import Cluster
    from ndplan.io.common import policy_of

    plain = strategy if strategy is not None else Strategy()
    text = emit_settings(model, plain, fmt, options, device)
    return policy_of(written_strategy(model, plain, text, fmt, Cluster(device=device, num_devices=plain.world_size),
                                      own_precision=True).precision)


def read_back(model: Any, emitted: Any, text: str, fmt: str, cluster: Any, options: Any, limit: float) -> dict[str, Any]:
    """What the written ``fmt`` settings run, read back and priced as ``ndplan estimate --from``
    prices the file on this cluster (the model, runtime settings and precision the file states:
    torchtitan's vocabulary-parallel loss, an AutoModel config without MTP modules) by the full
    estimators; ``same``: they are what was priced (a format may not express an uneven placement
    under some schedules, recompute on some layers only, or a precision); ``differs``: how not."""
    from dataclasses import replace

    from ndplan.io.common import canonical_strategy, policy_of, same_bytes
    from ndplan.memory import estimate
    from ndplan.model import count_parameters
    from ndplan.perf import default_overlap, estimate_time
    from ndplan.perf.accumulation import launch_efficiency
    from ndplan.perf.efficiency import default_efficiency, with_software

    read = _read_written(model, text, fmt, cluster)
    written = canonical_strategy(read.strategy(cluster.num_devices), model)
    run_model = read.model or model
    # What the file states (runtime, loss, attention, kernels, overlap) as --from reads it; what no
    # file states (overhead, routing imbalance, capacity factor, a census) as the command priced.
    run_options = replace(memory_options(argparse.Namespace(), {}, read, cluster.device),
                          include_overhead=options.include_overhead, moe_imbalance=options.moe_imbalance,
                          moe_capacity_factor=options.moe_capacity_factor)
    if "overlap" not in (read.runtime_settings or {}):
        run_options = replace(run_options, overlap=options.overlap)
    differs: list[str] = []
    try:
        run_options = replace(run_options, census=options.census)
    except NdplanError:  # a census prices the runtime's own selective policy, not the one the file runs
        differs.append(f"the census left out: it measures the runtime's own selective recompute, not the file's "
                       f"{run_options.selective_policy}")
    precision = policy_of(written.precision)
    if written.model_copy(update={"precision": emitted.precision}) != canonical_strategy(emitted, model):
        differs.append(f"the strategy, {written.short()}")
    if not same_bytes(precision, policy_of(emitted.precision)):
        differs.append(f"precision {precision.name}")
    # The model as the file builds it, where that changes what is priced (not a field that prices
    # nothing, such as a dense width in a model without dense layers, or one shared expert of twice
    # the width for two): its layers, modules and parameter counts.
    counts, priced_counts = count_parameters(run_model), count_parameters(model)
    if run_model.mtp_depth != model.mtp_depth:
        differs.append(f"mtp_depth {run_model.mtp_depth} (priced {model.mtp_depth})")
    elif (counts.total, counts.active) != (priced_counts.total, priced_counts.active):
        differs.append(f"the model, {counts.total:,} parameters ({counts.active:,} active; priced "
                       f"{priced_counts.total:,}, {priced_counts.active:,})")
    def stated(opts: Any) -> dict[str, Any]:
        """The settings that price a run, each resolved (None: the runtime profile's own)."""
        out = {name: getattr(opts, name) for name in ("runtime", "loss_upcast", "attention", "torch_compile")}
        if fmt == "megatron":  # (the other formats' frameworks state no such setting)
            # as priced: the option, or where the runtime's rules turn it off for this strategy, off
            software = with_software(default_efficiency(cluster.device), opts.time_keywords()["software"])
            out["gradient_accumulation_fusion"] = launch_efficiency(software, run_model, written)[0].gradient_accumulation_fusion
        if fmt == "megatron" and written.ulysses_ranks > 1:  # (what a Ulysses group does with the KV heads)
            out["ulysses_kv_repeat"] = opts.ulysses_kv_repeat
        if run_model.is_moe:
            out["grouped_gemm"] = opts.grouped_gemm
            out["moe_dispatcher"] = opts.moe_dispatcher
        if written.tp > 1:  # a vocabulary-parallel loss shards over TP only
            out["loss_parallel"] = opts.vocab_parallel_loss
        if written.recompute == "selective":  # the policy prices nothing else
            out["selective_policy"] = opts.recompute_policy
        # what the step hides (the file's overlap where it states one, over the runtime's defaults)
        out["overlap"] = (opts.overlap or default_overlap(cluster.device.runtime)).describe()
        return out

    ran, priced = stated(run_options), stated(options)
    peak: float | None = None
    step: float | None = None
    unpriced = None
    try:
        peak = estimate(run_model, written, cluster.device, run_options, num_devices=cluster.num_devices).peak_bytes
        step = estimate_time(run_model, written, cluster, **run_options.time_keywords()).step_s
    except NdplanError as error:
        # The search prices a pipeline in closed form; the full estimators simulate it and refuse
        # a schedule too long to simulate: the settings stand, their figures cannot be checked.
        unpriced = str(error)
    if ran["overlap"] != priced["overlap"]:
        # A switch only counts where the strategy has something it hides (no parameter gather
        # to overlap without a distributed optimizer, ...): the same step with the priced overlap.
        # Unpriced, that cannot be told, and the overlap is left out of the comparison.
        as_priced = replace(run_options, overlap=options.overlap or default_overlap(cluster.device.runtime))
        if step is None or estimate_time(run_model, written, cluster, **as_priced.time_keywords()).step_s == step:
            ran["overlap"] = priced["overlap"]
    differs += [f"{name} {ran[name]!r} (priced {priced[name]!r})" for name in ran if ran[name] != priced[name]]
    return {"same": not differs, "differs": differs, "strategy": written.short(),
            "stage_layers": list(written.stage_layers or ()), "precision": precision.name,
            "peak_bytes": None if peak is None else round(peak), "fits": None if peak is None else peak <= limit,
            "step_s": step, **({"unpriced": unpriced} if unpriced else {})}
