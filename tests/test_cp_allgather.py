"""All-gather context parallelism (``cp_kind`` 'allgather'): Transformer Engine's and MindSpeed's
AttnFuncWithCPAndKVAllGather, Megatron's ``--cp-comm-type allgather`` and MindSpeed's
``--context-parallel-algo kvallgather_cp_algo``. Every figure below is derived by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.io import emit, read_config
from ndplan.memory import MemoryOptions, estimate, stage_memory
from ndplan.model import get_preset
from ndplan.perf import default_efficiency, estimate_time
from ndplan.search import default_space
from ndplan.search.run import run_search, runtime_refusals
from ndplan.strategy import CP_KINDS, Strategy, StrategyBatch

LLAMA8 = get_preset("llama-3.1-8b")


def _cluster(n: int, device: str = "h100-sxm") -> Cluster:
    return Cluster(device=get_device(device), num_devices=n)


def _pieces(strategies: list[Strategy], devices: int) -> dict[tuple[str, str], np.ndarray]:
    """The dense decoder layer's seconds per (pass, category) for each strategy, on H100s."""
    from ndplan.perf.layer import LayerContext, piece_times
    from ndplan.perf.overlap import default_overlap
    from ndplan.perf.step import compute_rates, strategy_columns
    from ndplan.perf.topology import Fabric

    batch = StrategyBatch.of(strategies)
    cluster = _cluster(devices)
    eff = default_efficiency(cluster.device)
    overlap = default_overlap(cluster.device.runtime)
    ctx = LayerContext(LLAMA8, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap,
                       batch.precision, recompute_modules=batch.recompute_modules)
    dense = piece_times(ctx, strategy_columns(LLAMA8, batch, overlap))["dense"]
    return {key: np.broadcast_to(value, (len(batch),)) for key, value in dense.seconds.items()}


def test_the_gathers_and_the_reduce_scatter_are_exposed():
    """Llama-3.1-8B on 16 A100s, tp 8 and cp 2 across nodes (25 GB/s · 0.85, 10 µs a step), seq
    8192, two micro-batches, no recompute. A rank's K + V: 4096 tokens · (8 KV heads / 8) · (128 +
    128) = 1,048,576 elements, 2,097,152 B; the all-gather of the two ranks' 4,194,304 B takes
    10 µs + (1/2)·4,194,304/21.25e9 = 108.69 µs, the reduce-scatter of the gradients as much.
    Forward: the gather; backward: the gather again and the reduce-scatter, none of it hidden ->
    2 micro-batches · 32 layers · 3 · 108.69 µs = 20.87 ms of exposed CP; the ring hides its
    sends under attention instead."""
    s = Strategy(dp=1, tp=8, cp=2, cp_kind="allgather", sequence_parallel=True, micro_batch_size=1,
                 num_micro_batches=2, seq_length=8192)
    cluster = _cluster(16, "a100-80gb")
    collective = 10e-6 + 0.5 * 4_194_304 / (25e9 * 0.85)
    assert collective == pytest.approx(108.69e-6, abs=0.01e-6)
    r = estimate_time(LLAMA8, s, cluster)
    assert r.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * 3 * collective, rel=1e-9)
    ring = estimate_time(LLAMA8, s.model_copy(update={"cp_kind": "ring"}), cluster)
    assert ring.breakdown["comm_exposed"]["cp"] < r.breakdown["comm_exposed"]["cp"] / 2
    # A full recompute replays the forward's gather in the backward.
    full = estimate_time(LLAMA8, s.model_copy(update={"recompute": "full"}), cluster)
    assert full.breakdown["comm_exposed"]["cp"] == pytest.approx(2 * 32 * 4 * collective, rel=1e-9)


