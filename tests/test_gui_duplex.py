"""The window with a full-duplex model (the Moshi demo, offscreen): both sides at once, the frame clock
in the overlay, Stop reply = flush + mute, the demo notice; plus the overlay's "behind" colours and the
bridge's duplex mailbox on their own.

As in test_gui.py, every window uses the sound-file microphone session (FileMicSession) on the real
engine, settings in a temporary INI file and temporary cache/state dirs.  Waits are on state
(qtbot.waitUntil), never on the wall clock.
"""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

from omnidesk.engine.duplex import DuplexView  # noqa: E402
from omnidesk.engine.timeline import validate  # noqa: E402
from omnidesk.gui.bridge import DuplexShown, EngineBridge  # noqa: E402
from omnidesk.gui.devices import Device  # noqa: E402
from omnidesk.gui.file_mic import FileMicSession  # noqa: E402
from omnidesk.gui.latency import DUPLEX_CSV_COLUMNS, csv_text  # noqa: E402
from omnidesk.gui.main_window import STOP_TIP_DUPLEX, MainWindow  # noqa: E402
from omnidesk.gui.overlay import LATE, LatencyOverlay  # noqa: E402
from omnidesk.gui.worker import wait_for_background  # noqa: E402
from omnidesk.models.families import MOSHI  # noqa: E402
from omnidesk.models.moshi.demo import make_moshi_demo  # noqa: E402
from paint_gaps import record_paint_gaps  # noqa: E402
from test_gui import private_dirs, settings  # noqa: E402,F401  (fixtures: private dirs, a throwaway settings file)

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ROOT / "tests" / "fixtures" / "question.wav"
DEVICES = [Device(0, "Built-in Microphone", inputs=1, outputs=2, is_default_input=True, is_default_output=True)]


@pytest.fixture(scope="module")
def moshi_demo_dir(tmp_path_factory):
    return make_moshi_demo(tmp_path_factory.mktemp("gui-moshi") / "moshi-demo")


def open_window(qtbot, settings, tmp_path, model, realtime=True):
    def files_factory(kind, executor, live_settings, engine_config, on_update, timeline):
        return FileMicSession(executor, live_settings, engine_config, on_update, timeline, realtime=realtime)

    w = MainWindow(settings, model=model, session_factory=files_factory, list_devices=lambda: list(DEVICES),
                   find_models=lambda: [], log_path=tmp_path / "state" / "omnidesk.log", live_available=False)
    qtbot.addWidget(w)
    w.show()
    w.start()
    return w


def close_window(w):
    w.close()
    w.shutdown()
    assert wait_for_background(30000)


def _number(text: str) -> float:
    """"17.3 ms" -> 17.3; raises if the overlay shows no number."""
    return float(text.split()[0])


# ---------------------------------------------------------------- the Moshi demo in the window


