"""Device choice by name, index or default, and the messages a missing device gives (no PortAudio
needed: the device list is given)."""

import pytest

from omnidesk.audio.device import AudioDeviceError, DeviceInfo, resolve_device

DEVICES = [
    DeviceInfo(0, "HDA Intel PCH: ALC257 Analog (hw:0,0)", 2, 2, 48000.0, "ALSA", False, False),
    DeviceInfo(1, "USB Headset: Audio (hw:1,0)", 1, 2, 44100.0, "ALSA", False, False),
    DeviceInfo(2, "HDMI 0 (hw:0,3)", 0, 8, 48000.0, "ALSA", False, False),
    DeviceInfo(3, "default", 32, 32, 44100.0, "ALSA", True, True),
]


def test_default_index_exact_and_partial_names():
    assert resolve_device(None, "input", DEVICES).index == 3
    assert resolve_device("", "output", DEVICES).index == 3
    assert resolve_device(1, "input", DEVICES).index == 1
    assert resolve_device("2", "output", DEVICES).index == 2
    assert resolve_device("default", "input", DEVICES).index == 3
    assert resolve_device("usb headset", "input", DEVICES).index == 1  # case-insensitive part of the name


def test_a_device_without_that_direction_is_not_chosen():
    # HDMI has no input channels: asking for it as the microphone is an error that lists the choices
    with pytest.raises(AudioDeviceError, match=r"microphone \(input\) 'HDMI' not found .*available: 0: HDA"):
        resolve_device("HDMI", "input", DEVICES)
    with pytest.raises(AudioDeviceError, match=r"microphone \(input\) 2 not found"):
        resolve_device(2, "input", DEVICES)


def test_no_device_at_all_says_so():
    outputs_only = [d for d in DEVICES if d.inputs == 0]
    with pytest.raises(AudioDeviceError, match="no microphone \\(input\\) device found"):
        resolve_device(None, "input", outputs_only)
    # without a default, the first usable device
    no_default = [d for d in DEVICES if d.index != 3]
    assert resolve_device(None, "output", no_default).index == 0
