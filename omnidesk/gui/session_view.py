"""The window's side of the conversation: opening sessions, hearing the engine, painting what it hears.

:class:`SessionView` owns the session's lifecycle as the window sees it (open one on the loaded model
and the chosen devices, retry after an error, say why one failed or stopped) and the window's picture
of the running conversation: the engine's state, the latest status (microphone level, barge-in
counts), the full-duplex view, and which failed turn the error banner is about.  The engine's updates
only store that picture and mark it dirty; :meth:`SessionView.paint`, on the window's 15 Hz timer,
draws it into the state pill, the duplex lamps, the level meter, the transcript and the overlay.
The session itself and its bridge are :class:`.conversation.Conversation`'s.
"""

from __future__ import annotations

import importlib.util
import time

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QFormLayout, QVBoxLayout

from omnidesk.audio.session import LiveSession, LiveSettings
from omnidesk.engine.engine import TurnState

from .bridge import DuplexShown, TurnView
from .errors import as_sentence, plain_message
from .file_mic import FileMicSession
from .settings import SOUND_FILES, Settings
from .widgets import DuplexActivity, LevelMeter, StateIndicator

INTERRUPTED_FLASH_S = 1.5  # how long "Interrupted" stays up after a cut
DUPLEX_RECOVERED_FRAMES = 13  # a duplex model stepping this many frames (~1 s) after a failure works again
PLACEHOLDERS = {  # the empty conversation says what to do now
    "loading": "Loading the model…",
    "idle": "Not listening yet (see the message above, if any).",
    "muted": "The microphone is muted.",
    "push_to_talk": "Hold Space and say something.",
    "listening": "Say something: OmniDesk is listening.",
}


def live_audio_available() -> bool:
    """sounddevice is there (PortAudio itself is checked when a stream opens)."""
    return importlib.util.find_spec("sounddevice") is not None


def default_session_factory(kind: str, executor, settings, engine_config, on_update, timeline):
    """kind "files": the sound-file microphone; "live": the real devices."""
    if kind == "files":
        return FileMicSession(executor, settings, engine_config, on_update, timeline)
    return LiveSession(executor, settings, engine_config=engine_config, on_update=on_update, timeline=timeline)


def live_settings(settings: Settings) -> LiveSettings:
    """The audio layer's LiveSettings from what the window remembers."""
    return LiveSettings(input_device=settings.input_device if settings.input_device != SOUND_FILES else None,
                        output_device=settings.output_device, headphones=settings.headphones,
                        push_to_talk=settings.push_to_talk, end_of_turn=settings.end_of_turn,
                        turn_complete=settings.turn_complete, turn_incomplete=settings.turn_incomplete,
                        turn_max_wait_ms=settings.turn_max_wait_ms)


