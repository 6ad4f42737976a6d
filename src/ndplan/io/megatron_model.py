"""The model a Megatron-LM / MindSpeed-LLM argument list builds.

A flag that is given states a ModelSpec field. When the arguments define an architecture
(``--hidden-size`` is given), the switches that are absent state Megatron's defaults too:
LayerNorm, GeLU without gating, biases on, tied embeddings, learned absolute positions,
``kv_channels = hidden / heads``. Without ``--hidden-size`` (e.g. a script that only cuts a
``--model`` down to ``--num-layers 4``) only the given flags override the base model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ndplan.io.common import Stated, merge_model, pad_vocab
from ndplan.io.megatron_args import Args
from ndplan.model.spec import MAX_LAYERS, MlpKind, ModelSpec

#: Tokens of GPT-2's byte-pair encoding (Megatron's GPT2BPETokenizer).
GPT2_BPE_TOKENS = 50257


@dataclass
class FlagModel:
    """The model, and the layer slots Megatron builds (``--num-layers``, MindSpeed noop layers included)."""

    model: ModelSpec | None
    slots: int | None
    noop: frozenset[int]


def parse_pattern(text: str) -> list[int]:
    """Megatron's layer-pattern expressions, e.g. ``([0]*3+[1]*58)`` or ``[1,0]*4``, without eval.

    Grammar: expr = term ('+' term)*; term = atom ('*' int)?; atom = '[' ints ']' | '(' expr ')'.
    """
    tokens = re.findall(r"\d+|[\[\](),+*]", text)
    if "".join(tokens) != re.sub(r"\s+", "", text):
        raise ValueError(f"not a layer pattern: {text!r}")
    pos = 0

    def peek() -> str:
        return tokens[pos] if pos < len(tokens) else ""

    def take(expected: str | None = None) -> str:
        nonlocal pos
        token = peek()
        if not token or (expected is not None and token != expected):
            raise ValueError(f"not a layer pattern: {text!r}")
        pos += 1
        return token

    def expr() -> list[int]:
        out = term()
        while peek() == "+":
            take("+")
            out += term()
        return out

    def term() -> list[int]:
        out = atom()
        while peek() == "*":
            take("*")
            times = int(take())
            if len(out) * times > MAX_LAYERS:  # refused before the list is built
                raise ValueError(f"pattern of over {MAX_LAYERS:,} layers: {text!r}")
            out = out * times
        return out

    def atom() -> list[int]:
        if peek() == "(":
            take("(")
            out = expr()
            take(")")
            return out
        take("[")
        out = [int(take())]
        while peek() == ",":
            take(",")
            out.append(int(take()))
        take("]")
        return out

    result = expr()
    if pos != len(tokens):
        raise ValueError(f"not a layer pattern: {text!r}")
    return result


def _frequency_pattern(args: Args, flag: str, slots: int, every: Callable[[int, int], int]) -> list[int]:
    """A Megatron layer-frequency flag (--moe-layer-freq, --window-attn-skip-freq) as 0/1 per
    layer slot: absent, all 1; an integer N, ``every(i, N)`` for slot i; else a list expression
    (``parse_pattern``) of --num-layers entries, each 0 or 1."""
    freq = args.get(flag)
    if freq is None or not freq.values:
        return [1] * slots
    if re.fullmatch(r"\d+", freq.values[0]):
        n = int(freq.values[0])
        if n < 1:
            raise args.error(freq, f"must be >= 1, got {n}")
        return [every(i, n) for i in range(slots)]
    try:
        pattern = parse_pattern("".join(freq.values))
    except ValueError as error:
        raise args.error(freq, str(error)) from None
    if len(pattern) != slots:
        raise args.error(freq, f"pattern has {len(pattern)} entries but --num-layers is {slots}")
    if any(bit not in (0, 1) for bit in pattern):
        raise args.error(freq, "a pattern's entries are 0 or 1")
    return pattern


def _moe_kinds(args: Args, slots: int, experts: int) -> tuple[MlpKind, ...]:
    # An integer N: every N-th layer from the first is MoE.
    pattern = _frequency_pattern(args, "--moe-layer-freq", slots, lambda i, n: 1 if i % n == 0 else 0)
    first_dense = args.integer("--first-k-dense-replace", default=0, minimum=0) or 0
    return tuple("moe" if experts and flag and i >= first_dense else "dense" for i, flag in enumerate(pattern))


def _window(args: Args, put: Callable[[str, Any, str], None], slots: int | None, noop: frozenset[int],
            defines: bool) -> None:
    """--window-size L,R (TransformerEngine's: query i attends keys i − L … i + R, so L + 1 keys
    causal) and --window-attn-skip-freq (an integer N: every N-th layer slot, 1-based, attends
    in full; a list: 1 slides, 0 full), as ``sliding_window`` and ``layer_attention_spans``
    (MindSpeed's noop slots dropped)."""
    layers = slots
    size = args.get("--window-size")
    if size is None or not size.values:
        args.get("--window-attn-skip-freq")
        if defines:
            put("sliding_window", 0, "no --window-size")
            if layers is not None:
                put("layer_attention_spans", ("full",) * (layers - len(noop)), "no --window-size")
        return
    text = ",".join(v.strip(",") for v in size.values if v.strip(",")).strip("()")
    parts = text.split(",")
    if len(parts) != 2 or not all(re.fullmatch(r"-?\d+", p.strip()) for p in parts):
        raise args.error(size, f"must be two integers 'left,right', got {text!r}")
    left, right = (int(p) for p in parts)
    if left == -1 and right in (0, -1):  # TransformerEngine's unlimited window: full causal attention
        put("sliding_window", 0, "--window-size -1 (unlimited)")
        if slots is not None:
            put("layer_attention_spans", ("full",) * (slots - len(noop)), "--window-size -1 (unlimited)")
        return
    if left < 0 or right != 0:
        raise args.error(size, f"only a causal window 'left,0' with left >= 0 (or -1: unlimited) is modelled, "
                         f"got {text!r}")
    put("sliding_window", left + 1, "--window-size")
    if layers is None:
        return
    # An integer N: every N-th layer (1-based) attends in full, the others slide.
    pattern = _frequency_pattern(args, "--window-attn-skip-freq", layers, lambda i, n: 0 if (i + 1) % n == 0 else 1)
    spans = tuple("sliding" if bit else "full" for i, bit in enumerate(pattern) if i not in noop)
    put("layer_attention_spans", spans, "--window-attn-skip-freq")


#: Megatron-LM's defaults for its Gated DeltaNet layers' widths (megatron/training/arguments.py).
_GATED_DELTANET_FLAGS = (("--linear-num-key-heads", "linear_num_key_heads", 16),
                         ("--linear-num-value-heads", "linear_num_value_heads", 32),
                         ("--linear-key-head-dim", "linear_key_head_dim", 128),
                         ("--linear-value-head-dim", "linear_value_head_dim", 128),
                         ("--linear-conv-kernel-dim", "linear_conv_kernel", 4))


def _gated_deltanet(args: Args, put: Callable[[str, Any, str], None], slots: int | None, noop: frozenset[int],
                    defines: bool) -> None:
    """--experimental-attention-variant gated_delta_net (or the older --linear-attention-type)
    with --linear-attention-freq (an integer N: every N-th layer, 1-based, softmax attention, the
    others Gated DeltaNet; a list: 1 Gated DeltaNet, 0 softmax) and the --linear-* widths, as
    ``layer_attention_spans`` 'linear' and the ``linear_*`` fields; --attention-output-gate."""
    if args.has("--attention-output-gate"):
        put("attention_output_gate", True, "--attention-output-gate")
    elif defines:
        put("attention_output_gate", False, "no --attention-output-gate")
    variant = args.text("--experimental-attention-variant", "--linear-attention-type")
    if variant not in ("gated_delta_net", "gdn"):
        args.get("--linear-attention-freq", *(flag for flag, _, _ in _GATED_DELTANET_FLAGS))
        if defines:
            for _, field, _ in _GATED_DELTANET_FLAGS:
                put(field, 0, "no --experimental-attention-variant gated_delta_net")
        return
    window = args.get("--window-size")
    if window is not None:
        raise args.error(window, "sliding windows beside Gated DeltaNet layers are not modelled")
    for flag, field, default in _GATED_DELTANET_FLAGS:
        put(field, args.integer(flag, default=default), flag)
    if slots is None:
        return
    freq = args.get("--linear-attention-freq")
    if freq is None or not freq.values:
        raise args.error(args.get("--experimental-attention-variant", "--linear-attention-type") or "--experimental-attention-variant",
                         "needs --linear-attention-freq (which layers attend in full), as Megatron-LM does")
    pattern = _frequency_pattern(args, "--linear-attention-freq", slots, lambda i, n: 0 if (i + 1) % n == 0 else 1)
    spans = tuple("linear" if bit else "full" for i, bit in enumerate(pattern) if i not in noop)
    put("layer_attention_spans", spans, "--linear-attention-freq")


def _noop_layers(args: Args, slots: int | None) -> frozenset[int]:
    arg = args.get("--noop-layers")
    if arg is None:
        return frozenset()
    text = ",".join(arg.values)
    try:
        layers = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise args.error(arg, f"expected comma-separated layer indices, got {text!r}") from None
    if slots is not None and any(not 0 <= i < slots for i in layers):
        raise args.error(arg, f"layer indices must be in 0..{slots - 1}, got {text!r}")
    return layers


def _default_ffn(hidden: int, gated: bool) -> int:
    """Megatron's --ffn-hidden-size default (arguments.py): swiglu int(4h·2/3 / 64)·64, else 4h."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if gated else 4 * hidden


def _megatron_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """Megatron's documented defaults for the fields a flag list leaves out."""
    hidden = int(values["hidden_size"])
    out: dict[str, Any] = {}
    out["ffn_hidden_size"] = _default_ffn(hidden, bool(values.get("gated_mlp", False)))
    out["head_dim"] = hidden // int(values["num_attention_heads"])
    out["num_kv_heads"] = values["num_attention_heads"]
    if values.get("num_experts"):
        # --moe-ffn-hidden-size defaults to --ffn-hidden-size.
        out["moe_ffn_hidden_size"] = values.get("ffn_hidden_size", out["ffn_hidden_size"])
    return out


def model_from_flags(args: Args, base: ModelSpec | None, tp: int, warnings: list[str], notes: list[str]) -> FlagModel:
    """Build the model the arguments describe, over ``base`` (from ``--model``) if given."""
    src = args.src
    stated: Stated = {}

    def put(name: str, value: Any, label: str) -> None:
        stated[name] = (value, label)

    defines = args.has("--hidden-size")
    slots = args.integer("--num-layers", maximum=MAX_LAYERS)
    noop = _noop_layers(args, slots)
    if slots is not None:
        put("num_layers", slots - len(noop), "--num-layers" + (" minus --noop-layers" if noop else ""))
    for flag, name in (("--hidden-size", "hidden_size"), ("--ffn-hidden-size", "ffn_hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"),
                       ("--max-position-embeddings", "max_position_embeddings")):
        value = args.integer(flag, minimum=1)
        if value is not None:
            put(name, value, flag)
    heads = args.integer("--num-attention-heads")
    hidden = args.integer("--hidden-size")

    mla = args.has("--multi-latent-attention", "--multi-head-latent-attention")
    gqa = args.has("--group-query-attention")
    groups = args.integer("--num-query-groups")
    if mla:
        rope = args.integer("--qk-pos-emb-head-dim", "--qk-rope-head-dim", default=64)
        nope = args.integer("--qk-head-dim", "--qk-nope-head-dim", default=128)
        assert rope is not None and nope is not None
        put("q_lora_rank", args.integer("--q-lora-rank", default=0, minimum=0), "--q-lora-rank")
        put("kv_lora_rank", args.integer("--kv-lora-rank", default=32), "--kv-lora-rank")
        put("qk_rope_head_dim", rope, "--qk-pos-emb-head-dim")
        put("qk_nope_head_dim", nope, "--qk-head-dim")
        put("v_head_dim", args.integer("--v-head-dim", default=128), "--v-head-dim")
        put("head_dim", rope + nope, "--qk-head-dim + --qk-pos-emb-head-dim")
        if heads is not None:
            put("num_kv_heads", heads, "--multi-latent-attention")
        args.get("--kv-channels")  # MLA sizes heads by --qk-head-dim and --v-head-dim instead
    else:
        if gqa:
            put("num_kv_heads", groups or 1, "--num-query-groups")
        elif defines and heads is not None:
            put("num_kv_heads", heads, "--num-attention-heads (no --group-query-attention)")
        kv_channels = args.integer("--kv-channels")
        if kv_channels is not None:
            put("head_dim", kv_channels, "--kv-channels")
        elif defines and heads:
            assert hidden is not None
            put("head_dim", hidden // heads, "--hidden-size / --num-attention-heads")
    if groups is not None and not gqa and not mla:
        notes.append(f"{src.where(args.line('--num-query-groups'))}: --num-query-groups has no effect "
                     "without --group-query-attention (Megatron builds multi-head attention)")

    # Vocabulary: Megatron pads it to a multiple of make-vocab-size-divisible-by · tp unless
    # --padded-vocab-size gives the final size. Padding is applied after the merge so it is
    # never mistaken for a conflict with --model.
    multiple = (args.integer("--make-vocab-size-divisible-by", default=128) or 128) * tp
    padded = args.integer("--padded-vocab-size")
    vocab = args.integer("--vocab-size")
    tokenizer = args.text("--tokenizer-type")
    if padded is not None:
        put("vocab_size", padded, "--padded-vocab-size")
    elif vocab is not None:
        put("vocab_size", vocab, "--vocab-size")
    elif tokenizer == "GPT2BPETokenizer" or (tokenizer is None and args.has("--merge-file") and defines):
        # GPT-2's byte-pair encoding, pretrain_gpt.py's tokenizer when only its files are given.
        put("vocab_size", GPT2_BPE_TOKENS, "GPT2BPETokenizer's vocabulary")
        if tokenizer is None:
            notes.append(f"--merge-file without --tokenizer-type: GPT-2's BPE ({GPT2_BPE_TOKENS:,} tokens), "
                         "pretrain_gpt.py's default; give --vocab-size or --model for another vocabulary")

    if args.has("--untie-embeddings-and-output-weights"):
        put("tie_word_embeddings", False, "--untie-embeddings-and-output-weights")
    elif defines:
        put("tie_word_embeddings", True, "Megatron's default (no --untie-embeddings-and-output-weights)")
    norm = args.text("--normalization")
    if norm is not None:
        if norm not in ("RMSNorm", "LayerNorm"):
            raise args.error("--normalization", f"expected RMSNorm or LayerNorm, got {norm!r}")
        put("norm", norm.lower(), "--normalization")
        put("norm_bias", norm == "LayerNorm", "--normalization")
    elif defines:
        put("norm", "layernorm", "Megatron's default --normalization LayerNorm")
        put("norm_bias", True, "Megatron's default --normalization LayerNorm")
    if args.has("--swiglu"):
        put("activation", "silu", "--swiglu")
        put("gated_mlp", True, "--swiglu")
    elif args.has("--squared-relu"):
        put("activation", "relu2", "--squared-relu")
        put("gated_mlp", False, "--squared-relu")
    elif args.has("--quick-geglu"):
        put("activation", "quick_gelu", "--quick-geglu")
        put("gated_mlp", True, "--quick-geglu")
    elif defines:
        put("activation", "gelu", "Megatron's default activation")
        put("gated_mlp", False, "Megatron's default activation")
    if defines and hidden is not None and not args.has("--ffn-hidden-size"):
        # Megatron's default, whatever model --model names.
        put("ffn_hidden_size", _default_ffn(hidden, bool(stated.get("gated_mlp", (False, ""))[0])),
            "Megatron's default --ffn-hidden-size")
    no_bias = args.has("--disable-bias-linear")
    if no_bias or defines:
        label = "--disable-bias-linear" if no_bias else "Megatron's default (no --disable-bias-linear)"
        put("o_bias", not no_bias, label)
        put("mlp_bias", not no_bias, label)
        put("expert_bias", not no_bias, label)  # Megatron-Core's experts take add_bias_linear too
        put("qkv_bias", not no_bias or args.has("--add-qkv-bias"), "--add-qkv-bias" if no_bias else label)
    elif args.has("--add-qkv-bias"):
        put("qkv_bias", True, "--add-qkv-bias")
    for flag, name in (("--hidden-dropout", "hidden_dropout"), ("--attention-dropout", "attention_dropout")):
        probability = args.number(flag)
        if probability is not None:
            if not 0.0 <= probability < 1.0:
                raise args.error(flag, f"must be a probability in [0, 1), got {probability:g}")
            put(name, probability, flag)
        elif defines:
            put(name, 0.1, f"Megatron's default {flag} 0.1")
            notes.append(f"{flag} not given: Megatron's default 0.1, whose masks are kept for backward")
    softmax = args.text("--softmax-type")
    if softmax is not None:
        if softmax not in ("vanilla", "off-by-one", "learnable"):
            raise args.error("--softmax-type", f"must be vanilla, off-by-one or learnable, got {softmax!r}")
        put("attention_sinks", softmax == "learnable", "--softmax-type")  # off-by-one adds no parameter
    elif defines:
        put("attention_sinks", False, "no --softmax-type")
    if args.has("--qk-layernorm") and not mla:
        put("qk_norm", True, "--qk-layernorm")
    elif defines and not mla:
        put("qk_norm", False, "no --qk-layernorm")

    experts = args.integer("--num-experts", "--num-moe-experts", minimum=0)
    if experts:
        put("num_experts", experts, "--num-experts")
        put("num_experts_per_tok", args.integer("--moe-router-topk", default=2), "--moe-router-topk")
        moe_width = args.integer("--moe-ffn-hidden-size", "--moe-intermediate-size")
        if moe_width is None:
            moe_width = args.integer("--ffn-hidden-size")
            if moe_width is None and base is not None:
                moe_width = base.moe_ffn_hidden_size or None
        if moe_width is not None:
            put("moe_ffn_hidden_size", moe_width, "--moe-ffn-hidden-size")
        shared_total = args.integer("--moe-shared-expert-intermediate-size")
        shared_count = args.integer("--n-shared-experts", minimum=0)
        if shared_total:
            put("num_shared_experts", 1, "--moe-shared-expert-intermediate-size")
            put("shared_expert_ffn_hidden_size", shared_total, "--moe-shared-expert-intermediate-size")
        elif shared_count and moe_width:
            put("num_shared_experts", shared_count, "--n-shared-experts")
            put("shared_expert_ffn_hidden_size", moe_width, "--n-shared-experts")
        elif defines:
            put("num_shared_experts", 0, "no --moe-shared-expert-intermediate-size")
            put("shared_expert_ffn_hidden_size", 0, "no --moe-shared-expert-intermediate-size")
        # SharedExpertMLP's sigmoid gate (Qwen2-MoE, Qwen3-Next, Qwen3.5)
        if args.has("--moe-shared-expert-gate"):
            put("shared_expert_gate", True, "--moe-shared-expert-gate")
        elif defines:
            put("shared_expert_gate", False, "no --moe-shared-expert-gate")
        layer_slots = slots if slots is not None else (base.num_layers if base else None)
        if layer_slots is not None:
            kinds = _moe_kinds(args, layer_slots, experts)
            kinds = tuple(k for i, k in enumerate(kinds) if i not in noop)
            put("layer_mlp_kinds", kinds, "--moe-layer-freq")
    elif experts == 0 or defines:
        args.get("--moe-layer-freq", "--moe-router-topk", "--moe-ffn-hidden-size", "--first-k-dense-replace")
        put("num_experts", 0, "no --num-experts")
        if base is not None and base.is_moe:
            put("layer_mlp_kinds", ("dense",) * (slots - len(noop) if slots else base.num_layers), "no --num-experts")

    layer_slots = slots if slots is not None else (base.num_layers if base else None)
    gated_deltanet = args.text("--experimental-attention-variant", "--linear-attention-type") in ("gated_delta_net", "gdn")
    if not gated_deltanet:  # (its spans come from --linear-attention-freq)
        _window(args, put, layer_slots, noop, defines)
    _gated_deltanet(args, put, layer_slots, noop, defines)

    mtp = args.integer("--mtp-num-layers", "--num-nextn-predict-layers", minimum=0)
    if mtp is not None:
        put("mtp_depth", mtp, "--mtp-num-layers")
    elif defines:
        put("mtp_depth", 0, "no --mtp-num-layers")

    if defines:
        position = args.text("--position-embedding-type")
        rope = args.has("--use-rotary-position-embeddings") or position in ("rope", "mrope", "none")
        if not rope and not args.has("--no-position-embedding"):
            warnings.append(f"{src.name}: learned absolute position embeddings (Megatron's default "
                            "--position-embedding-type) are not modelled; ndplan counts no position table")

    name = base.name if base else src.path.stem
    model = merge_model(
        src, stated, base, name=name, model_type="megatron", defaults=_megatron_defaults,
        warnings=warnings, origin="the script", tolerate=_tolerated(multiple),
    )
    if model is not None and padded is None and (vocab is not None or stated):
        size = pad_vocab(model.vocab_size, multiple)
        if size != model.vocab_size:
            notes.append(f"vocab_size {model.vocab_size} is padded to {size} (a multiple of "
                         f"--make-vocab-size-divisible-by · tp = {multiple}), as Megatron does")
            model = model.model_copy(update={"vocab_size": size})
    return FlagModel(model, slots if slots is not None else (model.num_layers + len(noop) if model else None), noop)


def _tolerated(multiple: int) -> Callable[[str, Any, Any], bool]:
    """Not conflicts with --model: a --padded-vocab-size a little above its vocabulary (padding),
    and a --max-position-embeddings above its own (Megatron asserts it covers --seq-length; under
    RoPE it sizes no table, so a launch raises it to the sequence it runs)."""
    def tolerate(field: str, stated: Any, base: Any) -> bool:
        if field == "max_position_embeddings":
            return int(stated) >= int(base)
        return field == "vocab_size" and 0 <= int(stated) - int(base) < max(multiple, 128)

    return tolerate
