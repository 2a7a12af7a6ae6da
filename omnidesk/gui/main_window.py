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
"""

from __future__ import annotations

import html
import importlib.util
import logging
import time
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QPoint, QRect, QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QAction, QDesktopServices, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (QAbstractSpinBox, QComboBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout,
                               QInputDialog, QLabel, QLineEdit, QMainWindow, QProgressBar, QPushButton, QScrollArea,
                               QSpinBox, QSplitter, QTextEdit, QVBoxLayout, QWidget)

from omnidesk.audio.session import LiveSession, LiveSettings
from omnidesk.engine.duplex import SESSION_RATE, session_rate
from omnidesk.engine.engine import EngineConfig, TurnState

from . import devices as device_list
from .bridge import DuplexShown, TurnView
from .conversation import Conversation
from .errors import as_sentence, plain_message
from .file_mic import FileMicSession, read_sound_file
from .latency import export_timeline
from .model_loader import DEMO, CatalogEntry, LoadedModel, ModelChoice, catalog, choose_model, load_model
from .overlay import LatencyOverlay
from .settings import SOUND_FILES, Settings
from .transcript import TranscriptView
from .widgets import Banner, DuplexActivity, LevelMeter, StateIndicator
from .worker import run_in_background

log = logging.getLogger("omnidesk.gui")

PAINT_HZ = 15
INTERRUPTED_FLASH_S = 1.5  # how long "Interrupted" stays up after a cut
DUPLEX_RECOVERED_FRAMES = 13  # a duplex model stepping this many frames (~1 s) after a failure works again
CHOOSE_FOLDER = "\x00choose-folder"  # model picker item that opens a folder dialog
CHOOSE_SERVER = "\x00choose-server"  # model picker item that asks for a vLLM-Omni server's URL (omnidesk.remote)
REMOTE_BADGE_STYLE = "background: #b3261e; color: white; font-weight: bold; padding: 2px 8px; border-radius: 3px"
STOP_TIP = "Stop the reply now (Esc): same as cutting in by voice"
END_OF_TURN_ITEMS = (("Auto (model when installed)", "auto"), ("Smart Turn model", "smart"),
                     ("Silence (400 ms)", "fixed"))
END_OF_TURN_TIP = ("When your turn is over. The Smart Turn model listens to how a sentence ends: it answers "
                   "about 200 ms after a finished question and waits through a pause mid-sentence (up to 1.5 s). "
                   "Silence: the turn ends after 400 ms without speech.")
STOP_TIP_DUPLEX = ("Stop the assistant now (Esc): what is playing is dropped and it stays muted until it has "
                   "finished the sentence it was saying")
INTERRUPT_AFTER_TIP = "Cut the current or next reply this long after it starts playing"
INTERRUPT_AFTER_TIP_DUPLEX = "Stop the assistant this long after it starts speaking (as Stop reply does)"
WEIGHTS_TIP = ("int8: the thinker's linears are quantized to int8 while loading; a GPTQ/AWQ checkpoint runs 4-bit "
               "either way. Reloads the model.")
PLACEHOLDERS = {  # the empty conversation says what to do now
    "loading": "Loading the model…",
    "idle": "Not listening yet (see the message above, if any).",
    "muted": "The microphone is muted.",
    "push_to_talk": "Hold Space and say something.",
    "listening": "Say something: OmniDesk is listening.",
}
DECODE_TIP = ("How the model's decode steps run. Automatic: captured as CUDA graphs on a GPU (several times faster "
              "than eager), eager on the CPU unless compiling pays there. Compiled: torch.compile on the CPU, CUDA "
              "graphs on a GPU; compiling runs in the background while you talk and is cached on disk. Eager: no "
              "compiling.")


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


class _SpaceToTalk(QObject):
    """Push-to-talk: Space held anywhere in the app (except while typing in a text field)."""

    def __init__(self, window: "MainWindow"):
        super().__init__(window)
        self.window = window
        self.held = False

    def eventFilter(self, obj, event):
        kind = event.type()
        if kind in (QEvent.Type.KeyPress, QEvent.Type.KeyRelease) and self.window.push_to_talk_on():
            if event.key() == Qt.Key.Key_Space and not self._typing():
                if not event.isAutoRepeat():
                    self.held = kind == QEvent.Type.KeyPress
                    self.window.set_talk_pressed(self.held)
                return True  # in push-to-talk mode Space talks; it does not click the focused button
        elif kind == QEvent.Type.ApplicationDeactivate and self.held:
            self.held = False  # the key release will go to another app
            self.window.set_talk_pressed(False)
        return False

    @staticmethod
    def _typing() -> bool:
        from PySide6.QtWidgets import QApplication

        w = QApplication.focusWidget()
        if isinstance(w, (QLineEdit, QAbstractSpinBox)):
            return True
        if isinstance(w, QTextEdit) and not w.isReadOnly():
            return True
        return isinstance(w, QComboBox) and w.isEditable()



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
        self.list_devices = list_devices
        self.find_models = find_models
        self.log_path = log_path
        self.live_available = live_audio_available() if live_available is None else live_available

        self.loaded: LoadedModel | None = None
        self.conversation = Conversation(session_factory, self)
        self.conversation.started.connect(self._on_session_started)
        self.conversation.failed.connect(self._on_session_failed)
        self.conversation.stopped.connect(self._on_session_stopped)
        self.conversation.state_changed.connect(self._on_state)
        self.conversation.turn_updated.connect(self._show_turn)
        self.conversation.turn_interrupted.connect(self._on_interrupted)
        self.conversation.turn_failed.connect(self._on_turn_failed)
        self.conversation.status_changed.connect(self._on_status)
        self.conversation.duplex_changed.connect(self._on_duplex)
        self.engine_config = EngineConfig(voice=settings.voice)
        self.loading = False
        self.engine_state: TurnState | None = None
        self.status = None
        self._status_dirty = False
        self.duplex: DuplexShown | None = None  # the latest view of a full-duplex conversation
        self._interrupted_until = 0.0
        self._failed_turn: int | None = None  # the turn whose failure the error banner shows
        self._failed_frames: int | None = None  # a duplex model's frame count when a step failed
        self._pending_say = None  # audio to say once the sound-file session is up
        self._catalog: list[CatalogEntry] = []
        self._closing = False
        self._devices_listed = True
        self._open_when_listed = False
        self._load_id = 0  # the latest load() wins; earlier ones are dropped when they finish

        self.setWindowTitle("OmniDesk")
        self._build()
        self._build_menus()
        self.space = _SpaceToTalk(self)
        from PySide6.QtWidgets import QApplication

        QApplication.instance().installEventFilter(self.space)
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
        self.state_indicator = StateIndicator()
        panel.addWidget(self.state_indicator)
        self.duplex_activity = DuplexActivity()  # full-duplex models: both sides at once
        self.duplex_activity.hide()
        panel.addWidget(self.duplex_activity)
        self.level = LevelMeter()
        level_row = QFormLayout()
        level_row.addRow("Microphone", self.level)
        panel.addLayout(level_row)

        talk = QGroupBox("Conversation")
        form = QFormLayout(talk)
        self.mode_picker = QComboBox()
        self.mode_picker.addItem("Hands-free", False)
        self.mode_picker.addItem("Push to talk (hold Space)", True)
        self.mode_picker.setCurrentIndex(1 if self.settings.push_to_talk else 0)
        self.mode_picker.currentIndexChanged.connect(self._on_mode_changed)
        form.addRow("&Mode", self.mode_picker)
        self.end_of_turn_picker = QComboBox()
        for label, value in END_OF_TURN_ITEMS:
            self.end_of_turn_picker.addItem(label, value)
        self.end_of_turn_picker.setCurrentIndex(max(0, self.end_of_turn_picker.findData(self.settings.end_of_turn)))
        self.end_of_turn_picker.setToolTip(END_OF_TURN_TIP)
        self.end_of_turn_picker.activated.connect(self._on_end_of_turn_changed)
        form.addRow("&End of turn", self.end_of_turn_picker)
        self.end_of_turn_status = QLabel("")  # which detector the running session uses, and why
        self.end_of_turn_status.setWordWrap(True)
        form.addRow("", self.end_of_turn_status)
        buttons = QHBoxLayout()
        self.mute_button = QPushButton("M&ute")
        self.mute_button.setCheckable(True)
        self.mute_button.toggled.connect(self._on_mute)
        self.stop_button = QPushButton("&Stop reply")
        self.stop_button.setToolTip(STOP_TIP)
        self.stop_button.clicked.connect(self.stop_reply)
        buttons.addWidget(self.mute_button)
        buttons.addWidget(self.stop_button)
        form.addRow(buttons)
        self.say_button = QPushButton("Spea&k a sound file…")
        self.say_button.setToolTip("Play a WAV file into the assistant as if you said it")
        self.say_button.clicked.connect(self.choose_sound_file)
        form.addRow(self.say_button)
        panel.addWidget(talk)

        audio = QGroupBox("Audio")
        form = QFormLayout(audio)
        self.input_picker = QComboBox()
        self.output_picker = QComboBox()
        self.input_picker.setAccessibleName("Input device")
        self.output_picker.setAccessibleName("Output device")
        self._fill_devices([])
        self.input_picker.activated.connect(self._on_input_changed)
        self.output_picker.activated.connect(self._on_output_changed)
        form.addRow("&Input", self.input_picker)
        form.addRow("&Output", self.output_picker)
        self.output_kind = QComboBox()
        self.output_kind.addItem("Speakers (echo cancellation on)", False)
        self.output_kind.addItem("Headphones (echo cancellation off)", True)
        self.output_kind.setCurrentIndex(1 if self.settings.headphones else 0)
        self.output_kind.currentIndexChanged.connect(self._on_headphones_changed)
        form.addRow("&Listening on", self.output_kind)
        panel.addWidget(audio)

        model = QGroupBox("Model")
        form = QFormLayout(model)
        self.model_picker = QComboBox()
        self.model_picker.setAccessibleName("Model")
        self.model_picker.activated.connect(self._on_model_picked)
        form.addRow("Mo&del", self.model_picker)
        self.voice_picker = QComboBox()
        self.voice_picker.setAccessibleName("Voice")
        self.voice_picker.activated.connect(self._on_voice_picked)
        form.addRow("Voic&e", self.voice_picker)
        self.weights_picker = QComboBox()  # how the weights are loaded (omnidesk/models/quant.py)
        self.weights_picker.setAccessibleName("Weights")
        self.weights_picker.addItem("As stored (bf16, or the checkpoint's 4-bit)", "none")
        self.weights_picker.addItem("int8 (about half the GPU memory)", "int8")
        self.weights_picker.setCurrentIndex(max(0, self.weights_picker.findData(self.settings.quantize)))
        self.weights_picker.setToolTip(WEIGHTS_TIP)
        self.weights_picker.activated.connect(self._on_weights_picked)
        form.addRow("&Weights", self.weights_picker)
        self.decode_picker = QComboBox()  # how the decode steps run (omnidesk/models/runner.py)
        self.decode_picker.setAccessibleName("Decode steps")
        self.decode_picker.addItem("Automatic (CUDA graphs on a GPU)", "auto")
        self.decode_picker.addItem("Compiled / CUDA graphs", "on")
        self.decode_picker.addItem("Eager (no compiling)", "off")
        self.decode_picker.setCurrentIndex(max(0, self.decode_picker.findData(self.settings.compile)))
        self.decode_picker.setToolTip(DECODE_TIP)
        self.decode_picker.activated.connect(self._on_decode_picked)
        form.addRow("Deco&de steps", self.decode_picker)
        self.decode_label = QLabel()  # which mode runs now, and how far compiling is
        self.decode_label.setAccessibleName("Decode mode")
        self.decode_label.setWordWrap(True)
        form.addRow("", self.decode_label)
        panel.addWidget(model)

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
        self.interrupt_after_button = QPushButton("Interrupt &after")
        self.interrupt_after_button.setToolTip(INTERRUPT_AFTER_TIP)
        self.interrupt_after_button.clicked.connect(self.arm_interrupt_after)
        row.addWidget(self.interrupt_after_button)
        row.addWidget(self.interrupt_ms)
        form.addRow(row)
        self.repeat_button = QPushButton("&Repeat last question")
        self.repeat_button.clicked.connect(self.repeat_last_question)
        form.addRow(self.repeat_button)
        self.barge_in_counts = QLabel("Barge-ins: 0 confirmed, 0 false")
        self.barge_in_counts.setAccessibleName("Barge-in counters")
        form.addRow(self.barge_in_counts)
        panel.addWidget(testing)
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
        self.remote_badge = QLabel()
        self.remote_badge.setStyleSheet(REMOTE_BADGE_STYLE)
        self.remote_badge.setAccessibleName("Remote model")
        self.statusBar().addPermanentWidget(self.remote_badge)
        self.remote_badge.hide()

        self.overlay = LatencyOverlay(self)
        self.overlay.export_requested.connect(self.choose_export)
        self.overlay.installEventFilter(self)  # remember when the user closes it

    def _build_menus(self) -> None:
        def action(menu, text, slot, shortcut=None, checkable=False, app_wide=False) -> QAction:
            a = QAction(text, self)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
                if app_wide:  # also while the overlay has the focus
                    a.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
            a.setCheckable(checkable)
            (a.toggled if checkable else a.triggered).connect(slot)
            menu.addAction(a)
            return a

        bar = self.menuBar()
        file = bar.addMenu("&File")
        action(file, "Export timeline as &JSON…", lambda: self.choose_export("json"), "Ctrl+E")
        action(file, "Export timeline as &CSV…", lambda: self.choose_export("csv"))
        action(file, "Open the &log file", self.open_log)
        file.addSeparator()
        action(file, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        talk = bar.addMenu("&Conversation")
        self.stop_action = action(talk, "&Stop reply", self.stop_reply, "Esc")
        self.mute_action = action(talk, "&Mute microphone", self.mute_button.setChecked, "Ctrl+M", checkable=True)
        self.mute_button.toggled.connect(self.mute_action.setChecked)
        action(talk, "Speak a sound &file…", self.choose_sound_file, "Ctrl+O")
        action(talk, "&Repeat last question", self.repeat_last_question, "Ctrl+R")
        action(talk, "&Interrupt the reply after the set time", self.arm_interrupt_after, "Ctrl+I")
        view = bar.addMenu("&View")
        self.overlay_action = action(view, "&Latency overlay", self.set_overlay_visible, "F2", checkable=True,
                                     app_wide=True)

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        """Kick off the background work: devices, the model list, the model."""
        self.refresh_devices()
        self.refresh_models()
        self.load(self.requested_model or self.settings.model)
        if self.settings.overlay_visible:
            self.overlay_action.setChecked(True)

    def refresh_devices(self) -> None:
        # Only before a session opens: listing re-initialises PortAudio, which an open stream may not survive.
        self._devices_listed = False

        def done(found):
            self._fill_devices(found)
            self._devices_listed = True
            if self._open_when_listed:
                self._open_when_listed = False
                self.open_session()

        run_in_background("listing audio devices", lambda progress: self.list_devices(),
                          on_done=done, on_failed=lambda e: done([]))

    def refresh_models(self) -> None:
        find = self.find_models
        run_in_background("looking for models", lambda progress: catalog(find),
                          on_done=self._fill_models, on_failed=lambda e: self._fill_models(catalog(lambda: [])))

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
        self.voice_picker.clear()
        for name in loaded.voices:
            self.voice_picker.addItem(name, name)
        # a model with one voice (Moshi) has nothing to pick
        self.voice_picker.setEnabled(bool(loaded.voices))
        self.voice_picker.setToolTip("" if loaded.voices else f"{loaded.family_title} speaks with one voice")
        voice = self.settings.voice if self.settings.voice in loaded.voices else (loaded.voices or [None])[0]
        self.engine_config.voice = voice
        if voice is not None:
            self.voice_picker.setCurrentIndex(loaded.voices.index(voice))
        self._show_model_kind(loaded.duplex)
        self._show_weights_choice(loaded)
        self._show_decode_mode()
        self._show_remote(loaded)
        self._select_model_item(loaded.choice)
        self.model_loaded.emit(loaded)
        self.open_session()

    def _show_model_kind(self, duplex: bool) -> None:
        """Turn-based or full duplex: the controls and the overlay say what they do for this model."""
        self.duplex_activity.setVisible(duplex)
        self.overlay.set_duplex(duplex)
        self.stop_button.setToolTip(STOP_TIP_DUPLEX if duplex else STOP_TIP)
        self.interrupt_after_button.setToolTip(INTERRUPT_AFTER_TIP_DUPLEX if duplex else INTERRUPT_AFTER_TIP)
        self.barge_in_counts.setText("Stops: 0" if duplex else "Barge-ins: 0 confirmed, 0 false")

    def _on_model_failed(self, exc: BaseException, load_id: int) -> None:
        if load_id != self._load_id:
            return
        self.loading = False
        self._set_progress(None)
        actions = {"Use the demo model": lambda: self.load(DEMO), "Open the log": self.open_log}
        self.error_banner.show_message(plain_message(exc, "loading the model"), actions)

    def _fill_models(self, entries: list[CatalogEntry]) -> None:
        self._catalog = entries
        self.model_picker.clear()
        for e in entries:
            self.model_picker.addItem(e.label, e.source)
        self.model_picker.addItem("Choose a checkpoint folder…", CHOOSE_FOLDER)
        self.model_picker.addItem("Server…", CHOOSE_SERVER)
        if self.loaded is not None:
            self._select_model_item(self.loaded.choice)

    def _select_model_item(self, choice: ModelChoice) -> None:
        index = self.model_picker.findData(choice.source)
        if index < 0:  # a folder picked by hand or given on the command line, a server
            index = self.model_picker.findData(CHOOSE_FOLDER)  # before the items that ask for one
            if index < 0:
                index = self.model_picker.count() - 1 if self.model_picker.count() else 0
            self.model_picker.insertItem(max(0, index), choice.name, choice.source)
            index = self.model_picker.findData(choice.source)
        self.model_picker.setCurrentIndex(index)

    def _on_model_picked(self, index: int) -> None:
        source = self.model_picker.itemData(index)
        if source == CHOOSE_FOLDER:
            folder = QFileDialog.getExistingDirectory(self, "Choose a model checkpoint folder")
            if not folder:
                if self.loaded is not None:
                    self._select_model_item(self.loaded.choice)
                return
            source = folder
        elif source == CHOOSE_SERVER:
            url = self.ask_server_url()
            if not url:
                if self.loaded is not None:
                    self._select_model_item(self.loaded.choice)
                return
            source = url
        if self.loaded is not None and source == self.loaded.choice.source:
            return
        self.settings.model = source
        self.load(source)

    def ask_server_url(self) -> str | None:
        """"Server…": the URL of a vLLM-Omni server (remembered); None when the user cancels."""
        url, ok = QInputDialog.getText(
            self, "Run the model on a server",
            "URL of a vLLM-Omni server (vllm serve MODEL --omni), e.g. http://gpu-box:8091.\n"
            "Your voice is sent to it. An API key comes from the OMNIDESK_API_KEY environment variable.",
            QLineEdit.EchoMode.Normal, self.settings.server or "http://")
        url = url.strip()
        if not ok or not url or url in ("http://", "https://"):
            return None
        self.settings.server = url
        return url

    def _show_remote(self, loaded: LoadedModel | None, notice: str | None = None) -> None:
        """The "remote" badge while a server is the model, with what the server does differently
        (its audio only when a reply is complete: said in the badge as long as it is true)."""
        remote = loaded.remote if loaded is not None else None
        self.remote_badge.setVisible(bool(remote))
        if not remote:
            return
        notice = notice or loaded.executor.notice
        host = remote.split("://", 1)[-1]
        self.remote_badge.setText(f"REMOTE · {host}" + (" · audio only when a reply is complete" if notice else ""))
        self.remote_badge.setToolTip(f"The model ({loaded.family_title}) runs on {remote}: what you say is sent "
                                     f"there." + (f" Note: {as_sentence(notice)}" if notice else ""))
        self.setWindowTitle(f"OmniDesk: {loaded.family_title} on {host} (remote)")
        if notice:
            self.statusBar().showMessage(as_sentence(notice), 15000)

    def _show_weights_choice(self, loaded: LoadedModel) -> None:
        """The Weights picker only where it does something: greyed out, saying why, for a family
        that loads its weights as stored (Moshi, Qwen3-Omni) or a server's model.  The remembered
        choice stays and applies again to the next model that can use it."""
        usable = loaded.int8_on_load and not loaded.remote
        self.weights_picker.setEnabled(usable)
        if usable:
            self.weights_picker.setToolTip(WEIGHTS_TIP)
        elif loaded.remote:
            self.weights_picker.setToolTip("The server holds the weights: how they are loaded is set there.")
        else:
            self.weights_picker.setToolTip(f"{loaded.family_title} loads its weights as stored: int8 on load is "
                                           f"for Qwen2.5-Omni checkpoints.")

    def _show_decode_mode(self) -> None:
        """Which mode the decode steps run in (eager, compiling, compiled, CUDA graphs); polled while a
        background compile is under way (the UI thread only reads the runner's state)."""
        runner = getattr(self.loaded.executor, "runner", None) if self.loaded is not None else None
        self.decode_picker.setEnabled(runner is not None)
        self.decode_label.setText(runner.describe() if runner is not None else "on the server")
        if runner is not None and not runner.ready:
            QTimer.singleShot(1000, self._show_decode_mode)

    def _on_decode_picked(self, index: int) -> None:
        value = self.decode_picker.itemData(index)
        if value == self.settings.compile:
            return
        self.settings.compile = value
        self.load(self.loaded.choice.source if self.loaded is not None else self.requested_model or self.settings.model)

    def _on_weights_picked(self, index: int) -> None:
        value = self.weights_picker.itemData(index)
        if value == self.settings.quantize:
            return
        self.settings.quantize = value
        # reload the model in use (or the one being loaded) with the new weights; a later load wins
        self.load(self.loaded.choice.source if self.loaded is not None else self.requested_model or self.settings.model)

    def _on_voice_picked(self, index: int) -> None:
        voice = self.voice_picker.itemData(index)
        self.settings.voice = voice
        # the engine reads its config when a reply starts: the next reply uses this voice
        self.engine_config.voice = voice

    # ------------------------------------------------------------------ devices
    def _fill_devices(self, found: list) -> None:
        def fill(picker: QComboBox, devices: list, remembered: str | None, extra: list[tuple[str, str]]):
            picker.clear()
            picker.addItem("System default", None)
            names = set()
            for d in devices:
                if d.name in names:  # one device under several host APIs: the audio layer picks by name
                    continue
                names.add(d.name)
                default = d.is_default_input if picker is self.input_picker else d.is_default_output
                picker.addItem(d.name + ("  (default)" if default else ""), d.name)
            for label, data in extra:
                picker.addItem(label, data)
            index = picker.findData(remembered) if remembered else 0
            if remembered and index < 0:  # remembered but unplugged: keep it visible, marked
                picker.addItem(f"{remembered} (not connected)", remembered)
                index = picker.count() - 1
            picker.setCurrentIndex(max(0, index))

        inputs = [d for d in found if d.inputs > 0]
        outputs = [d for d in found if d.outputs > 0]
        fill(self.input_picker, inputs, self.settings.input_device, [("Sound files (no microphone)", SOUND_FILES)])
        fill(self.output_picker, outputs, self.settings.output_device, [])

    def _on_input_changed(self, index: int) -> None:
        value = self.input_picker.itemData(index)
        if value != self.settings.input_device:
            self.settings.input_device = value
            self.open_session()

    def _on_output_changed(self, index: int) -> None:
        value = self.output_picker.itemData(index)
        if value != self.settings.output_device:
            self.settings.output_device = value
            self.open_session()

    def _end_of_turn_in_use(self, session) -> str:
        """The status line under End of turn: the detector this session runs, and why not the model."""
        if self.duplex_model:
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

    def _on_end_of_turn_changed(self, index: int) -> None:
        value = self.end_of_turn_picker.itemData(index)
        if value != self.settings.end_of_turn:
            self.settings.end_of_turn = value
            self.open_session()  # the endpointer is the session's: a new one decides from now on

    def _on_headphones_changed(self, index: int) -> None:
        on = bool(self.output_kind.itemData(index))
        self.settings.headphones = on
        if self.session is not None:
            self.session.set_headphones(on)

    # ------------------------------------------------------------------ session
    @property
    def duplex_model(self) -> bool:
        """A full-duplex model (Moshi) is loaded: no turns, one step per frame."""
        return self.loaded is not None and self.loaded.duplex

    @property
    def session(self):
        return self.conversation.session

    def session_kind(self) -> str:
        return "files" if self.settings.input_device == SOUND_FILES or not self.live_available else "live"

    def open_session(self) -> None:
        """(Re)open the conversation on the current model and devices, in the background."""
        if self.loaded is None:
            return
        if not self._devices_listed:
            self._open_when_listed = True
            return
        self.error_banner.hide()
        kind = self.session_kind()
        if kind == "files" and not self.live_available:
            self.info_banner.show_message(
                "Live microphone audio is not available in this version yet. Speak to the assistant with sound "
                "files: Conversation ▸ Speak a sound file… (Ctrl+O).")
        else:
            self.info_banner.hide()
        self.transcript.clear_turns()
        self.overlay.clear()
        self.duplex = None
        self.duplex_activity.set_activity(user_speaking=False, assistant_speaking=False, muted=False)
        self.engine_state = None
        self.status = None
        self._status_dirty = True
        self.conversation.open(kind, self.loaded, live_settings(self.settings), self.engine_config)

    def _on_session_started(self, session) -> None:
        self.end_of_turn_status.setText(self._end_of_turn_in_use(session))
        session.set_muted(self.mute_button.isChecked())
        session.set_push_to_talk(self.push_to_talk_on())
        session.set_headphones(self.settings.headphones)
        self.engine_state = TurnState.LISTENING
        if self._pending_say is not None:
            _speak_into(session, self._pending_say)
            self._pending_say = None
        self.session_started.emit(session)

    def _on_session_failed(self, exc: BaseException) -> None:
        self.engine_state = None
        actions = {"Retry": self.open_session}
        if self.session_kind() == "live":
            actions["Use sound files instead"] = self.use_sound_files
        actions["Open the log"] = self.open_log
        self.error_banner.show_message(plain_message(exc, "opening the audio devices"), actions)

    def _on_session_stopped(self, message: str) -> None:
        self.engine_state = None
        if "out of memory" in message.lower():
            from omnidesk.models.families import SMALLEST_REPO

            message = (f"The GPU ran out of memory during the reply. Pick a smaller model ({SMALLEST_REPO}) "
                       "or close other programs that use the GPU, then Retry")
        self.error_banner.show_message(as_sentence(message), {"Retry": self.retry, "Open the log": self.open_log})

    def retry(self) -> None:
        """After a device error: restart the same session (same conversation) where it can, else a new one."""
        self.error_banner.hide()
        self.engine_state = None
        if not self.conversation.restart():
            self.open_session()

    def use_sound_files(self) -> None:
        self.settings.input_device = SOUND_FILES
        index = self.input_picker.findData(SOUND_FILES)
        if index >= 0:
            self.input_picker.setCurrentIndex(index)
        self.open_session()

    def shutdown(self) -> None:
        """At exit, after the window is gone: close the session and wait for it."""
        self.conversation.shutdown()

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
        self.error_banner.show_message(as_sentence(message) + " Details are in the log.",
                                       {"Open the log": self.open_log})

    def _on_status(self, status) -> None:
        self.status = status
        self._status_dirty = True

    def _on_duplex(self, shown: DuplexShown) -> None:
        self.duplex = shown
        # a failed duplex step restarted the model's stream: once it has stepped a second again
        # without failing, the banner has said what it had to
        if self._failed_turn is not None and self._failed_frames is not None \
                and shown.view.frames >= self._failed_frames + DUPLEX_RECOVERED_FRAMES:
            self._failed_turn = self._failed_frames = None
            self.error_banner.hide()
        self.transcript.show_duplex(shown)
        self.overlay.show_duplex(shown)

    def _show_turn(self, view: TurnView) -> None:
        failed = self._failed_turn
        if failed is not None and view.done and view.number > failed:  # a later turn worked
            self._failed_turn = None
            self.error_banner.hide()
        if view.network and view.network.get("audio_only_at_end") and "only when" not in self.remote_badge.text():
            from omnidesk.remote.executor import AUDIO_AT_END_NOTICE

            self._show_remote(self.loaded, AUDIO_AT_END_NOTICE)  # learnt from a reply: said from now on
        self.transcript.show_turn(view)
        self.overlay.show_turn(view)

    # ------------------------------------------------------------------ painting (15 Hz)
    def paint(self) -> None:
        state = self.display_state()
        self.state_indicator.set_state(state)
        if self.duplex is not None:
            v = self.duplex.view
            self.duplex_activity.set_activity(v.user_speaking, v.assistant_speaking, v.muted)
        self.transcript.set_placeholder(PLACEHOLDERS.get(state, PLACEHOLDERS["listening"]))
        self.transcript.render()
        if self._status_dirty:
            self._status_dirty = False
            s = self.status
            self.level.set_level(None if s is None else s.level_dbfs)
            if self.mute_button.isChecked():
                self.level.set_level(None, "muted")
            if s is not None and self.duplex_model:  # a duplex model has stops, not voice barge-ins
                self.barge_in_counts.setText(f"Stops: {s.confirmed_barge_ins}")
            elif s is not None:
                self.barge_in_counts.setText(f"Barge-ins: {s.confirmed_barge_ins} confirmed, "
                                             f"{s.false_barge_ins} false")
            self.overlay.show_status(s)
        if self.overlay.isVisible():
            self.overlay.render()

    def display_state(self) -> str:
        if self.loading:
            return "loading"
        if self.session is None or self.engine_state is None:
            return "idle"
        if time.monotonic() < self._interrupted_until:
            return "interrupted"
        if self.mute_button.isChecked():
            return "muted"
        if self.duplex_model:
            return self._duplex_state()
        state = self.engine_state
        if state in (TurnState.USER_SPEAKING, TurnState.SUSPECTED_BARGE_IN):
            return "user_speaking"
        if state == TurnState.PREEMPTING:
            return "thinking"
        if state == TurnState.RESPONDING:
            current = self.overlay.current
            playing = current is not None and current.events.get("playback_start") is not None
            return "speaking" if playing else "thinking"
        return "push_to_talk" if self.push_to_talk_on() else "listening"

    def _duplex_state(self) -> str:
        """A full-duplex model: both sides may speak at once; after a stop the assistant is muted."""
        v = self.duplex.view if self.duplex is not None else None
        if v is None:
            return "push_to_talk" if self.push_to_talk_on() else "listening"
        if v.user_speaking and v.assistant_speaking:
            return "both_speaking"
        if v.user_speaking:
            return "user_speaking"
        if v.muted:
            return "assistant_muted"
        if v.assistant_speaking:
            return "speaking"
        return "push_to_talk" if self.push_to_talk_on() else "listening"

    # ------------------------------------------------------------------ controls
    def push_to_talk_on(self) -> bool:
        return bool(self.mode_picker.currentData())

    def set_talk_pressed(self, pressed: bool) -> None:
        if self.session is not None:
            self.session.set_talk_pressed(pressed)

    def _on_mode_changed(self, index: int) -> None:
        on = bool(self.mode_picker.itemData(index))
        self.settings.push_to_talk = on
        if self.session is not None:
            self.session.set_push_to_talk(on)

    def _on_mute(self, muted: bool) -> None:
        self.mute_button.setText("Unm&ute" if muted else "M&ute")
        if self.session is not None:
            self.session.set_muted(muted)
        self._status_dirty = True

    def stop_reply(self) -> None:
        """The stop button / Esc: the same path as a confirmed barge-in."""
        if self.session is not None:
            self.session.interrupt()

    def arm_interrupt_after(self) -> None:
        if self.session is None:
            return
        ms = self.interrupt_ms.value()
        self.session.interrupt_after(ms)
        message = (f"The assistant will be stopped {ms} ms after it starts speaking." if self.duplex_model
                   else f"The current or next reply will be cut {ms} ms after it starts playing.")
        self.statusBar().showMessage(message, 6000)

    def _on_interrupt_ms(self, value: int) -> None:
        self.settings.interrupt_after_ms = value

    def repeat_last_question(self) -> None:
        if self.session is None:
            return
        if not self.session.repeat_last_question():
            self.statusBar().showMessage("Nothing to repeat yet: ask something first.", 6000)

    def choose_sound_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Speak a sound file", "", "Sound files (*.wav *.flac *.ogg)")
        if path:
            self.say_file(path)

    def say_file(self, path: str) -> None:
        """Play a sound file into the assistant as the user's voice (mixed into the live microphone, or
        through the sound-file input when there is no live session)."""
        rate = session_rate(self.loaded.executor) if self.loaded is not None else SESSION_RATE
        run_in_background("reading a sound file", lambda progress: read_sound_file(path, rate),
                          on_done=self._say,
                          on_failed=lambda e: self.error_banner.show_message(
                              plain_message(e, f"reading {Path(path).name}"), {"Open the log": self.open_log}))

    def _say(self, audio) -> None:
        if self.conversation.running:
            _speak_into(self.session, audio)
            return
        self._pending_say = audio  # said once the session has started
        if self.session is None and self.loaded is not None and self.settings.input_device != SOUND_FILES:
            self.use_sound_files()  # no conversation (no microphone?): the sound-file input needs none

    # ------------------------------------------------------------------ overlay, export, log
    def set_overlay_visible(self, visible: bool) -> None:
        self.settings.overlay_visible = visible
        if visible:
            self.overlay.adjustSize()
            self.overlay.move(*self._overlay_place())
            self.overlay.show()
            self.overlay.raise_()
            self.overlay.render()
        else:
            self.overlay.hide()

    def _banner_area(self) -> QRect:
        """Where the banners appear, in screen coordinates: the top of the window's content, as tall as
        the banners can get (shown or not: one may appear after the overlay opened)."""
        top_left = self.centralWidget().mapToGlobal(QPoint(0, 0))
        height = max(160, sum(b.sizeHint().height() for b in (self.demo_banner, self.info_banner, self.error_banner)))
        return QRect(top_left, QSize(self.centralWidget().width(), height))

    def _overlay_place(self) -> tuple[int, int]:
        """Where the overlay opens: where it was last, if that spot is still on a screen and clear of the
        banners; else beside the window, or inside its lower right corner when no screen has room beside
        it.  Never over the banners (a warning hidden by the overlay is a warning nobody reads)."""
        size = self.overlay.frameGeometry().size().expandedTo(self.overlay.sizeHint())
        banners = self._banner_area()

        def fits(x: int, y: int) -> bool:
            rect = QRect(QPoint(x, y), size)
            on_screen = any(scr.availableGeometry().contains(rect) for scr in QGuiApplication.screens())
            return on_screen and not rect.intersects(banners)

        remembered = self.settings.overlay_pos
        if remembered is not None and fits(*remembered):
            return remembered
        frame = self.frameGeometry()
        for x, y in ((frame.right() + 8, frame.top()), (frame.left() - size.width() - 8, frame.top()),
                     (frame.right() - size.width() - 8, frame.bottom() - size.height() - 8)):
            if fits(x, y):
                return x, y
        return frame.left(), max(frame.top(), banners.bottom() + 8)  # below the banners at least

    def eventFilter(self, obj, event):
        if obj is self.overlay and event.type() == QEvent.Type.Hide and not self._closing:
            self.overlay_action.setChecked(False)
        if obj is self.overlay and event.type() == QEvent.Type.Move and self.overlay.isVisible():
            pos = self.overlay.pos()  # the user's spot: opened there again, if it is still free
            self.settings.overlay_pos = (pos.x(), pos.y())
        return False

    def timeline_dict(self) -> dict:
        s = self.status
        extra = {} if s is None else {"confirmed_barge_ins": s.confirmed_barge_ins,
                                      "false_barge_ins": s.false_barge_ins}
        return self.conversation.timeline_dict(extra)

    def choose_export(self, kind: str) -> None:
        suffix = ".csv" if kind == "csv" else ".json"
        name = time.strftime("omnidesk-timeline-%Y%m%d-%H%M%S") + suffix
        path, _ = QFileDialog.getSaveFileName(self, "Export the session's timelines", name,
                                              "CSV (*.csv)" if kind == "csv" else "JSON (*.json)")
        if path:
            self.export(path)

    def export(self, path: str) -> Path | None:
        try:
            written = export_timeline(self.timeline_dict(), path)
        except Exception as e:  # noqa: BLE001
            log.exception("export failed")
            self.error_banner.show_message(plain_message(e, "exporting the timeline"), {"Open the log": self.open_log})
            return None
        self.statusBar().showMessage(f"Timeline written to {written}", 8000)
        return written

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

    # ------------------------------------------------------------------ closing
    def closeEvent(self, event):
        self._closing = True
        self.settings.set_geometry("main", self.saveGeometry())
        self.settings.sync()
        self.overlay.hide()
        super().closeEvent(event)


def _speak_into(session, audio) -> None:
    """A sound file as the user's voice: the sound-file session says it; the live one mixes it into the mic."""
    if hasattr(session, "say"):
        session.say(audio)
    else:
        session.inject(audio)


def _free(loaded: LoadedModel) -> None:
    """Drop a model and give its GPU memory back (pool thread)."""
    device = loaded.device
    del loaded
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
