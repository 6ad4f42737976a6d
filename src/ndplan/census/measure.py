"""Run the census: measure, with the real transformers modeling code, what one decoder layer of
each kind keeps for backward, per token, on CPU under FakeTensorMode (no weights, no real memory).

torch and transformers are imported lazily: without them ``run_census`` raises NdplanError naming
the optional extra. How and what is measured: docs/census.md and ``ndplan.census._engine``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ndplan.census.record import CensusRecord, Recompute, SavedOp
from ndplan.errors import NdplanError, did_you_mean, parse_nested, read_text

EXTRA_MESSAGE = "census needs the optional extra: pip install 'ndplan[census]' (torch==2.13.0, transformers)"

POLICIES = ("none", "full", "selective")
ATTENTIONS = ("sdpa", "eager")
# Static-shape experts implementations only: their saved tensors have T*top_k rows whatever the
# routing. The "eager" per-expert loop is data dependent (nonzero, a Python loop over hit experts).
EXPERTS = ("grouped_mm", "batched_mm")


def _require_torch() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError:
        raise NdplanError(EXTRA_MESSAGE) from None
    return torch, transformers


def _check_args(seq_length: int, micro_batch_size: int, dtype: str, attention: str, experts: str) -> None:
    if not isinstance(seq_length, int) or seq_length < 4:
        raise NdplanError(f"census: seq_length must be an integer >= 4, got {seq_length!r}")
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise NdplanError(f"census: micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise NdplanError(f"census: dtype must be bfloat16, float16 or float32, got {dtype!r}")
    if attention not in ATTENTIONS:
        raise NdplanError(f"census: attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if experts not in EXPERTS:
        raise NdplanError(
            f"census: experts must be one of {', '.join(EXPERTS)}, got {experts!r} "
            "(the eager per-expert loop routes data-dependently and cannot run under FakeTensorMode)"
        )


def run_census(
    hf_config: dict[str, Any],
    *,
    seq_length: int = 4096,
    micro_batch_size: int = 1,
    dtype: str = "bfloat16",
    attention: str = "sdpa",
    experts: str = "grouped_mm",
    name: str | None = None,
) -> list[CensusRecord]:
    """Measure every distinct decoder-layer kind of ``hf_config`` (a config.json dict), plus the
    output layer (final norm + LM head + loss). One record per kind, values in bytes per token."""
    if not isinstance(hf_config, dict):
        raise NdplanError("census: hf_config must be a dict (a Hugging Face config.json)")
    _check_args(seq_length, micro_batch_size, dtype, attention, experts)
    model_name = name or hf_config.get("name") or hf_config.get("_name_or_path") or hf_config.get("model_type")
    _check_readable(hf_config, str(model_name))
    torch, transformers = _require_torch()
    from ndplan.census import _engine as E

    t_start = time.perf_counter()
    config = E.make_config(hf_config, attention=attention, experts=experts)
    config2, tp_notes = E.tp2_config(config)
    model1 = E.build_meta_model(config)
    model2 = E.fit_projection_norms(E.build_meta_model(config2))
    dt = E.DTYPES[dtype]
    b = micro_batch_size
    s_main, s_half = seq_length, seq_length // 2
    h = int(config.hidden_size)
    fp32 = E.keep_fp32_patterns(model1, dt)
    kinds = E.layer_kinds(model1)
    records: list[CensusRecord] = []
    common = dict(
        model=str(model_name),
        architecture=_architecture(hf_config, str(model_name)),
        model_type=str(config.model_type),
        hidden_size=h,
        seq_length=seq_length,
        micro_batch_size=b,
        dtype=dtype,
        attention=attention,
        torch_version=str(torch.__version__),
        transformers_version=str(transformers.__version__),
    )

    fake = E.FakeTensorMode()
    emulated: list[str] = []
    with fake, E.gpu_kernels(emulated):
        for model in (model1, model2):
            rotary = E.find_module(model, "rotary_emb")
            if rotary is not None:
                E.materialize(rotary, dt, "model.rotary_emb", fp32)

        # decoder layers
        for kind, idx, count in kinds:
            runs: dict[tuple[int, int, str], Any] = {}
            for tp, model, cfg in ((1, model1, config), (2, model2, config2)):
                seqs = (s_main, s_half) if tp == 1 else (s_main,)
                for (s, policy), run in _layer_runs(E, model, cfg, idx, kind, dt, fp32, b, seqs, POLICIES).items():
                    runs[(tp, s, policy)] = run
            is_moe = "moe" in kind
            notes = list(tp_notes)
            if is_moe:
                notes.append(f"MoE experts_implementation={experts}: static shapes, T*top_k rows whatever the routing")
            notes.extend(dict.fromkeys(emulated))
            emulated.clear()
            records.append(
                _record(runs, kind, count, s_main, s_half, b, attention, notes, common,
                        experts=experts if is_moe else "")
            )

        # output layer: final norm + LM head + cross-entropy as the CausalLM computes it
        runs = {}
        vocab = int(config.vocab_size)
        vocab2 = (vocab + 1) // 2
        norm = E.find_module(model1, "norm")
        lm_head = model1.get_output_embeddings()
        if norm is None or lm_head is None:
            from ndplan.model.hf import READERS

            raise NdplanError(f"census: {model_name} (model_type '{config.model_type}'): cannot find the model's "
                              "final norm and LM head; the census measures decoder-only causal LMs (ndplan reads "
                              f"{', '.join(READERS)})")
        E.materialize(norm, dt, "model.norm", fp32)
        head1 = torch.nn.Linear(h, vocab, bias=lm_head.bias is not None, dtype=dt)
        head2 = torch.nn.Linear(h, vocab2, bias=lm_head.bias is not None, dtype=dt)
        loss_fn = model1.loss_function
        for tp, head, v in ((1, head1, vocab), (2, head2, vocab2)):
            root = torch.nn.ModuleDict({"norm": norm, "lm_head": head})
            root.train()
            params = E.module_storages(root)
            for s in (s_main, s_half) if tp == 1 else (s_main,):
                x = torch.empty(b, s, h, dtype=dt, requires_grad=True)
                labels = torch.zeros(b, s, dtype=torch.long)
                fn = _output_fn(norm, head, loss_fn, labels, v, getattr(config, "final_logit_softcapping", None))
                for policy in POLICIES:
                    runs[(tp, s, policy)] = _measure(
                        E, fn, x, root, params, {E.storage_key(labels)}, policy, b * s, "output"
                    )
                del x, labels, fn
        records.append(
            _record(runs, "output", 1, s_main, s_half, b, attention,
                    ["TP 2 simulated as a vocabulary-parallel LM head and loss (vocab halved)"], common,
                    experts="")
        )
    del model1, model2
    E.collect()
    elapsed = time.perf_counter() - t_start
    return [_with_note(r, f"census took {elapsed:.1f} s") for r in records]


def _layer_runs(E: Any, model: Any, cfg: Any, idx: int, kind: str, dt: Any, fp32: list[str], b: int,
                seqs: tuple[int, ...], policies: tuple[str, ...]) -> dict[tuple[int, str], Any]:
    """Forward and backward of decoder layer ``idx`` (fake tensors), per sequence length and
    recompute policy; the layer's parameters are released after."""
    import torch

    layer = E.decoder_layers(model)[idx]
    E.materialize(layer, dt, _module_name(model, layer), fp32)
    layer.train()
    params = E.module_storages(layer)
    runs = {}
    for s in seqs:
        x = torch.empty(b, s, int(cfg.hidden_size), dtype=dt, requires_grad=True)
        # what the model's own forward hands this layer: the sliding-window mask (and rotary)
        # where it slides, else the causal mask and its layer type's rotary
        sliding = E.sliding_inputs(model, cfg, x) if E.layer_slides(layer, cfg) else None
        types = getattr(cfg, "layer_types", None)
        extra = sliding if sliding is not None else E.position_inputs(model, cfg, x, *(types[idx:idx + 1] if types else ()))
        shared = {E.storage_key(t) for t in E.tensors_in(extra)}
        fn = E.call_layer_fn(layer, extra)
        for policy in policies:
            runs[(s, policy)] = _measure(E, fn, x, layer, params, shared, policy, b * s, kind)
        del x, extra, fn
    _release(E, layer)
    return runs