def test_two_attention_calls_and_the_copies_around_them():
    """Llama-3.1-8B, dp 2 x cp 4 on 8 H100s, seq 16384: T = 4096 tokens a rank, KV = 4096 · 2048
    = 8,388,608 elements, Q = O = 4096 · 4096 = 16,777,216. The copies (memory_ops' docstring):
    forward (2·4·KV + 2·O)·2 = 201,326,592 B; backward ((8·4 + 3/2)·KV + 2·Q)·2 = 629,145,600 B,
    at 3.35e12 · 0.8 B/s. Two attention calls a pass where the ring makes four: 2 · 2e-4 s of
    fixed cost fewer, split forward : backward as 1 : 2.5. Its collectives over the node's
    NVLink (450 GB/s · 0.8, 3 µs a step): 3·3 µs + (3/4)·4·KV·2/360e9 = 148.81 µs forward, twice
    that backward."""
    rate, call = 3.35e12 * 0.8, 2e-4
    eff = default_efficiency(get_device("h100-sxm"))
    assert (eff.hbm_efficiency, eff.attention_call_s) == (0.8, call)
    kinds = [Strategy(dp=2, cp=4, cp_kind=kind, seq_length=16384) for kind in ("ring", "allgather")]
    ring, gathered = (dict((key, value[i]) for key, value in _pieces(kinds, 8).items()) for i in range(2))
    assert gathered[("F", "compute")] - ring[("F", "compute")] == pytest.approx(
        201_326_592 / rate - 2 * call / 3.5, rel=1e-9)
    assert gathered[("B", "compute")] - ring[("B", "compute")] == pytest.approx(
        629_145_600 / rate - 2.5 * 2 * call / 3.5, rel=1e-9)
    gather = 9e-6 + 0.75 * 4 * 8_388_608 * 2 / (450e9 * 0.8)
    assert gather == pytest.approx(148.81e-6, abs=0.01e-6)
    assert gathered[("F", "cp")] == pytest.approx(gather, rel=1e-9)
    assert gathered[("B", "cp")] == pytest.approx(2 * gather, rel=1e-9)


def test_the_backward_holds_the_gathered_keys_values_and_their_gradients():
    """Megatron's runtime, Llama-3.1-8B (k_w = v_w = 1024), bf16, dp 2 x cp 4, seq 16384: T = 4096
    tokens a rank. All-gather CP holds ((3c + 1/2)·(k_w + v_w) + c·max(k_w, v_w))·T·β =
    (12.5 · 2048 + 4096) · 4096 · 2 = 243,269,632 B while a layer's backward runs; the ring
    2·(k_w + v_w)·T·β = 33,554,432 B and Ulysses 2·(4096 + 1024 + 1024 + 4096)·T·β =
    167,772,160 B; each is the largest buffer alive (no TP, no experts, no pipeline). A batch
    of the three prices each as it prices it alone."""
    options = MemoryOptions(runtime="megatron")
    strategies = [Strategy(dp=2, cp=4, cp_kind=kind, seq_length=16384) for kind in ("ring", "ulysses", "allgather")]
    alone = [estimate(LLAMA8, s, options=options).stages[0].comm_bytes for s in strategies]
    assert alone[2] - alone[0] == 243_269_632 - 33_554_432
    assert alone[2] - alone[1] == 243_269_632 - 167_772_160
    together = stage_memory(LLAMA8, StrategyBatch.of(strategies), options)
    assert list(together.comm[:, 0]) == alone
    said = estimate(LLAMA8, strategies[2], options=options).explain()
    assert any("CP K/V is all-gathered (cp_kind allgather)" in line for line in said)


def test_more_tp_ranks_than_kv_heads_gather_one_head_a_rank():
    """Llama-3.1-8B has 8 KV heads: at tp 16 a rank holds one whole, so its K + V are T·256
    elements as at tp 8, not half; both the buffer and the gather are tp 8's. cp 8 at seq 32768
    (T = 4096): ((3·8 + 1/2)·256 + 8·128)·4096·2 = 59,768,832 B, above the sequence-parallel
    gather's 4096·4096·2 = 33,554,432 B."""
    options = MemoryOptions(runtime="megatron")
    at = {t: Strategy(tp=t, cp=8, cp_kind="allgather", sequence_parallel=True, seq_length=32768) for t in (8, 16)}
    buffers = {t: estimate(LLAMA8, s, options=options).stages[0].comm_bytes for t, s in at.items()}
    assert buffers[8] == buffers[16] == 59_768_832
    cluster = _cluster(128, "h100-sxm")
    seconds = {t: estimate_time(LLAMA8, Strategy(dp=16 // t, tp=t, cp=8, cp_kind="allgather", sequence_parallel=True,
                                                 seq_length=32768), cluster).breakdown["comm_exposed"]["cp"]
               for t in (8, 16)}
    assert seconds[16] == seconds[8]  # the same bytes, across nodes either way


