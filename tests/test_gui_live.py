"""The window on the real live audio session: PortAudio on a private PulseAudio server (tests/audio_harness.py),
the demo model, question.wav played into the virtual microphone, the stop button, all in real time (~15 s).

Skipped where the PulseAudio harness cannot run (see audio_harness.ensure_installed)."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("pytestqt")

from audio_harness import pulse_server  # noqa: E402,F401  (fixture)
from PySide6.QtCore import QSettings, Qt  # noqa: E402

from omnidesk.gui.main_window import MainWindow  # noqa: E402
from omnidesk.gui.settings import Settings  # noqa: E402
from omnidesk.gui.worker import wait_for_background  # noqa: E402
from omnidesk.models.qwen2_5_omni.demo import make_demo  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


def test_window_talks_and_stops_on_live_devices(qtbot, tmp_path, monkeypatch, pulse_server):  # noqa: F811
    pytest.importorskip("omnidesk.audio.session")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = Settings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    w = MainWindow(settings, model=str(make_demo(tmp_path / "demo")), find_models=lambda: [],
                   log_path=tmp_path / "omnidesk.log", live_available=True)
    qtbot.addWidget(w)
    levels = []
    w.show()
    w.start()
    qtbot.waitUntil(lambda: w.session is not None and w.display_state() == "listening", timeout=60000)
    qtbot.waitUntil(lambda: w.session.frames >= 25, timeout=15000)  # the pulse plugin takes a moment
    assert type(w.session).__name__ == "LiveSession"
    names = [w.input_picker.itemText(i) for i in range(w.input_picker.count())]
    assert any("pulse" in n.lower() or "default" in n.lower() for n in names[1:]), names

    question, rate = sf.read(str(FIXTURES / "question.wav"), dtype="float32")
    player = threading.Thread(target=pulse_server.play_into_mic, args=(question, rate), daemon=True)
    player.start()  # blocks for the length of the question: not on the UI thread

    def hearing_the_question():
        if w.status is not None:
            levels.append(w.status.level_dbfs)
        return w.display_state() == "user_speaking"

    qtbot.waitUntil(hearing_the_question, timeout=20000)
    qtbot.waitUntil(lambda: w.display_state() == "speaking", timeout=30000)
    qtbot.waitUntil(lambda: w.session.audio.speaker.playhead >= 0.5 * w.session.audio.speaker.sample_rate, timeout=20000)  # the playhead, not the wall clock
    qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.overlay.current is not None and w.overlay.current.interrupted, timeout=10000)
    cut = w.overlay.current
    assert cut.barge_in.heard_audio_s > 0.3 and cut.heard_text is not None
    assert cut.text.startswith(cut.heard_text)
    w.paint()
    assert "line-through" in w.transcript.to_html() or not cut.discarded_text
    assert max(levels) > -40  # the meter saw the question
    player.join(timeout=10)
    w.close()
    w.shutdown()
    assert wait_for_background(30000)
    assert np.isfinite(cut.stop_s) and cut.stop_s >= 0


def test_window_runs_the_moshi_demo_on_live_devices(qtbot, tmp_path, monkeypatch, pulse_server):  # noqa: F811
    """Full duplex in the window on the real devices: the assistant's audio flows while the user
    speaks, echo cancellation on (speakers), and Stop mutes it."""
    pytest.importorskip("omnidesk.audio.session")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = Settings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    w = MainWindow(settings, model="moshi-demo", find_models=lambda: [], log_path=tmp_path / "omnidesk.log",
                   live_available=True)
    qtbot.addWidget(w)
    w.show()
    w.start()
    qtbot.waitUntil(lambda: w.session is not None and w.loaded is not None and w.loaded.duplex, timeout=60000)
    qtbot.waitUntil(lambda: w.session.frames >= 25, timeout=15000)  # the pulse plugin takes a moment
    session = w.session
    assert type(session).__name__ == "LiveSession" and type(session.engine).__name__ == "DuplexEngine"
    assert session.aec is not None and not session.aec.bypass  # speakers: echo cancellation on
    assert w.demo_banner.isVisible() and "Moshi demo model" in w.demo_banner.text
    # speak once the model has talked a while: the user talks over it
    qtbot.waitUntil(lambda: session.audio.speaker.playhead >= 1.5 * session.audio.speaker.sample_rate,
                    timeout=20000)

    question, rate = sf.read(str(FIXTURES / "question.wav"), dtype="float32")
    player = threading.Thread(target=pulse_server.play_into_mic, args=(question, rate), daemon=True)
    player.start()
    # both at once: the user is heard while the assistant's audio keeps flowing
    qtbot.waitUntil(lambda: w.duplex is not None and w.duplex.view.user_speaking, timeout=20000)
    played = session.audio.speaker.playhead
    qtbot.waitUntil(lambda: session.audio.speaker.playhead >= played + 0.5 * session.audio.speaker.sample_rate,
                    timeout=10000)
    assert w.duplex_activity.states["you"] == "speaking"
    player.join(timeout=15)
    qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.duplex is not None and w.duplex.view.muted, timeout=10000)
    data = w.timeline_dict()
    assert data["duplex"]["errors"] == [] and len(data["duplex"]["user_speech"]) >= 1
    assert len(data["duplex"]["stops"]) == 1
    w.close()
    w.shutdown()
    assert wait_for_background(30000)
