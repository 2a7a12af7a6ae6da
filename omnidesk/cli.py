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


def cmd_models_list(args) -> int:
    from omnidesk.models.inventory import find_checkpoints

    found = find_checkpoints([Path(d) for d in args.dir or []])
    if not found:
        print("no Qwen2.5-Omni checkpoints found in the Hugging Face cache"
              + (" or the given folders" if args.dir else "")
              + "; get one with: omnidesk models download Qwen/Qwen2.5-Omni-3B")
        return 0
    for info in found:
        state = "ok" if info.loads else "BROKEN"
        demo = "  (demo: random weights, noise)" if info.demo else ""
        params = f"{info.params / 1e9:.2f}B" if info.params >= 1e9 else f"{info.params / 1e6:.1f}M"
        print(f"{info.name}\n    {info.path}\n    {info.size_bytes / 1e9:.2f} GB, {params} params, "
              f"{info.dtype}, voices: {', '.join(info.voices) or '-'}, {state}{demo}")
        for problem in info.problems:
            print(f"    problem: {problem}")
    return 0


def cmd_models_verify(args) -> int:
    from omnidesk.models.inventory import verify

    report = verify(args.path, load_test=not args.no_load_test)
    for line in report.checked:
        print(f"  ok  {line}")
    for line in getattr(report, "notes", []):
        print(f"  --  {line}")
    for line in report.problems:
        print(f"  !!  {line}")
    print("verified: no problems" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def cmd_models_download(args) -> int:
    from omnidesk.models.download import RECOMMENDED, DownloadError, download

    hint = RECOMMENDED.get(args.repo)
    if hint:
        print(f"{args.repo}: about {hint.download_gb} GB to download; {hint.guidance}")
    try:
        path = download(args.repo, cache_dir=Path(args.cache_dir) if args.cache_dir else None,
                        endpoint=args.endpoint, progress=not args.no_progress)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"downloaded to {path}\nuse it with: omnidesk --model {args.repo}")
    return 0


def cmd_doctor(args) -> int:
    from omnidesk.doctor import format_report, run_checks

    checks = run_checks()
    print(format_report(checks))
    return 0 if all(c.ok for c in checks) else 1


def cmd_reply(args) -> int:
    from omnidesk.engine.offline import generate_reply
    from omnidesk.models.reply import talker_defaults
    from omnidesk.models.sampling import SamplingParams

    stack = _load(args.model, args.device)
    wave = _read_wav(Path(args.input), stack.features.sampling_rate)
    t0 = time.perf_counter()
    reply = generate_reply(stack, wave, voice=args.voice,
                           thinker_sampling=SamplingParams(greedy=True) if args.greedy else
                           SamplingParams(temperature=0.7, top_p=0.9),
                           talker_sampling=talker_defaults(stack, greedy=args.greedy),
                           max_text_tokens=args.max_text_tokens, max_codec_tokens=args.max_codec_tokens,
                           seed=args.seed)
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


def cmd_talk(args) -> int:
    import asyncio

    import numpy as np
    import soundfile as sf

    from omnidesk.engine.engine import EngineConfig
    from omnidesk.engine.executors.qwen2_5_omni import executor_for
    from omnidesk.engine.talk import Script, latency_table, run_script
    from omnidesk.engine.timeline import Timeline
    from omnidesk.models.demo import is_demo

    stack = _load(args.model, args.device)
    rate = stack.features.sampling_rate
    inputs = [_read_wav(Path(p), rate).numpy().astype(np.float32) for p in args.input]
    barge = None
    if args.barge_in:
        seconds, _, path = args.barge_in.partition(":")
        try:
            barge = (float(seconds), _read_wav(Path(path), rate).numpy().astype(np.float32))
        except ValueError:
            raise SystemExit(f"error: --barge-in wants SECONDS:FILE.wav, got {args.barge_in!r}") from None
    executor = executor_for(stack, greedy=args.greedy, max_text_tokens=args.max_text_tokens,
                            max_codec_tokens=args.max_codec_tokens)
    timeline = Timeline(model={"path": str(stack.path), "demo": is_demo(stack.config.raw),
                               "dtype": str(stack.dtype).replace("torch.", "")}, device=str(stack.device))
    config = EngineConfig(voice=args.voice, seed=args.seed)
    detector = None
    if args.vad == "webrtc":
        from omnidesk.audio.vad import WebRtcVAD

        detector = WebRtcVAD(sample_rate=rate)
    after = None if args.interrupt_after is None else args.interrupt_after / 1000.0
    engine, speaker = asyncio.run(run_script(executor, Script(inputs, barge, args.no_vad, after), config, timeline,
                                             realtime=not args.fast, detector=detector))
    sf.write(args.output, speaker.recording(), speaker.sample_rate)
    timeline.extra["preemptive_used"] = engine.stats.preemptive_used
    timeline.extra["preemptive_discarded"] = engine.stats.preemptive_discarded
    timeline.extra["false_barge_ins"] = engine.stats.false_barge_ins
    timeline.write(args.timeline)
    print(latency_table(timeline))
    print(f"wrote {args.output} ({speaker.clock_samples / speaker.sample_rate:.1f} s) and {args.timeline}")
    return 0


