"""What the demo prints: numbered stages, indented lines, one updating status line on a
terminal, and `kubectl get sft` rows whose columns line up across separate kubectl calls."""
from __future__ import annotations

import re
import sys
import time

STAGES = 7
TTY = sys.stdout.isatty()
WIDTHS = (12, 11, 27, 8, 9, 10)  # NAME PHASE REASON STEP LOSS RESTARTS (AGE last)


class Out:
    """Stage headers and indented lines; remembers how long each stage took (summary.json)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.stage_t0 = self.t0
        self.timings: dict[str, float] = {}
        self._current: str | None = None
        self._open_line = False

    def stage(self, n: int, title: str) -> None:
        self._close_stage()
        self.end_line()
        self._current = f"{n}. {title}"
        self.stage_t0 = time.time()
        print(f"\n\033[1m==> [{n}/{STAGES}] {title}\033[0m" if TTY else f"\n==> [{n}/{STAGES}] {title}", flush=True)

    def _close_stage(self) -> None:
        if self._current:
            self.timings[self._current] = round(time.time() - self.stage_t0, 1)

    def say(self, msg: str = "") -> None:
        self.end_line()
        print(f"    {msg}" if msg else "", flush=True)

    def cmd(self, text: str) -> None:
        self.say(f"$ {text}")

    def progress(self, line: str, newline: bool) -> None:
        """One updating line on a terminal; a new line only when asked (phase/step change)."""
        if TTY and not newline:
            print(f"\r\033[K    {line}", end="", flush=True)
            self._open_line = True
        else:
            self.end_line()
            print(f"    {line}", flush=True)

    def end_line(self) -> None:
        if self._open_line:
            print(flush=True)
            self._open_line = False

    def done(self) -> None:
        self._close_stage()
        self.end_line()
        self.timings["total"] = round(time.time() - self.t0, 1)


def row(table: str, header: bool = False) -> str:
    """One row (or the header) of `kubectl get sft` with fixed column widths, so that rows
    printed by separate kubectl calls line up."""
    lines = table.splitlines()
    if len(lines) < 2:
        return table.strip()
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    line = lines[0] if header else lines[1]
    cells = [line[s:e].strip() for s, e in zip(starts, starts[1:] + [None])]
    # a cell wider than its column still gets one space after it
    return "".join(c.ljust(w) if len(c) < w else c + " "
                   for c, w in zip(cells, WIDTHS + (0,) * len(cells))).rstrip()
