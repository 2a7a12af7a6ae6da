"""The UI thread must keep painting while the engine works: record the gaps between the window's paints."""

import time


def record_paint_gaps(window) -> list[float]:
    """Route the window's paint timer through a recorder; returns the list the gaps (s) are appended to."""
    gaps, last = [], [time.monotonic()]
    paint = window.paint

    def timed_paint():
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now
        paint()

    window.paint_timer.timeout.disconnect()
    window.paint_timer.timeout.connect(timed_paint)
    return gaps
