"""Progress of long work: phase lines, and bars for pieces × shapes and for bytes moved.

The CLI passes its stream (stderr: bars redrawn in place on a TTY). Library callers pass none:
then every line goes to the ``aotc.progress`` logger at INFO (a bar's steps at DEBUG, a transfer
once per tenth), seen where the process shows aotc's INFO lines (``AOTC_LOG=info``)."""

from __future__ import annotations

import time
from typing import TextIO

from aotc.log import logger

_log = logger("progress")


class Progress:
    """Reports phases and steps to ``stream``, or to the ``aotc.progress`` logger when there is
    none (module doc). ``quiet`` silences it."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._open_bar = False
        self._last_tenth = -1

    def _write(self, text: str) -> None:
        if self.quiet:
            return
        if self.stream is None:
            _log.info(text)
            return
        if self._open_bar:
            self.stream.write("\n")
            self._open_bar = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def phase(self, name: str, detail: str = "") -> None:
        """A phase begins (``capture``, ``split``, ``compile`` …)."""
        self._write(f"[{time.perf_counter() - self._t0:6.1f}s] {name}" + (f": {detail}" if detail else ""))

    def step(self, done: int, total: int, label: str) -> None:
        """One step of a counted phase; a bar on a TTY, one line per step elsewhere."""
        if self.quiet:
            return
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        self.step_line(f"  [{bar}] {done}/{total} {label}", done >= total)

    def note(self, text: str) -> None:
        """A warning or remark the user should see."""
        self._write(f"  note: {text}")

    def transfer(self, done: int, total: int, label: str) -> None:
        """Bytes moved of ``total``: a bar redrawn on a TTY; elsewhere a line per tenth."""
        if self.quiet or total <= 0:
            return
        from aotc.cache.humanize import format_size

        tenth = 10 * done // total
        if not self.tty and done < total and tenth == self._last_tenth:
            return
        self._last_tenth = tenth if done < total else -1
        width = 24
        bar = "#" * (width * done // total) + "-" * (width - width * done // total)
        self.step_line(f"  [{bar}] {format_size(done)} / {format_size(total)} {label}", done >= total)

    def step_line(self, line: str, last: bool) -> None:
        """Draw one progress line (in place on a TTY)."""
        if self.stream is None:
            _log.log(20 if last else 10, line.strip())  # INFO when done, DEBUG on the way
            return
        if self.tty:
            self.stream.write("\r" + line.ljust(78))
            self._open_bar = not last
            if last:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
