"""Pipeline-schedule simulator: pinned figures from the published schedules, dependency
sanity under random durations, memory counts, validation."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.errors import NdplanError
from ndplan.schedule import (
    SCHEDULES,
    SPLIT_BACKWARD,
    ScheduleResult,
    in_flight,
    simulate,
    simulated_makespan_s,
)
from ndplan.schedule.builders import build_plan

# --------------------------------------------------------------------------- helpers


def check_timeline(r: ScheduleResult, p2p_s: float = 0.0) -> None:
    """Every op exactly once, every input before its consumer, no stage doing two steps at once."""
    tol = 1e-9
    seen: dict[tuple[str, int, int, int], tuple[int, int, float, float]] = {}
    counts: Counter[tuple[str, int, int, int]] = Counter()
    for s in range(r.pp):
        ops = r.ops[s]
        # steps of a stage run one after another
        first = np.flatnonzero(np.diff(np.concatenate(([-1], ops.step))) != 0)
        starts, ends = ops.start_s[first], ops.end_s[first]
        assert np.all(starts[1:] >= ends[:-1] - tol)
        assert np.all(ends >= starts)
        for op, step in zip(ops, ops.step.tolist(), strict=True):
            g = int(r.model_chunk[s, op.chunk])
            key = (op.kind, op.micro_batch, g, op.seq_chunk)
            counts[key] += 1
            seen[key] = (s, step, op.start_s, op.end_s)
    n_chunks = r.pp * r.vpp
    k = r.seq_chunks
    expected = {(mb, g, q) for mb in range(r.num_micro_batches) for g in range(n_chunks) for q in range(k)}
    kinds = ("F", "B", "W") if r.schedule in SPLIT_BACKWARD else ("F", "B")
    assert set(counts) == {(kind, *x) for kind in kinds for x in expected}
    assert set(counts.values()) == {1}

    def after(consumer: tuple[str, int, int, int], producer: tuple[str, int, int, int]) -> None:
        cs, cstep, c_start, _ = seen[consumer]
        ps, pstep, _, p_end = seen[producer]
        if (cs, cstep) == (ps, pstep):  # same step: a full backward's W beside its B
            assert consumer[0] == "W" and producer[0] == "B"
            return
        delay = p2p_s if cs != ps else 0.0
        assert c_start >= p_end + delay - tol, (consumer, producer)

    for mb, g, q in expected:
        if g + 1 < n_chunks:
            after(("F", mb, g + 1, q), ("F", mb, g, q))
            after(("B", mb, g, q), ("B", mb, g + 1, q))
        after(("B", mb, g, q), ("F", mb, g, q))
        if q + 1 < k:
            after(("F", mb, g, q + 1), ("F", mb, g, q))
            after(("B", mb, g, q), ("B", mb, g, q + 1))
        if "W" in kinds:
            after(("W", mb, g, q), ("B", mb, g, q))
    assert r.makespan_s == pytest.approx(max(float(o.end_s.max()) for o in r.ops))
    busy = r.busy_s.sum()
    assert r.bubble_fraction == pytest.approx(1 - busy / (r.pp * r.makespan_s) if r.makespan_s else 0.0)


def valid_config(schedule: str, pp: int) -> dict[str, int]:
    """A small valid (vpp, m, seq_chunks) for a schedule."""
    if schedule == "interleaved":
        return {"vpp": 2, "num_micro_batches": 2 * pp, "seq_chunks": 1}
    if schedule in ("zbv", "dualpipev"):
        return {"vpp": 2, "num_micro_batches": 2 * pp + 1, "seq_chunks": 1}
    if schedule == "seq1f1b":
        return {"vpp": 1, "num_micro_batches": pp + 1, "seq_chunks": 3}
    return {"vpp": 1, "num_micro_batches": pp + 2, "seq_chunks": 1}


def step_names(schedule: str, pp: int, vpp: int, m: int, stage: int) -> list[str]:
    """A stage's steps as 'F0.3' (kind, local chunk, micro-batch), ops of a step joined by '+'."""
    return [
        "+".join(f"{'FBW'[k]}{c}.{mb}" for k, mb, c, _ in step)
        for step in build_plan(schedule, pp, vpp, m)[stage].steps()
    ]


# --------------------------------------------------------------------------- 1F1B and GPipe

CASES_1F1B = [(1, 1), (1, 5), (2, 2), (4, 3), (4, 8), (8, 5), (8, 16), (16, 64)]


@pytest.mark.parametrize(("p", "m"), CASES_1F1B)
def test_1f1b_unit_times(p: int, m: int) -> None:
    r = simulate("1f1b", p, 1, m)  # defaults: F=1, B=2
    assert r.makespan_s == pytest.approx((m + p - 1) * 3)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.peak_in_flight[:, 0].tolist() == [min(m, p - s) for s in range(p)]
    assert r.peak_in_flight_w.max() == 0  # no split: nothing lingers after B
    check_timeline(r)


