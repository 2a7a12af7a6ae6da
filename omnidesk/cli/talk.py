"""Conversations with the model: ``omnidesk reply`` (one spoken question from a sound file, answered
unstreamed), ``omnidesk talk`` (a scripted conversation from sound files through the engine, timed
turn by turn) and ``omnidesk live`` (a conversation on the real microphone and speaker)."""

from __future__ import annotations

import sys
import time

from omnidesk.errors import UsageError

from .files import _check_writable, _read_input, write_wav
from .model_setup import Prepared, _load, _prepare, _turn_tools
from .options import END_OF_TURN_HELP, _model_command


def _end_of_turn_judge(args, prepared: Prepared, blocking: bool):
    """The end-of-turn judge ``--end-of-turn`` asks for (None: the fixed silence rule), said in one line."""
    from omnidesk.engine.smart_turn import TurnModelUnavailable
    from omnidesk.engine.turn_judge import make_judge

    if prepared.duplex or args.no_vad:  # no endpointing to decide
        return None
    try:
        judge = make_judge(args.end_of_turn, blocking=blocking)
    except TurnModelUnavailable as e:
        raise UsageError(f"--end-of-turn smart: {e}") from None
    print(f"end of turn: {'the Smart Turn model' if judge else 'silence (400 ms)'}"
          + ("" if judge or args.end_of_turn == "fixed" else " (the Smart Turn model is not installed)"))
    return judge


def cmd_reply(args) -> int:
    import torch

    from omnidesk.models.sampling import SamplingParams

    prepared = _prepare(args, sys.stdout)
    tools = _turn_tools(prepared, "reply")
    args.doing = "reading the input"
    _check_writable(args.output, "--output")
    wave = torch.from_numpy(_read_input(args.input, prepared.input_rate, None if args.no_vad else "webrtc"))
    stack = _load(args, prepared, sys.stdout).stack
    args.doing = "generating the reply"
    t0 = time.perf_counter()
    reply = tools.generate_reply(stack, wave, voice=args.voice,
                                 thinker_sampling=SamplingParams(greedy=True) if args.greedy else
                                 SamplingParams(temperature=0.7, top_p=0.9),
                                 talker_sampling=tools.talker_defaults(stack, greedy=args.greedy),
                                 max_text_tokens=args.max_text_tokens, max_codec_tokens=args.max_codec_tokens,
                                 seed=args.seed)
    elapsed = time.perf_counter() - t0
    rate_in = stack.features.sampling_rate
    if reply.dropped_audio_s:  # longer than the context: heard as a long conversation is, newest first
        print(f"note: {args.input} is {wave.shape[0] / rate_in:.1f} s long; the model's context holds "
              f"{wave.shape[0] / rate_in - reply.dropped_audio_s:.1f} s of it, so its first "
              f"{reply.dropped_audio_s:.1f} s were not heard")
    print(f"heard {wave.shape[0] / rate_in - reply.dropped_audio_s:.2f} s -> {len(reply.prompt_ids)} prompt tokens")
    print(f"reply text ({len(reply.text_ids)} tokens): {reply.text!r}")
    print(f"speech tokens: {len(reply.codec_ids)}; thinker + talker took {elapsed * 1000:.0f} ms (sequential path)")
    if args.output and reply.codec_ids:
        args.doing = "speaking the reply"
        audio, rate, notes = tools.speak(stack, reply, args.voice or stack.default_voice, args.seed)
        write_wav(args.output, audio, rate)
        for line in notes:
            print(line)
        print(f"wrote {audio.size / rate:.2f} s of audio -> {args.output}")
    return 0


