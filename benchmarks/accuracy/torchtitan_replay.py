"""torchtitan's published runs whose step a fake-tensor step can run, measured on fake tensors and
their allocations replayed through the caching allocator (``ndplan.census.allocator``).

torchtitan's benchmark page gives each run's peak reserved memory, which ndplan's estimate reads
4-28% low. The fake step (``ndplan measure``: transformers' Llama under FSDP2, the same AdamW, the
same checkpointing) runs the 8B rows, the 70B one over FSDP and TP with sequence and loss
parallelism, and the 405B one over FSDP, TP and a 1F1B pipeline (every stage; no context
parallelism); its replay says how much of that gap the allocator's segments make. Rows that ran torch.compile or Float8
are stood in for by the eager bf16 step (the estimate prices eager modules too). The results are
kept in tests/data/measured/torchtitan/<run>-fake.json, which ``benchmarks/accuracy_time.py``
reads (no torch needed there).

    python benchmarks/accuracy/torchtitan_replay.py      # about 2 minutes on a CPU
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from ndplan.census.measure import load_hf_config  # noqa: E402
from ndplan.census.measure_step import measure_step  # noqa: E402
from ndplan.census.measurement import save_measurement  # noqa: E402
from ndplan.perf.calibrate import load_runs  # noqa: E402
from ndplan.strategy import Strategy  # noqa: E402

OUT = ROOT / "tests" / "data" / "measured" / "torchtitan"
RUNS = ROOT / "benchmarks" / "published_runs.yaml"

#: run id -> what the fake step runs of it: "as run", or what stands in for what it ran.
REPLAYED = {
    "torchtitan-8b-fsdp-8gpu": "as run",
    "torchtitan-8b-fsdp-128gpu": "as run",
    "torchtitan-8b-fsdp-compile-8gpu": "eager modules for torch.compile's",
    "torchtitan-8b-fsdp-compile-128gpu": "eager modules for torch.compile's",
    "torchtitan-8b-cp1-32k": "eager bf16 modules for torch.compile's Float8 ones",
    "torchtitan-70b-2d": "eager bf16 modules for torch.compile's Float8 ones, without AsyncTP",
    "torchtitan-405b-3d-1f1b": "eager bf16 modules for torch.compile's Float8 ones",
}


def fake_strategy(run_strategy: Strategy) -> Strategy:
    """The run's step as a fake step measures it (FSDP2's bf16 recipe)."""
    s = run_strategy
    return Strategy(dp=s.dp, tp=s.tp, sequence_parallel=s.sequence_parallel, pp=s.pp, vpp=s.vpp, schedule=s.schedule,
                    zero=3, fsdp=True, reshard_after_forward=s.reshard_after_forward,
                    micro_batch_size=s.micro_batch_size,
                    num_micro_batches=s.num_micro_batches, global_batch_size=s.global_batch_size,
                    seq_length=s.seq_length, recompute=s.recompute, precision="fsdp-bf16")


def main() -> None:
    runs = {run.id: run for run in load_runs(RUNS)}
    OUT.mkdir(parents=True, exist_ok=True)
    for run_id, stands_for in REPLAYED.items():
        run = runs[run_id]
        strategy = fake_strategy(run.strategy_obj())
        policy = "torchtitan-op" if run.software.get("selective_recompute") == "torchtitan-op" else None
        name, config = load_hf_config(run.model)
        t0 = time.perf_counter()
        # (torchtitan's loss runs on vocabulary-sharded logits under TP: its default)
        measured = measure_step(config, strategy, num_layers=config["num_hidden_layers"], name=name,
                                selective_policy=policy, loss_parallel=strategy.tp > 1)
        # (the time it took left out, so that a file changes only when the step does)
        notes = [n for n in measured.notes if not n.startswith("measurement took")]
        measured = replace(measured, notes=(*notes, f"torchtitan run {run_id}: the fake step runs {stands_for}"))
        target = OUT / f"{run_id}-fake.json"
        save_measurement(target, measured)
        rank = max(measured.ranks, key=lambda r: r.replayed_reserved_bytes or 0)
        print(f"{run_id}: allocated {rank.allocated_bytes / 2**30:.2f} GiB, replayed reserved "
              f"{(rank.replayed_reserved_bytes or 0) / 2**30:.2f} GiB (measured {run.reserved_gib} GiB), "
              f"{time.perf_counter() - t0:.0f} s -> {target.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    main()