def cmd_live(args) -> int:
    """A conversation on real audio devices in the terminal: one latency line per turn."""
    import threading

    from omnidesk.audio.device import AudioDeviceError, list_devices
    from omnidesk.audio.session import LiveSession, LiveSettings
    from omnidesk.engine.engine import EngineConfig
    from omnidesk.engine.executors.qwen2_5_omni import executor_for
    from omnidesk.engine.talk import LATENCY_HEADER, latency_row
    from omnidesk.engine.timeline import Timeline
    from omnidesk.models.demo import is_demo

    if args.list_devices:
        try:
            devices = list_devices()
        except AudioDeviceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for d in devices:
            marks = [m for m, on in (("default input", d.is_default_input), ("default output", d.is_default_output)) if on]
            print(f"{d.index:3d}  {d.name}  (in {d.inputs}, out {d.outputs}, {d.default_rate:.0f} Hz, {d.hostapi})"
                  + (f"  [{', '.join(marks)}]" if marks else ""))
        return 0
    stack = _load(args.model, args.device)
    executor = executor_for(stack)
    timeline = Timeline(model={"path": str(stack.path), "demo": is_demo(stack.config.raw),
                               "dtype": str(stack.dtype).replace("torch.", "")}, device=str(stack.device))
    finished = threading.Event()
    turns_done = [0]

    def on_update(kind, payload):
        if kind in ("done", "interrupted"):
            turns_done[0] += 1
            print(latency_row(turns_done[0], payload), flush=True)
            if args.turns and turns_done[0] >= args.turns:
                finished.set()
        elif kind == "turn":
            print("  (you're speaking)", flush=True)
        elif kind == "error":
            print(f"error: {payload}", file=sys.stderr, flush=True)
            finished.set()

    settings = LiveSettings(input_device=args.input_device, output_device=args.output_device,
                            headphones=args.headphones, barge_in_confirm_ms=args.barge_in_ms)
    session = LiveSession(executor, settings, EngineConfig(voice=args.voice, seed=args.seed), on_update, timeline)
    try:
        session.start()
    except AudioDeviceError as e:
        print(f"error: {e}\n(see `omnidesk live --list-devices`)", file=sys.stderr)
        return 2
    print(f"listening on {session.audio.describe()}; echo cancellation "
          f"{'off (headphones)' if args.headphones else 'on'}. Speak; Ctrl-C to stop.")
    print(LATENCY_HEADER, flush=True)
    try:
        finished.wait(args.duration or None)
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    if args.timeline:
        timeline.write(args.timeline)
    stats = session.stats
    erle = session.echo_reduction_db()
    print(f"{len(timeline.turns)} turns; barge-ins {stats.barge_ins} confirmed, {stats.false_barge_ins} false; "
          f"echo reduction {'-' if erle is None else f'{erle:.1f} dB'}")
    return 0


def cmd_bench(args) -> int:
    import json

    from omnidesk.engine import bench

    stack = _load(args.model, args.device)
    result = bench.run(stack, turns=args.turns, interrupts=args.interrupts,
                       with_transformers=not args.no_transformers)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


