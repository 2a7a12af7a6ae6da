"""The options the commands share, and the rule that merges the ones given before the command.

--model, --device, --quantize and --compile may be given before the command (``omnidesk --model X
reply ...``) or after it (``omnidesk reply --model X ...``).  A command's own copy lands in
``sub_NAME``; :func:`_merge_options` folds the two into ``NAME``, refusing two different values and
a top-level option the command has no use for.
"""

from __future__ import annotations

import argparse

from omnidesk.errors import UsageError

END_OF_TURN_HELP = ("when the user's turn is over: 'smart' = the Smart Turn v3 model scores each pause (replies "
                    "~200 ms after a finished sentence, waits through a mid-sentence pause; needs the optional "
                    "'turn' extra), 'fixed' = 400 ms of silence, 'auto' (default) = smart when installed")


def _model_help() -> str:
    from omnidesk.models.families import FAMILIES, RECOMMENDED

    titles = " or ".join(f.title for f in FAMILIES)
    demos = ", ".join(f"'{f.demo_name}' ({f.title})" for f in FAMILIES)
    return (f"checkpoint folder ({titles}), cached repo id (e.g. {', '.join(RECOMMENDED)}) or a demo: {demos}, "
            f"tiny and made on first use, their replies are noise; default: the model picked in the window last "
            f"time, else the smallest intact checkpoint in the Hugging Face cache, else '{FAMILIES[0].demo_name}'")


DEVICE_HELP = "cpu or cuda[:N]; default: cuda when torch can use a GPU, else cpu"
BOTH_HELP = (" May also be given before the command (omnidesk {opt} ... reply ...); giving it before and after "
             "the command with different values is an error.")


def _model_options(p: argparse.ArgumentParser, device: bool = True) -> None:
    """--model/--device of a command; they land in sub_model/sub_device and are merged with the
    top-level options by :func:`_merge_options`."""
    p.add_argument("--model", dest="sub_model", metavar="MODEL",
                   help=_model_help() + "." + BOTH_HELP.format(opt="--model"))
    if device:
        p.add_argument("--device", dest="sub_device", metavar="DEVICE",
                       help=DEVICE_HELP + "." + BOTH_HELP.format(opt="--device"))


QUANTIZE_HELP = ("weights: 'int8' quantizes a bf16/fp16/fp32 checkpoint's thinker linears to int8 (per output "
                 "channel) while loading, about half the GPU memory of bf16; 'none' (default) runs them as stored. "
                 "A GPTQ/AWQ 4-bit checkpoint runs 4-bit without it")


COMPILE_HELP = ("decode steps: 'auto' (default) captures them as CUDA graphs on a GPU and compiles them on the CPU "
                "where that pays; 'on' compiles (CPU) or captures (GPU) them; 'off' runs them eagerly. Compiling "
                "runs in the background (the conversation starts at once, eagerly) and is cached on disk")


def _command_option(p: argparse.ArgumentParser, name: str, choices, help_text: str) -> None:
    """--NAME of a command, also accepted before it (lands in sub_NAME; merged with the top-level one by
    :func:`_merge_options`)."""
    p.add_argument(f"--{name}", dest=f"sub_{name}", choices=choices,
                   help=help_text + "." + BOTH_HELP.format(opt=f"--{name}"))


def _quantize_option(p: argparse.ArgumentParser) -> None:
    from omnidesk.models.quant import QUANTIZE_CHOICES

    _command_option(p, "quantize", QUANTIZE_CHOICES, QUANTIZE_HELP)


def _compile_option(p: argparse.ArgumentParser) -> None:
    from omnidesk.models.runner import SETTINGS

    _command_option(p, "compile", SETTINGS, COMPILE_HELP)


def _model_command(sub, name: str, help_text: str, server: bool = False) -> argparse.ArgumentParser:
    """The parser of a command that runs a model: --model, --device, the --server options where the
    model may also run on a vLLM-Omni server (omnidesk/remote), --quantize and --compile, in the order
    its --help lists them; the command adds its own options after these."""
    p = sub.add_parser(name, help=help_text)
    _model_options(p)
    if server:
        from omnidesk.remote.frontend import add_server_options

        add_server_options(p)
    _quantize_option(p)
    _compile_option(p)
    return p


def add_top_level_options(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --quantize and --compile given before the command (or with none: the window)."""
    parser.add_argument("--model", help=_model_help() + ". Applies to the window, reply, talk, live, bench and "
                                                     "models verify; a command's own --model must not differ.")
    parser.add_argument("--device", help=DEVICE_HELP + ". Applies to the window, reply, talk, live and bench; "
                                                       "a command's own --device must not differ.")
    parser.add_argument("--quantize", choices=("none", "int8"),
                        help=QUANTIZE_HELP + ". Applies to the window (and is remembered there), reply, talk, live "
                                             "and bench.")
    parser.add_argument("--compile", choices=("auto", "off", "on"),
                        help=COMPILE_HELP + ". Applies to the window (and is remembered there), reply, talk, live "
                                            "and bench.")


def _merge_options(args) -> None:
    """Apply the top-level --model/--device to the command; refuse them where they mean nothing."""
    command = " ".join(c for c in (args.command, getattr(args, "models_command", None)) if c)
    for name in ("model", "device", "quantize", "compile"):
        top = getattr(args, name)
        if not hasattr(args, f"sub_{name}"):
            if top is not None and args.command is not None:
                raise UsageError(f"--{name} does not apply to `omnidesk {command}`")
            continue
        sub = getattr(args, f"sub_{name}")
        if top is not None and sub is not None and top != sub:
            raise UsageError(f"--{name} given twice with different values ('{top}' before `{command}`, "
                             f"'{sub}' after it); give it once")
        setattr(args, name, sub if sub is not None else top)
