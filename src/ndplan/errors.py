"""The one error type users see: a bad input, told in one line."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class NdplanError(ValueError):
    """A problem with the user's input. The CLI prints its message on one line and exits 2."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """The suffix " (did you mean 'x'?)" for the known name closest to a mistyped ``name``, or "": a prefix
    first (``h100`` is ``h100-sxm``), then difflib's closest match at ratio 0.6 or more."""
    choices = list(known)
    wanted = name.strip().lower()
    prefixed = [choice for choice in choices if wanted and choice.lower().startswith(wanted)]
    if len(prefixed) == 1:
        return f" (did you mean '{prefixed[0]}'?)"
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(wanted, list(lowered), n=1, cutoff=0.6)
    return f" (did you mean '{lowered[close[0]]}'?)" if close else ""


def require_name(value: object, what: str) -> str:
    """``value`` where it is a name (a str); else an NdplanError naming argument ``what`` (the API
    said ``'NoneType' object has no attribute 'lower'``)."""
    if not isinstance(value, str):
        raise NdplanError(f"{what} must be a name (a str), got {type(value).__name__}")
    return value


def by_name_or_object(value: object, kind: type, load: Callable[[str], Any], what: str, noun: str) -> Any:
    """``value`` if it is a ``kind``, ``load(value)`` if it is a name; else an NdplanError saying
    that argument ``what`` takes a ``kind`` or a ``noun`` name (the API's entry points take a
    model or device either way)."""
    if isinstance(value, str):
        return load(value)
    if not isinstance(value, kind):
        raise NdplanError(f"{what} must be a {kind.__name__} or a {noun} name, got {type(value).__name__}")
    return value


def read_text(path: str | os.PathLike[str]) -> str:
    """A user's file as UTF-8 text: one that is not text (a binary, another encoding) is an
    ``NdplanError`` naming it, not a UnicodeDecodeError."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise NdplanError(f"{path}: not a UTF-8 text file ({error.reason} at byte {error.start})") from None


def parse_nested(parse: Callable[[str], T], text: str, source: object, syntax: str) -> T:
    """``parse(text)`` (json.loads, yaml.safe_load, tomllib.loads); a document nested deeper than
    the parser's recursion allows (``[[[[...`` a hundred thousand times) is an NdplanError naming
    ``source`` instead of a RecursionError traceback. Real configs nest a few levels."""
    try:
        return parse(text)
    except RecursionError:
        raise NdplanError(f"{source}: malformed {syntax}: nested too deeply to read (lists or mappings "
                          "inside each other hundreds of levels down; a config nests a few)") from None
