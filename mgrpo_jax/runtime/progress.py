"""What a run shows while it works: a bar per phase on a terminal, one log line per step everywhere.

::

    with RunProgress(enabled=is_main_process) as progress:
        bar = progress.phase("warm start main", total=200)
        for i in range(200):
            ...
            bar.update(i + 1, loss=1.23)           # the bar: step/total, elapsed, ETA, loss
            if (i + 1) % 25 == 0:
                log.info("warm start main %s", bar.line(loss=1.23))   # "25/200 | loss 1.230 | ETA 3m05s"
        bar.close()

- The bars are `rich.progress` bars, drawn only when stderr is a terminal (not in CI, a redirected log or a
  non-zero process). While they are drawn, log records print through the same console, above the bars instead
  of through them, in the format of the handler they stand in for; when the bars close, that handler comes back.
- The log lines carry the same figures as the bars (step/total, the phase's loss or reward, the ETA from this
  process's recent step times), so a log file alone tells how far a run is and how long it still needs. Bar and
  log line show one ETA (`Phase.eta`), not rich's own estimate, which counts the first step's compilation.
- On a narrow terminal (80 columns) only the figures give way: cut, then dropped; the bar, step/total, the
  elapsed time and the ETA stay.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

ETA_WINDOW = 10  # steps: the ETA follows the recent pace
BAR_WIDTH = 20  # columns: with the step count, times and ETA it fits an 80-column terminal beside the figures


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_figures(figures: dict) -> str:
    """`loss 1.230 | main/reward 0.412`: the figures that are numbers, in the order given."""
    return " | ".join(f"{k} {v:.3f}" for k, v in figures.items() if isinstance(v, int | float))


class Phase:
    """One phase's bar (when drawn) and its pace. `update(done, **figures)` after each step."""

    def __init__(self, progress: Progress | None, description: str, total: int, done: int = 0):
        self.description, self.total, self.done = description, int(total), int(done)
        self._progress = progress
        # (seconds, steps) between consecutive updates of this process: the first step (it compiles) and the first
        # after a pause (another phase ran meanwhile) start a new interval instead of ending one
        self._intervals: deque[tuple[float, int]] = deque(maxlen=ETA_WINDOW)
        self._last: tuple[float, int] | None = None
        self._task = None
        if progress is not None:
            self._task = progress.add_task(description, total=self.total, completed=self.done, figures="", eta="")

    def update(self, done: int, **figures) -> None:
        now = time.perf_counter()
        if self._last is not None and done > self._last[1]:
            self._intervals.append((now - self._last[0], int(done) - self._last[1]))
        self.done, self._last = int(done), (now, int(done))
        if self._task is not None:
            self._progress.update(self._task, completed=self.done, figures=format_figures(figures),
                                  eta=self.eta() or ("ETA -" if self.done < self.total else ""))

    def pause(self) -> None:
        """Other work runs before this phase's next step (the warm start alternates agents by rounds): the time
        until then is not this phase's pace."""
        self._last = None

    def eta_seconds(self) -> float | None:
        """Seconds left at the pace of this process's last `ETA_WINDOW` steps, not counting its first nor the first
        after a pause (None before there is an interval)."""
        if not self._intervals:
            return None
        seconds, steps = map(sum, zip(*self._intervals, strict=True))
        return seconds / steps * max(self.total - self.done, 0)

    def eta(self) -> str:
        """`ETA 3m05s`, the same on the bar and in the log line ("" before there is a pace and once done)."""
        eta = self.eta_seconds()
        return f"ETA {format_duration(eta)}" if eta is not None and self.done < self.total else ""

    def line(self, **figures) -> str:
        """`done/total | figures | ETA`: the phase's log line."""
        return " | ".join(p for p in (f"{self.done}/{self.total}", format_figures(figures), self.eta()) if p)

    def close(self) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None


class FieldColumn(ProgressColumn):
    """A task field as plain text on one line (the ETA from `Phase.eta`, the figures)."""

    def __init__(self, field: str, table_column: Column | None = None):
        super().__init__(table_column)
        self.field = field

    def render(self, task) -> Text:
        return Text(str(task.fields.get(self.field, "")), no_wrap=True, overflow="ellipsis")


class ConsoleHandler(logging.Handler):
    """Prints records through the bars' console (above the bars) in the format of the handler it stands in for,
    so that the screen shows one log format with bars or without."""

    def __init__(self, console: Console, original: logging.Handler):
        super().__init__(original.level)
        self.console, self.original = console, original

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(Text(self.original.format(record)), soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must never fail the run
            self.handleError(record)


class RunProgress:
    """The run's bars (see the module docstring). A context manager; `phase` opens a bar."""

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.live = bool(enabled) and self.console.is_terminal
        self._progress = None
        if self.live:
            # Only the figures may shrink (cut with an ellipsis, then dropped): on a narrow terminal the bar, the
            # step count, the elapsed time and the ETA stay whole.
            fixed = {"table_column": Column(no_wrap=True)}
            self._progress = Progress(
                TextColumn("[bold]{task.description}", **fixed), BarColumn(BAR_WIDTH, **fixed),
                MofNCompleteColumn(**fixed), TimeElapsedColumn(**fixed), FieldColumn("eta", **fixed),
                FieldColumn("figures", table_column=Column(min_width=0, overflow="ellipsis")),
                console=self.console, redirect_stdout=False, redirect_stderr=False)
        self._swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []

    def phase(self, description: str, total: int, done: int = 0) -> Phase:
        return Phase(self._progress, description, total, done)

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.start()
            self._route_logging()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        for logger, original, replacement in self._swapped:
            logger.removeHandler(replacement)
            logger.addHandler(original)
        self._swapped.clear()

    def _route_logging(self) -> None:
        """Handlers that write to the terminal the bars are on print through rich instead, above the bars."""
        streams = {id(sys.stderr), id(sys.__stderr__), id(sys.stdout), id(sys.__stdout__)}
        for logger in (logging.getLogger(), logging.getLogger("mgrpo_jax")):
            for handler in list(logger.handlers):
                # absl's handler (installed by app.run) writes through an inner stream handler
                stream = getattr(getattr(handler, "_current_handler", handler), "stream", None)
                if not isinstance(handler, logging.FileHandler) and id(stream) in streams:
                    replacement = ConsoleHandler(self.console, handler)
                    logger.removeHandler(handler)
                    logger.addHandler(replacement)
                    self._swapped.append((logger, handler, replacement))