def cmd_talk(args) -> int:
    import asyncio

    import soundfile as sf

    from omnidesk.engine.engine import EngineConfig
    from omnidesk.engine.talk import LATENCY_HEADER, Script, latency_row, run_script
    from omnidesk.engine.timeline import Timeline

    barge_seconds = barge_path = None
    if args.barge_in:
        seconds, _, barge_path = args.barge_in.rpartition(":")
        try:
            barge_seconds = float(seconds)
        except ValueError:
            barge_seconds = None
        if barge_seconds is None or barge_seconds < 0 or not barge_path:
            raise UsageError(f"--barge-in wants SECONDS:FILE.wav (e.g. 1.0:cut.wav), got '{args.barge_in}'")
    prepared = _prepare(args, sys.stdout)
    if prepared.duplex and args.barge_in:
        raise UsageError(f"--barge-in needs a turn-based model; {prepared.family.title} is full duplex (it "
                         f"hears you while it talks): give the interruption as another --input, or use "
                         f"--interrupt-after to stop it")
    rate = prepared.input_rate
    args.doing = "reading the inputs"
    _check_writable(args.output, "--output")
    _check_writable(args.timeline, "--timeline")
    inputs = [_read_input(p, rate, None if args.no_vad else args.vad) for p in args.input]
    # a barge-in need not be speech (a cough tests a false barge-in): only silence is refused
    barge = None if barge_path is None else (barge_seconds, _read_input(barge_path, rate, None))
    loaded = _load(args, prepared, sys.stdout)
    args.doing = "the scripted conversation"
    executor = loaded.executor
    timeline = Timeline(model=loaded.model_info, device=loaded.device)
    config = EngineConfig(voice=args.voice, seed=args.seed)
    detector = None
    if args.vad == "webrtc":
        from omnidesk.audio.vad import WebRtcVAD
        from omnidesk.engine.duplex import vad_rate

        detector = WebRtcVAD(sample_rate=vad_rate(executor))  # 16 kHz, also where the model hears 24
    after = None if args.interrupt_after is None else args.interrupt_after / 1000.0
    judge = _end_of_turn_judge(args, prepared, blocking=args.fast)  # --fast: scored inline, reproducibly
    held: dict = {}
    interrupted = False
    printed: set[int] = set()  # turns whose line is out: each turn is printed as it ends

    def print_turn(kind, turn) -> None:
        if kind in ("done", "interrupted", "error") and not prepared.duplex:
            turn = getattr(turn, "turn", turn)  # an error update carries its turn
            if turn in timeline.turns and id(turn) not in printed:
                if not printed:
                    print(LATENCY_HEADER, flush=True)
                printed.add(id(turn))
                print(latency_row(timeline.turns.index(turn) + 1, turn), flush=True)

    try:
        engine, speaker = asyncio.run(run_script(executor, Script(inputs, barge, args.no_vad, after), config,
                                                 timeline, realtime=not args.fast, detector=detector, judge=judge,
                                                 held=held, on_update=print_turn))
    except KeyboardInterrupt:  # Ctrl-C: what happened so far is still written
        if "speaker" not in held:
            raise
        engine, speaker, interrupted = held["engine"], held["speaker"], True
    finally:
        if judge is not None:
            judge.close()
    # written whatever happened: a failed turn is in the timeline with the turns before it
    args.doing = "writing the results"
    write_wav(args.output, speaker.recording(), speaker.sample_rate)
    timeline.extra["preemptive_used"] = engine.stats.preemptive_used
    timeline.extra["preemptive_discarded"] = engine.stats.preemptive_discarded
    timeline.extra["false_barge_ins"] = engine.stats.false_barge_ins
    timeline.write(args.timeline)
    if prepared.duplex:
        print(duplex_summary(timeline.extra.get("duplex") or {}))
    else:  # the turns not printed yet (one cut short by the end of the run)
        for number, turn in enumerate(timeline.turns, 1):
            if id(turn) not in printed:
                if not printed:
                    print(LATENCY_HEADER)
                printed.add(id(turn))
                print(latency_row(number, turn))
    if getattr(args, "server", None):  # each turn's network share; the server's audio notice
        from omnidesk.remote.frontend import session_notes

        for line in session_notes(timeline, args.remote_said):
            print(line)
    print(f"wrote {args.output} ({speaker.clock_samples / speaker.sample_rate:.1f} s) and {args.timeline}")
    if interrupted:
        print(f"interrupted: the timeline holds the {len(timeline.turns)} turn(s) so far and {args.output} what "
              f"was played", file=sys.stderr)
        return 130
    failure = getattr(engine, "failure", None)
    if failure is not None:
        print(f"error: the reply failed in the {failure.stage}: {failure.message}", file=sys.stderr)
        return 1
    heard = (timeline.extra.get("duplex") or {}).get("user_speech") if prepared.duplex else timeline.turns
    if not heard:
        print("error: no speech detected: the speech detector started no turn in the inputs "
              "(pass --no-vad to make each file one turn)", file=sys.stderr)
        return 1
    return 0


