"""Megatron-LM / MindSpeed-LLM arguments as ``--flag value...`` entries, from a launch script or an
argument file, with typed access that records which flags ndplan has interpreted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ndplan.errors import NdplanError
from ndplan.io.common import LineIndex, Source, as_int
from ndplan.io.megatron_flags import DEST_TO_FLAG, UNMODELLED, is_no_effect
from ndplan.io.shell import ShellSyntaxError, Word, run_script

#: Words that start a distributed launch; the first ``*.py`` word after one is the training script.
LAUNCHERS = ("torchrun", "python", "python3", "deepspeed", "msrun", "srun", "mpirun", "accelerate", "uv")


@dataclass
class Arg:
    """One flag with the words that followed it (argparse: the last occurrence wins)."""

    flag: str
    values: list[str]
    line: int | None
    notes: list[str | None] = field(default_factory=list)

    def note(self, index: int = 0) -> str | None:
        return self.notes[index] if index < len(self.notes) else None


class Args:
    """Flags by name; every read marks the flag as interpreted."""

    def __init__(self, src: Source, entries: Mapping[str, Arg]):
        self.src = src
        self.entries = dict(entries)
        self.used: set[str] = set()

    def get(self, *flags: str) -> Arg | None:
        self.used.update(flags)
        for flag in flags:
            if flag in self.entries:
                return self.entries[flag]
        return None

    def has(self, *flags: str) -> bool:
        return self.get(*flags) is not None

    def line(self, *flags: str) -> int | None:
        arg = self.get(*flags)
        return arg.line if arg else None

    def error(self, arg: Arg | str, message: str) -> NdplanError:
        if isinstance(arg, str):
            found = self.entries.get(arg)
            return self.src.error(arg, message, found.line if found else None)
        return self.src.error(arg.flag, message, arg.line)

    def _value(self, arg: Arg) -> str:
        if not arg.values:
            raise self.error(arg, "expects a value")
        return arg.values[0]

    def integer(self, *flags: str, default: int | None = None, minimum: int | None = 1,
                maximum: int | None = None) -> int | None:
        arg = self.get(*flags)
        if arg is None:
            return default
        value = self._value(arg)
        try:
            return as_int(self.src, value, arg.flag, arg.line, minimum=minimum, maximum=maximum)
        except NdplanError:
            why = f" ({arg.note()})" if arg.note() else ""
            if re.fullmatch(r"[+-]?\d+", value.strip()):
                bounds = ([f">= {minimum}"] if minimum is not None else []) + (
                    [f"<= {maximum:,}"] if maximum is not None else [])
                raise self.error(arg, f"must be {' and '.join(bounds)}, got {value}") from None
            raise self.error(arg, f"expected an integer, got {value!r}{why}") from None

    def number(self, *flags: str, default: float | None = None) -> float | None:
        """A real-valued flag (a probability, a factor)."""
        arg = self.get(*flags)
        if arg is None:
            return default
        value = self._value(arg)
        try:
            return float(value)
        except ValueError:
            raise self.error(arg, f"expected a number, got {value!r}") from None

    def text(self, *flags: str, default: str | None = None) -> str | None:
        arg = self.get(*flags)
        if arg is None:
            return default
        value = self._value(arg)
        if not value and arg.note():
            raise self.error(arg, f"has no value ({arg.note()})")
        return value

    def values(self, *flags: str) -> list[str] | None:
        arg = self.get(*flags)
        return None if arg is None else [v for v in arg.values if v]

    def leftovers(self) -> list[str]:
        """Warnings for flags nobody interpreted: unmodelled memory effects and unknown flags."""
        out: list[str] = []
        for flag, arg in self.entries.items():
            if flag in self.used or is_no_effect(flag):
                continue
            where = self.src.where(arg.line)
            if flag in UNMODELLED:
                out.append(f"{where}: {flag}: {UNMODELLED[flag]}")
            else:
                out.append(f"{where}: {flag}: unknown to ndplan; if it changes memory or time, the plan does not include it")
        return out


# ---------------------------------------------------------------- launch scripts
@dataclass
class Launch:
    """The launcher words (``torchrun --nnodes 4 ...``) and the training script's argument words."""

    launcher: list[Word]
    script: Word | None
    arguments: list[Word]


def parse_script(src: Source, text: str) -> Launch:
    """The launch command of a script: the one running a ``.py`` file with the most flags."""
    try:
        commands = run_script(text)
    except ShellSyntaxError as error:
        raise NdplanError(f"{src.where(error.line)}: malformed shell script: {error.message}") from None
    best: Launch | None = None
    best_flags = -1
    for words in commands:
        for i, word in enumerate(words):
            if not word.text.endswith(".py"):
                continue
            launched = i == 0 or any(w.text.split("/")[-1].startswith(LAUNCHERS) for w in words[:i])
            if not launched:
                continue
            flags = sum(1 for w in words[i + 1:] if w.text.startswith("--"))
            if flags >= best_flags:
                best, best_flags = Launch(words[:i], word, words[i + 1:]), flags
            break
    if best is not None and best_flags > 0:
        return best
    # A bare argument block: lines that start with a flag (what one pastes from a script).
    bare = [w for words in commands if words[0].text.startswith("--") for w in words]
    if bare:
        return Launch([], None, bare)
    raise NdplanError(
        f"{src.name}: no Megatron-LM launch command found (a torchrun/python line running a .py script "
        "with --flags, or lines of --flags)"
    )


