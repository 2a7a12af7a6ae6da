"""Errors in plain words for the window, details in a log file the user can open.

Dialogs and banners never show a traceback: :func:`plain_message` turns an
exception into one or two sentences that say what happened and what to do;
the traceback goes to the log file (:func:`setup_logging`).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path

log = logging.getLogger("omnidesk.gui")

LOG_NAME = "omnidesk.log"


def default_log_dir() -> Path:
    """``$OMNIDESK_LOG_DIR``, else the XDG state dir (``~/.local/state/omnidesk``)."""
    if os.environ.get("OMNIDESK_LOG_DIR"):
        return Path(os.environ["OMNIDESK_LOG_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "omnidesk"


def setup_logging(log_dir: Path | None = None) -> Path:
    """Send the ``omnidesk`` loggers to a rotating file; return its path.  Idempotent per path."""
    path = (log_dir or default_log_dir()) / LOG_NAME
    root = logging.getLogger("omnidesk")
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve():
            return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=2_000_000, backupCount=2, encoding="utf-8")
    except OSError:
        return path  # an unwritable state dir must not stop the app; the window says "no log"
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def plain_message(exc: BaseException, doing: str) -> str:
    """What went wrong while ``doing`` (e.g. "loading the model"), in words a user can act on."""
    from omnidesk.models.checkpoint import CheckpointError, ConfigError, ModelTooLargeError
    from omnidesk.models.families import SMALLEST_REPO

    name = type(exc).__name__
    text = str(exc).strip()
    if isinstance(exc, ModelTooLargeError):
        # the loader's message is "<path>: <what fits instead>"; the path is noise here
        advice = text.split(": ", 1)[-1]
        return f"Not enough GPU memory for this model. {advice}"
    if name == "OutOfMemoryError" or "out of memory" in text.lower():
        return (f"The GPU ran out of memory while {doing}. Close other programs that use the GPU, "
                f"or pick a smaller model ({SMALLEST_REPO}).")
    if isinstance(exc, (CheckpointError, ConfigError)):  # every family's errors derive from these
        return (f"The model cannot be used: {_first_line(text)} "
                "Check it with 'omnidesk models verify', or pick another model.")
    if name == "DeviceError":  # --device names something this machine cannot run on; the message says what to use
        return as_sentence(_first_line(text))
    if name == "TurnModelUnavailable":  # "Smart Turn model" picked but not installed: the message says what to install
        return as_sentence(_first_line(text)) + " Or choose Auto or Silence under End of turn."
    if name == "ServerError":  # a vLLM-Omni server (omnidesk.remote): the message names it and says what failed
        return as_sentence(_first_line(text))
    if name == "AudioDeviceError":
        return as_sentence(_first_line(text))  # the audio layer already names the device in plain words
    if name == "EchoCancellerUnavailable":
        return ("Echo cancellation is not available on this computer, so the assistant would hear itself "
                "through the speakers. Choose 'Headphones' under Audio to talk without it. Details are in the log file.")
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return f"A file is missing or not readable while {doing}: {_first_line(text)}"
    return f"Something went wrong while {doing} ({name}). The details are in the log file."


def _first_line(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 300 else line[:297] + "..."


def as_sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."
