"""Efficiency figures: what fraction of a device's datasheet peaks real kernels reach.

Every step-time term is "work / (peak rate × efficiency)". The peaks come from the Device
(hardware/devices.yaml, with sources); the efficiencies live here, one documented profile per
device family, so that the whole time model has a handful of dimensionless knobs a user can
override, or fit to their own measurements with ``ndplan calibrate``.

Units: efficiencies are fractions in (0, 1]; ``*_latency_s`` seconds; ``gemm_knee`` elements;
``*_overhead_s`` seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ndplan.errors import NdplanError, parse_nested, read_text
from ndplan.hardware.device import Device

Fraction = Annotated[float, Field(gt=0.0, le=1.0)]


class EfficiencyProfile(BaseModel):
    """Achieved fractions of peak, per device family (see ``FAMILY_DEFAULTS`` for sources).

    GEMMs: a matmul of shape (M, N, K) runs at
        peak_flops[dtype] · gemm_efficiency · min(1, min(M, N, K) / gemm_knee)
    (tile quantisation: a dimension thinner than one tile costs as much as a full tile), and
    never faster than its operands and result can stream from HBM (roofline, see gemm.py).
    ``fp8_gemm_efficiency`` replaces ``gemm_efficiency`` when the compute dtype is fp8, as the
    GEMM library of Transformer Engine-based training runs them; ``fp8_gemm_kernel`` 'deepgemm'
    prices DeepSeek's fine-grained fp8 GEMMs (DeepGEMM, the 1x128/128x128-scaled kernels its
    DeepSeek-V3 report describes) at their published rates instead (``DEEPGEMM_FP8_EFFICIENCY``,
    where the family has a figure).
    Reduction depth: each output tile pays a fixed cost (pipeline fill, epilogue, scale
    handling) worth ``gemm_depth_knee`` (``fp8_gemm_depth_knee`` in fp8) elements of its
    reduction, so a pass summing over R elements runs at R/(R + knee) of the asymptotic rate.
    The efficiencies above are quoted at R = 8192 (large square GEMMs), so the rate is
    multiplied by min(1, R/(R + knee) · (8192 + knee)/8192) (gemm.depth_factor). R is K in the
    forward, N in the input gradient and M (the tokens) in the weight gradient: expert GEMMs
    of fine-grained MoE models (f_e = 768-2048, 1-4 K tokens per expert) lose 15-45% to it.
    0 turns it off (families without a measurement).
    Routed-expert GEMMs are grouped GEMMs; ``grouped_gemm_factor`` multiplies their efficiency,
    and each local expert's GEMM costs at least ``expert_gemm_latency_s`` more (kernel prologue,
    epilogue and the partial last wave of a small per-expert GEMM, plus its per-expert fp8
    quantisation kernel): grouped GEMMs over many small experts are latency-bound. That holds
    where the runtime launches a GEMM per expert (``expert_gemm`` 'per-expert': Transformer
    Engine's GroupedLinear); with 'grouped' one kernel runs every local expert
    (torch._grouped_mm, a CUTLASS grouped GEMM: transformers' and torchtitan's MoE; the
    grouped_gemm library's ops.gmm is one kernel on sm_80 alone, elsewhere a cuBLAS GEMM per
    expert, 'per-expert'), which on an
    H200 costs no more per expert than the roofline (benchmarks/accuracy/cuda_probe.py, bf16,
    16-128 experts of 64-4096 tokens), and the host launches no per-expert kernels
    (``host_expert_s`` is 0 there too).

    Attention core (QK^T, softmax, PV): FlashAttention-style fused kernels at
    ``attention_efficiency`` of peak; the backward counts 2.5x the forward FLOPs (the kernel
    recomputes the scores; (3·d_qk + 2·d_v)/(d_qk + d_v) where the head widths differ, MLA's 2.6x); each layer's call costs ``attention_call_s`` more, forward and
    backward together (the backward's pre- and post-processing kernels), split as the FLOPs. With ``flash_attention`` False (pre-2022 Megatron), scores are
    materialised: two batched GEMMs over the full s×s square plus memory-bound softmax passes.
    ``flex_attention`` (PyTorch's FlexAttention, compiled into a Triton kernel) runs the same
    flash algorithm slower than the family's kernel: ``FLEX_ATTENTION_SHARE`` of it, by its
    developer's averages, where the family has such a figure (A100, H100); elsewhere as the
    family's kernel. Its block mask skips what a sliding window leaves out (``window_kernel``).
    ``window_kernel`` False: a sliding-window layer runs a fused kernel given an explicit mask
    (transformers' SDPA once seq >= window), which computes every (query, key) pair of the
    square rather than skipping the blocks outside the window, at ``masked_attention_efficiency``
    (``attention_efficiency`` when unset): reading the mask, the kernel runs slower than causal
    flash attention. ``loss_upcast`` False: the cross-entropy works on the logits' own dtype
    (memory_ops.head_bytes), as the memory option of that name says. ``loss_parallel`` False:
    the output layer all-gathers the logits to every tensor-parallel rank and the loss reads all
    T·V of them (torchtitan without loss parallelism, the ``pytorch`` runtime's default) rather
    than the vocabulary-parallel loss on T·V/t with its three per-token all-reduces (layer.py).

    Memory-bound ops (norms, activations, rotary, residuals, loss) move bytes at
    ``hbm_bandwidth · hbm_efficiency``; the optimizer's update at its own rate (below).

    Collectives: alpha-beta; a step costs ``*_latency_s`` and bytes move at
    ``bandwidth · *_efficiency`` (NCCL bus bandwidth over link rate).
    ``scaleup_topology`` 'mesh' means point-to-point links (MI300X, Ascend 910B): a group of n
    out of a domain of D devices reaches only (n-1)/(D-1) of the device's scale-up bandwidth.

    FP8: every GEMM input is quantised first, a memory-bound pass of ``fp8_cast_bytes`` per
    element (read bf16 2, write fp8 1, plus the transposed copy the backward needs 1): the
    forward casts the activation [m, k], the backward the output gradient [m, n].

    Elementwise kernels: ``elementwise_passes`` multiplies their bytes; 1 for fused kernels
    (Megatron/Transformer Engine, torch.compile), about 4.5 for eager PyTorch (RMSNorm, SwiGLU
    and rotary as chains of separate fp32 kernels): in real steps of transformers' Llama-3.1-8B,
    Mistral-7B, Qwen3-30B-A3B and DeepSeek-V2-Lite on an H200, the kernels that are neither GEMMs
    nor attention took 4.4-5.4 times the seconds of one pass over the bytes counted here
    (torch.profiler, tests/data/measured/h200/profile.json). ``loss_elementwise_passes`` (unset:
    ``elementwise_passes``) is the loss's own (the final norm's and the cross-entropy's), where
    a runtime fuses the decoder layers but not the loss: torch.compile of the blocks alone
    (torchtitan's ``[compile] components = ["model"]``, and every torchtitan release before
    the loss could be compiled) leaves the loss eager.

    Selective recompute (``Strategy.recompute = 'selective'``) differs by framework, a fact of
    the software like ``flash_attention``: ``selective_recompute`` 'megatron' re-runs the
    attention core and the cheap elementwise ops (Megatron's core-attention recompute);
    'torchtitan-op' is torchtitan's per-op policy, which saves the attention output and every
    matmul's except every second one, so it re-runs every second matmul of each block
    (``flops.alternate_recomputed_gemms``) and the elementwise ops, not the attention core;
    'keep-matmuls' saves every matmul's and the attention core's output and re-runs the
    elementwise ops alone (the ``pytorch`` runtime profile's selective policy, which its census
    measures); both re-run the copies and merges counted op by op below too, no output of theirs
    being saved. A runtime profile states its own (``RuntimeProfile.selective_policy``), and the
    commands that know the runtime price that one (``step.evaluate``'s ``software``).

    Host: the CPU enqueues a layer's kernels ahead of the GPU; when that takes longer than the
    GPU work the GPU waits. A decoder layer's forward and backward each take at least
    ``host_layer_s`` (dense) or ``host_moe_layer_s`` (MoE: routing, token permutation and the
    device-to-host sync of per-expert token counts that dropless dispatch needs), plus
    ``host_expert_s`` per local expert: after that sync the host launches each expert's
    GEMMs and casts (about 4 launches of ~5 µs forward; the backward counts twice), with the
    GPU queue drained, so these launches are not hidden behind earlier GPU work. The same
    sync drains the queue in the middle of every MoE forward: the GPU work queued before it
    (attention block and router) cannot overlap the host's launches after it, so a MoE
    forward takes at least (host_f - host_layer_s) + GPU time before the sync, the launches
    before the sync being about a dense layer's (layer.py).

    Overheads: ``layer_overhead_s`` per decoder layer per pass on the GPU (kernel tails,
    synchronisation); ``step_overhead_s`` once per step (data loading, logging).
    ``moe_imbalance`` >= 1 scales routed-expert compute and all-to-all: the busiest rank of an
    expert-parallel group sets the pace. ``moe_capacity_factor`` (None: dropless) prices a
    token-dropping MoE padded to capacity instead (Megatron's --moe-expert-capacity-factor with
    --moe-pad-expert-input-to-capacity): every expert's buffer holds capacity_factor × its
    balanced share, whatever the routing, so its GEMMs and the all-to-alls that fill and empty
    it (even splits of capacity rows per expert) move that multiple, as the memory option of
    that name holds (``routed_token_factor``). Without padding no more than that comes, but
    fewer may: an upper bound then, as on the memory side. ``moe_dispatcher`` is Megatron-Core's
    token dispatcher, as the memory option of that name: 'alltoall' sends the routed copies
    over the EP group and all-gathers them over expert TP; 'allgather' gathers every token of
    the etp x ep group and reduce-scatters the experts' output in fp32 (``layer.py``).

    TP overlap (``OverlapConfig.tp``) hides a pass's TP collectives under its GEMMs; of the
    backward's, those ``tp_overlap_backward`` names, the rest stays exposed. 'all' for
    Transformer Engine's userbuffers, which pipeline every one with its GEMM; 'all-gathers' for
    torch's async TP (Inductor's micro-pipeline pass, the ``pytorch`` runtime's fact): it fuses an
    all-gather with the matmuls that read its output and a reduce-scatter with the one matmul
    whose output it takes alone (``fuse_matmul_reduce_scatter`` leaves any other input unfused),
    so the forward's four collectives of a layer fuse, and of the backward's the two all-gathers
    of the output gradients, not the two reduce-scatters of the input gradients, each the sum of
    the q/k/v (or gate/up) projections' input gradients.

    ``fp8_tp_gather`` (torchtitan's float8 TP styles, the ``pytorch`` runtime's fact): under an
    fp8 compute dtype the sequence-parallel all-gathers move fp8, 1 byte an element, in both
    passes (torchao's PrepareFloat8ModuleInput casts a block's input before gathering it, and
    Float8RowwiseParallel casts the output gradient before its backward all-gather); the
    reduce-scatters stay at activation width.

    Routed experts' biases (gpt-oss): ``expert_bias_add`` says how the runtime adds them,
    memory-bound bytes per element of the expert projections' outputs that each way moves
    (``memory_ops.EXPERT_BIAS_BYTES``): 'fused' in the GEMM's epilogue (Transformer Engine's
    grouped linear; no bytes of its own), 'repeat' as torchtitan does (the bias repeated to
    every routed row, then added; the ``pytorch`` runtime's fact), 'split-cat' as NeMo
    AutoModel's DeepEP experts do (the output split per expert, each piece added to its bias,
    the pieces concatenated; the down projection's bias weighted by the fp32 routing
    probabilities first, so its sum and concatenation run in fp32). Counted op by op, not
    multiplied by ``elementwise_passes``. Attention sinks (gpt-oss) likewise: ``sink_rescale``
    'fused' in the kernel's softmax (cuDNN's learnable offset, Transformer Engine), 'bf16' where
    the output is rescaled by sigmoid(lse - sink) after the kernel in its own dtype (torchtitan;
    the ``pytorch`` runtime's fact), 'fp32' where the fp32 scale promotes that product and it is
    cast back (NeMo AutoModel's FlexAttention wrapper; ``memory_ops.SINK_RESCALE_BYTES``).
    Ring attention's merges too: ``ring_merge`` 'torch' (torch's context parallelism, the
    ``pytorch`` runtime's fact) merges each ring step's output into an fp32 running output and
    copies the keys, values and their fp32 gradients around every step
    (``memory_ops.ring_merge_bytes``); 'fused' leaves them unpriced (Transformer Engine
    corrects the output inside its own kernels). How the ring moves keys and values,
    ``ring_exchange`` (``layer.ring_exchange_seconds``): 'p2p' (Transformer Engine) sends K and V
    to the next rank at each step, the backward their gradients with them, each send under a
    step's attention; 'allgather' (torch's context parallelism with its default rotate method,
    ``_RotateMethod.ALL_GATHER``) all-gathers K and V as the model passes them (torchtitan
    repeats them to every query head) once a pass, under the first step's attention alone, and
    sends the fp32 gradients of K and V to the next rank after every step: each send hides under
    the next step's attention, the last one is waited for with nothing left to run.
    MLA's query and key: ``mla_assembly`` 'fused' (Megatron-Core's fused MLA RoPE kernels: the
    key and value written out of the up-projection's output in one pass, the query rotated in
    place) or 'cat' (torch.cat of the nope and rope parts, the rope key expanded to every head: NeMo AutoModel, torchtitan, the
    ``pytorch`` runtime's fact), ``memory_ops.mla_assembly_bytes``. ``qkv_transpose``: the
    runtime copies q, k and v into head-major layout before its attention kernel and the output
    back (NeMo AutoModel's sdpa and flex backends), ``memory_ops.qkv_transpose_bytes``.

    Hidden expert all-to-all still costs compute: its kernels hold ``ep_comm_compute_share`` of
    the GPU's SMs while they run, so the compute they hide under loses that share of the
    all-to-all's duration (an all-to-all of X seconds hidden under compute C takes
    C + X·share, not C). 0 where the SM budget is not sourced.

    So do hidden data-parallel collectives (gradient reduces, the distributed optimizer's and
    FSDP's gathers): NCCL runs one block per channel, each on an SM no compute kernel shares,
    and opens the fewest channels that reach the link's rate (NVIDIA/nccl#689, its maintainer:
    2 SMs for one NIC, 16 for a DGX's eight). ``dp_comm_compute_share`` is the share they hold
    at the scale-up rate; below it, in proportion (``topology.collective_sm_share``), so what a
    hidden collective costs goes with its bytes, not with how slow its link is.

    Optimizer: Adam's update is memory-bound, at ``hbm_bandwidth · optimizer_efficiency``
    (``hbm_efficiency`` when unset): its multi-tensor kernels reach less of the bandwidth than a
    bulk copy (on an H200 a 2 GiB copy ran at 0.87 of the datasheet rate, AdamW's update at
    0.49-0.72 and clip_grad_norm_ at 0.45). ``optimizer_kernel`` 'fused' is one pass (Apex/TE
    fused Adam, torch's fused=True); 'foreach' is torch.optim.AdamW(foreach=True), eight
    multi-tensor kernels that each read and write whole tensors (step.py counts their bytes).

    Weight-gradient accumulation: ``gradient_accumulation_fusion`` (Megatron's default, on) has
    the weight-gradient GEMM add its product into the gradient buffer in its epilogue (Transformer
    Engine's fuse_wgrad_accumulation; MindSpeed's npu_matmul_add_fp32 on Ascend): 2·g bytes a
    weight, g the buffer's width, inside the GEMM's roofline. Off (Megatron's
    --no-gradient-accumulation-fusion, which MindSpeed-LLM's example scripts pass), the GEMM
    writes the gradient in the activation dtype (a bytes a weight) and a kernel of its own adds
    it to the buffer (``param.main_grad.add_(param.grad)``: a + 2·g bytes a weight at the HBM
    rate, after the GEMM, every micro-batch). ``gradient_accumulation_rules`` 'megatron' (the
    megatron runtime's) prices so, with the fusion on, the strategies whose Megatron launch
    cannot fuse: torch FSDP2, and Megatron-FSDP beside expert data parallelism or on Ascend
    NPUs (``ndplan.perf.accumulation``, which the Megatron emitter reads too).

    FSDP's copies: ``fsdp_stream_copies`` (FSDP2, the ``pytorch`` runtime's fact) copies each
    gathered unit out of its all-gather buffer into the parameters (``split_with_sizes_copy``,
    2·g bytes an element, g the gather width) and each unsharded gradient into the
    reduce-scatter buffer, cast to the reduce dtype (``chunk_cat``, a + r bytes: the gradient's
    activation width and the reduce width), both on the compute stream (``foreach_all_gather_copy_out``
    waits for the gather there; ``foreach_reduce`` copies in before handing over to the
    reduce-scatter stream, so that the gradients can be freed): memory-bound seconds on the pass
    that gathers or reduces, which nothing hides. Megatron-FSDP gathers into the parameters'
    own buffers. (Under a pipeline that defers the reduce, the copies of its once-a-run gathers
    and reduces are not priced: a run's, against m micro-batches of compute.)

    FSDP's CPU offload: ``fsdp_cpu_offload`` (FSDP2's CPUOffloadPolicy, the ``pytorch`` runtime's
    fact, what its optimizer offload is under FSDP: torchtitan's training.enable_cpu_offload) keeps
    the sharded parameters and their gradients on the host beside the optimizer states: each
    gather first copies the unit's shard in over the host link, each reduce-scatter copies the
    gradient shard out, on FSDP's streams (``layer._fsdp_pass_seconds``), and the step is the CPU's
    Adam alone, its operands already there (``step._dp_raw``).

    FSDP under a pipeline: ``pipeline_defers_fsdp_reduce`` (torch.distributed.pipelining, the
    ``pytorch`` runtime's fact) runs every micro-batch's backward without gradient sync or
    resharding and reduces each chunk's gradients once, after its last backward
    (``perform_reduce_grad``, which makes the compute stream wait for the reduce): no reduce-scatter
    per micro-batch, one exposed per run; and parameters gathered for a run stay gathered until
    then, so without resharding after forward they are gathered once a run, not per micro-batch.

    Pipeline transfers: ``p2p_wait`` names the schedules whose compute waits for its own sends.
    '1f1b' (Megatron-Core): outside its interleaved schedule, whose overlap_p2p_comm
    (--no-overlap-p2p-communication unset) overlaps them, it batches each send with a receive
    (batch_p2p_comm) and synchronises the device after it (batch_p2p_sync, both defaults;
    megatron/core/pipeline_parallel/p2p_communication.py). '1f1b+interleaved'
    (torch.distributed.pipelining, the ``pytorch`` runtime's fact): Schedule1F1B waits for its
    fused sends and receives, and PipelineScheduleMulti, which ScheduleInterleaved1F1B ran on
    through 2025, for every time step's (``_wait_batch_p2p(_batch_p2p(ops))``); its lowered
    runtime (``_PipelineScheduleRuntime``: ZB-V, DualPipeV, and a later torch's Interleaved1F1B)
    and GPipe wait for their sends at the end of the step or phase. A waited send lasts a
    transfer on the sender's own timeline, and the receiver has its input when the send ends;
    elsewhere (``'none'``, and the schedules not named) the sender runs on and the transfer
    delays the receiver alone (``pipeline.py``, ``step._makespan``). ``pipeline_scatter_gather``:
    Megatron-LM before Megatron-Core (2020-22; scatter_gather_tensors_in_pipeline, on by default)
    sent, from a TP rank without sequence parallelism, 1/tp of the activation over its own link
    and all-gathered it over TP on the receiver (``step._p2p_seconds``); Megatron-Core sends
    every TP rank's whole copy.

    Gradient buckets (ZeRO 0-2, step.py): ``grad_buckets`` 'megatron' cuts the data-parallel
    reduce into buckets of max(40e6, 1e6·dp) parameters (Megatron-Core's default; the overlap's
    ``dp_bucket_params``, its --ddp-bucket-size, overrides) on the first pipeline stage and one
    bucket on later stages; 'ddp' is PyTorch DDP's ``bucket_cap_mb``, ``ddp_bucket_cap_mb`` MiB
    of gradients (25 in torch, 100 in torchtitan's ``replicate``). The last bucket's reduce is
    exposed: nothing of the backward is left to hide it.

    Host link (PCIe or equivalent): copies to and from pinned host memory move at
    ``host_link_bandwidth · host_link_efficiency`` per direction (activation and optimizer
    offload). 0.8 is an assumption, not a measurement: pinned copies reach about 80-85% of a
    PCIe link's raw rate on the platforms whose bandwidth tests we know of.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str = "generic"
    gemm_efficiency: Fraction
    gemm_knee: float = Field(default=256.0, gt=0.0, description="elements; below this the thin dimension is padded")
    fp8_gemm_efficiency: Fraction
    fp8_gemm_depth_knee: float = Field(default=0.0, ge=0.0, description="elements of the reduction dimension")
    gemm_depth_knee: float = Field(default=0.0, ge=0.0, description="elements of the reduction dimension")
    grouped_gemm_factor: float = Field(default=0.9, gt=0.0, le=1.0)
    expert_gemm: Literal["per-expert", "grouped"] = "per-expert"
    optimizer_kernel: Literal["fused", "foreach"] = "fused"
    pipeline_defers_fsdp_reduce: bool = False
    p2p_wait: Literal["1f1b", "1f1b+interleaved", "none"] = "1f1b"
    pipeline_scatter_gather: bool = False
    grad_buckets: Literal["megatron", "ddp"] = "megatron"
    ddp_bucket_cap_mb: float = Field(default=25.0, gt=0.0, description="MiB of gradients per PyTorch DDP bucket")
    optimizer_efficiency: Fraction | None = None
    attention_efficiency: Fraction
    masked_attention_efficiency: Fraction | None = None
    attention_call_s: float = Field(default=0.0, ge=0.0, description="fixed seconds of a layer's attention core, fwd+bwd")
    #: Gated DeltaNet's chunked delta rule (flash-linear-attention's Triton kernels), as a share of
    #: the bf16 peak over the FLOPs they execute (``flops.linear_core_flops``). Measured on an H200
    #: by Qwen's FlashQLA benchmark of fla 0.5.1 (benchmark/benchmark_results_H200.txt: 16 key and
    #: 32 value heads of 128, 32k tokens, forward 1.89 ms, backward 5.70 ms): 101 and 96 TFLOP/s,
    #: 0.10 of 989. Carried to every device unmeasured but this one; FlashInfer's H100 timing of
    #: the same forward (PR 3788) reads 1.15x slower.
    linear_attention_efficiency: Fraction = 0.1
    flash_attention: bool = True
    flex_attention: bool = False
    window_kernel: bool = True
    loss_upcast: bool = True
    loss_parallel: bool = True
    selective_recompute: Literal["megatron", "torchtitan-op", "keep-matmuls"] = "megatron"
    hbm_efficiency: Fraction
    scaleup_efficiency: Fraction
    scaleout_efficiency: Fraction
    scaleup_latency_s: float = Field(default=3e-6, ge=0.0)
    scaleout_latency_s: float = Field(default=10e-6, ge=0.0)
    scaleup_topology: Literal["switch", "mesh"] = "switch"
    fp8_cast_bytes: float = Field(default=4.0, ge=0.0, description="bytes per element to quantise a GEMM input")
    elementwise_passes: float = Field(default=1.0, ge=1.0)
    loss_elementwise_passes: float | None = Field(default=None, ge=1.0)
    host_layer_s: float = Field(default=0.3e-3, ge=0.0)
    host_moe_layer_s: float = Field(default=2.0e-3, ge=0.0)
    host_expert_s: float = Field(default=20e-6, ge=0.0, description="host seconds per local expert, forward")
    expert_gemm_latency_s: float = Field(default=5e-6, ge=0.0, description="GPU seconds per local expert per GEMM")
    layer_overhead_s: float = Field(default=20e-6, ge=0.0)
    step_overhead_s: float = Field(default=0.0, ge=0.0)
    moe_imbalance: float = Field(default=1.0, ge=1.0)
    moe_capacity_factor: float | None = Field(default=None, gt=0.0, le=1024.0,
                                              description="token dropping, padded to capacity (None: dropless)")
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    ep_comm_compute_share: float = Field(default=0.0, ge=0.0, lt=1.0,
                                         description="share of the SMs a hidden expert all-to-all holds")
    dp_comm_compute_share: float = Field(default=0.0, ge=0.0, lt=1.0,
                                         description="share of the SMs a hidden data-parallel collective holds")
    tp_overlap_backward: Literal["all", "all-gathers"] = "all"
    fsdp_stream_copies: bool = False
    fsdp_cpu_offload: bool = False
    gradient_accumulation_fusion: bool = True
    gradient_accumulation_rules: Literal["megatron"] | None = None
    ulysses_kv_repeat: Literal["needed", "always"] = "needed"
    fp8_tp_gather: bool = False
    expert_bias_add: Literal["fused", "repeat", "split-cat"] = "fused"
    sink_rescale: Literal["fused", "bf16", "fp32"] = "fused"
    ring_merge: Literal["fused", "torch"] = "fused"
    ring_exchange: Literal["p2p", "allgather"] = "p2p"
    mla_assembly: Literal["fused", "cat"] = "fused"
    fp8_gemm_kernel: Literal["default", "deepgemm"] = "default"
    qkv_transpose: bool = False
    cpu_optimizer_params_per_s: float = Field(default=2e9, gt=0.0, description="CPU Adam, for optimizer offload")
    host_link_efficiency: Fraction = Field(default=0.8, description="pinned host copies over the host link's raw rate")

    def figure(self, name: str) -> float:
        """A figure's value, where an unset one (None) takes the figure it defaults to
        (``UNSET_MEANS``: the optimizer's efficiency the HBM's, the masked kernel's the causal's)."""
        value = getattr(self, name)
        return float(value if value is not None else getattr(self, UNSET_MEANS[name]))

    @property
    def routed_token_factor(self) -> float:
        """Routed tokens on the busiest rank over balanced routing, which its expert GEMMs and
        all-to-alls move: the capacity factor where tokens are dropped and padded to capacity
        (every expert's buffer holds exactly that multiple of its share), else ``moe_imbalance``
        (``memory.options.MemoryOptions.routed_token_factor``, the same rule)."""
        return self.moe_capacity_factor if self.moe_capacity_factor is not None else self.moe_imbalance

    @property
    def fp8_gemm_rate_share(self) -> float:
        """fp8 GEMMs' share of the fp8 peak: ``DEEPGEMM_FP8_EFFICIENCY`` under ``fp8_gemm_kernel``
        'deepgemm' where the family has a figure, else ``fp8_gemm_efficiency``."""
        if self.fp8_gemm_kernel == "deepgemm" and self.family in DEEPGEMM_FP8_EFFICIENCY:
            return DEEPGEMM_FP8_EFFICIENCY[self.family]
        return self.fp8_gemm_efficiency

    @property
    def flex_share(self) -> float:
        """The attention core's speed over the family's flash kernel: ``FLEX_ATTENTION_SHARE`` under
        ``flex_attention`` where the family has a figure, else 1."""
        return FLEX_ATTENTION_SHARE.get(self.family, 1.0) if self.flex_attention else 1.0

    @property
    def expert_gemm_latency(self) -> float:
        """Seconds per local expert per routed-expert GEMM: 0 where one kernel runs them all."""
        return self.expert_gemm_latency_s if self.expert_gemm == "per-expert" else 0.0

    @property
    def host_expert(self) -> float:
        """Host seconds per local expert per forward: 0 where one kernel runs them all."""
        return self.host_expert_s if self.expert_gemm == "per-expert" else 0.0

    def replace(self, **changes: Any) -> EfficiencyProfile:
        """A copy with some figures changed (validated)."""
        try:
            return EfficiencyProfile.model_validate({**self.model_dump(), **changes})
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "?"
            raise NdplanError(f"invalid efficiency figure {field}={first.get('input')!r}: {first['msg']}") from None


#: DeepGEMM's fp8 GEMMs' share of the fp8 peak at the profiles' reference depth (R = 8192): its
#: README's H800 table (Feb 2025) of M = 4096 dense GEMMs at K = 512, 1536, 2048, 7168, 16384,
#: 590, 990, 1025, 1304 and 1358 TFLOP/s, each taken to R = 8192 through the hopper fp8 depth
#: knee (720: rate · (K + 720)/K · 8192/8912) gives 1305, 1337, 1273, 1319 and 1303, mean 1307 of
#: 1979 TFLOP/s; its grouped contiguous GEMMs at K = 7168 (1288-1297) give the same. No figure
#: for other families (there it is priced as ``fp8_gemm_efficiency``).
DEEPGEMM_FP8_EFFICIENCY: dict[str, float] = {
    "hopper": 0.66,
}

#: FlexAttention's speed over the flash kernel a family's ``attention_efficiency`` describes, its
#: forward and backward weighted by their FLOPs (1 : 2.5): 3.5 / (1/f + 2.5/b). Its developer's
#: averages (D. Guessous's GTC 2025 session, abstract in the PyTorch blog "PyTorch at GTC 2025"):
#: on A100 f = 90%, b = 85% of FlashAttention-2's speed; on H100 85% and 76% of FlashAttention-3's.
#: No figure for other families (there it is priced as the family's kernel).
FLEX_ATTENTION_SHARE: dict[str, float] = {
    "ampere": 3.5 / (1 / 0.90 + 2.5 / 0.85),
    "hopper": 3.5 / (1 / 0.85 + 2.5 / 0.76),
}

#: Optional figures and the figure an unset one takes (``EfficiencyProfile.figure``).
UNSET_MEANS = {"optimizer_efficiency": "hbm_efficiency", "masked_attention_efficiency": "attention_efficiency",
               "loss_elementwise_passes": "elementwise_passes"}

#: Fields that calibration may fit, with their bounds (all efficiencies are fractions).
FITTABLE: dict[str, tuple[float, float]] = {
    "optimizer_efficiency": (0.1, 1.0),
    "masked_attention_efficiency": (0.1, 1.0),
    "gemm_efficiency": (0.2, 1.0),
    "fp8_gemm_efficiency": (0.15, 1.0),
    "attention_efficiency": (0.1, 1.0),
    "linear_attention_efficiency": (0.02, 1.0),
    "hbm_efficiency": (0.2, 1.0),
    "scaleup_efficiency": (0.1, 1.0),
    "scaleout_efficiency": (0.1, 1.0),
    "layer_overhead_s": (0.0, 2e-3),
    "host_layer_s": (0.0, 5e-3),
    "host_moe_layer_s": (0.0, 20e-3),
    "grouped_gemm_factor": (0.05, 1.0),
    "gemm_depth_knee": (0.0, 4096.0),
    "fp8_gemm_depth_knee": (0.0, 4096.0),
    "host_expert_s": (0.0, 2e-4),
    "expert_gemm_latency_s": (0.0, 1e-4),
    "step_overhead_s": (0.0, 5.0),
    "host_link_efficiency": (0.2, 1.0),
    # the busiest expert-parallel rank's share of routed tokens over the balanced one, for runs
    # with real (not forced-balance) routing; 4 is past any table in docs/accuracy_time.md
    "moe_imbalance": (1.0, 4.0),
    # SMs held by hidden collectives: 0.5 would leave half the GPU to the compute they hide under
    "ep_comm_compute_share": (0.0, 0.5),
    "dp_comm_compute_share": (0.0, 0.5),
}

# Defaults, one per family. They are first-principles figures from public microbenchmarks,
# rounded; docs/time.md lists where each comes from and docs/accuracy_time.md how well the set
# predicts published end-to-end runs.
FAMILY_DEFAULTS: dict[str, EfficiencyProfile] = {
    # A100: cuBLAS bf16/fp16 large GEMMs reach 250-270 of 312 TFLOP/s; FlashAttention-2 fwd+bwd
    # ~60-70%; HBM2e copy ~1.6-1.7 of 2.0 TB/s; NCCL all-reduce bus bandwidth ~230 of 300 GB/s
    # NVLink3; ~22 of 25 GB/s per HDR NIC. Data-parallel collectives: 16 SMs (NCCL's maintainer,
    # NVIDIA/nccl#689, for a DGX of that generation at 190 GB/s, about NVLink3's effective rate).
    "ampere": EfficiencyProfile(
        family="ampere", gemm_efficiency=0.82, fp8_gemm_efficiency=0.82, attention_efficiency=0.6,
        hbm_efficiency=0.8, scaleup_efficiency=0.75, scaleout_efficiency=0.85, dp_comm_compute_share=16 / 108,
    ),
    # Reduction-depth knees, fitted to R/(R + knee) on published GEMM timings at fixed M, N:
    # fp8 720 from DeepGEMM's H800 table (README, Feb 2025: M = 4096 dense GEMMs at K = 512,
    # 1536, 2048, 7168, 16384 run at 590, 990, 1025, 1304, 1358 TFLOP/s; grouped contiguous
    # K = 2048 vs 7168: 1093-1099 vs 1288-1297); bf16 240 from OpenXLA's measured sm_90 GEMM
    # table (xla/service/gpu/model/matmul_interpolator_data.h: 2 x 4096x4096, K = 256, 512,
    # 1024, 4096 at 464, 608, 693, 808 TFLOP/s).
    # H100/H200: cuBLAS bf16 ~700-760 of 989 TFLOP/s; FP8 GEMMs in training (Transformer Engine,
    # per-tensor or 1x128 block scaling) run ~1.3-1.4x BF16, i.e. ~0.5 of the fp8 peak (isolated
    # large fp8 GEMMs reach more); FlashAttention-2/3 50-65% of bf16 peak; HBM3 ~2.8 of
    # 3.35 TB/s; NVLink4 all-reduce bus bandwidth ~360 of 450 GB/s; 400 Gb/s NDR ~45 of 50 GB/s.
    # Expert all-to-all SMs: DeepSeek-V3's report (arXiv 2412.19437, sec. 3.2.2) gives its
    # overlapped dispatch/combine kernels 20 of the H800's 132 SMs; DeepEP's and Megatron-Core's
    # default (--moe-deepep-num-sms) is the same 20. NCCL's all-to-all is taken to hold as many.
    # Data-parallel collectives: NCCL's 16 channels on an NVLink node (NCCL's log on an H800 node,
    # NVIDIA/nccl#892: "16 coll channels"; an H100 FSDP all-gather profiled at 24 blocks, NVIDIA
    # developer forum 337991), the low end taken.
    # Measured on an H200 (benchmarks/accuracy/cuda_probe.py, tests/data/measured/h200): cuDNN's
    # fused flash attention, which torch's SDPA and Transformer Engine both run, took
    # forward+backward FLOPs / (peak · 0.55) + 0.2 ms per call within 4% (causal, 4k-16k tokens,
    # 32-64 heads of 128): 0.42 of peak at 4k, 0.54 at 16k; given a sliding window as a boolean
    # mask (32 heads, 8k tokens) 0.31 over the whole square; AdamW's update and clip_grad_norm_
    # 0.45-0.72 of HBM, hence optimizer_efficiency 0.6.
    "hopper": EfficiencyProfile(
        family="hopper", gemm_efficiency=0.75, fp8_gemm_efficiency=0.5, attention_efficiency=0.55,
        attention_call_s=2e-4, masked_attention_efficiency=0.31,
        hbm_efficiency=0.8, scaleup_efficiency=0.8, scaleout_efficiency=0.85, optimizer_efficiency=0.6,
        gemm_depth_knee=240.0, fp8_gemm_depth_knee=720.0, ep_comm_compute_share=20 / 132,
        dp_comm_compute_share=16 / 132,
    ),
    # B200: cuBLAS bf16 ~1.6 of 2.25 PFLOP/s; FP8 in training ~1.35x BF16 (~0.5 of 4.5 PFLOP/s);
    # NVLink5 ~0.75-0.8 of link rate. Reduction-depth knees from OpenXLA's measured sm_100 GEMM
    # table (same file, 4096x4096 at K = 1024 and 4096): fp8 1,895 and 2,765 TFLOP/s -> 740,
    # bf16 1,076 and 1,417 -> 480. Data-parallel collectives: Hopper's 16 NCCL channels assumed
    # (no Blackwell channel count found).
    "blackwell": EfficiencyProfile(
        family="blackwell", gemm_efficiency=0.72, fp8_gemm_efficiency=0.5, attention_efficiency=0.55,
        hbm_efficiency=0.8, scaleup_efficiency=0.78, scaleout_efficiency=0.85,
        gemm_depth_knee=480.0, fp8_gemm_depth_knee=740.0, ep_comm_compute_share=20 / 148,  # the same 20 SMs of 148
        dp_comm_compute_share=16 / 148,
    ),
    # MI300X: hipBLASLt bf16 ~600-750 of 1307 TFLOP/s; xGMI full mesh.
    "cdna3": EfficiencyProfile(
        family="cdna3", gemm_efficiency=0.5, fp8_gemm_efficiency=0.45, attention_efficiency=0.35,
        hbm_efficiency=0.7, scaleup_efficiency=0.7, scaleout_efficiency=0.8, scaleup_topology="mesh",
    ),
    # MI350X/MI355X (CDNA4): no training measurement known; CDNA3's figures carried over. AMD's
    # own large FP8 GEMMs reach a similar share of the peak on both, a little more on CDNA4
    # (hipBLASLt: MI300X 1273 of 2615 TFLOP/s, 0.49, "Max-Achievable FLOPs" blog; MI355X ~2750-3130
    # of 5033, 0.55-0.62, "CDNA4 GEMM kernels" blog).
    "cdna4": EfficiencyProfile(
        family="cdna4", gemm_efficiency=0.5, fp8_gemm_efficiency=0.45, attention_efficiency=0.35,
        hbm_efficiency=0.7, scaleup_efficiency=0.7, scaleout_efficiency=0.8, scaleup_topology="mesh",
    ),
    # Ascend 910B: cube units ~65-75% on large GEMMs; HCCS full mesh of 8.
    "davinci-mesh": EfficiencyProfile(
        family="davinci-mesh", gemm_efficiency=0.7, fp8_gemm_efficiency=0.7, attention_efficiency=0.45,
        hbm_efficiency=0.7, scaleup_efficiency=0.7, scaleout_efficiency=0.8, scaleup_topology="mesh",
        scaleout_latency_s=15e-6,
    ),
    # Ascend 910C (CloudMatrix): the same dies on a switched UB fabric.
    "davinci-switch": EfficiencyProfile(
        family="davinci-switch", gemm_efficiency=0.7, fp8_gemm_efficiency=0.7, attention_efficiency=0.45,
        hbm_efficiency=0.7, scaleup_efficiency=0.7, scaleout_efficiency=0.8, scaleout_latency_s=15e-6,
    ),
    "generic": EfficiencyProfile(
        family="generic", gemm_efficiency=0.7, fp8_gemm_efficiency=0.6, attention_efficiency=0.5,
        hbm_efficiency=0.75, scaleup_efficiency=0.75, scaleout_efficiency=0.8,
    ),
}

# Device-name prefixes to families; the first match wins.
_FAMILY_OF_PREFIX: tuple[tuple[str, str], ...] = (
    ("a100", "ampere"), ("a800", "ampere"), ("a10", "ampere"),
    ("h100", "hopper"), ("h200", "hopper"), ("h800", "hopper"), ("h20", "hopper"), ("gh200", "hopper"),
    ("b200", "blackwell"), ("b300", "blackwell"), ("gb200", "blackwell"), ("gb300", "blackwell"),
    ("mi300", "cdna3"), ("mi325", "cdna3"), ("mi350", "cdna4"), ("mi355", "cdna4"),
    ("ascend-910c", "davinci-switch"), ("ascend-910b", "davinci-mesh"), ("ascend", "davinci-mesh"),
)


def device_family(device: Device) -> str:
    name = device.name.lower()
    for prefix, family in _FAMILY_OF_PREFIX:
        if name.startswith(prefix):
            return family
    return "generic"


def default_efficiency(device: Device) -> EfficiencyProfile:
    """The family profile of ``device`` (generic for unknown names), with the figures the
    device states in its ``efficiency`` (a calibrated profile, or a device YAML's mapping)."""
    family = device_family(device)
    if not device.efficiency:
        return FAMILY_DEFAULTS[family]
    figures = tuple(sorted(device.efficiency.items()))
    try:
        hash(figures)
    except TypeError:  # a value no figure takes (a list, a mapping): validation names it, uncached
        return _stated.__wrapped__(device.name, family, figures)
    return _stated(device.name, family, figures)


@lru_cache(maxsize=64)
def _stated(device: str, family: str, figures: tuple[tuple[str, Any], ...]) -> EfficiencyProfile:
    try:
        return EfficiencyProfile.model_validate({**FAMILY_DEFAULTS[family].model_dump(), **dict(figures)})
    except ValidationError as error:
        raise NdplanError(f"device {device}: efficiency {_figure_error(error)}") from None


def _figure_error(error: ValidationError) -> str:
    """"field 'NAME': why" of a profile's first invalid figure; a misspelt one is named with the
    figure meant and every known figure (pydantic's words were "Extra inputs are not permitted")."""
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"])
    if first["type"] != "extra_forbidden":
        return f"field '{field}': {first['msg']}"
    import difflib

    known = list(EfficiencyProfile.model_fields)
    # a shortened name ('gemm_eff') is the figure it starts; else the closest spelling
    close = [name for name in known if name.startswith(field)][:1] or difflib.get_close_matches(field, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"field '{field}': unknown efficiency figure{hint}; known: {', '.join(known)}"


def device_with_efficiency(device: Device, path: str | Path) -> Device:
    """``device`` with the efficiency profile in ``path`` (``ndplan calibrate``'s output, or
    any profile YAML/JSON: figures it omits keep the device family's)."""
    base = default_efficiency(device)
    profile = load_efficiency(path, base=base)
    if profile.family != base.family:
        # Figures fitted on another family's kernels and links price this one wrongly, silently.
        raise NdplanError(f"{path}: a profile of the {profile.family} family, and {device.name} is {base.family}: "
                          f"calibrate on runs of {base.family} devices, or set 'family: {base.family}' in the "
                          "profile to apply its figures anyway")
    return device.model_copy(update={"efficiency": profile.model_dump()})


def load_efficiency(path: str | Path, base: EfficiencyProfile | None = None) -> EfficiencyProfile:
    """Read a YAML/JSON profile; fields it omits come from ``base`` (or the generic profile).

    Raises NdplanError naming the file and the field on any problem.
    """
    source = str(path)
    try:
        data = parse_nested(yaml.safe_load, read_text(path), source, "YAML/JSON")
    except OSError as exc:
        raise NdplanError(f"{source}: cannot read efficiency profile ({exc.strerror or exc})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise NdplanError(f"{source}{line}: malformed YAML/JSON efficiency profile ({problem})") from None
    if isinstance(data, dict) and "efficiency" in data and isinstance(data["efficiency"], dict):
        data = data["efficiency"]
    if not isinstance(data, dict):
        raise NdplanError(f"{source}: an efficiency profile is a mapping of figure names to numbers")
    merged = {**(base or FAMILY_DEFAULTS["generic"]).model_dump(), **data}
    try:
        return EfficiencyProfile.model_validate(merged)
    except ValidationError as error:
        raise NdplanError(f"{source}: {_figure_error(error)}") from None


def dump_efficiency(profile: EfficiencyProfile, path: str | Path, comment: str = "") -> None:
    """Write ``profile`` as YAML (with an optional leading comment block)."""
    header = "".join(f"# {line}\n" for line in comment.splitlines()) if comment else ""
    body = yaml.safe_dump({"efficiency": profile.model_dump()}, sort_keys=False)
    Path(path).write_text(header + body, encoding="utf-8")


def waits_for_sends(p2p_wait: str, schedule: str) -> bool:
    """Whether ``schedule``'s compute waits for its own pipeline sends under ``p2p_wait``
    (``EfficiencyProfile.p2p_wait``)."""
    return schedule in p2p_wait.split("+")


#: The figures that describe the software rather than the device: what a runtime states of itself.
#: ``attention_efficiency`` is one where the software picks another attention kernel than the
#: family's default assumes (torch's SDPA ran FlashAttention-2 on Hopper before cuDNN's kernel
#: became its choice there: 0.33 of the peak forward, 0.30 forward and backward, against cuDNN's 0.55).
SOFTWARE_FIELDS = ("selective_recompute", "flash_attention", "flex_attention", "window_kernel", "moe_imbalance", "moe_capacity_factor",
                   "moe_dispatcher",
                   "elementwise_passes", "loss_elementwise_passes", "expert_gemm", "optimizer_kernel", "fp8_cast_bytes",
                   "pipeline_defers_fsdp_reduce", "p2p_wait", "pipeline_scatter_gather", "grad_buckets", "ddp_bucket_cap_mb", "loss_upcast", "loss_parallel", "attention_efficiency",
                   "tp_overlap_backward", "fsdp_stream_copies", "fsdp_cpu_offload", "gradient_accumulation_fusion",
                   "gradient_accumulation_rules", "ulysses_kv_repeat", "fp8_tp_gather", "expert_bias_add",
                   "sink_rescale", "ring_merge", "ring_exchange", "mla_assembly", "qkv_transpose",
                   "fp8_gemm_kernel")


def with_software(efficiency: EfficiencyProfile, software: Mapping[str, Any] | None) -> EfficiencyProfile:
    """``efficiency`` with the runtime's facts (``SOFTWARE_FIELDS``: its selective recompute
    policy, whether its attention is flash, the busiest rank's routed tokens where the user
    states them; None: as it is). Each is stated once where the runtime is (its memory profile,
    the attention and MoE options), so that memory and time price the same re-runs, the same
    kernels and the same busiest rank."""
    if software is not None and not isinstance(software, Mapping):
        raise NdplanError(f"software must be a mapping of {', '.join(SOFTWARE_FIELDS)} to values (or None), "
                          f"got {type(software).__name__}")
    if not software:
        return efficiency
    unknown = sorted(set(software) - set(SOFTWARE_FIELDS))
    if unknown:
        raise NdplanError(f"software fact '{unknown[0]}' is not one of {', '.join(SOFTWARE_FIELDS)}")
    changed = {k: v for k, v in software.items() if getattr(efficiency, k) != v}
    return efficiency.replace(**changed) if changed else efficiency
