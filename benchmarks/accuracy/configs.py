"""The accuracy suite's configurations: a model (depth-trimmed), a strategy, a note.

Each entry is measured with ``ndplan.census.measure_step`` (one rank per pipeline stage) and
estimated with ``ndplan.memory.stages`` on the same trimmed model; every measured stage is one
row of docs/accuracy.md. Keep the suite to a few minutes on 2 CPU cores: fake tensors cost
nothing per element, but every op, module hook and DTensor dispatch costs Python time, so models
are trimmed to 2-8 decoder layers.
"""

from __future__ import annotations

from typing import Any

# name, model preset, decoder layers kept, Strategy fields
CONFIGS: list[dict[str, Any]] = [
    # ---- one device, no parallelism: bf16 weights, gradients and AdamW states (bf16-pure)
    {"name": "llama8b-1dev-s2k", "model": "llama-3.1-8b", "layers": 2,
     "strategy": {"seq_length": 2048, "precision": "bf16-pure"}},
    {"name": "llama8b-1dev-s4k-mbs2-sel", "model": "llama-3.1-8b", "layers": 2,
     "strategy": {"seq_length": 4096, "micro_batch_size": 2, "recompute": "selective", "precision": "bf16-pure"}},
    {"name": "llama8b-1dev-s8k-full", "model": "llama-3.1-8b", "layers": 2,
     "strategy": {"seq_length": 8192, "recompute": "full", "precision": "bf16-pure"}},
    {"name": "qwen25-7b-1dev-s4k", "model": "qwen2.5-7b", "layers": 2,
     "strategy": {"seq_length": 4096, "precision": "bf16-pure"}},
    {"name": "qwen3-8b-1dev-s4k-mbs2", "model": "qwen3-8b", "layers": 2,
     "strategy": {"seq_length": 4096, "micro_batch_size": 2, "precision": "bf16-pure"}},
    {"name": "mixtral-1dev-s4k", "model": "mixtral-8x7b", "layers": 2,
     "strategy": {"seq_length": 4096, "precision": "bf16-pure"}},
    {"name": "qwen3-moe-1dev-s4k-mbs2", "model": "qwen3-30b-a3b", "layers": 2,
     "strategy": {"seq_length": 4096, "micro_batch_size": 2, "precision": "bf16-pure"}},
    {"name": "dsv3-1dev-s2k", "model": "deepseek-v3", "layers": 4,
     "strategy": {"seq_length": 2048, "precision": "bf16-pure"}},
    # ---- FSDP2 over 8 ranks, fp32 sharded weights, bf16 compute (fsdp-bf16)
    {"name": "llama8b-fsdp8-s4k", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 4096, "precision": "fsdp-bf16"}},
    {"name": "llama8b-fsdp8-s8k-full", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 8192, "recompute": "full", "precision": "fsdp-bf16"}},
    {"name": "qwen25-7b-fsdp8-s8k-mbs2-sel", "model": "qwen2.5-7b", "layers": 2,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 8192, "micro_batch_size": 2,
                  "recompute": "selective", "precision": "fsdp-bf16"}},
    {"name": "qwen3-8b-fsdp8-s2k-mbs2", "model": "qwen3-8b", "layers": 4,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 2048, "micro_batch_size": 2, "precision": "fsdp-bf16"}},
    {"name": "mixtral-fsdp8-s8k-full", "model": "mixtral-8x7b", "layers": 2,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 8192, "recompute": "full", "precision": "fsdp-bf16"}},
    {"name": "qwen3-moe-fsdp8-s4k-sel", "model": "qwen3-30b-a3b", "layers": 2,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 4096, "recompute": "selective", "precision": "fsdp-bf16"}},
    {"name": "dsv3-fsdp8-s4k-full", "model": "deepseek-v3", "layers": 4,
     "strategy": {"dp": 8, "fsdp": True, "zero": 3, "seq_length": 4096, "recompute": "full", "precision": "fsdp-bf16"}},
    # ---- DTensor tensor parallelism (no sequence parallelism) with FSDP2 over the rest of 8 ranks
    {"name": "llama8b-tp2-fsdp4-s4k", "model": "llama-3.1-8b", "layers": 2,
     "strategy": {"dp": 4, "tp": 2, "fsdp": True, "zero": 3, "seq_length": 4096, "precision": "fsdp-bf16"}},
    {"name": "llama8b-tp4-fsdp2-s8k-sel", "model": "llama-3.1-8b", "layers": 2,
     "strategy": {"dp": 2, "tp": 4, "fsdp": True, "zero": 3, "seq_length": 8192, "recompute": "selective",
                  "precision": "fsdp-bf16"}},
    {"name": "qwen25-7b-tp4-fsdp2-s4k-full", "model": "qwen2.5-7b", "layers": 2,
     "strategy": {"dp": 2, "tp": 4, "fsdp": True, "zero": 3, "seq_length": 4096, "recompute": "full", "precision": "fsdp-bf16"}},
    {"name": "qwen3-8b-tp2-fsdp4-s8k-sel", "model": "qwen3-8b", "layers": 2,
     "strategy": {"dp": 4, "tp": 2, "fsdp": True, "zero": 3, "seq_length": 8192, "recompute": "selective",
                  "precision": "fsdp-bf16"}},
    # ---- pipelines: every stage of pp 2 and 4 under each torch.distributed.pipelining schedule
    {"name": "llama8b-pp2-1f1b-m8-s4k", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"pp": 2, "schedule": "1f1b", "num_micro_batches": 8, "seq_length": 4096, "precision": "bf16-pure"}},
    {"name": "llama8b-pp4-1f1b-m8-s2k", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"pp": 4, "schedule": "1f1b", "num_micro_batches": 8, "seq_length": 2048, "precision": "bf16-pure"}},
    {"name": "qwen3-8b-pp2-gpipe-m4-s4k", "model": "qwen3-8b", "layers": 4,
     "strategy": {"pp": 2, "schedule": "gpipe", "num_micro_batches": 4, "seq_length": 4096, "precision": "bf16-pure"}},
    {"name": "llama8b-pp2-interleaved-m4-s4k", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"pp": 2, "vpp": 2, "schedule": "interleaved", "num_micro_batches": 4, "seq_length": 4096,
                  "precision": "bf16-pure"}},
    {"name": "qwen25-7b-pp4-interleaved-m8-s2k", "model": "qwen2.5-7b", "layers": 8,
     "strategy": {"pp": 4, "vpp": 2, "schedule": "interleaved", "num_micro_batches": 8, "seq_length": 2048,
                  "precision": "bf16-pure"}},
    {"name": "llama8b-pp2-zbv-m4-s4k", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"pp": 2, "vpp": 2, "schedule": "zbv", "num_micro_batches": 4, "seq_length": 4096, "precision": "bf16-pure"}},
    {"name": "llama8b-pp4-zbv-m8-s2k", "model": "llama-3.1-8b", "layers": 8,
     "strategy": {"pp": 4, "vpp": 2, "schedule": "zbv", "num_micro_batches": 8, "seq_length": 2048, "precision": "bf16-pure"}},
    {"name": "qwen3-8b-pp2-dualpipev-m4-s4k", "model": "qwen3-8b", "layers": 4,
     "strategy": {"pp": 2, "vpp": 2, "schedule": "dualpipev", "num_micro_batches": 4, "seq_length": 4096,
                  "precision": "bf16-pure"}},
    {"name": "mixtral-pp2-1f1b-m4-s4k-sel", "model": "mixtral-8x7b", "layers": 2,
     "strategy": {"pp": 2, "schedule": "1f1b", "num_micro_batches": 4, "seq_length": 4096, "recompute": "selective",
                  "precision": "bf16-pure"}},
    {"name": "llama8b-pp2-fsdp4-1f1b-m4-s4k", "model": "llama-3.1-8b", "layers": 4,
     "strategy": {"pp": 2, "dp": 4, "fsdp": True, "zero": 3, "schedule": "1f1b", "num_micro_batches": 4,
                  "seq_length": 4096, "precision": "fsdp-bf16"}},
    {"name": "dsv3-pp2-1f1b-m4-s2k", "model": "deepseek-v3", "layers": 4,
     "strategy": {"pp": 2, "schedule": "1f1b", "num_micro_batches": 4, "seq_length": 2048, "precision": "bf16-pure"}},
]
