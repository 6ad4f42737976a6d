"""Measure one real training step on this machine's GPU: ``torch.cuda.max_memory_allocated``.

``measure_step`` (fake tensors) sees every tensor PyTorch allocates but nothing a CUDA kernel
takes besides its outputs, and no allocator. This runs the same depth-trimmed transformers model
for real, on one CUDA device, and reads the caching allocator's own counters:

* ``params``: allocated after the model is built on the device (parameters and buffers);
* ``optimizer``: what one AdamW warm-up step (zero gradients) added: its states;
* ``activations``: allocated after the first micro-batch's forward, less what was there before it
  (the tensors forward keeps for backward, and the loss);
* ``grads``: allocated after the last backward, less what was there before the first forward;
* ``transient``: the forward/backward peak less all of the above (cuBLAS and attention workspaces,
  backward temporaries), as ``measure_step`` defines it;
* ``optimizer_step``: the optimizer step's peak less the parameters, gradients and optimizer
  states (its temporaries, and the math libraries' workspace, allocated since the first matmul);
* ``reserved_bytes``: ``torch.cuda.max_memory_reserved`` over the measured steps (the allocator's
  segments, fragmentation included), which ``ndplan verify`` compares with the estimate's
  reserved bytes.

Two steps run after the warm-up and the second is reported (its reserved peak is the larger of the
two: the allocator's segments settle in the first). Only what one device can run is measured:
no data, tensor or pipeline parallelism (``measure_step`` measures those on fake tensors). Run it
in a fresh process: a process that ran other work on the GPU keeps workspaces and cached
segments that would count here.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ndplan.census.measure_step import (
    _param_groups,
    _warm_up_optimizer,
    _wrap_recompute,
    check_selective_policy,
    checked_step_config,
    step_model_name,
)
from ndplan.census.measurement import RankMemory, StepMeasurement
from ndplan.errors import NdplanError
from ndplan.strategy import Strategy

#: Precisions one device runs without FSDP.
CUDA_PRECISIONS = ("bf16-pure", "fp32")

#: Measured steps after the warm-up; the last one is reported.
STEPS = 2


def check_single_device(strategy: Strategy) -> None:
    """Refuse what one GPU cannot run: any parallelism, or FSDP's mixed precision."""
    s = strategy
    problems = [f"{name}={value}" for name, value in (("dp", s.dp), ("tp", s.tp), ("pp", s.pp), ("vpp", s.vpp))
                if value > 1]
    if s.zero:
        problems.append(f"zero={s.zero}")
    if problems:
        raise NdplanError(f"measure --backend cuda runs one GPU: {', '.join(problems)} needs --backend fake "
                          "(or measure on a cluster and pass the file to verify --measured)")
    if s.precision.name not in CUDA_PRECISIONS:
        raise NdplanError(f"measure --backend cuda: precision must be one of {', '.join(CUDA_PRECISIONS)}, "
                          f"got {s.precision.name!r}")


def measure_step_cuda(
    hf_config: dict[str, Any],
    strategy: Strategy,
    *,
    num_layers: int,
    attention: str = "sdpa",
    experts: str = "grouped_mm",
    name: str | None = None,
    seed: int = 0,
    selective_policy: str | None = None,
) -> StepMeasurement:
    """Run ``STEPS`` training steps of ``hf_config`` trimmed to ``num_layers`` decoder layers on
    ``cuda:0`` and report the last one's memory, in bytes, by the categories of the module doc
    (``selective_policy`` as ``measure_step`` takes it)."""
    from ndplan.census.measure import _require_torch

    check_selective_policy(strategy, selective_policy)
    cfg = checked_step_config(hf_config, strategy, num_layers, attention, experts)
    check_single_device(strategy)
    torch, transformers = _require_torch()
    if not torch.cuda.is_available():
        raise NdplanError("measure --backend cuda: PyTorch sees no CUDA device here (use --backend fake)")
    t0 = time.perf_counter()
    try:
        rank = _run(torch, cfg, strategy, attention, experts, seed, selective_policy=selective_policy)
    except NdplanError:
        raise
    except torch.cuda.OutOfMemoryError as error:
        raise NdplanError(f"measure --backend cuda: out of memory on {torch.cuda.get_device_name()}: "
                          f"{str(error).splitlines()[0]}") from None
    except Exception as error:  # a modeling path this PyTorch or transformers cannot run
        msg = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise NdplanError(f"measure --backend cuda failed: {type(error).__name__}: {msg}") from error
    elapsed = time.perf_counter() - t0
    return StepMeasurement(
        model=step_model_name(hf_config, name),
        strategy=strategy,
        ranks=(rank,),
        num_layers=num_layers,
        attention=attention,
        source="ndplan measure --backend cuda: a real step on one GPU, torch.cuda.max_memory_allocated/reserved",
        notes=(f"measurement took {elapsed:.1f} s", f"step {STEPS} of {STEPS} after an optimizer warm-up"),
        provenance={
            "experts": experts,
            "device": f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})",
            "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "torch_version": str(torch.__version__),
            "transformers_version": str(transformers.__version__),
            **({"selective_policy": selective_policy} if selective_policy else {}),
        },
    )


