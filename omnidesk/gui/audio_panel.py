"""The "Audio" group: which microphone and speakers the conversation uses, and speakers or headphones.

:class:`AudioPanel` owns the device pickers: it lists the devices in the background (a remembered
device that is unplugged stays in the list, marked), remembers what the user picks, and opens a new
session on a new device.  No session opens while the devices are being listed: listing
re-initialises PortAudio, which an open stream may not survive.  Speakers or headphones (echo
cancellation on or off) is the session's setter, so it needs no new session.
"""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QComboBox, QFormLayout, QGroupBox

from .settings import SOUND_FILES
from .widgets import switch_picker
from .worker import run_in_background


class AudioPanel(QObject):
    """``window`` is the :class:`.main_window.MainWindow`; ``list_devices()`` lists the audio devices
    (blocking: it runs on the thread pool)."""

    def __init__(self, window, list_devices):
        super().__init__(window)
        self.window = window
        self.settings = window.settings
        self.list_devices = list_devices
        self._listed = True
        self._open_when_listed = False

    def group(self) -> QGroupBox:
        audio = QGroupBox("Audio")
        form = QFormLayout(audio)
        self.input_picker = QComboBox()
        self.output_picker = QComboBox()
        self.input_picker.setAccessibleName("Input device")
        self.output_picker.setAccessibleName("Output device")
        self._fill([])
        self.input_picker.activated.connect(self._on_input_changed)
        self.output_picker.activated.connect(self._on_output_changed)
        form.addRow("&Input", self.input_picker)
        form.addRow("&Output", self.output_picker)
        self.output_kind = switch_picker("Speakers (echo cancellation on)", "Headphones (echo cancellation off)",
                                         self.settings.headphones, self._on_headphones_changed)
        form.addRow("&Listening on", self.output_kind)
        return audio

    def refresh(self) -> None:
        """List the devices again, in the background (only before a session opens, see above)."""
        self._listed = False

        def done(found):
            self._fill(found)
            self._listed = True
            if self._open_when_listed:
                self._open_when_listed = False
                self.window.session_view.open_session()

        run_in_background("listing audio devices", lambda progress: self.list_devices(),
                          on_done=done, on_failed=lambda e: done([]))

    def ready_for_session(self) -> bool:
        """False while the devices are being listed: the session then opens once they are."""
        if not self._listed:
            self._open_when_listed = True
        return self._listed

    def _fill(self, found: list) -> None:
        def fill(picker: QComboBox, devices: list, is_default, remembered: str | None, extra: list[tuple[str, str]]):
            picker.clear()
            picker.addItem("System default", None)
            names = set()
            for d in devices:
                if d.name in names:  # one device under several host APIs: the audio layer picks by name
                    continue
                names.add(d.name)
                picker.addItem(d.name + ("  (default)" if is_default(d) else ""), d.name)
            for label, data in extra:
                picker.addItem(label, data)
            index = picker.findData(remembered) if remembered else 0
            if remembered and index < 0:  # remembered but unplugged: keep it visible, marked
                picker.addItem(f"{remembered} (not connected)", remembered)
                index = picker.count() - 1
            picker.setCurrentIndex(max(0, index))

        inputs = [d for d in found if d.inputs > 0]
        outputs = [d for d in found if d.outputs > 0]
        fill(self.input_picker, inputs, lambda d: d.is_default_input, self.settings.input_device,
             [("Sound files (no microphone)", SOUND_FILES)])
        fill(self.output_picker, outputs, lambda d: d.is_default_output, self.settings.output_device, [])

    def _on_input_changed(self, index: int) -> None:
        self.window.session_view.reopen_with("input_device", self.input_picker.itemData(index))

    def _on_output_changed(self, index: int) -> None:
        self.window.session_view.reopen_with("output_device", self.output_picker.itemData(index))

    def _on_headphones_changed(self, on: bool) -> None:
        self.settings.headphones = on
        if self.window.session is not None:
            self.window.session.set_headphones(on)

    def use_sound_files(self) -> None:
        """The sound-file input instead of a microphone (no microphone, or the devices failed)."""
        self.settings.input_device = SOUND_FILES
        index = self.input_picker.findData(SOUND_FILES)
        if index >= 0:
            self.input_picker.setCurrentIndex(index)
        self.window.session_view.open_session()
