"""Kernels, training steps and the allocator's record on one GPU, for the time model and the
memory estimate (run where CUDA is):

* ``gemm``: seconds of bf16 GEMMs (torch.matmul) and of grouped expert GEMMs
  (torch._grouped_mm) over shapes of the preset models, each pass (F: X·W, B: dY·Wᵀ,
  W: Xᵀ·dY) timed in CUDA graphs (no host dispatch), the median of 10 replays.
* ``attention``: torch's SDPA forward and forward+backward as transformers calls it.
* ``bandwidth``: a bulk copy, a foreach add, AdamW's step (foreach and fused), clip_grad_norm_.
* ``times``: seconds of real one-GPU training steps (the model ``ndplan measure --backend cuda``
  builds), forward+backward and the optimizer step apart, median of 3 after 2 warm-up steps.
* ``profile``: kernel seconds of four of those steps by kind (GEMM, attention, other).
* ``history``: the allocator's record (torch.cuda.memory._record_memory_history) of one
  forward+backward of a case, the live blocks at its peak grouped by the Python line that
  allocated them, and every large allocation with the op that made it.

tests/data/measured/h200 keeps the results; benchmarks/accuracy/h200_time.py compares the time
model with them (tests/test_perf_measured_h200.py).

    python benchmarks/accuracy/cuda_probe.py --out DIR [gemm] [times [--only STEP ...]] [attention]
        [bandwidth] [profile] [history]

Each writes ``DIR/<name>.json`` (``history-<case>.txt``), rewritten after each item so that a run
cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

#: Dense shapes (m tokens, n outputs, k inputs): Llama-3.1-8B's projections at 4096 tokens, a
#: depth sweep at 8192², a thin-token sweep, and a 70B-like wide GEMM.
DENSE: list[tuple[int, int, int]] = [
    (4096, 6144, 4096), (4096, 4096, 4096), (4096, 28672, 4096), (4096, 4096, 14336),
    (8192, 8192, 8192), (16384, 8192, 8192), (8192, 1024, 8192), (4096, 2048, 2048), (4096, 1024, 1024),
    *((8192, 8192, k) for k in (256, 512, 1024, 2048, 4096, 16384)),
    *((m, 8192, 8192) for m in (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096)),
    *((m, 4096, 4096) for m in (128, 256, 512, 1024, 2048)),
]
#: Grouped expert GEMMs (experts, tokens per expert, n, k): Qwen3-30B-A3B (h 2048, f 768) with
#: 16 and 128 local experts, DeepSeek-V3-like (h 7168, f 2048) with 8 and 32, Mixtral (h 4096, f
#: 14336) with 8; gate+up (n = 2f) and down (k = f) projections.
GROUPED: list[tuple[int, int, int, int]] = [
    (e, t, n, k)
    for e, t in ((16, 256), (16, 1024), (16, 4096), (128, 256), (128, 1024))
    for n, k in ((1536, 2048), (2048, 768))
] + [
    (e, t, n, k)
    for e, t in ((8, 512), (8, 2048), (32, 512), (32, 2048))
    for n, k in ((4096, 7168), (7168, 2048))
] + [(8, 2048, 28672, 4096), (8, 2048, 4096, 14336)] + [
    (e, 512, 1536, 2048) for e in (1, 2, 4, 64)  # the cost per expert at a fixed per-expert shape
] + [(e, 64, 1536, 2048) for e in (16, 128)]

#: name -> (preset, layers, strategy settings): whole models as deep as one H200 holds.
TIMED: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama8b-32l-s4k-full": ("llama-3.1-8b", 32, {"seq_length": 4096, "recompute": "full"}),
    "llama8b-32l-s4k-sel": ("llama-3.1-8b", 32, {"seq_length": 4096, "recompute": "selective"}),
    "llama8b-32l-s4k": ("llama-3.1-8b", 32, {"seq_length": 4096}),
    "llama8b-16l-s8k-m2": ("llama-3.1-8b", 16, {"seq_length": 8192, "num_micro_batches": 2}),
    "qwen3-8b-36l-s4k-full": ("qwen3-8b", 36, {"seq_length": 4096, "recompute": "full"}),
    "mistral-32l-s8k-sel": ("mistral-7b", 32, {"seq_length": 8192, "recompute": "selective"}),
    "qwen3-moe-12l-s4k-full": ("qwen3-30b-a3b", 12, {"seq_length": 4096, "recompute": "full"}),
    "dsv2-lite-12l-s4k-full": ("deepseek-v2-lite", 12, {"seq_length": 4096, "recompute": "full"}),
    "qwen3-moe-8l-s4k-mbs2": ("qwen3-30b-a3b", 8, {"seq_length": 4096, "micro_batch_size": 2}),
    "llama8b-16l-s16k-full": ("llama-3.1-8b", 16, {"seq_length": 16384, "recompute": "full"}),
    "llama8b-32l-s2k-mbs4-sel": ("llama-3.1-8b", 32, {"seq_length": 2048, "micro_batch_size": 4,
                                                      "recompute": "selective"}),
    "qwen3-8b-36l-s8k-sel": ("qwen3-8b", 36, {"seq_length": 8192, "recompute": "selective"}),
    "mistral-32l-s4k": ("mistral-7b", 32, {"seq_length": 4096}),
    "qwen3-moe-12l-s8k-full": ("qwen3-30b-a3b", 12, {"seq_length": 8192, "recompute": "full"}),
    "dsv2-lite-16l-s4k-mbs2-full": ("deepseek-v2-lite", 16, {"seq_length": 4096, "micro_batch_size": 2,
                                                             "recompute": "full"}),
    "llama8b-8l-s4k-m4": ("llama-3.1-8b", 8, {"seq_length": 4096, "num_micro_batches": 4}),
}
#: The steps measured after the time model's figures were chosen (``held_out`` in times.json).
HELD_OUT = ("llama8b-16l-s16k-full", "llama8b-32l-s2k-mbs4-sel", "qwen3-8b-36l-s8k-sel", "mistral-32l-s4k",
            "qwen3-moe-12l-s8k-full", "dsv2-lite-16l-s4k-mbs2-full", "llama8b-8l-s4k-m4")
#: name -> (preset, layers, strategy settings, attention) of the allocator records.
HISTORY_CASES: dict[str, tuple[str, int, dict[str, Any], str]] = {
    "fp32-gqa": ("llama-3.1-8b", 2, {"seq_length": 4096, "precision": "fp32"}, "sdpa"),
    "eager": ("llama-3.1-8b", 2, {"seq_length": 4096}, "eager"),
}


def _events_median(fn: Any, *args: Any, repeats: int = 10, calls: int = 10, **kwargs: Any) -> float:
    """Median GPU seconds of one ``fn(*args, **kwargs)``: ``calls`` calls captured in a CUDA graph,
    replayed ``repeats`` times between CUDA events. The graph takes the host's dispatch (~20 us a
    call through Python) out of the figure: a small GEMM timed eagerly measures the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(3):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args, **kwargs)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def _write(out: Path, name: str, doc: Any) -> None:
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def _device() -> dict[str, str]:
    return {"device": torch.cuda.get_device_name(), "cuda": str(torch.version.cuda), "torch": str(torch.__version__)}


