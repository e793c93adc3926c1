"""What a run shows on stderr while it measures.

On a terminal: one tqdm bar over every point of the run (all its ops), with the
estimated time left, and each point's line printed above it. Elsewhere (a log file,
CI): the plain lines alone, since a bar's carriage returns make a log unreadable.
Quiet: nothing.
"""

from __future__ import annotations

import sys
from typing import IO, Optional

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Progress over `total` points; confirmation passes add theirs with `more`.

    `label` starts every point's line: in a run sharded under torchrun, each rank's
    (`[rank 1] `), and no bar, since K bars drawn on one terminal overwrite each other."""

    def __init__(self, total: int, enabled: bool = True, stream: Optional[IO[str]] = None, label: str = ""):
        self.stream = stream or sys.stderr
        self.enabled, self.label = enabled, label
        use_bar = enabled and self.stream.isatty() and not label
        self.bar = tqdm(total=total, unit="point", file=self.stream, dynamic_ncols=True) if use_bar else None

    def op(self, name: str) -> None:
        """The op now measured, named on the bar."""
        if self.bar is not None:
            self.bar.set_description(name)

    def more(self, points: int) -> None:
        """Points the run will measure beyond the total it started with (the confirmation pass)."""
        if self.bar is not None and points:
            self.bar.total += points
            self.bar.refresh()

    def done(self, line: str) -> None:
        """One point measured: its line, and the bar one step on."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
            self.bar.update(1)
        elif self.enabled:
            print(f"{self.label}{line}", file=self.stream, flush=True)

    def echo(self, text: str) -> None:
        """`text` on stdout (a summary), above the bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
