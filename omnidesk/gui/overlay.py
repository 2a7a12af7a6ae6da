"""The latency overlay (F2): the current turn's stages, a big voice-to-voice number, live rates,
barge-in costs and the recent turns with median and p90.  Built for a projector: dark,
high-contrast, large type; it floats above the main window (a tool window) and is
slightly transparent where the window system can do it.

For a full-duplex model (Moshi: no turns, one model step per 80 ms frame) it shows the
clock instead (:meth:`LatencyOverlay.set_duplex`): step time p50 / p90 / last against the
frame budget, late and dropped frames, lag behind the microphone, and per exchange the delay
from the end of the user's speech to the start of the assistant's (negative: it started
while the user was still talking).  Whatever says the model is falling behind is red."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from .bridge import DuplexShown, TurnView
from .latency import percentile, summary
from .timeline_bar import TimelineBar

RECENT_TURNS = 10  # the table and its median / p90
OPACITY = 0.92
BACKGROUND = QColor(18, 20, 26)
TEXT = QColor(242, 244, 248)
DIM = QColor(165, 172, 186)
LATE = QColor(255, 92, 92)  # bright on the dark background: readable from the back of a room


def _ms(value_s: float | None) -> str:
    return "–" if value_s is None else f"{value_s * 1000:.0f} ms"


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _signed_ms(value_s: float | None) -> str:
    """A reply delay: negative when the assistant started while the user was still talking."""
    if value_s is None:
        return "–"
    ms = round(value_s * 1000)
    return f"+{ms} ms" if ms > 0 else (f"−{-ms} ms (overlap)" if ms < 0 else "0 ms")


def _over(ms: float | None, budget_ms: float) -> bool:
    return ms is not None and ms > budget_ms


def _paint_value(label: QLabel, text: str, behind: bool) -> None:
    """Red when the number says the model cannot keep up with the microphone (and said in words to a
    screen reader, which sees no colour)."""
    label.setText(text)
    if label.property("behind") != behind:  # restyling is not free: only when it changes
        label.setProperty("behind", behind)
        # both colours explicit: a label whose style sheet is cleared again loses the overlay's palette
        label.setStyleSheet(f"color: {(LATE if behind else TEXT).name()}")
        label.setAccessibleDescription("slower than the frame: falling behind" if behind else "")


# The full-duplex figures: (key, caption), shown in two rows
DUPLEX_FIGURES = ((("p50", "step p50"), ("p90", "step p90"), ("last", "last step"), ("frames", "frames")),
                  (("late", "late frames"), ("dropped", "dropped frames"), ("lag", "lag"),
                   ("delay", "reply delay (last)"), ("delay_median", "reply delay (median)")))


class LatencyOverlay(QWidget):
    export_requested = Signal(str)  # "json" or "csv"

    def __init__(self, parent=None):
        super().__init__(parent, Qt.WindowType.Tool)
        self.setWindowTitle("OmniDesk latency")
        self.setAccessibleName("Latency overlay")
        self.setWindowOpacity(OPACITY)
        self.setAutoFillBackground(True)
        pal = self.palette()
        for group in (QPalette.ColorGroup.Active, QPalette.ColorGroup.Inactive):
            pal.setColor(group, QPalette.ColorRole.Window, BACKGROUND)
            pal.setColor(group, QPalette.ColorRole.WindowText, TEXT)
            pal.setColor(group, QPalette.ColorRole.ButtonText, TEXT)
            pal.setColor(group, QPalette.ColorRole.Button, BACKGROUND.lighter(160))
            pal.setColor(group, QPalette.ColorRole.Text, TEXT)
        self.setPalette(pal)
        font = self.font()
        font.setPointSizeF(font.pointSizeF() * 1.35)
        self.setFont(font)

        self.turns: dict[int, TurnView] = {}
        self.status = None
        self._dirty = True

        self.turn_label = QLabel("No turn yet")
        self.v2v_caption = QLabel("voice-to-voice")
        self.v2v_caption.setStyleSheet(f"color: {DIM.name()}")
        self.v2v = QLabel("–")
        big = self.font()
        big.setPointSizeF(big.pointSizeF() * 3.2)
        big.setBold(True)
        self.v2v.setFont(big)
        self.v2v.setAccessibleName("Voice-to-voice latency")
        self.v2v.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.v2v.setMinimumWidth(self.v2v.fontMetrics().horizontalAdvance("00000 ms"))
        self.v2v_caption.setAlignment(Qt.AlignmentFlag.AlignRight)
        self.end_of_turn = QLabel("")  # what ended the user's turn (the end-of-turn model's verdict)
        self.end_of_turn.setStyleSheet(f"color: {DIM.name()}")
        self.end_of_turn.setAccessibleName("End of turn")
        title = QVBoxLayout()
        title.setSpacing(0)
        title.addWidget(self.turn_label)
        title.addWidget(self.end_of_turn)
        head = QHBoxLayout()
        head.addLayout(title)
        head.addStretch(1)
        number = QVBoxLayout()
        number.setSpacing(0)
        number.addWidget(self.v2v_caption)
        number.addWidget(self.v2v)
        head.addLayout(number)

        self.bar = TimelineBar()

        self.rates: dict[str, QLabel] = {}
        rates = QGridLayout()
        names = (("thinker", "thinker tok/s"), ("talker", "talker tok/s"), ("rtf", "vocoder RTF"),
                 ("buffer", "playback buffer"), ("underruns", "underruns"))
        for col, (key, caption) in enumerate(names):
            self.rates[key] = self._figure(rates, 0, col, caption)

        # full-duplex models: the clock (shown instead of the turn's stages, rates and table)
        self.duplex_values: dict[str, QLabel] = {}
        figures = QGridLayout()
        for row, line in enumerate(DUPLEX_FIGURES):
            for col, (key, caption) in enumerate(line):
                self.duplex_values[key] = self._figure(figures, 2 * row, col, caption)
        self.duplex_note = QLabel()
        self.duplex_note.setWordWrap(True)
        self.duplex_note.setStyleSheet(f"color: {DIM.name()}")
        self.duplex_panel = QWidget()
        duplex_layout = QVBoxLayout(self.duplex_panel)
        duplex_layout.setContentsMargins(0, 0, 0, 0)
        duplex_layout.addLayout(figures)
        duplex_layout.addWidget(self.duplex_note)
        duplex_layout.addStretch(1)
        self.duplex_panel.hide()
        self.duplex = False
        self.duplex_shown: DuplexShown | None = None

        self.barge_ins = QLabel()
        self.barge_ins.setAccessibleName("Barge-ins")
        self.recent = QLabel()
        self.recent.setTextFormat(Qt.TextFormat.RichText)
        self.recent.setAccessibleName("Recent turns")
        self.recent.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)

        self.export_json = QPushButton("Export &JSON…")
        self.export_csv = QPushButton("Export &CSV…")
        self.close_button = QPushButton("Close (F2)")
        self.export_json.clicked.connect(lambda: self.export_requested.emit("json"))
        self.export_csv.clicked.connect(lambda: self.export_requested.emit("csv"))
        self.close_button.clicked.connect(self.hide)
        buttons = QHBoxLayout()
        buttons.addWidget(self.export_json)
        buttons.addWidget(self.export_csv)
        buttons.addStretch(1)
        buttons.addWidget(self.close_button)

        self.turn_panel = QWidget()  # what only turn-based models have
        turn_layout = QVBoxLayout(self.turn_panel)
        turn_layout.setContentsMargins(0, 0, 0, 0)
        turn_layout.addWidget(self.bar)
        self.network = QLabel()  # a remote model: the server's and the network's share of the wait
        self.network.setWordWrap(True)
        self.network.setAccessibleName("Network")
        self.network.hide()
        turn_layout.addWidget(self.network)
        turn_layout.addLayout(rates)

        layout = QVBoxLayout(self)
        layout.addLayout(head)
        layout.addWidget(self.turn_panel)
        layout.addWidget(self.duplex_panel, 1)
        layout.addWidget(self.barge_ins)
        layout.addWidget(self.recent, 1)
        layout.addLayout(buttons)
        self.resize(1100, 640)
        self.render()

    def _figure(self, grid: QGridLayout, row: int, col: int, caption: str) -> QLabel:
        """A dim caption over a large bold value; returns the value's label."""
        cap = QLabel(caption)
        cap.setStyleSheet(f"color: {DIM.name()}")
        value = QLabel("–")
        value_font = self.font()
        value_font.setPointSizeF(value_font.pointSizeF() * 1.4)
        value_font.setBold(True)
        value.setFont(value_font)
        value.setAccessibleName(caption)
        grid.addWidget(cap, row, col)
        grid.addWidget(value, row + 1, col)
        return value

    # ------------------------------------------------------------------ data in (UI thread)
    def set_duplex(self, duplex: bool) -> None:
        """Show the full-duplex clock (True) or the turn-based stages (False), for the model loaded."""
        self.duplex = duplex
        self.turn_panel.setVisible(not duplex)
        self.recent.setVisible(not duplex)
        self.duplex_panel.setVisible(duplex)
        self.v2v_caption.setText("step time p50" if duplex else "voice-to-voice")
        self._dirty = True

    def show_duplex(self, shown: DuplexShown) -> None:
        self.duplex_shown = shown
        self._dirty = True

    def show_turn(self, view: TurnView) -> None:
        old = self.turns.get(view.number)
        if old is not None and (old.done or old.interrupted) and not (view.done or view.interrupted):
            return
        self.turns[view.number] = view
        self._dirty = True

    def show_status(self, status) -> None:
        self.status = status
        self._dirty = True

    def clear(self) -> None:
        self.turns.clear()
        self.status = None
        self.duplex_shown = None
        self._dirty = True

    @property
    def current(self) -> TurnView | None:
        return self.turns[max(self.turns)] if self.turns else None

    # ------------------------------------------------------------------ painting
    def render(self) -> bool:
        if not self._dirty:
            return False
        self._dirty = False
        if self.duplex:
            self._render_duplex()
            return True
        cur = self.current
        self.bar.set_turn(cur)
        if cur is None:
            self.turn_label.setText("No turn yet: say something")
            self.end_of_turn.setText("")
            self.v2v.setText("–")
        else:
            state = "cut" if cur.interrupted else ("done" if cur.done else "in progress")
            self.turn_label.setText(f"Turn {cur.number} ({state})")
            self.end_of_turn.setText(cur.end_of_turn_text or "")
            # while a reply is being prepared, keep the previous turn's number: an empty number flickers
            shown = cur if cur.voice_to_voice_s is not None else self._last_measured()
            self.v2v.setText(_ms(shown.voice_to_voice_s) if shown else "–")
        network = cur.network_text if cur is not None else None
        self.network.setVisible(bool(network))
        self.network.setText(network or "")
        s = self.status
        # a remote model's stages run on the server: the step times here are network waits, not its rates
        rates = None if network else s
        self.rates["thinker"].setText(_num(getattr(rates, "thinker_tok_s", None), ".0f"))
        self.rates["talker"].setText(_num(getattr(rates, "talker_tok_s", None), ".0f"))
        self.rates["rtf"].setText(_num(getattr(rates, "vocoder_rtf", None), ".2f"))
        self.rates["buffer"].setText(_num(getattr(s, "playback_buffer_ms", None), ".0f") +
                                     (" ms" if s is not None else ""))
        self.rates["underruns"].setText(_num(getattr(s, "underruns", None), "d"))
        self.barge_ins.setText(self._barge_in_text())
        self.recent.setText(self._recent_html())
        return True

    def _render_duplex(self) -> None:
        v = self.duplex_shown.view if self.duplex_shown is not None else None
        values = self.duplex_values
        self.end_of_turn.setText("")  # a duplex model has no turns to end
        if v is None:
            self.turn_label.setText("Full duplex: say something")
            self.v2v_caption.setText("step time p50")
            for label in (self.v2v, *values.values()):
                _paint_value(label, "–", False)
        else:
            budget_ms = v.frame_s * 1000.0
            self.turn_label.setText(f"Full duplex: {v.frames} frames of {budget_ms:.0f} ms")
            self.v2v_caption.setText(f"step time p50 (frame budget {budget_ms:.0f} ms)")
            p50 = v.step_ms_p50
            _paint_value(self.v2v, _num(p50, ".0f") + (" ms" if p50 is not None else ""), _over(p50, budget_ms))
            for key, ms in (("p50", p50), ("p90", v.step_ms_p90), ("last", v.last_step_ms)):
                _paint_value(values[key], _num(ms, ".1f") + (" ms" if ms is not None else ""), _over(ms, budget_ms))
            _paint_value(values["frames"], str(v.frames), False)
            _paint_value(values["late"], str(v.late_frames), v.late_frames > 0)
            _paint_value(values["dropped"], str(v.dropped_frames), v.dropped_frames > 0)
            _paint_value(values["lag"], f"{v.lag_s:.2f} s", v.lag_s > v.frame_s)
            _paint_value(values["delay"], _signed_ms(v.last_delay_s), False)
            median = percentile(list(v.delays_s), 50)
            n = len(v.delays_s)
            _paint_value(values["delay_median"],
                         _signed_ms(median) + (f" ({n} exchange{'s' if n > 1 else ''})" if n else ""), False)
        self.duplex_note.setText(
            "One model step per frame: a step slower than the frame (red) makes the model fall behind the "
            "microphone, and the oldest input frames are then dropped. Reply delay: from the end of your speech "
            "to the start of the assistant's; negative when it started while you were still talking.")
        stops = getattr(self.status, "confirmed_barge_ins", None)
        muted = "   ·   assistant muted (stopped)" if v is not None and v.muted else ""
        self.barge_ins.setText(f"Stops: {_num(stops, 'd')}{muted}")

    def _last_measured(self) -> TurnView | None:
        for n in sorted(self.turns, reverse=True):
            if self.turns[n].voice_to_voice_s is not None:
                return self.turns[n]
        return None

    def _barge_in_text(self) -> str:
        s = self.status
        confirmed = getattr(s, "confirmed_barge_ins", None)
        false = getattr(s, "false_barge_ins", None)
        if confirmed is None:
            confirmed = sum(1 for v in self.turns.values() if v.interrupted)
        parts = [f"Barge-ins: {confirmed} confirmed, {_num(false, 'd')} false"]
        cut = next((self.turns[n] for n in sorted(self.turns, reverse=True) if self.turns[n].interrupted), None)
        if cut is not None:
            b = cut.barge_in
            parts.append(f"last (turn {cut.number}): stopped in {_ms(cut.stop_s)}, "
                         f"kept {b.kept_text_tokens} / rolled back {b.rolled_back_tokens} tokens")
        return "   ·   ".join(parts)

    def _recent_html(self) -> str:
        views = [self.turns[n] for n in sorted(self.turns)]
        if not views:
            return ""
        dim = DIM.name()
        rows = [f"<tr style='color:{dim}'><th align=left>turn</th><th align=right>voice-to-voice</th>"
                f"<th align=right>endpoint → playing</th><th align=right>stop</th>"
                f"<th align=left>&nbsp;&nbsp;rollback</th></tr>"]
        for v in views[-RECENT_TURNS:]:
            ep = None
            if v.endpoint is not None and v.events.get("playback_start") is not None:
                ep = v.events["playback_start"] - v.endpoint
            rb = (f"kept {v.barge_in.kept_text_tokens}, dropped {v.barge_in.rolled_back_tokens}"
                  if v.barge_in is not None else "")
            rows.append(f"<tr><td>{v.number}</td><td align=right>{_ms(v.voice_to_voice_s)}</td>"
                        f"<td align=right>{_ms(ep)}</td><td align=right>{_ms(v.stop_s)}</td>"
                        f"<td>&nbsp;&nbsp;{html.escape(rb)}</td></tr>")
        s = summary(views, last=RECENT_TURNS)
        med, p90 = s["voice_to_voice_median_ms"], s["voice_to_voice_p90_ms"]
        line = (f"<p>voice-to-voice over the last {s['turns']} turns: median <b>{_num(med, '.0f')} ms</b>, "
                f"p90 <b>{_num(p90, '.0f')} ms</b>")
        if s["stop_median_ms"] is not None:
            line += f" · stop median {s['stop_median_ms']:.0f} ms, p90 {s['stop_p90_ms']:.0f} ms"
        return f"<table cellspacing=6>{''.join(rows)}</table>{line}</p>"
