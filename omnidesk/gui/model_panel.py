"""The "Model" group and the remote badge: which model runs, where, with which voice, weights and decode mode.

:class:`ModelPanel` owns the model choice: the list of models found (in the background), a
checkpoint folder or a vLLM-Omni server picked by hand (its URL remembered), the voice, the weights
(as stored or int8) and the decode mode.  A new model, weights or decode mode means a new load,
which the window does (:meth:`.main_window.MainWindow.load`); a voice is read by the engine when a
reply starts, so it needs none.  While a server is the model, the red badge in the status bar says
so, always in view: what the user says leaves the machine.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QComboBox, QFileDialog, QFormLayout, QGroupBox, QInputDialog, QLabel, QLineEdit

from .errors import as_sentence
from .model_loader import CatalogEntry, LoadedModel, ModelChoice, catalog
from .widgets import choice_picker
from .worker import run_in_background

CHOOSE_FOLDER = "\x00choose-folder"  # model picker item that opens a folder dialog
CHOOSE_SERVER = "\x00choose-server"  # model picker item that asks for a vLLM-Omni server's URL (omnidesk.remote)
REMOTE_BADGE_STYLE = "background: #b3261e; color: white; font-weight: bold; padding: 2px 8px; border-radius: 3px"
AUDIO_AT_END = " · audio only when a reply is complete"  # the badge's words while the server says so
WEIGHTS_ITEMS = (("As stored (bf16, or the checkpoint's 4-bit)", "none"), ("int8 (about half the GPU memory)", "int8"))
WEIGHTS_TIP = ("int8: the thinker's linears are quantized to int8 while loading; a GPTQ/AWQ checkpoint runs 4-bit "
               "either way. Reloads the model.")
DECODE_ITEMS = (("Automatic (CUDA graphs on a GPU)", "auto"), ("Compiled / CUDA graphs", "on"),
                ("Eager (no compiling)", "off"))
DECODE_TIP = ("How the model's decode steps run. Automatic: captured as CUDA graphs on a GPU (several times faster "
              "than eager), eager on the CPU unless compiling pays there. Compiled: torch.compile on the CPU, CUDA "
              "graphs on a GPU; compiling runs in the background while you talk and is cached on disk. Eager: no "
              "compiling.")


class ModelPanel(QObject):
    """``window`` is the :class:`.main_window.MainWindow` (its settings, loaded model and ``load``)."""

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.settings = window.settings
        self._catalog: list[CatalogEntry] = []

    def group(self) -> QGroupBox:
        model = QGroupBox("Model")
        form = QFormLayout(model)
        self.model_picker = QComboBox()
        self.model_picker.setAccessibleName("Model")
        self.model_picker.activated.connect(self.pick_model)
        form.addRow("Mo&del", self.model_picker)
        self.voice_picker = QComboBox()
        self.voice_picker.setAccessibleName("Voice")
        self.voice_picker.activated.connect(self.pick_voice)
        form.addRow("Voic&e", self.voice_picker)
        # how the weights are loaded (omnidesk/models/quant.py)
        self.weights_picker = choice_picker(WEIGHTS_ITEMS, self.settings.quantize, self.pick_weights,
                                            name="Weights", tip=WEIGHTS_TIP)
        form.addRow("&Weights", self.weights_picker)
        # how the decode steps run (omnidesk/models/runner.py)
        self.decode_picker = choice_picker(DECODE_ITEMS, self.settings.compile, self.pick_decode,
                                           name="Decode steps", tip=DECODE_TIP)
        form.addRow("Deco&de steps", self.decode_picker)
        self.decode_label = QLabel()  # which mode runs now, and how far compiling is
        self.decode_label.setAccessibleName("Decode mode")
        self.decode_label.setWordWrap(True)
        form.addRow("", self.decode_label)
        return model

    def badge(self) -> QLabel:
        """The "remote" badge, for the status bar; hidden while the model runs here."""
        self.remote_badge = QLabel()
        self.remote_badge.setStyleSheet(REMOTE_BADGE_STYLE)
        self.remote_badge.setAccessibleName("Remote model")
        return self.remote_badge

    # ------------------------------------------------------------------ the list of models
    def refresh(self, find) -> None:
        """List the models ``find`` finds (None: the caches), in the background."""
        run_in_background("looking for models", lambda progress: catalog(find),
                          on_done=self._fill, on_failed=lambda e: self._fill(catalog(lambda: [])))

    def _fill(self, entries: list[CatalogEntry]) -> None:
        self._catalog = entries
        self.model_picker.clear()
        for e in entries:
            self.model_picker.addItem(e.label, e.source)
        self.model_picker.addItem("Choose a checkpoint folder…", CHOOSE_FOLDER)
        self.model_picker.addItem("Server…", CHOOSE_SERVER)
        if self.window.loaded is not None:
            self._select(self.window.loaded.choice)

    def _select(self, choice: ModelChoice) -> None:
        index = self.model_picker.findData(choice.source)
        if index < 0:  # a folder picked by hand or given on the command line, a server
            index = self.model_picker.findData(CHOOSE_FOLDER)  # before the items that ask for one
            if index < 0:
                index = self.model_picker.count() - 1 if self.model_picker.count() else 0
            self.model_picker.insertItem(max(0, index), choice.name, choice.source)
            index = self.model_picker.findData(choice.source)
        self.model_picker.setCurrentIndex(index)

    def pick_model(self, index: int) -> None:
        """What choosing the model picker's item at ``index`` does (its ``activated``)."""
        source = self.model_picker.itemData(index)
        if source in (CHOOSE_FOLDER, CHOOSE_SERVER):
            source = (QFileDialog.getExistingDirectory(self.window, "Choose a model checkpoint folder")
                      if source == CHOOSE_FOLDER else self.ask_server_url())
            if not source:  # cancelled: the picker shows the model in use again
                if self.window.loaded is not None:
                    self._select(self.window.loaded.choice)
                return
        if self.window.loaded is not None and source == self.window.loaded.choice.source:
            return
        self.settings.model = source
        self.window.load(source)

    def ask_server_url(self) -> str | None:
        """"Server…": the URL of a vLLM-Omni server (remembered); None when the user cancels."""
        url, ok = QInputDialog.getText(
            self.window, "Run the model on a server",
            "URL of a vLLM-Omni server (vllm serve MODEL --omni), e.g. http://gpu-box:8091.\n"
            "Your voice is sent to it. An API key comes from the OMNIDESK_API_KEY environment variable.",
            QLineEdit.EchoMode.Normal, self.settings.server or "http://")
        url = url.strip()
        if not ok or not url or url in ("http://", "https://"):
            return None
        self.settings.server = url
        return url

    # ------------------------------------------------------------------ a model is loaded
    def show_loaded(self, loaded: LoadedModel) -> None:
        """The panel for a model just loaded: its voices, what its weights and decode steps can do, where
        it runs, and the picker's item."""
        self._show_voices(loaded)
        self._show_weights_choice(loaded)
        self._show_decode_mode()
        self.show_remote(loaded)
        self._select(loaded.choice)

    def _show_voices(self, loaded: LoadedModel) -> None:
        self.voice_picker.clear()
        for name in loaded.voices:
            self.voice_picker.addItem(name, name)
        # a model with one voice (Moshi) has nothing to pick
        self.voice_picker.setEnabled(bool(loaded.voices))
        self.voice_picker.setToolTip("" if loaded.voices else f"{loaded.family_title} speaks with one voice")
        voice = self.settings.voice if self.settings.voice in loaded.voices else (loaded.voices or [None])[0]
        self.window.engine_config.voice = voice
        if voice is not None:
            self.voice_picker.setCurrentIndex(loaded.voices.index(voice))

    def show_remote(self, loaded: LoadedModel | None, notice: str | None = None) -> None:
        """The "remote" badge while a server is the model, with what the server does differently
        (its audio only when a reply is complete: said in the badge as long as it is true)."""
        remote = loaded.remote if loaded is not None else None
        self.remote_badge.setVisible(bool(remote))
        if not remote:
            return
        notice = notice or loaded.executor.notice
        host = remote.split("://", 1)[-1]
        self.remote_badge.setText(f"REMOTE · {host}" + (AUDIO_AT_END if notice else ""))
        self.remote_badge.setToolTip(f"The model ({loaded.family_title}) runs on {remote}: what you say is sent "
                                     f"there." + (f" Note: {as_sentence(notice)}" if notice else ""))
        self.window.setWindowTitle(f"OmniDesk: {loaded.family_title} on {host} (remote)")
        if notice:
            self.window.statusBar().showMessage(as_sentence(notice), 15000)

    def learn_audio_only_at_end(self) -> None:
        """A reply came from a server that sends its audio only once the reply is complete: the badge
        says so from now on."""
        if AUDIO_AT_END not in self.remote_badge.text():
            from omnidesk.remote.executor import AUDIO_AT_END_NOTICE

            self.show_remote(self.window.loaded, AUDIO_AT_END_NOTICE)

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
        loaded = self.window.loaded
        runner = getattr(loaded.executor, "runner", None) if loaded is not None else None
        self.decode_picker.setEnabled(runner is not None)
        self.decode_label.setText(runner.describe() if runner is not None else "on the server")
        if runner is not None and not runner.ready:
            QTimer.singleShot(1000, self._show_decode_mode)

    # ------------------------------------------------------------------ picks that reload or not
    def pick_decode(self, index: int) -> None:
        self._reload_with("compile", self.decode_picker.itemData(index))

    def pick_weights(self, index: int) -> None:
        self._reload_with("quantize", self.weights_picker.itemData(index))

    def _reload_with(self, setting: str, value) -> None:
        """A setting the loader reads (weights, decode mode): remembered, and the model in use (or the one
        being loaded) is loaded again with it; a later load wins."""
        if value == getattr(self.settings, setting):
            return
        setattr(self.settings, setting, value)
        w = self.window
        w.load(w.loaded.choice.source if w.loaded is not None else w.requested_model or self.settings.model)

    def pick_voice(self, index: int) -> None:
        voice = self.voice_picker.itemData(index)
        self.settings.voice = voice
        # the engine reads its config when a reply starts: the next reply uses this voice
        self.window.engine_config.voice = voice
