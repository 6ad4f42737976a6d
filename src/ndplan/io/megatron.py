"""Read Megatron-LM / MindSpeed-LLM training arguments: a launch script or a JSON/YAML argument file.

Understood: the parallel degrees (TP, PP with virtual stages or a layer layout, CP with its
communication type, EP/ETP, SP), the distributed optimizer and Megatron/torch FSDP, micro and
global batch, sequence length, recompute granularity/method/layers/modules, fine-grained
activation offload (``--fine-grained-activation-offloading --offload-modules``), bf16/fp16/fp8 and the
precision-aware optimizer, optimizer CPU offload, the model flags (see ``megatron_model``) and
the world size of the ``torchrun``/``torch.distributed.launch``/``deepspeed``/``msrun`` line.
The communication-overlap flags become the step-time model's switches (``_overlap``).
Flags ndplan knows to be irrelevant to memory and time are accepted silently
(``megatron_flags.NO_EFFECT``); every other flag it does not interpret is a warning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ndplan.errors import NdplanError
from ndplan.io.common import (
    MAX_DEGREE,
    LineIndex,
    ReadResult,
    Source,
    load_json,
    load_yaml,
    make_policy,
    micro_batches,
    precision_setting,
    set_placement,
)
from ndplan.io.megatron_args import Arg, Args, file_entries, flag_entries, parse_script, world_from_launcher
from ndplan.io.megatron_model import FlagModel, model_from_flags
from ndplan.model.spec import MAX_LAYERS, ModelSpec
from ndplan.placement import uniform_layer_counts
from ndplan.strategy.precision import PrecisionPolicy
from ndplan.strategy.strategy import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    canonical_offload,
    layer_offload_conflict,
    offload_conflict,
)

FORMAT = "megatron"

_CP_ALGOS = {  # MindSpeed --context-parallel-algo
    "megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses", "hybrid_cp_algo": "hybrid",
    "hybrid_adaptive_cp_algo": "hybrid", "adaptive_cp_algo": "ring",
    "kvallgather_cp_algo": "allgather",
}
#: Megatron-Core's --moe-token-dispatcher-type values (alltoall_seq: its older all-to-all).
_DISPATCHERS = ("allgather", "alltoall", "flex", "alltoall_seq")
_CP_COMM = {"p2p": "ring", "a2a": "ulysses", "allgather": "allgather", "a2a+p2p": "hybrid"}
#: Flags that only MindSpeed / MindSpeed-LLM define (Megatron-LM's parser rejects them): a script
#: that sets any of them runs on MindSpeed, whose attention rules differ (``_unfused_attention``).
MINDSPEED_ONLY = (
    "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--npu-deterministic",
    "--use-mc2", "--use-ascend-mc2", "--use-fusion-attn-v2", "--noop-layers", "--moe-tp-extend-ep",
    "--reuse-fp32-param", "--swap-attention", "--recompute-in-advance", "--moe-alltoall-overlap-comm",
    "--moe-fb-overlap", "--context-parallel-algo", "--use-fused-moe-token-permute-and-unpermute",
    "--moe-permutation-async-comm", "--use-fused-ring-attention-update", "--use-cp-send-recv-overlap",
    "--sparse-mode", "--pre-tockens", "--next-tockens", "--shape-order", "--schedules-method",
    "--kv-head-repeat-before-uly-alltoall",
)
_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
#: ``--offload-modules`` Megatron-Core accepts that ndplan does not price: left out with a warning.
_UNPRICED_OFFLOAD: tuple[str, ...] = ("fused_group_mlp", "shortcut_post_norm")


def read_script(path: Path, text: str, model: ModelSpec | None, devices: int | None) -> ReadResult:
    """A launch script: run its assignments, find the training command, interpret its flags."""
    src = Source(path)
    warnings: list[str] = []
    launch = parse_script(src, text)
    entries = flag_entries(src, launch.arguments, warnings)
    world, per_node = world_from_launcher(src, launch.launcher, warnings)
    world_line = launch.launcher[0].line if launch.launcher else None
    return interpret(Args(src, entries), model, devices, world, per_node, world_line, warnings)


def read_args_file(path: Path, text: str, kind: str, model: ModelSpec | None, devices: int | None) -> ReadResult:
    """A JSON/YAML mapping of Megatron arguments (e.g. a dump of ``args``)."""
    data = load_json(path, text) if kind == "json" else load_yaml(path, text)
    lines = LineIndex.from_yaml(text)
    src = Source(path, lines)
    args = Args(src, file_entries(src, data, lines))
    world = args.integer("--world-size")
    return interpret(args, model, devices, world, None, args.line("--world-size"), [])


def interpret(
    args: Args, base: ModelSpec | None, devices: int | None, world: int | None, per_node: int | None,
    world_line: int | None, warnings: list[str],
) -> ReadResult:
    src = args.src
    notes: list[str] = []
    settings: dict[str, Any] = {}

    tp = args.integer("--tensor-model-parallel-size", default=1, maximum=MAX_DEGREE) or 1
    pp = args.integer("--pipeline-model-parallel-size", default=1, maximum=MAX_DEGREE) or 1
    cp = args.integer("--context-parallel-size", default=1, maximum=MAX_DEGREE) or 1
    ep = args.integer("--expert-model-parallel-size", default=1, maximum=MAX_DEGREE) or 1
    etp = args.integer("--expert-tensor-parallel-size", maximum=MAX_DEGREE)
    if args.has("--moe-tp-extend-ep"):
        # MindSpeed lends the TP ranks to expert parallelism: experts are not TP-split.
        ep, etp = ep * tp, 1
        notes.append("--moe-tp-extend-ep: experts use the tensor-parallel ranks for expert parallelism "
                     f"(ep = {ep}, etp = 1)")
    settings.update(tp=tp, pp=pp, cp=cp, ep=ep)
    if etp is not None:
        settings["etp"] = etp

    flag_model = model_from_flags(args, base, tp, warnings, notes)
    model = flag_model.model
    if world is None and devices and per_node and devices % per_node:
        raise args.src.error("world size", f"--devices {devices} is not a whole number of nodes of "
                             f"--nproc_per_node {per_node} devices", world_line)
    _world(args, settings, devices, world, world_line, notes, warnings)
    dp = settings.get("dp")

    sp = args.has("--sequence-parallel")
    if sp and tp == 1:
        notes.append("--sequence-parallel has no effect with tp=1 (Megatron turns it off)")
        sp = False
    if ep > 1 and tp > 1 and not sp:
        # megatron/core/model_parallel_config.py: ValueError before the model is built.
        warnings.append(f"{src.where(args.line('--expert-model-parallel-size'))}: --expert-model-parallel-size {ep} "
                        f"with --tensor-model-parallel-size {tp} without --sequence-parallel: Megatron-Core refuses "
                        "the pair (ModelParallelConfig); priced as written")
    elif tp > 1 and not sp and model is not None and model.is_moe:
        # MoELayer.forward: ValueError at the first training forward.
        warnings.append(f"{src.where(args.line('--tensor-model-parallel-size'))}: --tensor-model-parallel-size {tp} "
                        "without --sequence-parallel on a model with experts: Megatron-Core's MoE layer refuses to "
                        "train so (MoELayer.forward) and stops at the first forward; priced as written")
    settings["sp"] = sp
    _context_parallel(args, settings, cp, warnings, model.num_layers if model is not None else None)
    _pipeline(args, settings, flag_model, warnings)
    _sharding(args, settings, warnings, notes)
    _recompute(args, settings, warnings, notes)
    _refused_recompute_modules(args, settings, model, warnings)
    _offload(args, settings, warnings, notes)
    _layer_offload(args, settings, warnings, notes)
    settings["precision"] = precision_setting(_precision(args, warnings))
    _batch(args, settings, dp, warnings, notes)
    overlap = _overlap(args, notes, warnings)
    _refused_ep_overlap(args, settings, warnings)
    notes.append("runtime: megatron, what Megatron-Core keeps for backward (--runtime overrides)")
    # Megatron's cross-entropy is always vocabulary-parallel over TP (no flag turns it off): a
    # fact of the launch, stated as the attention kernel and the loss dtype are, so that another
    # --runtime prices the loss Megatron runs.
    runtime_settings: dict[str, Any] = {"overlap": overlap, "runtime": "megatron", "loss_parallel": True}
    # Megatron's token dispatcher, priced as it runs: allgather where none is stated (its default)
    dispatcher = args.get("--moe-token-dispatcher-type")
    kind = dispatcher.values[0] if dispatcher is not None and dispatcher.values else "allgather"
    if kind not in _DISPATCHERS:
        raise args.error("--moe-token-dispatcher-type", f"unknown dispatcher {kind!r}; known: {', '.join(_DISPATCHERS)}")
    if model is not None and model.is_moe and kind == "allgather" and not args.has("--moe-enable-deepep"):
        runtime_settings["moe_dispatcher"] = "allgather"
    # MindSpeed-LLM's repeat of every GQA layer's KV heads before a Ulysses all-to-all (on by
    # default there, a store_true flag that cannot turn it off; MindSpeed's own repeats only where
    # the group outnumbers a rank's heads).
    if args.has("--kv-head-repeat-before-uly-alltoall"):
        runtime_settings["ulysses_kv_repeat"] = "always"
    # Without overlap_p2p_comm the interleaved schedule batches its sends and synchronises the
    # device after them too (batch_p2p_comm = not overlap_p2p_comm): it waits for its sends as 1F1B does.
    if args.has("--no-overlap-p2p-communication"):
        runtime_settings["p2p_wait"] = "1f1b+interleaved"
        notes.append("--no-overlap-p2p-communication: the interleaved schedule waits for its pipeline sends as 1F1B "
                     "does (p2p_wait 1f1b+interleaved)")
    # Without gradient-accumulation fusion each weight gradient is written, then added to its
    # buffer by a kernel of its own (EfficiencyProfile.gradient_accumulation_fusion).
    if args.has("--no-gradient-accumulation-fusion"):
        runtime_settings["gradient_accumulation_fusion"] = False
        notes.append("--no-gradient-accumulation-fusion: each weight gradient is added to its buffer by a kernel of "
                     "its own after the GEMM (priced in the step time)")
    # Transformer Engine's cross-entropy works on the bf16 logits (no fp32 copy); Megatron's own
    # (native, or unfused) upcasts them.
    fusion_impl = args.text("--cross-entropy-fusion-impl", default="native")
    if fusion_impl not in ("native", "te", "linear"):
        raise args.error("--cross-entropy-fusion-impl",
                         f"unknown implementation {fusion_impl!r}; known: native, te, linear")
    if args.has("--cross-entropy-loss-fusion") and fusion_impl == "te":
        runtime_settings["loss_upcast"] = False
        notes.append("--cross-entropy-fusion-impl te: the loss keeps the bf16 logits, no fp32 copy (--no-loss-upcast)")
    elif args.has("--cross-entropy-loss-fusion") and fusion_impl == "linear":
        warnings.append(f"{args.src.where(args.line('--cross-entropy-fusion-impl'))}: --cross-entropy-fusion-impl "
                        "linear (the head fused with the loss, logits never whole) is not modelled; ndplan prices "
                        "Megatron's native fp32 loss, an upper bound")

    impl = args.text("--transformer-impl", default="transformer_engine") or "transformer_engine"
    if impl not in ("transformer_engine", "local", "inference_optimized"):
        warnings.append(f"{src.where(args.line('--transformer-impl'))}: --transformer-impl {impl!r} is not one ndplan "
                        "knows (transformer_engine, local, inference_optimized); priced as transformer_engine")
    unfused = _unfused_attention(args, impl, warnings)
    if unfused:
        runtime_settings["attention"] = "eager"
        notes.append(f"{unfused}: attention keeps its s x s softmax (--attention eager)")

    # Token dropping: every expert's buffer sized capacity x its balanced share (MemoryOptions.
    # moe_capacity_factor, which prices it padded; without the pad flag fewer may come: an upper bound).
    capacity = args.number("--moe-expert-capacity-factor")
    padded = args.has("--moe-pad-expert-input-to-capacity")
    if capacity is not None and capacity > 0:
        runtime_settings["moe_capacity_factor"] = capacity
        notes.append(f"--moe-expert-capacity-factor {capacity:g}: expert buffers priced at {capacity:g}x the balanced "
                     "share of tokens" + ("" if padded else " (without --moe-pad-expert-input-to-capacity an expert "
                                          "gets at most that many: an upper bound)") + " (--moe-capacity-factor)")
    elif padded:
        warnings.append(f"{args.src.where(args.line('--moe-pad-expert-input-to-capacity'))}: "
                        "--moe-pad-expert-input-to-capacity without --moe-expert-capacity-factor: nothing to pad to")
    # Megatron's experts run one grouped GEMM (TE's GroupedLinear) only with --moe-grouped-gemm;
    # without it, or with Megatron's own layers, one GEMM per expert (SequentialMLP).
    grouped = args.has("--moe-grouped-gemm") and impl != "local"
    if model is not None and model.is_moe and not grouped:
        runtime_settings["grouped_gemm"] = False
        notes.append("experts without --moe-grouped-gemm (SequentialMLP): no grouped-GEMM workspaces")

    warnings.extend(args.leftovers())
    return ReadResult(
        format=FORMAT, source=src.name, model=model, strategy_settings=settings,
        devices=settings.get("dp", 0) * tp * pp * cp or world or devices or None,
        devices_per_node=per_node, warnings=warnings, notes=notes, runtime_settings=runtime_settings,
    )


def _unfused_attention(args: Args, impl: str, warnings: list[str]) -> str | None:
    """Why the launch runs unfused attention (which keeps the s x s scores), or None where it
    runs a fused kernel (flash or cuDNN's, which keep O(s) statistics).

    MindSpeed (a script with a flag only MindSpeed defines, ``MINDSPEED_ONLY``) runs the NPU's
    fused attention only with --use-flash-attn, and otherwise Megatron's DotProductAttention,
    whatever --transformer-impl says (on an NPU every layer is Megatron's own). Megatron-Core:
    TE's unfused attention and Megatron's own (``--attention-backend unfused|local``, or
    ``--transformer-impl local``, whose attention is always unfused) keep the scores; flash,
    fused and auto (which picks one of them) do not. An argument dump writes the enum as
    "AttnBackend.unfused"; a value ndplan does not know (a later Megatron's) is priced as the
    fused kernels are, and said so. Megatron's legacy models run flash only with --use-flash-attn."""
    # Looked up without marking the flag read: it still gets its own "not modelled" warning.
    mindspeed = next((flag for flag in MINDSPEED_ONLY if flag in args.entries), None)
    if mindspeed is not None:
        args.get("--attention-backend")  # MindSpeed's attention follows --use-flash-attn alone
        return None if args.has("--use-flash-attn") else f"MindSpeed ({mindspeed}) without --use-flash-attn"
    backend = (args.text("--attention-backend", default="auto") or "auto").removeprefix("AttnBackend.")
    if backend not in ("auto", "flash", "fused", "unfused", "local"):
        warnings.append(f"{args.src.where(args.line('--attention-backend'))}: --attention-backend {backend!r} is not "
                        "one ndplan knows (auto, flash, fused, unfused, local); priced as flash attention")
    if impl == "local":
        return "--transformer-impl local"
    if backend in ("unfused", "local"):
        return f"--attention-backend {backend}"
    if args.has("--use-legacy-models") and not args.has("--use-flash-attn"):
        return "--use-legacy-models without --use-flash-attn"
    return None


def _overlap(args: Args, notes: list[str], warnings: list[str]) -> dict[str, Any]:
    """The step-time overlap switches (``ndplan.perf.OverlapConfig``) the flags state. Megatron
    overlaps nothing unless asked, so an absent flag means off; expert-parallel overlap stays
    'auto' (on under DualPipeV) unless a flag turns it on."""
    overlap: dict[str, Any] = {
        "dp_grad_reduce": args.has("--overlap-grad-reduce"),
        "dp_param_gather": args.has("--overlap-param-gather"),
        "tp": args.has("--tp-comm-overlap"),
    }
    mc2 = next((flag for flag in ("--use-mc2", "--use-ascend-mc2") if args.has(flag)), None)
    if mc2 is not None and not overlap["tp"]:
        # MindSpeed's MC2 fuses the sequence-parallel linears' TP all-gather and reduce-scatter
        # into their matmuls: the step time's TP overlap, as docs/accuracy_time.md prices
        # MindSpeed-LLM's published runs (which read fast so: perf.gaps says it beside the plan).
        if args.has("--sequence-parallel"):
            overlap["tp"] = True
            notes.append(f"{mc2}: MindSpeed's fused matmul and TP collectives, priced as TP comm overlap")
        else:
            notes.append(f"{mc2} without --sequence-parallel: MC2 fuses the sequence-parallel linears' "
                         "collectives, so nothing is overlapped")
    # The gradient bucket, in parameters (unset: Megatron-Core's max(40e6, 1e6·dp)); without
    # --overlap-grad-reduce Megatron-Core keeps one bucket, and nothing hides either way.
    bucket = args.integer("--ddp-bucket-size")
    if bucket is not None:
        overlap["dp_bucket_params"] = bucket
    # What validate_args (megatron/training/arguments.py) asserts against: the launch stops there.
    refused = []
    if overlap["dp_param_gather"] and not overlap["dp_grad_reduce"]:
        refused.append(("--overlap-param-gather", "without --overlap-grad-reduce"))
    if overlap["dp_param_gather"] and not args.has("--use-distributed-optimizer", "--use-megatron-fsdp"):
        refused.append(("--overlap-param-gather", "without --use-distributed-optimizer or --use-megatron-fsdp"))
    if overlap["tp"] and not args.has("--sequence-parallel"):
        refused.append(("--tp-comm-overlap", "without --sequence-parallel"))
    for flag, why in refused:
        warnings.append(f"{args.src.where(args.line(flag))}: {flag} {why}: Megatron-LM refuses it (validate_args) "
                        "and stops before the first step; priced as written")
    if args.has("--overlap-moe-expert-parallel-comm", "--moe-alltoall-overlap-comm", "--moe-fb-overlap"):
        overlap["ep"] = True
    dispatcher = args.get("--moe-token-dispatcher-type")
    kind = dispatcher.values[0] if dispatcher is not None and dispatcher.values else "allgather"
    backend = args.get("--moe-flex-dispatcher-backend")
    if kind == "flex" or args.has("--moe-enable-deepep"):
        # DeepEP and HybridEP send a token once per destination node and rank, not per expert.
        overlap["ep_dispatch"] = "node_dedup"
        name = backend.values[0] if backend is not None and backend.values else "deepep"
        notes.append(f"expert dispatch: {name} (flex dispatcher), one network copy per destination node")
    elif kind == "allgather" and args.has("--num-experts"):
        notes.append("--moe-token-dispatcher-type allgather" + ("" if dispatcher is not None else " (Megatron's default)")
                     + ": every token of the expert-TP x EP group gathered into a persistent buffer, the experts' output "
                     "reduce-scattered in fp32")
    hidden = [name for name, on in overlap.items() if on is True]
    notes.append(f"overlap from the flags: {', '.join(hidden) or 'none'} (the step time's switches; --overlap overrides)")
    return overlap


def _world(
    args: Args, settings: dict[str, Any], devices: int | None, world: int | None, world_line: int | None,
    notes: list[str], warnings: list[str],
) -> None:
    src = args.src
    tp, pp, cp = settings["tp"], settings["pp"], settings["cp"]
    model_ranks = tp * pp * cp
    dp_stated = args.integer("--data-parallel-size", maximum=MAX_DEGREE)
    if world and devices and world != devices:
        raise src.error("world size", f"the launch command gives {world} devices but --devices is {devices}", world_line)
    world = world or devices
    if world:
        if world % model_ranks:
            raise src.error(
                "world size", f"{world} devices are not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {model_ranks}",
                world_line,
            )
        settings["dp"] = world // model_ranks
        if dp_stated and dp_stated != settings["dp"]:
            raise args.error("--data-parallel-size", f"{dp_stated} but world size {world} / (tp·pp·cp) = {settings['dp']}")
    elif dp_stated:
        settings["dp"] = dp_stated
    else:
        warnings.append(f"{src.name}: no world size (torchrun --nproc_per_node/--nnodes); "
                        "give --devices so ndplan can derive the data-parallel degree")


def _most_layers(types: list[str]) -> str:
    """The context-parallel type of the most layers in a per-layer --cp-comm-type list (the first
    of those tied). One kind prices every layer; the most layers' is the nearest, and for a model
    whose sliding-window layers outnumber its full ones (Gemma 3: a2a or allgather on those,
    which Transformer Engine requires of them, p2p on the rest) it is a kind the sliding ones run."""
    return max(dict.fromkeys(types), key=types.count)


def _context_parallel(args: Args, settings: dict[str, Any], cp: int, warnings: list[str],
                      num_layers: int | None) -> None:
    algo = args.get("--context-parallel-algo")
    comm = args.get("--cp-comm-type")
    ulysses = args.integer("--ulysses-degree-in-cp")
    sizes = args.values("--hierarchical-context-parallel-sizes")
    if cp == 1:
        return
    kind = "ring"
    if algo is not None and algo.values:
        if algo.values[0] not in _CP_ALGOS:
            raise args.error(algo, f"unknown algorithm {algo.values[0]!r}; known: {', '.join(_CP_ALGOS)}")
        kind = _CP_ALGOS[algo.values[0]]
        if algo.values[0] == "adaptive_cp_algo":
            warnings.append(f"{args.src.where(algo.line)}: --context-parallel-algo {algo.values[0]} is priced as "
                            "ring attention")
    elif comm is not None and comm.values:
        types = [v for v in comm.values if v]
        if len(types) > 1 and num_layers is not None and len(types) != num_layers:
            # Megatron-Core asserts one type per layer when several are given.
            raise args.error(comm, f"{len(types)} types, one per layer, but the model has {num_layers} layers")
        for name in types:
            if name not in _CP_COMM:
                raise args.error(comm, f"unknown type {name!r}; known: {', '.join(_CP_COMM)}")
        chosen = _most_layers(types)
        if len(set(types)) > 1:
            counts = ", ".join(f"{name} ×{types.count(name)}" for name in dict.fromkeys(types))
            warnings.append(f"{args.src.where(comm.line)}: --cp-comm-type differs per layer ({counts}); ndplan "
                            f"prices {chosen!r}, the type of the most layers, for every layer")
        kind = _CP_COMM[chosen]
        if kind == "hybrid" and sizes:
            try:
                levels = [int(s) for s in sizes]
            except ValueError:
                raise args.error("--hierarchical-context-parallel-sizes", f"expected integers, got {sizes}") from None
            product = 1
            for level in levels:
                product *= level
            if product != cp:
                raise args.error("--hierarchical-context-parallel-sizes",
                                 f"sizes multiply to {product} but --context-parallel-size is {cp}")
            ulysses = levels[0]
    settings["cp_kind"] = kind
    if kind == "hybrid":
        if not ulysses:
            flag = "--ulysses-degree-in-cp" if algo else "--hierarchical-context-parallel-sizes"
            raise args.src.error(flag, "hybrid context parallelism needs the Ulysses degree")
        settings["ulysses_degree"] = ulysses


# ---------------------------------------------------------------- pipeline
def parse_layout(text: str) -> list[str]:
    """Megatron's --pipeline-model-parallel-layout: stages (model order) of E/t/m/L symbols."""
    text = text.replace(",", "")
    text = _repeat(r"\(([^)]+)\)\*(\d+)", text)
    text = _repeat(r"(.)\*(\d+)", text)
    stages = text.split("|")
    for stage in stages:
        bad = set(stage) - set("EtmL")
        if bad:
            raise ValueError(f"unknown layer symbol {sorted(bad)[0]!r} (known: E, t, m, L)")
    return stages


def _repeat(pattern: str, text: str) -> str:
    """Each ``pattern`` match (``X*n``) replaced by group 1 repeated group 2 times; over MAX_LAYERS
    symbols in all is a ValueError before the text is built (``t*99999999999`` took all memory)."""
    matches = list(re.finditer(pattern, text))
    if len(text) + sum(len(m.group(1)) * (int(m.group(2)) - 1) for m in matches) > MAX_LAYERS:
        raise ValueError(f"expands to over {MAX_LAYERS:,} layer symbols (no model has as many layers)")
    return re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)


def _pipeline(args: Args, settings: dict[str, Any], flag_model: FlagModel, warnings: list[str]) -> None:
    pp = settings["pp"]
    slots = flag_model.slots
    model_layers = flag_model.model.num_layers if flag_model.model else (
        slots - len(flag_model.noop) if slots is not None else None)
    emb = args.has("--account-for-embedding-in-pipeline-split")
    loss = args.has("--account-for-loss-in-pipeline-split")
    layout = args.get("--pipeline-model-parallel-layout")
    # Megatron-Core's TransformerConfig: each edge count > 0, and not mixed with the accounting.
    first = args.integer("--decoder-first-pipeline-num-layers", minimum=1, maximum=MAX_LAYERS)
    last = args.integer("--decoder-last-pipeline-num-layers", minimum=1, maximum=MAX_LAYERS)
    for edge, count in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        for accounting, on in (("--account-for-embedding-in-pipeline-split", emb),
                               ("--account-for-loss-in-pipeline-split", loss)):
            if count is not None and on:
                raise args.error(edge, f"Megatron-Core does not mix it with {accounting} (TransformerConfig refuses "
                                       "the pair); give the layers of every stage in one of the two ways")
    layer_list = args.get("--num-layer-list")
    per_virtual = args.integer("--num-layers-per-virtual-pipeline-stage", maximum=MAX_LAYERS)
    vpp = args.integer("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
                       maximum=MAX_DEGREE)
    dualpipe = args.text("--schedules-method")
    if dualpipe is not None and dualpipe != "dualpipev":
        raise args.error("--schedules-method", f"unknown method {dualpipe!r}; known: dualpipev")

    counts: list[int] | None = None
    if layout is not None:
        try:
            stages = parse_layout("".join(layout.values))
        except ValueError as error:
            raise args.error(layout, str(error)) from None
        if len(stages) % pp:
            raise args.error(layout, f"{len(stages)} stages are not a multiple of --pipeline-model-parallel-size {pp}")
        vpp = len(stages) // pp
        joined = "".join(stages)
        if not stages[0].startswith("E") or joined.count("E") != 1 or not stages[-1].endswith("L") or joined.count("L") != 1:
            raise args.error(layout, "the embedding E must open the first stage and the loss L close the last, once each")
        if "m" in joined and "m" not in stages[-1]:
            warnings.append(f"{args.src.where(layout.line)}: MTP layers placed before the last stage; "
                            "ndplan places MTP modules on the last virtual stage")
        counts = [stage.count("t") for stage in stages]
        if slots is not None and sum(counts) != slots:
            raise args.error(layout, f"the layout has {sum(counts)} decoder layers but --num-layers is {slots}")
    elif per_virtual is not None:
        if slots is None:
            raise args.error("--num-layers-per-virtual-pipeline-stage", "needs --num-layers (or --model) to count stages")
        units = slots + int(emb) + int(loss)
        if units % pp or (units // pp) % per_virtual:
            raise args.error("--num-layers-per-virtual-pipeline-stage",
                             f"{units} layers over pp={pp} stages do not split into chunks of {per_virtual}")
        vpp = units // pp // per_virtual
    if dualpipe:
        if vpp not in (None, 2):
            raise args.error("--schedules-method", f"dualpipev holds two chunks per stage, not {vpp}")
        vpp = 2
    vpp = vpp or 1
    settings["vpp"] = vpp
    settings["schedule"] = "dualpipev" if dualpipe else ("interleaved" if vpp > 1 else "1f1b")

    if layout is None and slots is not None:
        stages_total = pp * vpp
        if first is not None or last is not None:
            counts = _first_last_counts(args, slots, pp, vpp, first, last)
        elif layer_list is not None:
            try:
                counts = [int(x) for x in ",".join(layer_list.values).split(",") if x.strip()]
            except ValueError:
                raise args.error(layer_list, f"expected comma-separated integers, got {layer_list.values}") from None
            if len(counts) != pp or vpp != 1:
                raise args.error(layer_list, f"needs one count per pipeline stage ({pp}) and no virtual stages")
            if sum(counts) != slots:
                raise args.error(layer_list, f"counts sum to {sum(counts)} but --num-layers is {slots}")
        else:
            units = slots + int(emb) + int(loss)
            if pp > 1 and units % stages_total:
                flag = "--num-layers" if args.has("--num-layers") else "--pipeline-model-parallel-size"
                raise args.error(flag, f"{units} layers{' (with embedding/loss accounted)' if emb or loss else ''} "
                                       f"do not split evenly over pp·vpp = {stages_total} stages")
            counts = list(uniform_layer_counts(slots, stages_total, embedding_as_layer=emb, output_as_layer=loss))
    if counts is not None and flag_model.noop:
        counts = _drop_noop(counts, flag_model.noop)
    if counts is None:
        set_placement(settings, None, model_layers, embedding_as_layer=emb, output_as_layer=loss)
    else:
        set_placement(settings, counts, model_layers)


def _first_last_counts(args: Args, slots: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Megatron's uneven first/last stages: the rest spreads evenly over the middle stages, and
    each stage's layers split evenly over its virtual chunks (transformer_layer.py)."""
    flag = "--decoder-first-pipeline-num-layers" if first is not None else "--decoder-last-pipeline-num-layers"
    stated = " + ".join(f"{name} {n}" for name, n in (("--decoder-first-pipeline-num-layers", first),
                                                       ("--decoder-last-pipeline-num-layers", last)) if n is not None)
    middle_stages = pp - (first is not None) - (last is not None)
    middle = slots - (first or 0) - (last or 0)
    if middle_stages < 0:  # pp=1: one stage is both first and last
        raise args.error(flag, f"pp={pp} has one stage; give --decoder-first-pipeline-num-layers or "
                               "--decoder-last-pipeline-num-layers, not both")
    if middle < 0:
        raise args.error(flag, f"{stated} is more than the {slots} layers of --num-layers")
    if middle_stages == 0 and middle:
        raise args.error(flag, f"pp={pp} leaves no middle stage, so {stated} must be the {slots} layers of "
                               f"--num-layers, not {slots - middle}")
    if middle_stages and middle % middle_stages:
        raise args.error(flag, f"the other {middle} layers do not split evenly over {middle_stages} middle stages")
    per_stage = [middle // middle_stages if middle_stages else 0] * pp
    if first is not None:
        per_stage[0] = first
    if last is not None:
        per_stage[-1] = last
    if any(n % vpp for n in per_stage):
        raise args.error(flag, f"stage layer counts {per_stage} do not split over {vpp} virtual chunks")
    return [per_stage[s] // vpp for _ in range(vpp) for s in range(pp)]


def _drop_noop(counts: list[int], noop: frozenset[int]) -> list[int]:
    """MindSpeed noop layers hold no weights: take them out of the stages that hold them."""
    out, start = [], 0
    for count in counts:
        out.append(count - sum(1 for i in range(start, start + count) if i in noop))
        start += count
    return out


# ---------------------------------------------------------------- sharding, recompute, precision
def _sharding(args: Args, settings: dict[str, Any], warnings: list[str], notes: list[str]) -> None:
    zero, fsdp, reshard = 0, False, True
    if args.has("--use-distributed-optimizer"):
        zero = 1
    strategy = args.get("--data-parallel-sharding-strategy")
    if args.has("--use-megatron-fsdp", "--use-custom-fsdp"):
        name = strategy.values[0] if strategy and strategy.values else "no_shard"
        if name not in _SHARDING:
            raise args.error(strategy or "--data-parallel-sharding-strategy",
                             f"unknown strategy {name!r}; known: {', '.join(_SHARDING)}")
        zero = max(zero, _SHARDING[name])
        fsdp = zero == 3
    elif strategy is not None and strategy.values and strategy.values[0] != "no_shard":
        warnings.append(f"{args.src.where(strategy.line)}: --data-parallel-sharding-strategy applies only with "
                        "--use-megatron-fsdp; ignored")
    if args.has("--use-torch-fsdp2"):
        zero, fsdp = 3, True
        reshard = not args.has("--torch-fsdp2-no-reshard-after-forward")
    settings.update(zero=zero, fsdp=fsdp, reshard=reshard)
    instances = args.integer("--num-distributed-optimizer-instances", default=1) or 1
    if instances > 1:
        if zero == 0:
            warnings.append(f"{args.src.where(args.line('--num-distributed-optimizer-instances'))}: "
                            "--num-distributed-optimizer-instances needs a sharded optimizer; ignored")
        elif args.has("--use-torch-fsdp2"):
            # Megatron's torch FSDP2 wrapper builds its mesh from the whole dp·cp group
            # (core/distributed/torch_fully_sharded_data_parallel.py): no replicas.
            warnings.append(f"{args.src.where(args.line('--num-distributed-optimizer-instances'))}: "
                            f"--num-distributed-optimizer-instances {instances}: torch FSDP2 (--use-torch-fsdp2) shards "
                            "over the whole data-parallel group whatever it says; priced so")
        elif "dp" in settings:
            replicas = settings["dp"] * settings["cp"]
            if replicas % instances:
                raise args.error("--num-distributed-optimizer-instances",
                                 f"{instances} does not divide dp·cp = {replicas}")
            settings["shard_group"] = replicas // instances
    offload = args.has("--optimizer-cpu-offload")
    fraction = args.get("--optimizer-offload-fraction")
    if offload and fraction and fraction.values:
        # (HybridDeviceOptimizer: that share of the rank's parameters updated on the CPU, the rest
        # on the device)
        share = args.number("--optimizer-offload-fraction")
        if share is None or not 0.0 < share <= 1.0:
            raise args.error("--optimizer-offload-fraction", f"{fraction.values[0]} is not a share in (0, 1]")
        settings["optimizer_offload_fraction"] = share
    settings["optimizer_offload"] = offload
    # The states and master weights on the host through the forward and backward, back for a step
    # on the device: Megatron-Core's --offload-optimizer-states, MindSpeed's --swap-optimizer (which
    # brings them back in --swap-optimizer-times slices; priced whole, an upper bound of the step's peak).
    between = args.has("--offload-optimizer-states") or args.has("--swap-optimizer")
    if between and offload:
        warnings.append(f"{args.src.where(args.line('--offload-optimizer-states', '--swap-optimizer'))}: the optimizer "
                        "states are offloaded for a step on the CPU (--optimizer-cpu-offload) already; "
                        "--offload-optimizer-states / --swap-optimizer ignored")
        between = False
    if between and args.has("--swap-optimizer"):
        notes.append("--swap-optimizer: MindSpeed keeps the optimizer states and master weights on the host through the "
                     "forward and backward and swaps them back in slices for the step on the NPU; priced as "
                     "--offload-optimizer-states (reloaded whole: the step's peak an upper bound)")
    args.has("--swap-optimizer-times")  # (read: the slices change the step's peak alone, bounded above)
    settings["offload_optimizer_states"] = between


def _recompute(args: Args, settings: dict[str, Any], warnings: list[str], notes: list[str]) -> None:
    granularity = args.text("--recompute-granularity")
    if args.has("--recompute-activations"):
        granularity = granularity or "selective"
    method = args.get("--recompute-method")
    layers = args.integer("--recompute-num-layers", minimum=0)
    modules = args.values("--recompute-modules") or []
    settings["recompute"], settings["recompute_layers"] = "none", 0
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise args.error("--recompute-modules", f"unknown module {unknown[0]!r}; known: {', '.join(RECOMPUTE_MODULES)}")
    given = granularity
    moe_layer = args.get("--moe-layer-recompute")
    if moe_layer is not None:
        # Deprecated: Megatron-Core's TransformerConfig turns it into selective recompute with
        # "moe" added to --recompute-modules (whose default is core_attn), and refuses it beside
        # full recompute.
        if granularity == "full":
            warnings.append(f"{args.src.where(moe_layer.line)}: --moe-layer-recompute with --recompute-granularity "
                            "full: Megatron-Core refuses the pair (TransformerConfig) and stops before the first "
                            "step; priced as full recompute")
        else:
            granularity = "selective"
            modules = (modules or ["core_attn"]) + ([] if "moe" in modules else ["moe"])
            notes.append(f"--moe-layer-recompute is Megatron-Core's --recompute-granularity selective "
                         f"--recompute-modules {' '.join(modules)}")
    if granularity != "selective" and modules:
        notes.append("--recompute-modules has no effect without --recompute-granularity selective")
    if granularity is None:
        if method is not None:
            notes.append("--recompute-method has no effect without --recompute-granularity")
        return
    if granularity == "selective":
        if method is not None and given == "selective":
            raise args.error(method, "Megatron supports no recompute method with --recompute-granularity selective")
        if method is not None:  # checked only where the granularity is given (TransformerConfig)
            notes.append("--recompute-method has no effect with --moe-layer-recompute's selective recompute")
        if layers is not None and given == "selective":
            warnings.append(f"{args.src.where(args.line('--recompute-num-layers'))}: --recompute-num-layers with "
                            "--recompute-granularity selective: Megatron-Core refuses it (TransformerConfig: "
                            "recompute_num_layers must be None) and stops before the first step; priced as "
                            "selective recompute of every layer")
        settings["recompute"] = "selective"
        if modules:  # without them Megatron re-runs core_attn, as ndplan's Megatron policy does
            settings["recompute_modules"] = tuple(modules)
        return
    if granularity != "full":
        raise args.error("--recompute-granularity", f"expected full or selective, got {granularity!r}")
    name = method.values[0] if method and method.values else None
    if name not in ("uniform", "block"):
        raise args.src.error("--recompute-method", "--recompute-granularity full needs --recompute-method uniform or block",
                             args.line("--recompute-granularity"))
    if layers is None:
        raise args.error("--recompute-granularity", "full recompute needs --recompute-num-layers")
    # Megatron-Core checks only that the count is given (its message asks for 1 to the layers per
    # pipeline rank): 0 passes, and then its loops do nothing, or never end.
    if layers == 0 and name == "uniform":
        raise args.error("--recompute-num-layers", "0 with --recompute-method uniform: Megatron-Core's uniform loop "
                         "advances by that many layers and never ends; give 1 up to the layers per pipeline rank")
    if layers == 0:
        warnings.append(f"{args.src.where(args.line('--recompute-num-layers'))}: --recompute-method block with "
                        "--recompute-num-layers 0 checkpoints no layer (Megatron-Core recomputes the first 0 "
                        "layers of each stage): priced as no recompute")
        return
    settings["recompute"] = "full"
    if name == "block":
        settings["recompute_layers"] = layers
    elif layers != 1:
        warnings.append(f"{args.src.where(args.line('--recompute-num-layers'))}: --recompute-method uniform with "
                        f"--recompute-num-layers {layers} checkpoints groups of {layers} layers; "
                        "ndplan keeps one input per layer")


def _refused_ep_overlap(args: Args, settings: dict[str, Any], warnings: list[str]) -> None:
    """--overlap-moe-expert-parallel-comm where Megatron-Core's TransformerConfig refuses it:
    a pipeline without virtual stages, full recompute, the MoE layer recomputed, fp32, no
    expert parallelism, a token dispatcher other than alltoall or flex (allgather, the default)."""
    arg = args.get("--overlap-moe-expert-parallel-comm")
    if arg is None:
        return
    refused = []
    if settings["ep"] == 1:
        refused.append("with --expert-model-parallel-size 1")
    dispatcher = args.text("--moe-token-dispatcher-type", default="allgather")
    if dispatcher not in ("alltoall", "flex"):
        refused.append(f"with --moe-token-dispatcher-type {dispatcher}"
                       + ("" if args.has("--moe-token-dispatcher-type") else " (Megatron's default)"))
    if settings["pp"] > 1 and settings["vpp"] == 1:
        refused.append("with --pipeline-model-parallel-size > 1 and no virtual stages")
    if settings["recompute"] == "full":
        refused.append("with --recompute-granularity full")
    if "moe" in settings.get("recompute_modules", ()):
        refused.append("with --recompute-modules moe")
    if not args.has("--bf16", "--fp16"):
        refused.append("outside --bf16/--fp16")
    for why in refused:
        warnings.append(f"{args.src.where(arg.line)}: --overlap-moe-expert-parallel-comm {why}: Megatron-Core refuses "
                        "it (TransformerConfig) and stops before the first step; priced as written")


def _refused_recompute_modules(args: Args, settings: dict[str, Any], model: ModelSpec | None,
                               warnings: list[str]) -> None:
    """--recompute-modules Megatron-Core's TransformerConfig raises for: moe_act without
    --moe-grouped-gemm, mla_up_proj without MLA, shared_experts beside
    --moe-shared-expert-overlap (with shared experts), moe_act or layernorm under fp8's delayed
    scaling (--fp8-recipe's default); and full recompute's uniform method over groups of layers
    beside MTP layers, which their own checkpoint refuses."""
    modules = settings.get("recompute_modules", ())
    where = args.src.where(args.line("--recompute-modules"))
    refused = []
    if "moe_act" in modules and not args.has("--moe-grouped-gemm"):
        refused.append("moe_act without --moe-grouped-gemm")
    if "mla_up_proj" in modules and model is not None and not model.is_mla:
        refused.append("mla_up_proj without --multi-latent-attention")
    if "shared_experts" in modules and args.has("--moe-shared-expert-overlap") and (
            args.has("--moe-shared-expert-intermediate-size") or (model is not None and model.num_shared_experts)):
        refused.append("shared_experts with --moe-shared-expert-overlap")
    fp8 = args.has("--fp8-format")
    recipe = args.text("--fp8-recipe", default="delayed")
    if fp8 and recipe == "delayed" and {"moe_act", "layernorm"} & set(modules):
        refused.append("moe_act/layernorm under --fp8-format with delayed scaling (--fp8-recipe's default)")
    for why in refused:
        warnings.append(f"{where}: --recompute-modules {why}: Megatron-Core refuses it (TransformerConfig) and stops "
                        "before the first step; priced as written")
    # MultiTokenPredictionLayer asserts "recompute_num_layers must be 1 for MTP recompute" under
    # full recompute's uniform method.
    method = args.values("--recompute-method") or []
    groups = args.integer("--recompute-num-layers", minimum=0)
    if (settings.get("recompute") == "full" and method[:1] == ["uniform"] and groups is not None and groups > 1
            and model is not None and model.mtp_depth):
        warnings.append(f"{args.src.where(args.line('--recompute-num-layers'))}: --recompute-method uniform with "
                        f"--recompute-num-layers {groups} and MTP layers: Megatron-Core refuses it (its MTP layer "
                        "needs recompute_num_layers 1) and stops at the first step; priced as written")


def _offload(args: Args, settings: dict[str, Any], warnings: list[str], notes: list[str]) -> None:
    """Megatron-Core's fine-grained activation offload: the modules whose saved inputs go to the
    host (``offload_modules``), and a warning for each tuning knob ndplan does not model."""
    enabled = args.has("--fine-grained-activation-offloading")
    given = args.get("--offload-modules")
    modules = args.values("--offload-modules") or []
    if not enabled:
        if modules:
            assert given is not None
            warnings.append(f"{args.src.where(given.line)}: --offload-modules {' '.join(modules)}: Megatron ignores it "
                            "without --fine-grained-activation-offloading; nothing is offloaded")
        for flag in _offload_knobs(args, None):
            notes.append(f"{flag} has no effect without --fine-grained-activation-offloading")
        return
    allowed = ", ".join(OFFLOAD_MODULES)
    if not modules:
        raise args.error(given or "--fine-grained-activation-offloading",
                         f"offload_modules is empty: Megatron-Core needs --offload-modules with at least one of {allowed}")
    unknown = [m for m in modules if m not in OFFLOAD_MODULES and m not in _UNPRICED_OFFLOAD]
    if unknown:
        raise args.error(given or "--offload-modules",
                         f"unknown module {unknown[0]!r} for offload_modules; allowed: {allowed} "
                         f"({' and '.join(_UNPRICED_OFFLOAD)} are Megatron-Core's too, not priced by ndplan)")
    where = args.src.where(given.line if given else None)
    for name in dict.fromkeys(m for m in modules if m in _UNPRICED_OFFLOAD):
        warnings.append(f"{where}: --offload-modules {name}: ndplan does not price this module's offload and "
                        "leaves it out")
    _offload_knobs(args, warnings)
    chosen = canonical_offload(modules)
    if not chosen:
        return
    problem = offload_conflict(chosen, settings["recompute"], tuple(settings.get("recompute_modules", ())),
                               settings["schedule"])
    if problem:
        raise args.error(given or "--offload-modules", problem)
    settings["offload_modules"] = chosen


def _layer_offload(args: Args, settings: dict[str, Any], warnings: list[str], notes: list[str]) -> None:
    """Megatron-Core's layer offload: ``--cpu-offloading-num-layers N`` (which sets
    --cpu-offloading) copies the first N layers' saved activations to the host
    (``offload_layers``); weights are never offloaded in the releases read."""
    given = args.get("--cpu-offloading-num-layers")
    layers = args.integer("--cpu-offloading-num-layers", default=0, minimum=0, maximum=MAX_DEGREE) or 0
    knobs = [flag for flag in ("--cpu-offloading", "--cpu-offloading-weights", "--cpu-offloading-double-buffering")
             if args.has(flag)]
    if not layers:
        for flag in knobs:
            notes.append(f"{args.src.where(args.line(flag))}: {flag} without --cpu-offloading-num-layers offloads "
                         "no layer")
        return
    for flag, meaning in (("--cpu-offloading-weights", "weights (Transformer Engine 2.10 ignores it, with a warning)"),
                          ("--cpu-offloading-double-buffering", "two layers' reload buffers kept on the device "
                                                                "(Transformer Engine 2.5-2.9)")):
        if flag in knobs:
            warnings.append(f"{args.src.where(args.line(flag))}: {flag}: {meaning}: not priced")
    problem = layer_offload_conflict(layers, settings["pp"], settings["recompute"],
                                     tuple(settings.get("offload_modules", ())))
    if problem:
        assert given is not None
        raise args.error(given, problem)
    settings["offload_layers"] = layers


def _offload_knobs(args: Args, warnings: list[str] | None) -> list[str]:
    """The offload tuning flags set away from Megatron's defaults (each one a warning saying
    what ndplan assumes instead, when ``warnings`` is given); every one of them is read."""
    changed: list[str] = []

    def warn(arg: Arg, shown: str, assumption: str) -> None:
        changed.append(arg.flag)
        if warnings is not None:
            warnings.append(f"{args.src.where(arg.line)}: {arg.flag}{shown}: {assumption}")

    size = args.get("--min-offloaded-tensor-size")
    if size is not None and args.integer(size.flag, minimum=0) != 1024 * 1024:
        warn(size, f" {size.values[0]}", "ndplan moves every saved tensor of the offloaded modules that is as wide "
                                         "as the hidden size or wider and keeps the per-token statistics, whatever the "
                                         f"threshold (Megatron-Core keeps tensors under {size.values[0]} elements on the device)")
    fraction = args.get("--activation-offload-fraction")
    if fraction is not None:
        value = _fraction(args, fraction)
        if value != 1.0:
            warn(fraction, f" {fraction.values[0]}", "ndplan assumes fraction 1.0: every layer offloads its modules")
    delta = args.get("--delta-offload-bytes-across-pp-ranks")
    if delta is not None and args.integer(delta.flag, minimum=None) != 0:
        warn(delta, f" {delta.values[0]}", "ndplan offloads the same bytes on every pipeline stage")
    inflight = args.get("--fine-grained-offloading-max-inflight-offloads")
    limit = next((v for v in inflight.values if v), None) if inflight is not None else None
    if inflight is not None and limit is not None:
        warn(inflight, f" {limit}", "ndplan prices a forward that waits for each copy that falls behind "
                                    "and holds no pending copies in device memory, whatever the cap")
    delay = args.get("--delay-offload-until-cuda-graph")
    if delay is not None:
        warn(delay, "", "ndplan models no CUDA graphs; it starts each copy when its module's forward ends")
    return changed


def _fraction(args: Args, arg: Arg) -> float:
    text = arg.values[0] if arg.values else ""
    try:
        value = float(text)
    except ValueError:
        raise args.error(arg, f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise args.error(arg, f"must be in [0, 1], got {text}")
    return value


def _precision(args: Args, warnings: list[str]) -> PrecisionPolicy:
    """The byte widths Megatron's mixed precision and (precision-aware) optimizer keep."""
    bf16, fp16 = args.has("--bf16"), args.has("--fp16")
    dtype = args.text("--params-dtype") or ""
    bf16 = bf16 or "bfloat16" in dtype
    fp16 = fp16 or ("float16" in dtype and "bfloat16" not in dtype)
    if bf16 and fp16:
        raise args.error("--fp16", "--bf16 and --fp16 exclude each other")
    fp8 = args.text("--fp8-format")
    optimizer = args.text("--optimizer", default="adam") or "adam"
    if optimizer not in ("adam", "adamw", "sgd", "muon", "dist_muon"):
        raise args.error("--optimizer", f"unknown optimizer {optimizer!r}")
    states = 2 if optimizer in ("adam", "adamw") else 1
    if optimizer in ("muon", "dist_muon"):
        warnings.append(f"{args.src.where(args.line('--optimizer'))}: --optimizer {optimizer} keeps one state for "
                        "matrices and Adam's two for the rest; ndplan prices one state everywhere")
    widths = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
    aware = args.has("--use-precision-aware-optimizer")
    if aware:
        # megatron/core/optimizer/optimizer_config.py asserts both when it builds the optimizer.
        where = args.src.where(args.line("--use-precision-aware-optimizer"))
        if not args.has("--use-distributed-optimizer"):
            warnings.append(f"{where}: --use-precision-aware-optimizer without --use-distributed-optimizer: "
                            "Megatron-Core refuses it (OptimizerConfig) and stops before the first step; priced as written")
        if optimizer == "sgd":
            warnings.append(f"{where}: --use-precision-aware-optimizer with --optimizer sgd: Megatron-Core runs it only "
                            "with Adam (OptimizerConfig) and stops before the first step; priced as written")
    dtypes = [args.text(flag, default="fp32") for flag in
              ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")]
    # Megatron applies these dtypes only with the precision-aware optimizer.
    main_grads, main_params, avg, avg_sq = dtypes if aware else ["fp32"] * 4
    for flag, value in (("--main-grads-dtype", main_grads), ("--main-params-dtype", main_params),
                        ("--exp-avg-dtype", avg), ("--exp-avg-sq-dtype", avg_sq)):
        if value not in widths:
            raise args.error(flag, f"unknown dtype {value!r}")
    assert main_grads and main_params and avg and avg_sq
    if widths[avg] != widths[avg_sq]:
        warnings.append(f"{args.src.name}: --exp-avg-dtype {avg} and --exp-avg-sq-dtype {avg_sq} differ; "
                        f"ndplan prices both at {max(widths[avg], widths[avg_sq])} bytes")
    if not (bf16 or fp16):
        if fp8:
            raise args.error("--fp8-format", "needs --bf16 or --fp16")
        return make_policy("megatron-fp32", param_bytes=4, grad_bytes=4, master_weight_bytes=0,
                           optimizer_state_bytes=4, optimizer_states=states, activation_bytes=4,
                           compute_dtype="fp32", param_gather_bytes=4)
    # Megatron forces fp32 gradient accumulation under bf16; under fp16 the gradient buffer is
    # fp16 unless --accumulate-allreduce-grads-in-fp32 asks for fp32 (arguments.py).
    fp16_grads = fp16 and not args.has("--accumulate-allreduce-grads-in-fp32")
    grad = 2 if args.has("--grad-reduce-in-bf16") or main_grads == "bf16" or fp16_grads else 4
    compute = "fp8" if fp8 else ("bf16" if bf16 else "fp16")
    fp8_params = args.has("--fp8-param-gather")
    if fp8_params and not fp8:
        warnings.append(f"{args.src.where(args.line('--fp8-param-gather'))}: --fp8-param-gather without "
                        "--fp8-format keeps no fp8 weights; ignored")
        fp8_params = False
    name = (f"megatron-{compute}" + ("-param" if fp8_params else "") + ("-grad16" if grad == 2 else "")
            + ("-lowopt" if aware else ""))
    return make_policy(
        name, param_bytes=2, grad_bytes=grad, master_weight_bytes=widths[main_params],
        optimizer_state_bytes=max(widths[avg], widths[avg_sq]), optimizer_states=states,
        compute_dtype=compute, fp8_params=fp8_params, param_gather_bytes=1 if fp8_params else 2,
    )


def _batch(args: Args, settings: dict[str, Any], dp: int | None, warnings: list[str], notes: list[str]) -> None:
    mbs = args.integer("--micro-batch-size")
    if mbs is None:
        notes.append("no --micro-batch-size (Megatron requires one); ndplan uses 1")
        mbs = 1
    settings["mbs"] = mbs
    seq = args.integer("--seq-length", "--encoder-seq-length")
    if seq is not None:
        settings["seq"] = seq
    else:
        warnings.append(f"{args.src.name}: no --seq-length; ndplan uses its default unless --seq is given")
    gbs_arg = args.get("--global-batch-size")
    gbs = args.integer("--global-batch-size")
    if dp is None:
        if gbs is not None:
            settings["gbs"] = gbs
        return
    if gbs is None:
        gbs = mbs * dp  # Megatron's default: one micro-batch per step
        notes.append(f"no --global-batch-size: Megatron uses micro-batch size · dp = {gbs}")
    settings["gbs"] = gbs
    settings["num_micro_batches"] = micro_batches(
        args.src, gbs=gbs, dp=dp, mbs=mbs, gbs_field="--global-batch-size",
        gbs_line=gbs_arg.line if gbs_arg else None,
    )


def read(path: Path, text: str, kind: str, model: ModelSpec | None, devices: int | None) -> ReadResult:
    if kind == "shell":
        return read_script(path, text, model, devices)
    if kind in ("json", "yaml"):
        return read_args_file(path, text, kind, model, devices)
    raise NdplanError(f"{path}: not a Megatron argument file")
