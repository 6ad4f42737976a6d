"""docs/memory.md's worked example and quotes stay true: the command it shows prints what the page
quotes, the figures it works out by hand are the code's, and its accuracy headlines are quoted
exactly from the pages that own them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from ndplan.cli import main
from ndplan.memory import MemoryOptions, estimate
from ndplan.memory.activations import layer_activations
from ndplan.memory.static import embedding_elements, layer_elements, mlp_split
from ndplan.memory.terms import whole_embedding_grad_extra
from ndplan.model import as_model
from ndplan.model.params import attention_params
from ndplan.strategy import Strategy, StrategyBatch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "memory.md"


def _block_after(text: str, marker: str) -> str:
    """The first code block after the line holding ``marker``."""
    start = text.index(marker)
    match = re.search(r"^```[a-z]*\n(.*?)^```", text[start:], flags=re.S | re.M)
    assert match, f"no code block after {marker!r}"
    return match.group(1)


def _squeezed(text: str) -> str:
    return " ".join(text.split())


def _example_argv(text: str) -> list[str]:
    lines = [line for line in _block_after(text, "<!-- worked-example:command").splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ndplan estimate ")
    return shlex.split(lines[0])[1:]


def test_the_worked_example_prints_what_the_page_quotes(capsys):
    """Each line of the quoted output, its parts between "…", appears in that order in what the
    command prints (whitespace aside: the console wraps long lines)."""
    text = PAGE.read_text()
    assert main(_example_argv(text)) == 0
    printed = _squeezed(capsys.readouterr().out)
    quoted = _block_after(text, "<!-- worked-example:output -->")
    at, pieces = 0, 0
    for line in quoted.splitlines():
        for piece in (_squeezed(part) for part in line.split("…")):
            if not piece:
                continue
            found = printed.find(piece, at)
            assert found >= 0, f"not printed (after what the lines before matched): {piece!r}"
            at, pieces = found + len(piece), pieces + 1
    assert pieces >= 20  # the table row, the verdict and every term of the peak stage


#: The figures the page works out by hand for its worked example (as it writes them), and where the
#: code gives each: the peak stage's report, or the layer activations.
HAND_FIGURES = {
    "2,007,629,824": lambda stage, acts: stage.params_bytes / 2,  # elements on a rank of stage 0
    "133,192": lambda stage, acts: float(acts.full["dense"][0]),  # a dense layer's bytes per token
    "4,015,259,648": lambda stage, acts: stage.params_bytes,
    "12,045,778,944": lambda stage, acts: stage.optimizer_bytes,
    "9,081,192,448": lambda stage, acts: stage.grads_bytes,
    "17,524,916,224": lambda stage, acts: stage.activations_bytes,
    "603,979,776": lambda stage, acts: stage.comm_bytes,
    "184,549,376": lambda stage, acts: stage.transient_bytes,
    "43,455,676,416": lambda stage, acts: stage.forward_backward_bytes,
    "4,619,239,424": lambda stage, acts: stage.optimizer_step_bytes,
    "25,142,231,040": lambda stage, acts: stage.static_bytes,
    "46,366,657,740.8": lambda stage, acts: stage.peak_bytes,
}


def test_the_hand_worked_figures_are_the_codes():
    """The strategy the example's command prices, through the Python API: the peak stage, its
    in-flight count and each figure the page derives (a figure edited in the page, or changed in
    the code, fails here)."""
    text = PAGE.read_text()
    argv = _example_argv(text)
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert (flags["--model"], flags["--hardware"], flags["--tp"], flags["--pp"], flags["--zero"], flags["--gbs"],
            flags["--seq"], flags["--devices"]) == ("llama-3.1-8b", "h100-sxm", "2", "2", "1", "32", "4096", "8")
    model = as_model("llama-3.1-8b")
    strategy = Strategy(dp=2, tp=2, pp=2, zero=1, num_micro_batches=16, seq_length=4096, global_batch_size=32)
    report = estimate(model, strategy, "h100-sxm", MemoryOptions())
    assert report.peak_stage == 0 and report.fits
    stage = report.stages[0]
    assert [chunk.peak_in_flight for chunk in stage.chunks] == [2.0]
    assert "holds min(pp − s, m) = **2** micro-batches" in text
    acts = layer_activations(model, StrategyBatch.of(strategy), MemoryOptions())
    for written, figure in HAND_FIGURES.items():
        assert written in text, f"the page no longer shows {written}"
        assert float(written.replace(",", "")) == pytest.approx(figure(stage, acts), rel=0, abs=1e-3), written
    # Every number the hand-worked part writes (with thousands separators) is one of these figures
    # or an intermediate the code gives too: a figure edited in one place of several is caught.
    tp = np.array([2.0])
    blocks = {name: float(value[0]) for name, value in acts.dense_blocks.items()}
    intermediates = [
        model.num_kv_heads * model.head_dim, model.hidden_size, model.ffn_hidden_size, model.vocab_size,
        float(layer_elements(model, tp, tp / 2, tp).by_kind["dense"]["norm"][0]),  # two norms' weights
        blocks["attention"], blocks["norm"], blocks["norm"] / 2, blocks["mlp"],
        blocks["mlp"] - 2 * model.hidden_size,  # the MLP's four ffn-wide tensors, its input aside
        float(acts.backward_extra["dense"][0]),
        attention_params(model), mlp_split(model).sharded,
        float(layer_elements(model, tp, tp / 2, tp).non_expert["dense"][0]),
        float(embedding_elements(model, tp)[0]),
        whole_embedding_grad_extra(model, MemoryOptions().profile, 2, 1, 16) * strategy.precision.grad_bytes,
        sum(stage.activations_by_kind[kind] for kind in ("attention", "norm", "mlp")),
        stage.activations_by_kind["pipeline"],
    ]
    known = {*HAND_FIGURES, *(f"{float(value):,.0f}" for value in intermediates)}
    hand = text[text.index("By hand ("):text.index("`tests/test_memory_doc.py` runs the command")]
    unknown = sorted(set(re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", hand)) - known)
    assert not unknown, f"the worked example writes figures the code does not give: {unknown}"


def test_the_accuracy_headlines_are_quoted_exactly():
    """Section 10 quotes a headline of each generated accuracy page: the quote is the page's own."""
    text = PAGE.read_text()
    section = text[text.index("## 10. Accuracy"):text.index("## 11.")]
    rows = [line for line in section.splitlines() if line.startswith("| docs/")]
    assert len(rows) == 4
    for row in rows:
        page = re.match(r"\| (docs/[a-z_]+\.md)", row).group(1)
        quotes = re.findall(r'"([^"]+)"', row.replace("\\|", "|"))
        assert quotes, row
        source = " ".join((ROOT / page).read_text().split())
        for quote in quotes:
            assert " ".join(quote.split()) in source, f"{page} does not say {quote!r}"
