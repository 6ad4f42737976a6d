"""Progress on stderr while a command works for more than a moment; never with --json, never on
a stderr that is not a terminal, never in stdout."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from ndplan.cli import main
from ndplan.perf.cli import add_calibrate_command

BALANCE = ["balance", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--dp", "2", "--pp", "4",
           "--zero", "1",
           "--gbs", "64", "--memory-limit", "60GiB"]


def _calibrate_argv(tmp_path: Path) -> list[str]:
    runs = tmp_path / "runs.yaml"
    runs.write_text(yaml.safe_dump({"runs": [{
        "id": "one", "source": "a test", "model": "llama-3.1-8b", "device": "h100-sxm", "num_devices": 8,
        "strategy": {"dp": 8, "zero": 1, "num_micro_batches": 2, "seq_length": 2048},
        "measured": {"step_s": 1.5}}]}))
    return ["calibrate", str(runs), "-o", str(tmp_path / "profile.yaml"), "--fit", "gemm_efficiency"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    if argv[0] == "calibrate":  # registered by ndplan.cli's parser as well; called the same way
        import argparse

        parser = argparse.ArgumentParser(prog="ndplan")
        add_calibrate_command(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        code = args.func(args)
    else:
        code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _as_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr is a terminal: the stream capsys put in its place for the test's call says it is one
    (set in the test itself: capsys puts a new stream in place after the fixtures' setup)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


@pytest.mark.parametrize(("command", "shown"), [("balance", "balancing dp2 tp1 pp4 zero1"),
                                                 ("calibrate", "calibrating: fitting 1 run on h100-sxm")])
def test_a_long_step_shows_what_it_does_on_a_terminals_stderr(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path, command: str, shown: str) -> None:
    # Balancing a pipeline (0.6-2 s) and a calibration fit (2.5 s CPU for three runs) showed nothing
    # until they finished; only search drew a bar.
    argv = BALANCE if command == "balance" else _calibrate_argv(tmp_path)
    _as_terminal(monkeypatch)
    code, out, err = _run(argv, capsys)
    assert code == 0
    assert shown in err and shown not in out


@pytest.mark.parametrize("command", ["balance", "calibrate"])
def test_json_output_stays_json_and_shows_no_progress(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path, command: str) -> None:
    argv = (BALANCE if command == "balance" else _calibrate_argv(tmp_path)) + ["--json"]
    _as_terminal(monkeypatch)
    code, out, err = _run(argv, capsys)
    assert code == 0
    json.loads(out)
    assert "balancing" not in err and "calibrating" not in err


def test_no_progress_where_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(BALANCE, capsys)
    assert code == 0 and "layers per virtual stage" in out
    assert "balancing" not in err


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs the census extra (torch, transformers)")
def test_measuring_a_step_shows_what_it_measures(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    # A fake-tensor step (`ndplan measure`, `ndplan verify MODEL`) took 5-20 s with nothing shown.
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(dict(model_type="llama", hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=100)))
    _as_terminal(monkeypatch)
    code, out, err = _run(["measure", str(config), "--seq", "32"], capsys)
    assert code == 0
    assert "measuring a step of tiny (2 layers, dp1 tp1 pp1 mbs1 m1 1f1b) on fake tensors" in err
    assert "measuring a step" not in out


def test_reading_emitted_candidates_back_and_drawing_figures_show_progress(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    # A review: `search --emit` reading its ranked candidates back (about 2 s on DeepSeek-V3) and
    # `report --plot-dir` (matplotlib's import, then the figures) showed nothing while they worked.
    _as_terminal(monkeypatch)
    code, out, err = _run(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "16",
                           "--fix", "tp=2", "pp=1", "--emit", "megatron"], capsys)
    assert code == 0 and "megatron settings of" in out
    assert "reading the ranked candidates back as megatron settings" in err
    assert "reading the ranked candidates back" not in out
    code, out, err = _run(["report", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                           "--plot-dir", str(tmp_path / "figures")], capsys)
    assert code == 0 and "wrote" in out and (tmp_path / "figures" / "memory.png").exists()
    assert "drawing the figures into /" in err and "drawing the figures" not in out
    code, out, err = _run(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs",
                           "16", "--fix", "tp=2", "pp=1", "--emit", "megatron", "--json"], capsys)
    json.loads(out)
    assert "reading the ranked" not in err
