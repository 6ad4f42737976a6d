"""`ndplan search`: the fastest strategies that fit, over every parallel dimension; why the others
lost, the Pareto front, what would fit where nothing does, and (--emit) the fastest candidate a
framework writes as priced, read back to check.

Wired into ``ndplan.cli.build_parser`` with ``add_search_command(sub)``; errors are raised as
:class:`NdplanError`, which ``ndplan.cli.main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ndplan.cli_args import (
    EFFICIENCY_HELP,
    HOST_MEMORY_HELP,
    add_runtime_arguments,
    device_count,
    device_from,
    memory_limit,
    sequence_count,
    sequence_length,
    strategy_from_settings,
    with_host_memory,
)
from ndplan.cli_common import console, dispatcher_note, emit_json, memory_options, print_kernels, require
from ndplan.cli_emit import (
    emit_settings,
    read_back,
    round_trips,
    runtime_note,
    written_precision,
    written_strategy,
)
from ndplan.errors import NdplanError
from ndplan.model import ModelSpec, load_model
from ndplan.model.heads import KvRepeat
from ndplan.model.hf import first_validation_error
from ndplan.outputs import made_folder, output_path
from ndplan.progress import shows_progress
from ndplan.strategy import Strategy
from ndplan.strategy.strategy import OFFLOAD_MODULES, RECOMPUTE_MODULES
from ndplan.units import format_bytes


def add_search_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ndplan search`` on the subparsers of the ``ndplan`` parser; returns its parser."""
    from ndplan.io import EMIT_FORMATS
    from ndplan.io.cli import add_from_argument
    from ndplan.search import DIMENSIONS
    from ndplan.search.space import OPT_IN_DIMENSIONS
    from ndplan.strategy import PRECISION_PRESETS

    p: argparse.ArgumentParser = subparsers.add_parser(
        "search", help="the fastest strategies that fit, over every parallel dimension")
    p.add_argument("--model", help="preset name, a config.json / spec YAML path, or a model folder with a config.json")
    p.add_argument("--hardware", help="device preset or device YAML path")
    p.add_argument("--efficiency", help=EFFICIENCY_HELP)
    p.add_argument("--devices", type=device_count,
                   help="number of devices, every candidate uses all of them (needed, unless --from states it)")
    p.add_argument("--gbs", type=sequence_count,
                   help="global batch size in sequences (needed, unless --from states it)")
    p.add_argument("--seq", type=sequence_length, help="sequence length in tokens (default 4096)")
    add_from_argument(p, "search")
    p.add_argument("--dims", nargs="+", action="extend", choices=DIMENSIONS,
                   help="dimensions to search (default: all but " + ", ".join(OPT_IN_DIMENSIONS) + ", which are "
                        "searched only where named)")
    p.add_argument("--fix", nargs="+", action="extend", metavar="NAME=VALUE", help="fix dimensions, e.g. tp=8 schedule=1f1b (also vpp=N and seq_chunks=N, the "
                   "pipeline option's other parts)")
    p.add_argument("--memory-limit", help="per-device limit, e.g. 70GiB (default: the device's memory)")
    p.add_argument("--host-memory", help=HOST_MEMORY_HELP)
    p.add_argument("--precision", choices=sorted(PRECISION_PRESETS),
                   help="the candidates' precision (default: the --from file's, else the one --emit's format "
                        "writes, else megatron-bf16)")
    p.add_argument("--recompute-modules", nargs="+", action="extend", choices=RECOMPUTE_MODULES, metavar="MODULE",
                   help="what the selective-recompute candidates re-run (Megatron-Core's --recompute-modules; "
                        "runtime megatron); default: the runtime's own policy")
    p.add_argument("--offload-modules", nargs="+", action="extend", choices=OFFLOAD_MODULES, metavar="MODULE",
                   help="what every candidate offloads to host memory (Megatron-Core's --offload-modules; runtime "
                        "megatron; default: nothing); candidates Megatron would not run with it (full recompute, its default selective "
                        "policy with core_attn, other schedules) are rejected")
    p.add_argument("--offload-module-sets", nargs="+", action="extend", metavar="SET",
                   help="search what goes to host memory (runtime megatron): sets such as 'expert_fc1+moe_act' or "
                        "'none', or 'common' (up to 5 sets for the model); '--dims ... offload_modules' searches "
                        "'common'")
    p.add_argument("--recompute-module-sets", nargs="+", action="extend", metavar="SET",
                   help="search what selective recompute re-runs (runtime megatron): sets such as "
                        "'layernorm+moe_act' or 'default' (the runtime's own policy), or 'common' (up to 5 sets "
                        "for the model) or 'all' (every subset of the modules the model has); "
                        "'--dims ... recompute_modules' searches 'common'")
    p.add_argument("--top", type=int, default=10, help="how many ranked strategies to show (default 10)")
    p.add_argument("--balance", nargs="?", const="per-layer", choices=["per-layer", "one-setting"],
                   help="rank every fitting candidate by its balanced plan (pipelines: layers per stage and recompute "
                        "per layer; --balance alone is per-layer); 'one-setting' ranks by the fastest plan one recompute setting expresses (with "
                        "--emit, one that format writes back: torchtitan has no recompute of the first k layers)")
    p.add_argument("--csv", help="write the ranked rows to a CSV file")
    p.add_argument("--emit", choices=EMIT_FORMATS,
                   help="print the fastest ranked candidate that framework writes as priced (each read back to "
                        "check; the first 20 at most) as its settings")
    p.add_argument("--explain", action="store_true",
                   help="print the winner's memory (peak stage) and time term by term, with formulas")
    add_runtime_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_search)
    return p


