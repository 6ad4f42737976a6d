"""The torch side of the census. Imported only by ``ndplan.census.measure`` once torch is known
to be installed; nothing else in ndplan imports this module.

Three instruments watch one forward + backward of one decoder layer, all under ``FakeTensorMode``
(tensors carry shape, dtype, device and storage identity, but no data and no memory):

* ``SavedRecorder``: ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook notes the storage
  of every tensor autograd saves, de-duplicated per storage (``untyped_storage()._cdata``, the
  StorageImpl's address, stable while the storage lives; FakeTensors have real, distinct
  StorageImpls on the meta device). Parameters, buffers and their views are left out, and so are
  tensors every layer shares (rotary cos/sin, the attention mask): those are counted once per model.
* ``LiveTracker``: a ``TorchDispatchMode`` that sees every aten op. An op output whose schema
  return does not alias an input is a new storage: it is "allocated" (its storage nbytes added to
  the live total) and a ``weakref.finalize`` on the storage object "frees" it when the storage dies
  (storage PyObjects are preserved for as long as the StorageImpl lives, so the finalizer fires
  exactly when the last tensor or view of it goes). It records which op and which submodule made
  each storage, and the peak of the live total.
* Liveness after forward: the tracked storages still alive once the forward returns (other than
  the output) are what the step keeps. For plain autograd this is the same set the pack hook saw;
  under ``torch.utils.checkpoint`` the saved tensors hide behind the checkpoint's own pack hooks and
  the selective-checkpoint cache, so liveness is what finds them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ndplan.errors import NdplanError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Ops whose outputs the selective policy keeps: matmuls and attention kernels.
_SAVE_OP_NAMES = (
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _save_packets() -> frozenset[Any]:
    return frozenset(
        getattr(torch.ops.aten, name) for name in _SAVE_OP_NAMES if hasattr(torch.ops.aten, name)
    )


SELECTIVE_SAVE_OPS = _save_packets()


def storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def storage_nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


# --------------------------------------------------------------------------------------------------
# instruments


class ModuleStack:
    """Which submodule of the layer is running (for naming the op that produced a storage)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def attach(self, root: torch.nn.Module) -> None:
        for name, mod in root.named_modules():
            if not name:
                continue
            self.handles.append(mod.register_forward_pre_hook(functools.partial(self._push, name)))
            self.handles.append(mod.register_forward_hook(functools.partial(self._pop, name), always_call=True))

    def _push(self, name: str, *_: Any) -> None:
        self.stack.append(name)

    def _pop(self, name: str, *_: Any) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()


@dataclass
class StorageInfo:
    nbytes: int
    op: str
    module: str
    shape: tuple[int, ...]
    dtype: str


