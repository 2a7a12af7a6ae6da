"""The desktop window (offscreen): real demo turns through the engine, stop, pickers, settings, errors, screenshots.

Every window here uses a sound-file microphone session (FileMicSession) on the
real engine and demo model, settings in a temporary INI file, and temporary
cache/state dirs, so the user's settings, caches and logs are never touched.
``OMNIDESK_WRITE_SCREENSHOTS=1`` makes the screenshot test write docs/*.png.
"""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, Qt  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from omnidesk.engine.timeline import validate  # noqa: E402
from omnidesk.gui.devices import Device, list_devices  # noqa: E402
from omnidesk.gui.errors import plain_message, setup_logging  # noqa: E402
from omnidesk.gui.file_mic import FileMicSession  # noqa: E402
from omnidesk.gui.main_window import MainWindow  # noqa: E402
from omnidesk.gui.model_loader import DEMO, catalog, choose_model  # noqa: E402
from omnidesk.gui.settings import SOUND_FILES, Settings  # noqa: E402
from omnidesk.gui.worker import wait_for_background  # noqa: E402
from omnidesk.models.qwen2_5_omni.demo import make_demo  # noqa: E402
from omnidesk.models.checkpoint import ModelTooLargeError  # noqa: E402
from paint_gaps import record_paint_gaps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ROOT / "tests" / "fixtures" / "question.wav"
FAKE_DEVICES = [
    Device(0, "Built-in Microphone", inputs=2, outputs=0, is_default_input=True),
    Device(1, "USB Headset", inputs=1, outputs=2),
    Device(2, "HDMI Speakers", inputs=0, outputs=2, is_default_output=True),
]


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """No test reads or writes the user's caches, Hugging Face hub or logs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HOME", raising=False)
    QApplication.setOrganizationName("OmniDesk-tests")  # belt and braces: never the real settings


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("gui-demo") / "demo")


@pytest.fixture
def settings(tmp_path):
    return Settings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))


def open_window(qtbot, settings, tmp_path, model, realtime=False, live_available=False, factory=None,
                devices=FAKE_DEVICES, find_models=lambda: []):
    sessions = []

    def files_factory(kind, executor, live_settings, engine_config, on_update, timeline):
        session = FileMicSession(executor, live_settings, engine_config, on_update, timeline, realtime=realtime)
        sessions.append(session)
        return session

    w = MainWindow(settings, model=model, session_factory=factory or files_factory,
                   list_devices=lambda: list(devices), find_models=find_models,
                   log_path=tmp_path / "state" / "omnidesk.log", live_available=live_available)
    w.sessions = sessions
    qtbot.addWidget(w)
    w.show()
    w.start()
    return w


def wait_listening(qtbot, w, timeout=60000):
    qtbot.waitUntil(lambda: w.session is not None and w.display_state() in ("listening", "push_to_talk"),
                    timeout=timeout)


def close_window(w):
    w.close()
    w.shutdown()
    assert wait_for_background(30000)


def say(qtbot, w, path=QUESTION):
    w.say_file(str(path))


def turn(w, number):
    return w.overlay.turns.get(number)


# ---------------------------------------------------------------- a real turn, interrupt-after, repeat, export


def test_turns_update_transcript_and_overlay_then_interrupt_after_and_repeat(qtbot, settings, tmp_path, demo_dir):
    # live_available: the window runs as with live audio (no "sound files only" banner in the screenshots);
    # the session is still the sound-file microphone
    w = open_window(qtbot, settings, tmp_path, str(demo_dir), live_available=True)
    wait_listening(qtbot, w)
    assert w.demo_banner.isVisible() and "omnidesk models download Qwen/Qwen2.5-Omni-3B" in w.demo_banner.text
    assert [w.voice_picker.itemText(i) for i in range(w.voice_picker.count())] == ["Chelsie", "Ethan"]
    assert w.weights_picker.isEnabled() and w.weights_picker.toolTip().startswith("int8: the thinker's linears")

    say(qtbot, w)
    qtbot.waitUntil(lambda: turn(w, 1) is not None and turn(w, 1).done, timeout=60000)
    first = turn(w, 1)
    assert first.text and first.text_tokens > 0
    w.paint()
    page = w.transcript.toPlainText()
    assert "You" in page and "spoke for" in page
    assert first.text[:20] in page  # the reply text the engine decoded, as streamed
    # the overlay's timeline: every stage of the turn, in words and as the big number
    w.overlay.render()
    described = w.overlay.bar.describe()
    for stage in ("speech end", "endpoint", "encoded", "prefilled", "1st token", "1st speech token", "1st audio",
                  "playing"):
        assert stage in described
    assert w.overlay.v2v.text() == f"{first.voice_to_voice_s * 1000:.0f} ms"
    assert w.display_state() == "listening"

    # reproducible interruption: cut the next reply 1000 ms into playback, then repeat the question
    w.interrupt_ms.setValue(1000)
    qtbot.mouseClick(w.interrupt_after_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(w.repeat_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: turn(w, 2) is not None and turn(w, 2).interrupted, timeout=60000)
    second = turn(w, 2)
    b = second.barge_in
    assert b.playback_stopped - second.events["playback_start"] == pytest.approx(1.0, abs=0.045)
    assert b.heard_audio_s == pytest.approx(1.0, abs=0.045)
    assert 0 <= b.kept_text_tokens < second.text_tokens and b.rolled_back_tokens > 0
    assert second.heard_text is not None and second.text.startswith(second.heard_text)
    w.paint()
    html = w.transcript.to_html()
    assert "line-through" in html and f"{b.rolled_back_tokens} rolled back" in html
    assert w.display_state() == "interrupted"
    w.overlay_action.trigger()  # F2's action
    assert w.overlay.isVisible()
    w.overlay.render()
    assert "stopped" in w.overlay.bar.describe() and f"kept {b.kept_text_tokens} tokens" in w.overlay.bar.describe()
    assert "median" in w.overlay.recent.text() and "p90" in w.overlay.recent.text()

    # export: the JSON keeps the timeline contract; the CSV has one row per turn
    qtbot.waitUntil(lambda: len(w.timeline_dict()["turns"]) == 2 and w.timeline_dict()["turns"][1]["interrupted"])
    data = json.loads(w.export(str(tmp_path / "t.json")).read_text())
    validate(data)
    assert data["model"]["demo"] is True and data["turns"][1]["barge_in"]["kept_text_tokens"] == b.kept_text_tokens
    rows = w.export(str(tmp_path / "t.csv")).read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("turn,") and ",True," in rows[2]

    shots = ROOT / "docs" if os.environ.get("OMNIDESK_WRITE_SCREENSHOTS") == "1" else tmp_path
    shots.mkdir(exist_ok=True)
    w.statusBar().clearMessage()  # no temporary paths in the pictures
    QApplication.processEvents()
    for widget, name in ((w, "main_window.png"), (w.overlay, "overlay.png")):
        path = shots / name
        assert widget.grab().save(str(path))
        assert 5_000 < path.stat().st_size < 200_000
    close_window(w)


# ---------------------------------------------------------------- the stop button


def test_stop_button_interrupts_and_the_transcript_shows_the_cut(qtbot, settings, tmp_path, demo_dir):
    w = open_window(qtbot, settings, tmp_path, str(demo_dir), realtime=True)
    wait_listening(qtbot, w)
    gaps = record_paint_gaps(w)
    say(qtbot, w)
    qtbot.waitUntil(lambda: w.display_state() == "user_speaking", timeout=20000)
    qtbot.waitUntil(lambda: w.display_state() == "speaking", timeout=30000)
    # click once the user has heard 0.6 s: the playhead, not the wall clock (a busy CI machine lags)
    qtbot.waitUntil(lambda: w.session.speaker.heard_s >= 0.6, timeout=20000)
    qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: turn(w, 1) is not None and turn(w, 1).interrupted, timeout=10000)
    cut = turn(w, 1)
    assert cut.barge_in.heard_audio_s >= 0.6
    assert cut.stop_s is not None and 0 <= cut.stop_s <= 0.1  # the speaker is flushed within a frame of the click
    assert cut.discarded_text  # the thinker ran ahead of the speech: there was an unheard rest
    w.paint()
    html = w.transcript.to_html()
    assert "line-through" in html
    assert w.display_state() == "interrupted"
    qtbot.waitUntil(lambda: "1 confirmed" in w.barge_in_counts.text(), timeout=5000)
    assert max(gaps) < 1.5, f"the UI thread stalled for {max(gaps):.2f} s"
    close_window(w)


# ---------------------------------------------------------------- pickers and settings


def test_device_pickers_list_what_exists(qtbot, settings, tmp_path):
    settings.input_device = "Old Microphone"  # remembered, unplugged since
    w = MainWindow(settings, list_devices=lambda: list(FAKE_DEVICES), find_models=lambda: [], live_available=False)
    qtbot.addWidget(w)
    w.refresh_devices()
    qtbot.waitUntil(lambda: w.output_picker.count() > 1)
    inputs = [w.input_picker.itemText(i) for i in range(w.input_picker.count())]
    outputs = [w.output_picker.itemText(i) for i in range(w.output_picker.count())]
    assert inputs == ["System default", "Built-in Microphone  (default)", "USB Headset",
                      "Sound files (no microphone)", "Old Microphone (not connected)"]
    assert w.input_picker.currentText() == "Old Microphone (not connected)"
    assert outputs == ["System default", "USB Headset", "HDMI Speakers  (default)"]
    # the real list (PortAudio / the audio layer) never raises; whatever exists has names and channels
    for d in list_devices():
        assert d.name and d.inputs + d.outputs > 0


def _real_looking_copy(demo_dir: Path, hub: Path, repo: str) -> Path:
    """The demo checkpoint in the Hugging Face cache layout, without its demo marker."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / "0123abc"
    shutil.copytree(demo_dir, snap)
    raw = json.loads((snap / "config.json").read_text())
    del raw["omnidesk_demo"]
    (snap / "config.json").write_text(json.dumps(raw))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("0123abc")
    return snap