def cmd_default(args) -> int:
    """No subcommand: the desktop window, on the best model available (--model, else the one picked
    in the window last time, else a Qwen2.5-Omni checkpoint in the Hugging Face cache, else the demo
    model).  Without a display (SSH, containers) it runs one check turn in the terminal instead."""
    from omnidesk.gui.app import display_problem

    problem = display_problem()
    if problem is None:
        try:
            import PySide6  # noqa: F401
        except ImportError:
            problem = "the window needs PySide6 (pip install PySide6-Essentials)"
    if problem is None:
        from omnidesk.gui.app import print_demo_notice, run

        return run(args.model, args.device, on_model_loaded=print_demo_notice)

    import torch

    from omnidesk.engine.offline import generate_reply
    from omnidesk.gui.model_loader import choose_model, default_device

    print(f"{problem}\nRunning one check turn in the terminal instead.", file=sys.stderr)
    stack = _load(choose_model(args.model).source, args.device or default_device())
    t = torch.arange(int(1.5 * stack.features.sampling_rate)) / stack.features.sampling_rate
    wave = (0.3 * torch.sin(2 * torch.pi * 180 * t) * torch.sin(torch.pi * t / 1.5)).float()
    reply = generate_reply(stack, wave, max_text_tokens=24, max_codec_tokens=100)
    print(f"model ready: {stack.path}")
    print(f"one turn on a synthetic 1.5 s tone: {len(reply.text_ids)} text tokens, {len(reply.codec_ids)} speech tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnidesk", description="A local voice assistant (Qwen2.5-Omni).")
    # None = choose: the window's last pick, else a cached checkpoint, else the demo (cmd_default)
    parser.add_argument("--model", help="checkpoint dir, cached repo id, or 'demo' (default: the best available)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--install-desktop-entry", action="store_true",
                        help="add OmniDesk to this user's desktop menu (entry + icons) and exit")
    sub = parser.add_subparsers(dest="command")

    models = sub.add_parser("models", help="manage model checkpoints")
    msub = models.add_subparsers(dest="models_command", required=True)
    demo = msub.add_parser("make-demo", help="write the tiny random demo checkpoint (its replies are noise)")
    demo.add_argument("--dir", help="where to write it (default: the user cache dir)")
    demo.add_argument("--force", action="store_true", help="rewrite even if it exists")
    demo.set_defaults(func=cmd_make_demo)
    mlist = msub.add_parser("list", help="Qwen2.5-Omni checkpoints found locally (HF cache and --dir folders)")
    mlist.add_argument("--dir", action="append", help="also look in this folder (repeatable)")
    mlist.set_defaults(func=cmd_models_list)
    mverify = msub.add_parser("verify", help="check a checkpoint: files, headers, tensor names/shapes, a load test")
    mverify.add_argument("path", help="checkpoint folder or cached repo id")
    mverify.add_argument("--no-load-test", action="store_true")
    mverify.set_defaults(func=cmd_models_verify)
    mdl = msub.add_parser("download", help="download Qwen/Qwen2.5-Omni-3B or -7B (only when you ask; resumable)")
    mdl.add_argument("repo", help="e.g. Qwen/Qwen2.5-Omni-3B")
    mdl.add_argument("--endpoint", help="another hub endpoint (a mirror)")
    mdl.add_argument("--cache-dir", help="download into this cache instead of the Hugging Face cache")
    mdl.add_argument("--no-progress", action="store_true")
    mdl.set_defaults(func=cmd_models_download)

    doctor = sub.add_parser("doctor", help="check Python, torch/GPU, audio, Qt and models, and say what to fix")
    doctor.set_defaults(func=cmd_doctor)

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

    talk = sub.add_parser("talk", help="a scripted conversation from WAV files through the engine")
    talk.add_argument("--model", default="demo")
    talk.add_argument("--device", default="cpu")
    talk.add_argument("--input", action="append", required=True, help="16 kHz WAV, one user utterance (repeatable)")
    talk.add_argument("--barge-in", help="SECONDS:FILE.wav played into the mic that long after the first reply starts")
    talk.add_argument("--interrupt-after", type=float, metavar="MS",
                      help="stop the first reply MS after it starts playing, as the stop button does")
    talk.add_argument("--no-vad", action="store_true", help="each input file is exactly one turn")
    talk.add_argument("--vad", choices=("webrtc", "energy"), default="webrtc",
                      help="speech detector: webrtcvad (as the app) or a plain energy threshold")
    talk.add_argument("--greedy", action="store_true")
    talk.add_argument("--seed", type=int, default=0)
    talk.add_argument("--voice")
    talk.add_argument("--fast", action="store_true", help="do not pace in real time (as fast as the CPU allows)")
    talk.add_argument("--max-text-tokens", type=int, help="reply text limit (default 512; 48 for the demo)")
    talk.add_argument("--max-codec-tokens", type=int, help="speech token limit (default 4096; 300 for the demo)")
    talk.add_argument("--output", required=True, help="WAV of what the speaker played (24 kHz)")
    talk.add_argument("--timeline", required=True, help="per-turn latency timeline (JSON)")
    talk.set_defaults(func=cmd_talk)

    live = sub.add_parser("live", help="a conversation on real audio devices in the terminal")
    live.add_argument("--model", default="demo")
    live.add_argument("--device", default="cpu")
    live.add_argument("--input-device", help="microphone: name (or part of it) or index (default: system default)")
    live.add_argument("--output-device", help="speaker: name (or part of it) or index (default: system default)")
    live.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    live.add_argument("--headphones", action="store_true", help="no echo cancellation (nothing leaks to the mic)")
    live.add_argument("--barge-in-ms", type=float, default=300.0,
                      help="speech needed to interrupt a reply (shorter sounds only pause it)")
    live.add_argument("--voice")
    live.add_argument("--seed", type=int, default=0)
    live.add_argument("--turns", type=int, help="stop after this many replies")
    live.add_argument("--duration", type=float, help="stop after this many seconds")
    live.add_argument("--timeline", help="write the session's timeline (JSON) here at the end")
    live.set_defaults(func=cmd_live)

    bench = sub.add_parser("bench", help="latency and throughput benchmark, JSON (vs transformers when installed)")
    bench.add_argument("--model", default="demo")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--turns", type=int, default=3, help="real-time turns per configuration")
    bench.add_argument("--interrupts", type=int, default=50)
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    bench.add_argument("--out", help="also write the JSON here")
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    from omnidesk.models.config import ConfigError
    from omnidesk.models.loading import CheckpointError
    from omnidesk.models.tokenizer import TokenizerError

    if args.install_desktop_entry:
        from omnidesk.desktop import install_desktop_entry

        for path in install_desktop_entry():
            print(f"installed {path}")
        return 0
    try:
        return args.func(args) if getattr(args, "func", None) else cmd_default(args)
    except (CheckpointError, ConfigError, TokenizerError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
