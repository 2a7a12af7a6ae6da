"""Desktop integration files: validators, icons and the per-user installer."""

import configparser
import os
import shlex
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from omnidesk import desktop

ROOT = Path(__file__).resolve().parent.parent
DESKTOP_FILE = ROOT / "packaging" / "io.omnidesk.OmniDesk.desktop"
METAINFO = ROOT / "packaging" / "io.omnidesk.OmniDesk.metainfo.xml"
HICOLOR = ROOT / "assets" / "icons" / "hicolor"
PNG_SIZES = (48, 128, 256)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# binary -> Debian package that provides it
VALIDATORS = {"desktop-file-validate": "desktop-file-utils", "appstreamcli": "appstream"}


@pytest.fixture(scope="session")
def validators():
    """Paths of the validator binaries; installed with apt-get when running as root (CI)."""
    missing = [pkg for exe, pkg in VALIDATORS.items() if shutil.which(exe) is None]
    if missing:
        if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
            pytest.skip(f"validators not installed (apt-get install {' '.join(missing)})")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)
    return {exe: shutil.which(exe) for exe in VALIDATORS}


def _read_entry(path: Path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read(path, encoding="utf-8")
    return parser["Desktop Entry"]


def test_desktop_file_validates(validators):
    proc = subprocess.run([validators["desktop-file-validate"], str(DESKTOP_FILE)],
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "error:" not in out and "warning:" not in out, out


def test_desktop_file_fields():
    entry = _read_entry(DESKTOP_FILE)
    assert entry["Type"] == "Application"
    assert entry["Exec"] == "omnidesk"
    assert entry["Icon"] == desktop.APP_ID
    assert entry["Terminal"] == "false"
    assert entry["StartupWMClass"] == "omnidesk"


def test_metainfo_validates(validators):
    proc = subprocess.run([validators["appstreamcli"], "validate", "--no-net", str(METAINFO)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_metainfo_matches_desktop_file():
    root = ET.parse(METAINFO).getroot()
    assert root.get("type") == "desktop-application"
    assert root.findtext("id") == desktop.APP_ID
    assert root.find("launchable").text == DESKTOP_FILE.name
    assert root.find("provides/binary").text == "omnidesk"
    assert [r.get("version") for r in root.iter("release")] == ["0.1.0"]


def test_icons_are_valid():
    svg = ET.parse(HICOLOR / "scalable" / "apps" / f"{desktop.APP_ID}.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    for n in PNG_SIZES:
        data = (HICOLOR / f"{n}x{n}" / "apps" / f"{desktop.APP_ID}.png").read_bytes()
        assert data[:8] == PNG_MAGIC
        assert data[12:16] == b"IHDR"
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert (width, height) == (n, n)


def test_install_desktop_entry(tmp_path, monkeypatch, validators):
    data_home = tmp_path / "data"
    monkeypatch.setenv("XDG_DATA_HOME", str(data_home))
    bindir = tmp_path / "bin dir"  # a space forces Exec quoting
    bindir.mkdir()
    launcher = bindir / "omnidesk"
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")

    written = desktop.install_desktop_entry()

    entry_path = data_home / "applications" / DESKTOP_FILE.name
    assert entry_path in written
    expected_icons = [data_home / "icons" / "hicolor" / f"{n}x{n}" / "apps" / f"{desktop.APP_ID}.png"
                      for n in PNG_SIZES]
    expected_icons.append(data_home / "icons" / "hicolor" / "scalable" / "apps" / f"{desktop.APP_ID}.svg")
    assert set(written) == {entry_path, *expected_icons}
    for icon in expected_icons:
        assert icon.read_bytes() == (HICOLOR / icon.relative_to(data_home / "icons" / "hicolor")).read_bytes()

    entry = _read_entry(entry_path)
    # Undo the string-level escaping, then split as the spec's quoting rules allow.
    argv = shlex.split(entry["Exec"].replace("\\\\", "\\"))
    assert argv == [str(launcher)]
    assert entry["Icon"] == desktop.APP_ID

    proc = subprocess.run([validators["desktop-file-validate"], str(entry_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_install_desktop_entry_home_and_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(desktop.sys, "argv", ["pytest"])
    written = desktop.install_desktop_entry(home=tmp_path)
    entry_path = tmp_path / ".local" / "share" / "applications" / DESKTOP_FILE.name
    assert written[0] == entry_path
    assert _read_entry(entry_path)["Exec"] == "omnidesk"
    # Running it again overwrites in place.
    assert desktop.install_desktop_entry(home=tmp_path) == written


@pytest.mark.parametrize("arg, expected", [
    ("/usr/bin/omnidesk", "/usr/bin/omnidesk"),
    ("/opt/my apps/omnidesk", '"/opt/my apps/omnidesk"'),
    ("/home/a$b/omnidesk", '"/home/a\\\\$b/omnidesk"'),
])
def test_quote_exec_arg(arg, expected):
    assert desktop.quote_exec_arg(arg) == expected