def test_moshi_demo_shows_both_sides_the_frame_clock_and_stop_mutes(qtbot, settings, tmp_path, moshi_demo_dir):
    w = open_window(qtbot, settings, tmp_path, str(moshi_demo_dir))
    qtbot.waitUntil(lambda: w.session is not None and w.conversation.running, timeout=60000)

    # what it is: the family's demo notice, and the controls of a full-duplex model
    assert w.loaded.duplex and w.loaded.demo and w.loaded.name == "Moshi demo model"
    assert w.demo_banner.isVisible()
    assert "Moshi demo model" in w.demo_banner.text and "random weights" in w.demo_banner.text
    assert MOSHI.demo_notice.split(": ", 1)[1].split(" - ")[0] in w.demo_banner.text
    assert w.duplex_activity.isVisible()
    assert not w.voice_picker.isEnabled() and "one voice" in w.voice_picker.toolTip()
    assert not w.weights_picker.isEnabled() and "Moshi loads its weights as stored" in w.weights_picker.toolTip()
    assert w.stop_button.isEnabled() and w.stop_button.toolTip() == STOP_TIP_DUPLEX
    assert w.interrupt_after_button.isEnabled()
    w.overlay_action.trigger()  # F2
    assert w.overlay.isVisible() and w.overlay.duplex_panel.isVisible() and not w.overlay.turn_panel.isVisible()

    gaps = record_paint_gaps(w)

    w.say_file(str(QUESTION))
    # full duplex: the user is heard while the assistant talks (the demo's random text never pauses)
    qtbot.waitUntil(lambda: w.duplex_activity.states == {"you": "speaking", "assistant": "speaking"}, timeout=30000)
    assert w.display_state() == "both_speaking"
    assert w.state_indicator.text() == "You're both speaking"
    qtbot.waitUntil(lambda: w.session.engine.user_segments and w.session.engine.user_segments[0].end is not None,
                    timeout=30000)
    qtbot.waitUntil(lambda: w.duplex_activity.states["you"] == "quiet", timeout=10000)

    # the overlay shows the clock the engine measured
    engine = w.session.engine
    qtbot.waitUntil(lambda: w.overlay.duplex_shown is not None and w.overlay.duplex_shown.view.frames > 0)
    w.overlay.render()  # what is on screen now and the view it came from, read together on this thread
    shown = w.overlay.duplex_shown.view
    values = w.overlay.duplex_values
    frames = int(values["frames"].text())
    assert frames == shown.frames and 0 < frames <= len(engine.steps_ms)
    steps = np.asarray(engine.steps_ms[:frames][-500:])  # append-only: the steps this view summed up
    assert _number(values["p50"].text()) == pytest.approx(np.percentile(steps, 50), abs=0.051)
    assert _number(values["p90"].text()) == pytest.approx(np.percentile(steps, 90), abs=0.051)
    assert _number(values["last"].text()) == pytest.approx(steps[-1], abs=0.051)
    assert _number(w.overlay.v2v.text()) == pytest.approx(np.percentile(steps, 50), abs=0.51)
    assert "budget 80 ms" in w.overlay.v2v_caption.text()
    assert int(values["late"].text()) == shown.late_frames and int(values["dropped"].text()) == shown.dropped_frames
    assert _number(values["lag"].text()) == pytest.approx(shown.lag_s, abs=0.0051)
    for key in ("p50", "p90", "last"):  # red exactly when slower than the frame
        assert values[key].property("behind") == (_number(values[key].text()) > 80.0)

    # the transcript: the assistant's running text, one line per exchange
    w.paint()
    page = " ".join(w.transcript.toPlainText().split())
    assert "You" in page and "OmniDesk" in page
    said = [text for who, text in w.transcript.duplex.line_texts() if who == "assistant" and text]
    assert said and " ".join(said[-1].split())[:40] in page

    # Stop reply: the speaker is flushed and the assistant muted until its text goes quiet
    speaker = w.session.speaker
    flushes = []
    flush = speaker.flush

    def spy_flush(fade_ms=None):
        flushes.append(fade_ms)
        return flush(fade_ms)

    speaker.flush = spy_flush  # the engine's thread calls it
    qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(engine.stops) == 1, timeout=10000)
    assert flushes and flushes[0] is None  # the stop's flush (with the fade), not a full-buffer drop
    qtbot.waitUntil(lambda: w.duplex is not None and w.duplex.view.muted, timeout=10000)
    qtbot.waitUntil(lambda: w.duplex_activity.states["assistant"] == "muted", timeout=5000)
    assert w.display_state() == "assistant_muted" and w.state_indicator.text() == "Assistant muted"
    assert "Stopped: the assistant is muted" in w.transcript.toPlainText()
    qtbot.waitUntil(lambda: w.barge_in_counts.text() == "Stops: 1", timeout=5000)

    # the export carries the engine's duplex section (no turns: a duplex conversation has none)
    qtbot.waitUntil(lambda: len(w.timeline_dict().get("duplex", {}).get("stops", [])) == 1)
    data = json.loads(w.export(str(tmp_path / "duplex.json")).read_text())
    validate(data)
    assert data["turns"] == [] and data["model"]["family"] == "moshi" and data["model"]["demo"] is True
    assert len(data["duplex"]["step_ms"]) >= frames and data["duplex"]["user_speech"][0][1] is not None
    rows = w.export(str(tmp_path / "duplex.csv")).read_text().splitlines()
    assert rows[0] == ",".join(DUPLEX_CSV_COLUMNS) and len(rows) == 1 + len(data["duplex"]["exchanges"])

    assert max(gaps) < 1.5, f"the UI thread stalled for {max(gaps):.2f} s"
    close_window(w)


def test_a_failed_duplex_step_shows_a_banner_that_clears_once_the_model_steps_again(qtbot, settings, tmp_path,
                                                                                     moshi_demo_dir):
    from omnidesk.engine.executor import stage

    w = open_window(qtbot, settings, tmp_path, str(moshi_demo_dir))
    qtbot.waitUntil(lambda: w.session is not None and w.conversation.running, timeout=60000)
    ex = w.loaded.executor
    step, failed = ex.step, []

    def fail_once(frame):  # the engine's worker thread calls it
        if not failed:
            failed.append(True)
            with stage("vocoder"):
                raise RuntimeError("decoder exploded")
        return step(frame)

    ex.step = fail_once
    qtbot.waitUntil(lambda: w.error_banner.isVisible(), timeout=20000)
    assert "vocoder" in w.error_banner.text and "decoder exploded" in w.error_banner.text
    # the model restarted its stream and keeps stepping: the banner goes once it has for a second
    qtbot.waitUntil(lambda: not w.error_banner.isVisible(), timeout=30000)
    assert w.duplex is not None and w.duplex.view.frames >= 13 and w.conversation.running
    close_window(w)