def flag_entries(src: Source, words: Sequence[Word], warnings: list[str]) -> dict[str, Arg]:
    """``--flag v1 v2 --other`` → entries; ``--flag=value`` too. Words before the first flag
    (positional arguments) are reported, not guessed at."""
    entries: dict[str, Arg] = {}
    current: Arg | None = None
    for word in words:
        text = word.text
        if text.startswith("--") and len(text) > 2:
            name, eq, value = text.partition("=")
            current = Arg(normalise_flag(name), [value] if eq else [], word.line, [word.note] if eq else [])
            entries[current.flag] = current
        elif current is not None:
            current.values.append(text)
            current.notes.append(word.note)
        elif text:
            warnings.append(f"{src.where(word.line)}: positional argument {text!r} before any flag is ignored")
    return entries


def normalise_flag(name: str) -> str:
    """``--tensor_model_parallel_size`` and ``--tensor-model-parallel-size`` are the same flag."""
    return "--" + name.lstrip("-").replace("_", "-")


# ---------------------------------------------------------------- world size from the launcher
def _option(words: Sequence[Word], *names: str) -> Word | None:
    """The value word of a launcher option, ``--opt value`` or ``--opt=value``."""
    found: Word | None = None
    for i, word in enumerate(words):
        for name in names:
            if word.text == name and i + 1 < len(words):
                found = words[i + 1]
            elif word.text.startswith(name + "="):
                found = Word(word.text[len(name) + 1:], word.line, word.note)
    return found


def _launcher_int(src: Source, word: Word | None, option: str, warnings: list[str]) -> int | None:
    if word is None:
        return None
    text = word.text.split(":")[-1]  # elastic "--nnodes 2:4": the largest size
    if re.fullmatch(r"\d+", text) and int(text) > 0:
        return int(text)
    why = f" ({word.note})" if word.note else ""
    warnings.append(
        f"{src.where(word.line)}: {option} {word.text!r}{why}: not a device count; give --devices for the world size"
    )
    return None


def world_from_launcher(src: Source, launcher: Sequence[Word], warnings: list[str]) -> tuple[int | None, int | None]:
    """(world size, devices per node) from torchrun, torch.distributed.launch, deepspeed or msrun."""
    if not launcher:
        return None, None
    per_node = _launcher_int(src, _option(launcher, "--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus",
                                          "--local_worker_num"), "--nproc_per_node", warnings)
    nodes_word = _option(launcher, "--nnodes", "--num_nodes", "--num-nodes")
    nodes = _launcher_int(src, nodes_word, "--nnodes", warnings)
    total = _launcher_int(src, _option(launcher, "--worker_num"), "--worker_num", warnings)
    if total:
        return total, per_node
    if per_node and nodes_word is not None and nodes is None:
        return None, per_node  # an unreadable node count ($NNODES unset): --devices gives the world size
    if per_node:
        return per_node * (nodes or 1), per_node
    return None, None


# ---------------------------------------------------------------- argument files
def file_entries(src: Source, data: Any, lines: LineIndex) -> dict[str, Arg]:
    """A JSON/YAML mapping of Megatron arguments (``dest`` or flag spelling) → entries.

    ``true`` means the flag is given, ``false``/``null`` that it is not; lists are ``nargs``
    values. Inverted dests (``add_bias_linear: false``) become their flag (``--disable-bias-linear``).
    """
    if not isinstance(data, Mapping):
        raise NdplanError(f"{src.name}: expected a mapping of Megatron arguments, got {type(data).__name__}")
    entries: dict[str, Arg] = {}
    for key, value in data.items():
        key = str(key)
        line = lines.line((key,))
        dest = key.lstrip("-").replace("-", "_")
        flag, invert = DEST_TO_FLAG.get(dest, (normalise_flag(key), False))
        if isinstance(value, Mapping):
            raise src.error(key, "expected a value, got a mapping (the file must be flat: one key per argument)", line)
        if invert:
            if value is False:
                entries[flag] = Arg(flag, [], line)
            continue
        if value is None or value is False:
            continue
        if value is True:
            entries[flag] = Arg(flag, [], line)
        elif isinstance(value, (list, tuple)):
            entries[flag] = Arg(flag, [str(v) for v in value], line)
        else:
            entries[flag] = Arg(flag, [str(value)], line)
    return entries