def duplex_summary(section: dict) -> str:
    """A few lines on a full-duplex session (the timeline's "duplex" section): frames, step times, exchanges."""
    import numpy as np

    steps = np.asarray(section.get("step_ms") or [], dtype=float)
    frame_ms = 1000.0 * section.get("frame_s", 0.08)
    if steps.size:
        p50, p90, worst = np.percentile(steps, 50), np.percentile(steps, 90), steps.max()
        times = f"step p50 {p50:.1f} ms, p90 {p90:.1f} ms, max {worst:.1f} ms"
    else:
        times = "no steps"
    lines = [f"duplex: {steps.size} frames of {frame_ms:.0f} ms; {times}; late frames {section.get('late_frames', 0)}"
             f", dropped {section.get('dropped_frames', 0)}, max lag {section.get('max_lag_s', 0.0) * 1000:.0f} ms"]
    users = section.get("user_speech") or []
    lines.append(f"user speech: {len(users)} segment(s)"
                 + "".join(f"  [{a:.2f}-{'?' if b is None else f'{b:.2f}'} s]" for a, b in users[:8]))
    exchanges = section.get("exchanges") or []
    if not exchanges:
        lines.append("exchanges: none (the assistant did not start speaking after the user)")
    for i, x in enumerate(exchanges, 1):
        lines.append(f"exchange {i}: user {x['user_speech_start']:.2f}-{x['user_speech_end']:.2f} s, assistant "
                     f"from {x['assistant_speech_start']:.2f} s: delay {x['delay_s'] * 1000:+.0f} ms")
    said = " ".join(s["text"] for s in section.get("assistant_speech") or [] if s.get("text")).strip()
    if said:
        lines.append(f"assistant text: {said[:200]!r}")
    return "\n".join(lines)


NO_DEVICES = ("no audio devices found: PortAudio sees no sound card or sound server; check that "
              "PulseAudio/PipeWire is running (`pactl info`) and that you may use the audio devices, "
              "then run `omnidesk doctor`")


def cmd_live(args) -> int:
    """A conversation on real audio devices in the terminal: one latency line per turn."""
    import threading

    from omnidesk.audio.device import AudioDeviceError, list_devices

    if args.list_devices:
        try:
            devices = list_devices()
        except AudioDeviceError as e:
            raise UsageError(f"{e} (run `omnidesk doctor` to see what is missing)") from None
        if not devices:
            raise UsageError(NO_DEVICES)
        for d in devices:
            marks = [m for m, on in (("default input", d.is_default_input), ("default output", d.is_default_output)) if on]
            print(f"{d.index:3d}  {d.name}  (in {d.inputs}, out {d.outputs}, {d.default_rate:.0f} Hz, {d.hostapi})"
                  + (f"  [{', '.join(marks)}]" if marks else ""))
        return 0

    from omnidesk.audio.aec import EchoCancellerUnavailable
    from omnidesk.audio.session import LiveSession, LiveSettings
    from omnidesk.engine.smart_turn import TurnModelUnavailable
    from omnidesk.engine.engine import EngineConfig
    from omnidesk.engine.talk import LATENCY_HEADER, latency_row
    from omnidesk.engine.timeline import Timeline

    prepared = _prepare(args, sys.stdout)
    _check_writable(args.timeline, "--timeline")
    loaded = _load(args, prepared, sys.stdout)
    args.doing = "the live conversation"
    executor = loaded.executor
    timeline = Timeline(model=loaded.model_info, device=loaded.device)
    finished = threading.Event()
    turns_done = [0]
    errors: list[str] = []

    def on_update(kind, payload):
        if kind == "duplex":  # a full-duplex model: one line per exchange (user stops -> it starts)
            if len(payload.delays_s) > turns_done[0]:
                turns_done[0] = len(payload.delays_s)
                print(f"exchange {turns_done[0]}: delay {payload.delays_s[-1] * 1000:+.0f} ms; step p50 "
                      f"{payload.step_ms_p50 or 0:.1f} ms, late frames {payload.late_frames}", flush=True)
                if args.turns and turns_done[0] >= args.turns:
                    finished.set()
        elif kind in ("done", "interrupted"):
            turns_done[0] += 1
            print(latency_row(turns_done[0], payload), flush=True)
            if getattr(args, "server", None):  # the turn's network share; the server's audio notice
                from omnidesk.remote.frontend import turn_notes

                for line in turn_notes(turns_done[0], payload, args.remote_said):
                    print(line, flush=True)
            if args.turns and turns_done[0] >= args.turns:
                finished.set()
        elif kind == "turn":
            print("  (you're speaking)", flush=True)
        elif kind == "error":
            errors.append(str(payload))
            print(f"error: {payload}", file=sys.stderr, flush=True)
            if getattr(payload, "stage", None) == "server":  # a server's failure drops the turn, not the session
                print("(the conversation goes on: say it again)", flush=True)
            else:
                finished.set()

    settings = LiveSettings(input_device=args.input_device, output_device=args.output_device,
                            headphones=args.headphones, barge_in_confirm_ms=args.barge_in_ms,
                            end_of_turn=args.end_of_turn)
    session = LiveSession(executor, settings, EngineConfig(voice=args.voice, seed=args.seed), on_update, timeline)
    try:
        session.start()
    except AudioDeviceError as e:
        raise UsageError(f"{e} (see `omnidesk live --list-devices`)") from None
    except EchoCancellerUnavailable as e:
        raise UsageError(f"{e} (--headphones)") from None
    except TurnModelUnavailable as e:
        raise UsageError(f"--end-of-turn smart: {e}") from None
    detector = getattr(session, "end_of_turn", None)  # "fixed", "smart-turn-v3"
    turn_end = "" if prepared.duplex or detector is None else \
        f"; end of turn: {'silence (400 ms)' if detector == 'fixed' else 'the Smart Turn model'}"
    print(f"listening on {session.audio.describe()}; echo cancellation "
          f"{'off (headphones)' if args.headphones else 'on'}{turn_end}. Speak; Ctrl-C to stop.")
    print(f"the model hears: {session.hearing}", flush=True)
    if not prepared.duplex:
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
    if prepared.duplex:
        print(duplex_summary(timeline.extra.get("duplex") or {}))
    print(f"{turns_done[0] if prepared.duplex else len(timeline.turns)} {'exchanges' if prepared.duplex else 'turns'}; barge-ins {stats.barge_ins} confirmed, {stats.false_barge_ins} false; "
          f"echo reduction {'-' if erle is None else f'{erle:.1f} dB'}")
    return 1 if errors else 0


