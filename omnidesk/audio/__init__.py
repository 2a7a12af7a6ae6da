"""Real-time audio: devices, speech detection, echo cancellation, and the live session.

Import from the modules (``omnidesk.audio.session``, ``.device``, ``.aec``, ``.vad``); only the
speech detector is re-exported here, because the others load native libraries on import."""

from omnidesk.audio.vad import WebRtcVAD, WebRtcVADConfig

__all__ = ["WebRtcVAD", "WebRtcVADConfig"]