@pytest.mark.parametrize(("p", "m"), CASES_1F1B)
def test_gpipe_holds_every_micro_batch(p: int, m: int) -> None:
    r = simulate("gpipe", p, 1, m)
    assert r.peak_in_flight[:, 0].tolist() == [m] * p
    assert r.makespan_s == pytest.approx((m + p - 1) * 3)
    check_timeline(r)


def test_gpipe_p2p_adds_two_latencies_per_hop() -> None:
    # Forward and backward each cross pp-1 links once on the critical path.
    r = simulate("gpipe", 4, 1, 8, p2p_s=0.5)
    assert r.makespan_s == pytest.approx(3 * (8 + 3) + 2 * 3 * 0.5)
    check_timeline(r, 0.5)


def test_1f1b_single_micro_batch_with_p2p() -> None:
    r = simulate("1f1b", 3, 1, 1, p2p_s=0.25)
    assert r.makespan_s == pytest.approx(3 * 3 + 2 * 2 * 0.25)


def test_1f1b_order_is_megatron_without_interleaving() -> None:
    assert step_names("1f1b", 4, 1, 6, 1) == (
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 F0.4 B0.2 F0.5 B0.3 B0.4 B0.5".split()
    )


# --------------------------------------------------------------------------- interleaved


@pytest.mark.parametrize(
    ("p", "v", "m"), [(4, 2, 8), (4, 2, 4), (4, 3, 8), (8, 2, 16), (2, 4, 4), (8, 4, 32), (1, 2, 3)]
)
def test_interleaved_textbook_bubble_and_warmup_peak(p: int, v: int, m: int) -> None:
    # Textbook assumption: a chunk is 1/v of a stage, so F=1/v and B=2/v per chunk.
    r = simulate("interleaved", p, v, m, forward_s=1 / v, backward_s=2 / v)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert r.makespan_s == pytest.approx(3 * m + 3 * (p - 1) / v)
    # Megatron: rank s runs min(m*v, 2(p-s-1) + (v-1)p) warm-up forwards, then one more F
    # before its first B, so it holds warm-up + 1 micro-batch-chunks at most.
    warmup = [min(m * v, 2 * (p - s - 1) + (v - 1) * p) for s in range(p)]
    expected = [min(m * v, w + 1) for w in warmup]
    assert r.peak_in_flight_total.tolist() == expected
    assert r.peak_in_flight_total[0] == expected[0]
    check_timeline(r)


def test_interleaved_order_follows_megatron_schedule_table() -> None:
    # pp=2, vpp=2, m=4: forward table (mb, chunk) = (0,0)(1,0)(0,1)(1,1)(2,0)(3,0)(2,1)(3,1);
    # rank 0 warms up with 2*(2-0-1) + (2-1)*2 = 4 forwards; backward k runs chunk 1-c.
    assert step_names("interleaved", 2, 2, 4, 0) == (
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3".split()
    )
    # The model chunk held by chunk c of stage s is c*pp + s.
    assert simulate("interleaved", 2, 2, 4).model_chunk.tolist() == [[0, 2], [1, 3]]


# --------------------------------------------------------------------------- zero bubble


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 16), (8, 5)])
def test_zb_h1_beats_1f1b_with_same_activation_peak(p: int, m: int) -> None:
    durations = {"forward_s": 1.0, "backward_s": 1.0, "weight_grad_s": 1.0}  # B+W = a 1F1B backward of 2
    zb = simulate("zb-h1", p, 1, m, **durations)
    base = simulate("1f1b", p, 1, m, **durations)
    assert base.makespan_s == pytest.approx(3 * (m + p - 1))
    if m >= p:  # the paper's setting; with fewer micro-batches there are too few Ws to fill
        # Published ZB-H1 bubble: (p-1)(F + B - 2W) with B the whole backward: (p-1) here.
        assert zb.makespan_s == pytest.approx(3 * m + (p - 1))
    assert zb.bubble_fraction < base.bubble_fraction
    assert np.array_equal(zb.peak_in_flight, base.peak_in_flight)
    check_timeline(zb)


def test_zb_h1_bubble_formula_with_uneven_times() -> None:
    r = simulate("zb-h1", 4, 1, 8, forward_s=2.0, backward_s=3.0, weight_grad_s=1.0)
    assert r.makespan_s - 8 * 6.0 == pytest.approx(3 * (2.0 + 4.0 - 2 * 1.0))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32), (16, 64)])