def test_megatron_and_mindspeed_launches_read_and_write_it():
    """--cp-comm-type allgather and MindSpeed's --context-parallel-algo kvallgather_cp_algo read
    as all-gather CP without a warning; the Megatron emitter writes --cp-comm-type allgather back.
    Frameworks without it say they lose it."""
    for flag in ("--cp-comm-type allgather", "--context-parallel-algo kvallgather_cp_algo"):
        read = read_config(_launch(flag), model="llama-3.1-8b", devices=8)
        assert read.strategy().cp_kind == "allgather"
        assert not any("allgather" in w or "priced as ring" in w for w in read.warnings)
    s = Strategy(dp=4, cp=2, cp_kind="allgather", seq_length=8192)
    assert "--cp-comm-type allgather" in emit(LLAMA8, s, "megatron")
    for fmt, written in (("torchtitan", "context_parallel_degree = 2"), ("hyperparallel", "context_parallel_algo: ring"),
                         ("mindformers", "context_parallel_algo: colossalai_cp")):
        text = emit(LLAMA8, s, fmt)
        assert written in text
        assert any(line.startswith("# ndplan: not expressible") and "allgather context parallelism" in
                   line.replace("all-gather", "allgather") for line in text.splitlines())


_SCRIPTS: list[object] = []


def _launch(flag: str):  # type: ignore[no-untyped-def]
    import tempfile
    from pathlib import Path

    folder = tempfile.TemporaryDirectory()
    _SCRIPTS.append(folder)  # (kept alive for the read)
    path = Path(folder.name) / "run.sh"
    path.write_text(f"torchrun pretrain_gpt.py --context-parallel-size 2 {flag} --micro-batch-size 1 "
                    "--global-batch-size 8 --seq-length 8192 --bf16\n")
    return path


def test_the_pytorch_runtime_refuses_it():
    """torch's context parallelism is a ring: the pytorch runtime refuses all-gather CP, in the
    estimate (an error naming the runtime) and in the search (not runnable)."""
    s = Strategy(dp=4, cp=2, cp_kind="allgather", seq_length=8192)
    with pytest.raises(NdplanError, match="runtime 'pytorch' runs torch's ring attention.*use runtime megatron"):
        estimate(LLAMA8, s, options=MemoryOptions(runtime="pytorch"))
    assert any("cp_kind=allgather" in reason for reason in runtime_refusals(s, MemoryOptions(runtime="pytorch"), LLAMA8))
    assert runtime_refusals(s, MemoryOptions(runtime="megatron"), LLAMA8) == []


def test_a_search_takes_it_fixed_but_does_not_vary_it():
    """The search varies ring and Ulysses; --fix cp_kind=allgather (or a launch file's) searches
    it alone."""
    device = get_device("h100-sxm")
    assert "allgather" not in default_space(LLAMA8, device, 8, 16, 16384).cp_kind
    assert default_space(LLAMA8, device, 8, 16, 16384, fixed={"cp_kind": "allgather"}).cp_kind == ("allgather",)


