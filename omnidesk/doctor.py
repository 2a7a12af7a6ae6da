"""`omnidesk doctor`: check what the app needs on this machine and say how to fix what is missing.

Every check catches its own errors, so a broken library shows up as a failed line
instead of a traceback.  Nothing here touches the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, NamedTuple


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str
    fix: str | None = None


QT_NO_DISPLAY = "no display: the window needs a desktop session or Xvfb; offscreen works for tests"


def check_python() -> Check:
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    if v >= (3, 10):
        return Check("Python", True, text)
    return Check("Python", False, text + ": OmniDesk needs Python 3.10 or newer", "install Python 3.10+ and reinstall")


def check_torch() -> Check:
    try:
        import torch
    except Exception as e:
        return Check("torch", False, f"cannot import torch ({type(e).__name__}: {e})", "pip install torch")
    cuda = getattr(torch.version, "cuda", None)
    build = f"CUDA {cuda} build" if cuda else "CPU-only build"
    return Check("torch", True, f"{torch.__version__} ({build})")


def _gpu_needs() -> str:
    """"about 12.8 GB for Qwen2.5-Omni-3B, ..., 17.6 GB for Moshi": the loader's own memory estimate
    (``Recommendation.gpu_memory_gb``: bf16, default context), the figure it refuses to load by; a
    family's repos that need the same are said once, by the family's name."""
    from .models.families import FAMILIES

    parts = []
    for f in FAMILIES:
        needs = {r.gpu_memory_gb for r in f.repos.values()}
        if len(needs) == 1:
            parts.append(f"{needs.pop():g} GB for {f.title}")
        else:
            parts += [f"{r.gpu_memory_gb:g} GB for {repo.split('/')[-1]}" for repo, r in f.repos.items()]
    return "about " + ", ".join(parts) + " of GPU memory in bf16 (the loader's estimate at its default context)"


def check_gpu() -> Check:
    try:
        import torch
    except Exception as e:
        return Check("GPU", False, f"torch unavailable ({type(e).__name__})", "pip install torch")
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if not torch.version.cuda else "no usable NVIDIA GPU / driver found"
        return Check("GPU", False, f"no CUDA GPU ({why}): the demo model runs on the CPU, "
                     "real models need an NVIDIA GPU",
                     f"use a machine with an NVIDIA GPU ({_gpu_needs()}) and a CUDA build of torch "
                     "(see https://pytorch.org/get-started/locally/)")
    parts = []
    for i in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(i)
        try:
            free, total = torch.cuda.mem_get_info(i)
            parts.append(f"{name}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
        except Exception:
            parts.append(name)
    return Check("GPU", True, "; ".join(parts))


def _sounddevice():
    import sounddevice  # noqa: PLC0415 - the import itself is what is checked

    return sounddevice


def check_portaudio() -> Check:
    try:
        sd = _sounddevice()
    except OSError as e:
        return Check("PortAudio", False, f"PortAudio library not found ({e})",
                     "sudo apt-get install libportaudio2 (macOS: brew install portaudio)")
    except Exception as e:
        return Check("PortAudio", False, f"cannot import sounddevice ({type(e).__name__}: {e})",
                     "pip install sounddevice")
    try:
        version = sd.get_portaudio_version()[1]
    except Exception:
        version = "version unknown"
    return Check("PortAudio", True, f"sounddevice {getattr(sd, '__version__', '?')}, {version}")


def check_audio_devices() -> Check:
    try:
        sd = _sounddevice()
    except Exception as e:
        return Check("audio devices", False, f"not checked: sounddevice/PortAudio unavailable ({type(e).__name__})",
                     "fix PortAudio first (sudo apt-get install libportaudio2)")
    devices = list(sd.query_devices())
    n_in = sum(1 for d in devices if d.get("max_input_channels", 0) > 0)
    n_out = sum(1 for d in devices if d.get("max_output_channels", 0) > 0)

    def default(kind: str):
        try:
            return sd.query_devices(kind=kind)["name"]
        except Exception:
            return None

    mic, speaker = default("input"), default("output")
    detail = (f"{n_in} input / {n_out} output devices; default input: {mic or 'none'}; "
              f"default output: {speaker or 'none'}")
    if mic and speaker:
        return Check("audio devices", True, detail)
    missing = " and ".join(k for k, v in (("microphone", mic), ("speaker", speaker)) if not v)
    return Check("audio devices", False, detail,
                 f"connect a {missing} and make it the system default (pavucontrol / sound settings); "
                 "in containers or over SSH pass the sound device through (e.g. PulseAudio/PipeWire socket)")


def check_webrtcvad() -> Check:
    try:
        import webrtcvad

        webrtcvad.Vad(2)
    except Exception as e:
        return Check("webrtcvad", False, f"cannot use webrtcvad ({type(e).__name__}: {e})",
                     "pip install webrtcvad-wheels")
    return Check("webrtcvad", True, "voice activity detector available")


def check_echo_cancellation() -> Check:
    try:
        import numpy as np

        from omnidesk.audio.aec import EchoCanceller

        frame = np.zeros(640, np.float32)
        EchoCanceller(16000).process(frame, frame)  # loads the native library and runs one frame
    except Exception as e:
        return Check("echo cancellation", False, f"cannot use WebRTC echo cancellation ({type(e).__name__}: {e})",
                     "pip install livekit; until then use headphones (Headphones in the window, "
                     "omnidesk live --headphones)")
    return Check("echo cancellation", True, "WebRTC echo canceller and noise suppression available (livekit)")


def check_qt() -> Check:
    try:
        import PySide6
    except Exception as e:
        return Check("Qt display", False, f"cannot import PySide6 ({type(e).__name__}: {e})",
                     "pip install PySide6-Essentials")
    version = getattr(PySide6, "__version__", "?")
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if sys.platform.startswith("linux") and not platform and not (
            os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return Check("Qt display", False, f"PySide6 {version}; {QT_NO_DISPLAY}",
                     "run from a desktop session, or: xvfb-run omnidesk ... (QT_QPA_PLATFORM=offscreen for tests)")
    # Start the platform plugin in a child process: a plugin that cannot load aborts its process.
    code = "from PySide6.QtGui import QGuiApplication as A; a = A([]); print(a.platformName())"
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except Exception as e:
        return Check("Qt display", False, f"PySide6 {version}; could not start Qt ({type(e).__name__}: {e})", None)
    if run.returncode == 0:
        name = run.stdout.strip() or platform or "default"
        note = " (no window is shown: offscreen works for tests)" if name in ("offscreen", "minimal") else ""
        return Check("Qt display", True, f"PySide6 {version}; platform plugin '{name}' starts{note}")
    lines = [ln.strip() for ln in run.stderr.splitlines() if ln.strip()] or ["no output"]
    err = next((ln for ln in lines if "could not" in ln.lower() or "cannot" in ln.lower()), lines[-1])
    if "connect to display" in err.lower():
        return Check("Qt display", False, f"PySide6 {version}; {err}",
                     "check DISPLAY / WAYLAND_DISPLAY point at a running desktop session, or use xvfb-run")
    return Check("Qt display", False, f"PySide6 {version}; the Qt platform plugin failed to start: {err}",
                 "sudo apt-get install libxcb-cursor0 libxkbcommon-x11-0 libegl1 "
                 "(run with QT_DEBUG_PLUGINS=1 for details)")


def check_models() -> Check:
    from .models.checkpoint import cached_repos, cached_snapshot, hf_hub_cache, repo_cache_dir
    from .models.families import RECOMMENDED, SMALLEST_REPO, detect_family

    cache = hf_hub_cache()
    found = [f"{repo} ({family.title})" for repo, snap in cached_repos()
             if (family := detect_family(snap)) is not None]
    # a known repo whose folder exists without a usable snapshot: the download stopped halfway
    broken = [repo for repo in RECOMMENDED if repo_cache_dir(repo).is_dir() and cached_snapshot(repo_cache_dir(repo))
              is None]
    if found:
        extra = f" (incomplete: {', '.join(broken)})" if broken else ""
        return Check("models", True, f"{', '.join(found)} in {cache}{extra}")
    detail = (f"incomplete download of {', '.join(broken)} in {cache}" if broken
              else f"no model in {cache} (the demo models work without one)")
    return Check("models", False, detail, f"omnidesk models download {broken[0] if broken else SMALLEST_REPO}")


def check_demo() -> Check:
    from .models.families import FAMILIES

    made = [f"{f.demo_name} at {f.demo_dir()}" for f in FAMILIES if (f.demo_dir() / "config.json").is_file()]
    waiting = [f.demo_name for f in FAMILIES if not (f.demo_dir() / "config.json").is_file()]
    detail = "; ".join(([f"built: {', '.join(made)}"] if made else [])
                       + ([f"not built yet (made on first use): {', '.join(waiting)}"] if waiting else []))
    return Check("demo model", True, detail)


def check_end_of_turn() -> Check:
    """Which end-of-turn detector "auto" runs: the Smart Turn model when installed, else the silence rule.
    Either works, so this never fails; it says what to install for the model."""
    from .engine.smart_turn import SmartTurn, TurnModelUnavailable

    try:
        model = SmartTurn.load()
    except TurnModelUnavailable as e:
        return Check("end of turn", True, f"silence rule (400 ms): {e}")
    return Check("end of turn", True, f"Smart Turn model: {model.describe()}")


def check_decode() -> Check:
    """Which mode the decode steps run in here by default (omnidesk.models.runner), and whether the CPU
    can compile them (inductor builds C++ with the system's compiler)."""
    import shutil

    import torch

    from .models.runner import CPU_COMPILE_PAYS, inductor_cache_dir, resolve_mode

    setting = os.environ.get("OMNIDESK_COMPILE") or "auto"
    cache = inductor_cache_dir()
    cached = f"; compiled code cached in {cache}" if cache.is_dir() and any(cache.iterdir()) else ""
    if torch.cuda.is_available():
        return Check("decode steps", True, f"{resolve_mode(setting, 'cuda')} on the GPU (--compile {setting}){cached}")
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
    compiled = sorted(f for f in CPU_COMPILE_PAYS if resolve_mode(setting, "cpu", f) == "compile")
    wants = setting == "on" or bool(compiled)
    what = (f"compiled on the CPU for {', '.join(compiled)}, eager for the rest" if compiled and setting != "on"
            else "compiled on the CPU" if setting == "on" else "eager on the CPU")
    if wants and compiler is None:
        return Check("decode steps", False, f"{what} (--compile {setting}), but no C++ compiler was found: "
                     "compiling fails and the steps stay eager", "install g++ (Debian/Ubuntu: apt install g++)")
    return Check("decode steps", True, f"{what} (--compile {setting})"
                 + (f"; C++ compiler {compiler}" if wants else "") + cached)


CHECKS: list[tuple[str, Callable[[], Check]]] = [
    ("Python", check_python),
    ("torch", check_torch),
    ("GPU", check_gpu),
    ("decode steps", check_decode),
    ("PortAudio", check_portaudio),
    ("audio devices", check_audio_devices),
    ("webrtcvad", check_webrtcvad),
    ("echo cancellation", check_echo_cancellation),
    ("end of turn", check_end_of_turn),
    ("Qt display", check_qt),
    ("models", check_models),
    ("demo model", check_demo),
]


def run_checks() -> list[Check]:
    """Run every check; a check that itself fails is reported as a failed line, never raised."""
    out = []
    for name, fn in CHECKS:
        try:
            out.append(fn())
        except Exception as e:
            out.append(Check(name, False, f"check failed: {type(e).__name__}: {e}", None))
    return out


def format_report(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{'✓' if c.ok else '✗'} {c.name:<{width}}  {c.detail}")
        if c.fix and not c.ok:
            lines.append(f"  {'':<{width}}  fix: {c.fix}")
    failed = sum(not c.ok for c in checks)
    lines.append("all checks passed" if not failed else f"{failed} of {len(checks)} checks need attention")
    return "\n".join(lines)


__all__ = ["Check", "format_report", "run_checks"]
