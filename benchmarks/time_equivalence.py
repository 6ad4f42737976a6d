"""Check that a change to the step-time model returns the same figures: record, then compare.

    .venv/bin/python benchmarks/time_equivalence.py record figures.pkl [--count 100000]
    .venv/bin/python benchmarks/time_equivalence.py compare figures.pkl [--count 100000]

``record`` prices random valid mixed strategies (``bench_time.mixed_strategies``: DeepSeek-V3 on
2048 H100, Llama-3.1-405B on 1024, and the dense Llama-3.1-8B on 64) with ``step_time_batch``
and with ``evaluate(..., details=True)`` (closed-form pipelines), under the default options
(no runtime keywords) and each runtime profile's ``MemoryOptions(runtime).time_keywords()``
(``pytorch``, ``megatron``), and stores every output array; then a quarter of the batch again
in fp8 with the rarer paths: partial recompute (``recompute_layers``), selective recompute of
named modules and activation offload; and that quarter without named modules under
torchtitan's per-op selective recompute. ``compare`` prices the same
batches with the code now imported and reports every difference: integer arrays must be
equal, floats equal or within 1e-12 relative. It exits 1 if any differs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_time import mixed_strategies  # noqa: E402
from equivalence import array_figures_main  # noqa: E402

from ndplan.hardware import get_device  # noqa: E402
from ndplan.hardware.device import Cluster  # noqa: E402
from ndplan.memory import MemoryOptions  # noqa: E402
from ndplan.model import get_preset  # noqa: E402
from ndplan.perf import step_time_batch  # noqa: E402
from ndplan.perf.step import evaluate  # noqa: E402
from ndplan.strategy import StrategyBatch, get_precision  # noqa: E402

CASES = (("deepseek-v3", 2048), ("llama-3.1-405b", 1024), ("llama-3.1-8b", 64))
#: None: step_time_batch's own defaults; else the runtime profile whose time keywords are passed.
RUNTIMES = (None, "pytorch", "megatron")


def figures(count: int) -> dict[str, np.ndarray]:
    """Every array the cases produce, keyed by case, options, function and output."""
    out: dict[str, np.ndarray] = {}
    device = get_device("h100-sxm")
    for name, devices in CASES:
        model = get_preset(name)
        cluster = Cluster(device=device, num_devices=devices)
        batch = mixed_strategies(model, devices, count)
        for runtime in RUNTIMES:
            keywords: dict[str, Any] = {} if runtime is None else MemoryOptions(runtime=runtime).time_keywords()
            label = f"{name} {runtime or 'default'}"
            started = time.process_time()
            for key, value in step_time_batch(model, batch, cluster, **keywords).items():
                out[f"{label} step_time_batch {key}"] = value
            for key, value in evaluate(model, batch, cluster, pipeline="closed_form", details=True, **keywords).items():
                out[f"{label} evaluate {key}"] = value
            print(f"{label}: {len(batch):,} strategies, {time.process_time() - started:.2f} s CPU", file=sys.stderr)
        rare = rarer_paths(batch.take(np.arange(count // 4)), model.num_layers)
        titan = StrategyBatch.from_columns({name: getattr(rare, name) for name in StrategyBatch.array_fields()},
                                           rare.precision)
        for label, priced, keywords in ((f"{name} rare", rare, {}),
                                        (f"{name} torchtitan-op", titan,
                                         {"software": {"selective_recompute": "torchtitan-op"}})):
            for key, value in step_time_batch(model, priced, cluster, **keywords).items():
                out[f"{label} step_time_batch {key}"] = value
            for key, value in evaluate(model, priced, cluster, pipeline="closed_form", details=True, **keywords).items():
                out[f"{label} evaluate {key}"] = value
    return out


def rarer_paths(batch: StrategyBatch, num_layers: int, seed: int = 1) -> StrategyBatch:
    """``batch`` in fp8 recomputing a random number of each chunk's layers (where it recomputes),
    selectively the attention core and the MLP, and offloading the attention core's activations."""
    rng = np.random.default_rng(seed)
    per_chunk = -(-num_layers // (batch.pp * batch.vpp))
    columns = {name: getattr(batch, name) for name in StrategyBatch.array_fields()}
    columns["recompute_layers"] = np.where(batch.recompute > 0, rng.integers(0, 1 << 20, len(batch)) % (per_chunk + 1), 0)
    return StrategyBatch.from_columns(columns, get_precision("megatron-fp8"), recompute_modules=("core_attn", "mlp"),
                                      offload_modules=("core_attn",))


def main() -> None:
    array_figures_main(__doc__ or "", figures, 100_000)


if __name__ == "__main__":
    main()
