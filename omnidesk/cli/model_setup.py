"""The model and device a command runs: chosen as the window chooses, checked, said in one line,
then loaded through the model's family (or, with --server, a vLLM-Omni server connected instead).

Everything here runs before or while the weights load; the commands in .talk, .check and .window
call :func:`_prepare` first (cheap: no weights read) and :func:`_load` once their inputs are checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from omnidesk.errors import UsageError


def _remembered_model() -> str | None:
    """The model the window's model picker remembers (its QSettings), or None."""
    try:
        from omnidesk.gui.settings import Settings

        return Settings().model
    except Exception:  # no PySide6, unreadable settings: nothing remembered
        return None


def _choose_model(model: str | None):
    """The window's rule (omnidesk/models/choice.py): ``model`` when given, else the one remembered
    from the window's model picker, else the Hugging Face cache, else the demo."""
    from omnidesk.models.choice import choose_model

    return choose_model(model, remembered=None if model else _remembered_model())


@dataclass
class Prepared:
    """The model and device to run, resolved and checked, before anything heavy loads."""

    source: str  # what was chosen: "demo", a folder or a repo id
    root: Path  # the checkpoint folder
    device: str
    input_rate: int  # the audio encoder's sampling rate (WAV inputs are resampled to it)
    family: object = None  # the omnidesk.models.families.Family

    @property
    def duplex(self) -> bool:
        return bool(getattr(self.family, "duplex", False))


def _prepare(args, out) -> Prepared:
    """Check the device, choose the model (as the window does) and say which and why, in one line."""
    from omnidesk.models.choice import WHY_CONFIGURED, check_device, default_device, why_default_device
    from omnidesk.models.families import demo_family, resolve_model

    if getattr(args, "server", None):  # the model runs on a vLLM-Omni server (omnidesk/remote)
        from omnidesk.remote.frontend import prepare_server

        return prepare_server(args, out, Prepared)
    args.doing = "choosing the model"
    if args.device:
        device, device_why = check_device(args.device), "given with --device"
    else:
        device, device_why = default_device(), why_default_device()
    choice = _choose_model(args.model)
    why = "given with --model" if choice.why == WHY_CONFIGURED else choice.why
    print(f"model: {choice.source} ({why}); device: {device} ({device_why})", file=out, flush=True)
    if demo_family(choice.source) is not None:  # a demo name: made on first use
        args.doing = "making the demo model"
        t0 = time.perf_counter()
        root, family = resolve_model(choice.source, make_demo=True)
        print(f"demo model at {root} ({(time.perf_counter() - t0) * 1000:.0f} ms)", file=out)
    else:
        root, family = resolve_model(choice.source)
    return Prepared(choice.source, root, device, family.input_rate(root), family)


def _turn_tools(prepared: Prepared, command: str, instead: str = ""):
    """The family's unstreamed one-turn tools; a UsageError where it has none (a full-duplex model)."""
    family = prepared.family
    if family.turn_tools is None:
        kind = "is full duplex" if family.duplex else "has no one-turn tools"
        raise UsageError(f"`omnidesk {command}` runs one turn of a turn-based model; {family.title} {kind}: "
                         f"use `omnidesk talk` or `omnidesk live`" + (f" ({instead})" if instead else ""))
    return family.turn_tools()


# Commands that run once and end (None: the check turn without a display): compiling on the CPU (tens of
# seconds the first time) would outlast them
ONE_SHOT_COMMANDS = ("reply", "talk", None)


def _compile_setting(args, prepared: Prepared) -> str | None:
    """The decode-step setting for the loaded model: the user's --compile; for a one-shot command on the
    CPU "auto" means eager (the compile would not be ready before the command ends).  ``reply`` runs its
    own executor (``args.reply_compile``); the loaded one stays eager."""
    import torch

    compile = getattr(args, "compile", None)
    if args.command in ONE_SHOT_COMMANDS and compile in (None, "auto") and torch.device(prepared.device).type == "cpu":
        compile = "off"
    if args.command == "reply":
        args.reply_compile, compile = compile, "off"
    return compile


def _load(args, prepared: Prepared, out):
    """Load the prepared checkpoint through its family (a :class:`~omnidesk.models.families.Loaded`),
    saying which options the family has no use for and printing the demo notice where it applies."""
    from omnidesk.models.families import LoadOptions

    if getattr(args, "server", None):  # connect instead: the model is the server's
        from omnidesk.remote.frontend import load_server

        return load_server(args, prepared, out)

    options = LoadOptions(greedy=bool(getattr(args, "greedy", False)), seed=int(getattr(args, "seed", 0) or 0),
                          voice=getattr(args, "voice", None), max_text_tokens=getattr(args, "max_text_tokens", None),
                          max_codec_tokens=getattr(args, "max_codec_tokens", None),
                          quantize=None if getattr(args, "quantize", None) in (None, "none") else args.quantize,
                          compile=_compile_setting(args, prepared))
    family = prepared.family
    ignored = ["--" + name.replace("_", "-") for name in family.ignored_options
               if getattr(options, name, None) is not None]
    if ignored:
        print(f"note: {', '.join(ignored)} ha{'ve' if len(ignored) > 1 else 's'} no meaning for "
              f"{family.title}; ignored", file=out)
    args.doing = "loading the model"
    loaded = family.load(prepared.root, prepared.device, options)
    quantization = loaded.model_info.get("quantization")
    if quantization:  # which weights and which matmul path run (omnidesk/models/quant.py)
        print(f"weights: {quantization['summary']}", file=out)
    runner = getattr(loaded.executor, "runner", None)
    if runner is not None and args.command != "reply":  # eager, compiled or CUDA graphs (models/runner.py)
        if runner.mode == "compile" and args.command in ("talk", "bench"):  # measured runs: steady from the start
            print("decode steps: compiling before the run (cached on disk for the next one)...", file=out, flush=True)
            runner.wait_ready()
        print(f"decode steps: {runner.describe()}", file=out)
    if loaded.demo:
        print(f"NOTE: {family.demo_notice}", file=out)
    return loaded