def test_the_search_path_prices_it_as_the_estimate_does():
    """The search's path (strategies alike priced once, the kind read only where it can be the
    largest buffer: ``buffers.cp_kind_read``) gives every kind the estimate's bytes, on a dense
    and a MoE model, with and without TP and EP. On Qwen3-30B-A3B at cp 16 the all-gather's
    buffer, ((3·16 + 1/2)·1024 + 16·512)·T·β, outgrows the expert all-to-all's 2·8·2048·T·β,
    which outgrows Ulysses' 2·(4096 + 512 + 512 + 4096)·T·β: there the kind must be read."""
    from ndplan.memory.stages import peak_memory
    from ndplan.strategy import check_strategy

    options = MemoryOptions(runtime="megatron")
    for model, ep in ((LLAMA8, 1), (get_preset("qwen3-30b-a3b"), 2)):
        strategies = [Strategy(dp=2, tp=tp, cp=cp, cp_kind=kind, ep=ep, sequence_parallel=tp > 1, seq_length=seq)
                      for tp in (1, 2) for cp in (1, 2, 4, 16) for kind in ("ring", "ulysses", "allgather")
                      for seq in (4096, 65536)]
        valid = [s for s in strategies if not check_strategy(s, model)]  # (Ulysses splits the KV heads)
        assert sum(s.cp_kind == "allgather" for s in valid) == 16
        peak, _ = peak_memory(model, StrategyBatch.of(valid), options)
        alone = [estimate(model, s, get_device("h100-sxm"), options).peak_bytes for s in valid]
        np.testing.assert_array_equal(peak, np.array(alone), err_msg=model.name)


def test_transformer_engine_runs_each_attention_under_some_kinds():
    """Transformer Engine's context-parallel attention (attn_forward_func_with_cp) asserts sliding
    windows under a2a or all_gather alone, MLA (keys and values of different head widths) under
    p2p or a2a+p2p, and attention sinks under a2a alone. Under Megatron on a GPU: Mistral-7B
    (every layer sliding) runs Ulysses and all-gather CP; DeepSeek-V3 (MLA) the ring and the
    hybrid; gpt-oss (sliding layers and sinks) Ulysses alone; Llama every kind. On an Ascend NPU
    (MindSpeed's attention, whose own limit the next test checks) and where the device is not known
    Transformer Engine's refuse nothing."""
    from ndplan.search.run import te_cp_kinds

    assert te_cp_kinds(get_preset("mistral-7b"))[0] == ("ulysses", "allgather")
    assert te_cp_kinds(get_preset("deepseek-v3"))[0] == ("ring", "hybrid")
    assert te_cp_kinds(get_preset("gpt-oss-20b"))[0] == ("ulysses",)
    assert te_cp_kinds(LLAMA8) == (("ring", "ulysses", "hybrid", "allgather"), [])
    megatron = MemoryOptions(runtime="megatron")
    h100, npu = get_device("h100-sxm"), get_device("ascend-910b")
    mistral = get_preset("mistral-7b")
    ring = Strategy(dp=8, cp=2, seq_length=32768)
    said = runtime_refusals(ring, megatron, mistral, h100)
    assert said == ["cp_kind ring (--cp-comm-type p2p) on mistral-7b: Transformer Engine's context-parallel attention "
                    "refuses it (sliding-window layers run under a2a or allgather alone); it runs ulysses (--cp-comm-type "
                    "a2a), allgather (--cp-comm-type allgather)"]
    for kind in ("ulysses", "allgather"):
        assert runtime_refusals(ring.model_copy(update={"cp_kind": kind}), megatron, mistral, h100) == []
    gather = ring.model_copy(update={"cp_kind": "allgather"})
    assert "attention sinks" in runtime_refusals(gather, megatron, get_preset("gpt-oss-20b"), h100)[0]
    assert "MLA" in runtime_refusals(gather, megatron, get_preset("deepseek-v3"), h100)[0]
    assert not any("Transformer Engine" in said for said in runtime_refusals(ring, megatron, mistral, npu))
    assert runtime_refusals(ring, megatron, mistral) == []
    assert runtime_refusals(ring, megatron, LLAMA8, h100) == []
    assert runtime_refusals(Strategy(dp=16, seq_length=32768), megatron, mistral, h100) == []  # no CP


