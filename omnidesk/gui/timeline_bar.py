"""The stage timeline of one turn, painted big enough for a projector.

Time runs left to right from the end of the user's speech (0 ms).  Each stage
(endpoint, encoded, prefilled, 1st token, 1st speech token, 1st audio,
playing) is a tick with its label and time; stages that share an instant
stack their labels instead of overprinting.  A cut reply adds the barge-in
marks (cut in, confirmed, stopped) and a rollback bar: tokens kept vs rolled
back.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from .bridge import TurnView
from .latency import barge_in_times, stage_times

# Colour of the segment that ENDS at each stage (what that stage cost), readable on dark and light.
STAGE_COLOURS = {
    "endpoint": "#8e9aaf", "encoded": "#4e9af1", "prefilled": "#3fb6d8", "1st token": "#49c27a",
    "1st speech token": "#a3c94a", "1st audio": "#f0b429", "playing": "#f07b3f",
}
CUT_COLOUR = "#ef4f6a"
KEPT_COLOUR = "#49c27a"
DROPPED_COLOUR = "#7a7f8c"


class TimelineBar(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.view: TurnView | None = None
        self._labels: list[tuple[str, float, int]] = []  # (label, time, row above the bar)
        self._rows = 1
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAccessibleName("Turn timeline")
        self._relayout()

    def changeEvent(self, event):
        super().changeEvent(event)
        if event.type() == event.Type.FontChange:
            self._relayout()

    def resizeEvent(self, event):
        super().resizeEvent(event)
        self._relayout()

    def set_turn(self, view: TurnView | None) -> None:
        self.view = view
        self.setAccessibleDescription(self.describe())
        self._relayout()
        self.update()

    def describe(self) -> str:
        """The timeline in words (accessibility, tests)."""
        v = self.view
        if v is None:
            return "no turn yet"
        origin = self._origin(v)
        words = [f"{label} {((t - origin) * 1000):+.0f} ms" for label, t in stage_times(v)]
        if v.barge_in is not None:
            words += [f"{label} {((t - origin) * 1000):+.0f} ms" for label, t in barge_in_times(v)]
            words.append(f"kept {v.barge_in.kept_text_tokens} tokens, rolled back {v.barge_in.rolled_back_tokens}")
        return "; ".join(words)

    @staticmethod
    def _origin(v: TurnView) -> float:
        stages = stage_times(v)
        if v.user_speech_end is not None:
            return v.user_speech_end
        return stages[0][1] if stages else 0.0

    # ------------------------------------------------------------------ geometry
    def _scale(self):
        """(x(t), left, right, lo, span) for the current turn and width."""
        fm = QFontMetrics(self.font())
        v = self.view
        times = [t for _, t in stage_times(v) + barge_in_times(v)] + [self._origin(v)]
        lo, hi = min(times), max(times)
        span = max(hi - lo, 0.2)  # at least 200 ms wide: a fast turn must not fill the bar with one stage
        margin = fm.horizontalAdvance("1st speech token +0000 ms") / 2
        left, right = margin, max(margin + 1, self.width() - margin)
        return (lambda t: left + (right - left) * (t - lo) / span), left, right

    def _text(self, label: str, t: float) -> str:
        return f"{label} {((t - self._origin(self.view)) * 1000):+.0f} ms"

    def _relayout(self) -> None:
        """Stack stage labels in rows so that none overlaps (stages at one instant are common), and
        size the widget to the rows used."""
        fm = QFontMetrics(self.font())
        self._labels, edges = [], []
        if self.view is not None and stage_times(self.view):
            x, _, _ = self._scale()
            for label, t in sorted(stage_times(self.view), key=lambda s: s[1]):
                w = fm.horizontalAdvance(self._text(label, t))
                cx = x(t)
                row = next((i for i, edge in enumerate(edges) if cx - w / 2 > edge + 6), None)
                if row is None:
                    edges.append(0.0)
                    row = len(edges) - 1
                edges[row] = cx + w / 2
                self._labels.append((label, t, row))
        self._rows = max(2, len(edges))
        height = int(fm.height() * (self._rows + 5.8))
        if height != self.minimumHeight():
            self.setMinimumHeight(height)

    # ------------------------------------------------------------------ painting
    def paintEvent(self, event):
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        fg = self.palette().color(self.foregroundRole())
        fm = QFontMetrics(self.font())
        line = fm.height()
        v = self.view
        if v is None or not self._labels:
            p.setPen(fg)
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "The next turn's stages appear here.")
            return
        x, left, right = self._scale()
        bar_top, bar_h = line * (self._rows + 1.0), line * 1.1
        # segments between consecutive stages, each coloured by the stage that ends it (what it cost)
        chrono = [(label, t) for label, t, _ in self._labels]
        for (_, t0), (label, t1) in zip(chrono, chrono[1:]):
            if t1 > t0:
                p.fillRect(QRectF(x(t0), bar_top, x(t1) - x(t0), bar_h), QColor(STAGE_COLOURS.get(label, "#888")))
        p.setPen(QPen(fg, 1))
        p.drawRect(QRectF(left, bar_top, right - left, bar_h))
        bg = self.palette().color(self.backgroundRole())
        boxes = []
        for label, t, row in self._labels:  # ticks first, then the labels on opaque boxes above them
            text = self._text(label, t)
            w = fm.horizontalAdvance(text) + line * 0.3
            cx = x(t)
            y_text = bar_top - line * (1.05 + row)
            p.setPen(QPen(QColor(STAGE_COLOURS.get(label, fg.name())), 2))
            p.drawLine(int(cx), int(y_text), int(cx), int(bar_top + bar_h))
            boxes.append((QRectF(cx - w / 2, y_text - line * 0.85, w, line), text))
        for box, text in boxes:
            p.fillRect(box, bg)
            p.setPen(fg)
            p.drawText(box, Qt.AlignmentFlag.AlignCenter, text)
        cuts = barge_in_times(v)
        if cuts:  # barge-in marks below the bar, then the rollback bar
            started = v.events.get("playback_start")
            stopped = v.barge_in.playback_stopped
            if started is not None and stopped is not None and stopped > started:  # what the user heard
                heard = QColor(STAGE_COLOURS["playing"])
                heard.setAlpha(110)
                p.fillRect(QRectF(x(started), bar_top, x(stopped) - x(started), bar_h), heard)
            y = bar_top + bar_h + line * 0.3
            texts = [self._text(label, t) for label, t in cuts]
            widths = [fm.horizontalAdvance(text) + line * 0.5 for text in texts]
            # left to right without overlap, then shifted back inside the widget if the last one spills
            centres, edge = [], -1e9
            for (_, t), w in zip(cuts, widths):
                cx = max(x(t), edge + w / 2)
                centres.append(cx)
                edge = cx + w / 2
            shift = max(0.0, edge - self.width())
            for (label, t), text, w, cx in zip(cuts, texts, widths, centres):
                cx = max(w / 2, cx - shift)
                p.setPen(QPen(QColor(CUT_COLOUR), 3))
                p.drawLine(int(x(t)), int(bar_top), int(x(t)), int(y + line * 0.3))
                p.setPen(QColor(CUT_COLOUR))
                p.drawText(QRectF(cx - w / 2, y + line * 0.3, w, line), Qt.AlignmentFlag.AlignCenter, text)
            self._paint_rollback(p, v, left, right, y + line * 1.6, line, fg)

    @staticmethod
    def _paint_rollback(p: QPainter, v: TurnView, left: float, right: float, y: float, line: float, fg) -> None:
        b = v.barge_in
        total = b.kept_text_tokens + b.rolled_back_tokens
        if total <= 0:
            return
        width = (right - left) * 0.6
        kept_w = width * b.kept_text_tokens / total
        p.fillRect(QRectF(left, y, kept_w, line), QColor(KEPT_COLOUR))
        p.fillRect(QRectF(left + kept_w, y, width - kept_w, line), QColor(DROPPED_COLOUR))
        p.setPen(fg)
        p.drawRect(QRectF(left, y, width, line))
        p.drawText(QRectF(left + width + line * 0.5, y, right - left - width, line),
                   Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                   f"kept {b.kept_text_tokens} · rolled back {b.rolled_back_tokens} tokens")
