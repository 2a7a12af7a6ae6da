"""The `omnidesk` command: its parser, :func:`main` (the console-script entry point) and how a run
ends on an error.

User errors (a missing file, a device this machine cannot use, a damaged
checkpoint, ...) end with one line on stderr starting "error:" and exit code 2.
Anything unexpected ends with "error: <what failed>: <message>" plus where the
traceback went, and exit code 1 (``OMNIDESK_DEBUG=1`` shows the traceback).

The commands, one family a module: :mod:`.window` (no command: the desktop window), :mod:`.models`
(``models list/verify/download/make-demo``), :mod:`.talk` (``reply``, ``talk``, ``live``) and
:mod:`.check` (``doctor``, ``bench``).  What they share: :mod:`.options` (the options and how the ones
given before the command merge with the command's own), :mod:`.model_setup` (choosing, checking and
loading the model and device) and :mod:`.files` (the sound files read and the outputs written).

Importing this package is light: torch, PySide6 and the models are imported inside the functions that need
them (the CLI's start-up time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from omnidesk.errors import UsageError  # noqa: F401 - raised by the commands, and imported from here by callers

from . import check, models, talk
from .files import _read_wav, write_wav  # noqa: F401 - imported from here by tests
from .model_setup import _remembered_model  # noqa: F401 - imported from here by tests
from .options import _merge_options, add_top_level_options
from .window import cmd_default

EXIT_USER_ERROR = 2
DEBUG_ENV = "OMNIDESK_DEBUG"


def _build_parser() -> argparse.ArgumentParser:
    from omnidesk.models.families import FAMILIES

    parser = argparse.ArgumentParser(
        prog="omnidesk", description=f"A local voice assistant ({', '.join(f.title for f in FAMILIES)}).",
        epilog="Without a command: the desktop window.  Errors: one line starting 'error:' on stderr; exit code "
               f"2 for a problem you can fix (a file, a device, a checkpoint), 1 for anything else (set "
               f"{DEBUG_ENV}=1 for the traceback).")
    add_top_level_options(parser)
    parser.add_argument("--install-desktop-entry", action="store_true",
                        help="add OmniDesk to this user's desktop menu (entry + icons) and exit")
    sub = parser.add_subparsers(dest="command")
    # in the order --help lists them
    models.add_parsers(sub)
    check.add_doctor_parser(sub)
    talk.add_parsers(sub)
    check.add_bench_parser(sub)
    return parser


def _log_traceback(error: BaseException, argv: list[str]) -> Path | None:
    """Append the traceback to the log file the window uses; its path, or None if it cannot be written."""
    import traceback

    from omnidesk.gui.errors import LOG_NAME, default_log_dir

    path = default_log_dir() / LOG_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR omnidesk.cli "
                    f"`omnidesk {' '.join(argv)}` failed\n")
            f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    except OSError:
        return None
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    from omnidesk.audio.device import AudioDeviceError
    from omnidesk.models.choice import DeviceError
    from omnidesk.models.checkpoint import CheckpointError, ConfigError

    if args.install_desktop_entry:
        from omnidesk.desktop import install_desktop_entry

        for path in install_desktop_entry():
            print(f"installed {path}")
        return 0
    args.doing = f"omnidesk {args.command or ''}".strip()
    try:
        _merge_options(args)
        return args.func(args) if getattr(args, "func", None) else cmd_default(args)
    except (UsageError, DeviceError, CheckpointError, ConfigError, AudioDeviceError) as e:
        print(f"error: {str(e).strip() or type(e).__name__}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"error: {args.doing} failed: {type(e).__name__}{': ' + first if first else ''}", file=sys.stderr)
        log = _log_traceback(e, argv)
        print(f"details: {f'the traceback is in {log}; ' if log else ''}rerun with {DEBUG_ENV}=1 "
              f"to print it here", file=sys.stderr)
        return 1
