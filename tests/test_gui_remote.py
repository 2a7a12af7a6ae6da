"""The window with a remote model (offscreen): the model picker's "Server…" entry, the "remote" badge,
a turn through the vLLM-Omni protocol double (tests/vllm_omni_double.py) with the overlay's network
share, and a server that sends its audio only at the end.

As in test_gui.py: a sound-file microphone session on the real engine, settings in a temporary INI
file, temporary cache/state dirs; waits are on state (qtbot.waitUntil).  One test runs the window on
the live microphone (tests/audio_harness.py, as test_gui_live.py): switching model while the server
still streams a reply closes its stream; it is skipped where the PulseAudio harness cannot run.
"""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading
from pathlib import Path

import pytest
import soundfile as sf

pytest.importorskip("pytestqt")

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication, QInputDialog  # noqa: E402

from audio_harness import pulse_server  # noqa: E402,F401  (fixture)
from omnidesk.gui.main_window import CHOOSE_SERVER, MainWindow  # noqa: E402
from test_gui import private_dirs, settings  # noqa: E402,F401  (fixtures: private dirs, a throwaway settings file)
from vllm_omni_double import DEFAULT_TEXT, QWEN25, Reply, VllmOmniDouble, slow_reply  # noqa: E402
from test_gui_duplex import close_window, open_window  # noqa: E402  (Sound-files input, no devices)

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ROOT / "tests" / "fixtures" / "question.wav"


def answer_the_server_dialog(url: str) -> list:
    """Type ``url`` into the "Server…" dialog once it is open, and press OK (a real QInputDialog)."""
    seen = []

    def fill():
        dialog = QApplication.activeModalWidget()
        if not isinstance(dialog, QInputDialog):
            QTimer.singleShot(20, fill)
            return
        seen.append(dialog.labelText())
        dialog.setTextValue(url)
        dialog.accept()

    QTimer.singleShot(0, fill)
    return seen


def test_server_entry_connects_shows_the_remote_badge_and_the_network_share(qtbot, settings, tmp_path):
    with VllmOmniDouble() as double:
        w = open_window(qtbot, settings, tmp_path, "demo")
        qtbot.waitUntil(lambda: w.loaded is not None and w.session is not None, timeout=60000)
        assert not w.remote_badge.isVisible()  # a local model: no badge

        index = w.model_picker.findData(CHOOSE_SERVER)
        assert index >= 0 and w.model_picker.itemText(index) == "Server…"
        seen = answer_the_server_dialog(double.url)
        w.model_picker.setCurrentIndex(index)
        w._on_model_picked(index)  # what choosing the entry does (QComboBox.activated)
        assert seen and "Your voice is sent to it" in seen[0]
        qtbot.waitUntil(lambda: w.loaded is not None and w.loaded.remote == double.url and w.session is not None,
                        timeout=30000)
        # remembered: the server is the model next time, and the dialog offers its URL again
        assert settings.model == double.url and settings.server == double.url
        host = double.url.split("://")[1]
        assert w.remote_badge.isVisible() and w.remote_badge.text() == f"REMOTE · {host}"
        assert "what you say is sent there" in w.remote_badge.toolTip()
        assert "(remote)" in w.windowTitle()
        assert w.model_picker.currentData() == double.url
        assert [w.voice_picker.itemText(i) for i in range(w.voice_picker.count())] == ["Ethan", "Chelsie", "Aiden"]

        w.say_file(str(QUESTION))
        qtbot.waitUntil(lambda: w.overlay.turns.get(1) is not None and w.overlay.turns[1].done, timeout=30000)
        view = w.overlay.turns[1]
        assert view.text == "".join(DEFAULT_TEXT)
        w.paint()
        assert "".join(DEFAULT_TEXT)[:30] in w.transcript.toPlainText()
        w.set_overlay_visible(True)  # F2
        w.overlay.render()
        assert w.overlay.network.isVisible()
        assert w.overlay.network.text().startswith("server + network: first byte")
        assert "of the voice-to-voice time" in w.overlay.network.text()
        assert double.requests[0].body["speaker"] == "Ethan"

        # back to a local model: the badge goes
        w._on_model_picked(w.model_picker.findData("demo"))
        qtbot.waitUntil(lambda: w.loaded is not None and w.loaded.remote is None, timeout=60000)
        assert not w.remote_badge.isVisible()
        close_window(w)


def test_a_remembered_server_that_sends_audio_only_at_the_end_says_so(qtbot, settings, tmp_path):
    with VllmOmniDouble(model=QWEN25) as double:
        double.default = Reply(streaming=False, audio_s=3.0)
        settings.model = double.url  # picked in an earlier run
        w = open_window(qtbot, settings, tmp_path, None)
        qtbot.waitUntil(lambda: w.loaded is not None and w.session is not None, timeout=30000)
        assert w.loaded.remote == double.url
        text = w.remote_badge.text()
        assert w.remote_badge.isVisible() and text.endswith("audio only when a reply is complete")
        assert "only when it is complete" in w.remote_badge.toolTip()
        close_window(w)


def test_an_unreachable_server_is_said_in_words(qtbot, settings, tmp_path):
    with VllmOmniDouble() as double:
        url = double.url
    w = open_window(qtbot, settings, tmp_path, url)
    qtbot.waitUntil(lambda: w.error_banner.isVisible(), timeout=30000)
    assert f"Cannot reach the server at {url}" in w.error_banner.text
    assert not w.remote_badge.isVisible()
    close_window(w)


def test_switching_model_in_the_middle_of_a_reply_closes_its_stream(qtbot, settings, tmp_path,
                                                                    pulse_server):  # noqa: F811
    # the window on the live microphone (a LiveSession): choosing another model closes the session
    # in the background while the server still streams; the server must see the disconnect then,
    # not when the reply would have ended
    readers = lambda: {t for t in threading.enumerate() if t.name == "omnidesk-remote-stream"}  # noqa: E731
    before = readers()
    with VllmOmniDouble() as double:
        double.default = slow_reply()  # half a minute of reply: still streaming at the switch
        w = MainWindow(settings, model=double.url, find_models=lambda: [], log_path=tmp_path / "state" / "omnidesk.log",
                       live_available=True)
        qtbot.addWidget(w)
        w.show()
        w.start()
        qtbot.waitUntil(lambda: w.session is not None and w.display_state() == "listening", timeout=60000)
        assert w.loaded.remote == double.url and type(w.session).__name__ == "LiveSession"
        qtbot.waitUntil(lambda: w.session.frames >= 25, timeout=15000)  # the pulse plugin takes a moment
        question, rate = sf.read(str(QUESTION), dtype="float32")
        player = threading.Thread(target=pulse_server.play_into_mic, args=(question, rate), daemon=True)
        player.start()  # blocks for the length of the question: not on the UI thread
        qtbot.waitUntil(lambda: w.display_state() == "speaking", timeout=30000)
        req = double.requests[-1]  # the reply playing (a preemptive start may have been dropped before it)
        assert not req.gone.is_set()
        w._on_model_picked(w.model_picker.findData("demo"))
        qtbot.waitUntil(req.gone.is_set, timeout=5000)  # a generous bound: the double streams on for 30 s
        qtbot.waitUntil(lambda: w.loaded is not None and w.loaded.remote is None and w.session is not None,
                        timeout=60000)
        player.join(timeout=10)
        close_window(w)
    assert not req.completed
    assert not [t for t in readers() - before if t.is_alive()]  # the closed session waited for its reader
