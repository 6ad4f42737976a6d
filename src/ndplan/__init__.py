"""ndplan: plan N-dimensional parallel training of large language models.

The entry points a script needs are importable from here; each loads its module on first use,
so ``import ndplan`` (and the CLI) stays fast::

    import ndplan

    model = ndplan.get_preset("llama-3.1-70b")          # or ndplan.load_model("config.json")
    device = ndplan.get_device("h100-sxm")
    strategy = ndplan.Strategy(dp=2, tp=8, pp=4, sequence_parallel=True, zero=1,
                               num_micro_batches=128, recompute="selective", seq_length=4096)
    options = ndplan.MemoryOptions(runtime="megatron")   # what the runtime saves, re-runs, hides
    memory = ndplan.estimate(model, strategy, device, options, num_devices=64)  # bytes per stage
    cluster = ndplan.Cluster(device=device, num_devices=64)
    time = ndplan.estimate_time(model, strategy, cluster, options=options)  # s per step
    space = ndplan.default_space(model, device, 64, 256, 4096)                # every dimension
    result = ndplan.run_search(model, device, space, options=options)         # ranked, Pareto front

    from ndplan.balance import balance   # a subpackage of the same name: imported from there
    plan = balance(model, strategy, cluster, 60 * 2**30)                      # layers, recompute
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

#: Name -> the module that defines it. No name is also a subpackage's (``balance`` is not here:
#: once ``ndplan.balance`` is imported, the attribute is the package, whichever came first).
_EXPORTS = {
    "ModelSpec": "ndplan.model", "get_preset": "ndplan.model", "load_model": "ndplan.model",
    "preset_names": "ndplan.model", "count_parameters": "ndplan.model",
    "Device": "ndplan.hardware", "Cluster": "ndplan.hardware", "get_device": "ndplan.hardware",
    "resolve_device": "ndplan.hardware", "list_devices": "ndplan.hardware",
    "Strategy": "ndplan.strategy", "StrategyBatch": "ndplan.strategy", "get_precision": "ndplan.strategy",
    "check_strategy": "ndplan.strategy",
    "MemoryOptions": "ndplan.memory", "MemoryReport": "ndplan.memory", "estimate": "ndplan.memory",
    "stage_memory": "ndplan.memory",
    "TimeReport": "ndplan.perf", "estimate_time": "ndplan.perf", "step_time_batch": "ndplan.perf",
    "SearchResult": "ndplan.search", "SearchSpace": "ndplan.search", "default_space": "ndplan.search",
    "run_search": "ndplan.search",
    "BalanceResult": "ndplan.balance",
    "NdplanError": "ndplan.errors",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ndplan' has no attribute '{name}'")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return list(__all__)
