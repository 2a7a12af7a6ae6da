"""Audio devices for the pickers (called on a worker thread: PortAudio enumeration can take a while)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("omnidesk.gui")


@dataclass(frozen=True)
class Device:
    """The fields of ``omnidesk.audio.device.DeviceInfo`` that the pickers use."""

    index: int
    name: str
    inputs: int
    outputs: int
    default_rate: float = 0.0
    is_default_input: bool = False
    is_default_output: bool = False


def list_devices() -> list:
    """The audio layer's device list; PortAudio's own list until that layer is installed; [] without PortAudio."""
    try:
        from omnidesk.audio.device import list_devices as audio_list_devices
    except ImportError:
        audio_list_devices = None
    if audio_list_devices is not None:
        try:
            return list(audio_list_devices())
        except Exception:  # PortAudio missing or broken: the pickers offer the defaults only
            log.info("cannot list audio devices", exc_info=True)
            return []
    try:
        import sounddevice as sd

        raw = sd.query_devices()
        default_in, default_out = sd.default.device
    except Exception:  # no PortAudio library, no sound server: the pickers offer the defaults only
        log.info("no audio devices: PortAudio unavailable", exc_info=True)
        return []
    return [Device(index=i, name=d["name"], inputs=d["max_input_channels"], outputs=d["max_output_channels"],
                   default_rate=d["default_samplerate"], is_default_input=i == default_in,
                   is_default_output=i == default_out) for i, d in enumerate(raw)]
