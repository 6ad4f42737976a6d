"""Which launches of a runtime add their weight gradients apart, though the runtime fuses by default.

Megatron-Core accumulates each weight gradient inside the weight-gradient GEMM by default
(``EfficiencyProfile.gradient_accumulation_fusion``), but some of its launches cannot:

* torch FSDP2 (``--use-torch-fsdp2``, the only Megatron FSDP that keeps the parameters
  gathered after the forward): validate_args refuses it with the fusion;
* Megatron-FSDP beside expert data parallelism: Megatron-Core's FullyShardedDataParallel
  asserts "Megatron-FSDP with gradient_accumulation_fusion does not support data parallelism
  when expert parallelism is enabled" (a MoE model whose expert data-parallel group,
  dp·cp·tp / (ep·etp), has more than one rank);
* Megatron-FSDP on Ascend NPUs: MindSpeed's Megatron-FSDP guide runs it without the fusion.

Those launches write ``--no-gradient-accumulation-fusion`` (``io.megatron_emit``), and the step
time prices them so (``EfficiencyProfile.gradient_accumulation_rules``): one function, over
columns, serves both, so that a searched plan costs what its launch, read back, costs. Each is
priced as Megatron's separate add into its fp32 buffer (a + 2·g bytes a weight, every
micro-batch); torch FSDP2 accumulates into its unsharded gradients instead (autograd's add,
about 3·a bytes a weight), which that price bounds from above.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ndplan.model import ModelSpec
from ndplan.perf.efficiency import EfficiencyProfile
from ndplan.strategy import Strategy, StrategyBatch
from ndplan.strategy.precision import PrecisionPolicy

Array = np.ndarray

#: Codes of ``megatron_unfused_accumulation``: why a row runs without the fusion.
FUSED, TORCH_FSDP2, MEGATRON_FSDP_EXPERT_DP, MEGATRON_FSDP_NPU = 0, 1, 2, 3


def torch_fsdp2_rows(model: ModelSpec | None, columns: Mapping[str, Array], fp16: bool) -> Array:
    """Rows that Megatron runs as torch FSDP2: ZeRO-3 that keeps the parameters gathered after
    the forward (``reshard_after_forward`` off), where validate_args allows torch FSDP2: no
    pipeline or expert parallelism, untied embeddings, not fp16, and no shard group (Megatron's
    wrapper shards over the whole dp·cp group). ``columns``: Strategy fields, as arrays."""
    zero = np.asarray(columns["zero"])
    runs = (zero == 3) & (np.asarray(columns["reshard_after_forward"]) == 0)
    runs &= (np.asarray(columns["pp"]) == 1) & (np.asarray(columns["ep"]) == 1)
    runs &= np.asarray(columns["shard_group"]) == 0
    if fp16 or (model is not None and model.tie_word_embeddings):
        runs &= False
    return runs


def megatron_unfused_accumulation(model: ModelSpec | None, columns: Mapping[str, Array], fp16: bool,
                                  npu: bool) -> Array:
    """Per row, why Megatron's launch of it turns gradient-accumulation fusion off (int8 codes:
    ``FUSED`` where it keeps it, else ``TORCH_FSDP2``, ``MEGATRON_FSDP_EXPERT_DP`` or
    ``MEGATRON_FSDP_NPU``; see the module docstring). Megatron-FSDP is ZeRO-2, and ZeRO-3 that
    is not torch FSDP2. ``columns``: Strategy fields (zero, reshard_after_forward, pp, ep, etp,
    tp, dp, cp, shard_group), as arrays of any numeric dtype; ``fp16``: the batch computes in fp16."""
    zero = np.asarray(columns["zero"])
    torch_fsdp2 = torch_fsdp2_rows(model, columns, fp16)
    megatron_fsdp = ((zero == 2) | (zero == 3)) & ~torch_fsdp2
    codes = np.where(torch_fsdp2, TORCH_FSDP2, FUSED).astype(np.int8)
    if npu:
        codes[megatron_fsdp] = MEGATRON_FSDP_NPU
    elif model is not None and model.is_moe:
        ranks = np.asarray(columns["dp"]) * np.asarray(columns["cp"]) * np.asarray(columns["tp"])
        expert_dp = ranks // (np.asarray(columns["ep"]) * np.asarray(columns["etp"]))
        codes[megatron_fsdp & (expert_dp > 1)] = MEGATRON_FSDP_EXPERT_DP
    return codes


def unfused_reason(code: int, expert_dp: int | None = None) -> str:
    """Why a launch of ``megatron_unfused_accumulation``'s ``code`` runs without the fusion, in
    words ('' for ``FUSED``); ``expert_dp``: its expert data-parallel ranks, where said."""
    if code == TORCH_FSDP2:
        return "Megatron runs this FSDP as torch FSDP2, which validate_args refuses beside gradient-accumulation fusion"
    if code == MEGATRON_FSDP_EXPERT_DP:
        ranks = f" ({expert_dp} ranks)" if expert_dp is not None else ""
        return f"Megatron-Core's Megatron-FSDP refuses gradient-accumulation fusion beside expert data parallelism{ranks}"
    if code == MEGATRON_FSDP_NPU:
        return "MindSpeed's Megatron-FSDP runs without gradient-accumulation fusion"
    return ""


def rules_apply(eff: EfficiencyProfile) -> bool:
    """Whether the runtime's rules may turn the fusion off for some strategies: it has rules,
    and the fusion is not already off for every one."""
    return eff.gradient_accumulation_fusion and eff.gradient_accumulation_rules == "megatron"


def _rule_codes(model: ModelSpec, columns: Mapping[str, Array], eff: EfficiencyProfile,
                precision: PrecisionPolicy) -> Array | None:
    """``megatron_unfused_accumulation``'s codes where ``eff``'s rules apply (``rules_apply``), else None."""
    if not rules_apply(eff):
        return None
    return megatron_unfused_accumulation(model, columns, precision.compute_dtype == "fp16",
                                         eff.family.startswith("davinci"))


def unfused_note(why: str, overridden: bool = False) -> str:
    """The line that says a launch adds its weight gradients apart, and ``why`` (its
    ``launch_efficiency`` reason); ``overridden``: the user stated the fusion on."""
    asked = ", not as --gradient-accumulation-fusion asks" if overridden else ""
    return f"weight gradients added to their buffers by a kernel of their own after the GEMM (priced{asked}): {why}"


def forced_unfused(model: ModelSpec, columns: Mapping[str, Array], eff: EfficiencyProfile,
                   precision: PrecisionPolicy) -> Array | None:
    """Rows whose launch adds its weight gradients apart although ``eff`` fuses the
    accumulation, by the runtime's rules (``eff.gradient_accumulation_rules``); None where no
    rule applies. ``columns``: Strategy fields, as arrays."""
    codes = _rule_codes(model, columns, eff, precision)
    return None if codes is None else codes > FUSED


def launch_efficiency(eff: EfficiencyProfile, model: ModelSpec, strategy: Strategy) -> tuple[EfficiencyProfile, str]:
    """(``eff`` as the launch of ``strategy`` runs, why it differs or ''): gradient-accumulation
    fusion off where the runtime's rules turn it off for this strategy, so that one estimate
    (its kernel lines, ``--explain``) says what the batch path prices for it."""
    batch = StrategyBatch.of(strategy)
    codes = _rule_codes(model, strategy_rule_columns(batch), eff, batch.precision)
    if codes is None or codes[0] == FUSED:
        return eff, ""
    return eff.replace(gradient_accumulation_fusion=False), unfused_reason(int(codes[0]), expert_data_parallel(strategy))


def strategy_code(model: ModelSpec | None, strategy: Strategy, fp16: bool, npu: bool) -> int:
    """``megatron_unfused_accumulation``'s code of one strategy (the Megatron emitter's; ``fp16``:
    its precision computes in fp16)."""
    return int(megatron_unfused_accumulation(model, strategy_rule_columns(StrategyBatch.of(strategy)), fp16, npu)[0])


def expert_data_parallel(strategy: Strategy) -> int:
    """Ranks of a strategy's expert data-parallel group: dp·cp·tp / (ep·etp)."""
    return strategy.dp * strategy.cp * strategy.tp // (strategy.ep * strategy.etp)


def strategy_rule_columns(batch: StrategyBatch) -> dict[str, Array]:
    """The batch's fields the rules read."""
    return {name: getattr(batch, name) for name in ("zero", "reshard_after_forward", "pp", "ep", "etp", "tp", "dp",
                                                     "cp", "shard_group")}