def _build(torch: Any, cfg: dict[str, Any], attention: str, experts: str, dtype: Any, device: str) -> Any:
    """The trimmed model on ``device``, initialised as transformers initialises it, in ``dtype``
    (parameters transformers keeps in fp32 stay fp32)."""
    from ndplan.census import _engine as E

    config = E.make_config(cfg, attention=attention, experts=experts)
    model = E.build_meta_model(config)
    fp32 = E.keep_fp32_patterns(model, dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # also recomputes the rotary buffers to_empty left uninitialised
        for param_name, param in model.named_parameters():
            if param.is_floating_point() and not any(pat in param_name for pat in fp32):
                param.data = param.data.to(dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.train()
    return model


def _run(torch: Any, cfg: dict[str, Any], s: Strategy, attention: str, experts: str, seed: int,
         device: str = "cuda", counters: Any = None, selective_policy: str | None = None) -> RankMemory:
    """The measurement; ``device`` and ``counters`` (``torch.cuda``'s memory functions) are
    parameters so that a test runs the same steps on CPU with counters of its own
    (tests/test_measure_step.py: they agree with the fake-tensor step to a few bytes)."""
    from ndplan.census import _engine as E
    from ndplan.census.measure_step import _layers, _param_dtype

    cuda = counters if counters is not None else torch.cuda
    torch.manual_seed(seed)
    model = _build(torch, cfg, attention, experts, _param_dtype(torch, s), device)
    _wrap_recompute(model, range(len(_layers(model))), s.recompute, E, selective_policy)
    cuda.synchronize()
    cuda.empty_cache()  # the build's fp32 staging is freed: not part of a training step's segments
    params_bytes = cuda.memory_allocated()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(_param_groups(params), lr=1e-4, foreach=True)
    _warm_up_optimizer(torch, params, optimizer)
    cuda.synchronize()
    optimizer_bytes = cuda.memory_allocated() - params_bytes
    cuda.empty_cache()

    b, seq, m = s.micro_batch_size, s.seq_length, s.num_micro_batches
    vocab = int(model.config.vocab_size)
    reserved = forward_backward_peak = step_peak = grads = activations = 0
    for _ in range(STEPS):  # the figures of the last step are reported, reserved of all
        cuda.reset_peak_memory_stats()
        before = cuda.memory_allocated()
        for micro in range(m):
            # Random tokens route MoE tokens as real text would, spread over the experts.
            ids = torch.randint(0, vocab, (b, seq), device=device)
            loss = model(input_ids=ids, labels=ids).loss
            if micro == 0:
                cuda.synchronize()
                activations = cuda.memory_allocated() - before
            loss.backward()
            del loss, ids
        cuda.synchronize()
        forward_backward_peak = cuda.max_memory_allocated()
        grads = cuda.memory_allocated() - before
        reserved = max(reserved, cuda.max_memory_reserved())
        cuda.reset_peak_memory_stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cuda.synchronize()
        step_peak = cuda.max_memory_allocated()
        reserved = max(reserved, cuda.max_memory_reserved())

    categories = {
        "params": params_bytes,
        "grads": grads,
        "optimizer": optimizer_bytes,
        "activations": activations,
        "comm": 0,
        "transient": forward_backward_peak - params_bytes - optimizer_bytes - grads - activations,
        # All of the step's peak beyond the static state, as the estimator's optimizer_step (the
        # math libraries' workspace included: it is allocated before the step and stays).
        "optimizer_step": step_peak - params_bytes - optimizer_bytes - grads,
    }
    return RankMemory(
        stage=0,
        rank=0,
        allocated_bytes=max(forward_backward_peak, step_peak),
        reserved_bytes=reserved,
        layers=int(cfg["num_hidden_layers"]),
        virtual_stages=(0,),
        forward_backward_peak_bytes=forward_backward_peak,
        optimizer_step_peak_bytes=step_peak,
        categories=categories,
    )


__all__ = ["CUDA_PRECISIONS", "check_single_device", "measure_step_cuda"]