def test_model_picker_opens_the_cached_checkpoint_and_lists_the_demo(qtbot, settings, tmp_path, demo_dir):
    assert choose_model(None, find=lambda: []).source == DEMO  # nothing real here: the demo
    _real_looking_copy(demo_dir, tmp_path / "hub", "Qwen/Qwen2.5-Omni-3B")
    assert [e.source for e in catalog()] == ["Qwen/Qwen2.5-Omni-3B", DEMO, "moshi-demo", "qwen3-demo"]
    w = open_window(qtbot, settings, tmp_path, None, find_models=None)  # the real find_checkpoints
    wait_listening(qtbot, w)
    assert w.loaded.name == "Qwen/Qwen2.5-Omni-3B" and not w.loaded.demo
    assert not w.demo_banner.isVisible()
    qtbot.waitUntil(lambda: w.model_picker.count() == 6)
    items = [w.model_picker.itemText(i) for i in range(w.model_picker.count())]
    assert items[0] == "Qwen/Qwen2.5-Omni-3B" and items[1].startswith("Demo model") and "folder" in items[4]
    assert items[5] == "Server…"  # a vLLM-Omni server (test_gui_remote.py)
    assert items[2] == "Moshi demo (full duplex) (replies are noise)"
    assert "Qwen3-Omni" in items[3] and "noise" in items[3]
    assert w.model_picker.currentText() == "Qwen/Qwen2.5-Omni-3B"
    # picking the demo loads it in the background and says what it is
    w.model_picker.setCurrentIndex(1)
    w.model_picker.activated.emit(1)
    qtbot.waitUntil(lambda: w.loaded is not None and w.loaded.demo, timeout=60000)
    assert w.demo_banner.isVisible() and settings.model == DEMO
    close_window(w)


