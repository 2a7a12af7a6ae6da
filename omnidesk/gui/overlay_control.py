"""The latency overlay's wiring: shown or hidden (remembered), where it opens, and exporting the timelines.

:class:`OverlayControl` owns the :class:`.overlay.LatencyOverlay` window: View ▸ Latency overlay
(F2) shows it, closing it unticks the menu item, and it opens where the user last put it if that
spot is still on a screen and clear of the banners, else beside the main window; a warning hidden
by the overlay is a warning nobody reads.  The session's timelines (the data the overlay draws) are
exported from its button and from File ▸ Export, as JSON or CSV.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QPoint, QRect, QSize
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFileDialog

from .errors import plain_message
from .latency import export_timeline
from .overlay import LatencyOverlay

log = logging.getLogger("omnidesk.gui")


class OverlayControl(QObject):
    """``window`` is the :class:`.main_window.MainWindow` (its banners, its View menu's overlay action,
    the session's status and conversation)."""

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.settings = window.settings
        self.closing = False  # the main window is closing: the overlay goes with it, the setting stays
        self.overlay = LatencyOverlay(window)
        self.overlay.export_requested.connect(self.choose_export)
        self.overlay.installEventFilter(self)  # remember when the user closes it

    # ------------------------------------------------------------------ shown, placed
    def set_visible(self, visible: bool) -> None:
        self.settings.overlay_visible = visible
        if visible:
            self.overlay.adjustSize()
            self.overlay.move(*self._place())
            self.overlay.show()
            self.overlay.raise_()
            self.overlay.render()
        else:
            self.overlay.hide()

    def banner_area(self) -> QRect:
        """Where the banners appear, in screen coordinates: the top of the window's content, as tall as
        the banners can get (shown or not: one may appear after the overlay opened)."""
        w = self.window
        top_left = w.centralWidget().mapToGlobal(QPoint(0, 0))
        height = max(160, sum(b.sizeHint().height() for b in (w.demo_banner, w.info_banner, w.error_banner)))
        return QRect(top_left, QSize(w.centralWidget().width(), height))

    def _place(self) -> tuple[int, int]:
        """Where the overlay opens: where it was last, if that spot is still on a screen and clear of the
        banners; else beside the window, or inside its lower right corner when no screen has room beside
        it.  Never over the banners."""
        size = self.overlay.frameGeometry().size().expandedTo(self.overlay.sizeHint())
        banners = self.banner_area()

        def fits(x: int, y: int) -> bool:
            rect = QRect(QPoint(x, y), size)
            on_screen = any(scr.availableGeometry().contains(rect) for scr in QGuiApplication.screens())
            return on_screen and not rect.intersects(banners)

        remembered = self.settings.overlay_pos
        if remembered is not None and fits(*remembered):
            return remembered
        frame = self.window.frameGeometry()
        for x, y in ((frame.right() + 8, frame.top()), (frame.left() - size.width() - 8, frame.top()),
                     (frame.right() - size.width() - 8, frame.bottom() - size.height() - 8)):
            if fits(x, y):
                return x, y
        return frame.left(), max(frame.top(), banners.bottom() + 8)  # below the banners at least

    def eventFilter(self, obj, event):
        if obj is self.overlay and event.type() == QEvent.Type.Hide and not self.closing:
            self.window.overlay_action.setChecked(False)
        if obj is self.overlay and event.type() == QEvent.Type.Move and self.overlay.isVisible():
            pos = self.overlay.pos()  # the user's spot: opened there again, if it is still free
            self.settings.overlay_pos = (pos.x(), pos.y())
        return False

    def window_closing(self) -> None:
        """The main window closes: the overlay goes too, still remembered as shown (it opens next time)."""
        self.closing = True
        self.overlay.hide()

    # ------------------------------------------------------------------ export
    def timeline_dict(self) -> dict:
        s = self.window.status
        extra = {} if s is None else {"confirmed_barge_ins": s.confirmed_barge_ins,
                                      "false_barge_ins": s.false_barge_ins}
        return self.window.conversation.timeline_dict(extra)

    def choose_export(self, kind: str) -> None:
        suffix = ".csv" if kind == "csv" else ".json"
        name = time.strftime("omnidesk-timeline-%Y%m%d-%H%M%S") + suffix
        path, _ = QFileDialog.getSaveFileName(self.window, "Export the session's timelines", name,
                                              "CSV (*.csv)" if kind == "csv" else "JSON (*.json)")
        if path:
            self.export(path)

    def export(self, path: str) -> Path | None:
        w = self.window
        try:
            written = export_timeline(self.timeline_dict(), path)
        except Exception as e:  # noqa: BLE001
            log.exception("export failed")
            w.error_banner.show_message(plain_message(e, "exporting the timeline"), {"Open the log": w.open_log})
            return None
        w.statusBar().showMessage(f"Timeline written to {written}", 8000)
        return written
