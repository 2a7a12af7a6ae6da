"""The main window: conversation, state, microphone level, controls, pickers, banners.

Threads.  This window only paints and reacts.  Loading a model, listing
devices and checkpoints, starting and closing a session all run on the thread
pool (:func:`.worker.run_in_background`); the engine's updates arrive through
the session's :class:`.bridge.EngineBridge` as queued signals.  Calls into the
session from here (interrupt, mute, push-to-talk, ...) are the session's
"returns at once" setters.  Painting is paced by one 15 Hz timer: updates
only mark things dirty.

Sessions.  :class:`.conversation.Conversation` holds the current session (live
audio, or the sound-file microphone when the input picker says "Sound files"
or live audio is not available).  Changing devices, retrying after an error or
loading another model opens a new one: a new conversation.

Full-duplex models (Moshi) have no turns: the model hears and speaks at once.
The window then shows two lamps (you / the assistant, "muted" after a stop),
the assistant's running text one line per exchange, and the overlay shows the
frame clock.  "Stop reply" and "Interrupt after" do what the duplex engine does
(flush playback, mute the assistant until its text goes quiet); the voice
picker is off (one voice).

Parts.  The window is put together from panels, one module each:
:mod:`.session_view` (opening sessions, the engine's updates, painting),
:mod:`.talk_controls` (mute, stop, push-to-talk, interruption testing),
:mod:`.audio_panel` (devices), :mod:`.model_panel` (model, voice, weights,
server), :mod:`.overlay_control` (the latency overlay, export) and
:mod:`.menus`.  This module lays them out and owns the model's loading: a new
model ends the conversation, and the next one opens when the model is ready.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path

from PySide6.QtCore import QRect, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QLabel, QMainWindow, QProgressBar, QScrollArea, QSplitter, QVBoxLayout, QWidget

from omnidesk.engine.engine import EngineConfig

from . import devices as device_list
from .audio_panel import AudioPanel
from .conversation import Conversation
from .errors import plain_message
from .menus import build_menus
from .model_loader import DEMO, LoadedModel, choose_model, load_model
from .model_panel import CHOOSE_SERVER, ModelPanel
from .overlay_control import OverlayControl
from .session_view import SessionView, default_session_factory, live_audio_available
from .settings import Settings
from .talk_controls import STOP_TIP_DUPLEX, TalkControls
from .transcript import TranscriptView
from .widgets import Banner
from .worker import run_in_background

# importable from here as before: the model picker's server item, the stop button's duplex tip
__all__ = ["MainWindow", "CHOOSE_SERVER", "STOP_TIP_DUPLEX"]

log = logging.getLogger("omnidesk.gui")

PAINT_HZ = 15


class MainWindow(QMainWindow):
    model_loaded = Signal(object)  # LoadedModel
    session_started = Signal(object)  # the session

    def __init__(self, settings: Settings, model: str | None = None, device: str | None = None, *,
                 session_factory=default_session_factory, list_devices=device_list.list_devices,
                 find_models=None, log_path: Path | None = None, live_available: bool | None = None,
                 quantize: str | None = None, compile: str | None = None):
        super().__init__()
        self.settings = settings
        self.requested_model = model  # the command line's --model wins over the remembered one
        if quantize in ("none", "int8"):  # the command line's --quantize wins too, and is remembered
            settings.quantize = quantize
        if compile in ("auto", "on", "off"):  # so does --compile
            settings.compile = compile
        self.device = device
        self.find_models = find_models
        self.log_path = log_path

        self.loaded: LoadedModel | None = None
        self.loading = False
        self._load_id = 0  # the latest load() wins; earlier ones are dropped when they finish
        self.engine_config = EngineConfig(voice=settings.voice)
        self.conversation = Conversation(session_factory, self)
        # the panels, each owning its part of the window (their modules say which)
        self.session_view = SessionView(self, live_audio_available() if live_available is None else live_available)
        self.talk = TalkControls(self)
        self.audio = AudioPanel(self, list_devices)
        self.models = ModelPanel(self)

        self.setWindowTitle("OmniDesk")
        self._build()
        build_menus(self)
        self.talk.hold_space_to_talk()
        self.paint_timer = QTimer(self)
        self.paint_timer.setInterval(1000 // PAINT_HZ)
        self.paint_timer.timeout.connect(self.paint)
        self.paint_timer.start()
        geometry = settings.geometry("main")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1180, 760)

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        central = QWidget()
        outer = QVBoxLayout(central)
        self.demo_banner = Banner("demo")
        self.info_banner = Banner("info")
        self.error_banner = Banner("error")
        for banner in (self.demo_banner, self.error_banner, self.info_banner):
            outer.addWidget(banner)

        self.transcript = TranscriptView()
        font = self.transcript.font()
        font.setPointSizeF(font.pointSizeF() * 1.15)
        self.transcript.setFont(font)

        side = QWidget()
        panel = QVBoxLayout(side)
        self.session_view.add_indicators(panel)
        panel.addWidget(self.talk.conversation_group())
        panel.addWidget(self.audio.group())
        panel.addWidget(self.models.group())
        panel.addWidget(self.talk.testing_group())
        panel.addStretch(1)

        scroll = QScrollArea()  # at 200% scaling the controls may not fit: they scroll, never clip
        scroll.setWidget(side)
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        side.setMinimumWidth(side.sizeHint().width())
        scroll.setMinimumWidth(side.sizeHint().width() + scroll.verticalScrollBar().sizeHint().width() + 4)

        self.splitter = QSplitter()
        self.splitter.addWidget(self.transcript)
        self.splitter.addWidget(scroll)
        self.splitter.setStretchFactor(0, 1)
        self.splitter.setStretchFactor(1, 0)
        outer.addWidget(self.splitter, 1)
        self.setCentralWidget(central)

        self.progress_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy: the loader cannot tell how far it is
        self.progress.setMaximumWidth(self.fontMetrics().horizontalAdvance("M") * 12)
        self.statusBar().addWidget(self.progress_label, 1)
        self.statusBar().addPermanentWidget(self.progress)
        self.progress.hide()
        # Privacy: whenever a server is the model, the window says so, always in view
        self.statusBar().addPermanentWidget(self.models.badge())
        self.models.remote_badge.hide()

        self.overlay_control = OverlayControl(self)

        # the panels' widgets by name on the window, where the other panels and the tests reach them
        v, t, a, m = self.session_view, self.talk, self.audio, self.models
        self.state_indicator, self.duplex_activity, self.level = v.state_indicator, v.duplex_activity, v.level
        self.mode_picker, self.end_of_turn_picker, self.end_of_turn_status = \
            t.mode_picker, t.end_of_turn_picker, t.end_of_turn_status
        self.mute_button, self.stop_button, self.say_button = t.mute_button, t.stop_button, t.say_button
        self.interrupt_ms, self.interrupt_after_button = t.interrupt_ms, t.interrupt_after_button
        self.repeat_button, self.barge_in_counts = t.repeat_button, t.barge_in_counts
        self.input_picker, self.output_picker, self.output_kind = a.input_picker, a.output_picker, a.output_kind
        self.model_picker, self.voice_picker, self.remote_badge = m.model_picker, m.voice_picker, m.remote_badge
        self.weights_picker, self.decode_picker, self.decode_label = m.weights_picker, m.decode_picker, m.decode_label
        self.overlay = self.overlay_control.overlay

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        """Kick off the background work: devices, the model list, the model."""
        self.refresh_devices()
        self.refresh_models()
        self.load(self.requested_model or self.settings.model)
        if self.settings.overlay_visible:
            self.overlay_action.setChecked(True)

    def refresh_devices(self) -> None:
        self.audio.refresh()

    def refresh_models(self) -> None:
        self.models.refresh(self.find_models)

    # ------------------------------------------------------------------ model
    def load(self, source: str | None) -> None:
        """Load ``source`` (None: the best available) in the background; the window stays usable."""
        self.loading = True
        self.error_banner.hide()
        self.remote_badge.hide()  # no model until this one is loaded (a server's shows it again)
        self._set_progress("Looking for models")
        find, device, quantize, compile = self.find_models, self.device, self.settings.quantize, self.settings.compile

        self._load_id += 1
        load_id = self._load_id

        def work(progress):
            progress("Looking for models")
            choice = choose_model(source, find)
            return load_id, load_model(choice, device, progress, quantize=quantize, compile=compile)

        self.conversation.close()
        old, self.loaded = self.loaded, None
        if old is not None:
            run_in_background("freeing the previous model", lambda progress: _free(old))
        run_in_background("loading the model", work, on_done=self._on_model_loaded,
                          on_failed=lambda e: self._on_model_failed(e, load_id), on_progress=self._set_progress)

    def _on_model_loaded(self, result: tuple[int, LoadedModel]) -> None:
        load_id, loaded = result
        if load_id != self._load_id:  # another model was picked meanwhile
            run_in_background("freeing a model nobody wants", lambda progress: _free(loaded))
            return
        self.loading = False
        self._set_progress(None)
        self.loaded = loaded
        self.statusBar().showMessage(f"{loaded.name} ready on {loaded.device} ({loaded.choice.why})", 8000)
        self.setWindowTitle(f"OmniDesk: {loaded.name}")
        if loaded.demo:  # each family's own words: what its demo is, where real weights are
            what, _, rest = loaded.demo_notice.partition(": ")
            self.demo_banner.show_message(f"<b>{html.escape(what)}</b>: {html.escape(rest)}" if rest
                                          else html.escape(what))
        else:
            self.demo_banner.hide()
        # turn-based or full duplex: the controls and the overlay say what they do for this model
        self.duplex_activity.setVisible(loaded.duplex)
        self.overlay.set_duplex(loaded.duplex)
        self.talk.show_model_kind(loaded.duplex)
        self.models.show_loaded(loaded)
        self.model_loaded.emit(loaded)
        self.open_session()

    def _on_model_failed(self, exc: BaseException, load_id: int) -> None:
        if load_id != self._load_id:
            return
        self.loading = False
        self._set_progress(None)
        actions = {"Use the demo model": lambda: self.load(DEMO), "Open the log": self.open_log}
        self.error_banner.show_message(plain_message(exc, "loading the model"), actions)

    @property
    def duplex_model(self) -> bool:
        """A full-duplex model (Moshi) is loaded: no turns, one step per frame."""
        return self.loaded is not None and self.loaded.duplex

    # ------------------------------------------------------------------ session (see session_view)
    @property
    def session(self):
        return self.conversation.session

    @property
    def status(self):
        """The running session's latest status (level, barge-in counts); None before the first."""
        return self.session_view.status

    @property
    def duplex(self):
        """The latest view of a full-duplex conversation (DuplexShown), None otherwise."""
        return self.session_view.duplex

    def open_session(self) -> None:
        self.session_view.open_session()

    def shutdown(self) -> None:
        """At exit, after the window is gone: close the session and wait for it."""
        self.conversation.shutdown()

    def paint(self) -> None:
        self.session_view.paint()

    def display_state(self) -> str:
        return self.session_view.display_state()

    def say_file(self, path: str) -> None:
        self.talk.say_file(path)

    # ------------------------------------------------------------------ overlay, export, log
    def set_overlay_visible(self, visible: bool) -> None:
        self.overlay_control.set_visible(visible)

    def timeline_dict(self) -> dict:
        return self.overlay_control.timeline_dict()

    def export(self, path: str) -> Path | None:
        return self.overlay_control.export(path)

    def open_log(self) -> None:
        if self.log_path is None or not Path(self.log_path).exists():
            self.statusBar().showMessage("No log file yet.", 6000)
            return
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.log_path)))

    def _set_progress(self, text: str | None) -> None:
        if text is None:
            self.progress.hide()
            self.progress_label.clear()
            return
        self.progress.show()
        self.progress_label.setText(text + "…")

    # the panels' handlers, by the names the tests call them on the window
    def _on_model_picked(self, index: int) -> None:
        self.models.pick_model(index)

    def _on_weights_picked(self, index: int) -> None:
        self.models.pick_weights(index)

    def _end_of_turn_in_use(self, session) -> str:
        return self.talk.end_of_turn_in_use(session)

    def _banner_area(self) -> QRect:
        return self.overlay_control.banner_area()

    # ------------------------------------------------------------------ closing
    def closeEvent(self, event):
        self.settings.set_geometry("main", self.saveGeometry())
        self.settings.sync()
        self.overlay_control.window_closing()
        super().closeEvent(event)


def _free(loaded: LoadedModel) -> None:
    """Drop a model and give its GPU memory back (pool thread)."""
    device = loaded.device
    del loaded
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
