"""Start the desktop app: ``omnidesk`` (no subcommand) or ``python -m omnidesk.gui``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

APP_ID = "io.omnidesk.OmniDesk"
NO_DISPLAY = ("no display found (DISPLAY / WAYLAND_DISPLAY are not set): run OmniDesk from a desktop session, "
              "or use the terminal commands (omnidesk talk, omnidesk models ...)")


XCB_PACKAGES = ("libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 libxcb-shape0 "
                "libxkbcommon-x11-0")


def display_problem() -> str | None:
    """Why a window cannot open here, or None.  Checked before Qt starts: a Qt platform plugin
    that cannot load or connect aborts the whole process."""
    if not sys.platform.startswith("linux"):
        return None
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if not platform and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return NO_DISPLAY
    if platform == "xcb" or (not platform and not os.environ.get("WAYLAND_DISPLAY")):
        return _xcb_problem()
    return None


def _xcb_problem() -> str | None:
    """Qt's X11 plugin needs system libraries the PySide6 wheel does not ship; load it once to
    name a missing one (milliseconds) instead of letting Qt abort with a generic message."""
    import ctypes

    try:
        import PySide6
    except ImportError:
        return None
    plugin = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    if not plugin.is_file():
        return None
    try:
        ctypes.CDLL(str(plugin))
    except OSError as e:
        missing = str(e).split(":")[0]
        return (f"the window cannot start: the system library {missing} is missing; install Qt's X11 libraries "
                f"(sudo apt-get install {XCB_PACKAGES}); 'omnidesk doctor' checks the rest")
    return None


def _icon():
    from PySide6.QtGui import QIcon

    root = Path(__file__).resolve().parents[2] / "assets" / "icons" / "hicolor"
    icon = QIcon.fromTheme(APP_ID)
    if icon.isNull():
        for size in ("256x256", "128x128", "48x48"):
            path = root / size / "apps" / f"{APP_ID}.png"
            if path.is_file():
                icon.addFile(str(path))
    return icon


def run(model: str | None = None, device: str | None = None, on_model_loaded=None, argv: list[str] | None = None,
        quantize: str | None = None, compile: str | None = None) -> int:
    """Open the window and run the event loop.  ``on_model_loaded(LoadedModel)`` runs on the UI
    thread once a model is ready (the CLI prints the demo notice there); ``quantize`` ("none", "int8")
    and ``compile`` ("auto", "on", "off") override the settings the window remembers, and are remembered."""
    from PySide6.QtWidgets import QApplication

    from .errors import setup_logging
    from .main_window import MainWindow
    from .settings import APPLICATION, ORGANIZATION, Settings
    from .worker import wait_for_background

    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv[:1])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationDisplayName("OmniDesk")
    app.setDesktopFileName(APP_ID)
    app.setWindowIcon(_icon())
    log_path = setup_logging()
    window = MainWindow(Settings(), model=model, device=device, log_path=log_path, quantize=quantize,
                        compile=compile)
    if on_model_loaded is not None:
        window.model_loaded.connect(on_model_loaded)
    window.show()
    window.start()
    code = app.exec()
    window.shutdown()
    wait_for_background(10000)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnidesk.gui", description="The OmniDesk window.")
    parser.add_argument("--model", help="checkpoint dir, cached repo id, or 'demo' (default: the best available)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quantize", choices=("none", "int8"), help="load the weights in int8 (default: as stored)")
    parser.add_argument("--compile", choices=("auto", "on", "off"),
                        help="decode steps: CUDA graphs / compiled (on), eager (off); auto: graphs on a GPU")
    args = parser.parse_args(argv)
    problem = display_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return run(args.model, args.device, on_model_loaded=print_demo_notice, quantize=args.quantize,
               compile=args.compile)


def print_demo_notice(loaded) -> None:
    if loaded.demo:
        print(f"NOTE: {loaded.demo_notice}", flush=True)  # the family's own words on its demo
