"""What a new user meets first: the commands the README and docs show, every --help, and the
errors of a mistyped option, a closed pipe or a misspelt preset (one line, never a traceback)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ndplan.cli import build_parser, main
from ndplan.errors import NdplanError
from ndplan.hardware import list_devices
from ndplan.model import preset_names
from ndplan.model.hf import READERS

ROOT = Path(__file__).resolve().parents[1]
#: The hand-written pages (the others are generated from benchmarks).
DOCS = ["README.md", "docs/balance.md", "docs/census.md", "docs/io.md", "docs/memory.md", "docs/report.md",
        "docs/time.md"]


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


@pytest.mark.parametrize("page", DOCS)
def test_every_command_the_docs_show_parses(page):
    """Each command a page shows names a subcommand and flags that exist, with values they take
    (`...` stands for the flags of the line above and is left out)."""
    parser = build_parser()
    shown = _shown_commands(page)
    for line in shown:
        argv = line[1: line.index(">")] if ">" in line else line[1:]  # (a redirection is the shell's)
        args = parser.parse_args([a for a in argv if a != "..."])
        assert args.command == argv[0]
    assert shown or page not in ("README.md", "docs/report.md")


def test_readme_names_every_model_preset_architecture_and_device():
    """The README's "How it is built" counts the presets and lists the architectures and devices:
    held to `ndplan models` and `ndplan hardware`."""
    text = " ".join((ROOT / "README.md").read_text().split())
    count = re.search(r"(\d+) presets", text)
    assert count and int(count.group(1)) == len(preset_names()), count
    types = re.search(r"ModelSpec from HF config\.json \(([^)]*)\)", text)
    assert types and [t.strip() for t in types.group(1).split(",")] == list(READERS)
    devices = re.search(r"device presets with sources \((.*?)\), user device YAML", text)
    assert devices
    listed = [re.sub(r" \(.*", "", d.strip()) for d in re.sub(r"\([^)]*\)", "", devices.group(1)).split(",")]
    assert listed == [d.name for d in list_devices()]


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
                     "optimizer states in host memory", "(default: even, the remainder on the first chunks)",
                     "(default: resharded)"):
            assert said in text, said
    assert "the loss on whole logits, gathered over the TP ranks" in helps["estimate"]
    assert "how many ranked strategies to show (default 10)" in helps["search"]
    assert "--balance alone is per-layer" in helps["search"] and "megatron; default: nothing)" in helps["search"]
    assert "global batch size in sequences (needed, unless --from states it)" in helps["search"]
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
    assert "did you mean" not in err  # (--explain is no near miss of --plan)
    with pytest.raises(SystemExit):
        main(["report", *base[1:], "--json"])  # report writes HTML; '--sp' was suggested for it
    assert capsys.readouterr().err == ("ndplan report: error: unrecognized arguments: --json "
                                       "(see `ndplan report --help`)\n")
    with pytest.raises(SystemExit):
        main(["models", "--jsn"])
    assert "(did you mean '--json'?)" in capsys.readouterr().err


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


@pytest.mark.parametrize("command", ["census", "measure", "verify"])
def test_a_misspelt_preset_is_named_as_estimate_names_it(command, capsys):
    """`ndplan census llama-3.1-8bb` said "no config file or preset named 'llama-3.1-8bb' (a preset
    of `ndplan models`, ...)" with neither the preset meant nor the list, where `estimate --model`
    gives both; a preset in capitals was refused too (the file was looked up by the name as typed)."""
    code = main([command, "llama-3.1-8bb"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ndplan: error: unknown model 'llama-3.1-8bb' (did you mean 'llama-3.1-8b'?); presets: "
                          "deepseek-v2-lite, deepseek-v3,"), err
    assert main([command, "missing/config.json"]) == 2
    assert capsys.readouterr().err == "ndplan: error: missing/config.json: no such file\n"


def test_a_preset_is_read_in_any_case():
    from ndplan.census.measure import load_hf_config
    from ndplan.model import hf_config

    assert load_hf_config("Llama-3.1-8B") == ("llama-3.1-8b", hf_config("llama-3.1-8b"))
    with pytest.raises(NdplanError, match="did you mean 'qwen3-8b'"):
        load_hf_config("qwen3-8")


def test_the_census_of_an_encoder_names_its_model_type(tmp_path, capsys):
    """`ndplan census bert/config.json` said only "census: cannot find the model's final norm and
    LM head"; now the model type and what the census measures."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path / "tiny-bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64}))
    assert main(["census", str(folder), "--seq", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndplan: error: census: tiny-bert (model_type 'bert'): cannot find the model's final "
                          "norm and LM head; the census measures decoder-only causal LMs (ndplan reads llama, "), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("where", ["notes.txt/profile.yaml", "."])
def test_calibrate_refuses_an_output_it_cannot_write_before_fitting(where, tmp_path, monkeypatch, capsys):
    """`ndplan calibrate benchmarks/published_runs.yaml -o missing/x.yaml` fitted for a minute
    (26 s of CPU) and then said 'missing/x.yaml: No such file or directory'; a path that cannot be
    written is now named first (a missing folder is made, as every command's output makes it)."""
    import ndplan.perf.cli as perf_cli

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted before checking where the profile goes")

    monkeypatch.setattr(perf_cli, "calibrate", no_fit)
    output = tmp_path / where
    (tmp_path / "notes.txt").write_text("x")
    code = main(["calibrate", str(ROOT / "benchmarks" / "published_runs.yaml"), "-o", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    if where == ".":
        assert err == f"ndplan: error: -o {output}: a folder; give the profile YAML file's name\n"
    else:
        assert err == f"ndplan: error: -o {output}: {tmp_path / 'notes.txt'} is a file, not a folder (write elsewhere)\n"


def test_verify_from_a_script_naming_a_tokenizer_takes_model(tmp_path, capsys):
    """`ndplan verify --from train.sh --measured peaks.json` (README) on a launch script that names
    its tokenizer, as real ones do, warned "give --model ... to complete it", then refused: MODEL
    and --from together were refused ("drop MODEL"), and verify has no --model. MODEL now
    completes the script's model, and the estimate is `estimate --from`'s."""
    script = str(ROOT / "tests" / "fixtures" / "io" / "megatron_llama3_70b.sh")
    peaks = tmp_path / "peaks.json"
    peaks.write_text(json.dumps({"schema": "ndplan.measured-memory", "schema_version": 1, "source": "a cluster",
                                 "ranks": [{"rank": 0, "allocated_bytes": 50 * 2**30}]}))
    assert main(["verify", "--from", script, "--measured", str(peaks)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(f"ndplan: error: {script} does not describe the whole model; give MODEL (a preset or "
                                "config.json) to complete it"), err
    assert main(["verify", "llama-3.1-70b", "--from", script, "--measured", str(peaks), "--json"]) == 0
    stage0 = json.loads(capsys.readouterr().out)["stages"][0]
    verified = next(r for r in stage0["rows"] if r["key"] == "allocated")["estimate_bytes"]
    assert main(["estimate", "--from", script, "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)["stages"][0]["allocated_bytes"]
    assert verified == pytest.approx(estimated, rel=1e-9) and verified == pytest.approx(50.67 * 2**30, rel=1e-3)


@pytest.mark.parametrize(("setting", "error"), [
    ("schedule: 1F1B", "setting 'schedule': '1F1B' is not one of 1f1b, interleaved, zb-h1, zbv, dualpipev, gpipe, "
                       "seq1f1b (did you mean '1f1b'?)"),
    ("recompute: fulll", "setting 'recompute': 'fulll' is not one of none, selective, full (did you mean 'full'?)"),
    ("cp_kind: ulyses", "setting 'cp_kind': 'ulyses' is not one of ring, ulysses, hybrid, allgather (did you mean 'ulysses'?)"),
    ("precision: bf16", "setting 'precision': 'bf16' is not one of megatron-bf16, fsdp-bf16, fp32, bf16-pure, "
                        "megatron-fp8, megatron-bf16-grad16, megatron-fp8-grad16, megatron-fp8-param, "
                        "megatron-fp8-param-grad16 (did you mean 'bf16-pure'?)"),
    ("offload_modules: [expert_fc1, moe_actt]", "setting 'offload_modules': 'moe_actt' is not one of attn_norm, "
                                                "qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act "
                                                "(did you mean 'moe_act'?)"),
    ("schedule: 5", "setting 'schedule' must be one of 1f1b, interleaved, zb-h1, zbv, dualpipev, gpipe, seq1f1b; "
                    "got 5"),
])
@pytest.mark.parametrize("command", ["check", "estimate", "balance", "report"])
def test_a_misspelt_name_in_a_plan_file_names_the_file(command, setting, error, tmp_path, capsys):
    """`--plan plan.yaml` with `schedule: 1F1B` said "field 'schedule': Input should be '1f1b', ...
    (got '1F1B')", no word of the file the value came from; now the file, the setting, what is
    allowed and the name meant."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"model: llama-3.1-8b\nhardware: h100-sxm\ndevices: 8\ngbs: 32\n{setting}\n")
    code = main([command, "--plan", str(plan), *(["-o", str(tmp_path / "x.html")] if command == "report" else [])])
    assert code == 2 and capsys.readouterr().err == f"ndplan: error: {plan}: {error}\n"


def test_a_plan_file_precision_is_read_in_any_case(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: llama-3.1-8b\nhardware: h100-sxm\ndevices: 8\ngbs: 32\nprecision: FSDP-BF16\n")
    assert main(["estimate", "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"]["precision"]["name"] == "fsdp-bf16"


@pytest.mark.parametrize(("setting", "error"), [
    ("memory_limit: 70GiB", "'memory_limit' is a flag, not a plan setting: give --memory-limit on the command line "
                            "(a plan file holds the model, the cluster and the strategy)"),
    ("runtime: megatron", "'runtime' is a flag, not a plan setting: give --runtime on the command line (a plan file "
                          "holds the model, the cluster and the strategy)"),
    ("tpp: 2", "unknown setting 'tpp' (did you mean 'tp'?); known: cp, cp_kind, devices,"),
    ("1: 2\nfoo: 3", "unknown setting '1'; known: cp, cp_kind, devices,"),
])
def test_a_plan_file_setting_it_does_not_hold_is_named(setting, error, tmp_path, capsys):
    """The README: --memory-limit and the runtime options stay flags. A plan file holding them said
    only "unknown setting 'memory_limit'; known: ..."; a misspelt key named no key meant; keys of
    two types (YAML's `1:` beside names) ended in a TypeError traceback from sorting them."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"model: llama-3.1-8b\nhardware: h100-sxm\ndevices: 8\n{setting}\n")
    assert main(["check", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ndplan: error: {plan}: {error}") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["models", "--model", "{spec}"], ["inspect", "{spec}", "--from-format", "hf"],
                                  ["estimate", "--model", "{spec}", "--hardware", "h100-sxm"]])
def test_a_model_spec_with_a_number_for_a_field_name_is_one_line(argv, tmp_path, capsys):
    """A spec YAML holding `1: 2` (YAML reads the key as a number) ended in "TypeError: keywords
    must be strings", a traceback from ModelSpec(**data)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 2\n1: 2\n")
    assert main([a.format(spec=spec) for a in argv]) == 2
    assert capsys.readouterr().err == f"ndplan: error: {spec}: field names are text; 1 is not a field\n"
