"""What the step time should keep, swept over random strategies: how often and how far it does not.

    .venv/bin/python benchmarks/time_invariants.py                 # 300 draws, seed 1
    .venv/bin/python benchmarks/time_invariants.py --draws 1000 --seed 7 --show 5

Each draw is a (model, device, runtime, strategy) that validates; for it the sweep prices
variants that must not take longer (or must take at least as long) and counts the draws that
break each rule, with the worst break. A rule that holds everywhere belongs in
tests/test_invariants.py; the ones listed here with breaks are known approximations of the model
(docs/time.md, "Not modelled, or approximate"):

* overlap on: turning one overlap switch on (dp_grad_reduce, dp_param_gather, fsdp_prefetch,
  cp_ring, tp) never slows the step;
* faster device: 1.5x the FLOP/s, the HBM bandwidth, the scale-up or the scale-out bandwidth,
  each alone and all together, never slows the step;
* recompute: none <= selective <= full (outside split-backward schedules under the pytorch
  runtime, whose W rebuilds a checkpointed layer per parameter group);
* micro-batches: twice the micro-batches never takes less than one run of the first, and never
  more than twice it;
* sequence: twice the sequence never takes less.

Before the fortieth session's fix it reported selective recompute priced above full where FSDP's
traffic sets the pace (seed 2, 300 draws: Llama-3.1-70B, cp 2, FSDP over 16 on Ascend 910B,
+0.21%); before the forty-fourth session's, a faster device priced a ZeRO-2 step slower where
its per-micro-batch reduces, added whole after the pipeline, outgrew a stage's slack (seed 3:
DeepSeek-V2-Lite, pp 4 ZB-V on Ascend 910B, +0.79%); before the fifty-third session's, a faster
GPU priced a host-bound step slower where the collectives its host floor leaves room for were
added to it (seed 52: Qwen3-30B-A3B, CP 2 DualPipeV on GB200, +0.25%). What it still reports (a
MoE forward's collectives before its token-count sync, the bubble's share of a comm-bound
pipeline, and since the fifty-sixth session seed 3's ZeRO-2 case again, +0.29%, now priced with
MindSpeed's separate gradient adds: docs/time.md, section 12) is under a percent.
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from typing import Any

from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions
from ndplan.model import get_preset
from ndplan.perf import estimate_time
from ndplan.schedule import SPLIT_BACKWARD
from ndplan.strategy import Strategy, check_strategy

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b",
          "gpt-oss-20b")
DEVICES = ("h100-sxm", "b200", "a100-80gb", "ascend-910b", "gb200-nvl72")
SWITCHES = ("dp_grad_reduce", "dp_param_gather", "fsdp_prefetch", "cp_ring", "tp")


def draw(rng: random.Random) -> tuple[str, str, str, Strategy] | None:
    """One (model, device, runtime, strategy) that validates, or None."""
    name, device, runtime = rng.choice(MODELS), rng.choice(DEVICES), rng.choice(("megatron", "pytorch"))
    model = get_preset(name)
    settings: dict[str, Any] = dict(
        tp=rng.choice([1, 2, 4, 8]), pp=rng.choice([1, 2, 4]), cp=rng.choice([1, 1, 2]), dp=rng.choice([1, 2, 4, 8, 16]),
        micro_batch_size=rng.choice([1, 2]), num_micro_batches=rng.choice([1, 4, 8, 16]),
        seq_length=rng.choice([2048, 4096, 8192]), zero=rng.choice([0, 1, 2, 3]),
        recompute=rng.choice(["none", "selective", "full"]))
    if settings["tp"] > 1:
        settings["sequence_parallel"] = rng.random() < 0.7
    if model.is_moe:
        settings["ep"] = rng.choice([1, 2, 4, 8])
    if settings["zero"] == 3:
        settings["fsdp"] = rng.random() < 0.5
    if settings["pp"] > 1:
        settings["schedule"] = rng.choice(["1f1b", "interleaved", "zbv", "gpipe", "dualpipev"])
        if settings["schedule"] != "1f1b" and settings["schedule"] != "gpipe":
            settings["vpp"] = 2
            settings["num_micro_batches"] = max(settings["num_micro_batches"], 2 * settings["pp"])
    try:
        strategy = Strategy(**settings)
    except (NdplanError, ValueError):
        return None
    if check_strategy(strategy, model, strategy.world_size):
        return None
    return name, device, runtime, strategy


def step(name: str, device: Any, runtime: str, strategy: Strategy, **keywords: Any) -> float:
    options = MemoryOptions(runtime=runtime).time_keywords()
    options.update(keywords)
    cluster = Cluster(device=get_device(device) if isinstance(device, str) else device,
                      num_devices=strategy.world_size)
    return estimate_time(name, strategy, cluster, **options).step_s


def with_settings(strategy: Strategy, **changes: Any) -> Strategy | None:
    settings = {k: v for k, v in strategy.model_dump().items() if k != "global_batch_size"}  # derived
    try:
        changed = Strategy(**{**settings, **changes})
    except (NdplanError, ValueError):
        return None
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=3, help="breaks to print per rule")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    breaks: dict[str, list[tuple[float, str]]] = defaultdict(list)
    checked: dict[str, int] = defaultdict(int)

    def rule(label: str, worse: float, better: float, what: str, tolerance: float = 1e-9) -> None:
        """``worse`` must be >= ``better`` (seconds)."""
        checked[label] += 1
        if worse < better * (1 - tolerance):
            breaks[label].append((better / worse - 1, what))

    draws = 0
    while draws < args.draws:
        drawn = draw(rng)
        if drawn is None:
            continue
        name, device, runtime, strategy = drawn
        try:
            base = step(name, device, runtime, strategy)
        except NdplanError:
            continue
        draws += 1
        what = f"{name} {device} {runtime} {strategy.short()}"
        preset = "torchtitan" if runtime == "pytorch" else "megatron"  # the runtime's overlap defaults
        for switch in SWITCHES:
            try:
                off = step(name, device, runtime, strategy, overlap=f"{preset},{switch}=off")
                on = step(name, device, runtime, strategy, overlap=f"{preset},{switch}=on")
            except NdplanError:
                continue
            rule(f"overlap on: {switch}", off, on, what)
        dev = get_device(device)
        faster: dict[str, dict[str, Any]] = {
            "flops": dict(peak_flops={k: v * 1.5 for k, v in dev.peak_flops.items()}),
            "hbm": dict(hbm_bandwidth_bytes_per_s=dev.hbm_bandwidth_bytes_per_s * 1.5),
            "scale-up": dict(scaleup_bandwidth_bytes_per_s=dev.scaleup_bandwidth_bytes_per_s * 1.5),
            "scale-out": dict(scaleout_bandwidth_bytes_per_s=dev.scaleout_bandwidth_bytes_per_s * 1.5)}
        faster["all"] = {k: v for update in list(faster.values()) for k, v in update.items()}
        for label, update in faster.items():
            rule(f"faster device: {label}", base, step(name, dev.model_copy(update=update), runtime, strategy), what)
        if not (runtime == "pytorch" and strategy.schedule in SPLIT_BACKWARD):
            steps: dict[str, float] = {}
            for policy in ("none", "selective", "full"):
                try:
                    steps[policy] = step(name, device, runtime, strategy.with_recompute(policy))
                except NdplanError:
                    pass
            for low, high in (("none", "selective"), ("selective", "full")):
                if low in steps and high in steps:
                    rule(f"recompute: {low} <= {high}", steps[high], steps[low], what)
        # (rule, changed settings, whether the changed step must be at least the base or at most twice it)
        twice_batches = {"num_micro_batches": 2 * strategy.num_micro_batches}
        for label, changes, at_least in (("micro-batches: 2x never less", twice_batches, True),
                                         ("micro-batches: 2x never over twice", twice_batches, False),
                                         ("sequence: 2x never faster", {"seq_length": 2 * strategy.seq_length}, True)):
            changed = with_settings(strategy, **changes)
            if changed is None or check_strategy(changed, get_preset(name), changed.world_size):
                continue
            try:
                seconds = step(name, device, runtime, changed)
            except NdplanError:
                continue
            if at_least:
                rule(label, seconds, base, what)
            else:
                rule(label, 2 * base, seconds, what)

    print(f"{draws} strategies drawn (seed {args.seed}); per rule: draws checked, broken, worst break")
    for label in sorted(checked):
        found = sorted(breaks[label], reverse=True)
        worst = f"{found[0][0]:+.3%}" if found else "-"
        print(f"  {label:38s} {checked[label]:5d} {len(found):4d}  {worst}")
        for excess, what in found[:args.show]:
            print(f"      {excess:+.3%}  {what}")


if __name__ == "__main__":
    main()
