"""What the window remembers between runs (QSettings).

One small typed wrapper so the keys and defaults live in one place.  The app
uses the user's settings (organization/application "OmniDesk"); tests pass a
QSettings on a temporary INI file so real settings are never touched.
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings

from omnidesk.engine.vad import EndpointerConfig

ORGANIZATION = "OmniDesk"
APPLICATION = "OmniDesk"

# Input "device" that is not a device: the microphone is sound files the user picks
# (for machines without a microphone and for reproducible tests).
SOUND_FILES = "sound files"


def user_settings() -> QSettings:
    return QSettings(ORGANIZATION, APPLICATION)


class Settings:
    """Typed access to the window's QSettings."""

    def __init__(self, qsettings: QSettings | None = None):
        self.q = qsettings if qsettings is not None else user_settings()

    def _get(self, key: str, default, kind):
        value = self.q.value(key, default)
        if value is None:
            return default
        if kind is bool:  # INI files give back "true"/"false" strings
            return value if isinstance(value, bool) else str(value).lower() in ("true", "1", "yes")
        try:
            return kind(value)
        except (TypeError, ValueError):
            return default

    def _set(self, key: str, value) -> None:
        if value is None:
            self.q.remove(key)
        else:
            self.q.setValue(key, value)

    # model ----------------------------------------------------------------------
    @property
    def model(self) -> str | None:
        """Checkpoint folder, cached repo id, "demo", or a server URL; None = the best available."""
        return self._get("model/source", None, str) or None

    @model.setter
    def model(self, value: str | None) -> None:
        self._set("model/source", value)

    @property
    def quantize(self) -> str:
        """How the model's weights are loaded: "none" (as stored) or "int8" (omnidesk.models.quant)."""
        value = self._get("model/quantize", "none", str)
        return value if value in ("none", "int8") else "none"

    @quantize.setter
    def quantize(self, value: str | None) -> None:
        self._set("model/quantize", value if value in ("none", "int8") else None)

    @property
    def compile(self) -> str:
        """How the decode steps run: "auto" (CUDA graphs on a GPU), "on", "off" (omnidesk.models.runner)."""
        value = self._get("model/compile", "auto", str)
        return value if value in ("auto", "on", "off") else "auto"

    @compile.setter
    def compile(self, value: str | None) -> None:
        self._set("model/compile", value if value in ("auto", "on", "off") else None)

    @property
    def voice(self) -> str | None:
        return self._get("model/voice", None, str) or None

    @voice.setter
    def voice(self, value: str | None) -> None:
        self._set("model/voice", value)

    @property
    def server(self) -> str | None:
        """The vLLM-Omni server URL last given in the model picker's "Server…" (the picker's
        ``model`` is that URL while a server is the model)."""
        return self._get("model/server", None, str) or None

    @server.setter
    def server(self, value: str | None) -> None:
        self._set("model/server", value)

    # audio ----------------------------------------------------------------------
    @property
    def input_device(self) -> str | None:
        """Device name, SOUND_FILES, or None for the system default."""
        return self._get("audio/input", None, str) or None

    @input_device.setter
    def input_device(self, value: str | None) -> None:
        self._set("audio/input", value)

    @property
    def output_device(self) -> str | None:
        return self._get("audio/output", None, str) or None

    @output_device.setter
    def output_device(self, value: str | None) -> None:
        self._set("audio/output", value)

    @property
    def headphones(self) -> bool:
        return self._get("audio/headphones", False, bool)

    @headphones.setter
    def headphones(self, value: bool) -> None:
        self._set("audio/headphones", bool(value))

    @property
    def push_to_talk(self) -> bool:
        return self._get("audio/push_to_talk", False, bool)

    @push_to_talk.setter
    def push_to_talk(self, value: bool) -> None:
        self._set("audio/push_to_talk", bool(value))

    # end of turn (omnidesk.engine.turn_judge) ---------------------------------------
    @property
    def end_of_turn(self) -> str:
        """"auto" (the Smart Turn model when installed), "smart" or "fixed" (the silence rule)."""
        value = self._get("turn/end_of_turn", "auto", str)
        return value if value in ("auto", "smart", "fixed") else "auto"

    @end_of_turn.setter
    def end_of_turn(self, value: str) -> None:
        self._set("turn/end_of_turn", value)

    @property
    def turn_complete(self) -> float:
        """Smart Turn probability at or above which a pause ends the turn at once."""
        return self._get("turn/complete", EndpointerConfig.turn_complete, float)

    @property
    def turn_incomplete(self) -> float:
        """Smart Turn probability at or below which a pause is waited out (up to turn_max_wait_ms)."""
        return self._get("turn/incomplete", EndpointerConfig.turn_incomplete, float)

    @property
    def turn_max_wait_ms(self) -> int:
        return self._get("turn/max_wait_ms", int(EndpointerConfig.turn_max_wait_ms), int)

    # interruption testing and overlay ---------------------------------------------
    @property
    def interrupt_after_ms(self) -> int:
        return self._get("testing/interrupt_after_ms", 800, int)

    @interrupt_after_ms.setter
    def interrupt_after_ms(self, value: int) -> None:
        self._set("testing/interrupt_after_ms", int(value))

    @property
    def overlay_visible(self) -> bool:
        return self._get("overlay/visible", False, bool)

    @overlay_visible.setter
    def overlay_visible(self, value: bool) -> None:
        self._set("overlay/visible", bool(value))

    @property
    def overlay_pos(self) -> tuple[int, int] | None:
        """Where the overlay was last (screen coordinates of its top-left corner), None if never moved."""
        value = self.q.value("overlay/pos")
        try:
            x, y = (int(v) for v in (value or "").split(","))
        except (TypeError, ValueError, AttributeError):
            return None
        return x, y

    @overlay_pos.setter
    def overlay_pos(self, value: tuple[int, int] | None) -> None:
        self._set("overlay/pos", None if value is None else f"{int(value[0])},{int(value[1])}")

    def geometry(self, name: str) -> QByteArray | None:
        value = self.q.value(f"window/{name}")
        return value if isinstance(value, QByteArray) else None

    def set_geometry(self, name: str, value: QByteArray) -> None:
        self.q.setValue(f"window/{name}", value)

    def sync(self) -> None:
        self.q.sync()