#: A --from file's settings no search dimension holds, carried to every candidate as constants of
#: the space (``SearchSpace.carried``; plan-file keys), each where it means something.
_FILE_CARRIED = ("shard_group", "reshard", "recompute_layers", "ulysses_degree", "optimizer_offload",
                 "optimizer_offload_fraction", "offload_optimizer_states", "embedding_as_layer", "output_as_layer")
#: A --from file's settings the search cannot carry: dropped from the candidates, each named.
_FILE_DROPPED = ("stage_layers",)
#: Search dimensions a config file read by --from sets (plan-file keys, as the space names them).
_FILE_FIXABLE = ("tp", "sp", "cp", "cp_kind", "ep", "etp", "pp", "schedule", "zero", "mbs", "recompute",
                 "offload_layers")


def _carried_note(name: str, value: Any) -> str:
    """How the search applies a --from file's setting it carries (plan-file key ``name``)."""
    where = {"shard_group": "where zero > 0; dp·cp must be a multiple of it",
             "reshard": "the ZeRO-3 candidates, under a pipeline or not",
             "recompute_layers": "where the candidate recomputes; a stage must hold that many layers",
             "ulysses_degree": "under hybrid context parallelism; it must divide cp",
             "offload_optimizer_states": "the candidates with the distributed optimizer, zero 1",
             "optimizer_offload_fraction": "the candidates that offload the optimizer"}.get(name)
    return f"{name} {value!r}" + (f" ({where})" if where else "")