class SessionView(QObject):
    """Opens the window's sessions and paints the conversation; ``window`` is the :class:`.main_window.MainWindow`
    (its conversation, loaded model, banners, transcript, overlay and the other panels)."""

    def __init__(self, window, live_available: bool):
        super().__init__(window)
        self.window = window
        self.live_available = live_available
        self.engine_state: TurnState | None = None
        self.status = None
        self._status_dirty = False
        self.duplex: DuplexShown | None = None  # the latest view of a full-duplex conversation
        self._interrupted_until = 0.0
        self._failed_turn: int | None = None  # the turn whose failure the error banner shows
        self._failed_frames: int | None = None  # a duplex model's frame count when a step failed
        conversation = window.conversation
        conversation.started.connect(self._on_started)
        conversation.failed.connect(self._on_failed)
        conversation.stopped.connect(self._on_stopped)
        conversation.state_changed.connect(self._on_state)
        conversation.turn_updated.connect(self._show_turn)
        conversation.turn_interrupted.connect(self._on_interrupted)
        conversation.turn_failed.connect(self._on_turn_failed)
        conversation.status_changed.connect(self._on_status)
        conversation.duplex_changed.connect(self._on_duplex)

    def add_indicators(self, panel: QVBoxLayout) -> None:
        """The top of the side panel: the state pill, the duplex lamps (full-duplex models only), the level."""
        self.state_indicator = StateIndicator()
        panel.addWidget(self.state_indicator)
        self.duplex_activity = DuplexActivity()  # full-duplex models: both sides at once
        self.duplex_activity.hide()
        panel.addWidget(self.duplex_activity)
        self.level = LevelMeter()
        level_row = QFormLayout()
        level_row.addRow("Microphone", self.level)
        panel.addLayout(level_row)

    # ------------------------------------------------------------------ lifecycle
    def session_kind(self) -> str:
        files = self.window.settings.input_device == SOUND_FILES or not self.live_available
        return "files" if files else "live"

    def open_session(self) -> None:
        """(Re)open the conversation on the current model and devices, in the background."""
        w = self.window
        if w.loaded is None or not w.audio.ready_for_session():
            return
        w.error_banner.hide()
        kind = self.session_kind()
        if kind == "files" and not self.live_available:
            w.info_banner.show_message(
                "Live microphone audio is not available in this version yet. Speak to the assistant with sound "
                "files: Conversation ▸ Speak a sound file… (Ctrl+O).")
        else:
            w.info_banner.hide()
        w.transcript.clear_turns()
        w.overlay.clear()
        self.duplex = None
        self.duplex_activity.set_activity(user_speaking=False, assistant_speaking=False, muted=False)
        self.engine_state = None
        self.status = None
        self._status_dirty = True
        w.conversation.open(kind, w.loaded, live_settings(w.settings), w.engine_config)

    def reopen_with(self, setting: str, value) -> None:
        """A setting the session takes when it opens (a device, the end-of-turn detector): a new value is
        remembered and a new session opens with it."""
        if value != getattr(self.window.settings, setting):
            setattr(self.window.settings, setting, value)
            self.open_session()

    def _on_started(self, session) -> None:
        w = self.window
        w.talk.join(session)
        session.set_headphones(w.settings.headphones)
        self.engine_state = TurnState.LISTENING
        w.talk.say_pending(session)
        w.session_started.emit(session)

    def _on_failed(self, exc: BaseException) -> None:
        w = self.window
        self.engine_state = None
        actions = {"Retry": self.open_session}
        if self.session_kind() == "live":
            actions["Use sound files instead"] = w.audio.use_sound_files
        actions["Open the log"] = w.open_log
        w.error_banner.show_message(plain_message(exc, "opening the audio devices"), actions)

    def _on_stopped(self, message: str) -> None:
        self.engine_state = None
        if "out of memory" in message.lower():
            from omnidesk.models.families import SMALLEST_REPO

            message = (f"The GPU ran out of memory during the reply. Pick a smaller model ({SMALLEST_REPO}) "
                       "or close other programs that use the GPU, then Retry")
        self.window.error_banner.show_message(as_sentence(message),
                                              {"Retry": self.retry, "Open the log": self.window.open_log})

    def retry(self) -> None:
        """After a device error: restart the same session (same conversation) where it can, else a new one."""
        self.window.error_banner.hide()
        self.engine_state = None
        if not self.window.conversation.restart():
            self.open_session()

    # ------------------------------------------------------------------ engine updates (UI thread)
    def _on_state(self, state: TurnState) -> None:
        self.engine_state = state

    def _on_interrupted(self, view: TurnView) -> None:
        self._interrupted_until = time.monotonic() + INTERRUPTED_FLASH_S
        self._show_turn(view)

    def _on_turn_failed(self, view: TurnView | None, message: str) -> None:
        """One turn failed (the engine dropped it and listens again): say so, keep the session."""
        if view is not None:
            self._show_turn(view)
        self._failed_turn = view.number if view is not None else 0
        if view is None:  # a duplex step: no turn to wait for, the model's next good frames clear it
            self._failed_frames = self.duplex.view.frames if self.duplex is not None else 0
        self.window.error_banner.show_message(as_sentence(message) + " Details are in the log.",
                                              {"Open the log": self.window.open_log})

    def _on_status(self, status) -> None:
        self.status = status
        self._status_dirty = True

    def repaint_status(self) -> None:
        """The level meter and the counters are drawn again at the next tick (muting greys the meter)."""
        self._status_dirty = True

    def _on_duplex(self, shown: DuplexShown) -> None:
        self.duplex = shown
        # a failed duplex step restarted the model's stream: once it has stepped a second again
        # without failing, the banner has said what it had to
        if self._failed_turn is not None and self._failed_frames is not None \
                and shown.view.frames >= self._failed_frames + DUPLEX_RECOVERED_FRAMES:
            self._failed_turn = self._failed_frames = None
            self.window.error_banner.hide()
        self.window.transcript.show_duplex(shown)
        self.window.overlay.show_duplex(shown)

    def _show_turn(self, view: TurnView) -> None:
        w = self.window
        failed = self._failed_turn
        if failed is not None and view.done and view.number > failed:  # a later turn worked
            self._failed_turn = None
            w.error_banner.hide()
        if view.network and view.network.get("audio_only_at_end"):
            w.models.learn_audio_only_at_end()
        w.transcript.show_turn(view)
        w.overlay.show_turn(view)

    # ------------------------------------------------------------------ painting (15 Hz)
    def paint(self) -> None:
        w = self.window
        state = self.display_state()
        self.state_indicator.set_state(state)
        if self.duplex is not None:
            v = self.duplex.view
            self.duplex_activity.set_activity(v.user_speaking, v.assistant_speaking, v.muted)
        w.transcript.set_placeholder(PLACEHOLDERS.get(state, PLACEHOLDERS["listening"]))
        w.transcript.render()
        if self._status_dirty:
            self._status_dirty = False
            s = self.status
            self.level.set_level(None if s is None else s.level_dbfs)
            if w.talk.muted():
                self.level.set_level(None, "muted")
            if s is not None:
                w.talk.show_counts(s)
            w.overlay.show_status(s)
        if w.overlay.isVisible():
            w.overlay.render()

    def display_state(self) -> str:
        w = self.window
        if w.loading:
            return "loading"
        if w.session is None or self.engine_state is None:
            return "idle"
        if time.monotonic() < self._interrupted_until:
            return "interrupted"
        if w.talk.muted():
            return "muted"
        if w.duplex_model:
            return self._duplex_state()
        state = self.engine_state
        if state in (TurnState.USER_SPEAKING, TurnState.SUSPECTED_BARGE_IN):
            return "user_speaking"
        if state == TurnState.PREEMPTING:
            return "thinking"
        if state == TurnState.RESPONDING:
            current = w.overlay.current
            playing = current is not None and current.events.get("playback_start") is not None
            return "speaking" if playing else "thinking"
        return self._waiting_state()

    def _duplex_state(self) -> str:
        """A full-duplex model: both sides may speak at once; after a stop the assistant is muted."""
        v = self.duplex.view if self.duplex is not None else None
        if v is None:
            return self._waiting_state()
        if v.user_speaking and v.assistant_speaking:
            return "both_speaking"
        if v.user_speaking:
            return "user_speaking"
        if v.muted:
            return "assistant_muted"
        if v.assistant_speaking:
            return "speaking"
        return self._waiting_state()

    def _waiting_state(self) -> str:
        """Nobody speaks: waiting for the user, hands-free or with Space held."""
        return "push_to_talk" if self.window.talk.push_to_talk_on() else "listening"
