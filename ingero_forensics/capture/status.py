"""What the capture tells its operator on stderr: a status line on a terminal, plain log
lines otherwise, nothing but errors with --quiet."""

from __future__ import annotations

import sys
import time

from ..cliutil import clean, human_bytes, raw_stream

MODES = ("tty", "plain", "quiet")


class Reporter:
    #: plain mode repeats the status as a log line this often
    PLAIN_STATUS_S = 60.0

    def __init__(self, mode: str = "plain", stream=None):
        if mode not in MODES:
            raise ValueError(f"unknown output mode {mode!r}")
        self.mode = mode
        # its own line control (CR, erase line) goes to the terminal; the text is escaped
        self.stream = raw_stream(stream or sys.stderr)
        self._line_shown = False
        self._last_plain = time.monotonic()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # stderr gone (closed terminal): the bundle is what matters

    def message(self, level: str, source: str, text: str, always: bool = False) -> None:
        """One line on stderr. --quiet keeps only errors, and what ``always`` marks: a
        source that is off is never hidden (quiet hides progress, not blind spots)."""
        if self.mode == "quiet" and level != "error" and not always:
            return
        if self._line_shown:
            self._write("\r\033[K")
            self._line_shown = False
        stamp = time.strftime("%H:%M:%S")
        self._write(clean(f"{stamp} {level:<7} {source}: {text}") + "\n")

    def status(self, text: str) -> None:
        if self.mode == "tty":
            self._write(f"\r\033[K{clean(text)}")
            self._line_shown = True
        elif self.mode == "plain":
            now = time.monotonic()
            if now - self._last_plain >= self.PLAIN_STATUS_S:
                self._last_plain = now
                self.message("info", "capture", text)

    def close(self) -> None:
        if self._line_shown:
            self._write("\n")
            self._line_shown = False


def status_text(rates: dict[str, float], lost: int, segment: int, seg_bytes: int,
                disk_bytes: int) -> str:
    parts = " ".join(f"{name} {rate:.0f}/s" for name, rate in rates.items())
    return (f"seg {segment} {human_bytes(seg_bytes)} | disk {human_bytes(disk_bytes)} | "
            f"{parts} | lost {lost}")
