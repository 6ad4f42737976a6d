"""``ndplan census``, ``ndplan measure`` and ``ndplan verify``: measure with PyTorch, check the estimator.

``add_census_commands(subparsers)`` registers the three subcommands on ndplan's top-level parser.
Each handler returns the exit code; bad input raises ``NdplanError`` (the top-level ``main``
prints it on one line and exits 2). ``verify --tolerance`` exits 1 when the estimate misses.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ndplan.cli_args import positive_int
from ndplan.errors import NdplanError
from ndplan.outputs import made_folder, output_path
from ndplan.progress import working
from ndplan.units import format_bytes

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

EXTRA_HINT = "pip install 'ndplan[census]' (torch==2.13.0, transformers==5.24.0)"


def _require_extra(command: str) -> None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise NdplanError(f"{command} needs {' and '.join(missing)}: {EXTRA_HINT}")


def _emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    return f"{value:+.2f}%"


def _bytes(value: float | None) -> str:
    return "-" if value is None else format_bytes(value)


# ---------------------------------------------------------------- census
def cmd_census(args: argparse.Namespace) -> int:
    from ndplan.census.measure import load_hf_config
    from ndplan.census.record import save_census_file, to_json

    names_configs = [load_hf_config(m) for m in args.models]
    if args.out:  # (before the measurements, not after them)
        output_path(args.out, "--out", "census JSON file")
    _require_extra("ndplan census")
    from ndplan.census.measure import run_census

    records = []
    failed: list[str] = []
    for name, cfg in names_configs:
        # One model transformers cannot run (an attention kernel it lacks, ...) does not discard
        # the others' measurements: they are written, and the command then fails naming it.
        try:
            with working(f"census of {name}: measuring each layer kind on fake tensors", quiet=args.json):
                records += run_census(cfg, seq_length=args.seq, micro_batch_size=args.mbs, attention=args.attention,
                                      experts=args.experts, name=name)
        except NdplanError as error:
            if len(names_configs) == 1:
                raise
            failed.append(f"{name}: {error}")
    if args.out and records:
        save_census_file(made_folder(args.out, "--out"), records)
    if args.json:
        print(to_json(records))
        _raise_failed(failed, args.out if records else None)
        return 0
    for model in dict.fromkeys(r.model for r in records):
        rows = [r for r in records if r.model == model]
        first = rows[0]
        table = Table(title=f"{model} — saved for backward, bytes per token (seq {first.seq_length}, micro-batch "
                            f"{first.micro_batch_size}, {first.dtype}, {first.attention})")
        for col in ["kind", "layers", "saved", "TP-scaled", "replicated", "backward extra", "full: saved",
                    "full: bwd extra", "selective: saved", "selective: bwd extra"]:
            table.add_column(col, justify="left" if col == "kind" else "right")
        for r in rows:
            table.add_row(
                r.layer_kind, str(r.num_layers), *(f"{v:,.0f}" for v in (
                    r.saved_bytes_per_token, r.saved_tp_scaled_bytes_per_token, r.saved_replicated_bytes_per_token,
                    r.backward_peak_extra_bytes_per_token, r.full_recompute.saved_bytes_per_token,
                    r.full_recompute.backward_peak_extra_bytes_per_token, r.selective.saved_bytes_per_token,
                    r.selective.backward_peak_extra_bytes_per_token)))
        console.print(table)
        extras = [f"{r.layer_kind}: {r.saved_bytes_per_token_per_seq:,.1f} B/token per position" for r in rows
                  if r.saved_bytes_per_token_per_seq]
        if extras:
            console.print("  s² attention term: " + "; ".join(extras))
    if args.out and records:
        console.print(f"wrote {len(records)} records to {args.out}")
    _raise_failed(failed, args.out if records else None)
    return 0


def _raise_failed(failed: list[str], written: str | None) -> None:
    """The census's failures, after the other models' records are out: one error naming them."""
    if failed:
        kept = f" (the others' records are in {written})" if written else ""
        raise NdplanError(f"census of {len(failed)} model{'s' if len(failed) > 1 else ''} failed{kept}: "
                          + "; ".join(failed))


# ---------------------------------------------------------------- strategy flags
_FLAG_KEYS = ("dp", "tp", "sp", "pp", "vpp", "schedule", "mbs", "num_micro_batches", "pipeline_runs", "seq", "zero",
              "fsdp", "recompute", "precision", "reshard")


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The strategy flags measure and verify share (a subset of `ndplan estimate`'s)."""
    from ndplan.cli_args import add_switch
    from ndplan.strategy.precision import PRECISION_PRESETS
    from ndplan.strategy.strategy import RECOMPUTES, SCHEDULES

    parser.add_argument("--layers", type=int, help="decoder layers to keep (depth-trimmed model; default: all)")
    par = parser.add_argument_group("strategy")
    for flag, text in [("dp", "data-parallel degree (default 1; needs --fsdp when > 1)"),
                       ("tp", "tensor-parallel degree (default 1)"), ("pp", "pipeline-parallel degree (default 1)"),
                       ("vpp", "model chunks per pipeline rank (default 1)")]:
        par.add_argument(f"--{flag}", type=int, help=text)
    add_switch(par, "--sp", "--no-sp", "sp", "sequence parallelism over the tensor-parallel ranks (needs --tp > 1; "
               "dense models)", "no sequence parallelism (the default)")
    par.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    par.add_argument("--mbs", type=int, help="micro-batch size in sequences (default 1)")
    par.add_argument("--num-micro-batches", type=int, help="micro-batches per pipeline run (default 1)")
    par.add_argument("--pipeline-runs", type=positive_int,
                     help="runs of the pipeline schedule per step, gradients accumulated (default 1; needs --pp > 1)")
    par.add_argument("--seq", type=int, help="sequence length in tokens (default 4096)")
    par.add_argument("--zero", type=int, choices=[0, 3], help="0: no sharding; 3: FSDP2 (default 0, 3 with --fsdp)")
    par.add_argument("--fsdp", action="store_true", default=None, help="FSDP2 fully_shard over dp (zero 3)")
    par.add_argument("--no-reshard", dest="reshard", action="store_false", default=None,
                     help="FSDP keeps decoder layers gathered after forward")
    par.add_argument("--recompute", choices=RECOMPUTES, help="activation recompute of every decoder layer (default none)")
    par.add_argument("--precision", choices=sorted(PRECISION_PRESETS),
                     help="default: fsdp-bf16 with --fsdp, bf16-pure without")
    add_switch(par, "--loss-parallel", "--no-loss-parallel", "loss_parallel",
               "the LM head's logits sharded over the vocabulary and the loss run on them (torchtitan's "
               "default with TP; needs --tp > 1)", "logits gathered whole before the loss (the default)")
    par.add_argument("--selective-policy", choices=["keep-matmuls", "torchtitan-op"], default=None,
                     help="with --recompute selective, what each layer keeps: every matmul's and the attention "
                          "kernel's outputs (keep-matmuls, the default) or torchtitan's per-op policy "
                          "(torchtitan-op: every second matmul's)")


