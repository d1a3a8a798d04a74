"""Progress lines of the long stages (regenerate, extract, train, evaluate): tqdm written as log lines, with a
heartbeat.

A tqdm bar only prints when it is updated, so a stage whose unit of work (a batch of conversations, a prompt
decoded three ways) takes minutes would stay silent that long. :class:`LogProgress` prints one line every
``interval`` seconds whatever happens, with the stage's finished units (``n``), the work done inside the unit in
flight (:meth:`LogProgress.advance`: tokens generated, decoded, extracted) with its rate, the rate of units over the
window since the previous line, and an ETA from all the work done so far, the in-flight fraction included
(:meth:`LogProgress.set_partial`).
"""

from __future__ import annotations

import logging
import threading

from tqdm import tqdm

log = logging.getLogger("draftsmith")

BAR_FORMAT = ("{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) [{elapsed} elapsed, ETA {remaining}, "
              "{rate_fmt}{work}{postfix}]")


class _LogStream:
    """A file-like sink for tqdm that turns each refresh into one log line (no carriage returns)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger

    def write(self, text: str) -> None:
        text = text.replace("\x1b[A", "").strip("\r\n ")  # tqdm moves the cursor up when two bars are open
        if text:
            self.logger.info(text)

    def flush(self) -> None:
        pass


def _count(k: float) -> str:
    """``12,345`` below 100,000, then tqdm's ``123k``, ``4.56M``."""
    return f"{k:,.0f}" if k < 1e5 else tqdm.format_sizeof(k)


class LogProgress(tqdm):
    """A tqdm bar written as log lines at most and at least every ``interval`` seconds (see the module docstring).

    Beside tqdm's ``update`` (finished units), a stage reports work inside the unit in flight:
    ``advance(tokens=k)`` adds to a named count shown with its rate since the start (``12.3k tok, 41.0 tok/s``), and
    ``set_partial(f)`` says which fraction (0 <= f < 1, in units of the bar) of the next units is done, so the ETA
    moves before the first unit finishes. ETA = (total - done) x elapsed / (done - initial), done = n + partial;
    after ``restart_eta()`` (one-off costs paid: loading, warm-up) elapsed and done count from that call instead.
    The rate is that of the window since the previous line (units done in it / its seconds), or the mean since the
    start when the window finished nothing: tqdm's own smoothed rate only moves when ``update`` prints, which the
    heartbeat's lines pre-empt, so it went stale (a trainer at 9 steps/s was shown at 47).
    """

    def __init__(self, *args, interval: float = 30.0, **kwargs):
        self.counts: dict[str, float] = {}
        self.partial = 0.0
        self.interval = float(interval)
        self._window: tuple[float, float] | None = None  # (time, done) at the previous line
        self._window_rate: float | None = None
        self._eta_from: tuple[float, float] | None = None  # (time, done) of restart_eta()
        self._stop = threading.Event()
        super().__init__(*args, mininterval=interval, maxinterval=max(interval * 4, 10.0), **kwargs)
        self._heartbeat = None
        if not self.disable:
            self._heartbeat = threading.Thread(target=self._beat, name=f"progress {self.desc}", daemon=True)
            self._heartbeat.start()

    def advance(self, **counts: float) -> None:
        """Add to the named in-flight counts (``tokens=32``); they show on the next line."""
        for name, k in counts.items():
            self.counts[name] = self.counts.get(name, 0) + k

    def set_partial(self, fraction: float) -> None:
        """The done fraction of the units in flight (bar units; 0 when a unit finishes and ``update`` counts it)."""
        self.partial = max(0.0, float(fraction))

    def restart_eta(self) -> None:
        """Measure the rate and ETA from now on: the time so far went to one-off costs (loading the models, the
        warm-up), which an ETA projected over the units left would repeat for each (evaluate's first line, 2
        minutes into a CPU run with one prompt started, said 2 h 50 min). The elapsed time shown stays the
        bar's."""
        self._eta_from = (self._time(), self.n + self.partial)
        self._window = None
        self._window_rate = None

    def update(self, n: float = 1):
        if n:
            self.partial = 0.0
        return super().update(n)

    @property
    def format_dict(self):
        d = super().format_dict
        d["work"] = ""
        if not hasattr(self, "counts"):  # tqdm's own disabled bar
            return d
        elapsed = d["elapsed"]
        done = self.n + self.partial - self.initial
        spent = elapsed  # the time the rate and ETA divide by
        if self._eta_from is not None:
            spent, done = self._time() - self._eta_from[0], self.n + self.partial - self._eta_from[1]
        if done > 0 and spent > 0:
            d["rate"] = self._window_rate or done / spent
            if self.total:
                d["remaining"] = self.format_interval(max(self.total - self.n - self.partial, 0) * spent / done)
        elif self._eta_from is not None:
            d["rate"], d["remaining"] = 0, "?"  # nothing done since: no rate to project
        d["work"] = "".join(f", {_count(k)} {name}, {_count(k / elapsed) if elapsed else '?'} {name}/s"
                            for name, k in self.counts.items())
        return d

    def display(self, *args, **kwargs):
        """Print a line (tqdm's ``display``), first measuring the rate over the window since the previous line."""
        if hasattr(self, "_window"):  # not tqdm's own disabled bar
            now, done = self._time(), self.n + self.partial
            then, done_then = self._window or self._eta_from or (getattr(self, "start_t", now), self.initial)
            if now > then and done > done_then:
                self._window_rate = (done - done_then) / (now - then)
                self._window = (now, done)
            else:  # nothing finished since the previous line: the mean, and the window stays open
                self._window_rate = None
                self._window = (then, done_then)
        return super().display(*args, **kwargs)

    def _beat(self) -> None:
        """Print the last known counts when no line was printed for ``interval`` seconds."""
        tick = min(1.0, self.interval / 4)
        while not self._stop.wait(tick):
            if self._time() - self.last_print_t >= self.interval:
                with self._lock:
                    self.last_print_t = self._time()
                    self.display()

    def close(self):
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join()
        super().close()


def progress(total: int | None, desc: str, *, unit: str = "it", logger: logging.Logger | None = None,
             interval: float = 30.0, initial: int = 0, unit_scale: bool = False, disable: bool = False) -> LogProgress:
    """A :class:`LogProgress` bar writing to ``logger`` (console and the rule's log): one line every ``interval``
    seconds (and the final one) with count, rate, ETA, the in-flight counts and the ``postfix`` figures (loss,
    tokens/s)."""
    return LogProgress(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale, disable=disable,
                       file=_LogStream(logger or log), interval=interval, smoothing=0.1, bar_format=BAR_FORMAT)
