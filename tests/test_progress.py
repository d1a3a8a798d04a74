"""The progress lines of the long stages (draftsmith.progress): the rate a line shows is that of the window since
the previous line, the ETA comes from all the work done, and heartbeat lines do not freeze the rate."""

from __future__ import annotations

import logging

from draftsmith.progress import progress


class _Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _bar(caplog, monkeypatch, total=100):
    caplog.set_level(logging.INFO, logger="draftsmith.test")
    clock = _Clock(1000.0)
    monkeypatch.setattr("tqdm.std.time", clock)  # tqdm reads the time through self._time = tqdm.std.time
    bar = progress(total=total, desc="train", unit="step", logger=logging.getLogger("draftsmith.test"),
                   interval=3600)  # no heartbeat line during the test: each line is a display() below
    return bar, clock


def _last(caplog) -> str:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("train:")][-1]


def test_the_rate_is_the_window_since_the_previous_line_and_the_eta_the_mean(caplog, monkeypatch):
    bar, clock = _bar(caplog, monkeypatch)
    clock.t += 10
    bar.update(10)  # 1 step/s in the first window
    bar.display()
    assert "1.00step/s" in _last(caplog), _last(caplog)
    clock.t += 10
    bar.update(40)  # 4 steps/s in the second: shown as such, not tqdm's stale or the mean (2.5)
    bar.display()
    line = _last(caplog)
    assert "4.00step/s" in line, line
    assert "ETA 00:20" in line, line  # (100 - 50) x 20 s / 50 steps, from everything done so far
    bar.close()


def test_a_window_that_finished_nothing_shows_the_mean_rate(caplog, monkeypatch):
    bar, clock = _bar(caplog, monkeypatch)
    clock.t += 10
    bar.update(30)
    bar.display()
    clock.t += 20  # a slow step: nothing finished since the previous line
    bar.display()
    assert "1.00step/s" in _last(caplog), _last(caplog)  # 30 steps / 30 s, not the 3 steps/s of the last window
    clock.t += 10
    bar.update(20)
    bar.display()
    assert "1.50s/step" in _last(caplog), _last(caplog)  # the window reopened at the last progress: 20 steps in 30 s
    bar.close()


def test_partial_work_moves_the_rate_and_eta_before_a_unit_finishes(caplog, monkeypatch):
    bar, clock = _bar(caplog, monkeypatch, total=4)
    clock.t += 60
    bar.set_partial(0.5)  # half a prompt decoded in a minute
    bar.advance(tok=300)
    bar.display()
    line = _last(caplog)
    assert "ETA 07:00" in line, line  # 3.5 prompts left at 120 s each
    assert "300 tok, 5 tok/s" in line, line
    bar.close()


def test_one_off_costs_before_restart_eta_are_not_projected_over_the_units_left(caplog, monkeypatch):
    """Evaluate's loading and warm-up (2 minutes on the CPU) came before its first prompt; projected over 21
    prompts from a few tokens of the first, the first line said 2 h 50 min. After restart_eta the rate and ETA count
    from the warm-up's end; the elapsed time shown stays the bar's."""
    bar, clock = _bar(caplog, monkeypatch, total=21)
    clock.t += 120  # loading + warm-up
    bar.restart_eta()
    bar.display()
    line = _last(caplog)
    assert "ETA ?" in line and "?step/s" in line and "02:00 elapsed" in line, line
    clock.t += 10
    bar.set_partial(0.5)  # half the first prompt in 10 s
    bar.display()
    line = _last(caplog)
    assert "ETA 06:50" in line, line  # 20.5 prompts left at 20 s each, not at (130 s / 0.5)
    assert "02:10 elapsed" in line, line
    clock.t += 10
    bar.update(1)
    bar.display()
    assert "ETA 06:40" in _last(caplog), _last(caplog)  # 20 left at 20 s
    bar.close()
