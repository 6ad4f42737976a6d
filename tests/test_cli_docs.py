"""What a new user meets first: the commands the README and docs show, every --help, and the
errors of a mistyped option, a closed pipe or a misspelt preset (one line, never a traceback)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ndplan.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
#: The hand-written pages (the others are generated from benchmarks).
DOCS = ["README.md", "docs/balance.md", "docs/census.md", "docs/io.md", "docs/report.md", "docs/time.md"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _shown_commands(page: str) -> list[str]:
    """Every `ndplan ...` line of the page's code blocks, continuation lines joined, comments cut."""
    lines, block = [], False
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            block = not block
            continue
        if block:
            lines.append(line)
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip().startswith("ndplan ")]


def test_every_option_of_every_command_says_what_it_does_and_its_default():
    """A review read `ndplan estimate --help`: --cp-kind, --no-sp, --schedule, --optimizer-offload,
    --recompute, --precision and --no-loss-parallel had no text at all, --tp/--pp/--zero no default;
    --top (search), --plot-format (report) and census's --attention neither."""
    for name, parser in _commands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"ndplan {name} {action.option_strings or action.dest} has no help"
    helps = {name: " ".join(p.format_help().split()) for name, p in _commands().items()}
    for text in (helps["estimate"], helps["check"], helps["balance"], helps["report"]):
        for said in ("pipeline schedule (default 1f1b)", "tensor parallel degree (default 1)",
                     "(default ring)", "no sequence parallelism (the default", "default megatron-bf16",
                     "activation recompute of the decoder layers (default none)", "3 also parameters (default 0)",
                     "optimizer states in host memory"):
            assert said in text, said
    assert "the loss on whole logits, gathered over the TP ranks" in helps["estimate"]
    assert "how many ranked strategies to show (default 10)" in helps["search"]
    assert "format of --plot-dir figures (default png)" in helps["report"]
    assert "attention implementation (default sdpa)" in helps["census"]


def test_an_unknown_option_is_refused_by_its_command_with_the_one_meant(capsys):
    """`ndplan estimate ... --memroy-limit 70GiB` said "ndplan: error: unrecognized arguments:
    --memroy-limit 70GiB (see `ndplan --help`)", whose help lists no option; now the command's
    own help, and the option meant."""
    base = ["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32"]
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--memroy-limit", "70GiB"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err == ("ndplan estimate: error: unrecognized arguments: --memroy-limit 70GiB (did you mean "
                   "'--memory-limit'?) (see `ndplan estimate --help`)\n"), err
    with pytest.raises(SystemExit):
        main(["search", *base[1:], "--plan", "plan.yaml"])  # search takes no plan file
    err = capsys.readouterr().err
    assert err.startswith("ndplan search: error: unrecognized arguments: --plan plan.yaml")
    assert err.endswith("(see `ndplan search --help`)\n") and len(err.splitlines()) == 1, err


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`ndplan models --json | head` printed "ndplan: error: Broken pipe" and exited 2 once the
    output outgrew the pipe's buffer (64 KiB): now it stops silently with 141, as `cat` does."""
    proc = subprocess.Popen([sys.executable, "-m", "ndplan.cli", "models", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1) == b"["
    proc.stdout.close()  # the models' JSON is ~100 KiB: the writer meets the closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err