class LiveTracker(TorchDispatchMode):
    """Tracks live storages created by aten ops, and the peak of their total size."""

    def __init__(self, modules: ModuleStack, external: set[int]) -> None:
        super().__init__()
        self.modules = modules
        self.external = external  # storages that existed before (params, inputs): never counted
        self.live: dict[int, int] = {}
        self.info: dict[int, StorageInfo] = {}
        self.current = 0
        self.peak = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops.append(name)
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(returns) == len(outs):
            pairs = list(zip(returns, outs, strict=True))
        else:  # one Tensor[] return
            pairs = [(returns[0], o) for o in outs] if len(returns) == 1 else []
        for ret, o in pairs:
            items = o if isinstance(o, (tuple, list)) else (o,)
            for t in items:
                if isinstance(t, torch.Tensor) and ret.alias_info is None:
                    self._allocate(t, name)
        return out

    def _allocate(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        key = int(st._cdata)
        if key in self.live or key in self.external:
            return
        nbytes = int(st.nbytes())
        self.live[key] = nbytes
        self.info[key] = StorageInfo(nbytes, f"aten.{op.split('.')[-1]}" if op.startswith("aten.") else op,
                                     self.modules.current, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key).atexit = False

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


class SavedRecorder:
    """``saved_tensors_hooks`` pack/unpack that note what autograd saves, per storage."""

    def __init__(self, excluded: set[int], shared: set[int]) -> None:
        self.excluded = excluded
        self.shared = shared
        self.saved: dict[int, StorageInfo] = {}
        self.shared_saved: dict[int, int] = {}
        self.active = True

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            st = t.untyped_storage()
            key = int(st._cdata)
            if key in self.shared:
                self.shared_saved[key] = int(st.nbytes())
            elif key not in self.excluded and key not in self.saved:
                self.saved[key] = StorageInfo(int(st.nbytes()), "", "", tuple(t.shape),
                                              str(t.dtype).replace("torch.", ""))
                # A saved tensor of a graph branch that does not reach the output (e.g. a router's
                # integer top-k indices) dies with that branch during forward: it is not kept.
                weakref.finalize(st, self.saved.pop, key, None).atexit = False
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


# --------------------------------------------------------------------------------------------------
# one measurement


@dataclass
class RunResult:
    tokens: int
    saved: dict[int, StorageInfo]  # storage -> info, in the order first seen
    shared_bytes: int
    backward_peak_extra: int
    ops: list[str] = field(default_factory=list)
    live_only: int = 0  # storages kept alive after forward that no pack hook saw (checkpoint caches)

    @property
    def saved_bytes(self) -> int:
        return sum(i.nbytes for i in self.saved.values())


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op.overloadpacket in SELECTIVE_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


#: torchtitan's per-op selective checkpointing (selective_ac_option "op", its ``_op_sac_save_list``):
#: it saves these ops' outputs, but of the matmuls only the odd-numbered ones of each layer's
#: forward. The CPU flash kernel stands in for the CUDA one on the census's fake tensors.
_OP_SAC_SAVE_NAMES = ("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                      "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_flash_attention_for_cpu",
                      "max")


def _op_sac_contexts() -> Any:
    """A fresh torchtitan per-op policy for one checkpointed call (its matmul count restarts)."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {getattr(torch.ops.aten, name) for name in _OP_SAC_SAVE_NAMES if hasattr(torch.ops.aten, name)}
    reduce_scatter = getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)
    if reduce_scatter is not None:
        saved.add(reduce_scatter)
    count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if op.overloadpacket is torch.ops.aten.mm:
            count[mode] += 1
            keep = count[mode] % 2 == 1
        else:
            keep = op.overloadpacket in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return torch_checkpoint.create_selective_checkpoint_contexts(policy)


def _wrap(fn: Callable[[torch.Tensor], torch.Tensor], policy: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if policy == "none":
        return fn
    if policy == "full":
        return lambda x: torch_checkpoint.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)
    if policy == "selective":
        context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _selective_policy)
        return lambda x: torch_checkpoint.checkpoint(
            fn, x, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn
        )
    if policy == "torchtitan-op":
        return lambda x: torch_checkpoint.checkpoint(
            fn, x, use_reentrant=False, preserve_rng_state=False, context_fn=_op_sac_contexts
        )
    raise NdplanError(f"unknown recompute policy {policy!r}")


def measure_once(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    root: torch.nn.Module,
    params: set[int],
    shared: set[int],
    policy: str,
    tokens: int,
) -> RunResult:
    """Forward + backward of ``fn(x)`` once; what it saved and the backward's working set."""
    modules = ModuleStack()
    modules.attach(root)
    x_key = storage_key(x)
    tracker = LiveTracker(modules, external=params | shared | {x_key})
    recorder = SavedRecorder(excluded=params, shared=shared)
    call = _wrap(fn, policy)
    try:
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
                out = call(x)
            if isinstance(out, (tuple, list)):
                out = out[0]
            recorder.active = False
            out_key = storage_key(out)
            # What the step keeps: what autograd saved, plus whatever else forward left alive
            # (checkpoint inputs and the selective-checkpoint cache), less the output itself.
            keep: dict[int, StorageInfo] = {}
            for key, info in recorder.saved.items():
                tracked = tracker.info.get(key) if key in tracker.live else None
                if tracked is not None:
                    keep[key] = tracked
                elif key == x_key:
                    keep[key] = StorageInfo(info.nbytes, "input", "", info.shape, info.dtype)
                else:
                    keep[key] = StorageInfo(info.nbytes, "external", "", info.shape, info.dtype)
            hooked = len(keep)
            for key in list(tracker.live):
                if key != out_key and key not in keep:
                    keep[key] = tracker.info[key]
            live_only = len(keep) - hooked
            grad_out = torch.ones_like(out)
            start = tracker.current
            tracker.peak = start
            grads = torch.autograd.grad(out, [x], grad_out)
            peak_extra = tracker.peak - start
            del grads, grad_out, out
    finally:
        modules.detach()
    return RunResult(
        tokens=tokens,
        saved=keep,
        shared_bytes=sum(recorder.shared_saved.values()),
        backward_peak_extra=peak_extra,
        ops=tracker.ops,
        live_only=live_only,
    )


# --------------------------------------------------------------------------------------------------
# SDPA: the kernel a GPU would run where the CPU would fall back to the math path


@contextlib.contextmanager
def gpu_sdpa_kernels(used: list[str]) -> Iterator[None]:
    """Patch ``F.scaled_dot_product_attention`` for the census.

    On CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which saves what CUDA flash
    attention saves (q, k, v, out, logsumexp). Two cases differ from CUDA:

    * fp32 with grouped KV heads and no mask: CUDA has no fused kernel (flash takes 16-bit only,
      memory-efficient no grouped heads) and runs the math path, which keeps the s x s
      probabilities; so does this.
    * MLA (the value head dim differs from the query/key head dim): the CPU kernel cannot run it
      and falls back to the math path, while a GPU runs the memory-efficient kernel. Under
      FakeTensorMode the CUDA kernels' meta implementations run on CPU tensors, so this calls
      ``aten._scaled_dot_product_efficient_attention`` as the GPU would.

    ``used`` collects a note (a sentence) each time either emulation runs.
    """
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        # The CPU flash kernel needs one head dim for q, k and v (``torch._fused_sdp_choice`` cannot
        # tell under FakeTensorMode: its fake kernel always answers "math").
        if (enable_gqa and attn_mask is None and query.dtype == torch.float32
                and key.shape[-3] != query.shape[-3]):
            # CUDA has no fused kernel for this (flash: 16-bit only; memory-efficient: no grouped
            # KV heads), so SDPA runs its math path there; the CPU's flash kernel would take it.
            from torch.nn.attention import SDPBackend, sdpa_kernel

            used.append("SDPA ran its math path as CUDA does for fp32 with grouped KV heads "
                        "(the CPU's flash kernel would take it)")
            with sdpa_kernel(SDPBackend.MATH):
                return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                scale=scale, enable_gqa=enable_gqa)
        cpu_math = value.shape[-1] != query.shape[-1]
        same_heads = query.shape[-3] == key.shape[-3] == value.shape[-3]
        if (cpu_math and query.shape[-1] == key.shape[-1] and query.dtype in (torch.float16, torch.bfloat16)
                and same_heads and query.shape[-1] % 8 == 0 and value.shape[-1] % 8 == 0):
            used.append("SDPA ran aten._scaled_dot_product_efficient_attention as a GPU would "
                        "(the CPU kernel would fall back to the math path)")
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
            )
            return out[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def gpu_kernels(used: list[str]) -> Iterator[None]:
    """The GPU kernels the census stands in for: SDPA's (``gpu_sdpa_kernels``) and Gated DeltaNet's
    (``ndplan.census.kernels``). ``used`` collects a note each time one runs."""
    from ndplan.census.kernels import gated_deltanet_kernels

    with gpu_sdpa_kernels(used), gated_deltanet_kernels(used):
        yield


# --------------------------------------------------------------------------------------------------
# building layers from a Hugging Face config

_DROP_CONFIG_KEYS = (
    "model_type",
    "architectures",
    "transformers_version",
    "auto_map",
    "torch_dtype",
    "dtype",
    "quantization_config",
    "_name_or_path",
    "name_or_path",
)

_WIDTH_FIELDS = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_intermediate_size",
    "ffn_hidden_size",
)