def test_zbv_near_zero_bubble_and_1f1b_memory(p: int, m: int) -> None:
    r = simulate("zbv", p, 2, m)  # F = B = W = 1 per chunk
    # The last stage cannot start before p-1 forwards reach it; ZB-V loses exactly that.
    assert r.makespan_s == pytest.approx(6 * m + (p - 1))
    assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
    if m >= 4 * p:
        assert r.bubble_fraction < 0.05
    # Published: ZB-V holds as much as 1F1B's first stage, p whole-stage activations,
    # i.e. 2p half-size chunk activations.
    assert r.peak_in_flight_total.tolist() == [2 * p] * p
    assert r.model_chunk.tolist() == [[s, 2 * p - 1 - s] for s in range(p)]
    check_timeline(r)


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (4, 8), (4, 13), (8, 16)])
def test_dualpipev_published_bubble_and_memory(p: int, m: int) -> None:
    r = simulate("dualpipev", p, 2, m, overlap_f_and_b=False)
    # DeepSeek-V3 table, DualPipe over PP = 2p stages: bubble (PP/2-1)(F&B + B - 3W), with
    # F&B = F+B+W = 3 unoverlapped, B = 2 (whole backward), W = 1: 2(p-1).
    assert r.makespan_s == pytest.approx(6 * m + 2 * (p - 1))
    # ... and activations PP+1 = 2p+1 chunk activations per device.
    assert r.peak_in_flight_total.tolist() == [2 * p + 1] * p
    check_timeline(r)
    overlapped = simulate("dualpipev", p, 2, m)
    assert overlapped.makespan_s < r.makespan_s
    check_timeline(overlapped)


def test_dualpipev_order_follows_deepseek_steps() -> None:
    # pp=2, m=4, rank 0, DualPipeV.step(): 2xF0 | F0 F1 | B1(zb) W F1 | F0&B1, F1&B0 |
    # B1, F1&B0 | B1 B0(zb) | W B0(zb) | W. A full backward is its B and W in one step.
    assert step_names("dualpipev", 2, 2, 4, 0) == [
        "F0.0", "F0.1", "F0.2", "F1.0", "B1.0", "W1.0", "F1.1",
        "F0.3+B1.1+W1.1", "F1.2+B0.0+W0.0", "B1.2+W1.2", "F1.3+B0.1+W0.1",
        "B1.3+W1.3", "B0.2", "W0.2", "B0.3", "W0.3",
    ]  # fmt: skip


# --------------------------------------------------------------------------- Seq1F1B


@pytest.mark.parametrize(("p", "m", "k"), [(4, 8, 1), (4, 8, 2), (4, 8, 4), (8, 16, 4), (4, 2, 3), (1, 3, 2)])
def test_seq1f1b_fractional_in_flight(p: int, m: int, k: int) -> None:
    r = simulate("seq1f1b", p, 1, m, seq_chunks=k)
    # Warm-up min(p-s-2+k, mk) sub-sequences, one more before the first B; each is 1/k.
    assert r.peak_in_flight[:, 0].tolist() == pytest.approx([min(m * k, p - s - 1 + k) / k for s in range(p)])
    # Equal-cost sub-sequences: the 1F1B bubble shrinks as if there were k*m micro-batches.
    assert r.bubble_fraction == pytest.approx((p - 1) / (k * m + p - 1))
    check_timeline(r)


def test_seq1f1b_order_reverses_sub_sequences_in_backward() -> None:
    """pp 2, 2 micro-batches of 2 sub-sequences: stage s warms up min(2 - s - 2 + 2, 4) units,
    then runs 1F1B over units; each micro-batch's backward takes its sub-sequences last first
    (kind micro-batch.sub-sequence)."""

    def order(stage: int) -> list[str]:
        plan = build_plan("seq1f1b", 2, 1, 2, 2)[stage]
        return [f"{'FBW'[k]}{mb}.{q}" for step in plan.steps() for k, mb, _, q in step]

    assert order(0) == "F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 B1.1 B1.0".split()
    assert order(1) == "F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0".split()


def test_gpipe_order_runs_every_forward_first() -> None:
    assert step_names("gpipe", 3, 1, 3, 2) == "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2".split()


def test_seq1f1b_with_one_chunk_is_1f1b() -> None:
    a = simulate("seq1f1b", 4, 1, 6)
    b = simulate("1f1b", 4, 1, 6)
    assert step_names("seq1f1b", 4, 1, 6, 2) == step_names("1f1b", 4, 1, 6, 2)
    assert a.makespan_s == b.makespan_s


# --------------------------------------------------------------------------- dependency sanity


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_every_schedule_is_consistent(schedule: str, pp: int) -> None:
    cfg = valid_config(schedule, pp)
    r = simulate(schedule, pp, cfg["vpp"], cfg["num_micro_batches"], seq_chunks=cfg["seq_chunks"])
    check_timeline(r)


