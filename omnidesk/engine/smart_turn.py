"""Smart Turn v3: an audio-native end-of-turn classifier, run with onnxruntime on the CPU.

The model (``smart-turn-v3.2-cpu.onnx``, ~8 MB, BSD-2) ships inside the ``pipecat-ai``
wheel.  We take the file from that installed distribution but never import pipecat:
its package ``__init__`` pulls in loguru and, through its dependencies, openai,
numba, aiohttp and more.  ``pip install --no-deps pipecat-ai`` plus ``onnxruntime``
is all this module needs, and the file is found through ``importlib.metadata``
(``importlib.resources`` would import the package).

Input: the last ``n_frames * hop_length`` samples (8 s) of the user's 16 kHz audio,
as Whisper log-mel features ``[1, n_mels, n_frames]`` (80 x 800).  Output: the
probability that the turn is complete.  Both sizes are read from the model's
input shape.  The features are our :func:`~omnidesk.features.log_mel` with
80 mel bins, plus what Smart Turn's preprocessing (``WhisperFeatureExtractor``
with ``chunk_length=8``, ``do_normalize=True``) does differently:

1. shorter audio is zero-padded at the *start* to 8 s, longer audio keeps its end;
2. the padded 8 s window is normalised to zero mean and unit variance (float32,
   ``eps = 1e-7``) *before* the spectrogram, so the padding becomes a constant,
   not silence;
3. the STFT is centred with reflect padding at *both* ends (the audio is already
   8 s long, so nothing is zero-padded after it), whereas our ``log_mel`` sees zeros
   after the signal; we append that reflection ourselves;
4. the dynamic-range floor (max - 8) is taken over exactly the ``n_frames`` kept
   frames (the reference drops its one extra trailing frame before the max).

The result equals transformers' ``WhisperFeatureExtractor(feature_size=80,
chunk_length=8)`` bit for bit (both run the same float32 torch ops) and pipecat's
float64 numpy copy of it to ~1e-5.  That last gap matters more than it looks: the
model is int8-quantized and its probability moves by up to ~0.3 on features 1e-6
apart, so read single scores as noisy near the middle of the range.

Scoring is synchronous and creates no threads: the caller runs it on its own
thread, off the audio callback and off the model worker.  onnxruntime runs with
one intra-op thread so it does not compete with decoding for cores.  The feature
step (~5 ms) runs torch ops, which use torch's intra-op pool as set process-wide.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np
import torch

from ..features import DYNAMIC_RANGE, LOG_CLAMP, FeatureConfig, log_mel

__all__ = ["SmartTurn", "TurnModelUnavailable", "bundled_model", "DISTRIBUTION", "MODEL_FILE"]

DISTRIBUTION = "pipecat-ai"
MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
NORM_EPS = 1e-7  # WhisperFeatureExtractor's zero-mean unit-variance epsilon

INSTALL_ORT = "pip install onnxruntime"
INSTALL_MODEL = f"pip install --no-deps {DISTRIBUTION}"
# model files whose sha256 matched their RECORD: (path, size, mtime_ns, digest); a file changed on
# disk since (another size or time) is hashed again
_VERIFIED: set[tuple[str, int, int, str]] = set()


class TurnModelUnavailable(RuntimeError):
    """The Smart Turn model cannot be used; the message says what to install or repair."""


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:
        raise TurnModelUnavailable(f"onnxruntime is not installed ({e}): {INSTALL_ORT}") from None
    return onnxruntime


def _reinstall(version: str) -> str:
    return f"pip install --force-reinstall --no-deps {DISTRIBUTION}=={version}"


def bundled_model(verify: bool = True) -> tuple[Path, str]:
    """(path, pipecat-ai version) of the model file in the installed pipecat-ai distribution.

    ``verify`` checks the file against the sha256 in the wheel's RECORD, so a truncated or
    altered file is reported as damaged instead of failing inside onnxruntime.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise TurnModelUnavailable(
            f"the Smart Turn model comes with {DISTRIBUTION}, which is not installed: {INSTALL_MODEL}") from None
    version = dist.version
    if dist.files is None:  # installed without a RECORD (some system packagers): no list, no hash
        entry, path = None, Path(dist.locate_file(MODEL_FILE))
    else:
        entry = next((f for f in dist.files if f.as_posix() == MODEL_FILE), None)
        if entry is None:
            raise TurnModelUnavailable(
                f"{DISTRIBUTION} {version} does not list {MODEL_FILE}; install a version that ships "
                f"Smart Turn v3.2: {INSTALL_MODEL}")
        path = Path(dist.locate_file(entry))
    if not path.is_file():
        raise TurnModelUnavailable(f"{path} is missing from {DISTRIBUTION} {version}: {_reinstall(version)}")
    if verify and entry is not None and entry.hash is not None and entry.hash.mode == "sha256":
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, entry.hash.value)
        if key not in _VERIFIED:  # each session opens a judge: hash the 8 MB file once per process
            digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
            if digest != entry.hash.value:
                raise TurnModelUnavailable(
                    f"{path} is damaged (sha256 differs from {DISTRIBUTION} {version}'s RECORD): {_reinstall(version)}")
            _VERIFIED.add(key)
    return path, version