def make_config(hf_config: dict[str, Any], *, attention: str, experts: str) -> Any:
    import transformers

    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise NdplanError("census: the config has no 'model_type'")
    fields = {k: v for k, v in hf_config.items() if k not in _DROP_CONFIG_KEYS}
    from huggingface_hub.errors import StrictDataclassError  # transformers' config validation

    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        message = " ".join(str(e).split())  # one line: strict validation reports span several
        # An unknown model_type lists every type transformers knows (~900, 10 KB): name a few.
        message = message if len(message) <= 300 else message[:300].rsplit(" ", 1)[0] + " ..."
        raise NdplanError(f"census: transformers cannot build a {model_type!r} config: {message}") from None
    config._attn_implementation = attention
    config.use_cache = False
    config.census_experts = experts  # applied in build_meta_model where the model supports it
    return config


def tp2_config(config: Any) -> tuple[Any, list[str]]:
    """The config one rank of TP 2 would run: heads, KV heads and FFN/expert widths halved."""
    c = copy.deepcopy(config)
    notes: list[str] = []
    heads = getattr(c, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % 2:
        raise NdplanError(f"census: cannot simulate TP 2 with {heads} attention heads (needs an even count)")
    kv = getattr(c, "num_key_value_heads", None)
    # A config without head_dim takes hidden_size / heads in transformers' modeling code (qwen2,
    # mixtral, qwen2_moe): halving the heads would double it, and no projection would shrink.
    if not getattr(c, "head_dim", None) and isinstance(getattr(c, "hidden_size", None), int):
        c.head_dim = c.hidden_size // heads
    c.num_attention_heads = heads // 2
    if isinstance(kv, int):
        if kv % 2 == 0:
            c.num_key_value_heads = kv // 2
        else:
            notes.append(f"{kv} KV head(s) replicated at TP 2")
    for name in _WIDTH_FIELDS:
        v = getattr(c, name, None)
        if isinstance(v, int) and v > 0:
            setattr(c, name, v // 2)
    # A Gated DeltaNet's key and value heads, split as the attention heads are.
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        v = getattr(c, name, None)
        if isinstance(v, int) and v > 0 and any(t == "linear_attention" for t in getattr(c, "layer_types", None) or ()):
            if v % 2:
                raise NdplanError(f"census: cannot simulate TP 2 with {name}={v} (needs an even count)")
            setattr(c, name, v // 2)
    return c, notes


def fit_projection_norms(model: Any) -> Any:
    """``model`` with every q/k norm wider than its projection narrowed to it: OLMoE sizes its
    q/k norms, which normalise the whole projection, by hidden_size and kv_heads x (hidden_size
    / heads), not by the projection's width, so the TP-2 config's halved heads leave them twice
    too wide; a TP rank normalises (and holds the weights of) its own heads' share."""
    for module in model.modules():
        for projection_name, norm_name in (("q_proj", "q_norm"), ("k_proj", "k_norm")):
            projection, norm = getattr(module, projection_name, None), getattr(module, norm_name, None)
            weight = getattr(norm, "weight", None)
            width = getattr(projection, "out_features", None)
            if norm is not None and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 \
                    and isinstance(width, int) and weight.shape[0] > width:
                norm.weight = torch.nn.Parameter(torch.empty(width, dtype=weight.dtype, device=weight.device))
    return model


def build_meta_model(config: Any) -> Any:
    import transformers

    try:
        model_cls: Any = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise NdplanError(
            f"census: transformers has no causal-LM model for model_type {config.model_type!r}"
        ) from None
    experts = getattr(config, "census_experts", None)
    if experts and model_cls._can_set_experts_implementation():
        config._experts_implementation = experts
    # Inside a FakeTensorMode (a measured step builds its stage's model there) torch.tensor(x)
    # under the meta device makes a real meta tensor the mode then refuses (Gemma 3's embedding
    # scale buffer): build outside the mode, then hand the mode every tensor, as it would have made them.
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    fake = detect_fake_mode()
    try:
        with unset_fake_temporarily() if fake is not None else contextlib.nullcontext(), torch.device("meta"), \
                _quiet_transformers():
            model = model_cls(config)
    except ValueError as error:  # transformers refuses an attention kernel the model lacks
        attention = getattr(config, "_attn_implementation", None)
        hint = "; try --attention eager" if attention == "sdpa" else ""
        raise NdplanError(f"census: transformers cannot build {config.model_type!r} with attention "
                          f"{attention!r}{hint} ({str(error).splitlines()[0][:160]})") from None
    except RuntimeError as error:  # torch refuses a size the config gives (a negative head_dim, ...)
        raise NdplanError(f"census: transformers cannot build {config.model_type!r} from this config: "
                          f"{str(error).splitlines()[0][:160]}") from None
    if fake is not None:
        for module in model.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None:
                    module._parameters[name] = torch.nn.Parameter(fake.from_tensor(parameter),
                                                                   requires_grad=parameter.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = fake.from_tensor(buffer)
    if getattr(model.config, "_attn_implementation", None) != config._attn_implementation:
        raise NdplanError(
            f"census: transformers chose attention {model.config._attn_implementation!r}, "
            f"not {config._attn_implementation!r}"
        )
    return model


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def decoder_layers(model: Any) -> Any:
    n = model.config.num_hidden_layers
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            return mod
    raise NdplanError("census: cannot find the model's decoder layers")


def find_module(model: Any, suffix: str) -> Any:
    base = getattr(model, "model", model)
    return getattr(base, suffix, None)


def keep_fp32_patterns(model: Any, dtype: torch.dtype) -> list[str]:
    pats = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        pats += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return pats


def materialize(module: torch.nn.Module, dtype: torch.dtype, prefix: str, fp32: list[str]) -> None:
    """Replace meta parameters and buffers by (fake, inside FakeTensorMode) CPU tensors."""
    for mname, mod in module.named_modules():
        full = f"{prefix}.{mname}" if mname else prefix
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            pname_full = f"{full}.{pname}"
            target = p.dtype
            if p.is_floating_point():
                target = torch.float32 if any(pat in pname_full for pat in fp32) else dtype
            mod._parameters[pname] = torch.nn.Parameter(
                torch.empty(p.shape, dtype=target, device="cpu"), requires_grad=p.requires_grad
            )
        for bname, b in list(mod._buffers.items()):
            if b is None:
                continue
            mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device="cpu")


def layer_kinds(model: Any) -> list[tuple[str, int, int]]:
    """[(kind, first layer index, number of layers)] for the distinct decoder layers. Where some
    layers slide and others attend in full (gpt-oss, Gemma 3, OLMo 3) the sliding ones are a kind
    of their own, '<kind>-sliding': from the window on, the model hands them another mask."""
    layers = decoder_layers(model)
    config = getattr(model, "config", None)
    groups: dict[Any, list[int]] = {}
    for i, layer in enumerate(layers):
        sig = (
            type(layer).__name__,
            config is not None and layer_slides(layer, config),
            tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()),
        )
        groups.setdefault(sig, []).append(i)
    spans = {sig[1] for sig in groups}
    named: list[tuple[str, int, int]] = []
    used: set[str] = set()
    for sig, idxs in groups.items():
        layer = layers[idxs[0]]
        mla = any(n.endswith("kv_a_proj_with_mqa") for n, _ in layer.named_modules()) or hasattr(
            getattr(layer, "self_attn", None), "kv_lora_rank"
        )
        # A layer with routed experts: fused 3-D expert weights (not a Gated DeltaNet's convolution),
        # or a module list of experts. (Not
        # by class names: a family's prefix can say MoE on every class, GLM-4.5's dense layers'
        # Glm4MoeMLP and Qwen3-MoE's Qwen3MoeDecoderLayer included.)
        moe = any(p.dim() == 3 and not n.startswith("linear_attn.") for n, p in layer.named_parameters()) or any(
            name.rsplit(".", 1)[-1] == "experts" for name, _ in layer.named_modules()
        )
        name = ("mla-" if mla else "") + ("moe" if moe else "dense")
        if len(spans) > 1 and sig[1]:
            name += "-sliding"
        if is_linear_attention(layer) and len(groups) > 1:  # beside softmax layers: a kind of its own
            name += "-linear"
        if name in used:
            name += f"-{idxs[0]}"
        used.add(name)
        named.append((name, idxs[0], len(idxs)))
    return named


def is_linear_attention(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer mixes tokens through a Gated DeltaNet (Qwen3-Next, Qwen3.5's
    'linear_attention' layers) instead of softmax attention."""
    return getattr(layer, "linear_attn", None) is not None


def call_layer_fn(layer: torch.nn.Module, extra: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    params = inspect.signature(layer.forward).parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in extra.items() if k in params or has_var_kw}

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = layer(x, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    return fn


def position_inputs(model: Any, config: Any, x: torch.Tensor, layer_type: str = "full_attention") -> dict[str, Any]:
    """Position ids, rotary (cos, sin) and the attention mask, as the model computes them; the
    rotary of ``layer_type`` where the model has one per layer type (OLMo 3, Gemma 3: its own
    base frequency for sliding layers)."""
    b, s, _ = x.shape
    position_ids = torch.arange(s, device="cpu").unsqueeze(0)
    extra: dict[str, Any] = {"position_ids": position_ids, "use_cache": False}
    rotary = find_module(model, "rotary_emb")
    if rotary is not None:
        if "layer_type" not in inspect.signature(rotary.forward).parameters:
            extra["position_embeddings"] = rotary(x, position_ids)
        elif layer_type in getattr(rotary, "layer_types", (layer_type,)):  # (no layer of another type)
            extra["position_embeddings"] = rotary(x, position_ids, layer_type=layer_type)
    # position_ids=None here: with FakeTensor position ids transformers cannot rule out packed
    # sequences and would build a full mask; for one unpacked sequence per row (what the census
    # measures) the model builds the same mask as with position_ids=None.
    from transformers.masking_utils import create_causal_mask

    try:
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None)
    except TypeError:  # the transformers 4.x signature
        mask = create_causal_mask(
            config=config, input_embeds=x, attention_mask=None, cache_position=torch.arange(s),
            past_key_values=None, position_ids=None,
        )
    # A Gated DeltaNet layer gets the padding mask alone, None without padding (transformers'
    # create_recurrent_attention_mask), never the causal one.
    extra["attention_mask"] = None if layer_type == "linear_attention" else mask
    return extra


def sliding_inputs(model: Any, config: Any, x: torch.Tensor) -> dict[str, Any] | None:
    """What a sliding layer receives from the model's forward: the mask transformers gives
    sliding-window layers instead of the causal one, with their rotary (None where the config
    has no window)."""
    if not getattr(config, "sliding_window", None):
        return None
    from transformers.masking_utils import create_sliding_window_causal_mask

    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None)
    return {**position_inputs(model, config, x, "sliding_attention"), "attention_mask": mask}


def layer_slides(layer: torch.nn.Module, config: Any) -> bool:
    """Whether transformers gives ``layer`` the sliding-window mask: ``config.layer_types`` at
    the layer's index where the model has layer types (Qwen2/3, Qwen2-MoE, gpt-oss), else every
    layer of a config with a window (Mistral)."""
    types = getattr(config, "layer_types", None)
    attention = next((m for name, m in layer.named_modules() if name.endswith("self_attn")), None)
    index = getattr(attention, "layer_idx", None)
    if types and isinstance(index, int) and 0 <= index < len(types):
        return bool(types[index] == "sliding_attention")
    return bool(getattr(config, "sliding_window", None))


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def module_storages(module: torch.nn.Module) -> set[int]:
    keys = {storage_key(p) for p in module.parameters()}
    keys |= {storage_key(b) for b in module.buffers()}
    return keys


def collect() -> None:
    gc.collect()


__all__ = [
    "DTYPES",
    "FakeTensorMode",
    "LiveTracker",
    "ModuleStack",
    "RunResult",
    "SavedRecorder",
    "build_meta_model",
    "call_layer_fn",
    "collect",
    "decoder_layers",
    "find_module",
    "gpu_kernels",
    "gpu_sdpa_kernels",
    "layer_slides",
    "sliding_inputs",
    "keep_fp32_patterns",
    "layer_kinds",
    "make_config",
    "materialize",
    "measure_once",
    "module_storages",
    "position_inputs",
    "fit_projection_norms",
    "storage_key",
    "tensors_in",
    "tp2_config",
]
