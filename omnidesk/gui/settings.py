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


class _Key:
    """One remembered value, read as ``kind`` (``default`` when missing or unreadable) and written as
    ``kind`` too.  Read-only without ``writable`` (changed only by editing the settings file)."""

    def __init__(self, key: str, default, kind, doc: str = "", writable: bool = True):
        self.key, self.default, self.kind, self.writable = key, default, kind, writable
        self.__doc__ = doc

    def __get__(self, settings, owner=None):
        if settings is None:
            return self
        return settings._get(self.key, self.default, self.kind)

    def __set__(self, settings, value) -> None:
        if not self.writable:
            raise AttributeError(f"{self.key} is read-only")
        settings._set(self.key, self.kind(value))


class _Text(_Key):
    """A name or a path; empty reads as None (None: the default or the best available)."""

    def __init__(self, key: str, doc: str = ""):
        super().__init__(key, None, str, doc)

    def __get__(self, settings, owner=None):
        return self if settings is None else super().__get__(settings, owner) or None

    def __set__(self, settings, value) -> None:
        settings._set(self.key, value)  # stored as given; None removes it


class _Choice(_Key):
    """One of ``choices``; anything else reads as the first and is not stored."""

    def __init__(self, key: str, choices: tuple[str, ...], doc: str = ""):
        super().__init__(key, choices[0], str, doc)
        self.choices = choices

    def __get__(self, settings, owner=None):
        if settings is None:
            return self
        value = super().__get__(settings, owner)
        return value if value in self.choices else self.default

    def __set__(self, settings, value) -> None:
        settings._set(self.key, value if value in self.choices else None)


class Settings:
    """Typed access to the window's QSettings."""

    # model
    model = _Text("model/source",
                  'Checkpoint folder, cached repo id, "demo", or a server URL; None = the best available.')
    quantize = _Choice("model/quantize", ("none", "int8"),
                       'How the model\'s weights are loaded: "none" (as stored) or "int8" (omnidesk.models.quant).')
    compile = _Choice("model/compile", ("auto", "on", "off"),
                      'How the decode steps run: "auto" (CUDA graphs on a GPU), "on", "off" (omnidesk.models.runner).')
    voice = _Text("model/voice")
    server = _Text("model/server", 'The vLLM-Omni server URL last given in the model picker\'s "Server…" (the '
                                   "picker's ``model`` is that URL while a server is the model).")
    # audio
    input_device = _Text("audio/input", "Device name, SOUND_FILES, or None for the system default.")
    output_device = _Text("audio/output")
    headphones = _Key("audio/headphones", False, bool)
    push_to_talk = _Key("audio/push_to_talk", False, bool)
    # end of turn (omnidesk.engine.turn_judge)
    end_of_turn = _Choice("turn/end_of_turn", ("auto", "smart", "fixed"),
                          '"auto" (the Smart Turn model when installed), "smart" or "fixed" (the silence rule).')
    turn_complete = _Key("turn/complete", EndpointerConfig.turn_complete, float,
                         "Smart Turn probability at or above which a pause ends the turn at once.", writable=False)
    turn_incomplete = _Key("turn/incomplete", EndpointerConfig.turn_incomplete, float,
                           "Smart Turn probability at or below which a pause is waited out (up to turn_max_wait_ms).",
                           writable=False)
    turn_max_wait_ms = _Key("turn/max_wait_ms", int(EndpointerConfig.turn_max_wait_ms), int, writable=False)
    # interruption testing and overlay
    interrupt_after_ms = _Key("testing/interrupt_after_ms", 800, int)
    overlay_visible = _Key("overlay/visible", False, bool)

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