def test_settings_persist_and_push_to_talk_uses_space(qtbot, settings, tmp_path, demo_dir):
    w = open_window(qtbot, settings, tmp_path, str(demo_dir))
    wait_listening(qtbot, w)
    qtbot.waitUntil(lambda: w.input_picker.findData("USB Headset") >= 0)
    w.mode_picker.setCurrentIndex(1)  # push to talk
    w.output_kind.setCurrentIndex(1)  # headphones
    i = w.input_picker.findData("USB Headset")
    w.input_picker.setCurrentIndex(i)
    w.input_picker.activated.emit(i)
    w.voice_picker.setCurrentIndex(1)
    w.voice_picker.activated.emit(1)
    w.interrupt_ms.setValue(1250)
    w.overlay_action.trigger()
    wait_listening(qtbot, w)  # the device change reopened the session
    assert w.display_state() == "push_to_talk"
    assert w.engine_config.voice == "Ethan"
    # push to talk: Space held anywhere talks (and does not click the focused button)
    session = w.session
    w.stop_button.setFocus()
    qtbot.keyPress(w.stop_button, Qt.Key.Key_Space)
    assert session.talk_pressed
    qtbot.keyRelease(w.stop_button, Qt.Key.Key_Space)
    assert not session.talk_pressed
    qtbot.mouseClick(w.mute_button, Qt.MouseButton.LeftButton)
    assert session.muted and w.mute_action.isChecked() and w.display_state() == "muted"
    close_window(w)

    again = Settings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    assert (again.push_to_talk, again.headphones, again.input_device, again.voice, again.interrupt_after_ms,
            again.overlay_visible) == (True, True, "USB Headset", "Ethan", 1250, True)
    w2 = open_window(qtbot, again, tmp_path, str(demo_dir))
    wait_listening(qtbot, w2)
    assert w2.display_state() == "push_to_talk"
    qtbot.waitUntil(lambda: w2.input_picker.currentData() == "USB Headset")
    assert w2.mode_picker.currentIndex() == 1 and w2.output_kind.currentIndex() == 1
    assert w2.voice_picker.currentText() == "Ethan" and w2.interrupt_ms.value() == 1250
    assert w2.overlay.isVisible()
    close_window(w2)