def _strategy_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, key, None) is not None for key in _FLAG_KEYS) or getattr(args, "layers", None) is not None


def strategy_from_args(args: argparse.Namespace) -> Any:
    from ndplan.cli_args import strategy_from_settings

    settings = {key: getattr(args, key) for key in _FLAG_KEYS if getattr(args, key, None) is not None}
    if settings.get("fsdp") or settings.get("zero") == 3:
        settings.setdefault("zero", 3)
        settings.setdefault("fsdp", True)
    if "precision" not in settings:
        settings["precision"] = "fsdp-bf16" if settings.get("zero") == 3 else "bf16-pure"
    if settings.get("vpp", 1) > 1 and "schedule" not in settings:
        settings["schedule"] = "interleaved"
    return strategy_from_settings(settings)


def _model_inputs(model: str) -> tuple[str, dict[str, Any], Any]:
    """(name, HF config dict, ModelSpec) of a preset or a config.json path."""
    from ndplan.census.measure import load_hf_config
    from ndplan.model import load_model

    name, cfg = load_hf_config(model)
    return name, cfg, load_model(model)


def _measure(args: argparse.Namespace) -> Any:
    from ndplan.census.measure_step import (
        check_measurable,
        check_selective_policy,
        measure_step,
        trimmed_hf_config,
    )

    name, cfg, spec = _model_inputs(args.model)
    layers = args.layers if args.layers is not None else spec.num_layers
    strategy = strategy_from_args(args)
    check_measurable(strategy, layers, trimmed_hf_config(cfg, layers))
    check_selective_policy(strategy, args.selective_policy)
    if args.loss_parallel and strategy.tp == 1:  # (said before a measurement, on either backend)
        raise NdplanError("--loss-parallel shards the logits over tensor-parallel ranks: give --tp > 1")
    from ndplan.census.measure_step import trimmed_spec
    from ndplan.strategy import validate_strategy

    validate_strategy(strategy, trimmed_spec(spec, layers))
    cuda = getattr(args, "backend", "fake") == "cuda"
    if cuda:
        from ndplan.census.measure_cuda import check_single_device

        given = [flag for flag, key in (("--timeline", "timeline"), ("--peak-ops", "peak_ops"))
                 if getattr(args, key, None)]
        if given:
            raise NdplanError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --backend fake (a real "
                              "step's allocator keeps no per-tensor record)")
        check_single_device(strategy)
    _require_extra(f"ndplan {args.command}")
    # A config path (or model folder) is kept as given, so that `verify --measured` can load the model again.
    label = args.model if Path(args.model).exists() else name
    with working(f"measuring a step of {name} ({layers} layers, {strategy.short()}) "
                 + ("on this GPU" if cuda else "on fake tensors"), quiet=bool(getattr(args, "json", False))):
        if cuda:
            from ndplan.census.measure_cuda import measure_step_cuda

            return measure_step_cuda(cfg, strategy, num_layers=layers, attention=args.attention, name=label,
                                     selective_policy=args.selective_policy)
        return measure_step(cfg, strategy, num_layers=layers, attention=args.attention, name=label,
                            timeline=bool(getattr(args, "timeline", None)), selective_policy=args.selective_policy,
                            loss_parallel=bool(args.loss_parallel))


