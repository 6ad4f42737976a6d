"""The search's closed-form pipelines against the simulator, on strategies a search keeps.

    .venv/bin/python benchmarks/closed_form_vs_simulator.py [--samples 150]

For four models and both runtime profiles, a search (every dimension) on a mid-size cluster,
then a random sample of its fitting candidates with a pipeline: each priced by the search's
path (``step_time_batch``, closed forms) and by ``estimate_time``'s (the simulator). Prints the
error (closed form / simulated - 1) per schedule: median, range and the worst strategy.
"""

from __future__ import annotations

import argparse

import numpy as np

from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.memory.options import MemoryOptions
from ndplan.model import get_preset
from ndplan.perf.step import evaluate
from ndplan.search import default_space, run_search
from ndplan.strategy import StrategyBatch, get_precision

CASES = (("deepseek-v3", 1024, 2048), ("llama-3.1-405b", 2048, 1024), ("llama-3.1-70b", 64, 256),
         ("qwen3-30b-a3b", 64, 512))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=150, help="fitting candidates drawn per search")
    args = parser.parse_args()
    device = get_device("h100-sxm")
    rng = np.random.default_rng(0)
    everything = []
    for runtime in ("pytorch", "megatron"):
        options = MemoryOptions(runtime=runtime)
        for name, devices, gbs in CASES:
            model = get_preset(name)
            space = default_space(model, device, devices, gbs, 4096, get_precision("megatron-bf16"))
            result = run_search(model, device, space, options=options)
            cluster = Cluster(device=device, num_devices=devices)
            drawn = rng.choice(len(result.candidates_index), size=min(args.samples, len(result.candidates_index)),
                               replace=False)
            errors: dict[str, list[tuple[float, str]]] = {}
            for position in drawn:
                strategy = space.strategy(int(result.candidates_index[position]))
                if strategy.pp == 1:
                    continue
                simulated = evaluate(model, StrategyBatch.of(strategy), cluster, pipeline="simulate",
                                     **options.time_keywords())["step_s"][0]
                key = strategy.schedule + (f" vpp{strategy.vpp}" if strategy.vpp > 1 else "")
                errors.setdefault(key, []).append((result.candidates_time_s[position] / simulated - 1, strategy.short()))
            for key, rows in sorted(errors.items()):
                values = np.array([e for e, _ in rows])
                worst = rows[int(np.argmax(np.abs(values)))][1]
                everything.extend(values)
                print(f"{runtime:8s} {name:15s} {key:16s} n={len(values):3d}  median {np.median(values):+.2%}  "
                      f"range {values.min():+.2%} .. {values.max():+.2%}  worst: {worst}")
    values = np.abs(np.array(everything))
    print(f"all {len(values)} strategies: median |error| {np.median(values):.2%}, 95th percentile "
          f"{np.percentile(values, 95):.2%}, worst {values.max():.2%}")


if __name__ == "__main__":
    main()
