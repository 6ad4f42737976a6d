"""Build a Hugging Face config with transformers on the meta device and count parameters per block.

Shared by the tests that pin ndplan's parameter formulas to what transformers really builds.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_BLOCK_RULES = [
    (re.compile(r"embed_tokens"), "embedding"),
    (re.compile(r"lm_head"), "output_head"),
    (re.compile(r"^model\.norm\."), "final_norm"),
    (re.compile(r"\.(self_attn|linear_attn)\."), "attention"),
    (re.compile(r"\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\."),
     "norms"),
    (re.compile(r"\.mlp\.(shared_expert|shared_experts|shared_expert_gate)\b"), "shared_experts"),
    (re.compile(r"\.mlp\.experts\."), "routed_experts"),
    (re.compile(r"\.mlp\.gate\.(weight|bias)$"), "router"),
    (re.compile(r"\.mlp\.router\.(weight|bias)$"), "router"),  # gpt-oss
    (re.compile(r"\.mlp\."), "mlp"),
]


def block_of(name: str) -> str:
    for pattern, block in _BLOCK_RULES:
        if pattern.search(name):
            return block
    raise AssertionError(f"no block for parameter {name}")


def meta_block_counts(config: dict[str, Any]) -> Counter[str]:
    """numel per ndplan block of the model transformers builds for ``config``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in {"model_type", "architectures", "auto_map"}}
    # Kimi K2's own model_type runs DeepSeek-V3's modeling code (its remote code), which
    # transformers ships as deepseek_v3.
    model_type = {"kimi_k2": "deepseek_v3"}.get(config["model_type"], config["model_type"])
    hf_config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    counts: Counter[str] = Counter()
    for name, parameter in model.named_parameters(remove_duplicate=True):
        counts[block_of(name)] += parameter.numel()
    return counts
