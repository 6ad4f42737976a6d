"""What torch.compile'd decoder layers and loss keep for backward, measured on a CPU.

Each tiny transformers decoder layer (bf16, SDPA) runs one forward and its saved tensors are
counted: torch.compile's AOTAutograd hands them to ``ctx.save_for_backward``, where
``torch.autograd.graph.saved_tensors_hooks`` sees them (the checkpoint of selective recompute is
inlined into the compiled graph, so its saved tensors are seen too, unlike eager checkpointing's).
Parameters and the rotary cos/sin (shared by every layer) are left out; bytes are per token of the
sequence. Three policies: no recompute, torchtitan's per-op selective checkpointing (every second
matmul and the attention kernel saved) and keep-matmuls (every matmul and the attention kernel).
Inductor's partitioner decides what is saved the same way on every device (the graph it cuts is
the same), so a CPU measures what a GPU keeps; the kernels it then generates differ. The loss
is torchtitan's cross-entropy on an fp32 copy of the logits, compiled apart from the layers.

    python benchmarks/accuracy/compiled_layers.py   # rewrites tests/data/measured/compiled/layers.json

Needs the census extra (torch, transformers) and a C++ compiler for Inductor's CPU kernels; about
a minute a configuration. Where torchao is installed (not a dependency of ndplan) four of the
layers are measured again with its Float8 linears. tests/test_compiled_layers.py compares the pytorch profile's compiled
pricing with the file.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "measured" / "compiled" / "layers.json"
SEQ = 384
# Widths chosen apart from each other (h, the heads' widths and ffn differ) so that every tensor's
# size names it; the model types cover pre-norm (Llama: GQA, MHA, a head dim off h/heads; Qwen3:
# q/k norms), post-norm (OLMo 2: fp32-weight norms, q/k norms over the projection), sandwich norms
# (Gemma 3) and a fused qkv projection with partial rotary (Phi-3).
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": {"model_type": "llama", "hidden_size": 192, "intermediate_size": 640, "num_attention_heads": 6,
                  "num_key_value_heads": 2},
    "llama-mha": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
                  "num_key_value_heads": 4},
    "llama-wide-heads": {"model_type": "llama", "hidden_size": 192, "intermediate_size": 640,
                         "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 48},
    "qwen3": {"model_type": "qwen3", "hidden_size": 192, "intermediate_size": 640, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 32},
    "olmo2": {"model_type": "olmo2", "hidden_size": 192, "intermediate_size": 640, "num_attention_heads": 6,
              "num_key_value_heads": 2},
    "gemma3": {"model_type": "gemma3_text", "hidden_size": 192, "intermediate_size": 640, "num_attention_heads": 6,
               "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 4096, "layer_types": ["full_attention"]},
    "phi3": {"model_type": "phi3", "hidden_size": 192, "intermediate_size": 640, "num_attention_heads": 6,
             "num_key_value_heads": 2, "pad_token_id": 0},
}
COMMON = {"num_hidden_layers": 1, "vocab_size": 128}
#: The layers measured again with torchao's Float8 linears (torchtitan's float8 converter).
FLOAT8_CONFIGS = ("llama-gqa", "qwen3", "olmo2", "gemma3")
_MODULES = {"gemma3_text": "gemma3"}  # model types whose modeling code lives under another name

_MATMUL = torch.ops.aten.mm.default
_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _policy(every_matmul: bool) -> Any:
    """torchtitan's per-op policy (every_matmul False: the odd-numbered matmuls, counted apart in
    the forward and the recompute) or keep-matmuls (every matmul), the attention kernel always."""
    counts: dict[bool, int] = defaultdict(int)

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == _MATMUL:
            counts[ctx.is_recompute] += 1
        save = op in _ATTENTION or (op == _MATMUL and (every_matmul or counts[ctx.is_recompute] % 2 == 1))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


# (dynamo takes a checkpoint's context_fn only as a module-level function)
def per_op_context() -> Any:
    return create_selective_checkpoint_contexts(_policy(every_matmul=False))


def keep_matmuls_context() -> Any:
    return create_selective_checkpoint_contexts(_policy(every_matmul=True))


def _layer(config: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    cfg = transformers.AutoConfig.for_model(**config)
    cfg._attn_implementation = "sdpa"
    name = _MODULES.get(config["model_type"], config["model_type"])
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    layer_class = next(getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer") and "Vision" not in n)
    rope_class = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    return layer_class(cfg, 0).to(torch.bfloat16), (cfg, rope_class)


def measure(config: dict[str, Any], seq: int = SEQ, float8: bool = False) -> dict[str, float]:
    """Saved bytes per token of one compiled layer under each policy (``float8``: its linears
    torchao's Float8Linear, tensorwise scaling, as torchtitan's float8 converter makes them)."""
    torch.manual_seed(0)
    layer, (cfg, rope_class) = _layer(config)
    if float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(layer)
    hidden = torch.randn(1, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq)[None]
    rope = rope_class(cfg)
    try:
        cos, sin = rope(hidden, positions)
    except TypeError:  # Gemma 3's rotary takes the layer type
        cos, sin = rope(hidden, positions, layer_type="full_attention")
    left_out = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    left_out |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}

    def body(x: torch.Tensor) -> torch.Tensor:
        out = layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    runs = {"none": body,
            "torchtitan-op": lambda x: checkpoint(body, x, use_reentrant=False, context_fn=per_op_context),
            "keep-matmuls": lambda x: checkpoint(body, x, use_reentrant=False, context_fn=keep_matmuls_context)}
    result = {}
    for policy, run in runs.items():
        compiled = torch.compile(run)
        compiled(hidden)  # compile outside the count
        result[policy] = _saved_bytes(compiled, hidden, left_out) / seq
        torch._dynamo.reset()
    return result


def _saved_bytes(run: Any, hidden: torch.Tensor, left_out: set[int]) -> int:
    """Bytes of the storages one forward of ``run`` saves for backward, each counted once."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in left_out:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(hidden)
    return sum(saved.values())


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss torchtitan compiles with its blocks (``training.compile``, 2025: components/loss.py's
    build_cross_entropy_loss; later ``[compile] components = ["loss"]``): cross-entropy on an fp32
    copy of the logits."""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def measure_loss(vocab: int = 1000, seq: int = SEQ) -> dict[str, float]:
    """Saved bytes per token of the loss on [1, seq, vocab] bf16 logits, eager and compiled."""
    torch.manual_seed(0)
    pred = torch.randn(1, seq, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, seq))
    result = {}
    for name, loss in (("eager", cross_entropy_loss), ("compiled", torch.compile(cross_entropy_loss))):
        loss(pred, labels)
        result[name] = _saved_bytes(lambda logits, loss=loss: loss(logits, labels), pred, set()) / seq
        torch._dynamo.reset()
    return result


def main() -> None:
    layers = {}
    for name, config in CONFIGS.items():
        layers[name] = {"config": config, "bytes_per_token": measure({**config, **COMMON})}
        print(name, layers[name]["bytes_per_token"], flush=True)
    loss = {"vocab_size": 1000, "bytes_per_token": measure_loss(1000)}
    print("loss", loss["bytes_per_token"], flush=True)
    float8: dict[str, Any] = {}
    if importlib.util.find_spec("torchao") is not None:  # (not a dependency: measured where installed)
        import torchao

        float8["torchao"] = torchao.__version__
        for name in FLOAT8_CONFIGS:
            # (the scales, a scalar a linear, read as hundredths of a byte a token: rounded off)
            measured = measure({**CONFIGS[name], **COMMON}, float8=True)
            float8[name] = {policy: round(value, 1) for policy, value in measured.items()}
            print("float8", name, float8[name], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "bytes a token one torch.compile'd decoder layer saves for backward (parameters and rotary cos/sin "
                "left out), bf16, SDPA, measured on a CPU (benchmarks/accuracy/compiled_layers.py)",
        "torch": torch.__version__, "transformers": transformers.__version__, "seq_length": SEQ,
        "layers": layers, "loss": loss, "float8_layers": float8}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