@st.composite
def random_case(
    draw: st.DrawFn,
) -> tuple[str, int, int, int, int, np.ndarray, np.ndarray, np.ndarray, float, bool]:
    schedule = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.integers(1, 5))
    k = 1
    if schedule == "interleaved":
        vpp = draw(st.integers(2, 3))
        m = pp * draw(st.integers(1, 3))
    elif schedule in ("zbv", "dualpipev"):
        vpp = 2
        m = draw(st.integers(2 * pp if schedule == "dualpipev" else 1, 3 * pp + 2))
    else:
        vpp = 1
        m = draw(st.integers(1, 2 * pp + 2))
        if schedule == "seq1f1b":
            k = draw(st.integers(1, 3))
    times = st.lists(st.floats(0.0, 3.0), min_size=pp * vpp, max_size=pp * vpp).map(
        lambda xs: np.array(xs).reshape(pp, vpp)
    )
    return (
        schedule,
        pp,
        vpp,
        m,
        k,
        draw(times),
        draw(times),
        draw(times),
        draw(st.floats(0.0, 1.0)),
        draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(random_case())
def test_random_durations_keep_dependencies(case: tuple) -> None:
    schedule, pp, vpp, m, k, f, b, w, p2p, overlap = case
    r = simulate(
        schedule,
        pp,
        vpp,
        m,
        seq_chunks=k,
        forward_s=f,
        backward_s=b,
        weight_grad_s=w,
        p2p_s=p2p,
        overlap_f_and_b=overlap,
    )
    check_timeline(r, p2p)
    # The makespan alone is the same timeline's, to the bit.
    assert simulated_makespan_s(schedule, pp, vpp, m, seq_chunks=k, forward_s=f, backward_s=b, weight_grad_s=w,
                                p2p_s=p2p, overlap_f_and_b=overlap) == r.makespan_s
    # Activation counts depend on the order only, never on durations.
    assert np.array_equal(r.peak_in_flight, simulate(schedule, pp, vpp, m, seq_chunks=k).peak_in_flight)


# --------------------------------------------------------------------------- memory counts


def test_in_flight_is_cached_and_read_only() -> None:
    a = in_flight("interleaved", 4, 2, 8)
    assert in_flight("interleaved", 4, 2, 8) is a
    assert simulate("interleaved", 4, 2, 8).memory is a
    with pytest.raises(ValueError):
        a.peak[0, 0] = 99


def test_numpy_integers_share_the_cache() -> None:
    assert in_flight("1f1b", np.int64(4), 1, np.int32(8)) is in_flight("1f1b", 4, 1, 8, 1)
    assert simulate("1f1b", np.int64(4), 1, 8).pp == 4


def test_series_and_weighted_peak() -> None:
    r = simulate("zbv", 4, 2, 8)
    series = r.peak_in_flight_stage[0]
    assert series.held_until_b.shape == (len(r.ops[0]) + 1, 2)
    assert r.boundary_times_s(0).shape == (len(r.ops[0]) + 1,)
    assert np.array_equal(series.held_until_b.max(axis=0), r.peak_in_flight[0])
    # Weights per chunk: [1, 0] gives chunk 0 alone, [1, 1] the stage total.
    assert r.memory.peak_weighted([1.0, 0.0]).tolist() == r.peak_in_flight[:, 0].tolist()
    assert r.memory.peak_weighted(1.0).tolist() == r.peak_in_flight_total.tolist()
    # Split schedules: the part kept after B until W is priced on its own.
    zb = in_flight("zb-h1", 4, 1, 8)
    assert zb.peak_w[:, 0].tolist() == [1, 2, 3, 4]  # stage s defers its Ws by s backwards
    got = zb.peak_weighted(10.0, 3.0)
    want = [max(10 * st.held_until_b[:, 0] + 3 * st.held_until_w[:, 0]) for st in zb.stages]
    assert got.tolist() == pytest.approx(want)


def test_activation_held_from_end_of_f_to_end_of_b() -> None:
    r = simulate("1f1b", 2, 1, 2)
    # Stage 1 runs F0 B0 F1 B1: it never holds two.
    assert r.peak_in_flight_stage[1].held_until_b[:, 0].tolist() == [0, 1, 0, 1, 0]
    # Stage 0 runs F0 F1 B0 B1.
    assert r.peak_in_flight_stage[0].held_until_b[:, 0].tolist() == [0, 1, 2, 1, 0]


def test_ops_expose_times() -> None:
    r = simulate("1f1b", 2, 1, 1, forward_s=[[1.0], [2.0]], backward_s=[[3.0], [4.0]])
    ops = [(o.kind, o.start_s, o.end_s) for o in r.iter_ops(1)]
    assert ops == [("F", 1.0, 3.0), ("B", 3.0, 7.0)]
    assert r.busy_s.tolist() == [4.0, 6.0]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("pipedream", 4, 1, 8), {}, "unknown pipeline schedule 'pipedream'; known schedules: gpipe, 1f1b"),
        (("1f1b", 4, 2, 8), {}, "1f1b does not support virtual pipeline chunks: vpp must be 1"),
        (("gpipe", 4, 2, 8), {}, "gpipe does not support virtual pipeline chunks"),
        (("zb-h1", 4, 2, 8), {}, "zb-h1 does not support virtual pipeline chunks"),
        (("seq1f1b", 4, 2, 8), {}, "seq1f1b does not support virtual pipeline chunks"),
        (("zbv", 4, 1, 8), {}, "zbv places two model chunks per stage in a V shape: vpp must be 2"),
        (("zbv", 4, 3, 8), {}, "vpp must be 2"),
        (("dualpipev", 4, 4, 8), {}, "dualpipev places two model chunks per stage in a V shape"),
        (("interleaved", 4, 1, 8), {}, "interleaved needs vpp >= 2"),
        (
            ("interleaved", 4, 2, 6),
            {},
            r"interleaved needs num_micro_batches divisible by pp \(Megatron rule\)",
        ),
        (("dualpipev", 4, 2, 7), {}, r"dualpipev needs num_micro_batches >= 2\*pp"),
        (("seq1f1b", 4, 1, 8), {"seq_chunks": 0}, "seq_chunks must be >= 1"),
        (("1f1b", 4, 1, 8), {"seq_chunks": 2}, "seq_chunks > 1 needs schedule 'seq1f1b'"),
        (("1f1b", 4, 1, 0), {}, "num_micro_batches must be >= 1"),
        (("1f1b", 0, 1, 8), {}, "pp must be >= 1"),
        (("1f1b", 4, 0, 8), {}, "vpp must be >= 1"),
        (("1f1b", 4.0, 1, 8), {}, "pp must be an integer"),
        (("1f1b", 4, 1, True), {}, "num_micro_batches must be an integer"),
        (("1f1b", 4, 1, 8), {"forward_s": -1.0}, "forward_s must be finite and >= 0"),
        (("1f1b", 4, 1, 8), {"backward_s": float("nan")}, "backward_s must be finite and >= 0"),
        (
            ("1f1b", 4, 1, 8),
            {"weight_grad_s": [1.0, 2.0]},
            r"weight_grad_s must be a number or broadcast to \[pp, vpp\]",
        ),
        (("1f1b", 4, 1, 8), {"p2p_s": -0.1}, "p2p_s must be a finite number >= 0"),
    ],
)
def test_validation_errors(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(NdplanError, match=match):
        simulate(*args, **kwargs)
    with pytest.raises(NdplanError, match=match):
        simulated_makespan_s(*args, **kwargs)


def test_in_flight_validates_too() -> None:
    with pytest.raises(NdplanError, match="dualpipev needs num_micro_batches >= 2"):
        in_flight("dualpipev", 8, 2, 8)
    assert issubclass(NdplanError, ValueError)


def test_weights_must_match_shape() -> None:
    with pytest.raises(NdplanError, match=r"activation weights must broadcast to \[pp, vpp\]"):
        in_flight("zbv", 4, 2, 8).peak_weighted([1.0, 2.0, 3.0])


# --------------------------------------------------------------------------- performance


def test_simulation_is_fast_for_large_pipelines() -> None:
    simulate("interleaved", 16, 4, 256)  # first call builds and caches the op order
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        r = simulate("interleaved", 16, 4, 256, forward_s=0.01, backward_s=0.02, p2p_s=0.001)
        best = min(best, time.perf_counter() - t0)
    assert sum(len(o) for o in r.ops) == 2 * 16 * 4 * 256
    assert best < 0.05


@pytest.mark.parametrize("schedule, pp, vpp, m", [
    ("interleaved", 4, 2, 8), ("interleaved", 4, 3, 8), ("zbv", 4, 2, 8), ("dualpipev", 4, 2, 8),
])
def test_up_to_three_chunks_are_gathered_once_a_run(schedule, pp, vpp, m):
    from ndplan.schedule.unshard import chunk_gathers

    assert chunk_gathers(schedule, pp, vpp, m) == vpp


def test_more_chunks_than_torch_keeps_gathered_are_gathered_again_as_torch_does():
    """torch.distributed.pipelining inserts FSDP's gathers into its multi-chunk schedules
    (``_add_unshard_reshard``, three chunks kept ahead): counted from torch's own interleaved
    1F1B op lists and that function, the rank that gathers most, against ndplan's count from its
    op order (pp 4, 16 micro-batches, 4 chunks: 15 gathers, not 4)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from ndplan.schedule.unshard import chunk_gathers

    def torch_count(pp: int, vpp: int, m: int) -> int:
        order = schedules.ScheduleInterleaved1F1B.__new__(schedules.ScheduleInterleaved1F1B)
        order.n_local_stages, order.pp_group_size, order._n_microbatches = vpp, pp, m
        order.number_of_rounds = max(1, m // pp)
        order.microbatches_per_round = m // order.number_of_rounds
        return max(sum(1 for a in schedules._add_unshard_reshard(order._calculate_single_rank_operations(rank))
                       if a is not None and a.computation_type == schedules.UNSHARD) for rank in range(pp))

    assert chunk_gathers("interleaved", 4, 4, 16) == torch_count(4, 4, 16) == 15
    for pp in (2, 4, 8):
        for vpp in (2, 3, 4, 5, 6):
            for m in (pp, 2 * pp, 4 * pp):
                assert chunk_gathers("interleaved", pp, vpp, m) == torch_count(pp, vpp, m), (pp, vpp, m)


def test_gathers_past_the_steady_count_equal_the_full_order():
    """Past 2·pp micro-batches the interleaved count is extrapolated one repetition of pp
    micro-batches at a time; counted on the full order it is the same at every count up to
    4·pp·vpp + 2·pp, and the repetition holds from 2·pp micro-batches on."""
    from ndplan.schedule.unshard import _counted, chunk_gathers

    for pp in (1, 2, 3, 4, 5, 6, 8):
        for vpp in (2, 4, 5, 7):
            for active in (1, 3, 4):
                cap = 4 * pp * vpp
                for m in (*range(2 * pp, cap + 3 * pp, pp), cap + 5 * pp, 2 * cap):
                    assert chunk_gathers("interleaved", pp, vpp, m, 1, active) == _counted("interleaved", pp, vpp, m, 1, active)
                counts = [_counted("interleaved", pp, vpp, j * pp, 1, active) for j in range(2, 4 * vpp + 3)]
                assert len({b - a for a, b in zip(counts, counts[1:], strict=False)}) == 1, (pp, vpp, active)


# --------------------------------------------------------------------------- reference orders
# Each framework's order written out again from its source, step by step, and compared with the
# builders' on a grid of shapes (the pinned cases above check a few by hand).

Ref = list[tuple[int, int, int]]  # (kind 0/1/2 = F/B/W, micro-batch, local chunk)


def _megatron_interleaved(pp: int, vpp: int, m: int, rank: int) -> Ref:
    # megatron/core/pipeline_parallel/schedules.py: get_schedule_table (group size pp),
    # get_pp_rank_microbatches' warm-up, the backward on chunk vpp-1-c of the same table entry.
    table = []
    for lo in range(0, m, pp):
        hi = m if lo + pp >= m else lo + pp
        table += [(mb, c) for c in range(vpp) for mb in range(lo, hi)]
    total, warm = m * vpp, min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)
    ops = [(0, *table[i]) for i in range(warm)]
    for i in range(total - warm):
        ops += [(0, *table[i + warm]), (1, table[i][0], vpp - 1 - table[i][1])]
    return ops + [(1, table[i][0], vpp - 1 - table[i][1]) for i in range(total - warm, total)]


def _torch_zb1p(pp: int, m: int, rank: int) -> Ref:
    # torch.distributed.pipelining: ScheduleInterleavedZeroBubble with one stage per rank
    # (warm-up pp-1-rank, num_1f1b_microbatches = rank) through _get_1f1b_rank_ops.
    warm = min(pp - 1 - rank, m)
    ops: Ref = [(0, i, 0) for i in range(warm)]
    weights = 0
    for i in range(m):
        ops += ([(0, warm + i, 0)] if warm + i < m else []) + [(1, i, 0)]
        if i >= rank:
            ops.append((2, weights, 0))
            weights += 1
    return ops + [(2, j, 0) for j in range(weights, m)]


def _torch_zbv(pp: int, m: int, rank: int) -> Ref:
    # torch.distributed.pipelining: ScheduleZBVZeroBubble._calculate_single_rank_operations.
    n = max(2 * pp - 1, m)
    ops: Ref = []
    count = {(k, c): 0 for k in range(3) for c in range(2)}

    def add(*slots: tuple[int, int]) -> None:
        for k, c in slots:
            ops.append((k, count[k, c], c))
            count[k, c] += 1

    for _ in range(2 * (pp - rank) - 1):
        add((0, 0))
    for _ in range(rank):
        add((0, 1), (0, 0))
    for _ in range(pp - rank):
        add((0, 1), (1, 1), (2, 1))
    while count[0, 1] < count[0, 0] or count[0, 0] < n:
        add(*([(0, 0)] if count[0, 0] < n else []), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))
    for _ in range(rank):
        add((1, 0), (1, 1))
    for _ in range(pp - rank):
        add((1, 0), (2, 0))
    while count[2, 1] < count[1, 1]:
        add((2, 1))
    while count[2, 0] < count[1, 0]:
        add((2, 0))
    return [op for op in ops if op[1] < m]


def _deepseek_dualpipev(pp: int, m: int, rank: int) -> list[Ref]:
    # deepseek-ai/DualPipe dualpipev.py DualPipeV.step(), steps 1-8, as steps: an overlapped
    # forward-backward chunk is one step, a full backward its B and W, a zero-bubble backward
    # leaves its W to the FIFO that _weight_chunk pops.
    count: dict[tuple[int, int], int] = {}
    fifo: list[int] = []

    def op(k: int, c: int) -> tuple[int, int, int]:
        mb = count.get((k, c), 0)
        count[k, c] = mb + 1
        return (k, mb, c)

    def full(c: int) -> Ref:
        return [op(1, c), op(2, c)]

    def zero_bubble(c: int) -> Ref:
        fifo.append(c)
        return [op(1, c)]

    steps: list[Ref] = [[op(0, 0)] for _ in range((pp - rank - 1) * 2)]
    for _ in range(rank + 1):
        steps += [[op(0, 0)], [op(0, 1)]]
    for _ in range(pp - rank - 1):
        steps += [zero_bubble(1), [op(2, fifo.pop(0))], [op(0, 1)]]
    for i in range(m - 2 * pp + rank + 1):
        steps += [[op(0, 0)], full(1)] if i == 0 and rank == pp - 1 else [[op(0, 0), *full(1)]]
        steps.append([op(0, 1), *full(0)])
    for _ in range(pp - rank - 1):
        steps += [full(1), [op(0, 1), *full(0)]]
    zb, half = False, (rank + 1) // 2
    for i in range(rank + 1):
        zb = zb or (i == half and rank % 2 == 1)
        steps.append(zero_bubble(1) if zb else full(1))
        zb = zb or (i == half and rank % 2 == 0)
        steps.append(zero_bubble(0) if zb else full(0))
    for _ in range(pp - rank - 1):
        steps += [[op(2, fifo.pop(0))], zero_bubble(0)]
    return steps + [[op(2, fifo.pop(0))] for _ in range(rank + 1)]


def _sail_seq1f1b(pp: int, m: int, k: int, stage: int) -> list[tuple[int, int, int]]:
    # sail-sg/zero-bubble-pipeline-parallelism zerobubble/scheduler/seq1f1b.py create_schedule:
    # (kind, micro-batch, sub-sequence).
    warm = min(pp - stage - 2 + k, m * k)
    rest = m * k - warm
    ops = [(0, i // k, i % k) for i in range(warm)]
    for i in range(rest):
        ops += [(0, (warm + i) // k, (warm + i) % k), (1, i // k, k - 1 - i % k)]
    return ops + [(1, i // k, k - 1 - i % k) for i in range(rest, rest + warm)]


def _ops(schedule: str, pp: int, vpp: int, m: int, k: int = 1) -> list[list[tuple[int, int, int, int]]]:
    return [[op for step in st.steps() for op in step] for st in build_plan(schedule, pp, vpp, m, k)]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_orders_equal_the_frameworks_written_out_again(pp: int) -> None:
    for m in range(1, 4 * pp + 3):
        if m % pp == 0:
            for vpp in (2, 3):
                got = _ops("interleaved", pp, vpp, m)
                assert [[(kd, mb, c) for kd, mb, c, _ in ops] for ops in got] == [
                    _megatron_interleaved(pp, vpp, m, r) for r in range(pp)], (pp, vpp, m)
        for schedule, reference in (("zb-h1", _torch_zb1p), ("zbv", _torch_zbv)):
            got = _ops(schedule, pp, 2 if schedule == "zbv" else 1, m)
            assert [[(kd, mb, c) for kd, mb, c, _ in ops] for ops in got] == [
                reference(pp, m, r) for r in range(pp)], (schedule, pp, m)
        if m >= 2 * pp:
            plans = build_plan("dualpipev", pp, 2, m)
            for r in range(pp):
                assert [[(kd, mb, c) for kd, mb, c, _ in step] for step in plans[r].steps()] == (
                    _deepseek_dualpipev(pp, m, r)), (pp, m, r)
        for k in (1, 2, 3):
            got = _ops("seq1f1b", pp, 1, m, k)
            assert [[(kd, mb, q) for kd, mb, _, q in ops] for ops in got] == [
                _sail_seq1f1b(pp, m, k, r) for r in range(pp)], (pp, m, k)


# --------------------------------------------------------------------------- the timing pass


def _reference_ends(graph, step_s: np.ndarray, p2p: float) -> list[float]:
    """Every step's end by the definition, in sweeps over the steps until all are timed: a step
    is timed once its previous step and inputs are, at their latest end (+ p2p per hop) plus its
    duration. No stage order or parking, as ``_run_stages`` has."""
    n = graph.n
    prev, a, b, c = (x.tolist() for x in (graph.prev, graph.a, graph.b, graph.c))
    xa, xb = graph.xa.tolist(), graph.xb.tolist()
    end: list[float | None] = [None] * n + [0.0]
    while any(e is None for e in end):
        timed = 0
        for i in range(n):
            if end[i] is None and all(end[j] is not None for j in (prev[i], a[i], b[i], c[i])):
                end[i] = max(end[prev[i]], end[a[i]] + xa[i] * p2p, end[b[i]] + xb[i] * p2p, end[c[i]]) + float(step_s[i])
                timed += 1
        assert timed, "the reference found a cycle"
    return end  # type: ignore[return-value]


@pytest.mark.parametrize("schedule, pp, vpp, m, k", [
    ("gpipe", 3, 1, 5, 1), ("1f1b", 1, 1, 3, 1), ("1f1b", 5, 1, 3, 1), ("1f1b", 4, 1, 9, 1),
    ("interleaved", 3, 2, 6, 1), ("interleaved", 4, 3, 12, 1), ("zb-h1", 5, 1, 4, 1), ("zb-h1", 3, 1, 7, 1),
    ("zbv", 3, 2, 2, 1), ("zbv", 4, 2, 11, 1), ("dualpipev", 3, 2, 6, 1), ("dualpipev", 4, 2, 11, 1),
    ("seq1f1b", 3, 1, 5, 2), ("seq1f1b", 4, 1, 3, 3),
])
def test_timing_pass_equals_the_definition(schedule: str, pp: int, vpp: int, m: int, k: int) -> None:
    """The one-pass timing (stages run until an input is missing, parked until it is timed)
    gives every step's end and start, and every step's depth, exactly as the definition does."""
    from ndplan.schedule.graph import build_graph, build_levels, time_steps

    graph = build_graph(schedule, pp, vpp, m, k)
    rng = np.random.default_rng(pp * 100 + m)
    for step_s, p2p in ((rng.random(graph.n), 0.25), (rng.integers(0, 3, graph.n).astype(float), 0.0)):
        want = _reference_ends(graph, step_s, p2p)
        start, end = time_steps(graph, step_s, p2p)
        assert end.tolist() == want[:-1]
        assert np.array_equal(start + step_s, end)  # each starts at the latest of its inputs
    depth = _reference_ends(graph, np.ones(graph.n), 0.0)[:-1]
    levels = build_levels(schedule, pp, vpp, m, k)
    assert sorted(depth) == [float(i + 1) for i, group in enumerate(levels.groups) for _ in group]
    for i, group in enumerate(levels.groups):
        assert {depth[s] for s in group.tolist()} == {float(i + 1)}


def test_stages_park_on_a_missing_input_and_a_deadlock_is_a_bug() -> None:
    """Stage 0's first step waits for stage 1's second, which waits behind stage 1's first, which
    waits for stage 0's second: no step can start, and the pass says which are stuck (a builder's
    bug: RuntimeError, not a user's NdplanError)."""
    from ndplan.schedule.graph import _run_stages

    n = 4  # steps 0, 1 on stage 0; 2, 3 on stage 1; 4 is the sentinel
    with pytest.raises(RuntimeError, match=r"deadlocks; \(stage, step\) stuck: \[\(0, 0\), \(1, 0\)\]"):
        _run_stages([0, 2, 4], [3, n, 1, n], [0.0] * n, [1.0] * n)
    assert _run_stages([0, 2, 4], [n, n, 1, n], [0.0] * n, [1.0] * n) == [1.0, 2.0, 3.0, 4.0, 0.0]
    # A stage parks on whichever input is missing: here stage 0's second step on input b (then c)
    # from stage 1, whose second step ends at 3, so it ends at 4.
    none = [n] * n
    assert _run_stages([0, 2, 4], [n, n, 0, n], [0.0] * n, [1.0] * n, ([n, 3, n, n], [0.0] * n, none)) == [
        1.0, 4.0, 2.0, 3.0, 0.0]
    assert _run_stages([0, 2, 4], [n, n, 0, n], [0.0] * n, [1.0] * n, (none, [0.0] * n, [n, 3, n, n])) == [
        1.0, 4.0, 2.0, 3.0, 0.0]