def gemm(out: Path) -> None:
    bf16 = torch.bfloat16
    rows: list[dict[str, Any]] = []
    doc = {**_device(), "dtype": "bf16", "method": "10 calls in a CUDA graph, median of 10 replays timed with CUDA events", "dense": rows,
           "grouped": []}
    for m, n, k in DENSE:
        x = torch.randn(m, k, device="cuda", dtype=bf16)
        w = torch.randn(k, n, device="cuda", dtype=bf16)
        dy = torch.randn(m, n, device="cuda", dtype=bf16)
        row: dict[str, Any] = {"m": m, "n": n, "k": k}
        row["F"] = _events_median(torch.matmul, x, w)
        row["B"] = _events_median(torch.matmul, dy, w.t())
        row["W"] = _events_median(torch.matmul, x.t(), dy)
        rows.append(row)
        print(f"dense {m}x{n}x{k}: " + " ".join(f"{p} {row[p] * 1e6:.0f}us {2 * m * n * k / row[p] / 1e12:.0f}TF"
                                               for p in "FBW"), flush=True)
        _write(out, "gemm", doc)
    grouped = doc["grouped"]
    for e, t, n, k in GROUPED:
        x = torch.randn(e * t, k, device="cuda", dtype=bf16)
        w = torch.randn(e, k, n, device="cuda", dtype=bf16)
        w_t = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # the layout transformers keeps: [e, n, k]ᵀ
        dy = torch.randn(e * t, n, device="cuda", dtype=bf16)
        offs = torch.arange(t, e * t + 1, t, device="cuda", dtype=torch.int32)
        row = {"experts": e, "tokens_per_expert": t, "n": n, "k": k}
        try:
            row["F"] = _events_median(torch._grouped_mm, x, w_t, offs=offs)
            row["B"] = _events_median(torch._grouped_mm, dy, w_t.transpose(-2, -1), offs=offs)
            row["W"] = _events_median(torch._grouped_mm, x.t(), dy, offs=offs)
        except Exception as error:  # a torch without grouped GEMMs for this layout
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        grouped.append(row)
        print(f"grouped {e}x{t} {n}x{k}: " + " ".join(
            f"{p} {row[p] * 1e6:.0f}us {2 * e * t * n * k / row[p] / 1e12:.0f}TF" for p in "FBW" if p in row)
            + row.get("error", ""), flush=True)
        _write(out, "gemm", doc)


