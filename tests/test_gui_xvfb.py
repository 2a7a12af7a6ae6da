"""`omnidesk` (no subcommand) opens the window on a real X server: Xvfb, with Qt's xcb plugin.

This is the fresh-install check of the desktop issue: the app starts, loads the demo model in the
background and keeps running; nothing is mocked and no offscreen platform is forced."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from omnidesk.models.qwen2_5_omni.demo import make_demo


@pytest.mark.skipif(shutil.which("xvfb-run") is None, reason="xvfb-run missing (dev/setup.sh --test installs xvfb)")
def test_omnidesk_opens_the_window_under_xvfb(tmp_path):
    demo = make_demo(tmp_path / "demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = ["xvfb-run", "-a", "-s", "-screen 0 1280x800x24", sys.executable, "-m", "omnidesk", "--model", str(demo)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any("NOTE:" in line for line in lines):
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"omnidesk exited with {proc.returncode}:\n" + "".join(lines)
        assert any("replies are noise" in line for line in lines), "".join(lines)  # the demo model loaded
        time.sleep(2.0)
        assert proc.poll() is None, "".join(lines)  # still running with the model loaded
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    output = "".join(lines)
    assert "Traceback" not in output, output
    assert "in the terminal instead" not in output, output  # the window opened, not the fallback