def measure_policy(hf_config: dict[str, Any], policy: str, *, seq_length: int = 4096, micro_batch_size: int = 1,
                   dtype: str = "bfloat16", attention: str = "sdpa", experts: str = "grouped_mm") -> dict[str, float]:
    """Bytes per token each decoder-layer kind of ``hf_config`` keeps for backward under one
    recompute policy ('none', 'full', 'selective' or 'torchtitan-op': torchtitan's per-op
    checkpointing), at TP 1: what ``run_census`` measures per policy, for a policy its records
    do not hold."""
    if not isinstance(hf_config, dict):
        raise NdplanError("census: hf_config must be a dict (a Hugging Face config.json)")
    if policy not in ("none", "full", "selective", "torchtitan-op"):
        raise NdplanError(f"census: unknown recompute policy {policy!r}; known: none, full, selective, torchtitan-op")
    _check_args(seq_length, micro_batch_size, dtype, attention, experts)
    torch, _ = _require_torch()
    from ndplan.census import _engine as E

    config = E.make_config(hf_config, attention=attention, experts=experts)
    model = E.build_meta_model(config)
    dt = E.DTYPES[dtype]
    fp32 = E.keep_fp32_patterns(model, dt)
    out = {}
    with E.FakeTensorMode(), E.gpu_kernels([]):
        rotary = E.find_module(model, "rotary_emb")
        if rotary is not None:
            E.materialize(rotary, dt, "model.rotary_emb", fp32)
        for kind, idx, _count in E.layer_kinds(model):
            run = _layer_runs(E, model, config, idx, kind, dt, fp32, micro_batch_size, (seq_length,), (policy,))
            out[kind] = run[(seq_length, policy)].saved_bytes / (micro_batch_size * seq_length)
    del model
    E.collect()
    return out


