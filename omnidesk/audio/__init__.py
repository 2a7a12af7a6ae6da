"""Audio front-end helpers (speech detectors backed by native libraries)."""

from omnidesk.audio.vad import WebRtcVAD, WebRtcVADConfig

__all__ = ["WebRtcVAD", "WebRtcVADConfig"]