def _eager_median(fn: Any, repeats: int = 10) -> float:
    """Median seconds of ``fn()`` between CUDA events, after 3 warm-ups (kernels of a millisecond
    or more, where the host's dispatch is hidden)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


#: (name, batch, query heads, kv heads, seq, qk head dim, v head dim, sliding window or 0)
ATTENTION: list[tuple[str, int, int, int, int, int, int, int]] = [
    *((f"llama8b-s{s // 1024}k", 1, 32, 8, s, 128, 128, 0) for s in (2048, 4096, 8192, 16384)),
    ("llama70b-s4k", 1, 64, 8, 4096, 128, 128, 0),
    ("qwen3-moe-s4k", 1, 32, 4, 4096, 128, 128, 0),
    ("llama8b-s4k-mbs2", 2, 32, 8, 4096, 128, 128, 0),
    ("mla-lite-s4k", 1, 16, 16, 4096, 192, 128, 0),
    ("mistral-s8k-window", 1, 32, 8, 8192, 128, 128, 4096),
]


def attention(out: Path) -> None:
    """transformers' SDPA calls: causal with enable_gqa (no mask), or, for a sliding window at
    seq >= window, K/V repeated to every head and an explicit boolean mask."""
    import torch.nn.functional as F

    rows: list[dict[str, Any]] = []
    doc = {**_device(), "dtype": "bf16", "method": "torch SDPA as transformers calls it, CUDA events, median of 10",
           "cases": rows}
    for name, b, hq, hkv, s, dqk, dv, window in ATTENTION:
        q = torch.randn(b, hq, s, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, s, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, s, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if window:
            i = torch.arange(s, device="cuda")
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)

            def call(q: Any = q, k: Any = k, v: Any = v, mask: Any = mask, rep: int = hq // hkv) -> Any:
                return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                      attn_mask=mask)
        else:
            def call(q: Any = q, k: Any = k, v: Any = v, gqa: bool = hq != hkv) -> Any:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        grad = torch.randn(b, hq, s, dv, device="cuda", dtype=torch.bfloat16)
        row: dict[str, Any] = {"name": name, "batch": b, "heads": hq, "kv_heads": hkv, "seq": s, "qk_dim": dqk,
                               "v_dim": dv, "window": window}
        try:
            with torch.no_grad():
                row["forward_s"] = _eager_median(call)
            row["forward_backward_s"] = _eager_median(lambda call=call, grad=grad: call().backward(grad))
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        rows.append(row)
        print("attention", row, flush=True)
        _write(out, "attention", doc)


def bandwidth(out: Path) -> None:
    """HBM: a 2 GiB copy, a foreach add over 64 tensors, and AdamW's step (foreach and fused) and
    clip_grad_norm_ over 0.8 B bf16 parameters in 100 tensors."""
    doc: dict[str, Any] = {**_device(), "method": "CUDA events, median of 10"}
    x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    doc["copy_bytes"] = 2 * x.numel() * 2
    doc["copy_s"] = _eager_median(lambda: y.copy_(x))
    tensors = [torch.zeros(2**24, device="cuda", dtype=torch.bfloat16) for _ in range(64)]
    doc["foreach_add_bytes"] = 2 * 64 * 2**24 * 2
    doc["foreach_add_s"] = _eager_median(lambda: torch._foreach_add_(tensors, 1.0))
    print("bandwidth", doc, flush=True)
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        params = [torch.nn.Parameter(torch.randn(8 * 2**20, device="cuda", dtype=dtype)) for _ in range(100)]
        for p in params:
            p.grad = torch.randn_like(p)
        doc[f"{label}_params"] = sum(p.numel() for p in params)
        for impl in ("foreach", "fused"):
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **{impl: True})
            opt.step()
            doc[f"{label}_adamw_{impl}_s"] = _eager_median(opt.step)
            del opt
        doc[f"{label}_clip_grad_norm_s"] = _eager_median(lambda params=params: torch.nn.utils.clip_grad_norm_(params, 1.0))
        del params
        torch.cuda.empty_cache()
        print("bandwidth", doc, flush=True)
        _write(out, "bandwidth", doc)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    if any(key in low for key in ("flash", "fmha", "attention", "cutlass::kernel<pytorch_flash")):
        return "attention"
    if any(key in low for key in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "grouped")):
        return "gemm"
    if any(key in low for key in ("nccl",)):
        return "comm"
    return "other"


def profile(out: Path) -> None:
    """Kernel time of one training step by kind (torch.profiler), against the step's wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    doc: dict[str, Any] = {**_device(), "cases": []}
    for name in ("llama8b-32l-s4k", "qwen3-moe-12l-s4k-full", "mistral-32l-s8k-sel", "dsv2-lite-12l-s4k-full"):
        preset, layers, settings = TIMED[name]
        s, model, optimizer, _ = _setup(preset, layers, settings)
        for _ in range(2):
            _forward_backward(s, model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            _forward_backward(s, model)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kinds: dict[str, float] = {}
        kernels: dict[str, list[float]] = {}
        for event in prof.events():
            if str(getattr(event, "device_type", "")).endswith("CUDA") and event.device_time_total:
                seconds = event.device_time_total / 1e6
                kinds[_kernel_kind(event.name)] = kinds.get(_kernel_kind(event.name), 0.0) + seconds
                entry = kernels.setdefault(event.name[:120], [0.0, 0])
                entry[0] += seconds
                entry[1] += 1
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
        row = {"name": name, "forward_backward_wall_s": wall, "kernel_s_by_kind": kinds,
               "kernel_s": sum(kinds.values()),
               "top_kernels": [{"name": k, "seconds": v[0], "count": v[1]} for k, v in top]}
        doc["cases"].append(row)
        print("profile", name, f"wall {wall:.3f}", {k: round(v, 4) for k, v in kinds.items()}, flush=True)
        for k, v in top[:12]:
            print(f"   {v[0] * 1e3:8.2f} ms x{v[1]:<5} {k}", flush=True)
        del model, optimizer, prof
        torch.cuda.empty_cache()
        _write(out, "profile", doc)


def _strategy(settings: dict[str, Any]) -> Any:
    from ndplan.strategy import Strategy

    return Strategy(**{"precision": "bf16-pure", **settings})


def _setup(preset: str, layers: int, settings: dict[str, Any],
           attention: str = "sdpa") -> tuple[Any, Any, Any, list[Any]]:
    from ndplan.census import _engine as E
    from ndplan.census.measure import load_hf_config
    from ndplan.census.measure_cuda import _build
    from ndplan.census.measure_step import (
        _param_dtype,
        _param_groups,
        _warm_up_optimizer,
        _wrap_recompute,
        checked_step_config,
    )

    s = _strategy(settings)
    _, hf = load_hf_config(preset)
    cfg = checked_step_config(hf, s, layers, attention, "grouped_mm")
    torch.manual_seed(0)
    model = _build(torch, cfg, attention, "grouped_mm", _param_dtype(torch, s), "cuda")
    _wrap_recompute(model, range(layers), s.recompute, E)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(_param_groups(params), lr=1e-4, foreach=True)
    _warm_up_optimizer(torch, params, optimizer)
    return s, model, optimizer, params


def _forward_backward(s: Any, model: Any) -> None:
    vocab = int(model.config.vocab_size)
    for _ in range(s.num_micro_batches):
        ids = torch.randint(0, vocab, (s.micro_batch_size, s.seq_length), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()


def times(out: Path, only: list[str] | None = None) -> None:
    doc: dict[str, Any] = {**_device(), "method": "wall seconds with torch.cuda.synchronize, median of 3 steps "
                           "after 2 warm-up steps; AdamW foreach; transformers SDPA attention", "steps": []}
    import transformers

    doc["transformers"] = str(transformers.__version__)
    for name, (preset, layers, settings) in TIMED.items():
        if only and name not in only:
            continue
        row: dict[str, Any] = {"name": name, "model": preset, "layers": layers, **settings}
        if name in HELD_OUT:
            row["held_out"] = True
        try:
            s, model, optimizer, _ = _setup(preset, layers, settings)
            fwd_bwd, opt = [], []
            for step in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                _forward_backward(s, model)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if step >= 2:
                    fwd_bwd.append(t1 - t0)
                    opt.append(t2 - t1)
            row["forward_backward_s"] = statistics.median(fwd_bwd)
            row["optimizer_s"] = statistics.median(opt)
            row["forward_backward_all_s"] = fwd_bwd
            del model, optimizer
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        torch.cuda.empty_cache()
        doc["steps"].append(row)
        print(name, {k: v for k, v in row.items() if k.endswith("_s") or k == "error"}, flush=True)
        _write(out, "times", doc)


def _frame_key(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in transformers or ndplan's engine, else the innermost Python frame."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in py:
        name = f["filename"]
        if "transformers" in name or "ndplan" in name:
            return f"{name.split('site-packages/')[-1]}:{f['line']} {f['name']}"
    f = py[0] if py else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
    return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"


def history(out: Path) -> None:
    for name, (preset, layers, settings, attention) in HISTORY_CASES.items():
        _history(out, name, preset, layers, settings, attention)


def _history(out: Path, name: str, preset: str, layers: int, settings: dict[str, Any], attention: str) -> None:
    s, model, optimizer, _ = _setup(preset, layers, settings, attention)
    _forward_backward(s, model)  # one step first: lazy state (cuBLAS workspace) is made before recording
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
    _forward_backward(s, model)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    trace = snapshot["device_traces"][0]
    live: dict[int, tuple[int, str, int]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str, int]] = {}
    best_index = 0
    lines = [f"base {base} B, peak {peak} B (+{(peak - base) / 2**20:.1f} MiB), {len(trace)} events"]
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _frame_key(event.get("frames", [])), index)
            total += event["size"]
            if total > best:
                best, best_live, best_index = total, dict(live), index
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    lines.append(f"replayed peak +{best / 2**20:.1f} MiB above base at event {best_index}")
    groups: dict[str, list[int]] = {}
    for size, key, _ in best_live.values():
        groups.setdefault(key, []).append(size)
    for key, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(sizes) / 2**20:10.1f} MiB  x{len(sizes):<4d} {key}  sizes(MiB)="
                     f"{sorted({round(x / 2**20, 1) for x in sizes}, reverse=True)[:6]}")
    lines.append("every allocation of 1 GiB or more, in order (event, size, the aten/autograd frames):")
    born: dict[int, int] = {}
    for index, event in enumerate(trace):
        if event["size"] < 2**30 or event["action"] not in ("alloc", "free_completed"):
            continue
        if event["action"] == "free_completed":
            lines.append(f"  {index:5d} free {event['size'] / 2**20:7.0f} MiB (born {born.get(event['addr'], -1)})")
            continue
        born[event["addr"]] = index
        names = [f["name"] for f in event.get("frames", [])]
        # The dispatcher's op wrappers and autograd's backward nodes name what allocated it.
        ops = [n.split("(")[0] for n in names if "_ops::" in n or "generated::" in n][:6]
        py = [f"{f['filename'].split('/')[-1]}:{f['line']}" for f in event.get("frames", [])
              if f.get("filename", "").endswith(".py")][:3]
        lines.append(f"  {index:5d} alloc {event['size'] / 2**20:7.0f} MiB  {' | '.join(ops)}  py: {' <- '.join(py)}")
    (out / f"history-{name}.txt").write_text("\n".join(lines) + "\n")
    torch.cuda.empty_cache()
    print("\n".join(lines[:60]), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("what", nargs="*", default=["history", "gemm", "times"],
                        choices=["history", "gemm", "times", "attention", "bandwidth", "profile"])
    parser.add_argument("--only", nargs="+", choices=sorted(TIMED), help="the steps `times` runs (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for what in args.what:
        t0 = time.perf_counter()
        try:
            if what == "times":
                times(args.out, args.only)
            else:
                {"gemm": gemm, "history": history, "attention": attention, "bandwidth": bandwidth,
                 "profile": profile}[what](args.out)
        except Exception:  # one probe failing leaves the others to run
            traceback.print_exc()
        print(f"== {what} took {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
