"""Check that a change to the memory model returns the same figures: record, then compare.

    .venv/bin/python benchmarks/memory_equivalence.py record figures.pkl [--count 200000]
    .venv/bin/python benchmarks/memory_equivalence.py compare figures.pkl [--count 200000]

``record`` prices random valid strategies (``bench_memory.random_batch``: DeepSeek-V3 on 4096
devices, Llama-3.1-405B on 16384, and the dense Llama-3.1-8B on 64) with ``stage_memory``
(every category, every stage), ``peak_memory`` and ``static_lower_bound``, under the default
(``pytorch``) runtime profile and the ``megatron`` one, and stores every array. ``compare``
prices the same batches with the code now imported and reports every difference: integer arrays
must be equal, floats equal or within 1e-12 relative. It exits 1 if any differs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_memory import random_batch  # noqa: E402
from equivalence import array_figures_main  # noqa: E402

from ndplan.memory import MemoryOptions, stage_memory  # noqa: E402
from ndplan.memory.stages import peak_memory, static_lower_bound  # noqa: E402
from ndplan.model import get_preset  # noqa: E402

CASES = (("deepseek-v3", 4096), ("llama-3.1-405b", 16384), ("llama-3.1-8b", 64))
RUNTIMES = ("pytorch", "megatron")
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "transient", "optimizer_step",
              "forward_backward", "allocated", "reserved", "device")


def figures(count: int) -> dict[str, np.ndarray]:
    """Every array the cases produce, keyed by case, runtime and figure."""
    out: dict[str, np.ndarray] = {}
    for name, devices in CASES:
        model = get_preset(name)
        batch = random_batch(name, count, devices)
        for runtime in RUNTIMES:
            options = MemoryOptions(runtime=runtime)
            label = f"{name} {runtime}"
            started = time.process_time()
            memory = stage_memory(model, batch, options)
            for category in CATEGORIES:
                out[f"{label} stage {category}"] = getattr(memory, category)
            peak, stage = peak_memory(model, batch, options)
            out[f"{label} peak"], out[f"{label} peak stage"] = peak, stage
            out[f"{label} static bound"] = static_lower_bound(model, batch, options)
            print(f"{label}: {len(batch):,} strategies, {time.process_time() - started:.2f} s CPU", file=sys.stderr)
    return out


def main() -> None:
    array_figures_main(__doc__ or "", figures, 200_000)


if __name__ == "__main__":
    main()
