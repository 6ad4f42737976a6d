"""Pipeline makespan from per-stage, per-micro-batch times: the simulator, or closed forms.

Two methods, one interface (``makespan``):

* ``simulate``: ndplan.schedule.simulate on the exact per-chunk durations (forward F, backward
  B, weight gradient W per [stage, local chunk]) and the p2p time. Exact for the op orders the
  schedule builders produce; a few ms per call. ``estimate_time`` uses it.
* ``closed_form``: formulas in the per-stage totals, vectorised over strategies, for the
  search. For identical stages they equal the simulator (tests check every schedule):

      gpipe, 1f1b           M = (m + p - 1)·T                       T = f + b + w per stage
      interleaved (v)       M = (m + (p - 1)/v)·T
      seq1f1b (k chunks)    M = (m + (p - 1)/k)·T
      zb-h1 (m >= p)        M = m·T + (p - 1)·max(f, b, f + b - w)
      zbv (m >= 2p - 1)     M = m·T + max over 8 linear pieces in (f, b, w), q = p - 1:
                                (0, 1/2, (q-1)/2), (0, q/2, 0), (0, q, -q), (1/2, 0, (q-1)/2),
                                (q-1/2, -(q-1)/2, 0), (q-1/2, 1/2, -q), (q, -q/2, -1/2), (q, 0, -q-1/2)
      dualpipev (m >= 2p)   M = m·T + max over ((q-1)/2, q/2, 0), ((q-1)/2, q, -q/2), (q, 0, 0),
                                (q, q/2, -q/2)

  (the zero-bubble pieces are the critical paths the simulator finds: each is one chain of ops
  that must run back to back, so their maximum is the makespan). Below those counts of
  micro-batches no closed form holds (``closed_form_holds``); ``simulated_makespan_batch`` times
  such strategies together on the simulator's graph. Unequal stages: the bottleneck
  stage (largest T) sets the steady state and the others shorten the fill and drain in
  proportion to their slack:

      M = m·T* + bubble(f*, b*, w*)·(1 - Σ_s (T* - T_s) / ((p - 1)·T*))

  which is exact for 1F1B/GPipe whenever the last stage is the slowest. For 1F1B it reads too
  slow otherwise: a bottleneck s* runs min(p-1-s*, m) warm-up forwards inside the fill, which
  the formula charges again, so it reads up to that many f* too slow (with a single bottleneck
  exactly that: Llama-3.1-405B over pp 64, 126 layers, stage 0 the bottleneck with two layers
  and the embedding: 26.41 s for the simulator's 23.99 s, 63·f0 = 2.42 s; remainder layers on
  the first half of pp 4-64, m = 2p: +8%). Given the stages' order (``stage_column``: the
  search's layouts, or per-stage columns), 1F1B's compute there is instead the longest of the
  chains of ``one_f_one_b_chain_bound``: a stage's own ops with its fill, its tail handed to the
  stages after it, or two stages bridged by a backward; the simulator's on those layouts and
  within 1% below it on random profiles. Point-to-point time adds c·p2p, with c the number of transfers on the
  critical path that the simulator shows for identical stages: gpipe 2(p-1) and interleaved
  2(p·v-1) (exact); 1f1b and seq1f1b 2·max(0, p-1-k) + 2·m·k·(p-1)/p (each steady-state step
  waits one round trip: a line through the simulator's staircase, for 1f1b 2(p-1) + 2(m-1) -
  2·floor((m+p-2)/p), equal at m a multiple of p and within 2 transfers between); zb-h1 4(p-1)
  (W fills the waits) or the 1f1b value when w = 0; zbv 6p-8 (6(p-1) when w = 0); dualpipev 4p-6
  + 2m(p-1)/p. The zero-bubble counts are those of the critical path when b >= f; which path is
  critical depends on (f, b, w): with F = B = W the simulator's are zbv 5p-7 and dualpipev
  2(p-1) fewer (zb-h1's the same), and with b < f fewer still.

The stage totals cannot show where a stage's interleaved chunks differ (remainder layers on
the first chunks, the head on the last): there the makespan is the larger of the form and
``interleaved_chain_bound``, the longest of a family of op chains through each stage's chunks
(a lower bound of the simulator, exact on the layouts it was derived from).

DualPipeV's overlapped F&B steps are simulated as F+B+W (overlap_f_and_b=False): compute
cannot hide compute. What DualPipeV hides is the expert all-to-all, which the layer times
already leave out (OverlapConfig.ep).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ndplan.arrays import unique
from ndplan.model.spec import ModelSpec
from ndplan.perf.codes import first_of_codes, row_codes
from ndplan.placement import place_layers
from ndplan.schedule import simulated_makespan_s
from ndplan.schedule.ops import V_SHAPE

Array = np.ndarray


@dataclass(frozen=True)
class StageLayout:
    """What each physical stage holds, as coefficients of per-piece times.

    dense, moe, emb, head: [pp] counts of each piece on a stage (summed over its chunks).
    size_values: the distinct decoder-layer counts of a chunk; dense_by_size[j, s] and
    moe_by_size[j, s] = Σ over chunks on s with size_values[j] layers of (layers of the kind)
    / size_values[j]; recomputing R layers per chunk recomputes min(R, n_v)·(kind share).
    Per virtual stage v (forward order): chunk_dense[v], chunk_moe[v], stage_of[v], chunk_of[v],
    and whether its forward sends its output to another stage (``chunk_sends_f[v]``: the next
    virtual stage sits elsewhere) and its backward the input gradient (``chunk_sends_b[v]``);
    sends_f, sends_b: [pp] those counted per stage.

    Stages that hold the same pieces cost the same, so the vectorised path works on distinct
    stage *profiles*: ``profile`` maps each coefficient above to its [P] values per profile
    (P <= pp, typically 2-4: first, middle, last), ``profile_count[q]`` is how many stages share
    profile q, ``profile_stage[q]`` the first of them and ``stage_profile[s]`` stage s's profile.
    """

    pp: int
    vpp: int
    dense: Array
    moe: Array
    emb: Array
    head: Array
    size_values: Array
    dense_by_size: Array
    moe_by_size: Array
    chunk_dense: Array
    chunk_moe: Array
    stage_of: Array
    chunk_of: Array
    chunk_sends_f: Array
    chunk_sends_b: Array
    sends_f: Array
    sends_b: Array
    profile: dict[str, Array]
    profile_count: Array
    profile_stage: Array
    #: [pp] the profile of each stage, in stage order
    stage_profile: Array

    @property
    def layers(self) -> Array:
        return self.dense + self.moe


@lru_cache(maxsize=4096)
def stage_layout(
    model: ModelSpec,
    pp: int,
    vpp: int,
    v_shape: bool,
    stage_layers: tuple[int, ...] | None = None,
    embedding_as_layer: bool = False,
    output_as_layer: bool = False,
) -> StageLayout:
    """The layout of ``model`` over pp stages of vpp chunks (cached)."""
    schedule = "zbv" if v_shape else ("interleaved" if vpp > 1 else "1f1b")
    placement = place_layers(
        model, pp, vpp, schedule, stage_layers,
        embedding_as_layer=embedding_as_layer, output_as_layer=output_as_layer,
    )
    stage_of, chunk_of = placement.stage_of, placement.chunk_of
    cd = placement.dense_layers.astype(np.float64)
    cm = placement.moe_layers.astype(np.float64)
    nv = cd + cm
    dense = np.bincount(stage_of, weights=cd, minlength=pp)
    moe = np.bincount(stage_of, weights=cm, minlength=pp)
    emb = np.zeros(pp)
    emb[stage_of[0]] = 1.0
    head = np.zeros(pp)
    head[stage_of[-1]] = 1.0
    sizes = unique(nv[nv > 0]) if np.any(nv > 0) else np.array([1.0])
    dense_by = np.zeros((len(sizes), pp))
    moe_by = np.zeros((len(sizes), pp))
    for j, size in enumerate(sizes):
        on = nv == size
        dense_by[j] = np.bincount(stage_of[on], weights=cd[on] / size, minlength=pp)
        moe_by[j] = np.bincount(stage_of[on], weights=cm[on] / size, minlength=pp)
    # A virtual stage sends on where the next (forward) or the previous (backward) sits on
    # another stage: every one but the ends, except a V-shape's turn on its last stage.
    elsewhere = (stage_of[1:] != stage_of[:-1]).astype(np.float64)
    chunk_sends_f = np.append(elsewhere, 0.0)
    chunk_sends_b = np.insert(elsewhere, 0, 0.0)
    sends_f = np.bincount(stage_of, weights=chunk_sends_f, minlength=pp)
    sends_b = np.bincount(stage_of, weights=chunk_sends_b, minlength=pp)
    table = np.vstack([dense, moe, emb, head, dense_by, moe_by, sends_f, sends_b])  # [6 + 2J, pp]
    # The distinct stage columns in lexicographic order, each at its first stage, and how many
    # stages hold each: np.unique(table, axis=1)'s, from the columns as tuples sorted stably
    # (a few dozen short columns, where np.unique's cost per call was most of a layout's).
    columns = list(zip(*table.tolist(), strict=True))
    first_of: list[int] = []
    counts: list[int] = []
    of_stage = np.empty(pp, dtype=np.intp)
    for s in sorted(range(pp), key=columns.__getitem__):
        if first_of and columns[s] == columns[first_of[-1]]:
            counts[-1] += 1
        else:
            first_of.append(s)
            counts.append(1)
        of_stage[s] = len(first_of) - 1
    first, count = np.array(first_of, dtype=np.intp), np.array(counts, dtype=np.intp)
    distinct = table[:, first]
    j = len(sizes)
    profile = {
        "dense": distinct[0], "moe": distinct[1], "emb": distinct[2], "head": distinct[3],
        "dense_by_size": distinct[4:4 + j], "moe_by_size": distinct[4 + j:4 + 2 * j],
        "sends_f": distinct[4 + 2 * j], "sends_b": distinct[5 + 2 * j],
    }
    out = StageLayout(
        pp, vpp, dense, moe, emb, head, sizes, dense_by, moe_by, cd, cm, stage_of, chunk_of, chunk_sends_f,
        chunk_sends_b, sends_f, sends_b, profile, count.astype(np.float64), first, of_stage,
    )
    for arr in (dense, moe, emb, head, sizes, dense_by, moe_by, cd, cm, chunk_sends_f, chunk_sends_b, sends_f, sends_b,
                *profile.values(), out.profile_count, first, of_stage):
        arr.flags.writeable = False
    return out


def recomputed_layers(layout: StageLayout, recompute_layers: Array) -> tuple[Array, Array]:
    """[n, P] dense and MoE layers recomputed per stage profile when each chunk recomputes
    ``recompute_layers`` of its layers (0: all)."""
    r = np.asarray(recompute_layers, dtype=np.float64)[:, None]
    prof = layout.profile
    width = len(layout.profile_count)
    if not np.any(r > 0):
        return np.broadcast_to(prof["dense"], (r.shape[0], width)), np.broadcast_to(prof["moe"], (r.shape[0], width))
    share = np.where(r > 0, np.minimum(r, layout.size_values[None, :]), layout.size_values[None, :])  # [n, J]
    return share @ prof["dense_by_size"], share @ prof["moe_by_size"]


# ----------------------------------------------------------------- closed forms

def _zbv_pieces(q: float) -> Array:
    """[8, 3] the critical-path coefficients of ZB-V on (f, b, w), q = p - 1."""
    return np.array([
        (0, 0.5, (q - 1) / 2), (0, q / 2, 0), (0, q, -q), (0.5, 0, (q - 1) / 2),
        (q - 0.5, -(q - 1) / 2, 0), (q - 0.5, 0.5, -q), (q, -q / 2, -0.5), (q, 0, -q - 0.5),
    ])


def _dualpipev_pieces(q: float) -> Array:
    """[4, 3] the critical-path coefficients of DualPipeV on (f, b, w), q = p - 1."""
    return np.array([((q - 1) / 2, q / 2, 0), ((q - 1) / 2, q, -q / 2), (q, 0, 0), (q, q / 2, -q / 2)])


def identical_bubble(schedule: str, pp: Array, vpp: Array | float, m: Array, k: Array, f: Array, b: Array, w: Array) -> Array:
    """Seconds the makespan exceeds m·(f + b + w) when every stage takes (f, b, w)."""
    q = pp - 1.0
    total = f + b + w
    if schedule in ("gpipe", "1f1b"):
        return q * total
    if schedule == "interleaved":
        return q * total / vpp
    if schedule == "seq1f1b":
        return q * total / k
    if schedule == "zb-h1":
        return q * np.maximum(np.maximum(f, b), f + b - w)
    out = np.empty(np.shape(f))
    # Strategies of one call usually share pp; price each distinct pp with its own pieces.
    q_values = unique(q)
    for qv in q_values.tolist():
        pieces = _zbv_pieces(qv) if schedule == "zbv" else _dualpipev_pieces(qv)
        sel = q == qv if len(q_values) > 1 else slice(None)
        x = np.stack([np.broadcast_to(f, out.shape)[sel], np.broadcast_to(b, out.shape)[sel],
                      np.broadcast_to(w, out.shape)[sel]], axis=-1)
        lines = x @ pieces.T  # [n, pieces]: each critical path's seconds
        # The longest, column by column: .max(axis=-1) over a short row costs ~2.5x as much.
        longest = lines[:, 0].copy()
        for j in range(1, lines.shape[1]):
            np.maximum(longest, lines[:, j], out=longest)
        out[sel] = longest
    return out


def p2p_hops(schedule: str, pp: Array, vpp: Array | float, m: Array, k: Array, w: Array) -> Array:
    """Transfers on the critical path (coefficient of p2p_s), see the module docstring."""
    steady = 2.0 * np.maximum(pp - 1.0 - k, 0.0) + 2.0 * m * k * (pp - 1.0) / pp
    if schedule == "gpipe":
        return 2.0 * (pp - 1.0)
    if schedule == "interleaved":
        return 2.0 * (pp * vpp - 1.0)
    if schedule in ("1f1b", "seq1f1b"):
        return steady
    if schedule == "zb-h1":
        return np.where(w > 0, 4.0 * (pp - 1.0), steady)
    if schedule == "zbv":
        return np.where(w > 0, 6.0 * pp - 8.0, 6.0 * (pp - 1.0))
    return 4.0 * pp - 6.0 + 2.0 * m * (pp - 1.0) / pp


def closed_form_makespan(
    schedule: str, pp: Array | float, vpp: Array | float, m: Array, k: Array, f: Array, b: Array, w: Array,
    p2p: Array, stage_count: Array | None = None, star: Array | None = None, total: Array | None = None,
    stage_column: Array | None = None, alike: list[Array] | None = None,
) -> tuple[Array, Array, Array]:
    """(makespan, p2p part, bottleneck column) for strategies sharing one schedule.

    f, b, w: [n, S] per-stage seconds of one micro-batch (all chunks of a stage); p2p: [n];
    pp and vpp: [n], or one number for all (as strategies sharing a layout have).
    Columns may be stage profiles standing for ``stage_count[q]`` identical stages each;
    ``star``, the bottleneck column, and ``total``, f + b + w, may be given when the caller has them.
    ``stage_column`` [p]: each stage's column in stage order (default, without ``stage_count``:
    the columns are the stages); with it, 1F1B's compute is ``one_f_one_b_chain_bound``'s
    rather than the slack-scaled fill (which needs no stage order and overstates an early
    bottleneck). ``alike``: integer columns [n] that rows with the same f, b, w and m share
    (a group's layer configuration, recompute limit and micro-batch count): the chains are
    worked out once per distinct row of them (a row's chains read its own row alone, so the
    same bits).
    """
    if total is None:
        total = f + b + w
    if star is None:
        star = np.argmax(total, axis=1)
    # Each row read at its bottleneck column: np.take at flat positions (~2.5x faster than the
    # fancy index [rows, star]).
    at = np.arange(total.shape[0]) * total.shape[1] + star
    t_star = np.take(total, at)
    w_star = np.take(w, at)
    pp_f = np.asarray(pp, dtype=np.float64)
    bubble = identical_bubble(schedule, pp_f, vpp, m, k, np.take(f, at), np.take(b, at), w_star)
    weight = np.ones(total.shape[1]) if stage_count is None else stage_count
    stages_s = total @ weight
    slack = t_star * weight.sum() - stages_s
    fill = np.where(pp_f > 1, 1.0 - slack / np.maximum((pp_f - 1.0) * t_star, 1e-30), 0.0)
    bubble = np.where(pp_f > 1, bubble * np.clip(fill, 0.0, 1.0), 0.0)
    p2p_part = np.where(pp_f > 1, p2p_hops(schedule, pp_f, vpp, m, k, w_star) * p2p, 0.0)
    if schedule in ("1f1b", "seq1f1b"):
        # Unequal stages: each steady 1F1B period the forward and backward chains cross every
        # stage once, 2k(pp-1)/pp hops per stage on average, and the stages faster than the
        # bottleneck absorb them: a period lasts max(t*, t_mean + 2k(pp-1)/pp·p2p). The warm-up's
        # 2(pp-1-k) hops stay, and the fill and drain never take fewer than 2(pp-1). Equal stages
        # give p2p_hops' count (a test holds the simulator to both).
        t_mean = stages_s / weight.sum()
        steady = m * np.maximum(0.0, t_mean - t_star + 2.0 * k * (pp_f - 1.0) / pp_f * p2p)
        warm = 2.0 * np.maximum(pp_f - 1.0 - k, 0.0) * p2p
        p2p_part = np.where(pp_f > 1, np.maximum(warm + steady, 2.0 * (pp_f - 1.0) * p2p), 0.0)
        if schedule == "1f1b" and total.shape[1] > 1 and (stage_column is not None or stage_count is None):
            columns = np.arange(total.shape[1]) if stage_column is None else stage_column
            # Where the last stage is the slowest the fill is exact (and the chains no longer).
            early = np.flatnonzero((total[:, columns[-1]] < t_star) & (np.broadcast_to(pp_f, t_star.shape) > 1))
            if len(early):
                m_early = np.broadcast_to(m, t_star.shape)[early]
                chains = _chain_bound_once_each(f, b, w, np.broadcast_to(m, t_star.shape), columns, early, alike)
                bubble = bubble.copy()
                bubble[early] = np.maximum(chains - m_early * t_star[early], 0.0)
    elif schedule == "dualpipev":
        # The same absorption for DualPipeV's 2(pp-1)/pp steady transfers a micro-batch: in a V
        # stage 0 holds the embedding, head and loss and is usually the bottleneck, and the
        # others' slack hides the transfers (Qwen3-8B over pp 8, m 64: 0.219 s charged, 0.016 s
        # simulated). The fill and drain's 4pp - 6 stay.
        t_mean = stages_s / weight.sum()
        steady = m * np.maximum(0.0, t_mean - t_star + 2.0 * (pp_f - 1.0) / pp_f * p2p)
        p2p_part = np.where(pp_f > 1, (4.0 * pp_f - 6.0) * p2p + steady, 0.0)
    return m * t_star + bubble + p2p_part, p2p_part, star


def _chain_bound_once_each(f: Array, b: Array, w: Array, m: Array, columns: Array, rows: Array,
                           alike: list[Array] | None) -> Array:
    """``one_f_one_b_chain_bound`` of ``rows`` (backward b + w), worked out once per distinct
    row of the ``alike`` columns among them (None: once per row) and gathered: the mixed
    Llama-3.1-405B batch's 1F1B rows with an early bottleneck are ~3.4 alike each."""
    if alike is None:
        return one_f_one_b_chain_bound(f[rows], b[rows] + w[rows], m[rows], columns)
    codes, count = row_codes([column[rows] for column in alike])
    if 2 * count > len(rows):  # too few alike to pay for the gather
        return one_f_one_b_chain_bound(f[rows], b[rows] + w[rows], m[rows], columns)
    distinct = rows[first_of_codes(codes, count)]
    return one_f_one_b_chain_bound(f[distinct], b[distinct] + w[distinct], m[distinct], columns)[codes]


def one_f_one_b_chain_bound(f: Array, b: Array, m: Array, stage_column: Array) -> Array:
    """[n] seconds of the longest of a family of op chains through 1F1B (no transfers): the
    makespan where stages differ, which the slack-scaled fill overstates. f, b: [n, S] forward
    and whole backward seconds of one micro-batch per column; ``stage_column`` [p]: each stage's
    column, in stage order; m: [n].

    Stage s runs w = min(p-1-s, m-1) warm-up forwards after its first, then forward w+i beside
    backward i, then the remaining backwards. These run one after another (stage order, data):

    * one stage: F0 down to s, all of s's ops, B(m-1) back to stage 0; or from B0, reached
      through F0 over every stage and B0 back up to s (s then has idled):
          L_s = Σ_{s'<s} T + m·T_s + max(0, Σ_{s'>s} T - w·f_s)
      (a bottleneck's warm-up forwards run inside the fill: the form charges them again,
      w·f_s too slow for a single early bottleneck, 2.42 s of Llama-3.1-405B's 23.99 s over
      pp 64 with the embedding on stage 0);
    * the same, s's last forward handed down to s+1..s+d, whose backward d comes back to s
      (d <= w = p-1-s < m): s skips d of its backwards, the others add theirs,
          L_s + max_d Σ_{i=1..d} (T_{s+i} - b_s)
      (a stage as slow as an earlier bottleneck delays its tail);
    * two stages s2 < s: s from its B0 (entered as above) to its backward k, B_k down to s2,
      s2's ops from B_k on, B(m-1) back to stage 0, k at m - w_s2 or m - w_s (the kinks of
      this piecewise-linear length).

    The maxima run over each run of stages sharing a column at its first and last stage (and the
    run ends as hand-over points); each chain is a path of the simulator's graph, so the bound
    never exceeds it. Against the simulator, 400 random profiles (heavier first and last stages,
    a plateau of heavier stages on half of them, m from p/2 to 4p): within 0.01% at m >= 2p,
    -0.8% at worst at m = p, where the form read up to +21%."""
    col = np.asarray(stage_column, dtype=np.intp)
    p = len(col)
    cut = np.flatnonzero(np.diff(col)) + 1
    start = np.concatenate([[0], cut]).astype(np.intp)
    length = np.diff(np.concatenate([start, [p]]))
    run_col = col[start]
    m = np.asarray(m, dtype=np.float64)[:, None]
    fr, br = f[:, run_col], b[:, run_col]

    def before_runs(x: Array) -> Array:  # Σ over the stages of earlier runs, [n, R + 1]
        out = np.zeros((x.shape[0], x.shape[1] + 1))
        np.cumsum(x * length, axis=1, out=out[:, 1:])
        return out

    pf, pb = before_runs(fr), before_runs(br)
    f_all, b_all = pf[:, -1:], pb[:, -1:]
    t_end = (pf + pb)[:, 1:]  # Σ T through each run's last stage
    # candidate stages: each run's last
    cand_run = np.arange(len(start))
    cand_off = length - 1
    stage = (start[cand_run] + cand_off).astype(np.float64)
    fs, bs = fr[:, cand_run], br[:, cand_run]
    ts = fs + bs
    fb = pf[:, cand_run] + cand_off * fs  # Σ_{s'<s} f
    bb = pb[:, cand_run] + cand_off * bs
    t_after = (f_all + b_all) - fb - bb - ts
    w = np.minimum(p - 1.0 - stage, m - 1.0)  # [n, C]
    single = fb + bb + m * ts + np.maximum(t_after - w * fs, 0.0)
    # hand the last forward down to the end of a later run (then the gain is linear in d)
    run_end = (start + length - 1).astype(np.float64)
    gain = np.zeros_like(single)
    for r in range(len(start)):
        later = run_end[r] > stage  # [C]
        if not later.any():
            continue
        d = run_end[r] - stage
        g = t_end[:, r:r + 1] - (fb + bb + ts) - d * bs
        np.maximum(gain, np.where(later & (d <= w), g, 0.0), out=gain)
    best = (single + np.where(p - 1.0 - stage < m, gain, 0.0)).max(axis=1)
    # two stages: s2 a candidate before s
    entry = np.maximum(fb + (w + 1.0) * fs, f_all + (b_all - bb - bs))
    lo, hi = np.nonzero(stage[:, None] < stage[None, :])  # the pairs s2 < s
    if len(lo):
        w2, f2, b2 = w[:, lo], fs[:, lo], bs[:, lo]
        wj, fj, bj = w[:, hi], fs[:, hi], bs[:, hi]
        base = entry[:, hi] + bb[:, hi] - b2
        for k in (m - w2, m - wj):
            value = base + (k + 1.0) * bj + np.clip(np.minimum(k, m - wj - 1.0), 0.0, None) * fj
            value += (m - k) * b2 + np.maximum(m - 1.0 - w2 - k, 0.0) * f2
            value[(k < 0.0) | (k > m - 1.0)] = 0.0
            np.maximum(best, value.max(axis=1), out=best)
    return best


def interleaved_chain_bound(f: Array, b: Array, m: Array, p2p: Array, of: Array | None = None) -> tuple[Array, Array]:
    """(seconds, transfers) of the longest of a family of op chains through Megatron's
    interleaved schedule: a lower bound of its makespan that uses each stage's chunks, which the
    closed form, in stage totals, cannot see. f, b: [n, p, v] per-chunk forward and whole
    backward (B + W) seconds, stage-major as the simulator takes them; m (a multiple of p) and
    p2p: [k], each for the chunks of row ``of`` [k] of f and b (default: row for row).

    Every stage s runs group 0's forwards chunk by chunk, p micro-batches of local chunk 0, then
    of chunk 1, ... (all inside its warm-up), and ends on the last group's p backwards of chunk 0.
    So these ops follow one another (stage order or data), for stages h <= j <= r, s2 <= r:

      F0 of micro-batch 0 on stages 0..h-1;  stage h's first p·(v-1) forwards (chunks 0..v-2);
      F(v-2) of micro-batch p-1 on stages h+1..j;  F(v-1) of micro-batch 0 on stages j..r-1;
      stage r from its F(v-1) of micro-batch 0 to its B0 of micro-batch m-p (all its ops but
      the first p·(v-1) forwards and the last p-1 backwards);  that B0 on stages r-1..s2+1;
      stage s2's last p backwards;  B0 of micro-batch m-1 on stages s2-1..0.

    With W_s = Σ_{c<v-1} f[s, c] and T_s = f + b summed over s's chunks, its length is

      Σ_{s<h} f[s,0] + p·W_h + Σ_{h<s<=j} f[s,v-2] + Σ_{j<=s<r} f[s,v-1]
        + m·T_r - p·W_r - (p-1)·b[r,0] + Σ_{s<r} b[s,0] + (p-1)·b[s2,0]  + 2r·p2p

    (r hops down and r back up), maximised over h, j, s2 by running maxima along the stages and
    over r. For identical stages the best chain (r = h = j = p - 1) is the closed form's
    (m + (p-1)/v)·T + 2(p·v-1)·p2p less 2p(v-1)·p2p (fewer hops). Where a stage's chunks differ it is what
    the form misses: Llama-3.1-70B over pp 32 × vpp 2 (80 layers: chunk 0 of stages 0-15 two
    layers, the head on stage 31's chunk 1), m 64, full recompute, where the closed form reads
    20.38 s and the simulator 22.85 s, is this chain with r = 31, h = 0, j = 15, s2 = 0: the
    last stage's heavy chunk 1 (the head) holds back the next group's chunk-0 forwards while
    the others wait, which no stage total shows.

    Detours through the last stage (stage 0 the main run, k = m/p groups): the path above up to
    stage p-1's first chunk-(v-1) forward, then its p pairs F(v-1), B(v-1) of group 0, B(v-1) of
    micro-batch p-1 down to a stage t, t's forward between its backwards p-1 and p (there while
    its warm-up ends before, m >= 2p), B(v-2) of micro-batch 0 down to stage 0; stage 0 from its
    backward p on; and/or stage 0 up to B1 of micro-batch m-p-1 (its backward unit
    (k-2)·p·v + (v-1)·p - 1), which feeds B0 of the same micro-batch on stage p-1, whose ops up
    to B0 of micro-batch m-p are p·(f[p-1,v-1] + Σ_{c>=1} b[p-1,c]) + 2·b[p-1,0] (the last
    group's chunk-(v-1) pairs), then that B0 down to stage 0 and stage 0's last p backwards.
    Stage 0's ops before and after a given unit are counted per chunk from the unit pattern
    (forward unit u runs chunk (u mod p·v) // p, backward unit u the mirror). Llama-3.1-70B as
    above at m 128 (dp1 cp2): a step of 19.88 s by the form (makespan 19.84 s; the one-stage
    chains' 19.81 s), 21.20 s simulated; 21.05 s with the detours (3p-2 hops).

    A chain is a path of the simulator's own graph, so its length never exceeds the simulated
    makespan (tests/test_perf_pipeline.py holds 200 random chunk profiles to it, p2p included)."""
    return interleaved_chain_bound_by_stage(np.ascontiguousarray(f.transpose(2, 1, 0)),
                                            np.ascontiguousarray(b.transpose(2, 1, 0)), m, p2p, of)


def interleaved_chain_bound_by_stage(
    ft: Array, bt: Array, m: Array, p2p: Array, of: Array | None = None,
) -> tuple[Array, Array]:
    """``interleaved_chain_bound`` of f and b given stage-major: ft, bt [v, p, n] (chunk, stage,
    row; each [n] contiguous), as the search's chunk times come without a transposition.

    Each running sum or maximum over the stages is then p vector operations across the rows,
    where along the short stage axis of [n, p] numpy pays per row (several times as long).
    Running sums add in stage order either way and every other sum is taken along rows as
    before: the figures are the same to the bit. A fresh array costs page faults about as much
    as its arithmetic: the [p, n] buffers are reused once done with."""
    v, p, n = ft.shape
    warm = ft[0]  # W_s, [p, n]
    if v > 2:
        warm = warm.copy()
        for c in range(1, v - 1):
            warm += ft[c]
    total = warm + ft[v - 1]
    for c in range(v):
        total += bt[c]  # T_s, [p, n]
    p_warm = p * warm

    def running(op: np.ufunc, x: Array, out: Array | None = None) -> Array:  # op.accumulate over the stages
        out = np.empty_like(x) if out is None else out
        out[0] = x[0]
        for s in range(1, len(x)):
            op(out[s - 1], x[s], out=out[s])
        return out

    def before(x: Array, out: Array | None = None) -> Array:  # Σ_{s' < s} x[s'], [p, n]
        out = np.empty(x.shape) if out is None else out
        out[0] = 0.0
        if p > 1:
            running(np.add, x[:-1], out[1:])
        return out

    turn = running(np.add, ft[v - 2])  # Σ_{s <= j} f[s, v-2]
    best_h = before(ft[0])
    best_h += p_warm
    best_h -= turn
    running(np.maximum, best_h, best_h)  # max over h <= j
    best_h += turn
    last = before(ft[v - 1], turn)  # Σ_{s < j} f[s, v-1]
    best_h -= last
    entry = running(np.maximum, best_h, best_h)
    entry += last  # max over j <= r
    b0 = bt[0]
    fixed = running(np.maximum, b0, last)
    fixed *= p - 1
    scratch = np.empty((p, n))
    fixed += before(b0, scratch)  # the drain, max over s2 <= r
    fixed += entry
    fixed -= p_warm
    fixed -= np.multiply(b0, p - 1, out=scratch)
    hops = 2.0 * np.arange(p, dtype=np.float64)
    # Detours (p > 1): stage p-1 runs group 0's chunk-(v-1) pairs before stage 0 takes over at its
    # backward unit p (B(v-2) of micro-batch 0): B(v-1) of micro-batch p-1 down to a stage t,
    # its forward between the two backwards (where its warm-up leaves one: m >= 2p), B(v-2) of
    # micro-batch 0 on to stage 1. Per chunk configuration, the best t for either case of m.
    if p > 1:
        t = np.arange(1, p)
        w_t = 2 * (p - 1 - t) + (v - 1) * p
        down = running(np.add, bt[v - 1][:0:-1], scratch[:p - 1])  # Σ_{t<=s<=p-1} b[s, v-1], t from p-1 down
        down -= bt[v - 1][p - 1]  # Σ_{t<=s<=p-2} b[s, v-1]
        turn_without = running(np.add, bt[v - 2][1:], p_warm[:p - 1])  # Σ_{1<=s<=t} b[s, v-2]
        turn_without += down[::-1]
        mid = ft[((w_t + p) % (p * v)) // p, t]  # the forward between
        mid += turn_without
        turn_with, turn_without = mid.max(axis=0), turn_without.max(axis=0)
    else:
        turn_with = turn_without = np.zeros(n)
    entry_last = entry[p - 1] + p * (ft[v - 1, p - 1] + bt[v - 1, p - 1])
    f0, b0_all, last_b = ft[:, 0], bt[:, 0], bt[:, p - 1]  # stage 0's and stage p-1's chunks, [v, n]
    exit_fixed = (p * (ft[v - 1, p - 1] + _row_sums(last_b[1:])) + 2.0 * last_b[0]
                  + _row_sums(bt[0, 1:p - 1]) + p * b0_all[0])
    first_b = p * b0_all[v - 1]
    total0 = total[0].copy()
    if of is not None:  # each row's chunks, then its micro-batches and transfers
        fixed, total = fixed[:, of], total[:, of]
        turn_with, turn_without, entry_last = turn_with[of], turn_without[of], entry_last[of]
        f0, b0_all, exit_fixed, first_b, total0 = f0[:, of], b0_all[:, of], exit_fixed[of], first_b[of], total0[of]
    m = np.asarray(m, dtype=np.float64)
    p2p = np.asarray(p2p, dtype=np.float64)
    chain = np.multiply(total, m, out=total)
    chain += fixed
    chain += np.multiply.outer(hops, p2p, out=fixed)
    r = np.argmax(chain, axis=0)
    best, best_hops = np.take_along_axis(chain, r[None, :], axis=0)[0], hops[r]
    if p > 1:
        # Unit counts per chunk depend on m alone: worked out per distinct m and gathered.
        m_values, m_code = unique(m, return_inverse=True)
        units = m_values * v
        w0 = np.minimum(units, 2 * (p - 1) + (v - 1) * p)
        k0 = (m_values / p - 2.0) * p * v + (v - 1) * p - 1  # stage 0's last backward before the exit detour

        def per_chunk(lo: Array, hi: Array, backward: bool) -> Array:
            # [distinct m, v] units lo..hi-1 on each chunk ((k % pv) // p; mirrored backward)
            def upto(k: Array) -> Array:
                k = np.maximum(k, 0.0)[:, None]
                return np.floor(k / (p * v)) * p + np.clip(np.mod(k, p * v) - np.arange(v) * p, 0.0, p)
            count = np.maximum(upto(hi) - upto(lo), 0.0)
            return count[:, ::-1] if backward else count

        before_f = per_chunk(np.zeros_like(units), np.minimum(w0 + p + 1, units), False)
        after_b = per_chunk(k0 + 1, units, True)
        after_f = np.where((k0 < units - w0)[:, None], per_chunk(w0 + k0 + 1, units, False), 0.0)
        m_code = m_code.ravel()
        k0, w0 = k0[m_code], w0[m_code]
        whole = m * total0

        def weighted(count: Array, x: Array) -> Array:  # Σ_c count[m, c]·x[c], [k]
            return _row_sums(np.take(count.T, m_code, axis=1) * x)

        before_p = weighted(before_f, f0) + first_b
        after_k0 = weighted(after_b, b0_all) + weighted(after_f, f0)
        d_entry = entry_last + np.where(m >= 2 * p, turn_with, turn_without) - before_p
        for value, count, valid in (
            (d_entry + whole, 2.0 * (p - 1), m >= p),  # entry detour, then stage 0 to its end
            (whole - after_k0 + exit_fixed, float(p), k0 >= 0),  # exit detour: stage 0's wrap to p-1
            (d_entry + whole - after_k0 + exit_fixed, 3.0 * p - 2.0, k0 >= p),  # both
        ):
            value = value + count * p2p
            longer = valid & (value > best)
            best = np.where(longer, value, best)
            best_hops = np.where(longer, count, best_hops)
    return best, best_hops


def _row_sums(x: Array) -> Array:
    """Σ over the first axis of [L, n], as numpy sums each row of the transposed [n, L] (the
    figures as before, to the bit): in order under 8 terms, as numpy sums a column; pairwise
    from 8 (8 partial sums), for which the transposed rows are summed."""
    return x.sum(axis=0) if len(x) < 8 else np.ascontiguousarray(x.T).sum(axis=1)


@lru_cache(maxsize=1024)
def interleaved_stall(pp: int, chunk_layers: tuple[float, ...]) -> float:
    """The fraction of a stage's time per micro-batch that the interleaved schedule loses in its
    steady state where a stage's chunks hold different layer counts (``chunk_layers``: [pp·vpp]
    stage-major, layers of each chunk); 0 where every stage's chunks are equal. The closed form
    takes them as equal; the simulator, fed one layer's forward and backward as 1/3 and 2/3 of a
    unit, finds a stall constant per micro-batch and nearly independent of the forward's share
    (80 layers over pp 8 × vpp 4, chunks of 3, 3, 2, 2: 5%; 61 over pp 8 × vpp 2, chunks of 6 and
    2: 34%), measured here once per layout from two runs (2·pp and 4·pp micro-batches)."""
    grid = np.asarray(chunk_layers, dtype=np.float64).reshape(pp, -1)
    if pp < 2 or grid.shape[1] < 2 or bool(np.all(grid == grid[:, :1])):
        return 0.0
    runs = [simulated_makespan_s("interleaved", pp, grid.shape[1], m, forward_s=grid / 3.0, backward_s=grid * (2.0 / 3.0),
                                 weight_grad_s=np.zeros_like(grid), overlap_f_and_b=False) for m in (2 * pp, 4 * pp)]
    return max((runs[1] - runs[0]) / (2 * pp) / float(grid.sum(axis=1).max()) - 1.0, 0.0)


def closed_form_holds(schedule: str, pp: int, m: Array) -> Array:
    """Per micro-batch count, whether the schedule's closed form (identical stages) is its
    makespan: the zero-bubble forms assume a steady state, which ZB-H1 reaches with m >= p and
    ZB-V with m >= 2p - 1; below, the warm-up and drain overlap and the forms are off, most often
    too fast (with equal f, b, w by up to 41% for ZB-H1, 62% for ZB-V; a W three times F reads
    ZB-V at pp 8, m 8 5% too slow; tests/test_perf_pipeline.py). The others hold for every m
    the rules allow (DualPipeV needs m >= 2p, interleaving m >= p)."""
    m = np.asarray(m)
    if schedule == "zbv":
        return m >= 2 * pp - 1
    if schedule == "zb-h1":
        return m >= pp
    return np.ones(m.shape, dtype=bool)


# ----------------------------------------------------------------- simulation

def simulated_makespan_batch(
    schedule: str, pp: int, vpp: int, m: int, seq_chunks: int, f: Array, b: Array, w: Array, p2p: Array,
) -> tuple[Array, Array]:
    """``simulated_makespan`` for N strategies sharing one schedule shape, timed together
    (``ndplan.schedule.graph.time_steps_batch``): f, b, w [N, pp, vpp] per-chunk seconds as the
    simulator takes them, p2p [N]. Returns (makespan, p2p part), [N] each."""
    from ndplan.schedule import SPLIT_BACKWARD
    from ndplan.schedule.graph import time_steps_batch

    if schedule not in SPLIT_BACKWARD:
        b, w = b + w, np.zeros_like(w)  # B runs the whole backward
    op_s = np.stack([f / seq_chunks, b / seq_chunks, w], axis=-1).reshape(len(f), -1)
    p2p = np.asarray(p2p, dtype=np.float64)
    # The p2p part is the makespan less the same timeline without transfers: the strategies that
    # pay any go again, p2p 0, in the same call (each strategy is timed on its own column, so
    # one pass over the graph's depth groups serves both).
    n = len(op_s)
    paid = np.flatnonzero(p2p > 0)
    times = time_steps_batch(schedule, pp, vpp, m, seq_chunks, np.concatenate([op_s, op_s[paid]]),
                             np.concatenate([p2p, np.zeros(len(paid))]))
    with_p2p = times[:n]
    without = with_p2p.copy()
    without[paid] = times[n:]
    return with_p2p, with_p2p - without


def simulated_makespan(
    schedule: str, pp: int, vpp: int, m: int, seq_chunks: int,
    f: Array, b: Array, w: Array, p2p: float,
) -> tuple[float, float]:
    """(makespan, p2p part) from the simulator; f, b, w are [pp, vpp] per-chunk seconds."""
    if pp == 1:
        return float(m * (f.sum() + b.sum() + w.sum())), 0.0
    kwargs = dict(seq_chunks=seq_chunks, forward_s=f, backward_s=b, weight_grad_s=w, overlap_f_and_b=False)
    with_p2p = simulated_makespan_s(schedule, pp, vpp, m, p2p_s=p2p, **kwargs)  # type: ignore[arg-type]
    without = simulated_makespan_s(schedule, pp, vpp, m, p2p_s=0.0, **kwargs) if p2p > 0 else with_p2p  # type: ignore[arg-type]
    return with_p2p, with_p2p - without


def is_v_shape(schedule: str) -> bool:
    return schedule in V_SHAPE
