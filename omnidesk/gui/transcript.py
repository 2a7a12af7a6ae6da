"""The conversation: user turns, the assistant's text as it streams, cut replies with the unheard rest greyed out.

A full-duplex model (Moshi) has no turns: the page is then one line per
exchange, "You" when the user started speaking and "OmniDesk" with the words the
assistant said from then on, growing while it talks (:meth:`TranscriptView.show_duplex`)."""

from __future__ import annotations

import html

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QTextBrowser

from .bridge import DuplexShown, TurnView

DUPLEX_LINES = 40  # a duplex conversation can run for hours: the page shows the latest exchanges


class TranscriptView(QTextBrowser):
    """Read-only, selectable, screen-reader friendly (plain rich text).  Call :meth:`show_turn`
    with each new TurnView, then :meth:`render` (the window does it at most ~15 times a second)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setAccessibleName("Conversation")
        self.turns: dict[int, TurnView] = {}
        self.duplex: DuplexShown | None = None
        self.placeholder = "Say something: OmniDesk is listening."
        self._dirty = True

    def show_turn(self, view: TurnView) -> None:
        old = self.turns.get(view.number)
        if old is not None and (old.done or old.interrupted or old.failed) \
                and not (view.done or view.interrupted or view.failed):
            return  # a late streaming update must not undo the final state
        self.turns[view.number] = view
        self._dirty = True

    def show_duplex(self, shown: DuplexShown) -> None:
        """The latest state of a full-duplex conversation (replaces the previous one)."""
        self.duplex = shown
        self._dirty = True

    def clear_turns(self) -> None:
        self.turns.clear()
        self.duplex = None
        self._dirty = True

    def set_placeholder(self, text: str) -> None:
        if text != self.placeholder:
            self.placeholder = text
            self._dirty = True

    def changeEvent(self, event):  # light/dark switch: colours come from the palette
        super().changeEvent(event)
        self._dirty = True

    def render(self) -> bool:
        """Rebuild the page if something changed; keeps the view at the bottom if it was there."""
        if not self._dirty:
            return False
        self._dirty = False
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.setHtml(self.to_html())
        if at_bottom:
            bar.setValue(bar.maximum())
        return True

    def to_html(self) -> str:
        pal = self.palette()
        muted = _blend(pal.color(QPalette.ColorRole.Text), pal.color(QPalette.ColorRole.Base)).name()
        accent = pal.color(QPalette.ColorRole.Highlight).name()
        if self.duplex is not None and self.duplex.lines:
            return self._duplex_html(self.duplex, muted, accent)
        if not self.turns:
            return f"<p style='color:{muted}'>{html.escape(self.placeholder)}</p>"
        parts = []
        for number in sorted(self.turns):
            parts.append(self._turn_html(self.turns[number], muted, accent))
        return "".join(parts)

    @staticmethod
    def _turn_html(v: TurnView, muted: str, accent: str) -> str:
        said = v.user_speech_s
        you = f"spoke for {said:.1f} s" if said is not None else "speaking…"
        out = [f"<p><b style='color:{accent}'>You</b> <span style='color:{muted}'>({you})</span></p>"]
        if not v.text and not v.interrupted and not v.failed and v.user_speech_end is None:
            return "".join(out)
        out.append("<p style='margin-left:1em'><b>OmniDesk</b><br>")
        if v.failed:
            if v.text:
                out.append(f"<span style='color:{muted}; text-decoration:line-through'>{html.escape(v.text)}</span><br>")
            out.append(f"<i style='color:{muted}'>⚠ {html.escape(v.failed)}. This turn was dropped; "
                       f"say it again.</i>")
        elif v.interrupted:
            heard = v.heard_text or ""
            rest = v.discarded_text if heard else v.text
            out.append(html.escape(heard))
            if rest:
                out.append(f"<span style='color:{muted}; text-decoration:line-through'>{html.escape(rest)}</span>")
            b = v.barge_in
            note = f"you cut in after {b.heard_audio_s:.1f} s: {b.kept_text_tokens} tokens kept, " \
                   f"{b.rolled_back_tokens} rolled back"
            out.append(f"<br><i style='color:{muted}'>✂ {note}</i>")
        elif v.text:
            out.append(html.escape(v.text) + ("" if v.done else " …"))
        else:
            out.append(f"<i style='color:{muted}'>thinking…</i>")
        out.append("</p>")
        return "".join(out)

    @staticmethod
    def _duplex_html(shown: DuplexShown, muted: str, accent: str) -> str:
        v = shown.view
        lines = shown.line_texts(last=DUPLEX_LINES)
        out = []
        if len(shown.lines) > len(lines):
            out.append(f"<p style='color:{muted}'>… {len(shown.lines) - len(lines)} earlier lines</p>")
        last_you = max((i for i, (who, _) in enumerate(lines) if who == "you"), default=None)
        last_assistant = max((i for i, (who, _) in enumerate(lines) if who == "assistant"), default=None)
        for i, (who, text) in enumerate(lines):
            if who == "you":
                now = "speaking…" if i == last_you and v.user_speaking else "spoke"
                out.append(f"<p><b style='color:{accent}'>You</b> <span style='color:{muted}'>({now})</span></p>")
                continue
            talking = i == last_assistant and v.assistant_speaking
            words = html.escape(text) if text else f"<i style='color:{muted}'>(no words{' yet' if talking else ''})</i>"
            out.append(f"<p style='margin-left:1em'><b>OmniDesk</b><br>{words}{' …' if talking else ''}</p>")
        if v.muted:
            out.append(f"<p style='margin-left:1em'><i style='color:{muted}'>Stopped: the assistant is muted "
                       f"until it ends the sentence it was saying</i></p>")
        return "".join(out)


def _blend(a: QColor, b: QColor, f: float = 0.5) -> QColor:
    """Halfway between text and background: readable, clearly secondary, in light and dark themes."""
    return QColor(int(a.red() * f + b.red() * (1 - f)), int(a.green() * f + b.green() * (1 - f)),
                  int(a.blue() * f + b.blue() * (1 - f)))
