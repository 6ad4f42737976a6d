"""The launch-script reader: bash assignments, expansion, arrays and word lines, without running anything."""

from __future__ import annotations

import pytest

from ndplan.io.megatron import parse_layout
from ndplan.io.megatron_model import parse_pattern
from ndplan.io.shell import ShellSyntaxError, run_script


def texts(script: str) -> list[list[str]]:
    return [[w.text for w in command] for command in run_script(script)]


def test_assignments_expand_in_order_and_are_not_commands():
    script = "A=1\nB=${A}2\necho $A $B ${C:-3} ${A:+set}\n"
    assert texts(script) == [["echo", "1", "12", "3", "set"]]


def test_line_continuations_and_comments():
    script = "run \\\n  --a 1 \\\n  --b 2  # trailing comment\n# whole-line comment\nnext\n"
    assert texts(script) == [["run", "--a", "1", "--b", "2"], ["next"]]


def test_arithmetic_uses_variables_with_and_without_dollar():
    script = "N=4\nG=8\nW=$(($G*N))\nH=$(( (W + 2) / 3 ))\necho $W $H\n"
    assert texts(script) == [["echo", "32", "11"]]


def test_string_variable_splits_unquoted_and_keeps_quoted():
    script = 'ARGS="--x 1\n    --y 2"\ncmd $ARGS "$ARGS"\n'
    assert texts(script) == [["cmd", "--x", "1", "--y", "2", "--x 1\n    --y 2"]]


def test_arrays_with_comments_and_quoted_expansion():
    script = 'ARR=(\n  --a 1   # one\n  "two words"\n)\ncmd "${ARR[@]}" ${#ARR} ${ARR[*]}\n'
    assert texts(script)[0][:4] == ["cmd", "--a", "1", "two words"]


def test_words_carry_the_line_they_were_written_on():
    script = "TP=8\nARGS=\"--first 1 \\\n  --tp ${TP}\"\nrun $ARGS\n"
    words = run_script(script)[0]
    lines = {w.text: w.line for w in words}
    assert lines["run"] == 4 and lines["--first"] == 2 and lines["--tp"] == 3 and lines["8"] == 1


def test_unset_variable_leaves_an_empty_word_with_a_note():
    words = run_script("cmd --tp $TP --pp 2\n")[0]
    assert [w.text for w in words] == ["cmd", "--tp", "", "--pp", "2"]
    assert words[2].note == "$TP is not set in the script"


def test_command_substitution_is_not_run():
    words = run_script('cmd --log "$(date +%s)" `hostname`\n')[0]
    assert words[2].text == "" and "not run" in (words[2].note or "")


def test_pipes_redirections_and_heredocs_end_or_drop_words():
    script = "cmd --a 1 2>&1 | tee log.txt\ncat <<EOF\n--not-a-flag 1\nEOF\nafter > out.txt\n"
    assert texts(script) == [["cmd", "--a", "1"], ["tee", "log.txt"], ["cat"], ["after"]]


def test_export_and_keywords():
    script = "export A=1 B=2\nif [ -z \"$C\" ]; then\n  C=5\nfi\necho $A$B$C\n"
    assert texts(script)[-1] == ["echo", "125"]


@pytest.mark.parametrize("script, line", [('A="open\nB=1\n', 1), ("echo 'x\n\n", 1), ("A=(\n --x 1\n", 3)])
def test_unterminated_quotes_name_the_line(script, line):
    with pytest.raises(ShellSyntaxError) as info:
        run_script(script)
    assert info.value.line == line


@pytest.mark.parametrize("script, line, words", [
    ("X=( a ; b )\n", 1, "unexpected ';' inside an array"),  # used to loop forever
    ("A=(\n --x 1\n --moe-layer-freq ([0]*3+[1]*58)\n)\n", 3, "unexpected '(' inside an array"),
    ("--num-layers 4\n--moe-layer-freq ([0]*1+[1]*3)\n", 2, "unexpected '(' after a word: quote the value"),
    ("python train.py --a 1 --moe-layer-freq ([1]*4) --b 2\n", 1, "unexpected '(' after a word"),
])
def test_what_bash_refuses_unquoted_is_an_error_not_a_lost_value(script, line, words):
    with pytest.raises(ShellSyntaxError, match=words.replace("(", r"\(")) as info:
        run_script(script)
    assert info.value.line == line


def test_functions_and_subshells_still_parse():
    assert texts("f() {\n  echo hi\n}\n( cd x; python a.py --b 1 )\n")[-1] == ["python", "a.py", "--b", "1"]


@pytest.mark.parametrize("text, expected", [
    ("1", None), ("([0]*3+[1]*5)", [0, 0, 0, 1, 1, 1, 1, 1]), ("[1,0]*2", [1, 0, 1, 0]),
    ("([1]*2+[0])*2", [1, 1, 0, 1, 1, 0]), ("[0]*1+[1]*2", [0, 1, 1]),
])
def test_megatron_layer_patterns(text, expected):
    if expected is None:
        with pytest.raises(ValueError):
            parse_pattern(text)
    else:
        assert parse_pattern(text) == expected


@pytest.mark.parametrize("bad", ["[1]*", "__import__('os')", "[1]+", "(1)"])
def test_layer_patterns_reject_anything_else(bad):
    with pytest.raises(ValueError):
        parse_pattern(bad)


def test_pipeline_layouts_unroll_as_megatron_does():
    assert parse_layout("Et*3|(t*4|)*2,t*2mL") == ["Ettt", "tttt", "tttt", "ttmL"]
    assert parse_layout("E|(tt|)*2,L") == ["E", "tt", "tt", "L"]
    with pytest.raises(ValueError):
        parse_layout("Ex|L")
