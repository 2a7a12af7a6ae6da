"""`omnidesk talk --server URL` end to end: a subprocess against the vLLM-Omni protocol double
(tests/vllm_omni_double.py), with a clean home; and the errors a user meets when connecting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from omnidesk.engine.timeline import validate
from vllm_omni_double import DEFAULT_TEXT, QWEN25, Reply, VllmOmniDouble

FIXTURES = Path(__file__).parent / "fixtures"
QUESTION = FIXTURES / "question.wav"
SECOND = FIXTURES / "second_question.wav"


def omnidesk(tmp_path: Path, *argv, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
             "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state"),
             "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin", "QT_QPA_PLATFORM": "offscreen"}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "omnidesk", *map(str, argv)], capture_output=True, text=True,
                          env=clean, timeout=180)


def test_talk_with_a_server_plays_its_replies_and_writes_the_network_times(tmp_path):
    out, tl = tmp_path / "out.wav", tmp_path / "t.json"
    with VllmOmniDouble(api_key="sesame") as double:
        proc = omnidesk(tmp_path, "talk", "--server", double.url, "--input", QUESTION, "--input", SECOND,
                        "--end-of-turn", "fixed", "--voice", "Chelsie", "--output", out, "--timeline", tl,
                        env={"OMNIDESK_API_KEY": "sesame"})
        requests = list(double.requests)
    assert proc.returncode == 0, proc.stderr
    host = double.url
    assert f"connected: {double.model} on {host} (remote)" in proc.stdout
    assert "audio leaves this machine" in proc.stdout
    assert proc.stdout.count("server + network: first byte") == 2
    d = json.loads(tl.read_text())
    validate(d)
    assert d["model"]["family"] == "remote" and d["model"]["server"] == host and d["device"] == f"remote ({host})"
    assert len(d["turns"]) == 2
    for turn in d["turns"]:
        assert turn["text"] == "".join(DEFAULT_TEXT) and not turn["interrupted"]
        net = turn["network"]
        assert net["server"] == host and net["first_audio_ms"] is not None and net["error"] is None
        assert turn["events"]["playback_start"] is not None
    assert [r.body["speaker"] for r in requests] == ["Chelsie", "Chelsie"]
    assert requests[1].body["messages"][2] == {"role": "assistant", "content": "".join(DEFAULT_TEXT)}
    audio, rate = sf.read(str(out))
    assert rate == 24000 and np.abs(audio).max() > 0.05  # the server's audio was played


def test_talk_says_when_the_server_sends_its_audio_only_at_the_end(tmp_path):
    out, tl = tmp_path / "out.wav", tmp_path / "t.json"
    with VllmOmniDouble(model=QWEN25) as double:
        double.default = Reply(streaming=False, audio_s=2.6)
        proc = omnidesk(tmp_path, "talk", "--server", double.url, "--input", QUESTION, "--end-of-turn", "fixed",
                        "--output", out, "--timeline", tl)
    assert proc.returncode == 0, proc.stderr
    assert "NOTE: this server sends the reply's audio only when it is complete" in proc.stdout
    assert "the audio came only when the reply was complete" in proc.stdout
    assert json.loads(tl.read_text())["turns"][0]["network"]["audio_only_at_end"] is True


def test_talk_with_a_server_fails_with_words(tmp_path):
    args = ["--input", QUESTION, "--output", tmp_path / "o.wav", "--timeline", tmp_path / "t.json"]
    with VllmOmniDouble(api_key="sesame") as double:
        url = double.url
        refused = omnidesk(tmp_path, "talk", "--server", url, "--api-key", "wrong", *args)
        both = omnidesk(tmp_path, "talk", "--server", url, "--model", "demo", *args)
    unreachable = omnidesk(tmp_path, "talk", "--server", url, *args)
    not_a_url = omnidesk(tmp_path, "talk", "--server", "gpu-box:8091", *args)
    for proc in (refused, both, unreachable, not_a_url):
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert f"the server at {url} answered 401 (Unauthorized): the API key was refused" in refused.stderr
    assert "--model and --server both name the model" in both.stderr
    assert f"error: cannot reach the server at {url}" in unreachable.stderr
    assert "give the server's URL as http://HOST:PORT" in not_a_url.stderr
