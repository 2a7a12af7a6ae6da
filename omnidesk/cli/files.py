"""The files a command reads and writes: sound inputs (read, mixed to mono, resampled, refused
without speech) and outputs (checked writable before anything loads, written whole or not at all)."""

from __future__ import annotations

import os
from pathlib import Path

from omnidesk.errors import UsageError

def _read_wav(path_text: str, rate: int):
    """A sound file as float32 mono at ``rate`` (channels mixed down, resampled with soxr)."""
    import numpy as np
    import soundfile as sf

    path = Path(path_text)
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    if path.is_dir():
        raise UsageError(f"{path} is a folder, not a sound file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read {path}: permission denied")
    if path.stat().st_size == 0:
        raise UsageError(f"{path} is empty (0 bytes)")
    try:
        data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError, OSError) as e:
        reason = getattr(e, "error_string", None) or str(e)
        raise UsageError(f"cannot read {path}: not a sound file this program reads (WAV, FLAC, OGG) "
                         f"({reason.strip().rstrip('.')})") from None
    if data.shape[0] == 0:
        raise UsageError(f"{path} is empty: it holds no audio samples")
    mono = data.mean(axis=1, dtype=np.float32)
    if file_rate != rate:
        import soxr

        mono = soxr.resample(mono, file_rate, rate).astype(np.float32)
    return mono


def _speech_found(audio, rate: int, detector: str) -> bool:
    """Whether ``detector`` ("webrtc" as the app, or "energy") finds a run of speech long enough to
    start a turn (the endpointer's ``speech_start_ms``) in ``audio``, judged in 40 ms frames at 16 kHz
    after the lead-in silence ``talk`` plays first."""
    import math

    import numpy as np

    from omnidesk.engine.talk import FRAME_S, LEAD_SILENCE_S
    from omnidesk.engine.vad import EndpointerConfig, EnergyVAD

    vad_rate = 16000
    if rate != vad_rate:
        import soxr

        audio = soxr.resample(audio, rate, vad_rate).astype(np.float32)
    cfg = EndpointerConfig()
    if detector == "webrtc":
        from omnidesk.audio.vad import FILE_FLOOR_DBFS, WebRtcVAD, WebRtcVADConfig

        # a file is all start-up for webrtcvad: faint hiss would pass as speech without a floor
        vad = WebRtcVAD(sample_rate=vad_rate, config=WebRtcVADConfig(floor_dbfs=FILE_FLOOR_DBFS))
    else:
        vad = EnergyVAD()
    frame = int(round(vad_rate * FRAME_S))
    need = math.ceil(cfg.speech_start_ms / (FRAME_S * 1000))
    # the detector's noise model adapts: judge the file after the same lead-in `talk` plays (whole frames)
    lead = np.zeros(int(round(LEAD_SILENCE_S / FRAME_S)) * frame, np.float32)
    x = np.concatenate([lead, audio, np.zeros((-(lead.size + audio.size)) % frame, np.float32)])
    run = 0
    for i in range(0, x.size, frame):
        run = run + 1 if vad.is_speech(x[i:i + frame]) else 0
        if run >= need:
            return True
    return False


def _read_input(path_text: str, rate: int, detector: str | None):
    """``_read_wav``, refusing a file with no speech: all zeros always; with ``detector`` also a
    file in which it hears none."""
    import numpy as np

    audio = _read_wav(path_text, rate)
    if not np.any(audio):
        raise UsageError(f"no speech detected in {path_text}: it is silent (every sample is zero)")
    if detector is not None and not _speech_found(audio, rate, detector):
        name = "the webrtcvad speech detector" if detector == "webrtc" else "the energy speech detector"
        raise UsageError(f"no speech detected in {path_text} ({name} heard none); record it louder or closer "
                         f"to the microphone, or pass --no-vad to use the file as it is")
    return audio


def _check_writable(path_text: str | None, option: str) -> None:
    """Fail before loading when an output file cannot be written (a missing folder, a folder given)."""
    if not path_text:
        return
    path = Path(path_text)
    if path.is_dir():
        raise UsageError(f"{option} {path}: that is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: no such folder: {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: permission denied")
    # access() says yes to root on a read-only file system: create and remove a file there to be sure
    probe = parent / f".{path.name}.check{os.getpid()}"
    try:
        probe.touch()
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write in {parent} ({e.strerror or e})") from None
    probe.unlink(missing_ok=True)


def _write_atomic(path_text: str, write) -> None:
    """``write(tmp_path)`` to a temporary name beside ``path_text``, then rename it into place: an
    interrupted or failed write never leaves a half-written file under the user's name."""
    path = Path(path_text)
    tmp = path.with_name(f".{path.name}.part{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_wav(path_text: str, audio, rate: int) -> None:
    """A WAV file written whole or not at all (:func:`_write_atomic`)."""
    import soundfile as sf

    _write_atomic(path_text, lambda tmp: sf.write(str(tmp), audio, rate, format="WAV"))
