"""Small widgets of the main window: the state indicator, the microphone level meter, banners, pickers."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QComboBox, QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QSizePolicy

# Display states: (text, colour).  Colours are mid-tones that read on light and dark windows,
# always with white text on top.
STATE_LOOK = {
    "loading": ("Loading model…", "#6b7280"),
    "idle": ("Not listening", "#6b7280"),
    "muted": ("Muted", "#6b7280"),
    "listening": ("Listening", "#2f7d4f"),
    "push_to_talk": ("Hold Space to talk", "#2f7d4f"),
    "user_speaking": ("You're speaking", "#1f6fb2"),
    "thinking": ("Thinking", "#8a5cc2"),
    "speaking": ("Speaking", "#c2621f"),
    "interrupted": ("Interrupted", "#c22f4a"),
    # full-duplex models (Moshi): both sides may talk at once; a stop mutes the assistant for a while
    "both_speaking": ("You're both speaking", "#6a4fb0"),
    "assistant_muted": ("Assistant muted", "#c22f4a"),
}


class StateIndicator(QLabel):
    """A large coloured pill naming what the assistant is doing (text for screen readers too)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setAccessibleName("Assistant state")
        font = self.font()
        font.setPointSizeF(font.pointSizeF() * 1.6)
        font.setBold(True)
        self.setFont(font)
        self.state = ""
        self.set_state("loading")

    def set_state(self, state: str) -> None:
        if state == self.state:
            return
        self.state = state
        text, colour = STATE_LOOK[state]
        self.setText(text)
        self.setAccessibleDescription(text)
        pad = max(4, self.fontMetrics().height() // 3)
        self.setStyleSheet(f"QLabel {{ background: {colour}; color: white; border-radius: {pad * 2}px; "
                           f"padding: {pad}px {pad * 3}px; }}")


def _pill_style(label: QLabel, colour: str) -> str:
    pad = max(3, label.fontMetrics().height() // 4)
    return (f"QLabel {{ background: {colour}; color: white; border-radius: {pad * 2}px; "
            f"padding: {pad}px {pad * 2}px; }}")


# (text, colour) of each lamp state; "quiet" is dim so that a lit lamp stands out on a projector
LAMP_LOOK = {
    ("you", "speaking"): ("You: speaking", "#1f6fb2"),
    ("you", "quiet"): ("You: quiet", "#6b7280"),
    ("assistant", "speaking"): ("Assistant: speaking", "#c2621f"),
    ("assistant", "quiet"): ("Assistant: quiet", "#6b7280"),
    ("assistant", "muted"): ("Assistant: muted", "#c22f4a"),
}


class DuplexActivity(QFrame):
    """Two lamps side by side for a full-duplex model, which hears and speaks at the same time:
    who is speaking now ("You", "Assistant"), and "muted" after a stop.  Hidden for turn-based models."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setAccessibleName("Who is speaking")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.you = QLabel()
        self.assistant = QLabel()
        for lamp in (self.you, self.assistant):
            lamp.setAlignment(Qt.AlignmentFlag.AlignCenter)
            font = lamp.font()
            font.setBold(True)
            lamp.setFont(font)
            layout.addWidget(lamp, 1)
        self.states: dict[str, str] = {}
        self.set_activity(user_speaking=False, assistant_speaking=False, muted=False)

    def set_activity(self, user_speaking: bool, assistant_speaking: bool, muted: bool) -> None:
        you = "speaking" if user_speaking else "quiet"
        assistant = "muted" if muted else ("speaking" if assistant_speaking else "quiet")
        for who, lamp, state in (("you", self.you, you), ("assistant", self.assistant, assistant)):
            if self.states.get(who) == state:
                continue
            self.states[who] = state
            text, colour = LAMP_LOOK[(who, state)]
            lamp.setText(text)
            lamp.setAccessibleName(text)
            lamp.setStyleSheet(_pill_style(lamp, colour))


class LevelMeter(QProgressBar):
    """Microphone level, -60..0 dBFS."""

    FLOOR_DB = -60

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setRange(0, -self.FLOOR_DB)
        self.setAccessibleName("Microphone level")
        self.set_level(None)

    def set_level(self, dbfs: float | None, why: str = "no input") -> None:
        if dbfs is None:
            self.setValue(0)
            self.setFormat(why)
            return
        db = max(self.FLOOR_DB, min(0.0, dbfs))
        self.setValue(int(round(db - self.FLOOR_DB)))
        self.setFormat(f"{db:.0f} dBFS")


BANNER_LOOK = {  # background, text: fixed pairs with enough contrast in either theme
    "demo": ("#fff3c4", "#3d3000"),
    "info": ("#dbeafe", "#0b2e59"),
    "error": ("#fde2e4", "#5c0a14"),
}


class Banner(QFrame):
    """A message strip at the top of the window with optional action buttons."""

    def __init__(self, kind: str, parent=None):
        super().__init__(parent)
        bg, fg = BANNER_LOOK[kind]
        self.kind = kind
        self.setObjectName(f"{kind}Banner")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setAutoFillBackground(True)
        pal = self.palette()
        pal.setColor(QPalette.ColorRole.Window, QColor(bg))
        pal.setColor(QPalette.ColorRole.WindowText, QColor(fg))
        self.setPalette(pal)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self._layout = QHBoxLayout(self)
        self._layout.addWidget(self.label, 1)
        self.buttons: dict[str, QPushButton] = {}
        self.hide()

    def show_message(self, text: str, actions: dict | None = None) -> None:
        """Show ``text`` with buttons {caption: callback}; replaces the previous message."""
        for button in self.buttons.values():
            button.deleteLater()
        self.buttons = {}
        for caption, callback in (actions or {}).items():
            button = QPushButton(caption)
            button.clicked.connect(callback)
            self._layout.addWidget(button)
            self.buttons[caption] = button
        self.label.setText(text)
        self.label.setAccessibleName(text)
        self.show()

    @property
    def text(self) -> str:
        return self.label.text()


def choice_picker(items, current, on_pick, *, name: str | None = None, tip: str | None = None) -> QComboBox:
    """A drop-down of ``items`` ((label, value) pairs) showing the item of value ``current`` (the first
    if none has it); ``on_pick(index)`` runs when the user picks one, not when the code selects one."""
    picker = QComboBox()
    if name:
        picker.setAccessibleName(name)
    for label, value in items:
        picker.addItem(label, value)
    picker.setCurrentIndex(max(0, picker.findData(current)))
    if tip:
        picker.setToolTip(tip)
    picker.activated.connect(on_pick)
    return picker


def switch_picker(off: str, on: str, current: bool, on_change) -> QComboBox:
    """A drop-down for a yes/no setting: item ``off`` (False), item ``on`` (True), showing ``current``;
    ``on_change(bool)`` runs whenever it changes, by the user or the code."""
    picker = QComboBox()
    picker.addItem(off, False)
    picker.addItem(on, True)
    picker.setCurrentIndex(1 if current else 0)
    picker.currentIndexChanged.connect(lambda index: on_change(bool(picker.itemData(index))))
    return picker


def push_button(text: str, on_click, tip: str | None = None) -> QPushButton:
    """A button that calls ``on_click`` when clicked, with ``tip`` as its tooltip."""
    button = QPushButton(text)
    if tip:
        button.setToolTip(tip)
    button.clicked.connect(on_click)
    return button
