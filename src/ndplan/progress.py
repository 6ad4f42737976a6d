"""What a command shows on stderr while it works for more than a moment.

`ndplan search` draws a bar over its candidates; the other long steps (a fake-tensor training
step or census, a calibration fit, balancing every fitting pipeline, drawing a report's figures)
have no count to fill a bar with, so they show a spinner, what is being done and the time it has
taken. Never with --json, nor where stderr is not a terminal (pipes, CI logs), so the output a
program reads stays as it is; transient, so the finished command's output is what remains.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


def shows_progress(quiet: bool = False) -> bool:
    """Whether a command may draw progress: stderr is a terminal and the output is not --json."""
    return not quiet and sys.stderr.isatty()


@contextmanager
def working(description: str, *, quiet: bool = False) -> Iterator[None]:
    """A spinner with ``description`` and the elapsed time on stderr while the block runs."""
    if not shows_progress(quiet):
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, redirect_stdout=False) as progress:
        progress.add_task(description, total=None)
        yield
