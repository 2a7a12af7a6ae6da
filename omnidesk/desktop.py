"""Install OmniDesk's freedesktop launcher and icons for the current user.

The files have one source of truth in the repository: ``packaging/`` holds the
``.desktop`` entry and ``assets/icons/hicolor/`` the icons.  A wheel ships the
same files as data files (``<prefix>/share/applications`` and
``<prefix>/share/icons/hicolor``), so they are looked up in both places.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

APP_ID = "io.omnidesk.OmniDesk"
DESKTOP_NAME = f"{APP_ID}.desktop"
ICON_SIZES = ("48x48", "128x128", "256x256")

# Characters that may appear in an Exec argument without quoting
# (Desktop Entry Specification, "The Exec key").
_EXEC_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def _data_roots() -> list[Path]:
    """Directories that may hold the shipped ``share/`` tree, most specific first."""
    roots = [Path(__file__).resolve().parent.parent]  # source checkout / editable install
    for prefix in (sysconfig.get_path("data"), sys.prefix, sys.base_prefix):
        if prefix:
            roots.append(Path(prefix) / "share")
    return roots


def _find_desktop_file() -> Path:
    for root in _data_roots():
        for candidate in (root / "packaging" / DESKTOP_NAME, root / "applications" / DESKTOP_NAME):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"{DESKTOP_NAME} is not installed with this copy of omnidesk")


def _find_icon_root() -> Path:
    """The ``hicolor`` directory that holds our icons."""
    for root in _data_roots():
        for candidate in (root / "assets" / "icons" / "hicolor", root / "icons" / "hicolor"):
            if (candidate / "scalable" / "apps" / f"{APP_ID}.svg").is_file():
                return candidate
    raise FileNotFoundError(f"the {APP_ID} icons are not installed with this copy of omnidesk")


def find_launcher() -> str:
    """Absolute path of the ``omnidesk`` console script, or plain ``omnidesk``."""
    found = shutil.which("omnidesk")
    if found:
        return str(Path(found).absolute())
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "omnidesk" and argv0.is_file():
        return str(argv0.absolute())
    return "omnidesk"


def quote_exec_arg(arg: str) -> str:
    """Quote one argument for an Exec= value (spec quoting plus string escaping)."""
    if _EXEC_SAFE.fullmatch(arg):
        return arg
    inner = re.sub(r'(["`$\\])', r"\\\1", arg)
    quoted = f'"{inner}"'
    # The value is also a desktop-entry string, where a backslash must be doubled.
    return quoted.replace("\\", "\\\\")


def _render_desktop_entry(template: str, exec_value: str) -> str:
    lines = []
    for line in template.splitlines():
        if line.startswith("Exec="):
            line = f"Exec={exec_value}"
        elif line.startswith("TryExec="):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def _xdg_data_home(home: Path | None) -> Path:
    if home is not None:
        return Path(home) / ".local" / "share"
    env = os.environ.get("XDG_DATA_HOME")
    if env and Path(env).is_absolute():
        return Path(env)
    return Path.home() / ".local" / "share"


def install_desktop_entry(home: Path | None = None) -> list[Path]:
    """Install the launcher and icons under the user's data directory.

    Files go to ``$XDG_DATA_HOME`` (default ``~/.local/share``); when *home* is
    given they go to ``home/.local/share`` instead.  ``Exec=`` points at the
    absolute path of the ``omnidesk`` launcher when one can be found.  Returns
    the paths written.
    """
    data_home = _xdg_data_home(home)
    written: list[Path] = []

    template = _find_desktop_file().read_text(encoding="utf-8")
    entry = data_home / "applications" / DESKTOP_NAME
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text(_render_desktop_entry(template, quote_exec_arg(find_launcher())), encoding="utf-8")
    written.append(entry)

    icon_root = _find_icon_root()
    icons = [(f"{size}/apps", f"{APP_ID}.png") for size in ICON_SIZES]
    icons.append(("scalable/apps", f"{APP_ID}.svg"))
    for subdir, name in icons:
        src = icon_root / subdir / name
        if not src.is_file():
            continue
        dst = data_home / "icons" / "hicolor" / subdir / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not (dst.exists() and dst.samefile(src)):
            shutil.copyfile(src, dst)
        written.append(dst)
    return written


def main() -> int:
    for path in install_desktop_entry():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
