"""The `omnidesk` command."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _load(model: str, device: str):
    """Resolve 'demo' or a path / cached repo id and load it, printing the demo notice where it applies."""
    from omnidesk.models.demo import DEMO_NOTICE, is_demo, make_demo
    from omnidesk.models.loading import load_stack

    if model == "demo":
        t0 = time.perf_counter()
        path = make_demo()
        model = str(path)
        print(f"demo model at {path} ({(time.perf_counter() - t0) * 1000:.0f} ms)")
    stack = load_stack(model, device=device)
    if is_demo(stack.config.raw):
        print(f"NOTE: {DEMO_NOTICE}")
    return stack


def _read_wav(path: Path, rate: int):
    import soundfile as sf
    import torch

    try:
        data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, sf.LibsndfileError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}") from None
    if file_rate != rate:
        raise SystemExit(f"error: {path} is {file_rate} Hz; the audio encoder needs {rate} Hz mono "
                         f"(convert it first, e.g. sox {path} -r {rate} -c 1 out.wav)")
    return torch.from_numpy(data.mean(axis=1))


def cmd_make_demo(args) -> int:
    from omnidesk.models.demo import DEMO_NOTICE, make_demo

    t0 = time.perf_counter()
    path = make_demo(args.dir, force=args.force)
    size = sum(p.stat().st_size for p in path.iterdir()) / 1e6
    print(f"{path}  ({size:.1f} MB, {(time.perf_counter() - t0) * 1000:.0f} ms)")
    print(f"NOTE: {DEMO_NOTICE}")
    return 0


def cmd_reply(args) -> int:
    import torch

    from omnidesk.models.reply import generate_reply, talker_defaults
    from omnidesk.models.sampling import SamplingParams

    stack = _load(args.model, args.device)
    wave = _read_wav(Path(args.input), stack.features.sampling_rate)
    generator = torch.Generator(device=stack.device).manual_seed(args.seed)
    t0 = time.perf_counter()
    reply = generate_reply(stack, wave, voice=args.voice,
                           thinker_sampling=SamplingParams(greedy=True) if args.greedy else
                           SamplingParams(temperature=0.7, top_p=0.9),
                           talker_sampling=talker_defaults(stack, greedy=args.greedy),
                           max_text_tokens=args.max_text_tokens, max_codec_tokens=args.max_codec_tokens,
                           generator=generator)
    elapsed = time.perf_counter() - t0
    print(f"heard {wave.shape[0] / stack.features.sampling_rate:.2f} s -> {len(reply.prompt_ids)} prompt tokens")
    print(f"reply text ({len(reply.text_ids)} tokens): {reply.text!r}")
    print(f"speech tokens: {len(reply.codec_ids)}; thinker + talker took {elapsed * 1000:.0f} ms (sequential path)")
    if args.output and reply.codec_ids:
        _speak(stack, reply.codec_ids, args.voice or stack.default_voice, args.seed, Path(args.output))
    return 0


def _speak(stack, codec_ids: list[int], voice_name: str, seed: int, out: Path) -> None:
    """Run the streaming vocoder over a finished reply and write what it produced (the user asked for a file)."""
    import numpy as np
    import soundfile as sf

    v = stack.voices[voice_name]
    stream = stack.vocoder.stream(stack.vocoder.voice(v.cond, v.ref_mel), seed=seed)
    t0 = time.perf_counter()
    chunks, first = [], None
    for code in codec_ids:
        ready = stream.push([code])
        if ready and first is None:
            first = (len(stream.codes), time.perf_counter() - t0)
        chunks += ready
    chunks += stream.flush()
    elapsed = time.perf_counter() - t0
    audio = np.concatenate([c.numpy() for c in chunks])
    rate = stack.vocoder.hop_length * 100  # 100 mel frames per second
    sf.write(str(out), audio, rate)
    seconds = audio.size / rate
    if first:
        print(f"vocoder: first chunk after {first[0]} speech tokens ({first[1] * 1000:.0f} ms)")
    print(f"vocoder: {seconds:.2f} s of audio in {elapsed * 1000:.0f} ms (RTF {elapsed / seconds:.2f}) -> {out}")


def cmd_default(args) -> int:
    """No subcommand: until the desktop window exists, run one turn of the demo/best model in the terminal."""
    import torch

    from omnidesk.models.reply import generate_reply

    stack = _load(args.model, args.device)
    t = torch.arange(int(1.5 * stack.features.sampling_rate)) / stack.features.sampling_rate
    wave = (0.3 * torch.sin(2 * torch.pi * 180 * t) * torch.sin(torch.pi * t / 1.5)).float()
    reply = generate_reply(stack, wave, max_text_tokens=24, max_codec_tokens=100)
    print(f"model ready: {stack.path}")
    print(f"one turn on a synthetic 1.5 s tone: {len(reply.text_ids)} text tokens, {len(reply.codec_ids)} speech tokens")
    print("The desktop window is not built yet; try: omnidesk reply --input question.wav --output answer.wav")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnidesk", description="A local voice assistant (Qwen2.5-Omni).")
    parser.add_argument("--model", default="demo", help="checkpoint dir, cached repo id, or 'demo' (default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    sub = parser.add_subparsers(dest="command")

    models = sub.add_parser("models", help="manage model checkpoints")
    msub = models.add_subparsers(dest="models_command", required=True)
    demo = msub.add_parser("make-demo", help="write the tiny random demo checkpoint (its replies are noise)")
    demo.add_argument("--dir", help="where to write it (default: the user cache dir)")
    demo.add_argument("--force", action="store_true", help="rewrite even if it exists")
    demo.set_defaults(func=cmd_make_demo)

    reply = sub.add_parser("reply", help="answer one spoken question from a 16 kHz WAV file")
    reply.add_argument("--model", default="demo")
    reply.add_argument("--device", default="cpu")
    reply.add_argument("--input", required=True, help="16 kHz WAV file with the question")
    reply.add_argument("--voice", help="voice name from the checkpoint's spk_dict.pt")
    reply.add_argument("--greedy", action="store_true", help="greedy decoding (reference do_sample=False)")
    reply.add_argument("--seed", type=int, default=0)
    reply.add_argument("--max-text-tokens", type=int, default=128)
    reply.add_argument("--max-codec-tokens", type=int, default=1000)
    reply.add_argument("--output", help="write the spoken reply to this WAV file (24 kHz)")
    reply.set_defaults(func=cmd_reply)

    args = parser.parse_args(argv)
    from omnidesk.models.config import ConfigError
    from omnidesk.models.loading import CheckpointError
    from omnidesk.models.tokenizer import TokenizerError

    try:
        return args.func(args) if getattr(args, "func", None) else cmd_default(args)
    except (CheckpointError, ConfigError, TokenizerError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