# ---------------------------------------------------------------- measure
def cmd_measure(args: argparse.Namespace) -> int:
    from ndplan.census.measurement import save_measurement

    # Checked before the measurement, not after it.
    if args.out:
        output_path(args.out, "--out", "measured-memory JSON file")
    if args.timeline:
        output_path(args.timeline, "--timeline", "CSV file")
    result = _measure(args)
    if args.out:
        save_measurement(made_folder(args.out, "--out"), result)
    if args.timeline:
        _write_timeline(str(made_folder(args.timeline, "--timeline")), result)
    if args.json:
        data = result.to_dict()
        if args.peak_ops:
            for rank, entry in zip(result.ranks, data["ranks"], strict=True):
                entry["peak_blocks"] = [{"op": op, "count": n, "bytes_each": size}
                                        for op, n, size in rank.peak_blocks[:args.peak_ops]]
        _emit_json(data)
        return 0
    s = result.strategy
    table = Table(title=f"{result.model} ({result.num_layers} layers) — {s.short()} {s.precision.name} seq {s.seq_length}"
                        " — measured step, one rank per stage")
    cols = ["stage", "rank", "layers", "params", "grads", "optimizer", "activations (held)", "comm",
            "rest of fwd/bwd", "optim. step temp.", "fwd/bwd peak", "optim. peak", "peak allocated"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in result.ranks:
        c = r.categories
        table.add_row(str(r.stage), str(r.rank), str(r.layers), *(_bytes(c.get(k)) for k in (
            "params", "grads", "optimizer", "activations", "comm", "transient", "optimizer_step")),
            _bytes(r.forward_backward_peak_bytes), _bytes(r.optimizer_step_peak_bytes), _bytes(r.allocated_bytes))
    console.print(table)
    if any(r.at_peak for r in result.ranks):
        at_peak = Table(title="what the peak is made of: live at the instant of each rank's peak "
                              "(forward tensors count as activations, backward ones as temporaries)")
        for col in ["stage", "params", "grads", "optimizer", "activations", "comm", "temporaries", "total"]:
            at_peak.add_column(col, justify="right")
        for r in result.ranks:
            a = r.at_peak
            at_peak.add_row(str(r.stage), *(_bytes(a.get(k)) for k in (
                "params", "grads", "optimizer", "activations", "comm", "transient")), _bytes(r.allocated_bytes))
        console.print(at_peak)
    if args.peak_ops:
        _print_peak_blocks(result, args.peak_ops)
    if args.backend == "cuda":
        reserved = max(r.reserved_bytes or 0 for r in result.ranks)
        console.print(f"measured on {result.provenance.get('device')}: torch.cuda.max_memory_allocated; peak "
                      f"reserved {_bytes(reserved)}. Not seen: the CUDA context and what is allocated outside "
                      "PyTorch's allocator.")
    else:
        console.print("measured: every tensor PyTorch allocates (fake tensors, exact bytes); not seen: CUDA context, "
                      "NCCL buffers, math libraries' workspaces and 512-byte block rounding.")
        replayed = [r for r in result.ranks if r.replayed_reserved_bytes is not None]
        if replayed:
            console.print("reserved, replayed (PyTorch's CUDA caching allocator over the step's allocations and frees, "
                          "with the cuBLAS workspace, a pool per stream as FSDP2 uses them; "
                          "28 one-GPU steps on an H200: -1.5% to +2.9%, docs/accuracy_cuda.md): "
                          + ", ".join(f"stage {r.stage} {_bytes(r.replayed_reserved_bytes)}" for r in replayed))
    for path in (args.out, args.timeline):
        if path:
            console.print(f"wrote {path}")
    return 0


def _print_peak_blocks(result: Any, top: int) -> None:
    """Per rank, the ``top`` largest groups of blocks live at its peak: which op made the peak."""
    for r in result.ranks:
        table = Table(title=f"stage {r.stage}, rank {r.rank}: live at its peak ({_bytes(r.allocated_bytes)}), "
                            "by the op that allocated each block")
        for col in ("bytes", "blocks", "each", "op (backward: made in a backward; else the tracker's kind)"):
            table.add_column(col, justify="left" if col.startswith("op") else "right")
        shown = r.peak_blocks[:top]
        for op, n, size in shown:
            table.add_row(_bytes(n * size), str(n), _bytes(size), op)
        rest = sum(n * size for _, n, size in r.peak_blocks[top:])
        if rest:
            table.add_row(_bytes(rest), str(sum(n for _, n, _ in r.peak_blocks[top:])), "", "(the rest)")
        console.print(table)


def _write_timeline(path: str, result: Any) -> None:
    """What was live on each measured rank as the step went, as CSV (bytes by the estimator's
    categories): the way to see which moment makes a peak and what it is made of."""
    import csv

    from ndplan.census.measurement import CATEGORIES

    columns = [c for c in CATEGORIES if c != "optimizer_step"]
    try:
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["rank", "stage", "event", "phase", "in_backward", "total_bytes",
                             *(f"{c}_bytes" for c in columns)])
            for rank in result.ranks:
                for event, (phase, backward, live) in enumerate(rank.timeline):
                    writer.writerow([rank.rank, rank.stage, event, phase, int(backward), live["total"],
                                     *(live.get(c, 0) for c in columns)])
    except OSError as error:
        raise NdplanError(f"--timeline: cannot write {path}: {error.strerror}") from error