# ---------------------------------------------------------------- errors in plain words


def test_errors_are_plain_words_with_details_in_the_log(qtbot, settings, tmp_path, demo_dir):
    log_path = setup_logging(tmp_path / "state")
    try:
        w = open_window(qtbot, settings, tmp_path, str(tmp_path / "no-such-model"))
        qtbot.waitUntil(lambda: w.error_banner.isVisible(), timeout=30000)
        text = w.error_banner.text
        assert "cannot be used" in text and "not found" in text and "Traceback" not in text
        assert "Traceback" in log_path.read_text()  # the details went to the log file
        w.error_banner.buttons["Use the demo model"].click()
        wait_listening(qtbot, w)
        assert w.loaded.demo and not w.error_banner.isVisible()
        close_window(w)
    finally:
        import logging

        for h in list(logging.getLogger("omnidesk").handlers):
            logging.getLogger("omnidesk").removeHandler(h)
            h.close()

    oom = plain_message(ModelTooLargeError("/models/7b: needs 22.1 GiB, 15.2 GiB free; try Qwen/Qwen2.5-Omni-3B"),
                        "loading the model")
    assert oom.startswith("Not enough GPU memory") and "/models/7b" not in oom and "3B" in oom


def test_a_failed_reply_is_shown_and_the_conversation_goes_on(qtbot, settings, tmp_path, demo_dir, monkeypatch):
    from omnidesk.models.qwen2_5_omni.bigvgan import BigVGAN

    calls = []
    original = BigVGAN.forward

    def failing_second_chunk(self, *args, **kwargs):  # the vocoder dies while the first chunk plays
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected vocoder failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BigVGAN, "forward", failing_second_chunk)
    log_path = setup_logging(tmp_path / "state")
    try:
        w = open_window(qtbot, settings, tmp_path, str(demo_dir))
        wait_listening(qtbot, w)
        say(qtbot, w)
        qtbot.waitUntil(lambda: w.error_banner.isVisible(), timeout=60000)
        text = w.error_banner.text
        assert "failed in the vocoder" in text and "injected vocoder failure" in text and "Traceback" not in text
        assert "Open the log" in w.error_banner.buttons and "Retry" not in w.error_banner.buttons
        assert "injected vocoder failure" in log_path.read_text() and "Traceback" in log_path.read_text()
        qtbot.waitUntil(lambda: turn(w, 1) is not None and turn(w, 1).failed is not None, timeout=10000)
        w.paint()
        assert "This turn was dropped" in w.transcript.toPlainText()
        wait_listening(qtbot, w)  # not stuck in "thinking"

        say(qtbot, w)  # the next turn works, and the banner goes once it has
        qtbot.waitUntil(lambda: turn(w, 2) is not None and turn(w, 2).done, timeout=60000)
        assert turn(w, 2).text and not w.error_banner.isVisible()
        qtbot.waitUntil(lambda: len(w.timeline_dict()["turns"]) == 2)
        data = w.timeline_dict()
        validate(data)
        assert data["turns"][0]["error"]["stage"] == "vocoder" and "error" not in data["turns"][1]
        close_window(w)
    finally:
        import logging

        for h in list(logging.getLogger("omnidesk").handlers):
            logging.getLogger("omnidesk").removeHandler(h)
            h.close()