def test_mindspeed_runs_no_sliding_window_under_context_parallelism():
    """MindSpeed's context-parallel attention asserts no window under every --context-parallel-algo,
    and MindSpeed-LLM refuses CP where the window binds: under Megatron on an Ascend NPU, Mistral-7B
    (a 4,096-token window) over CP 2 at 32K tokens is refused whatever the kind, at 4,096 tokens (the
    window spans the sequence) it is not, nor without CP, nor Llama, nor on a GPU or an unknown
    device; a search on NPUs then ranks no CP for it. MindSpeed's hybrid needs a ring of two ranks
    at least (ulysses_degree < cp)."""
    megatron = MemoryOptions(runtime="megatron")
    npu, h100 = get_device("ascend-910b"), get_device("h100-sxm")
    mistral = get_preset("mistral-7b")
    assert mistral.sliding_window == 4096
    for kind in CP_KINDS:
        s = Strategy(dp=8, cp=2, cp_kind=kind, seq_length=32768)
        assert runtime_refusals(s, megatron, mistral, npu) == [
            "cp=2 on mistral-7b, whose sliding-window layers attend the last 4,096 of seq_length=32,768 tokens: "
            "MindSpeed's context-parallel attention runs no sliding window under any --context-parallel-algo "
            "(MindSpeed-LLM: 'Context parallel does not support sliding_windows'); train with cp=1 on Ascend NPUs"]
        assert not any("MindSpeed" in said for said in runtime_refusals(s, megatron, mistral, h100))
        assert runtime_refusals(s, megatron, mistral) == []
        assert runtime_refusals(s, megatron, LLAMA8, npu) == []
        assert runtime_refusals(s.model_copy(update={"seq_length": 4096}), megatron, mistral, npu) == []
    assert runtime_refusals(Strategy(dp=16, seq_length=32768), megatron, mistral, npu) == []
    assert runtime_refusals(Strategy(dp=8, cp=2, seq_length=32768), MemoryOptions(runtime="pytorch"), mistral, npu) == []
    hybrid = Strategy(dp=2, cp=8, cp_kind="hybrid", ulysses_degree=8, seq_length=32768)
    assert runtime_refusals(hybrid, megatron, LLAMA8, npu) == [
        "cp_kind hybrid with ulysses_degree=8 = cp: MindSpeed's hybrid_cp_algo needs a ring of two ranks at least "
        "(cp / --ulysses-degree-in-cp > 1); that plan is cp_kind ulysses (ulysses_cp_algo)"]
    assert runtime_refusals(hybrid.model_copy(update={"ulysses_degree": 4}), megatron, LLAMA8, npu) == []
    assert runtime_refusals(hybrid, megatron, LLAMA8, h100) == []
    space = default_space(mistral, npu, 16, 16, 16384, dims=("cp", "cp_kind", "recompute"), fixed={"tp": 2, "sp": 1})
    result = run_search(mistral, npu, space, options=megatron)
    assert result.ranked and {row["cp"] for row in result.ranked} == {1}
    assert result.rejected["not_runnable_in_runtime"] > 0


def test_a_search_over_sliding_windows_varies_all_gather_and_never_ranks_the_ring():
    """For a model with sliding-window layers the search varies all-gather CP beside ring and
    Ulysses; under Megatron on H100s it ranks no ring CP, and its ranking is the brute force's."""
    from search_brute import search_as_brute_force

    mistral = get_preset("mistral-7b")
    device = get_device("h100-sxm")
    assert default_space(mistral, device, 16, 16, 65536).cp_kind == ("ring", "ulysses", "allgather")
    assert default_space(LLAMA8, device, 16, 16, 65536).cp_kind == ("ring", "ulysses")
    space = default_space(mistral, device, 16, 16, 65536, dims=("cp", "cp_kind"), fixed={"tp": 2, "sp": 1})
    result = search_as_brute_force(mistral, device, space, 80 * 2**30, MemoryOptions(runtime="megatron"))
    kinds = {(row["cp"] > 1, row["cp_kind"]) for row in result.ranked}
    assert (True, "allgather") in kinds and (True, "ring") not in kinds