# ---------------------------------------------------------------- verify
def _apply_from(args: argparse.Namespace) -> None:
    """``--from CONFIG``: take the model and any strategy setting not given as a flag from a
    framework's launch config (the measurement needs a preset or config.json model)."""
    if not getattr(args, "from_config", None):
        return
    from ndplan.io.cli import merge_settings, print_messages, read_from_args
    from ndplan.io.common import derive_batch

    result = read_from_args(args)
    print_messages(result)
    if result is None:
        return
    if args.model is None and result.model is not None:
        args.model = result.model.name
    # The file's settings under the flags, what they change derived again (as estimate does).
    given = {key: getattr(args, key) for key in _FLAG_KEYS if getattr(args, key, None) is not None}
    merged = merge_settings(result, given)
    if result.format != "hf" and "dp" not in merged and not result.devices:
        # A launch config with no world size (torchtitan's data_parallel_shard_degree -1, a script
        # without torchrun's counts): its data-parallel degree is not known, as `inspect` says;
        # measuring dp 1 would be another strategy than the config's.
        raise NdplanError(f"{result.source}: the data-parallel degree depends on the world size, which the file "
                          "does not state; give --devices (or --dp)")
    # What the config runs that a measured step has no flag for: refused rather than dropped (the
    # step measured would be another strategy than the config's).
    unmeasured = [what for key, what in (("cp", "context parallelism"), ("ep", "expert parallelism"))
                  if int(merged.get(key) or 1) > 1]
    if unmeasured:
        raise NdplanError(f"{result.source}: runs {' and '.join(unmeasured)}, which a measured step does not: "
                          f"measure the strategy without {'them' if len(unmeasured) > 1 else 'it'}, by flags")
    policy = result.runtime_settings.get("selective_policy")
    if args.selective_policy is None and policy == "torchtitan-op" and merged.get("recompute") == "selective":
        args.selective_policy = policy  # torchtitan's per-op checkpointing, measured as it runs
    if args.loss_parallel is None and result.runtime_settings.get("loss_parallel") and int(merged.get("tp") or 1) > 1:
        args.loss_parallel = True  # torchtitan's loss on vocabulary-sharded logits
    if int(merged.get("tp") or 1) == 1:
        merged.pop("sp", None)  # (a reader's sequence-parallel default shards nothing without TP)
    for key, value in merged.items():
        if key in _FLAG_KEYS and getattr(args, key, None) is None and not isinstance(value, dict):
            setattr(args, key, value if key != "precision" or isinstance(value, str) else None)
    if result.devices and getattr(args, "dp", None) is None:
        per_replica = (args.tp or 1) * (args.pp or 1)
        args.dp = max(result.devices // per_replica, 1)
    derived_runs = getattr(args, "pipeline_runs", None) == 0
    if derived_runs:
        # Runs derived from the file's global batch (torchtitan's accumulation steps): as many as
        # the measured degrees leave, gbs / (dp · micro-batch size · micro-batches a run).
        if args.dp is None:
            raise NdplanError(f"{result.source}: its pipeline runs follow from the global batch and the "
                              "data-parallel degree: give --dp or --pipeline-runs")
        fields = {"global_batch_size": merged.get("gbs"), "dp": args.dp, "pp": args.pp or 1, "pipeline_runs": 0,
                  "micro_batch_size": args.mbs or 1, "num_micro_batches": args.num_micro_batches}
        derive_batch(fields)
        args.pipeline_runs, args.num_micro_batches = fields["pipeline_runs"], fields["num_micro_batches"]
    elif args.num_micro_batches is None and merged.get("gbs") and args.dp:
        # Micro-batches the flags made stale: the file's global batch over the measured degrees.
        args.num_micro_batches = max(1, int(merged["gbs"]) // (args.dp * (args.mbs or 1) * (args.pipeline_runs or 1)))
    gbs = merged.get("gbs")
    if gbs and args.dp and "pipeline_runs" not in given and (derived_runs or "num_micro_batches" not in given):
        # Derived from the file's global batch, the micro-batches and runs must give it back (given
        # ones win).
        step = args.dp * (args.mbs or 1) * (args.num_micro_batches or 1) * (args.pipeline_runs or 1)
        if step != int(gbs):
            raise NdplanError(f"{result.source}: its global batch {gbs} is not dp·mbs·num_micro_batches·pipeline_runs = "
                              f"{args.dp}·{args.mbs or 1}·{args.num_micro_batches or 1}·{args.pipeline_runs or 1} = "
                              f"{step} with these flags; give --num-micro-batches and --pipeline-runs to measure "
                              "another batch")


def _measured_from_config(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``--from CONFIG --measured FILE``: the model, strategy and runtime of a launch config (a
    Megatron script estimates with the megatron profile and its attention kernel and loss), the
    measured peaks per rank of the file, whose global ranks map to stages as the frameworks lay
    them out (pipeline-parallel ranks outermost)."""
    from ndplan.census.measurement import load_measurement
    from ndplan.cli_args import runtime_options
    from ndplan.io.cli import print_messages, read_from_args

    if _strategy_given(args) or args.selective_policy is not None or args.loss_parallel is not None:
        raise NdplanError("with --from and --measured the strategy comes from the config; drop the strategy flags")
    # MODEL, where given, completes or overrides the config's model, as `estimate --from` takes
    # --model: a launch script that names a tokenizer states no vocabulary size, and was refused.
    result = read_from_args(args)
    assert result is not None
    print_messages(result)
    if result.model is None:
        raise NdplanError(f"{args.from_config} does not describe the whole model; give MODEL (a preset or "
                          "config.json) to complete it")
    strategy = result.strategy(result.devices)
    measurement = load_measurement(args.measured, model=result.model.name, strategy=strategy)
    # --attention may override the config's kernel; census files go to verify itself.
    flags = argparse.Namespace(attention=args.attention)
    return result.model, measurement, runtime_options(flags, None, result.runtime_settings)


def cmd_verify(args: argparse.Namespace) -> int:
    from ndplan.census.verify import verify

    # (a comparison NaN fails: nan and inf read "exceeds ±nan%" and "within ±inf%")
    if args.tolerance is not None and not 0 <= args.tolerance < float("inf"):
        raise NdplanError(f"--tolerance must be a finite number >= 0 (percent), got {args.tolerance}")
    options = None
    if args.measured and getattr(args, "backend", "fake") != "fake":
        raise NdplanError("--backend measures a step; with --measured the measurement is the file's: drop one")
    if args.measured and getattr(args, "from_config", None):
        spec, measurement, options = _measured_from_config(args)
    elif args.measured:
        from ndplan.census.measurement import load_measurement
        from ndplan.model import load_model

        if _strategy_given(args):
            raise NdplanError("with --measured the model, layers and strategy come from the file; drop the strategy flags")
        if args.devices is not None:
            raise NdplanError("--devices goes with --from: a measured file states its strategy")
        if args.selective_policy is not None or args.loss_parallel is not None:
            raise NdplanError("--selective-policy, --loss-parallel: the measured file states what its step ran (its "
                              "'selective_policy' and 'loss_parallel'); drop the flag")
        if args.attention is not None:  # estimated as the file's 'attention' says, whatever the flag
            raise NdplanError("--attention: the measured file states the kernel its run used ('attention'); "
                              "drop the flag")
        measurement = load_measurement(args.measured)
        if args.model and args.model != measurement.model:
            raise NdplanError(f"{args.measured} measured model {measurement.model!r}, not {args.model!r}")
        spec = load_model(measurement.model)
    else:
        if args.devices is not None:
            raise NdplanError("--devices goes with --from and --measured; a measured step takes its degrees as flags")
        args.attention = args.attention or "sdpa"
        _apply_from(args)
        if not args.model:
            raise NdplanError("give MODEL (a preset or config.json) to measure, or --measured FILE.json")
        measurement = _measure(args)
        spec = _model_inputs(args.model)[2]
    census: tuple[Any, ...] = ()
    if args.census:
        from ndplan.census.record import load_census_file

        census = tuple(load_census_file(args.census))
    result = verify(spec, measurement, census=census, options=options)
    ok = args.tolerance is None or result.within(args.tolerance)
    if args.json:
        _emit_json(result.to_dict() | {"tolerance_pct": args.tolerance, "within_tolerance": ok})
        return 0 if ok else 1
    s = measurement.strategy
    depth = f" ({result.model.num_layers} layers)" if measurement.num_layers else ""
    for stage in result.stages:
        if not stage.measured_ranks:
            continue
        table = Table(title=f"{result.model.name}{depth} — {s.short()} {s.precision.name} seq {s.seq_length} — "
                            f"stage {stage.stage} ({stage.layers} layers): estimate vs measured")
        for col in ["", "estimate", "measured", "error", "measured at fwd/bwd peak"]:
            table.add_column(col, justify="left" if not col else "right")
        for row in stage.rows:
            bold = row.key in ("allocated", "reserved")
            table.add_row(row.label, _bytes(row.estimate), _bytes(row.measured), _pct(row.error_pct),
                          _bytes(row.at_peak), style="bold" if bold else None)
        console.print(table)
    below_zero = any(row.key == "transient" and row.estimate < 0 for stage in result.stages for row in stage.rows)
    if below_zero:
        # The categories above it need not all exist at the forward/backward peak.
        console.print("rest of fwd/bwd peak: that peak less the categories above it, below zero where the gradients "
                      "the backward has not made yet at that moment (and activations it has freed) outweigh the "
                      "working set; `ndplan estimate --explain` gives both terms")
    console.print(f"measurement: {measurement.source or 'measured file'}")
    peak = result.peak_row()
    if peak is not None:
        peak_stage, row = peak
        console.print(f"peak allocated: estimate {format_bytes(row.estimate)}, measured {_bytes(row.measured)} "
                      f"(stage {peak_stage}), error {_pct(row.error_pct)}")
    worst = result.worst()
    if args.tolerance is not None and worst is not None:
        verdict = "[bold green]within[/]" if ok else "[bold red]exceeds[/]"
        console.print(f"{verdict} ±{args.tolerance:g}%: worst {worst.label} error {_pct(worst.error_pct)}")
    return 0 if ok else 1


# ---------------------------------------------------------------- registration
def _add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("fake", "cuda"), default="fake",
                        help="fake: fake tensors on CPU, any parallel layout (default); cuda: a real step on "
                             "this machine's GPU, one device, torch.cuda.max_memory_allocated/reserved")


def add_census_commands(subparsers: Any) -> None:
    """Register `census`, `measure` and `verify` on ndplan's subcommand parser."""
    from ndplan.census.measure import ATTENTIONS, EXPERTS

    p = subparsers.add_parser("census", help="measure what each layer kind saves for backward (needs torch)")
    p.add_argument("models", nargs="+", metavar="MODEL", help="preset name or config.json path")
    p.add_argument("--seq", type=int, default=4096, help="sequence length in tokens (default 4096)")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size in sequences (default 1)")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa",
                   help="transformers' attention implementation (default sdpa)")
    p.add_argument("--experts", choices=EXPERTS, default="grouped_mm",
                   help="transformers experts implementation (default grouped_mm)")
    p.add_argument("--out", help="write the census records to this JSON file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_census)

    p = subparsers.add_parser("measure", help="measure one training step's memory with PyTorch on fake tensors (needs torch)")
    p.add_argument("model", metavar="MODEL", help="preset name or config.json path")
    add_step_arguments(p)
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa",
                   help="transformers' attention implementation (default sdpa)")
    _add_backend_argument(p)
    p.add_argument("--out", help="write the measurement (measured-memory JSON) to this file")
    p.add_argument("--timeline", metavar="CSV",
                   help="write what was live on each rank as the step went (bytes by category) to this CSV file")
    p.add_argument("--peak-ops", metavar="N", type=positive_int,
                   help="print the N largest groups of blocks live at each rank's peak, by the op that allocated them")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_measure)

    p = subparsers.add_parser("verify", help="compare the memory estimate with a measurement (fake-tensor step or a JSON file)")
    p.add_argument("model", metavar="MODEL", nargs="?", help="preset name or config.json path (optional with --measured; with --from, "
                   "it completes or overrides the config's model)")
    add_step_arguments(p)
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="attention kernel (default: sdpa; with --from and --measured, what the config states)")
    _add_backend_argument(p)
    p.add_argument("--devices", type=int, help="world size, with --from and --measured when the config does not state it")
    p.add_argument("--measured", help="measured-memory JSON (e.g. from a real cluster) instead of measuring; with "
                                      "--from, only its ranks' peaks: model, strategy and runtime come from the "
                                      "launch config")
    p.add_argument("--tolerance", type=float, metavar="PCT", help="exit 1 if a stage's peak misses the measurement by more than PCT percent")
    p.add_argument("--census", help="census JSON: measured activations replace the profile's formulas")
    from ndplan.io.cli import add_from_argument

    add_from_argument(p, "verify")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)


__all__ = ["add_census_commands", "add_step_arguments", "cmd_census", "cmd_measure", "cmd_verify", "strategy_from_args"]