class SmartTurn:
    """A loaded Smart Turn v3 session; :meth:`score` is the one call per pause.

    Stateless between calls: each score sees only the audio passed to it.
    """

    def __init__(self, session, path: Path, source: str, cfg: FeatureConfig, n_frames: int):
        self.session = session
        self.path = path
        self.source = source  # "pipecat-ai 1.14.0" or "file"
        self.cfg = cfg
        self.n_frames = n_frames
        self.window_samples = n_frames * cfg.hop_length  # 8 s at 16 kHz
        self.input_name = session.get_inputs()[0].name

    @classmethod
    def load(cls, path: str | Path | None = None) -> "SmartTurn":
        """Load the model: ``path`` if given, else the file in the installed pipecat-ai.

        Raises :class:`TurnModelUnavailable` naming the missing piece.
        """
        ort = _onnxruntime()
        if path is None:
            path, version = bundled_model()
            source = f"{DISTRIBUTION} {version}"
        else:
            path, source = Path(path), "file"
            if not path.is_file():
                raise TurnModelUnavailable(f"Smart Turn model file not found: {path}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail / InvalidProtobuf / ... types
            raise TurnModelUnavailable(f"{path} is damaged or not an ONNX model ({type(e).__name__}: {e})") from None
        inputs = session.get_inputs()
        shape = inputs[0].shape if len(inputs) == 1 else None
        if shape is None or len(shape) != 3 or not all(isinstance(d, int) for d in shape[1:]):
            raise TurnModelUnavailable(
                f"{path} is not a Smart Turn v3 model: expected one input [batch, mels, frames], got "
                f"{[(i.name, i.shape) for i in inputs]}")
        return cls(session, path, source, FeatureConfig(n_mels=shape[1]), shape[2])

    @staticmethod
    def missing() -> str | None:
        """Why :meth:`load` with no path would fail (what to install or repair), or None.

        Cheap (no hashing, no session); :meth:`load` is what reports a damaged file.
        """
        if importlib.util.find_spec("onnxruntime") is None:
            return f"onnxruntime is not installed: {INSTALL_ORT}"
        try:
            bundled_model(verify=False)
        except TurnModelUnavailable as e:
            return str(e)
        return None

    @staticmethod
    def available() -> bool:
        """Whether :meth:`load` with no path would find onnxruntime and the bundled model file."""
        return SmartTurn.missing() is None

    def describe(self) -> str:
        """One line for ``omnidesk doctor``: model file, where it came from, onnxruntime version."""
        return (f"Smart Turn v3 ({self.path.name} from {self.source}, {self.path}), "
                f"onnxruntime {_onnxruntime().__version__}, 1 thread")

    def features(self, audio_16k: np.ndarray) -> np.ndarray:
        """The model input for this audio: float32 ``[n_mels, n_frames]`` (see the module docstring)."""
        x = np.asarray(audio_16k)
        if x.ndim != 1:
            raise ValueError(f"audio must be 1-D mono samples, got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"audio must be float samples in [-1, 1], got {x.dtype}")
        x = x[-self.window_samples:].astype(np.float32)
        x = np.pad(x, (self.window_samples - len(x), 0))
        x = (x - x.mean()) / np.sqrt(x.var() + NORM_EPS)  # float32, as the reference
        half = self.cfg.n_fft // 2
        x = np.concatenate([x, x[-half - 1:-1][::-1]])  # reflect the end, as a centred STFT of the 8 s window
        # floor = log10(LOG_CLAMP) turns log_mel's floor off; the reference's floor comes below,
        # over the kept frames only.  (log + 4) / 4 maps "max - 8" to "max - 2".
        mel = log_mel(torch.from_numpy(x), self.cfg, floor=float(np.log10(LOG_CLAMP)))[:, :self.n_frames]
        mel = torch.maximum(mel, mel.max() - DYNAMIC_RANGE / 4)
        return mel.numpy()

    def probability(self, features: np.ndarray) -> float:
        """Run the model on features ``[n_mels, n_frames]``; the model's output is already a probability."""
        out = self.session.run(None, {self.input_name: features[None].astype(np.float32, copy=False)})[0]
        return float(out.reshape(-1)[0])

    def score(self, audio_16k: np.ndarray) -> float:
        """Probability that the turn is complete, from the last <= 8 s of 16 kHz float audio."""
        return self.probability(self.features(audio_16k))
