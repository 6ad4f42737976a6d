"""Memory evaluations per second over 1M mixed strategies (DeepSeek-V3 and Llama-3.1-405B).

    .venv/bin/python benchmarks/bench_memory.py [--count 1000000]

Strategies are drawn at random from the full space and kept if valid and not drawn before (the
rule masks are part of the search, not of this figure; a repeated strategy is priced once); the
timer covers the memory model over the valid batch only:
stage_memory (every stage, every category) cold and warm, and peak_memory (each strategy's
largest stage, what the search asks for).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ndplan.memory import MemoryOptions, stage_memory
from ndplan.memory.stages import peak_memory
from ndplan.model import get_preset
from ndplan.strategy import RuleContext, StrategyBatch, valid_mask


def random_batch(model_name: str, count: int, devices: int, seed: int = 0) -> StrategyBatch:
    rng = np.random.default_rng(seed)
    model = get_preset(model_name)
    n = count * 6  # oversample: many random combinations break a rule, some repeat
    tp = rng.choice([1, 2, 4, 8], n)
    pp = rng.choice([1, 2, 4, 8, 16], n)
    cp = rng.choice([1, 2, 4], n)
    dp = np.maximum(devices // (tp * pp * cp), 1)
    schedule = rng.choice([0, 1, 2, 3, 5], n)  # 1f1b, interleaved, zb-h1, zbv, gpipe
    vpp = np.where(schedule == 1, rng.choice([2, 4], n), np.where(schedule == 3, 2, 1))
    mbs = rng.choice([1, 2, 4], n)
    m = np.maximum(rng.choice([1, 2, 3, 4, 6, 8, 12, 16], n) * pp, 1)
    columns = {
        "dp": dp, "tp": tp, "pp": pp, "cp": cp, "vpp": vpp, "schedule": schedule,
        "ep": rng.choice([1, 8, 32, 64], n) if model.is_moe else 1, "etp": 1 if model.is_moe else tp,
        "sequence_parallel": (tp > 1) & rng.choice([True, False], n), "zero": rng.choice([0, 1, 2, 3], n),
        "recompute": rng.choice([0, 1, 2], n), "micro_batch_size": mbs, "num_micro_batches": m,
        "seq_length": rng.choice([2048, 4096, 8192], n), "cp_kind": rng.integers(0, 2, n),
    }
    batch = StrategyBatch.from_columns(columns)
    batch = batch.take(np.flatnonzero(valid_mask(batch, RuleContext(model, devices))))
    # Distinct strategies only: the memory model prices a repeated strategy once, which would
    # flatter the rate (the first draw of each, in the order drawn).
    first, _ = batch.distinct(StrategyBatch.array_fields())
    return batch.take(np.sort(first)[:count])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    args = parser.parse_args()
    for name, devices in (("deepseek-v3", 4096), ("llama-3.1-405b", 16384)):
        batch = random_batch(name, args.count, devices)
        model = get_preset(name)
        # Cold: the schedule simulations (one per schedule, pp, vpp, micro-batch count) are made
        # in the timed call, as in a search; warm: they are cached.
        start = time.perf_counter()
        memory = stage_memory(model, batch, MemoryOptions())
        cold = time.perf_counter() - start
        start = time.perf_counter()
        stage_memory(model, batch, MemoryOptions())
        warm = time.perf_counter() - start
        start = time.perf_counter()
        peak_memory(model, batch, MemoryOptions())
        peaks = time.perf_counter() - start
        peak, _ = memory.peak()
        print(f"{name:16s} {len(batch):>9,} strategies: every stage and category {len(batch) / cold:>9,.0f}/s cold, "
              f"{len(batch) / warm:>9,.0f}/s warm; peak only (the search's path) {len(batch) / peaks:>9,.0f}/s warm"
              f"  (median peak {np.median(peak) / 2**30:,.1f} GiB)")


if __name__ == "__main__":
    main()
