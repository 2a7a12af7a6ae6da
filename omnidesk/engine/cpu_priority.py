"""Background work that must not take the core from a reply: a lower CPU priority for one thread.

On a busy machine (users run the model next to other work; on 2 cores one busy process leaves one)
the reply's steps share a core with whatever else the app does meanwhile.  Threads whose work
can wait (the background compile, the end-of-turn judge) lower their own nice value: where the
core is free they run as before, where it is shared the reply goes first.  Linux only (elsewhere
threads have no priority of their own); raising one's own nice value needs no privilege.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

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