def add_parsers(sub) -> None:
    """``reply``, ``talk`` and ``live``."""
    from omnidesk.engine.turn_judge import END_OF_TURN_CHOICES

    reply = _model_command(sub, "reply", "answer one spoken question from a sound file")
    reply.add_argument("--input", required=True,
                       help="WAV file with the question (any rate and channel count: mixed to mono and resampled)")
    reply.add_argument("--no-vad", action="store_true", help="do not refuse a file in which webrtcvad hears no speech")
    reply.add_argument("--voice", help="voice name from the checkpoint's spk_dict.pt")
    reply.add_argument("--greedy", action="store_true", help="greedy decoding (reference do_sample=False)")
    reply.add_argument("--seed", type=int, default=0)
    reply.add_argument("--max-text-tokens", type=int, default=128)
    reply.add_argument("--max-codec-tokens", type=int, default=1000)
    reply.add_argument("--output", help="write the spoken reply to this WAV file (24 kHz)")
    reply.set_defaults(func=cmd_reply)

    talk = _model_command(sub, "talk", "a scripted conversation from WAV files through the engine", server=True)
    talk.add_argument("--input", action="append", required=True,
                      help="WAV file, one user utterance (repeatable; any rate and channel count)")
    talk.add_argument("--barge-in", help="SECONDS:FILE.wav played into the mic that long after the first reply starts")
    talk.add_argument("--interrupt-after", type=float, metavar="MS",
                      help="stop the first reply MS after it starts playing, as the stop button does")
    talk.add_argument("--no-vad", action="store_true",
                      help="each input file is exactly one turn (and is not checked for speech)")
    talk.add_argument("--vad", choices=("webrtc", "energy"), default="webrtc",
                      help="speech detector: webrtcvad (as the app) or a plain energy threshold")
    talk.add_argument("--end-of-turn", choices=END_OF_TURN_CHOICES, default="auto", help=END_OF_TURN_HELP)
    talk.add_argument("--greedy", action="store_true")
    talk.add_argument("--seed", type=int, default=0)
    talk.add_argument("--voice")
    talk.add_argument("--fast", action="store_true", help="do not pace in real time (as fast as the CPU allows)")
    talk.add_argument("--max-text-tokens", type=int, help="reply text limit (default 512; 48 for the demo)")
    talk.add_argument("--max-codec-tokens", type=int, help="speech token limit (default 4096; 300 for the demo)")
    talk.add_argument("--output", required=True, help="WAV of what the speaker played (24 kHz)")
    talk.add_argument("--timeline", required=True, help="per-turn latency timeline (JSON)")
    talk.set_defaults(func=cmd_talk)

    live = _model_command(sub, "live", "a conversation on real audio devices in the terminal", server=True)
    live.add_argument("--input-device", help="microphone: name (or part of it) or index (default: system default)")
    live.add_argument("--output-device", help="speaker: name (or part of it) or index (default: system default)")
    live.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    live.add_argument("--headphones", action="store_true", help="no echo cancellation (nothing leaks to the mic)")
    live.add_argument("--barge-in-ms", type=float, default=300.0,
                      help="speech needed to interrupt a reply (shorter sounds only pause it)")
    live.add_argument("--end-of-turn", choices=END_OF_TURN_CHOICES, default="auto", help=END_OF_TURN_HELP)
    live.add_argument("--voice")
    live.add_argument("--seed", type=int, default=0)
    live.add_argument("--turns", type=int, help="stop after this many replies")
    live.add_argument("--duration", type=float, help="stop after this many seconds")
    live.add_argument("--timeline", help="write the session's timeline (JSON) here at the end")
    live.set_defaults(func=cmd_live)
