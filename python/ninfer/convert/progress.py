"""A one-line progress display on stderr: tensors done, bytes written, rate, current tensor.

On a terminal the line is redrawn in place; otherwise (logs, CI) a line is printed at most every
few seconds so the output stays short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None):
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.bytes = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._width = 0

    def _line(self, name: str) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return (
            f"[{self.done:>{len(str(self.total))}}/{self.total}] {human_bytes(self.bytes)} "
            f"{human_bytes(self.bytes / elapsed)}/s {name}"
        )

    def update(self, name: str, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        interval = 0.2 if self.tty else 5.0
        if now - self._last < interval and self.done < self.total:
            return
        self._last = now
        line = self._line(name)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, message: str) -> None:
        if not self.enabled:
            return
        prefix = "\r" + " " * self._width + "\r" if self.tty else ""
        elapsed = time.monotonic() - self.start
        self.stream.write(f"{prefix}{message} ({self.done} tensors, {human_bytes(self.bytes)} in {elapsed:.1f} s)\n")
        self.stream.flush()