def test_csv_export_of_a_duplex_session_has_one_row_per_exchange():
    timeline = {"model": {}, "device": "cpu", "turns": [], "duplex": {"exchanges": [
        {"user_speech_start": 1.0, "user_speech_end": 2.5, "assistant_speech_start": 2.74, "delay_s": 0.24},
        {"user_speech_start": 5.0, "user_speech_end": 6.0, "assistant_speech_start": 5.8, "delay_s": -0.2}]}}
    assert csv_text(timeline).splitlines() == [",".join(DUPLEX_CSV_COLUMNS), "1,1.0,2.5,2.74,240.0",
                                               "2,5.0,6.0,5.8,-200.0"]


# ---------------------------------------------------------------- the overlay's clock on its own


def _view(**changes) -> DuplexView:
    base = dict(frames=40, frame_s=0.08, step_ms_p50=20.0, step_ms_p90=30.0, last_step_ms=25.0, late_frames=0,
                dropped_frames=0, lag_s=0.0, user_speaking=False, assistant_speaking=True, muted=False,
                text="hello there", last_delay_s=None, delays_s=())
    base.update(changes)
    return DuplexView(**base)


def test_overlay_shows_a_step_slower_than_the_frame_in_red(qtbot):
    overlay = LatencyOverlay()
    qtbot.addWidget(overlay)
    overlay.set_duplex(True)
    overlay.show_duplex(DuplexShown(_view()))
    overlay.render()
    values = overlay.duplex_values
    assert [values[k].text() for k in ("p50", "p90", "last", "frames")] == ["20.0 ms", "30.0 ms", "25.0 ms", "40"]
    assert not any(values[k].property("behind") for k in ("p50", "p90", "last", "late", "dropped", "lag"))
    assert values["delay"].text() == "–"

    slow = _view(step_ms_p90=95.0, last_step_ms=120.5, late_frames=3, dropped_frames=2, lag_s=0.42,
                 last_delay_s=-0.15, delays_s=(0.4, -0.15, 0.2))
    overlay.show_duplex(DuplexShown(slow))
    overlay.render()
    assert values["last"].text() == "120.5 ms" and values["late"].text() == "3" and values["lag"].text() == "0.42 s"
    for key in ("p90", "last", "late", "dropped", "lag"):
        assert values[key].property("behind") is True and LATE.name() in values[key].styleSheet(), key
    assert values["p50"].property("behind") is False and overlay.v2v.property("behind") is False
    assert values["last"].accessibleDescription().startswith("slower than the frame")
    assert values["delay"].text() == "−150 ms (overlap)"
    assert values["delay_median"].text() == "+200 ms (3 exchanges)"
    overlay.show_duplex(DuplexShown(_view(step_ms_p90=30.0, last_step_ms=25.0)))  # back in time: not red
    overlay.render()
    assert values["last"].property("behind") is False and LATE.name() not in values["last"].styleSheet()
    assert overlay.v2v.text() == "20 ms" and "budget 80 ms" in overlay.v2v_caption.text()

    overlay.set_duplex(False)  # a turn-based model again: the turn's stages, no clock
    assert overlay.turn_panel.isVisibleTo(overlay) and not overlay.duplex_panel.isVisibleTo(overlay)


# ---------------------------------------------------------------- the bridge


def test_bridge_coalesces_duplex_views_and_splits_the_text_per_exchange(qtbot):
    """Every view passes the bridge on the engine's thread (so no start of speech is missed); the UI
    thread gets a few queued signals and the latest view, with the text cut at each exchange."""
    bridge = EngineBridge()
    seen = {"signals": 0, "shown": None}

    def take():
        seen["signals"] += 1
        seen["shown"] = bridge.take_duplex()

    bridge.duplex_changed.connect(take, Qt.ConnectionType.QueuedConnection)
    # frames: the assistant says "hi", the user talks over it for one frame, the assistant says "ok" later
    script = ([_view(assistant_speaking=True, text="hi")] * 100 + [_view(user_speaking=True, text="hi")]
              + [_view(assistant_speaking=False, text="hi")] * 100
              + [_view(assistant_speaking=True, text="hi ok")] * 100)
    done = threading.Event()

    def engine():
        for i, view in enumerate(script):
            bridge.on_update("duplex", DuplexView(**{**view.__dict__, "frames": i + 1}))
        done.set()

    threading.Thread(target=engine).start()
    qtbot.waitUntil(lambda: done.is_set() and seen["shown"] is not None and seen["shown"].view.frames == len(script))
    assert 1 <= seen["signals"] < len(script)
    shown = seen["shown"]
    assert shown.lines == (("assistant", 0), ("you", 2), ("assistant", 2))
    assert shown.line_texts() == [("assistant", "hi"), ("you", ""), ("assistant", "ok")]
    assert shown.line_texts(last=1) == [("assistant", "ok")]
