"""The talk controls: the "Conversation" and "Interruption testing" groups, and Space for push-to-talk.

:class:`TalkControls` owns what the user does to the running conversation: hands-free or
push-to-talk, which end-of-turn detector, mute, stop the reply, speak a sound file, cut a reply a
set time after it starts, repeat the last question, and the barge-in counters.  Each goes to the
session through its "returns at once" setters; the end-of-turn detector is the session's own, so
changing it opens a new session.  A full-duplex model has stops, not turns: the tooltips and the
counters say so.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import (QAbstractSpinBox, QApplication, QComboBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QTextEdit)

from omnidesk.engine.duplex import SESSION_RATE, session_rate

from .errors import plain_message
from .file_mic import read_sound_file
from .settings import SOUND_FILES
from .widgets import choice_picker, push_button, switch_picker
from .worker import run_in_background

STOP_TIP = "Stop the reply now (Esc): same as cutting in by voice"
STOP_TIP_DUPLEX = ("Stop the assistant now (Esc): what is playing is dropped and it stays muted until it has "
                   "finished the sentence it was saying")
INTERRUPT_AFTER_TIP = "Cut the current or next reply this long after it starts playing"
INTERRUPT_AFTER_TIP_DUPLEX = "Stop the assistant this long after it starts speaking (as Stop reply does)"
END_OF_TURN_ITEMS = (("Auto (model when installed)", "auto"), ("Smart Turn model", "smart"),
                     ("Silence (400 ms)", "fixed"))
END_OF_TURN_TIP = ("When your turn is over. The Smart Turn model listens to how a sentence ends: it answers "
                   "about 200 ms after a finished question and waits through a pause mid-sentence (up to 1.5 s). "
                   "Silence: the turn ends after 400 ms without speech.")


class _SpaceToTalk(QObject):
    """Push-to-talk: Space held anywhere in the app (except while typing in a text field)."""

    def __init__(self, controls: "TalkControls"):
        super().__init__(controls.window)
        self.controls = controls
        self.held = False

    def eventFilter(self, obj, event):
        kind = event.type()
        if kind in (QEvent.Type.KeyPress, QEvent.Type.KeyRelease) and self.controls.push_to_talk_on():
            if event.key() == Qt.Key.Key_Space and not self._typing():
                if not event.isAutoRepeat():
                    self.held = kind == QEvent.Type.KeyPress
                    self.controls.set_talk_pressed(self.held)
                return True  # in push-to-talk mode Space talks; it does not click the focused button
        elif kind == QEvent.Type.ApplicationDeactivate and self.held:
            self.held = False  # the key release will go to another app
            self.controls.set_talk_pressed(False)
        return False

    @staticmethod
    def _typing() -> bool:
        w = QApplication.focusWidget()
        if isinstance(w, (QLineEdit, QAbstractSpinBox)):
            return True
        if isinstance(w, QTextEdit) and not w.isReadOnly():
            return True
        return isinstance(w, QComboBox) and w.isEditable()


class TalkControls(QObject):
    """The controls that act on the session; ``window`` is the :class:`.main_window.MainWindow`."""

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.settings = window.settings
        self._pending_say = None  # audio to say once the sound-file session is up

    # ------------------------------------------------------------------ layout
    def conversation_group(self) -> QGroupBox:
        talk = QGroupBox("Conversation")
        form = QFormLayout(talk)
        self.mode_picker = switch_picker("Hands-free", "Push to talk (hold Space)", self.settings.push_to_talk,
                                         self._on_mode_changed)
        form.addRow("&Mode", self.mode_picker)
        self.end_of_turn_picker = choice_picker(END_OF_TURN_ITEMS, self.settings.end_of_turn,
                                                self._on_end_of_turn_changed, tip=END_OF_TURN_TIP)
        form.addRow("&End of turn", self.end_of_turn_picker)
        self.end_of_turn_status = QLabel("")  # which detector the running session uses, and why
        self.end_of_turn_status.setWordWrap(True)
        form.addRow("", self.end_of_turn_status)
        buttons = QHBoxLayout()
        self.mute_button = QPushButton("M&ute")
        self.mute_button.setCheckable(True)
        self.mute_button.toggled.connect(self._on_mute)
        self.stop_button = push_button("&Stop reply", self.stop_reply, STOP_TIP)
        buttons.addWidget(self.mute_button)
        buttons.addWidget(self.stop_button)
        form.addRow(buttons)
        self.say_button = push_button("Spea&k a sound file…", self.choose_sound_file,
                                      "Play a WAV file into the assistant as if you said it")
        form.addRow(self.say_button)
        return talk

    def testing_group(self) -> QGroupBox:
        testing = QGroupBox("Interruption testing")
        form = QFormLayout(testing)
        row = QHBoxLayout()
        self.interrupt_ms = QSpinBox()
        self.interrupt_ms.setRange(0, 30000)
        self.interrupt_ms.setSingleStep(100)
        self.interrupt_ms.setSuffix(" ms")
        self.interrupt_ms.setValue(self.settings.interrupt_after_ms)
        self.interrupt_ms.setAccessibleName("Interrupt after milliseconds")
        self.interrupt_ms.valueChanged.connect(self._on_interrupt_ms)
        self.interrupt_after_button = push_button("Interrupt &after", self.arm_interrupt_after, INTERRUPT_AFTER_TIP)
        row.addWidget(self.interrupt_after_button)
        row.addWidget(self.interrupt_ms)
        form.addRow(row)
        self.repeat_button = push_button("&Repeat last question", self.repeat_last_question)
        form.addRow(self.repeat_button)
        self.barge_in_counts = QLabel("Barge-ins: 0 confirmed, 0 false")
        self.barge_in_counts.setAccessibleName("Barge-in counters")
        form.addRow(self.barge_in_counts)
        return testing

    def hold_space_to_talk(self) -> None:
        """Space talks in push-to-talk mode, wherever the focus is in the app."""
        self.space = _SpaceToTalk(self)
        QApplication.instance().installEventFilter(self.space)

    # ------------------------------------------------------------------ what the panel shows
    def show_model_kind(self, duplex: bool) -> None:
        """Turn-based or full duplex: the stop controls and the counters say what they do for this model."""
        self.stop_button.setToolTip(STOP_TIP_DUPLEX if duplex else STOP_TIP)
        self.interrupt_after_button.setToolTip(INTERRUPT_AFTER_TIP_DUPLEX if duplex else INTERRUPT_AFTER_TIP)
        self.barge_in_counts.setText("Stops: 0" if duplex else "Barge-ins: 0 confirmed, 0 false")

    def show_counts(self, status) -> None:
        if self.window.duplex_model:  # a duplex model has stops, not voice barge-ins
            self.barge_in_counts.setText(f"Stops: {status.confirmed_barge_ins}")
        else:
            self.barge_in_counts.setText(f"Barge-ins: {status.confirmed_barge_ins} confirmed, "
                                         f"{status.false_barge_ins} false")

    def end_of_turn_in_use(self, session) -> str:
        """The status line under End of turn: the detector this session runs, and why not the model."""
        if self.window.duplex_model:
            return "In use: the model (it decides itself when to talk)"
        detector = getattr(session, "end_of_turn", "fixed")
        if detector != "fixed":
            return "In use: Smart Turn model"
        if self.settings.end_of_turn == "auto":
            from omnidesk.engine.turn_judge import smart_turn_missing

            why = smart_turn_missing()
            if why:
                return f"In use: silence (400 ms). Smart Turn is not available: {why}"
        return "In use: silence (400 ms)"

    # ------------------------------------------------------------------ a session starts
    def join(self, session) -> None:
        """A session has started: it says which end-of-turn detector runs, and gets mute and push-to-talk
        as the controls are now."""
        self.end_of_turn_status.setText(self.end_of_turn_in_use(session))
        session.set_muted(self.muted())
        session.set_push_to_talk(self.push_to_talk_on())

    def say_pending(self, session) -> None:
        """A sound file picked while no session ran is said now."""
        if self._pending_say is not None:
            _speak_into(session, self._pending_say)
            self._pending_say = None

    # ------------------------------------------------------------------ controls
    def muted(self) -> bool:
        return self.mute_button.isChecked()

    def push_to_talk_on(self) -> bool:
        return bool(self.mode_picker.currentData())

    def set_talk_pressed(self, pressed: bool) -> None:
        if self.window.session is not None:
            self.window.session.set_talk_pressed(pressed)

    def _on_mode_changed(self, on: bool) -> None:
        self.settings.push_to_talk = on
        if self.window.session is not None:
            self.window.session.set_push_to_talk(on)

    def _on_end_of_turn_changed(self, index: int) -> None:
        # the endpointer is the session's: a new one decides from now on
        self.window.session_view.reopen_with("end_of_turn", self.end_of_turn_picker.itemData(index))

    def _on_mute(self, muted: bool) -> None:
        self.mute_button.setText("Unm&ute" if muted else "M&ute")
        if self.window.session is not None:
            self.window.session.set_muted(muted)
        self.window.session_view.repaint_status()

    def stop_reply(self) -> None:
        """The stop button / Esc: the same path as a confirmed barge-in."""
        if self.window.session is not None:
            self.window.session.interrupt()

    def arm_interrupt_after(self) -> None:
        session = self.window.session
        if session is None:
            return
        ms = self.interrupt_ms.value()
        session.interrupt_after(ms)
        message = (f"The assistant will be stopped {ms} ms after it starts speaking." if self.window.duplex_model
                   else f"The current or next reply will be cut {ms} ms after it starts playing.")
        self.window.statusBar().showMessage(message, 6000)

    def _on_interrupt_ms(self, value: int) -> None:
        self.settings.interrupt_after_ms = value

    def repeat_last_question(self) -> None:
        session = self.window.session
        if session is None:
            return
        if not session.repeat_last_question():
            self.window.statusBar().showMessage("Nothing to repeat yet: ask something first.", 6000)

    def choose_sound_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, "Speak a sound file", "",
                                              "Sound files (*.wav *.flac *.ogg)")
        if path:
            self.say_file(path)

    def say_file(self, path: str) -> None:
        """Play a sound file into the assistant as the user's voice (mixed into the live microphone, or
        through the sound-file input when there is no live session)."""
        w = self.window
        rate = session_rate(w.loaded.executor) if w.loaded is not None else SESSION_RATE
        run_in_background("reading a sound file", lambda progress: read_sound_file(path, rate),
                          on_done=self._say,
                          on_failed=lambda e: w.error_banner.show_message(
                              plain_message(e, f"reading {Path(path).name}"), {"Open the log": w.open_log}))

    def _say(self, audio) -> None:
        w = self.window
        if w.conversation.running:
            _speak_into(w.session, audio)
            return
        self._pending_say = audio  # said once the session has started
        if w.session is None and w.loaded is not None and self.settings.input_device != SOUND_FILES:
            w.audio.use_sound_files()  # no conversation (no microphone?): the sound-file input needs none


def _speak_into(session, audio) -> None:
    """A sound file as the user's voice: the sound-file session says it; the live one mixes it into the mic."""
    if hasattr(session, "say"):
        session.say(audio)
    else:
        session.inject(audio)
