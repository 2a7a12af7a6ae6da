#!/usr/bin/env bash
# Set up OmniDesk in ./.venv on a fresh Linux machine.
#   dev/setup.sh          the app and its runtime dependencies
#                         (with the end-of-turn model: onnxruntime + the pipecat-ai wheel's Smart Turn file)
#   dev/setup.sh --test   the same plus the test dependencies (pytest, pytest-qt, transformers and kyutai's
#                         moshi as the oracles)
# System libraries (PortAudio for the audio devices, the libraries Qt needs) are
# installed with apt-get when running as root and missing; otherwise it says
# what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

system_packages=(libportaudio2 libegl1 libgl1 libxkbcommon0 libfontconfig1 libglib2.0-0 libdbus-1-3
                 # Qt's X11 platform plugin aborts without these
                 libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0
                 libxcb-render-util0 libxcb-shape0
                 # torch.compile on the CPU (the decode steps' compiled mode) builds C++ with the system compiler
                 g++)
# the test suite validates the desktop entry and the AppStream metainfo, runs a private PulseAudio
# server with null sinks as virtual speaker and microphone, speaks test phrases with espeak-ng, and
# opens the window on a virtual X server (Xvfb); openssl makes the certificates of the remote tests' TLS server
[ "${1:-}" = "--test" ] && system_packages+=(desktop-file-utils appstream pulseaudio pulseaudio-utils
                                             libasound2-plugins espeak-ng xvfb xauth openssl)
missing=()
if command -v dpkg >/dev/null 2>&1; then
  for p in "${system_packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "warning: missing system packages (install them with your package manager): ${missing[*]}" >&2
  fi
fi

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "error: Python 3.10+ needed" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The tested torch release first: on this project's machines it is the CPU build from local disk.
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras}"
if [ "${1:-}" = "--test" ]; then
  # Kyutai's moshi package is the Moshi/Mimi oracle in tests only. It pins an older torch (and exact
  # sounddevice), so it goes in without its dependencies, into a folder of its own that the tests put on
  # sys.path (tests/conftest.py): pip never sees it, so no install compares its pins with this venv.
  # What its model code imports is added here.
  .venv/bin/python -m pip install -q "einops>=0.7" "sentencepiece>=0.2"
  [ -d .venv/oracles/moshi ] || .venv/bin/python -m pip install -q --no-deps --target .venv/oracles "moshi==0.2.13"
fi
# The end-of-turn model (the default "auto" uses it), light: onnxruntime runs it, the pipecat-ai wheel
# only carries its file (OmniDesk never imports pipecat, so its dependencies stay out).  Where either
# cannot be installed the app runs the silence rule and says why (doctor, the window).  The tests
# cover both with and without it (they hide it where they need the fixed rule).
.venv/bin/python -c 'import onnxruntime' 2>/dev/null || .venv/bin/python -m pip install -q "onnxruntime>=1.17" \
  || echo "warning: onnxruntime could not be installed: end of turn falls back to the 400 ms silence rule" >&2
.venv/bin/python -c 'import importlib.metadata as m; m.distribution("pipecat-ai")' 2>/dev/null \
  || .venv/bin/python -m pip install -q --no-deps "pipecat-ai>=1.0" \
  || echo "warning: the Smart Turn model file (pipecat-ai) could not be installed: end of turn falls back to the 400 ms silence rule" >&2
echo "ready: .venv/bin/omnidesk"