def _module_name(model: Any, target: Any) -> str:
    for n, m in model.named_modules():
        if m is target:
            return n
    return ""


def _release(E: Any, layer: Any) -> None:
    """Drop the layer's fake parameters (back to meta) so a large model's kinds don't pile up."""
    import torch

    for mod in layer.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[pname] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
                )


def _output_fn(norm: Any, head: Any, loss_fn: Any, labels: Any, vocab: int, softcap: float | None = None) -> Any:
    """Final norm, LM head and loss, the logits soft-capped first where the model caps them
    (Gemma 2: c·tanh(logits/c), as its causal LM's forward does)."""
    import torch

    def fn(x: Any) -> Any:
        logits = head(norm(x))
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return loss_fn(logits=logits, labels=labels, vocab_size=vocab)

    return fn


@contextmanager
def _expert_bias_out_of_place() -> Iterator[None]:
    """transformers' grouped and batched expert linears (integrations.moe) add the experts' bias
    into the matmul's output in place (gpt-oss, whose experts have biases). Selective recompute
    that keeps the matmul's output, the policy measured, cannot run that: torch refuses a cached
    tensor mutated afterwards ("Tensor cached during selective activation checkpoint has been
    mutated"), in a training run as here. Under that policy the bias is added out of place, the
    runnable form of the same layer: the matmul's output is kept and the sum is rebuilt with the
    other elementwise ops. The other policies measure the code as it is."""
    try:
        from transformers.integrations import moe
    except ImportError:  # an older transformers without the shared experts implementations
        yield
        return
    originals = {name: getattr(moe, name, None) for name in ("_grouped_linear", "_batched_linear")}

    def out_of_place(original: Any) -> Any:
        def linear(input: Any, weight: Any, *args: Any, bias: Any = None, **kwargs: Any) -> Any:
            out = original(input, weight, *args, bias=None, **kwargs)
            return out if bias is None else out + bias
        return linear

    try:
        for name, original in originals.items():
            if original is not None:
                setattr(moe, name, out_of_place(original))
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(moe, name, original)


def _measure(E: Any, fn: Any, x: Any, root: Any, params: set[int], shared: set[int], policy: str,
             tokens: int, kind: str) -> Any:
    try:
        with _expert_bias_out_of_place() if policy == "selective" else nullcontext():
            return E.measure_once(fn, x, root=root, params=params, shared=shared, policy=policy, tokens=tokens)
    except NdplanError:
        raise
    except Exception as e:  # a modeling path FakeTensorMode cannot run
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NdplanError(f"census: measuring the {kind!r} layer ({policy} recompute) failed: "
                          f"{type(e).__name__}: {msg}") from e


