"""No command: the desktop window (omnidesk/gui), on the model the window would choose.  Without a
display (SSH, a container) or without PySide6, one check of the model in the terminal instead."""

from __future__ import annotations

import sys

from .model_setup import _load, _prepare, _turn_tools


def cmd_default(args) -> int:
    """No subcommand: the desktop window, on the best model available (--model, else the one picked
    in the window last time, else a checkpoint in the Hugging Face cache, else the demo
    model).  Without a display (SSH, containers) it runs one check turn in the terminal instead."""
    from omnidesk.gui.app import display_problem

    problem = display_problem()
    if problem is None:
        try:
            import PySide6  # noqa: F401
        except ImportError:
            problem = "the window needs PySide6 (pip install PySide6-Essentials)"
    if args.device:  # a device the machine cannot use is said here, not in a banner after the window opens
        from omnidesk.models.choice import check_device

        args.device = check_device(args.device)
    if problem is None:
        from omnidesk.gui.app import print_demo_notice, run

        return run(args.model, args.device, on_model_loaded=print_demo_notice, quantize=args.quantize,
                   compile=args.compile)

    return _check_in_terminal(args, problem)


def _check_in_terminal(args, problem: str) -> int:
    """Where the window cannot open (``problem`` says why): load the model and run one turn on a synthetic
    tone (a full-duplex model: two seconds of frames through its step), to show that the model works."""
    import torch

    print(f"{problem}\nRunning a check of the model in the terminal instead.", file=sys.stderr)
    prepared = _prepare(args, sys.stdout)
    if prepared.family.duplex:  # no turn to take: two seconds of frames through the step
        from omnidesk.engine.duplex_bench import speech_like

        loaded = _load(args, prepared, sys.stdout)
        args.doing = "the check"
        ex = loaded.executor
        frames = speech_like(int(round(2.0 * ex.sample_rate_in / ex.frame_samples_in)), ex.sample_rate_in,
                             ex.frame_samples_in)
        steps = [ex.step(frame) for frame in frames]
        ex.reset_conversation()
        print(f"model ready: {loaded.root}")
        print(f"2 s of a synthetic tone through the full-duplex step: {len(steps)} frames in, "
              f"{sum(s.audio.size for s in steps) / ex.sample_rate_out:.2f} s of audio and "
              f"{sum(s.text_token is not None for s in steps)} text tokens out")
        return 0
    tools = _turn_tools(prepared, "(the check turn)")
    stack = _load(args, prepared, sys.stdout).stack
    args.doing = "the check turn"
    t = torch.arange(int(1.5 * stack.features.sampling_rate)) / stack.features.sampling_rate
    wave = (0.3 * torch.sin(2 * torch.pi * 180 * t) * torch.sin(torch.pi * t / 1.5)).float()
    reply = tools.generate_reply(stack, wave, max_text_tokens=24, max_codec_tokens=100)
    print(f"model ready: {stack.path}")
    print(f"one turn on a synthetic 1.5 s tone: {len(reply.text_ids)} text tokens, {len(reply.codec_ids)} speech tokens")
    return 0
