"""A private PulseAudio server with virtual devices, for end-to-end audio tests.

The session fixture :func:`pulse_server` starts ``pulseaudio`` (as root too, in
a container) with its own runtime/state dirs under a tmp dir, a unix socket
with anonymous auth, and two null sinks:

* ``omnidesk_speaker``: what the app plays to; tests capture it from
  ``omnidesk_speaker.monitor`` (:meth:`PulseHarness.record_speaker`);
* ``omnidesk_mic``: what the test plays into (:meth:`PulseHarness.play_into_mic`);
  the app records from ``omnidesk_mic.monitor``.

PortAudio (sounddevice) reaches the server through ALSA's pulse plugin
(``libasound2-plugins``; the ``pulse``/``default`` ALSA devices).  The
harness points the client side at the private server with ``PULSE_SERVER``
and makes ``omnidesk_mic.monitor`` / ``omnidesk_speaker`` the defaults
(``PULSE_SOURCE``/``PULSE_SINK`` plus ``pactl set-default-*``), then
re-initialises PortAudio so it enumerates the pulse device.  Environment and
PortAudio state are restored and the server is killed at the end.

Needs the Debian packages ``pulseaudio pulseaudio-utils libasound2-plugins``;
when they are missing and we are root the fixture tries ``apt-get install``
once (``OMNIDESK_AUDIO_APT=0`` disables that), otherwise it skips with the reason.
Every subprocess has a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

SPEAKER = "omnidesk_speaker"
MIC = "omnidesk_mic"
APT_PACKAGES = ("pulseaudio", "pulseaudio-utils", "libasound2-plugins")
_TOOLS = ("pulseaudio", "pactl", "pacat", "parec")
# pacat's buffer when it plays a question.  With 50 ms it had to run every ~25 ms: with one core
# busy and the app decoding on the other it sometimes did not, and the server played a gap into
# the question (bench/live_latency.py: the comma pause of "..., please?" grew past the 400 ms
# rule, and the recording no longer matched the question).  With a second queued at the server a
# stall of under a second changes nothing.
PLAYER_LATENCY_MS = 1000


def _missing_tools() -> list[str]:
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    plugin_dirs = [Path("/usr/lib/x86_64-linux-gnu/alsa-lib"), Path("/usr/lib/aarch64-linux-gnu/alsa-lib"),
                   Path("/usr/lib/alsa-lib"), Path("/usr/lib64/alsa-lib")]
    if not any((d / "libasound_module_pcm_pulse.so").exists() for d in plugin_dirs):
        missing.append("ALSA pulse plugin (libasound2-plugins)")
    return missing


def ensure_installed() -> str | None:
    """Install the packages if needed and possible; return a skip reason or None."""
    missing = _missing_tools()
    if not missing:
        return None
    if os.environ.get("OMNIDESK_AUDIO_APT", "1") == "0":
        return f"missing {', '.join(missing)} and OMNIDESK_AUDIO_APT=0"
    if os.geteuid() != 0:
        return f"missing {', '.join(missing)}; not root, cannot apt-get install {' '.join(APT_PACKAGES)}"
    if shutil.which("apt-get") is None:
        return f"missing {', '.join(missing)} and no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]
    try:
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:  # stale package lists: update once and retry
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
            r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "apt-get install timed out"
    if r.returncode != 0:
        return f"apt-get install {' '.join(APT_PACKAGES)} failed: {r.stderr.strip()[-300:]}"
    missing = _missing_tools()
    return f"still missing after apt-get: {', '.join(missing)}" if missing else None


class PulseHarness:
    """``rate``, ``sample_format`` (e.g. "float32le") and ``channels``: the null sinks' sample spec
    (PulseAudio's default format and channels when None)."""

    def __init__(self, root: Path, rate: int = 48000, sample_format: str | None = None, channels: int | None = None):
        self.root = Path(root)
        self.rate = rate
        self.spec = f"rate={rate}" + (f" format={sample_format}" if sample_format else "") \
            + (f" channels={channels}" if channels else "")
        self.socket = self.root / "native"
        self.server = f"unix:{self.socket}"
        self.log_path = self.root / "pulseaudio.log"
        self.proc: subprocess.Popen | None = None
        self._saved_env: dict[str, str | None] = {}
        self.last_recording_start: float | None = None  # set by record_speaker / record
        self.last_mic_recording_start: float | None = None  # set by record

    # ------------------------------------------------------------ lifecycle

    def command(self) -> list[str]:
        sink = "module-null-sink sink_name={name} {spec} sink_properties=device.description={name}"
        return [
            "pulseaudio", "--daemonize=no", "--system=false", "--exit-idle-time=-1", "--disallow-exit",
            "-n",  # no default.pa: only the modules below
            "--use-pid-file=no", "--disable-shm=yes", "--realtime=no", "--high-priority=no",
            f"--load=module-native-protocol-unix auth-anonymous=1 socket={self.socket}",
            f"--load={sink.format(name=SPEAKER, spec=self.spec)}",
            f"--load={sink.format(name=MIC, spec=self.spec)}",
            "--log-target=stderr",
        ]

    def server_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("PULSE_SERVER", "PULSE_SINK", "PULSE_SOURCE"):
            env.pop(k, None)
        env.update(HOME=str(self.root / "home"), XDG_RUNTIME_DIR=str(self.root / "xdg"),
                   XDG_CONFIG_HOME=str(self.root / "home" / ".config"),
                   PULSE_RUNTIME_PATH=str(self.root / "run"), PULSE_STATE_PATH=str(self.root / "state"))
        return env

    def client_env(self) -> dict[str, str]:
        return {"PULSE_SERVER": self.server, "PULSE_SINK": SPEAKER, "PULSE_SOURCE": f"{MIC}.monitor",
                "PULSE_CLIENTCONFIG": str(self.root / "client.conf")}

    def start(self, timeout: float = 15.0) -> None:
        for d in ("home", "xdg", "run", "state"):
            (self.root / d).mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / "client.conf").write_text("autospawn = no\n")
        self._log = open(self.log_path, "wb")
        # pulseaudio only warns when run as root with --system=false; it works.
        self.proc = subprocess.Popen(self.command(), env=self.server_env(), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pulseaudio exited with {self.proc.returncode}: {self.log()}")
            if self.socket.exists() and self.pactl("info", check=False).returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"pulseaudio not ready after {timeout}s: {self.log()}")
            time.sleep(0.1)
        self.pactl("set-default-sink", SPEAKER)
        self.pactl("set-default-source", f"{MIC}.monitor")
        for k, v in self.client_env().items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        self._reinit_portaudio()

    def stop(self) -> None:
        try:
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._saved_env.clear()
            self._reinit_portaudio()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            if getattr(self, "_log", None):
                self._log.close()

    def log(self, tail: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    @staticmethod
    def _reinit_portaudio() -> None:
        """PortAudio enumerates devices once, at initialisation; redo it so the pulse device
        (or its absence) reflects the current server."""
        import sys

        sd = sys.modules.get("sounddevice")
        if sd is not None:
            sd._terminate()
            sd._initialize()

    # ------------------------------------------------------------ tools

    def _env(self) -> dict[str, str]:
        return dict(os.environ, **self.client_env())

    def pactl(self, *args: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run(["pactl", "--server", self.server, *args], env=self._env(),
                              capture_output=True, text=True, timeout=timeout, check=check)

    def play(self, samples: np.ndarray, rate: int, sink: str = MIC, timeout: float | None = None) -> None:
        """Play mono float32 ``samples`` into ``sink`` (blocks until played)."""
        data = np.ascontiguousarray(np.asarray(samples, dtype="<f4").reshape(-1)).tobytes()
        if timeout is None:
            timeout = 10.0 + len(samples) / rate * 2
        subprocess.run(["pacat", "--playback", f"--server={self.server}", f"--device={sink}", "--raw",
                        "--format=float32le", f"--rate={rate}", "--channels=1",
                        f"--latency-msec={PLAYER_LATENCY_MS}"],
                       input=data, env=self._env(), capture_output=True, timeout=timeout, check=True)

    def play_into_mic(self, samples: np.ndarray, rate: int, timeout: float | None = None) -> None:
        """Play mono float32 ``samples`` into the ``omnidesk_mic`` sink (blocks until played)."""
        self.play(samples, rate, MIC, timeout)

    def record_speaker(self, seconds: float, rate: int = 16000,
                       during: Callable[[], object] | None = None) -> np.ndarray:
        """Capture ``seconds`` of ``omnidesk_speaker.monitor`` as mono float32 at ``rate``.

        ``during`` (optional) runs once the recorder is up, e.g. the code that plays to the speaker;
        the capture lasts ``seconds`` from the recorder's start or until ``during`` returns,
        whichever is later.  :attr:`last_recording_start` is the monotonic time of its first sample."""
        speaker, _ = self.record(seconds, rate, during, mic=False)
        return speaker

    def record(self, seconds: float, rate: int = 16000, during: Callable[[], object] | None = None,
               mic: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """Like :meth:`record_speaker`, and (``mic=True``) the microphone too: what the app could
        capture from ``omnidesk_mic.monitor``, recorded alongside.  Returns (speaker, mic);
        :attr:`last_recording_start` / :attr:`last_mic_recording_start` anchor them."""
        sources = [f"{SPEAKER}.monitor"] + ([f"{MIC}.monitor"] if mic else [])
        paths = [self.root / f"rec-{i}-{time.monotonic_ns()}.raw" for i in range(len(sources))]
        procs = []
        try:
            for source, path in zip(sources, paths):
                with open(path, "wb") as out:
                    procs.append(subprocess.Popen(
                        ["parec", f"--server={self.server}", f"--device={source}", "--raw",
                         "--format=float32le", f"--rate={rate}", "--channels=1", "--latency-msec=20"],
                        stdout=out, stderr=subprocess.PIPE, env=self._env(), start_new_session=True))
            t0 = time.monotonic()
            time.sleep(0.3)  # let the streams connect before anything plays
            if during is not None:
                during()
            time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        finally:
            t_stop = time.monotonic()
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        recordings = []
        for path in paths:
            data = path.read_bytes()
            path.unlink(missing_ok=True)
            recordings.append(np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4").copy())
        # Monotonic time of each recording's first sample, counted back from its end: parec takes
        # a variable time (up to ~1 s under load) to connect, so the start of the call is no anchor.
        starts = [t_stop - r.size / rate for r in recordings]
        self.last_recording_start = starts[0]
        self.last_mic_recording_start = starts[1] if mic else None
        return recordings[0], (recordings[1] if mic else None)

    @staticmethod
    def find_device(name: str = "pulse", kind: str | None = None) -> int:
        """Index of the first sounddevice device whose name contains ``name`` (case-insensitive),
        optionally with input (``kind="input"``) or output (``"output"``) channels."""
        import sounddevice as sd

        devices = sd.query_devices()
        for i, d in enumerate(devices):
            if name.lower() not in d["name"].lower():
                continue
            if kind == "input" and d["max_input_channels"] < 1:
                continue
            if kind == "output" and d["max_output_channels"] < 1:
                continue
            return i
        raise LookupError(f"no {kind or ''} device matching {name!r} in:\n{devices}")


@pytest.fixture(scope="session")
def pulse_server(tmp_path_factory, busy_core):
    """A running private PulseAudio server (:class:`PulseHarness`), stopped after the session; with
    pytest's ``--busy-core`` one core spins meanwhile (the ``busy_core`` fixture in conftest.py)."""
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    # Keep the socket path short (unix socket paths are limited to ~108 bytes).
    harness = PulseHarness(tmp_path_factory.mktemp("pulse"))
    try:
        try:
            harness.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"could not start pulseaudio: {e}")
        yield harness
    finally:
        harness.stop()