def _scaling(n1: int, nh: int, t_ratio: float, s_ratio: float) -> str:
    """How one saved storage grows from the half-length run to the full one."""
    if n1 == nh:
        return "constant"
    if nh and abs(n1 / nh - t_ratio * s_ratio) < 1e-9:
        return "token*seq"
    return "token"


def _classify(r1: Any, rh: Any, t_ratio: float, s_ratio: float) -> list[str] | None:
    """Per saved storage of ``r1``: "constant", "token" or "token*seq", by pairing it with the same
    storage (same position, op and module) of the half-length run ``rh``; None if they don't pair."""
    a, b = list(r1.saved.values()), list(rh.saved.values())
    if len(a) != len(b) or any((x.op, x.module) != (y.op, y.module) for x, y in zip(a, b, strict=True)):
        return None
    return [_scaling(x.nbytes, y.nbytes, t_ratio, s_ratio) for x, y in zip(a, b, strict=True)]


def _split(r: Any, classes: list[str] | None) -> tuple[float, float, float]:
    """(constant bytes, token-linear bytes, token*seq bytes) of one run's saved storages."""
    infos = list(r.saved.values())
    if classes is None or len(classes) != len(infos):
        return 0.0, float(r.saved_bytes), 0.0
    const = sum(i.nbytes for i, c in zip(infos, classes, strict=True) if c == "constant")
    quad = sum(i.nbytes for i, c in zip(infos, classes, strict=True) if c == "token*seq")
    return float(const), float(r.saved_bytes - const - quad), float(quad)


def _figures(runs: dict[tuple[int, int, str], Any], policy: str, s_main: int, s_half: int, b: int) -> Recompute:
    """Per-token figures of one policy from its three runs (TP 1 at s and s/2, TP 2 at s).

    Saved bytes: each storage is classed by how it grows from s/2 to s: constant (per layer, e.g.
    grouped-mm offsets, RNG seeds: reported apart, not per token), linear in tokens, or
    tokens*seq (eager attention probabilities: the ``_per_seq`` coefficient). Where the two runs'
    storages don't pair up, a two-point fit of the totals is used instead. The backward peak is a
    maximum over time, so it only gets the two-point fit.
    """
    r1, rh, r2 = runs[(1, s_main, policy)], runs[(1, s_half, policy)], runs[(2, s_main, policy)]
    t1, th = b * s_main, b * s_half
    classes = _classify(r1, rh, t1 / th, s_main / s_half)
    if classes is not None:
        const1, lin1, quad1 = _split(r1, classes)
        const2, lin2, quad2 = _split(r2, classes)
        s1, s2 = (lin1 + quad1) / t1, (lin2 + quad2) / t1
        per_seq = quad1 / t1 / s_main
    else:
        const1 = 0.0
        s1, sh, s2 = r1.saved_bytes / t1, rh.saved_bytes / th, r2.saved_bytes / t1
        per_seq = (s1 - sh) / (s_main - s_half)
    e1, eh = r1.backward_peak_extra / t1, rh.backward_peak_extra / th
    tp_scaled = 2.0 * (s1 - s2)
    return Recompute(
        saved_bytes_per_token=s1,
        saved_tp_scaled_bytes_per_token=tp_scaled,
        saved_replicated_bytes_per_token=s1 - tp_scaled,
        backward_peak_extra_bytes_per_token=e1,
        saved_bytes_per_token_per_seq=per_seq,
        backward_peak_extra_bytes_per_token_per_seq=(e1 - eh) / (s_main - s_half),
        saved_constant_bytes=const1,
    )


def _check_readable(hf_config: dict[str, Any], name: str) -> None:
    """A config of a model_type ndplan reads must read (a hidden_size its heads do not divide, a
    missing field...): its NdplanError, before transformers builds a model it rejects or cannot run."""
    from ndplan.model.hf import READERS, spec_from_hf_config

    if hf_config.get("model_type") in READERS:
        spec_from_hf_config(hf_config, name=name, source=f"census: {name}")


def _architecture(hf_config: dict[str, Any], name: str) -> tuple[tuple[str, Any], ...]:
    """The measured model's layer architecture as ndplan reads its config; () for a model_type
    ndplan has no reader for (the record is then matched by name)."""
    from ndplan.model.hf import spec_from_hf_config

    try:
        return spec_from_hf_config(hf_config, name=name).layer_architecture()
    except NdplanError:
        return ()


