"""How the runtime behaves, as the memory model reads it: ``MemoryOptions`` (the saved-tensor
profile, attention kernel, loss, MoE dispatcher and routing headroom, what is compiled and the
runtime overhead), and the values its fields take.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from ndplan.census.record import CensusRecord
from ndplan.errors import NdplanError
from ndplan.memory.profile import RuntimeProfile, get_profile
from ndplan.model.heads import KV_REPEATS, KvRepeat

if TYPE_CHECKING:
    from ndplan.model.spec import ModelSpec
    from ndplan.perf.overlap import OverlapConfig


#: The attention kernel: a flash kernel (FlashAttention, cuDNN, Transformer Engine's fused
#: attention), PyTorch's SDPA as transformers calls it, the eager s x s softmax, or PyTorch's
#: FlexAttention (a compiled flash-style kernel: it keeps what flash keeps, and runs slower).
Attention = Literal["flash", "sdpa", "eager", "flex"]
#: Megatron-Core's token dispatchers (``--moe-token-dispatcher-type``) as memory and time price
#: them: 'alltoall' (also what the flex dispatcher, DeepEP/HybridEP, is priced as; its network
#: copies follow ``OverlapConfig.ep_dispatch``) and 'allgather' (Megatron's default).
MoeDispatcher = Literal["alltoall", "allgather"]
#: What torch.compile compiles (torchtitan's ``[compile] components``): nothing, the decoder
#: layers, the layers and the loss, or the loss alone.
TorchCompile = Literal["off", "model", "model+loss", "loss"]
#: Which modules a pytorch-runtime model is built of, as the memory model prices what they keep:
#: the profile's eager modules (Hugging Face transformers', torchtitan's), or NeMo AutoModel's
#: Transformer Engine backend (``MemoryOptions.modules``).
Modules = Literal["eager", "te"]
#: The profile symbols ``modules`` 'te' sets to 1 (0 under 'eager'): a runtime whose profile uses
#: neither describes its own modules, and the option is refused there.
TE_MODULE_SYMBOLS = ("fused_norm", "weighted_experts")
#: The schedules whose compute waits for its own pipeline sends (``EfficiencyProfile.p2p_wait``).
P2PWait = Literal["1f1b", "1f1b+interleaved", "none"]


#: Most routed tokens on a rank, or in an expert's buffer, over the balanced share that
#: ``moe_imbalance`` and ``moe_capacity_factor`` may give: past every model's num_experts/top-k
#: (all tokens on one expert: 384/8 = 48 for Kimi K2), and small enough that no byte count
#: overflows.
MAX_MOE_FACTOR = 1024.0


def _is_number(value: object) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class MemoryOptions:
    """How the runtime behaves: its saved-tensor profile, attention kernel, loss, overhead.

    ``moe_imbalance`` scales the routed-expert tokens of the busiest rank (1.0: balanced routing;
    dropless MoE under real routing needs headroom, e.g. 1.2). ``moe_capacity_factor`` prices a
    token-dropping MoE instead: every expert's buffer holds capacity_factor × its balanced share
    of tokens (padded when fewer come, dropped beyond), so routed-expert bytes are exactly that
    multiple whatever the routing. ``census`` replaces the profile's formulas for the layer kinds
    it measured. ``loss_upcast`` off: the loss works on the logits' own dtype (NeMo AutoModel's
    MaskedCrossEntropy(fp32_upcast=False); Megatron with Transformer Engine's cross-entropy,
    which writes the gradient into the logits) instead of an fp32 copy. ``overlap`` says which
    communication the runtime hides; the memory model does not read it, the step-time model and
    the balancer do (None: the device runtime's defaults, ``ndplan.perf.overlap.default_overlap``),
    so the options a command builds carry it to both. ``grouped_gemm`` off: the experts run one
    GEMM each (Megatron's SequentialMLP, without --moe-grouped-gemm), so the profile's
    ``expert_workspace_bytes`` (a grouped GEMM's own workspaces) are not held.
    ``selective_policy`` says what selective recompute keeps where the runtime can run more than
    its own policy (None: the profile's): 'torchtitan-op' is torchtitan's per-op checkpointing
    (every second matmul rebuilt), for the pytorch profile; memory and step time both follow it.
    ``moe_dispatcher`` is Megatron-Core's token dispatcher (``--moe-token-dispatcher-type``):
    'alltoall' (what ``--emit megatron`` writes and the search prices; the flex dispatcher too,
    with ``overlap.ep_dispatch`` node_dedup) or 'allgather' (Megatron's default where a launch
    states none): MoEAllGatherTokenDispatcher gathers every token of the expert-TP x EP group
    into a persistent buffer, keeps the gathered routing probabilities and mask for backward,
    and returns the experts' output by a reduce-scatter in the probabilities' fp32
    (``allgather_dispatch_bytes``, the profile's ``moe_allgather`` block); only for runtimes
    whose profile states that block (megatron).
    ``torch_compile`` says what torch.compile fuses: 'model' runs each decoder layer's elementwise
    ops as fused kernels (one pass over their bytes) and leaves the final norm and loss at the
    runtime's eager figure; 'model+loss' fuses those too, 'loss' those alone; 'off' prices the
    runtime's own kernels. Compiled layers and a compiled loss also keep fewer tensors for
    backward, priced where the runtime's profile says which (``compiled_layers``, ``compiled_loss``:
    the pytorch profile, for dense layers and a loss that is not vocabulary-parallel).
    ``p2p_wait`` names the pipeline schedules whose compute waits for its own sends, for the
    step time alone (``EfficiencyProfile.p2p_wait``; None: the runtime's, its profile's kernel
    fact or Megatron-Core's '1f1b'): a Megatron launch with --no-overlap-p2p-communication waits
    in its interleaved schedule too ('1f1b+interleaved').
    ``gradient_accumulation_fusion``: whether the weight-gradient GEMM accumulates into the
    gradient buffer itself, for the step time alone (``EfficiencyProfile.gradient_accumulation_fusion``;
    None: the runtime's, on): a Megatron launch with --no-gradient-accumulation-fusion adds each
    weight gradient by a kernel of its own (False).
    ``modules`` says which modules the pytorch runtime's model is built of, for what they keep
    for backward: 'eager' (the profile's: transformers' and torchtitan's) or 'te', NeMo
    AutoModel's Transformer Engine backend (its ``te_deepep`` configs: ``rms_norm: te`` and the
    DeepEP experts). Transformer Engine's RMSNorm keeps its input in the activation dtype and one
    fp32 statistic a token, where the eager norm keeps an fp32 copy and the normalised input
    besides; the experts' activation is one fused function that weighs each routed copy by its
    fp32 routing probability before the down projection (Megatron's ``weighted_bias_swiglu``,
    AutoModel's compiled ``quick_geglu_deepep``), so it keeps its input and the probabilities, and
    nothing keeps the down projection's output. Memory alone: the step time prices the
    runtime's elementwise kernels as before (``elementwise_passes``).
    ``experts_outside_fsdp``: under FSDP, the routed experts whose shard group is one rank (expert
    parallelism over the whole data-parallel group) are left out of FSDP, as NeMo AutoModel's MoE
    parallelizer does (``apply_fsdp``'s ``ignored_params`` where its ep_shard mesh is one rank):
    FSDP gathers no copy of them and makes no unsharded gradient of theirs, and their gradients
    are kept in the parameters' dtype (torchtitan shards them over that one rank all the same).
    ``ulysses_kv_repeat``: when the runtime repeats a tensor-parallel rank's KV heads to its query
    heads before a Ulysses all-to-all, in memory and time: 'needed' where the group outnumbers them
    (MindSpeed's UlyssesContextAttention; elsewhere a runtime limit refuses such a group), or
    'always' (MindSpeed-LLM's --kv-head-repeat-before-uly-alltoall, on by default there: every GQA
    layer under Ulysses or hybrid CP), for the megatron runtime.
    """

    runtime: str = "pytorch"
    attention: Attention = "flash"
    loss_parallel: bool | None = None
    include_overhead: bool = True
    moe_imbalance: float = 1.0
    moe_capacity_factor: float | None = None
    loss_upcast: bool = True
    census: tuple[CensusRecord, ...] = field(default=())
    overlap: OverlapConfig | None = None
    grouped_gemm: bool = True
    selective_policy: str | None = None
    moe_dispatcher: MoeDispatcher = "alltoall"
    torch_compile: TorchCompile = "off"
    p2p_wait: P2PWait | None = None
    gradient_accumulation_fusion: bool | None = None
    modules: Modules = "eager"
    experts_outside_fsdp: bool = False
    ulysses_kv_repeat: KvRepeat = "needed"

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, str):
            raise NdplanError(f"runtime must be a runtime's name or a profile YAML's path, got {self.runtime!r}")
        for name in ("include_overhead", "loss_upcast", "grouped_gemm", "loss_parallel", "experts_outside_fsdp",
                     "gradient_accumulation_fusion"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)) and not (
                    value is None and name in ("loss_parallel", "gradient_accumulation_fusion")):
                also = " (or None: the runtime's choice)" if name == "loss_parallel" else ""
                raise NdplanError(f"{name} must be True or False{also}, got {value!r}")
        if isinstance(self.census, (str, Path)):  # a census file's path, as the CLI's --census takes
            from ndplan.census.record import load_census_file

            object.__setattr__(self, "census", tuple(load_census_file(self.census)))
        elif isinstance(self.census, list):
            object.__setattr__(self, "census", tuple(self.census))
        wrong = [r for r in self.census if not isinstance(r, CensusRecord)] \
            if isinstance(self.census, tuple) else [self.census]
        if wrong:
            raise NdplanError("census must be census records (ndplan.census) or a census file's path, "
                              f"got {type(wrong[0]).__name__} {wrong[0]!r:.60}")
        if self.attention not in get_args(Attention):
            raise NdplanError(f"attention must be one of {', '.join(get_args(Attention))}, got {self.attention!r}")
        get_profile(self.runtime)  # an unknown runtime is an error here, not at first use
        # (comparisons that NaN fails, and a bound: 1e300 overflowed the byte counts to inf)
        if not _is_number(self.moe_imbalance) or not 1.0 <= self.moe_imbalance <= MAX_MOE_FACTOR:
            raise NdplanError(f"moe_imbalance must be a finite number >= 1.0 and <= {MAX_MOE_FACTOR:g} (busiest rank over "
                              f"balanced routing), got {self.moe_imbalance!r}")
        if self.moe_capacity_factor is not None and (
                not _is_number(self.moe_capacity_factor) or not 0 < self.moe_capacity_factor <= MAX_MOE_FACTOR):
            raise NdplanError(f"moe_capacity_factor must be a finite number > 0 and <= {MAX_MOE_FACTOR:g}, "
                              f"got {self.moe_capacity_factor!r}")
        if self.moe_dispatcher not in get_args(MoeDispatcher):
            raise NdplanError(f"moe_dispatcher must be one of {', '.join(get_args(MoeDispatcher))}, "
                              f"got {self.moe_dispatcher!r}")
        if self.torch_compile not in get_args(TorchCompile):
            raise NdplanError(f"torch_compile must be one of {', '.join(get_args(TorchCompile))}, "
                              f"got {self.torch_compile!r}")
        if self.p2p_wait is not None and self.p2p_wait not in get_args(P2PWait):
            raise NdplanError(f"p2p_wait must be one of {', '.join(get_args(P2PWait))} (or None: the runtime's), "
                              f"got {self.p2p_wait!r}")
        if self.ulysses_kv_repeat not in KV_REPEATS:
            raise NdplanError(f"ulysses_kv_repeat must be one of {', '.join(KV_REPEATS)}, got {self.ulysses_kv_repeat!r}")
        if self.ulysses_kv_repeat == "always" and not self.profile.uses_shard("attended_kv"):
            raise NdplanError(f"ulysses_kv_repeat 'always' is MindSpeed-LLM's repeat of the KV heads before a Ulysses "
                              f"all-to-all; runtime '{self.runtime}' states no such repeat (use runtime megatron)")
        if self.modules not in get_args(Modules):
            raise NdplanError(f"modules must be one of {', '.join(get_args(Modules))}, got {self.modules!r}")
        if self.modules != "eager" and not self.profile.uses_symbols(TE_MODULE_SYMBOLS):
            raise NdplanError(f"modules {self.modules!r} describes NeMo AutoModel's Transformer Engine modules under the "
                              f"pytorch runtime; runtime '{self.runtime}' describes its own modules (leave modules "
                              f"'eager')")
        if self.moe_dispatcher == "allgather" and "moe_allgather" not in self.profile.blocks:
            raise NdplanError(f"moe_dispatcher 'allgather' is Megatron-Core's MoEAllGatherTokenDispatcher; runtime "
                              f"'{self.runtime}' states no such dispatcher (use runtime megatron)")
        if self.moe_dispatcher == "allgather" and self.overlap is not None and self.overlap.ep_dispatch == "node_dedup":
            raise NdplanError("moe_dispatcher 'allgather' gathers every token of the expert group; overlap "
                              "ep_dispatch=node_dedup is the flex dispatcher's (DeepEP, HybridEP): give one or the other")
        allowed = self.profile.selective_policies or (self.profile.selective_policy,)
        if self.selective_policy is not None and self.selective_policy not in allowed:
            raise NdplanError(f"selective_policy {self.selective_policy!r} is not one runtime '{self.runtime}' prices; "
                              f"allowed: {', '.join(allowed)}")
        if self.census and self.modules != "eager":
            raise NdplanError(f"a census measures the modules it ran (transformers' eager ones), not modules "
                              f"{self.modules!r}: leave out one or the other")
        if self.census and self.selective_policy not in (None, self.profile.selective_policy):
            raise NdplanError(f"a census measures the runtime's own selective recompute "
                              f"({self.profile.selective_policy}), not {self.selective_policy}: leave out one or the other")

    @property
    def recompute_policy(self) -> str:
        """What selective recompute keeps: ``selective_policy``, else the runtime's own."""
        return self.selective_policy or self.profile.selective_policy

    @property
    def routed_token_factor(self) -> float:
        """Routed-expert tokens on a rank relative to balanced routing."""
        return self.moe_capacity_factor if self.moe_capacity_factor is not None else self.moe_imbalance

    @property
    def profile(self) -> RuntimeProfile:
        return get_profile(self.runtime)

    @property
    def vocab_parallel_loss(self) -> bool:
        """Whether the loss runs on vocabulary-sharded logits: ``loss_parallel``, else the runtime's choice."""
        return self.profile.loss_parallel if self.loss_parallel is None else self.loss_parallel

    def compiled_layers(self, model: ModelSpec) -> bool:
        """Whether the decoder layers' saved tensors are priced as torch.compile's (the entries'
        ``compiled_bytes`` and ``compiled_keep``): the layers are compiled, the runtime's profile
        says what compiled layers keep, and the model's layers are of the kinds measured compiled
        (``compiled_layers_gap`` says why not where they are compiled)."""
        return "model" in self.torch_compile and not self.compiled_layers_gap(model)

    def compiled_loss(self) -> bool:
        """Whether the loss's saved tensors are priced as a compiled cross-entropy keeps them (the
        output block's ``compiled_bytes``): the loss is compiled, the runtime's profile says what a
        compiled loss keeps, and it is not vocabulary-parallel (DTensor's loss parallelism was not
        measured compiled)."""
        return ("loss" in self.torch_compile and not self.vocab_parallel_loss
                and any(t.compiled_bytes is not None for t in self.profile.blocks.get("output", ())))

    def compiled_layers_gap(self, model: ModelSpec) -> str:
        """Why compiled layers are priced as the eager modules (empty where they are not, or where
        nothing is compiled)."""
        if "model" not in self.torch_compile:
            return ""
        if not any(t.compiled_bytes is not None or t.compiled_keep is not None
                   for entries in self.profile.blocks.values() for t in entries):
            return f"runtime '{self.profile.name}' does not say what compiled layers keep"
        # (measured compiled on a CPU: dense layers of Llama, Qwen3, OLMo 2, Phi-3 and Gemma 3;
        # transformers' MoE blocks break the graph, and MLA and Gated DeltaNet were not measured)
        kinds = [kind for kind, has in (("experts", model.is_moe), ("multi-head latent attention", model.is_mla),
                                        ("Gated DeltaNet layers", model.has_linear_attention)) if has]
        if kinds:
            return f"{model.name}'s {' and '.join(kinds)} were not measured compiled"
        return ""

    def time_keywords(self) -> dict[str, Any]:
        """What the step-time model (``ndplan.perf.step.evaluate`` and the functions over it)
        needs of this runtime, so that time prices what memory assumes: its rebuilds per
        parameter group in a split backward's W, what its selective recompute re-runs, whether
        its attention kernel is flash (``attention``), and what it hides."""
        software: dict[str, Any] = {"selective_recompute": self.recompute_policy,
                                    "flash_attention": self.attention != "eager",  # SDPA runs a flash kernel
                                    "flex_attention": self.attention == "flex",
                                    # ... but a sliding window reaches transformers' SDPA as a mask
                                    # (where the runtime prices that mask's memory: sdpa_masked)
                                    "window_kernel": not (self.attention == "sdpa"
                                                          and "sdpa_masked" in self.profile.blocks)}
        software.update(self.profile.kernels)
        if self.torch_compile != "off":
            # A compiled part fuses its elementwise chains into one pass; the rest keeps the
            # runtime's (eager) figure.
            eager = float(software.get("elementwise_passes", 1.0))
            software["elementwise_passes"] = 1.0 if "model" in self.torch_compile else eager
            software["loss_elementwise_passes"] = 1.0 if "loss" in self.torch_compile else eager
        software["pipeline_defers_fsdp_reduce"] = self.profile.pipeline_defers_fsdp_reduce
        software["grad_buckets"] = self.profile.grad_buckets
        software["ddp_bucket_cap_mb"] = self.profile.ddp_bucket_cap_mb
        software["gradient_accumulation_rules"] = self.profile.gradient_accumulation_rules
        software["loss_upcast"] = self.loss_upcast
        # Whether the loss is vocabulary-parallel, or runs on logits gathered whole to every
        # tensor-parallel rank (the option, else the runtime's choice), as memory holds them.
        software["loss_parallel"] = self.vocab_parallel_loss
        # The busiest rank computes and receives as much more as it holds (1.0 too: the options,
        # not a device profile's figure, say what memory priced); a capacity factor, where
        # given, sets it instead (buffers padded to capacity: routed_token_factor), in time too.
        software["moe_imbalance"] = self.moe_imbalance
        software["moe_capacity_factor"] = self.moe_capacity_factor
        software["moe_dispatcher"] = self.moe_dispatcher
        software["ulysses_kv_repeat"] = self.ulysses_kv_repeat
        if self.p2p_wait is not None:
            software["p2p_wait"] = self.p2p_wait
        if self.gradient_accumulation_fusion is not None:
            software["gradient_accumulation_fusion"] = bool(self.gradient_accumulation_fusion)
        return {"weight_grad_rebuilds": self.profile.weight_grad_recomputes_per_group, "software": software,
                "overlap": self.overlap}
