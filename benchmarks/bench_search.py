"""Full searches at scale: candidates enumerated, priced and seconds.

    .venv/bin/python benchmarks/bench_search.py

DeepSeek-V3 (671B, MoE, MLA, MTP) on 4096 H100s with gbs 4096, seq 4096, and Llama-3.1-405B on
16384 H100s with gbs 2048, seq 4096, every dimension searched.
"""

from __future__ import annotations

from ndplan.hardware import get_device
from ndplan.model import get_preset
from ndplan.search import default_space, run_search
from ndplan.strategy import get_precision

CASES = (("deepseek-v3", 4096, 4096), ("llama-3.1-405b", 16384, 2048))


def main() -> None:
    device = get_device("h100-sxm")
    for name, devices, gbs in CASES:
        model = get_preset(name)
        space = default_space(model, device, devices, gbs, 4096, get_precision("megatron-bf16"))
        result = run_search(model, device, space)  # the step-time model of the default (pytorch) runtime
        best = result.best["label"] if result.best else "nothing fits"
        print(f"{name:15s} {devices:>6} devices: {result.space_size:>10,} enumerated, {result.evaluated:>10,} priced, "
              f"{result.fitting:>9,} fit, {result.seconds:6.2f} s ({result.evaluated / result.seconds:,.0f} priced/s)")
        print(f"    best: {best}")


if __name__ == "__main__":
    main()
