"""Files the commands write (``search --csv``, ``calibrate -o``, ``census --out``, ``measure
--out`` and ``--timeline``): checked before the work that fills them, so that a search, a fit or
a measurement is not lost to a path that cannot be written, and their missing folders made when
they are written, as ``report -o`` and ``estimate --plot`` make theirs."""

from __future__ import annotations

from pathlib import Path

from ndplan.errors import NdplanError


def output_path(value: str | Path, flag: str, what: str = "file") -> Path:
    """``value`` as the ``what`` a command will write under ``flag``: not a folder, and no folder
    above it a file (an NdplanError naming the flag says which). Folders that do not exist yet
    are fine: ``made_folder`` makes them."""
    path = Path(value)
    if path.is_dir():
        raise NdplanError(f"{flag} {path}: a folder; give the {what}'s name")
    blocking = next((folder for folder in reversed(path.parents) if folder.exists() and not folder.is_dir()), None)
    if blocking is not None:
        raise NdplanError(f"{flag} {path}: {blocking} is a file, not a folder (write elsewhere)")
    return path


def made_folder(value: str | Path, flag: str) -> Path:
    """``value``, its folder made where missing (an NdplanError naming ``flag`` where it cannot be)."""
    path = Path(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise NdplanError(f"{flag} {path}: cannot make its folder: {error.strerror or error}") from None
    return path