class AudioDeviceError(RuntimeError):
    """Stands in for omnidesk.audio.device.AudioDeviceError (matched by name)."""


def test_no_microphone_is_shown_with_a_way_out(qtbot, settings, tmp_path, demo_dir):
    kinds = []

    class NoMicSession:
        def __init__(self, *args):
            pass

        def start(self):
            raise AudioDeviceError("No microphone found: plug one in or pick another input device.")

        def close(self):
            pass

    def factory(kind, executor, live_settings, engine_config, on_update, timeline):
        kinds.append(kind)
        if kind == "live":
            return NoMicSession()
        return FileMicSession(executor, live_settings, engine_config, on_update, timeline, realtime=False)

    w = open_window(qtbot, settings, tmp_path, str(demo_dir), live_available=True, factory=factory)
    qtbot.waitUntil(lambda: w.error_banner.isVisible(), timeout=60000)
    assert w.error_banner.text.startswith("No microphone found") and w.display_state() == "idle"
    w.error_banner.buttons["Use sound files instead"].click()
    wait_listening(qtbot, w)
    assert kinds == ["live", "files"] and settings.input_device == SOUND_FILES
    assert not w.error_banner.isVisible()

    # a running session that stops by itself (device lost) reports on the engine thread; Retry reopens it
    import threading

    bridge = w.conversation.bridge
    threading.Thread(target=bridge.on_update, args=("error", "the microphone was unplugged")).start()
    qtbot.waitUntil(lambda: w.error_banner.isVisible())
    assert w.error_banner.text == "The microphone was unplugged." and w.display_state() == "idle"
    w.error_banner.buttons["Retry"].click()
    wait_listening(qtbot, w)
    assert w.conversation.bridge is not bridge and not w.error_banner.isVisible()
    close_window(w)


# ---------------------------------------------------------------- the bridge