def _attention_kernel(ops: list[str], attention: str) -> str:
    for op in ops:
        if "attention" in op and "backward" not in op:
            return op
    # No fused kernel ran: eager attention, or SDPA's math fallback (both keep s x s probabilities).
    return "eager: matmul + softmax" if attention == "eager" else "sdpa math fallback: matmul + softmax"


def _record(runs: dict[tuple[int, int, str], Any], kind: str, count: int, s_main: int, s_half: int, b: int,
            attention: str, notes: list[str], common: dict[str, Any], *, experts: str) -> CensusRecord:
    none = _figures(runs, "none", s_main, s_half, b)
    base = runs[(1, s_main, "none")]
    t1 = b * s_main
    classes = _classify(base, runs[(1, s_half, "none")], s_main / s_half, s_main / s_half) or []
    ops = tuple(
        SavedOp(op=i.op, bytes_per_token=i.nbytes / t1, module=i.module, shape=i.shape, dtype=i.dtype,
                scaling=classes[k] if k < len(classes) else "token")
        for k, i in enumerate(base.saved.values())
    )
    return CensusRecord(
        layer_kind=kind,
        num_layers=count,
        saved_bytes_per_token=none.saved_bytes_per_token,
        saved_tp_scaled_bytes_per_token=none.saved_tp_scaled_bytes_per_token,
        saved_replicated_bytes_per_token=none.saved_replicated_bytes_per_token,
        backward_peak_extra_bytes_per_token=none.backward_peak_extra_bytes_per_token,
        saved_bytes_per_token_per_seq=none.saved_bytes_per_token_per_seq,
        backward_peak_extra_bytes_per_token_per_seq=none.backward_peak_extra_bytes_per_token_per_seq,
        saved_constant_bytes=none.saved_constant_bytes,
        full_recompute=_figures(runs, "full", s_main, s_half, b),
        selective=_figures(runs, "selective", s_main, s_half, b),
        shared_saved_bytes_per_token=base.shared_bytes / t1,
        experts=experts,
        attention_kernel=_attention_kernel(base.ops, attention) if kind != "output" else "",
        saved_ops=ops,
        notes="; ".join(notes),
        **common,
    )


def _with_note(r: CensusRecord, note: str) -> CensusRecord:
    from dataclasses import replace

    return replace(r, notes=f"{r.notes}; {note}" if r.notes else note)


def load_hf_config(path_or_preset: str) -> tuple[str, dict[str, Any]]:
    """A config.json path, a model folder holding one (Hugging Face layout, as ``load_model`` reads
    it), or the name of an ndplan preset (src/ndplan/model/presets/<name>.json)."""
    p = Path(path_or_preset)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise NdplanError(f"{p}: a model folder needs a config.json (Hugging Face layout); none there")
        p = p / "config.json"
    if not p.is_file():
        # As `ndplan estimate --model` says it: a preset in any case; a path that is not there; else
        # the preset meant and the list (it said "no config file or preset named 'llama-3.1-8bb'").
        from ndplan.model.presets import MODEL_FILE_SUFFIXES, hf_config, preset_names

        if path_or_preset.lower() in preset_names():
            return path_or_preset.lower(), hf_config(path_or_preset)
        if p.suffix.lower() in MODEL_FILE_SUFFIXES or len(p.parts) > 1:
            raise NdplanError(f"{p}: no such file")
        raise NdplanError(f"unknown model '{path_or_preset}'{did_you_mean(path_or_preset, preset_names())}; presets: "
                          f"{', '.join(preset_names())} (or give a path to a config.json or a model folder)")
    else:
        name = p.stem if p.name != "config.json" else p.parent.name
    try:
        data = parse_nested(json.loads, read_text(p), f"census: {p}", "JSON")
    except OSError as e:
        raise NdplanError(f"census: cannot read {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        # transformers builds the model from its HF config: an ndplan YAML spec has none
        why = ("; the measurement builds the model with transformers from its config, so an ndplan YAML "
               "model spec cannot be measured") if p.suffix.lower() in (".yaml", ".yml") else ""
        raise NdplanError(f"census: {p} is not a Hugging Face config.json ({e.msg} at line {e.lineno}){why}") from None
    if not isinstance(data, dict):
        raise NdplanError(f"census: {p} is not a JSON object")
    return name, data


__all__ = ["EXTRA_MESSAGE", "run_census", "load_hf_config", "measure_policy"]
