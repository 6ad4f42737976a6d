"""What a new user meets first: the commands the README and docs show, every --help, and the
errors of a mistyped option, a closed pipe or a misspelt preset (one line, never a traceback)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from ndplan.cli import build_parser

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