def test_bridge_holds_back_a_character_still_arriving(qtbot):
    """A reply streaming a two-token character (byte-level BPE, here "é" = C3 A9 in two tokens):
    the transcript never shows the U+FFFD of its first half; a reply that ends on half a
    character shows it (that is what the model said)."""
    from omnidesk.engine.timeline import Timeline
    from omnidesk.gui.bridge import EngineBridge

    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9"}
    bridge = EngineBridge(decode=lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"))
    views = []
    bridge.turn_changed.connect(lambda: views.extend(bridge.take_turns()))
    done = []
    bridge.turn_done.connect(done.append)
    turn = Timeline().new_turn()
    bridge.on_update("turn", turn)
    texts = []
    for i in (1, 2, 3):
        turn.text_token_ids.append(i)
        bridge.on_update("reply", turn)
        qtbot.waitUntil(lambda: views and views[-1].text_tokens == i)
        texts.append(views[-1].text)
    assert texts == ["caf", "caf", "café"]
    turn.text_token_ids[:] = [1, 2]  # ends on half a character
    bridge.on_update("done", turn)
    assert done[-1].text == "caf\ufffd"


def test_bridge_copies_on_the_engine_thread_and_coalesces_replies(qtbot):
    """200 streaming updates from another thread reach the UI thread as a few queued signals,
    carrying immutable copies; the final state arrives in order."""
    import threading

    from omnidesk.engine.engine import TurnState
    from omnidesk.engine.timeline import BargeIn, Timeline
    from omnidesk.gui.bridge import EngineBridge

    bridge = EngineBridge(decode=lambda ids: " ".join(str(i) for i in ids))
    seen = {"changed": 0, "states": [], "views": [], "cut": None}
    queued = Qt.ConnectionType.QueuedConnection

    def take():
        seen["changed"] += 1
        seen["views"] += bridge.take_turns()

    bridge.turn_changed.connect(take, queued)
    bridge.state_changed.connect(seen["states"].append, queued)
    bridge.turn_interrupted.connect(lambda v: seen.__setitem__("cut", v), queued)
    timeline = Timeline()

    def engine():
        turn = timeline.new_turn()
        bridge.on_update("state", TurnState.USER_SPEAKING)
        bridge.on_update("turn", turn)
        for i in range(200):
            turn.text_token_ids.append(i)
            bridge.on_update("reply", turn)
        turn.text_token_ids.append(999)  # changes after the last update must not leak into the copies
        turn.interrupt(BargeIn(onset=1.0, confirmed=1.3, playback_stopped=1.32, heard_audio_s=0.5,
                               kept_text_tokens=3, rolled_back_tokens=198, thinker_cache_before=400,
                               thinker_cache_after=202))
        bridge.on_update("interrupted", turn)
        bridge.on_update("state", TurnState.LISTENING)

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    qtbot.waitUntil(lambda: seen["cut"] is not None and len(seen["states"]) == 2)
    assert seen["states"] == [TurnState.USER_SPEAKING, TurnState.LISTENING]
    assert 1 <= seen["changed"] < 200
    last = seen["views"][-1]
    assert last.text_tokens == 200 and last.text.endswith("199")
    cut = seen["cut"]
    assert cut.interrupted and cut.heard_text == "0 1 2" and cut.stop_s == pytest.approx(0.02)
    assert cut.discarded_text.startswith(" 3 4") and cut.discarded_text.endswith("999")


def test_the_overlay_never_covers_the_banners_and_reopens_only_where_it_was_on_screen(qtbot, settings, tmp_path,
                                                                                       demo_dir):
    """Issue 23.9: with the overlay remembered as open and no window manager, it covered the window's top and
    hid the "no microphone" banner.  It opens clear of the banners, where it was when that spot is free and
    on a screen, and remembers where the user put it."""
    from PySide6.QtGui import QGuiApplication

    w = open_window(qtbot, settings, tmp_path, str(demo_dir))
    try:
        w.move(0, 0)
        w.resize(900, 600)
        w.error_banner.show_message("No microphone found.")
        screen = QGuiApplication.primaryScreen().availableGeometry()

        def placed():
            w.set_overlay_visible(False)
            w.set_overlay_visible(True)
            return w.overlay.frameGeometry()

        for remembered in (None, (w.x() + 10, w.y() + 10), (screen.right() + 4000, screen.bottom() + 4000)):
            settings.overlay_pos = remembered  # never moved / over the banners / on no screen any more
            rect = placed()
            assert not rect.intersects(w._banner_area()), remembered
            assert any(s.availableGeometry().intersects(rect) for s in QGuiApplication.screens())
            assert w.error_banner.isVisible()
        # a free spot on the screen is used again, and where the user moves it is remembered
        free = (screen.left() + 20, w._banner_area().bottom() + 40)
        settings.overlay_pos = free
        assert (placed().x(), placed().y()) == free
        w.overlay.move(free[0] + 30, free[1] + 10)
        assert settings.overlay_pos == (free[0] + 30, free[1] + 10)
    finally:
        close_window(w)


def test_the_window_says_which_end_of_turn_detector_runs_and_why(qtbot, settings, tmp_path, demo_dir, monkeypatch):
    """Auto runs Smart Turn where it is installed; where it is not, the window says the silence rule
    runs and what is missing."""
    import importlib.util

    from omnidesk.engine.smart_turn import SmartTurn, TurnModelUnavailable

    settings.end_of_turn = "auto"
    installed = SmartTurn.available()
    w = open_window(qtbot, settings, tmp_path, str(demo_dir))
    wait_listening(qtbot, w)
    assert w.end_of_turn_status.text() == ("In use: Smart Turn model" if installed else
                                           w._end_of_turn_in_use(w.session))
    if not installed:
        assert "silence" in w.end_of_turn_status.text() and "not available" in w.end_of_turn_status.text()
    close_window(w)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real_find_spec(name, *a))

    def not_installed(cls, path=None):
        raise TurnModelUnavailable("onnxruntime is not installed")

    monkeypatch.setattr(SmartTurn, "load", classmethod(not_installed))
    w = open_window(qtbot, settings, tmp_path, str(demo_dir))
    wait_listening(qtbot, w)
    text = w.end_of_turn_status.text()
    assert text.startswith("In use: silence (400 ms). Smart Turn is not available") and "onnxruntime" in text
    close_window(w)
