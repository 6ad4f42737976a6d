"""Throughput of the vectorised step-time model: strategies priced per second on one core.

    .venv/bin/python benchmarks/bench_time.py            # 1M strategies per model
    .venv/bin/python benchmarks/bench_time.py --size 200000

For DeepSeek-V3 (2048 H100) and Llama-3.1-405B (1024 H100) it draws a batch of mixed strategies
(every parallel degree, schedule, ZeRO stage, recompute mode, micro-batch size), keeps the ones
every validity rule accepts until it has ``--size`` of them, and times ``step_time_batch`` on
them: a cold call (layouts and placements not cached yet) and the best of a few warm ones,
in wall time and in this process's CPU time (the machine may be shared). Then memory and time
together, as a search prices a strategy: ``peak_memory`` and ``step_time_batch`` one after the
other on the same batch (warm, CPU time, best of the repeats). Prints strategies/s.
"""

from __future__ import annotations

import argparse
import os
import time

# One core, as the target says: numpy must not fan out over threads.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402

from ndplan.hardware import get_device  # noqa: E402
from ndplan.hardware.device import Cluster  # noqa: E402
from ndplan.memory.stages import peak_memory  # noqa: E402
from ndplan.model import get_preset  # noqa: E402
from ndplan.model.spec import ModelSpec  # noqa: E402
from ndplan.perf import step_time_batch  # noqa: E402
from ndplan.strategy import StrategyBatch, valid_mask  # noqa: E402
from ndplan.strategy.rules import RuleContext  # noqa: E402
from ndplan.strategy.strategy import SCHEDULES  # noqa: E402


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mixed_strategies(model: ModelSpec, devices: int, size: int, *, seed: int = 0) -> StrategyBatch:
    """``size`` distinct valid strategies drawn at random over every dimension."""
    rng = np.random.default_rng(seed)
    ctx = RuleContext(model, devices)
    kept: list[StrategyBatch] = []
    have = 0
    pow2 = [d for d in _divisors(devices) if d & (d - 1) == 0]
    while have < size:
        n = 4 * size
        tp = rng.choice([1, 2, 4, 8], n)
        pp = rng.choice([p for p in pow2 if p <= 32], n)
        cp = rng.choice([1, 1, 2, 4], n)
        dp = np.maximum(devices // (tp * pp * cp), 1)
        mbs = rng.choice([1, 2, 4], n)
        gbs = rng.choice([1024, 2048, 4096], n)
        m = np.maximum(gbs // np.maximum(dp * mbs, 1), 1)
        schedule = rng.integers(0, len(SCHEDULES), n)
        vpp = np.where(np.isin(schedule, [SCHEDULES.index("zbv"), SCHEDULES.index("dualpipev")]), 2,
                       np.where(schedule == SCHEDULES.index("interleaved"), rng.choice([2, 3, 4], n), 1))
        ep = rng.choice([1, 8, 16, 32, 64], n) if model.is_moe else np.ones(n, np.int64)
        zero = rng.choice([0, 1, 2, 3], n)
        fsdp = (zero == 3) & (rng.random(n) < 0.5)
        columns = {
            "dp": dp, "tp": tp, "pp": pp, "cp": cp, "cp_kind": rng.integers(0, 2, n), "ep": ep, "etp": rng.choice([1, 0], n),
            "sequence_parallel": (tp > 1) & (rng.random(n) < 0.7), "vpp": vpp, "schedule": schedule,
            "seq_chunks": np.where(schedule == SCHEDULES.index("seq1f1b"), rng.choice([1, 2, 4], n), 1),
            "zero": zero, "fsdp": fsdp, "recompute": rng.integers(0, 3, n),
            "micro_batch_size": mbs, "num_micro_batches": m, "seq_length": rng.choice([4096, 8192], n),
        }
        batch = StrategyBatch.from_columns(columns)
        kept.append(batch.take(np.flatnonzero(valid_mask(batch, ctx))))
        merged = StrategyBatch(**{name: np.concatenate([getattr(b, name) for b in kept])
                                  for name in StrategyBatch.array_fields()})
        # Distinct strategies only: the memory model prices a repeated strategy once, which would
        # flatter the rate (the first draw of each, in the order drawn).
        first, _ = merged.distinct(StrategyBatch.array_fields())
        if len(first) < have + size // 100:
            break  # the space holds fewer distinct valid strategies than asked: all of them
        have = len(first)
        kept = [merged.take(np.sort(first))]
    return merged.take(np.sort(first)[:size])


def bench(name: str, devices: int, size: int, repeats: int = 3) -> None:
    model = get_preset(name)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=devices)
    batch = mixed_strategies(model, devices, size)
    started = time.perf_counter()
    out = step_time_batch(model, batch, cluster)
    cold = time.perf_counter() - started
    warm, cpu = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        out = step_time_batch(model, batch, cluster)
        warm.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    assert np.all(np.isfinite(out["step_s"])) and np.all(out["step_s"] > 0)
    best, best_cpu = min(warm), min(cpu)
    print(
        f"{name:16s} {len(batch):>9,} valid mixed strategies on {devices} GPUs: "
        f"cold {len(batch) / cold:>10,.0f}/s, warm best of {repeats} {len(batch) / best:>10,.0f}/s wall "
        f"({best:.2f} s), {len(batch) / best_cpu:>10,.0f}/s CPU time; "
        f"best step {out['step_s'].min():.2f} s, median MFU {np.median(out['mfu']):.1%}"
    )
    peak_memory(model, batch)  # warm: the schedules' frontiers cached, as in a search after its first block
    together = []
    for _ in range(repeats):
        cpu_started = time.process_time()
        peak_memory(model, batch)
        step_time_batch(model, batch, cluster)
        together.append(time.process_time() - cpu_started)
    print(f"{'':16s} memory and time together (peak_memory + step_time_batch): "
          f"{len(batch) / min(together):>10,.0f}/s CPU time ({min(together):.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="warm calls; the fastest is reported")
    args = parser.parse_args()
    bench("deepseek-v3", 2048, args.size, args.repeats)
    bench("llama-3.1-405b", 1024, args.size, args.repeats)


if __name__ == "__main__":
    main()