def test_the_estimate_says_what_the_runtime_cannot_run(capsys):
    """``estimate`` prices a strategy its runtime refuses all the same, and says so beside it (the
    search leaves it out): Mistral-7B over a CP ring under Megatron on H100s."""
    import json

    from ndplan.cli import main

    base = ["estimate", "--model", "mistral-7b", "--hardware", "h100-sxm", "--devices", "16", "--dp", "8", "--cp", "2",
            "--seq", "32768", "--runtime", "megatron", "--json"]
    assert main(base) == 0
    caveats = json.loads(capsys.readouterr().out)["caveats"]
    assert any(c.startswith("the megatron runtime cannot run this strategy: cp_kind ring (--cp-comm-type p2p) on "
                            "mistral-7b") for c in caveats)
    assert main([*base, "--cp-kind", "allgather"]) == 0
    assert not any("cannot run" in c for c in json.loads(capsys.readouterr().out)["caveats"])


def test_an_ascend_launch_names_mindspeeds_algorithm_and_reads_back():
    """MindSpeed picks its context-parallel attention by --context-parallel-algo (Megatron's
    --cp-comm-type it does not read): a launch written for Ascend NPUs names it, for every kind,
    and reads back as the same kind (the hybrid's Ulysses degree as --ulysses-degree-in-cp)."""
    import tempfile
    from pathlib import Path

    algos = {"ring": "megatron_cp_algo", "ulysses": "ulysses_cp_algo", "hybrid": "hybrid_cp_algo",
             "allgather": "kvallgather_cp_algo"}
    with tempfile.TemporaryDirectory() as folder:
        for kind, algo in algos.items():
            s = Strategy(dp=2, cp=8, cp_kind=kind, ulysses_degree=2 if kind == "hybrid" else 1, seq_length=32768)
            text = emit(LLAMA8, s, "megatron", device_runtime="cann")
            assert f"--context-parallel-algo {algo}" in text and "--cp-comm-type" not in text
            path = Path(folder) / f"{kind}.sh"
            path.write_text(text)
            back = read_config(path, model="llama-3.1-8b", devices=16).strategy()
            assert (back.cp, back.cp_kind, back.ulysses_degree) == (s.cp, kind, s.ulysses_degree)
        gpu = emit(LLAMA8, Strategy(dp=2, cp=8, seq_length=32768), "megatron")
        assert "--cp-comm-type p2p" in gpu and "--context-parallel-algo" not in gpu


def test_a_search_left_only_what_its_runtime_refuses_says_where_to_ask_why(capsys):
    """A search whose fixed values leave only candidates the runtime cannot run (Mistral-7B over a
    CP ring under Megatron on H100s) says which check names the reason."""
    import json

    from ndplan.cli import main

    main(["search", "--model", "mistral-7b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "16", "--seq",
          "32768", "--runtime", "megatron", "--fix", "cp=2", "cp_kind=ring", "--json"])
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert ("not_runnable_in_runtime: what the megatron runtime cannot run; `ndplan check` of one of them with "
            "--runtime megatron and --hardware says why") in notes


def test_balance_and_the_report_say_it_too(capsys, tmp_path):
    """``balance`` (of the settings it writes) and the HTML report's Cautions say what the runtime
    cannot run, as ``estimate`` does."""
    import json

    from ndplan.cli import main

    flags = ["--model", "mistral-7b", "--hardware", "h100-sxm", "--devices", "16", "--dp", "8", "--cp", "2",
             "--zero", "1", "--seq", "32768", "--runtime", "megatron"]
    said = "the megatron runtime cannot run this strategy: cp_kind ring (--cp-comm-type p2p) on mistral-7b"
    assert main(["balance", *flags, "--json"]) == 0
    assert any(c.startswith(said) for c in json.loads(capsys.readouterr().out)["caveats"])
    page = tmp_path / "r.html"
    assert main(["report", *flags, "-o", str(page)]) == 0
    assert said in page.read_text()
