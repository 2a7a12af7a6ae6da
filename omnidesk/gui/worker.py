"""Run blocking work (model loading, opening audio devices, closing a session) off the UI thread.

A :class:`Task` runs one function on the app's thread pool and reports back
through signals of a QObject created on the UI thread, so its slots run there
(queued).  The function gets a ``progress(str)`` callback it may call from the
pool thread.
"""

from __future__ import annotations

import logging
from typing import Callable

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

log = logging.getLogger("omnidesk.gui")

# Most tasks wait (on a device, on the previous session to close) rather than compute, and a
# session start waits for the previous close: a pool as small as the CPU count (2 on small laptops) could
# leave such a chain queued behind a model load.
MAX_THREADS = 8
_pool: QThreadPool | None = None


def pool() -> QThreadPool:
    global _pool
    if _pool is None:
        _pool = QThreadPool()
        _pool.setMaxThreadCount(MAX_THREADS)
    return _pool


class _Signals(QObject):
    progress = Signal(str)
    done = Signal(object)
    failed = Signal(object)  # the exception


class Task(QRunnable):
    """``fn(progress)`` on the pool; ``done(result)`` / ``failed(exc)`` / ``progress(text)`` on the UI thread."""

    _running: set["Task"] = set()  # Python must keep the task (and its signals) alive while it runs

    def __init__(self, what: str, fn: Callable[[Callable[[str], None]], object]):
        super().__init__()
        self.setAutoDelete(False)
        self.what = what
        self.fn = fn
        self.signals = _Signals()

    def run(self) -> None:
        try:
            result = self.fn(self.signals.progress.emit)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the window, never the void
            log.exception("%s failed", self.what)
            self.signals.failed.emit(e)
        else:
            self.signals.done.emit(result)

    def start(self) -> "Task":
        Task._running.add(self)
        self.signals.done.connect(self._forget)
        self.signals.failed.connect(self._forget)
        pool().start(self)
        return self

    def _forget(self, *_):
        Task._running.discard(self)


def run_in_background(what: str, fn, on_done=None, on_failed=None, on_progress=None) -> Task:
    """Start ``fn(progress)`` on the pool and connect the callbacks (called on the UI thread)."""
    task = Task(what, fn)
    if on_done is not None:
        task.signals.done.connect(on_done)
    if on_failed is not None:
        task.signals.failed.connect(on_failed)
    if on_progress is not None:
        task.signals.progress.connect(on_progress)
    return task.start()


def wait_for_background(ms: int = 10000) -> bool:
    """At exit (the window is gone): let running tasks (closing a session) finish."""
    return pool().waitForDone(ms)