def _parse_fix(items: list[str]) -> dict[str, int | str]:
    fixed: dict[str, int | str] = {}
    for item in items:
        if "=" not in item:
            raise NdplanError(f"--fix takes NAME=VALUE, got '{item}'")
        name, value = item.split("=", 1)
        if name.strip() in fixed:
            raise NdplanError(f"--fix {name.strip()} is given twice ({fixed[name.strip()]} and {value.strip()})")
        fixed[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return fixed


def search_result_dict(result: Any, model: ModelSpec, device: Any, space: Any) -> dict[str, Any]:
    from ndplan.report.data import candidate_cloud

    return {
        "model": model.name, "hardware": device.name, "devices": space.num_devices,
        "global_batch_size": space.global_batch_size, "seq_length": space.seq_length,
        "precision": space.precision.name,
        "space_size": result.space_size, "evaluated": result.evaluated, "fitting": result.fitting,
        "seconds": round(result.seconds, 3), "memory_limit_bytes": result.memory_limit_bytes,
        "rejected": result.rejected, "ranked": result.ranked, "pareto": result.pareto, "notes": result.notes,
        "smallest_peak_bytes": result.smallest_peak_bytes,
        "candidates": candidate_cloud(result.candidates_time_s, result.candidates_peak_bytes),
    }


@dataclass(frozen=True)
class _SearchAsked:
    """What the flags, and a config read with --from (``read``), ask the search for: the model
    (without its MTP modules where --emit torchtitan builds none: ``no_mtp``), the device, the
    devices, global batch and sequence; the settings fixed (--fix, and a file's dimensions not
    searched); a file's settings no dimension holds (``stated``: ``carried`` as constants of the
    space, ``dropped`` said); the runtime's options, the precision priced, and the space the
    flags describe on a number of devices (``space_on``)."""

    read: Any
    model: ModelSpec
    device: Any
    devices: int
    gbs: int
    seq: int
    fixed: dict[str, Any]
    stated: dict[str, Any]
    carried: dict[str, Any]
    dropped: list[str]
    no_mtp: bool
    options: Any
    precision: Any
    space_on: Callable[[int], Any]


def _asked(args: argparse.Namespace) -> _SearchAsked:
    """What ``args`` ask the search for (see ``_SearchAsked``); an NdplanError names what is missing."""
    from ndplan.io.common import PLAN_TO_FIELD, policy_of
    from ndplan.search import default_space
    from ndplan.search.space import runtime_reshard_under_pipeline
    from ndplan.strategy import get_precision

    read = None
    if args.from_config:
        from ndplan.io.cli import model_for, print_messages, read_from_args

        read = read_from_args(args)
        print_messages(read)
        settings = read.strategy_settings if read is not None else {}
        model = model_for({"model": args.model} if args.model else {}, read)
        devices: Any = args.devices or (read.devices if read is not None else None)
        gbs: Any = args.gbs or settings.get("gbs")
        seq: Any = args.seq or settings.get("seq")
    else:
        model = load_model(require(vars(args), "model", "--model", ", or --from a config"))
        devices, gbs, seq = args.devices, args.gbs, args.seq
    given = {"hardware": args.hardware, "devices": devices, "gbs": gbs}
    for key, flag in (("hardware", "--hardware"), ("devices", "--devices"), ("gbs", "--gbs")):
        require(given, key, flag, "" if key == "hardware" else ", or --from a config that sets it")
    seq = seq or 4096
    device = with_host_memory(args.host_memory, device_from(args.hardware, args.efficiency))
    fixed, recompute_sets = _parse_fix(args.fix or []), _searched_sets(args, read, model, "recompute")
    if read is not None and args.dims:
        # The dimensions not searched keep the file's values (--fix wins), not ndplan's defaults.
        kept = {name: read.strategy_settings[name] for name in _FILE_FIXABLE
                if name not in args.dims and name not in fixed and name in read.strategy_settings}
        if "schedule" in kept:  # the file's whole pipeline option: its vpp (5 is none of the searched ones)
            kept.update({name: read.strategy_settings[name] for name in ("vpp", "seq_chunks")
                         if name not in fixed and name in read.strategy_settings})
        fixed.update({name: int(value) if isinstance(value, bool) else value for name, value in kept.items()})
    # The file's settings no dimension holds: carried as constants of the space where it can,
    # else dropped, and said (not priced silently as the default).
    file_settings = read.strategy_settings if read is not None else {}
    stated = {name: file_settings[name] for name in (*_FILE_CARRIED, *_FILE_DROPPED)
              if name != "reshard" and name in file_settings
              and file_settings[name] != getattr(Strategy(), PLAN_TO_FIELD[name])}
    # (a setting searched or fixed as a dimension is the dimension's, not carried)
    stated = {name: value for name, value in stated.items()
              if not (name in (args.dims or ()) or name in fixed)}
    carried = {PLAN_TO_FIELD[name]: value for name, value in stated.items() if name in _FILE_CARRIED}
    dropped = [f"{name} {value!r}" for name, value in stated.items() if name in _FILE_DROPPED]
    # The file's layer offload, where neither searched nor fixed (it is an opt-in dimension).
    offloaded = file_settings.get("offload_layers", 0)
    if offloaded and "offload_layers" not in fixed and "offload_layers" not in (args.dims or ()):
        dropped.append(f"offload_layers {offloaded!r} (--dims ... offload_layers searches it)")
    offload_sets = _searched_sets(args, read, model, "offload")
    # Priced as the framework builds the model: torchtitan's model classes have no MTP module.
    no_mtp = args.emit == "torchtitan" and model.mtp_depth > 0
    if no_mtp:
        model = model.model_copy(update={"mtp_depth": 0})

    options = memory_options(args, {"overlap": args.overlap}, read, device)
    # Megatron runs FSDP under a pipeline only resharding (Megatron-FSDP)
    reshard_under_pipeline = runtime_reshard_under_pipeline(options) or args.emit == "megatron"
    # A ZeRO-3 file's resharding, where the runtime's policy gives its own strategy another
    # (a torchtitan "always" or "never"; a policy that follows the pipeline stays the runtime's).
    if file_settings.get("zero") == 3 and "reshard" in file_settings \
            and bool(file_settings["reshard"]) != (reshard_under_pipeline or file_settings.get("pp", 1) == 1):
        stated["reshard"] = carried["reshard_after_forward"] = bool(file_settings["reshard"])
    # Priced as the user's framework runs: a file states its precision; a format that cannot
    # write Megatron's (torchtitan's fp32 FSDP shards, MindSpore's one dtype) runs its own.
    if args.precision is not None:
        precision = get_precision(args.precision)
    elif read is not None and "precision" in read.strategy_settings:
        precision = policy_of(read.strategy_settings["precision"])
    elif args.emit:
        precision = written_precision(model, args.emit, options, device)
    else:
        precision = get_precision("megatron-bf16")

    def space_on(on_devices: int) -> Any:
        """The space the flags describe, on ``on_devices`` devices (the degrees it enumerates depend on them)."""
        return default_space(model, device, on_devices, gbs, seq, precision,
                             dims=tuple(args.dims) if args.dims else None, fixed=fixed,
                             recompute_modules=recompute_sets, offload_modules=offload_sets,
                             reshard_under_pipeline=reshard_under_pipeline, carried=carried)

    return _SearchAsked(read, model, device, devices, gbs, seq, fixed, stated, carried, dropped, no_mtp, options,
                        precision, space_on)


def cmd_search(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ndplan.search import run_search, runtime_step_time

    if args.top < 1:
        raise NdplanError(f"--top must be at least 1, got {args.top}")
    if args.csv:
        # Before the search (seconds to minutes), not after it: a folder that is not there.
        output_path(args.csv, "--csv", "CSV file")
    asked = _asked(args)
    read, model, device, devices, options = asked.read, asked.model, asked.device, asked.devices, asked.options
    precision, fixed, stated, carried, dropped = asked.precision, asked.fixed, asked.stated, asked.carried, asked.dropped
    no_mtp = asked.no_mtp
    space = asked.space_on(devices)
    limit = memory_limit(args.memory_limit, device)
    # --emit reads the ranked candidates back until one is written as priced: rank enough of them.
    ranked_top = max(args.top, _WRITTEN_CHECKED) if args.emit else args.top
    step_time = runtime_step_time(options)  # the runtime's step-time model, as memory follows its profile
    quiet = not shows_progress(args.json)
    with Progress(TextColumn("searching {task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=quiet) as progress:
        task = progress.add_task(f"{space.size:,} candidates", total=space.size)
        result = run_search(
            model, device, space, step_time, memory_limit_bytes=limit, options=options, top=ranked_top,
            progress=lambda done, total: progress.update(task, completed=done),
        )
    runs = 1
    if read is not None and "pipeline_runs" in read.strategy_settings:
        from ndplan.io.cli import merge_settings

        try:  # the file's runs on the devices and global batch searched
            runs = strategy_from_settings(merge_settings(read, {"devices": devices, "gbs": asked.gbs})).pipeline_runs
        except (NdplanError, ValidationError):
            pass  # the file's batch does not fit these devices: the search says what it can
    if runs > 1:
        result.notes.append(
            f"the config runs its pipeline schedule {runs} times a step (gradient accumulation outside it)"
            + ("; runs searched: each candidate's micro-batches in one run or several (--dims ... pipeline_runs)"
               if len(space.pipeline_runs) > 1 else
               "; the search schedules each candidate's micro-batches in one run (one bubble a step), which a "
               "framework that accumulates outside the pipeline reaches with one accumulation step; search the "
               "runs with --dims ... pipeline_runs"))
    if carried:
        result.notes.append("--from: every candidate keeps these settings of the file, which no search dimension "
                            "holds: " + "; ".join(_carried_note(name, value) for name, value in stated.items()
                                                  if name in _FILE_CARRIED)
                            + " (a candidate they are invalid for is rejected by the rule named in 'rejected')")
    if dropped:
        result.notes.append(f"--from: the search cannot carry these settings of the file, so its candidates run "
                            f"without them (ndplan's defaults): {', '.join(dropped)}")
    if no_mtp:
        result.notes.append("candidates priced without MTP (mtp_depth 0): torchtitan builds no multi-token-prediction "
                            "module, so the settings --emit torchtitan writes run none")
    if not result.ranked:
        result.notes.extend(_what_would_fit(result, model, device, devices, asked.space_on, options))
    elif args.balance:
        _rank_balanced(args, asked, space, result, step_time, limit, ranked_top, quiet)
    result.notes.extend(_unfused_notes(result.ranked[:args.top], model, device, options, precision))
    result.notes.extend(_kv_repeat_notes(result.ranked[:args.top], model, options.ulysses_kv_repeat))
    # --fix wins over --dims (a file's settings too): say so rather than search the value alone.
    result.notes.extend(f"--dims {name}: fixed by --fix {name}={fixed[name]}, so not searched"
                        for name in args.dims or () if name in fixed)
    from ndplan.perf import default_overlap

    overlap = options.overlap or default_overlap(device.runtime)
    data = search_result_dict(result, model, device, space)
    data["overlap"] = overlap.model_dump(mode="json")
    data["runtime"] = options.runtime
    data["loss_upcast"] = options.loss_upcast
    data["selective_policy"] = options.selective_policy
    data["modules"] = options.modules
    data["experts_outside_fsdp"] = options.experts_outside_fsdp
    # A balanced winner is written (and explained) as the settings one recompute setting expresses.
    winner = (Strategy(**result.best.get("balanced_settings", result.best)["strategy"],
                       precision=precision) if result.best else None)
    if args.emit and winner is not None:
        _emit_checked(args, asked, space, result, data, limit, quiet)
    if len(result.ranked) > args.top:  # the rows --emit read back beyond --top are not listed
        del result.ranked[args.top:]
        data["ranked"] = result.ranked
    if args.csv:
        _write_csv(args.csv, result.ranked)
    explained = None
    if args.explain and winner is not None:
        try:
            explained = _explain_winner(model, winner, device, options)
        except NdplanError as error:
            # The search prices a pipeline in closed form; estimate simulates it, and a schedule too
            # long to simulate is refused there: the ranking stands, the explanation cannot be made.
            result.notes.append(f"--explain: the winner cannot be priced on its own: {error}")
    if explained is not None:
        data["explain"] = explained
    if args.json:
        emit_json(data)
        return 0 if result.ranked else 1
    return _print_search_text(args, asked, space, result, data, overlap, winner, explained)


def _kv_repeat_notes(ranked: list[dict[str, Any]], model: ModelSpec, when: KvRepeat = "needed") -> list[str]:
    """How many ranked plans run Ulysses over more ranks than a tensor-parallel rank's KV heads
    (``model.heads.ulysses_kv_repeat``), as a note; none where there are none."""
    from ndplan.model.heads import ulysses_kv_repeat

    settings = [Strategy(**fields) for row in ranked if (fields := row.get("balanced_settings", row).get("strategy"))]
    repeated = [s for s in settings if ulysses_kv_repeat(model, s.tp, s.ulysses_ranks, when) > 1]
    if not repeated:
        return []
    why = ("run a Ulysses group, before whose all-to-all MindSpeed-LLM repeats every GQA layer's KV heads to the "
           "query heads (--ulysses-kv-repeat always)" if when == "always" else
           "run Ulysses over more ranks than a tensor-parallel rank's KV heads: MindSpeed repeats them to the query "
           "heads before the all-to-all")
    return [f"{len(repeated)} of the {len(ranked)} ranked plans {why}, priced so (K and V moved and kept as wide as "
            "the queries)"]


def _unfused_notes(ranked: list[dict[str, Any]], model: ModelSpec, device: Any, options: Any,
                   precision: Any) -> list[str]:
    """How many ranked plans the runtime's rules price with their weight gradients added apart
    (``perf.accumulation``), as a note; none where there are none."""
    from ndplan.perf.accumulation import rules_apply, strategy_code, unfused_reason
    from ndplan.perf.efficiency import default_efficiency, with_software

    eff = with_software(default_efficiency(device), options.time_keywords()["software"])
    if not rules_apply(eff):
        return []
    # (a balanced row's launch is its balanced settings')
    settings = [row.get("balanced_settings", row).get("strategy") for row in ranked]
    fp16, npu = precision.compute_dtype == "fp16", eff.family.startswith("davinci")
    codes = [strategy_code(model, Strategy(**fields, precision=precision), fp16, npu) for fields in settings if fields]
    apart = [unfused_reason(code) for code in codes if code]
    if not apart:
        return []
    return [f"{len(apart)} of the {len(ranked)} ranked plans are priced with each weight gradient added to its buffer "
            f"by a kernel of its own, as their Megatron launch runs ({'; '.join(dict.fromkeys(apart))}); "
            "--emit megatron writes --no-gradient-accumulation-fusion for them"]


def _rank_balanced(args: argparse.Namespace, asked: _SearchAsked, space: Any, result: Any, step_time: Any,
                   limit: int | None, ranked_top: int, quiet: bool) -> None:
    """--balance: ``result``'s fitting candidates ranked by their balanced plans, and what the
    ranking rests on said in its notes."""
    model, device, options = asked.model, asked.device, asked.options
    from ndplan.schedule.ops import MAX_SIMULATED_PASSES
    from ndplan.search.balanced import rank_balanced

    one_setting_only = args.balance == "one-setting"
    from ndplan.hardware import Cluster

    expressible = round_trips(model, args.emit, Cluster(device=device, num_devices=space.num_devices), options,
                              by_shape=True) if args.emit else None
    from ndplan.progress import working

    with working(f"balancing the {result.fitting:,} fitting candidates", quiet=quiet):
        ranking = rank_balanced(
            model, device, space, result, step_time, memory_limit_bytes=limit or device.memory_bytes,
            options=options, top=ranked_top, one_setting=one_setting_only, expressible=expressible,
        )
    result.ranked, balanced, unsimulated = ranking.rows, ranking.balanced, ranking.unsimulated
    plans = "one recompute setting per plan" if one_setting_only else "recompute per layer"
    # Balancing simulates a pipeline's schedule, which the simulator refuses past its cap.
    too_long = (f"{unsimulated:,} ranked unbalanced, as the search priced them (their schedule is longer than "
                f"the simulator takes: {MAX_SIMULATED_PASSES:,} micro-batch passes, "
                f"num_micro_batches·pp·vpp·seq_chunks), " if unsimulated else "")
    kept_uniform = [f"{ranking.over_limit:,} over the limit by the full memory estimator"] if ranking.over_limit else []
    kept_uniform += [f"{ranking.slower:,} no faster by the full time estimator (per layer: with the schedule "
                     f"simulated)"] if ranking.slower else []
    result.notes.append(
        f"--balance: every fitting candidate ranked by its balanced plan (pipelines: layers per stage and "
        f"chunk, {plans}); {balanced:,} balanced, {too_long}the others' lower bound already above the "
        f"{ranking.walk}th composed step; a plan reached from several starting recompute settings is listed once")
    result.notes.append(
        f"--balance ranking: the {ranking.walk} fastest by the balancer's composed step (exactly those balancing "
        f"every candidate gives) re-ranked by the step shown, the full estimators' (`ndplan estimate`, the "
        f"pipeline simulated) where the plan is one recompute setting, else the balancer's stage times with "
        f"the schedule simulated; a candidate outside those {ranking.walk} "
        f"whose full estimate is below its composed step can be missed"
        + (f"; plans kept in their uniform form: {', '.join(kept_uniform)}" if kept_uniform else ""))
    one_setting = result.ranked[0].get("balanced_settings") if result.ranked else None
    if one_setting is not None and not one_setting["is_the_plan"]:
        result.notes.append(
            f"the winner's per-layer recompute needs a framework that sets it layer by layer (its figures are the "
            f"balancer's, the schedule simulated); as one recompute setting (what --emit writes) it is "
            f"{one_setting['label']}, layers {one_setting['stage_layers']}, step "
            f"{one_setting['estimated_step_s']:.3f} s by `ndplan estimate`")


def _emit_checked(args: argparse.Namespace, asked: _SearchAsked, space: Any, result: Any, data: dict[str, Any],
                  limit: int | None, quiet: bool) -> None:
    """--emit: the fastest ranked candidate the format writes as priced, its settings read back and
    priced again, into ``data`` ("emitted", "emitted_rank", "emitted_check"), and what differs
    said in its notes."""
    model, device, options, precision = asked.model, asked.device, asked.options, asked.precision
    from ndplan.hardware import Cluster
    from ndplan.progress import working

    # each candidate written, read back and priced again (about 2 s on DeepSeek-V3)
    with working(f"reading the ranked candidates back as {args.emit} settings", quiet=quiet):
        emitted_rank, text, check, first_written, first_same = _first_written_as_priced(
            model, result.ranked, args.emit, Cluster(device=device, num_devices=space.num_devices), options,
            precision, limit or device.memory_bytes)
    data["emitted"], data["emitted_rank"], data["emitted_check"] = text, emitted_rank, check
    if note := runtime_note(options, args.emit):
        data["notes"].append(f"--emit {args.emit}: {note}")
    if check.get("unpriced"):
        data["notes"].append(f"--emit {args.emit}: the settings written are not checked by the full estimators "
                             f"(they read back as {check['strategy']}): {check['unpriced']}")
    if check["fits"] is False:
        data["notes"].append(f"--emit {args.emit}: the settings written run over the limit as they read back "
                             f"(peak {format_bytes(check['peak_bytes'])}): {'; '.join(check['differs'])}")
    if check.get("precision") and check["precision"] != precision.name and check["step_s"] is not None:
        data["notes"].append(
            f"--emit {args.emit} writes precision {check['precision']}, not {precision.name} as priced: the file "
            f"runs peak {format_bytes(check['peak_bytes'])} ({'fits' if check['fits'] else 'over the limit'}), "
            f"step {check['step_s']:.3f} s (search with --precision {check['precision']} to rank as it runs)")
    as_written = [row.get("balanced_settings", row) for row in result.ranked]  # what one setting writes
    if emitted_rank > 1:
        data["notes"].append(
            f"--emit {args.emit}: the fastest candidate {args.emit} writes as priced is #{emitted_rank}, "
            f"{check['strategy']} ({_written_step(result.ranked[emitted_rank - 1]):.3f} s); "
            + (f"#1's one recompute setting, {as_written[0]['label']}, runs {_written_step(result.ranked[0]):.3f} s"
               if first_same else f"#1, {as_written[0]['label']}, would be written as {first_written}"))
    elif emitted_rank == 0:
        data["notes"].append(
            f"--emit {args.emit}: none of the first {min(len(result.ranked), _WRITTEN_CHECKED)} ranked candidates "
            f"is written as priced; the winner's settings below "
            + (f"are {first_written}" if first_written.startswith("settings ")  # refused: say why
               else f"run {check['strategy']} ({check['step_s']:.3f} s, peak {format_bytes(check['peak_bytes'])}, "
               f"{'fits' if check['fits'] else 'over the limit'})" if check["step_s"] is not None
               else f"are {check['strategy']}")
            + f"; --fix what {args.emit} runs")


def _print_search_text(args: argparse.Namespace, asked: _SearchAsked, space: Any, result: Any,
                       data: dict[str, Any], overlap: Any, winner: Strategy | None,
                       explained: dict[str, Any] | None) -> int:
    """The search for people: the tables, what the step times assume, the settings --emit wrote
    and --explain's terms; the exit code (1 where nothing fits)."""
    model, device, options, precision = asked.model, asked.device, asked.options, asked.precision
    _print_search(result, model, device, space)
    if args.precision is None and args.emit:
        console.print(f"candidates priced in {precision.name}, the precision {args.emit} writes (--precision to choose)")
    console.print(f"step times with overlap {'as given' if options.overlap else 'defaults (set with --overlap)'}: "
                  f"{overlap.describe()}" + dispatcher_note(options, model), markup=False)
    print_kernels(options, model=model)
    if data.get("emitted"):
        whose = "the winner" if data.get("emitted_rank") in (1, 0) else f"#{data['emitted_rank']}"
        console.print(f"\n[bold]{args.emit}[/] settings of {whose}:")
        console.print(data["emitted"], markup=False, soft_wrap=True)  # settings to paste: never wrapped
    if explained is not None and winner is not None:
        console.print(f"\n[bold]the winner, {winner.short()}, explained[/] (as `ndplan estimate --explain`)")
        ranked = result.best["step_s"] if result.best and "balanced_settings" not in result.best else None
        if ranked is not None and abs(explained["step_s"] / ranked - 1) > 1e-6:
            # The search prices pipelines in closed form (millions of candidates); estimate simulates.
            console.print(f"ranked at {ranked:.3f} s by the search's closed-form pipeline; the simulated schedule "
                          f"below gives {explained['step_s']:.3f} s ({100 * (explained['step_s'] / ranked - 1):+.2f}%)")
        for part in ("memory", "time"):
            console.print(f"{part}{', peak stage' if part == 'memory' else ''}:")
            for line in explained[part]:
                console.print("  " + line, markup=False)
    return 0 if result.ranked else 1




#: Ranked candidates --emit reads back at most, looking for one the format writes as priced.
_WRITTEN_CHECKED = 20
#: The temporary file a read-back names in its errors ("/tmp/.../emitted.sh:5: ").
_WRITTEN_FILE = re.compile(r"^\S*emitted\.\w+:(\d+:)? ?")


def _torchtitan_refuses(text: str, devices: int) -> str:
    """Why torchtitan stops at the settings ``text`` writes, or '' (``io.torchtitan.refusal``)."""

    from ndplan.io.common import load_toml
    from ndplan.io.torchtitan import refusal

    return refusal(load_toml(Path("emitted.toml"), text), devices)


def _written_step(row: dict[str, Any]) -> float:
    """The step of what --emit writes of a ranked row: `ndplan estimate`'s of a balanced row's one
    recompute setting, the row's own otherwise."""
    settings = row.get("balanced_settings")
    return float(settings["estimated_step_s"] if settings else row["step_s"])


def _first_written_as_priced(model: ModelSpec, ranked: list[dict[str, Any]], fmt: str, cluster: Any, options: Any,
                             precision: Any, limit: float) -> tuple[int, str, dict[str, Any], str, bool]:
    """(rank from 1, settings, what they run; how #1 is written, whether as priced) of the fastest
    ranked candidate that ``fmt`` writes so that reading it back gives the strategy that was
    priced (torchtitan has no ZeRO-1/2, MindFormers no interleaved Seq1F1B, ...), a balanced row
    as its one recompute setting, fastest by that setting's step; rank 0 and #1's settings where
    none of the first ``_WRITTEN_CHECKED`` is. Only the settings chosen are priced again (the full
    estimators, ``read_back``)."""
    from ndplan.io.common import canonical_strategy

    def written(k: int) -> tuple[Strategy, str, str, bool]:
        """Ranked row k's settings as ``fmt`` writes them: the strategy, the text, how it reads
        back, and whether that is the strategy priced."""
        candidate = Strategy(**ranked[k].get("balanced_settings", ranked[k])["strategy"], precision=precision)
        text = emit_settings(model, candidate, fmt, options, cluster.device)
        refused = _torchtitan_refuses(text, cluster.num_devices) if fmt == "torchtitan" else ""
        if refused:
            return candidate, text, f"settings torchtitan refuses ({refused})", False
        try:
            back = written_strategy(model, candidate, text, fmt, cluster)
        except (NdplanError, ValidationError) as error:  # the format's reader refuses what was written
            reason = first_validation_error(error) if isinstance(error, ValidationError) else str(error)
            reason = _WRITTEN_FILE.sub("", reason)  # the temporary file's name says nothing to the user
            return candidate, text, f"settings its reader refuses ({reason})", False
        return candidate, text, str(back.short()), back == canonical_strategy(candidate, model)

    first = written(0)
    order = sorted(range(min(len(ranked), _WRITTEN_CHECKED)), key=lambda k: _written_step(ranked[k]))
    for k in order:
        candidate, text, _label, same = first if k == 0 else written(k)
        if same:
            return k + 1, text, read_back(model, candidate, text, fmt, cluster, options, limit), first[2], first[3]
    try:
        check = read_back(model, first[0], first[1], fmt, cluster, options, limit)
    except (NdplanError, ValidationError):
        check = {"same": False, "differs": [f"the strategy, {first[2]}"], "strategy": first[2], "stage_layers": [],
                 "precision": None, "peak_bytes": None, "fits": None, "step_s": None}
    return 0, first[1], check, first[2], first[3]


def _explain_winner(model: ModelSpec, strategy: Strategy, device: Any, options: Any) -> dict[str, Any]:
    """The winner's memory (peak stage) and time, term by term with their formulas, priced again
    with the single-strategy API (the search's figures: a test checks they agree)."""
    from ndplan.hardware import Cluster
    from ndplan.memory import estimate
    from ndplan.perf import estimate_time

    report = estimate(model, strategy, device, options, num_devices=strategy.world_size)
    timing = estimate_time(model, strategy, Cluster(device=device, num_devices=strategy.world_size),
                           **options.time_keywords())
    return {"peak_bytes": report.peak_bytes, "step_s": timing.step_s,
            "memory": list(report.explain()), "time": list(timing.explain())}


def module_sets_argument(model: ModelSpec, items: list[str]) -> tuple[tuple[str, ...], ...]:
    """--recompute-module-sets: 'common' or 'all' (``search.space.module_sets``), or sets such
    as 'layernorm+moe_act' and 'default' (the runtime's own policy)."""
    from ndplan.search.space import module_sets, parse_module_set

    if len(items) == 1 and items[0] in ("common", "all"):
        return module_sets(model, items[0])
    return tuple(parse_module_set(item) for item in items)


def _searched_sets(args: argparse.Namespace, read: Any, model: ModelSpec, kind: str) -> Any:
    """What search takes for ``kind`` (recompute or offload): --{kind}-modules, one set (else the
    plan file's), or --{kind}-module-sets, several."""
    one, several = getattr(args, f"{kind}_modules"), getattr(args, f"{kind}_module_sets")
    given = tuple(one or (read.strategy_settings.get(f"{kind}_modules", ()) if read is not None else ()))
    if not several:
        return given
    if one:
        raise NdplanError(f"give --{kind}-modules (one set) or --{kind}-module-sets (several), not both")
    return (module_sets_argument if kind == "recompute" else _offload_sets_argument)(model, several)


def _offload_sets_argument(model: ModelSpec, items: list[str]) -> tuple[tuple[str, ...], ...]:
    """--offload-module-sets: 'common' (``search.space.offload_sets``), or sets such as
    'expert_fc1+moe_act' and 'none' (no offload)."""
    from ndplan.search.space import offload_sets, parse_offload_set

    if len(items) == 1 and items[0] == "common":
        return offload_sets(model)
    return tuple(parse_offload_set(item) for item in items)


def _what_would_fit(result: Any, model: ModelSpec, device: Any, devices: int, space_on: Callable[[int], Any],
                    options: Any) -> list[str]:
    """When nothing fits: the smallest memory limit that would, and the smallest device count (the
    search again on larger clusters, ``space_on(devices)``, with the step-time model of the runtime
    of ``options``)."""
    import math

    from ndplan.search.run import NOT_RUNNABLE

    notes = []
    if result.smallest_peak_bytes is not None:
        # Rounded up, so that the limit it names fits that strategy.
        fits_in = math.ceil(result.smallest_peak_bytes / 2**30 * 100) / 100
        notes.append(f"nothing fits in {format_bytes(result.memory_limit_bytes)}; the smallest peak of any valid "
                     f"strategy is {format_bytes(result.smallest_peak_bytes)} (--memory-limit {fits_in:.2f}GiB fits it)")
    elif result.evaluated == 0:
        # Memory is not the reason: say so before trying larger clusters.
        notes.append("no candidate is valid: each breaks a rule, counted above at the first it breaks")
        if result.rejected.get(NOT_RUNNABLE):
            notes.append(f"{NOT_RUNNABLE}: what the {options.runtime} runtime cannot run; `ndplan check` of one of "
                         f"them with --runtime {options.runtime} and --hardware says why")
    from ndplan.search import run_search

    valid_anywhere = [result.evaluated > 0]

    def best_on(count: int) -> str | None:
        try:
            trial_space = space_on(count)
        except NdplanError:  # no valid value of some dimension on that many devices
            return None
        trial = run_search(model, device, trial_space, memory_limit_bytes=result.memory_limit_bytes,
                           options=options, top=1)
        valid_anywhere[0] = valid_anywhere[0] or trial.evaluated > 0
        return trial.ranked[0]["label"] if trial.ranked else None

    # Doubling finds a cluster that fits; bisection then finds the fewest devices between it and
    # the last that did not, over whole nodes (or multiples of the count given, below a node):
    # counts of whole nodes, not the count given plus nodes (28 + 8k skipped 32). Counts that are
    # also multiples of the degrees fixed (--fix cp=3: tp·pp·cp = 3 must divide the world): powers
    # of two alone never were, and "more devices do not help" was said where 24 fit.
    step = device.devices_per_node if devices >= device.devices_per_node else devices
    shape = space_on(devices)
    forced = math.prod(values[0] for values in (shape.tp, shape.pp, shape.cp) if len(values) == 1)
    node_step, step = step, math.lcm(step, forced)
    low, found = devices, None
    largest = max(devices * 2, min(devices * 64, 1 << 17))
    factor = 2
    while devices * factor <= largest:
        count = -(-devices * factor // step) * step
        label = best_on(count)
        if label is not None:
            found = (count, label)
            break
        low = count
        factor *= 2
    if found is None:
        if valid_anywhere[0]:
            notes.append(f"no strategy fits even on {low} devices")
        else:  # more devices do not lift the rule: a fixed value breaks it everywhere
            notes.append(f"no candidate is valid on up to {low} devices either: more devices do not help; "
                         "check the --fix values against the rules counted above")
        return notes
    high, label = found
    # In units of step: fits at high, not at low (nor, more never fitting less, at any fewer).
    low_units, high_units = low // step, high // step
    while high_units - low_units > 1:
        middle = (low_units + high_units) // 2
        trial_label = best_on(middle * step)
        if trial_label is not None:
            high_units, label = middle, trial_label
        else:
            low_units = middle
    unit = f"whole nodes of {step}" if step == device.devices_per_node else f"multiples of {step}"
    if step != node_step:
        unit += f", as the fixed tp·pp·cp = {forced} needs"
    notes.append(f"with {high_units * step} devices (the fewest that fit, in {unit}, assuming more never fits "
                 f"less) the best fitting strategy is {label}")
    return notes


#: A search's CSV columns where nothing fits (no row to take them from): the header alone,
#: so that a script reading the file finds the columns and no rows, not an empty file.
_CSV_COLUMNS = (
    "candidate", "label", "dp", "tp", "sp", "cp", "cp_kind", "ep", "etp", "pp", "vpp", "schedule", "seq_chunks",
    "zero", "fsdp", "recompute", "recompute_modules", "offload_modules", "offload_layers", "offload_optimizer_states",
    "optimizer_offload", "mbs", "num_micro_batches",
    "pipeline_runs", "peak_bytes", "peak_stage", "step_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "hfu",
    "model_flops", "hardware_flops", "compute_s", "tp_s", "cp_s", "ep_s", "dp_s", "offload_s", "pp_s", "bubble_s",
    "optimizer_s", "caveats", "headroom",
)


def _write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    """One line per ranked row; every column any row has (balanced rows add some), lists and
    mappings (caveats, a balanced plan's recompute ranges) as JSON."""
    import csv

    columns = list(dict.fromkeys(k for row in rows for k in row if k != "strategy")) or list(_CSV_COLUMNS)
    with open(made_folder(path, "--csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})


def _print_search(result: Any, model: ModelSpec, device: Any, space: Any) -> None:
    console.print(
        f"{model.name} on {space.num_devices} × {device.name}, gbs {space.global_batch_size}, seq {space.seq_length}: "
        f"{result.space_size:,} candidates, {result.evaluated:,} valid and priced, {result.fitting:,} fit "
        f"({result.seconds:.1f} s)"
    )
    if result.ranked:
        table = Table(title=f"Fastest strategies that fit in {format_bytes(result.memory_limit_bytes)}")
        # Balanced rows: what one recompute setting (--emit) runs by `ndplan estimate` beside the row's step;
        # a per-layer recompute mix the full estimators cannot price keeps the balancer's figures (*).
        settings = any("balanced_settings" in row for row in result.ranked)
        composed = any(row.get("figures") == "composed" for row in result.ranked)
        columns = ["#", "strategy", "peak", "stage", "step", *(["one setting"] if settings else []), "tokens/s", "MFU"]
        for col in columns:
            table.add_column(col, justify="left" if col == "strategy" else "right")
        for i, row in enumerate(result.ranked, 1):
            one = [f"{row['balanced_settings']['estimated_step_s']:.3f} s" if "balanced_settings" in row else "-"
                   ] if settings else []
            mark = "*" if row.get("figures") == "composed" else ""
            table.add_row(str(i), row["label"], format_bytes(row["peak_bytes"]) + mark, str(row["peak_stage"]),
                          f"{row['step_s']:.3f} s{mark}", *one, f"{row.get('tokens_per_s', 0):,.0f}{mark}",
                          f"{100 * row.get('mfu', 0):.1f}%{mark}")
        captions = []
        if any(row["pp"] > 1 and row.get("figures") is None for row in result.ranked):
            # The same strategy's step by `ndplan estimate` differs by the closed form's error.
            captions.append("step: a pipeline's makespan in closed form (mean error within 2% of the simulated "
                            "schedule that `ndplan estimate` runs; docs/time.md)")
        if settings:
            captions.append("a balanced plan of one recompute setting: `ndplan estimate`'s figures (the pipeline "
                            "simulated); one setting: `ndplan estimate`'s step of what --emit writes")
        if composed:
            captions.append("*: recompute per layer, not one strategy the full estimators price: the balancer's "
                            "figures (its stage times, the schedule simulated)")
        if space.precision.compute_dtype == "fp8":
            captions.append("MFU: of the fp8 peak (about half what the same speed reads against the bf16 peak)")
        if captions:
            table.caption = "\n".join(captions)
        console.print(table)
        from ndplan.search.run import evenly_spread

        shown = evenly_spread(len(result.pareto), 10)  # both ends of the trade-off
        of = f"{len(shown)} of {len(result.pareto)} points, evenly spread; --json lists more; " \
            if len(shown) < len(result.pareto) else ""
        front = Table(title=f"Pareto front ({of}step time vs peak memory, uniform placement)")
        for col in ["strategy", "peak", "step"]:
            front.add_column(col, justify="left" if col == "strategy" else "right")
        for row in (result.pareto[i] for i in shown):
            front.add_row(row["label"], format_bytes(row["peak_bytes"]), f"{row['step_s']:.3f} s")
        console.print(front)
    rejected = Table(title="Why candidates lost (each counted once, at the first rule it breaks)")
    rejected.add_column("reason")
    rejected.add_column("candidates", justify="right")
    for reason, count in sorted(result.rejected.items(), key=lambda kv: -kv[1]):
        if count:
            rejected.add_row(reason, f"{count:,}")
    console.print(rejected)
    for note in result.notes:
        console.print(f"[yellow]{note}[/]")
    if result.best:
        for caveat in result.best.get("caveats", []):
            console.print(f"[bold yellow]caution, the winner[/]: {caveat}")
        free = result.best.get("headroom", 0.0)
        if free and result.best["peak_bytes"] > (1 - free) * result.memory_limit_bytes:
            # The ranking fills the limit; the caution's margin is the user's to choose.
            console.print(f"[bold yellow]caution, the winner[/]: it leaves {format_bytes(result.memory_limit_bytes - result.best['peak_bytes'])} "
                          f"of {format_bytes(result.memory_limit_bytes)} free, less than the {free:.0%} the memory caution "
                          f"above asks for; --memory-limit {format_bytes((1 - free) * result.memory_limit_bytes).replace(' ', '')} "
                          "ranks only strategies that leave it")
