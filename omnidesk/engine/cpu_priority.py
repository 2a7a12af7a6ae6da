"""Background work that must not take the core from a reply: a lower CPU priority for one thread,
and how many cores the rest of the machine leaves this process.

On a busy machine (users run the model next to other work; on 2 cores one busy process leaves one)
the reply's steps share a core with whatever else the app does meanwhile.  Threads whose work
can wait (the background compile, the end-of-turn judge) lower their own nice value: where the
core is free they run as before, where it is shared the reply goes first.  Linux only (elsewhere
threads have no priority of their own); raising one's own nice value needs no privilege.

A priority only orders what shares a core; it cannot make two pieces of work that are both
awaited finish sooner than one after the other.  :class:`CoreMeter` says whether they can run side
by side at all: the cores this process may use, minus what other processes used of them lately.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


def lower_this_thread(by: int, what: str) -> None:
    """Raise the calling thread's nice value by ``by`` (at most 19); ``what`` names the thread in
    the log when the system refuses (a sandbox may)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError as e:
        log.info("the %s thread keeps its priority: %s", what, e)


class CoreMeter:
    """The cores the rest of the machine leaves this process: the cores it may run on (its
    affinity) minus the CPU time other processes took on them, averaged over the time since the
    previous look at least ``window_s`` ago (the first window starts at construction).

    Read from ``/proc/stat`` (all processes' CPU time per core) and this process's own CPU time,
    so this process's threads never count against it.  :meth:`spare` returns None where
    ``/proc/stat`` cannot be read (not Linux) and before the first window has passed."""

    def __init__(self, window_s: float = 1.0, stat_path: str = "/proc/stat",
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], float] = time.process_time):
        self.window_s = window_s
        self.stat_path = stat_path
        self._clock, self._own_cpu = clock, own_cpu
        try:
            self.cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # no affinity call (macOS): every core
            self.cpus = frozenset(range(os.cpu_count() or 1))
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._mark = self._read()
        self._spare: float | None = None

    def _read(self) -> tuple[float, float, float] | None:
        """(now, CPU seconds all processes spent on our cores, this process's CPU seconds)."""
        try:
            with open(self.stat_path) as f:
                lines = f.readlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu"):
                break  # the per-core lines come first; the rest (interrupts, counts) is not read
            if not (name[3:].isdigit() and int(name[3:]) in self.cpus):
                continue  # the all-cores line, and cores this process may not use
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            f = [int(v) for v in rest.split()[:8]]
            busy += f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)
        return self._clock(), busy / self._tick, self._own_cpu()

    def spare(self) -> float | None:
        """Cores free for this process, averaged over the last window (see the class docstring)."""
        now = self._read()
        mark = self._mark
        if now is None or mark is None:
            return None
        wall = now[0] - mark[0]
        if wall >= self.window_s:
            others = max(0.0, (now[1] - mark[1]) - (now[2] - mark[2])) / wall
            self._spare = max(0.0, len(self.cpus) - others)
            self._mark = now
        return self._spare
