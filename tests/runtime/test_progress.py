"""The progress display: bars on a terminal only, log lines with step/total, figures and an ETA from the pace."""

import io
import logging

import pytest
from rich.console import Console

from mgrpo_jax.runtime import progress as progress_module
from mgrpo_jax.runtime.progress import Phase, RunProgress, format_duration, format_figures


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (59.6, "1m00s"), (185, "3m05s"),
                                           (7620, "2h07m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_format_figures_keeps_numbers_in_order():
    assert format_figures({"loss": 1.23456, "name": "x", "main/reward": 0.5, "n": 3}) == \
        "loss 1.235 | main/reward 0.500 | n 3.000"


def test_phase_line_has_the_eta_of_the_recent_pace(monkeypatch):
    clock = iter([160.0, 164.0, 168.0])  # the first step took a minute (compilation), then one every 4 s
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    phase = Phase(None, "RL", total=20, done=5)  # resumed at step 5: the pace counts this process's steps only
    assert phase.line(reward=0.5) == "5/20 | reward 0.500"  # no pace yet, no ETA
    phase.update(6)
    assert phase.eta_seconds() is None  # the first step's time is compilation, not pace
    phase.update(7)
    assert phase.eta_seconds() == pytest.approx(4.0 * 13)
    assert phase.line(reward=0.25) == "7/20 | reward 0.250 | ETA 52s"
    phase.update(20)
    assert phase.line() == "20/20"  # finished: no ETA


def test_phase_pace_follows_the_last_steps_only(monkeypatch):
    times = [3.0 * d if d <= 10 else 30.0 + (d - 10) for d in range(1, 30)]  # 3 s per step, then 1 s
    clock = iter(times)
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    phase = Phase(None, "RL", total=100)
    for done in range(1, 30):
        phase.update(done)
    assert phase.eta_seconds() == pytest.approx(71.0)  # 71 steps left at the last 10 steps' 1 s


def test_time_spent_in_other_phases_is_not_pace(monkeypatch):
    """The warm start runs agents by rounds: the sub's bar pauses while the main agent's round runs."""
    clock = iter([10.0, 12.0, 14.0, 500.0, 502.0])  # 2 s per step; 486 s of the other agent's round between
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    phase = Phase(None, "warm start sub", total=100)
    for done in (1, 2, 3):
        phase.update(done)
    phase.pause()
    phase.update(4)
    assert phase.eta_seconds() == pytest.approx(2.0 * 96)
    phase.update(5)
    assert phase.eta_seconds() == pytest.approx(2.0 * 95)


def test_no_bars_off_a_terminal():
    with RunProgress(console=Console(file=io.StringIO(), force_terminal=False)) as run:
        assert not run.live
        run.phase("RL", 3).update(1, reward=0.5)


def test_bars_on_a_terminal_and_logging_above_them():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None)
    logger = logging.getLogger()
    original = logging.StreamHandler(progress_module.sys.stderr)
    logger.addHandler(original)
    try:
        with RunProgress(console=console) as run:
            assert run.live and original not in logger.handlers  # log records go through rich's console
            bar = run.phase("warm start main", 200, done=25)
            bar.update(50, loss=1.5)
            logging.getLogger("mgrpo_jax.test").warning("a line above the bars")
            run._progress.refresh()
        assert original in logger.handlers  # the original handler is back
    finally:
        logger.removeHandler(original)
    text = out.getvalue()
    assert "warm start main" in text and "50/200" in text and "loss 1.500" in text and "ETA" in text
    assert "a line above the bars" in text


def test_disabled_progress_is_never_live():
    assert not RunProgress(enabled=False, console=Console(file=io.StringIO(), force_terminal=True)).live


def test_absl_handler_is_routed_above_the_bars():
    """launch/tpu_run.py runs under absl's app.run, whose handler writes to stderr through an inner handler."""
    from absl import logging as absl_logging

    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    logger, handler = logging.getLogger(), absl_logging.get_absl_handler()
    logger.addHandler(handler)
    try:
        with RunProgress(console=console):
            assert handler not in logger.handlers
        assert handler in logger.handlers
    finally:
        logger.removeHandler(handler)


def _screen(out: io.StringIO) -> list[str]:
    """The last frame of the bars: the lines after the last cursor movement, without escape codes."""
    import re

    frame = out.getvalue().rsplit("\x1b[1A", 1)[-1]
    return [line for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame).split("\n") if line.strip()]


def test_at_80_columns_the_bars_keep_bar_step_count_and_eta_and_drop_the_figures_first(monkeypatch):
    clock = iter(float(t) for t in range(0, 1000, 2))  # one step every 2 s
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    figures = {"main/reward": 0.25, "main/correct": 0.5, "sub/reward": 0.125, "time/step_s": 16.0}
    with RunProgress(console=console) as run:
        rl = run.phase("RL", 200)
        for done in range(1, 27):
            rl.update(done, **figures)
        evaluation = run.phase("eval at step 26", 6)
        evaluation.update(2, accuracy=0.5)
        run._progress.refresh()
        line = rl.line(**figures)
    lines = _screen(out)
    assert len(lines) == 2 and all(len(text) <= 80 for text in lines), lines
    rl_line, eval_line = lines
    assert line.endswith("| ETA 5m48s")  # 174 steps left at 2 s
    assert rl_line.startswith("RL ") and "━" in rl_line and "26/200" in rl_line and "ETA 5m48s" in rl_line
    assert "main/reward 0.25" in rl_line and "time/step_s" not in rl_line  # the figures gave way
    assert "eval at step 26" in eval_line and "2/6" in eval_line and "ETA -" in eval_line  # no pace yet


def test_the_log_records_above_the_bars_keep_their_handler_format():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    logger, handler = logging.getLogger(), logging.StreamHandler(progress_module.sys.stderr)
    handler.setFormatter(logging.Formatter("FMT %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    try:
        with RunProgress(console=console) as run:
            run.phase("RL", 3)
            logging.getLogger("mgrpo_jax.test").warning("above the bars")
    finally:
        logger.removeHandler(handler)
    assert "FMT WARNING mgrpo_jax.test: above the bars" in out.getvalue()
