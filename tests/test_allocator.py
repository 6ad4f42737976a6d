"""The caching allocator's replay (ndplan.census.allocator), on sequences worked out by hand from
the rules of c10/cuda/CUDACachingAllocator.cpp, and against reserved bytes measured on an H200."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest

from ndplan.census.allocator import CachingAllocator, rounded_request, segment_bytes

MiB = 1 << 20
MEASURED = Path(__file__).parent / "data" / "measured" / "cuda"


def test_requests_round_to_512_bytes_and_segments_by_size() -> None:
    assert [rounded_request(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_bytes(512) == 2 * MiB  # the small pool's segments
    assert segment_bytes(MiB) == 2 * MiB
    assert segment_bytes(MiB + 512) == 20 * MiB  # 1 to 10 MiB share 20 MiB segments
    assert segment_bytes(10 * MiB) == 10 * MiB  # from 10 MiB on: rounded up to 2 MiB
    assert segment_bytes(12 * MiB + 512) == 14 * MiB


def test_small_requests_share_a_two_mib_segment() -> None:
    a = CachingAllocator()
    a.malloc("x", 100)
    a.malloc("y", MiB)  # from the same segment's remainder (2 MiB - 512 B)
    assert (a.allocated_bytes, a.reserved_bytes, a.segments_allocated) == (512 + MiB, 2 * MiB, 1)


def test_a_large_remainder_is_split_off_and_serves_later_requests() -> None:
    a = CachingAllocator()
    a.malloc("x", MiB + 1)  # 1 MiB + 512 in a new 20 MiB segment, the rest split off
    a.malloc("y", 5 * MiB)
    assert (a.reserved_bytes, a.segments_allocated) == (20 * MiB, 1)
    a.malloc("z", 14 * MiB)  # 14 MiB > 20 - 6 MiB - 512 B left: a segment of its own
    assert (a.reserved_bytes, a.segments_allocated) == (34 * MiB, 2)


def test_a_remainder_of_one_mib_or_less_stays_with_the_block() -> None:
    a = CachingAllocator()
    a.malloc("x", 19 * MiB + MiB // 2)  # a 20 MiB segment; 0.5 MiB left is not split off
    assert a.allocated_bytes == 20 * MiB  # torch counts the whole block as allocated
    a.malloc("y", MiB // 4)  # small pool: the large block's slack cannot serve it
    assert (a.reserved_bytes, a.segments_allocated) == (22 * MiB, 2)


def test_a_freed_block_serves_only_requests_it_holds() -> None:
    a = CachingAllocator()
    a.malloc("a", 30 * MiB)
    a.malloc("b", 30 * MiB)
    a.free("a")
    a.malloc("c", 40 * MiB)  # 30 MiB cached and free, too small: a new segment
    assert (a.allocated_bytes, a.reserved_bytes) == (70 * MiB, 100 * MiB)
    a.malloc("d", 20 * MiB)  # best fit: the cached 30 MiB block, split (10 MiB left over)
    assert a.reserved_bytes == 100 * MiB
    a.malloc("e", 10 * MiB)
    assert (a.allocated_bytes, a.reserved_bytes, a.peak_reserved_bytes) == (100 * MiB, 100 * MiB, 100 * MiB)


def test_best_fit_takes_the_smallest_block_that_holds_the_request() -> None:
    a = CachingAllocator()
    for key, size in (("big", 40 * MiB), ("small", 24 * MiB), ("mid", 30 * MiB)):
        a.malloc(key, size)
    for key in ("big", "small", "mid"):
        a.free(key)
    a.malloc("x", 26 * MiB)  # the 30 MiB block; the 40 MiB one stays whole for a later 40 MiB
    a.malloc("y", 40 * MiB)
    assert (a.reserved_bytes, a.segments_allocated) == (94 * MiB, 3)


def test_freed_neighbours_merge_and_empty_cache_returns_whole_segments() -> None:
    a = CachingAllocator()
    a.malloc("x", 2 * MiB)
    a.malloc("y", 2 * MiB)  # the same 20 MiB segment
    a.malloc("z", 30 * MiB)
    a.free("x")
    a.empty_cache()  # the 20 MiB segment still holds y
    assert a.reserved_bytes == 50 * MiB
    a.free("y")  # merges with x's block and the remainder: the whole segment is free
    a.malloc("w", 18 * MiB)  # served by the merged 20 MiB block
    assert a.reserved_bytes == 50 * MiB
    a.free("w")
    a.free("z")
    a.empty_cache()
    assert (a.reserved_bytes, a.allocated_bytes) == (0, 0)


def test_each_stream_keeps_its_own_pools() -> None:
    a = CachingAllocator()
    a.malloc("gathered", 30 * MiB, stream=1)  # e.g. FSDP2's all-gather output, on its copy-in stream
    a.free("gathered")
    a.malloc("activation", 30 * MiB)  # the compute stream cannot take the other stream's block
    assert a.reserved_bytes == 60 * MiB
    a.malloc("next gather", 30 * MiB, stream=1)  # the next unit's gather can
    assert (a.reserved_bytes, a.segments_allocated) == (60 * MiB, 2)


def test_reset_peak_starts_from_the_present_and_capacity_releases_the_cache() -> None:
    a = CachingAllocator(capacity_bytes=50 * MiB)
    a.malloc("a", 30 * MiB)
    a.free("a")
    a.reset_peak()
    assert (a.peak_reserved_bytes, a.peak_allocated_bytes) == (30 * MiB, 0)
    a.malloc("b", 40 * MiB)  # 30 + 40 > 50: the cached segment goes back first, as torch does
    assert (a.reserved_bytes, a.peak_reserved_bytes) == (40 * MiB, 40 * MiB)
    with pytest.raises(ValueError, match="already live"):
        a.malloc("b", 1)


#: (case, model, decoder layers, Strategy fields, attention): one-GPU steps measured on an H200
#: (tests/data/measured/cuda), chosen for the fragmentation they show (reserved / allocated 1.07
#: to 1.23, where the estimate's 5% slack reads -15% to -2%).
REPLAYED = [
    ("llama8b-s4k", "llama-3.1-8b", 2, {"seq_length": 4096}, "sdpa"),
    ("llama8b-s16k-full", "llama-3.1-8b", 2, {"seq_length": 16384, "recompute": "full"}, "sdpa"),
    ("llama8b-s4k-fp32", "llama-3.1-8b", 2, {"seq_length": 4096, "precision": "fp32"}, "sdpa"),
    ("qwen3-moe-s4k-mbs2", "qwen3-30b-a3b", 2, {"seq_length": 4096, "micro_batch_size": 2, "global_batch_size": 2},
     "sdpa"),
    ("llama8b-s4k-eager", "llama-3.1-8b", 2, {"seq_length": 4096}, "eager"),
    ("mistral-s16k", "mistral-7b", 2, {"seq_length": 16384}, "sdpa"),
]


@pytest.mark.skipif(find_spec("torch") is None or find_spec("transformers") is None,
                    reason="the fake-tensor step needs the census extra (torch, transformers)")
@pytest.mark.parametrize(("case", "model", "layers", "fields", "attention"), REPLAYED, ids=[c[0] for c in REPLAYED])
def test_the_replay_of_a_fake_step_lands_near_the_measured_reserved_peak(
        case: str, model: str, layers: int, fields: dict, attention: str) -> None:
    """The fake step's allocations replayed through the allocator against the same step's
    ``torch.cuda.max_memory_reserved`` on an H200: within 2% in these six cases (all 28 measured
    cases: -1.5% to +2.9%, docs/accuracy_cuda.md)."""
    from ndplan.census.measure import load_hf_config
    from ndplan.census.measure_step import measure_step
    from ndplan.strategy import Strategy

    measured = json.loads((MEASURED / f"{case}-cuda.json").read_text())["ranks"][0]["reserved_bytes"]
    _, config = load_hf_config(model)
    strategy = Strategy(**{"precision": "bf16-pure", **fields})
    rank = measure_step(config, strategy, num_layers=layers, attention=attention).ranks[0]
    assert rank.replayed_reserved_bytes is not None
    assert rank.replayed_reserved_bytes > rank.allocated_bytes
    assert rank.replayed_reserved_bytes / measured - 1 == pytest.approx(0, abs=0.02)


def test_torchtitans_fsdp_rows_replayed_near_their_measured_reserved_peak() -> None:
    """torchtitan's published 8B FSDP runs (peak reserved measured on H100s) against the replay of
    the same step on fake tensors, FSDP2's streams in pools of their own
    (benchmarks/accuracy/torchtitan_replay.py): the rows the fake step runs as they ran (eager
    bf16) within 2%, where the estimate's fixed slack reads 11-14% low; the rows it stands in for
    with eager bf16 modules (torch.compile's fused blocks, Float8; the 70B over TP with sequence
    and loss parallelism among them) within 10% (docs/accuracy_time.md)."""
    from ndplan.census.measurement import load_measurement
    from ndplan.memory import estimate
    from ndplan.perf.calibrate import load_runs

    runs = {run.id: run for run in load_runs(Path(__file__).parents[1] / "benchmarks" / "published_runs.yaml")}
    files = sorted((Path(__file__).parent / "data" / "measured" / "torchtitan").glob("*-fake.json"))
    assert len(files) == 7
    for path in files:
        run = runs[path.name.removesuffix("-fake.json")]
        assert run.reserved_gib is not None
        measured = run.reserved_gib * 2**30
        replayed = max(r.replayed_reserved_bytes or 0 for r in load_measurement(path).ranks)  # the fullest rank's
        assert replayed
        if run.id in ("torchtitan-8b-fsdp-8gpu", "torchtitan-8b-fsdp-128gpu"):
            estimated = max(s.reserved_bytes for s in estimate(run.model_spec(), run.strategy_obj(), None,
                                                               run.memory_options()).stages)
            assert abs(replayed / measured - 1) <= 0.02 and estimated / measured - 1 < -0.10, run.id
        else:
            assert abs(replayed / measured - 1) <= 0.10, run.id
