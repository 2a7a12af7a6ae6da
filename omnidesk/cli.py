"""The `omnidesk` command.

User errors (a missing file, a device this machine cannot use, a damaged
checkpoint, ...) end with one line on stderr starting "error:" and exit code 2.
Anything unexpected ends with "error: <what failed>: <message>" plus where the
traceback went, and exit code 1 (``OMNIDESK_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omnidesk.errors import UsageError  # noqa: F401 - raised here, and imported from here by callers

EXIT_USER_ERROR = 2
DEBUG_ENV = "OMNIDESK_DEBUG"


# ---------------------------------------------------------------- model and device

def _remembered_model() -> str | None:
    """The model the window's model picker remembers (its QSettings), or None."""
    try:
        from omnidesk.gui.settings import Settings

        return Settings().model
    except Exception:  # no PySide6, unreadable settings: nothing remembered
        return None


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
    from omnidesk.models.choice import WHY_CONFIGURED, check_device, choose_model, default_device, why_default_device
    from omnidesk.models.families import demo_family, resolve_model

    if getattr(args, "server", None):  # the model runs on a vLLM-Omni server (omnidesk/remote)
        from omnidesk.remote.frontend import prepare_server

        return prepare_server(args, out, Prepared)
    args.doing = "choosing the model"
    if args.device:
        device, device_why = check_device(args.device), "given with --device"
    else:
        device, device_why = default_device(), why_default_device()
    choice = choose_model(args.model, remembered=None if args.model else _remembered_model())
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


# ---------------------------------------------------------------- input and output files

def _read_wav(path_text: str, rate: int):
    """A sound file as float32 mono at ``rate`` (channels mixed down, resampled with soxr)."""
    import numpy as np
    import soundfile as sf

    path = Path(path_text)
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    if path.is_dir():
        raise UsageError(f"{path} is a folder, not a sound file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read {path}: permission denied")
    if path.stat().st_size == 0:
        raise UsageError(f"{path} is empty (0 bytes)")
    try:
        data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError, OSError) as e:
        reason = getattr(e, "error_string", None) or str(e)
        raise UsageError(f"cannot read {path}: not a sound file this program reads (WAV, FLAC, OGG) "
                         f"({reason.strip().rstrip('.')})") from None
    if data.shape[0] == 0:
        raise UsageError(f"{path} is empty: it holds no audio samples")
    mono = data.mean(axis=1, dtype=np.float32)
    if file_rate != rate:
        import soxr

        mono = soxr.resample(mono, file_rate, rate).astype(np.float32)
    return mono


def _speech_found(audio, rate: int, detector: str) -> bool:
    """Whether ``detector`` ("webrtc" as the app, or "energy") finds a run of speech long enough to
    start a turn (the endpointer's ``speech_start_ms``) in ``audio``, judged in 40 ms frames at 16 kHz
    after the lead-in silence ``talk`` plays first."""
    import math

    import numpy as np

    from omnidesk.engine.talk import FRAME_S, LEAD_SILENCE_S
    from omnidesk.engine.vad import EndpointerConfig, EnergyVAD

    vad_rate = 16000
    if rate != vad_rate:
        import soxr

        audio = soxr.resample(audio, rate, vad_rate).astype(np.float32)
    cfg = EndpointerConfig()
    if detector == "webrtc":
        from omnidesk.audio.vad import FILE_FLOOR_DBFS, WebRtcVAD, WebRtcVADConfig

        # a file is all start-up for webrtcvad: faint hiss would pass as speech without a floor
        vad = WebRtcVAD(sample_rate=vad_rate, config=WebRtcVADConfig(floor_dbfs=FILE_FLOOR_DBFS))
    else:
        vad = EnergyVAD()
    frame = int(round(vad_rate * FRAME_S))
    need = math.ceil(cfg.speech_start_ms / (FRAME_S * 1000))
    # the detector's noise model adapts: judge the file after the same lead-in `talk` plays (whole frames)
    lead = np.zeros(int(round(LEAD_SILENCE_S / FRAME_S)) * frame, np.float32)
    x = np.concatenate([lead, audio, np.zeros((-(lead.size + audio.size)) % frame, np.float32)])
    run = 0
    for i in range(0, x.size, frame):
        run = run + 1 if vad.is_speech(x[i:i + frame]) else 0
        if run >= need:
            return True
    return False


def _read_input(path_text: str, rate: int, detector: str | None):
    """``_read_wav``, refusing a file with no speech: all zeros always; with ``detector`` also a
    file in which it hears none."""
    import numpy as np

    audio = _read_wav(path_text, rate)
    if not np.any(audio):
        raise UsageError(f"no speech detected in {path_text}: it is silent (every sample is zero)")
    if detector is not None and not _speech_found(audio, rate, detector):
        name = "the webrtcvad speech detector" if detector == "webrtc" else "the energy speech detector"
        raise UsageError(f"no speech detected in {path_text} ({name} heard none); record it louder or closer "
                         f"to the microphone, or pass --no-vad to use the file as it is")
    return audio


def _check_writable(path_text: str | None, option: str) -> None:
    """Fail before loading when an output file cannot be written (a missing folder, a folder given)."""
    if not path_text:
        return
    path = Path(path_text)
    if path.is_dir():
        raise UsageError(f"{option} {path}: that is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: no such folder: {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: permission denied")
    # access() says yes to root on a read-only file system: create and remove a file there to be sure
    probe = parent / f".{path.name}.check{os.getpid()}"
    try:
        probe.touch()
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write in {parent} ({e.strerror or e})") from None
    probe.unlink(missing_ok=True)


def _write_atomic(path_text: str, write) -> None:
    """``write(tmp_path)`` to a temporary name beside ``path_text``, then rename it into place: an
    interrupted or failed write never leaves a half-written file under the user's name."""
    path = Path(path_text)
    tmp = path.with_name(f".{path.name}.part{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_wav(path_text: str, audio, rate: int) -> None:
    """A WAV file written whole or not at all (:func:`_write_atomic`)."""
    import soundfile as sf

    _write_atomic(path_text, lambda tmp: sf.write(str(tmp), audio, rate, format="WAV"))


# ---------------------------------------------------------------- commands

def cmd_make_demo(args) -> int:
    from omnidesk.models.families import FAMILIES, family_named

    try:
        family = family_named(args.family) if args.family else FAMILIES[0]
    except ValueError as e:
        raise UsageError(str(e)) from None
    t0 = time.perf_counter()
    path = family.make_demo(args.dir, force=args.force)
    size = sum(p.stat().st_size for p in path.iterdir()) / 1e6
    print(f"{path}  ({size:.1f} MB, {(time.perf_counter() - t0) * 1000:.0f} ms; --model {family.demo_name} names it)")
    print(f"NOTE: {family.demo_notice}")
    return 0


def cmd_models_list(args) -> int:
    from omnidesk.models.checkpoint import hf_hub_cache
    from omnidesk.models.families import SMALLEST_REPO
    from omnidesk.models.inventory import find_checkpoints

    found = find_checkpoints([Path(d) for d in args.dir or []], include_demo=True)
    for info in found:
        state = "BROKEN" if info.problems else f"NOT SUPPORTED ({info.unsupported})" if info.unsupported else "ok"
        demo = "  (the demo model: random weights, its replies are noise)" if info.demo else ""
        params = f"{info.params / 1e9:.2f}B" if info.params >= 1e9 else f"{info.params / 1e6:.1f}M"
        print(f"{info.name}{demo}\n    {info.path}\n    {info.title}{' (full duplex)' if info.duplex else ''}, "
              f"{info.size_bytes / 1e9:.2f} GB, {params} params, {info.dtype}, "
              f"voices: {', '.join(info.voices) or '-'}, {state}")
        if info.quantization or info.memory:  # the weights' format and the GPU memory of each way to run it
            modes = ", ".join(f"{mode} {m / 2**30:.1f} GiB" for mode, m in info.memory.items())
            print(f"    weights: {info.quantization or 'not quantized'}"
                  + (f"; GPU memory at 8192 tokens of context: {modes}" if modes else ""))
        for problem in info.problems:
            print(f"    problem: {problem}")
    if not any(not info.demo for info in found):
        print(f"no real checkpoint found in the Hugging Face cache ({hf_hub_cache()})"
              + (" or the given folders" if args.dir else "")
              + f"; get one with: omnidesk models download {SMALLEST_REPO}")
    return 0


def cmd_models_verify(args) -> int:
    from omnidesk.models.families import family_named, verify

    if args.path and args.model and args.path != args.model:
        raise UsageError(f"two checkpoints to verify ('{args.path}' and --model '{args.model}'); give one")
    target = args.path or args.model
    if not target:
        from omnidesk.models.choice import choose_model

        choice = choose_model(None, remembered=_remembered_model())
        target = choice.source
        print(f"verifying {target} ({choice.why}; name another with: omnidesk models verify PATH|REPO|demo)")
    last = [-1]

    def progress(done: int, total: int) -> None:  # a 7B check reads ~15 GB: say how far it is
        if total < 2**30:
            return
        pct = done * 100 // total
        if pct >= last[0] + 5 or done == total:
            last[0] = pct
            end = "\n" if done == total else ("\r" if sys.stderr.isatty() else "\n")
            print(f"  checking every value: {pct:3d}% ({done / 1e9:.1f} of {total / 1e9:.1f} GB)", end=end,
                  file=sys.stderr, flush=True)

    report = verify(target, load_test=not args.no_load_test, progress=progress)
    if report.family:
        print(f"  {family_named(report.family).title} checkpoint at {report.path}")
    for line in report.checked:
        print(f"  ok  {line}")
    if args.no_load_test:
        print("  --  load test skipped (--no-load-test)")
    for line in report.notes:
        print(f"  --  {line}")
    if report.demo:
        print(f"  --  {family_named(report.family).demo_notice}")
    for line in report.problems:
        print(f"  !!  {line}")
    if report.unsupported:
        print(f"  !!  OmniDesk cannot run this checkpoint: {report.unsupported}")
    print("verified: no problems" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.usable else 1


def cmd_models_download(args) -> int:
    from omnidesk.models.families import RECOMMENDED
    from omnidesk.models.download import DownloadError, download

    hint = RECOMMENDED.get(args.repo)
    if hint:
        print(f"{args.repo}: {hint.summary()}")
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


def cmd_bench(args) -> int:
    import json

    # stdout is the JSON: what was chosen and the demo notice go to stderr
    if args.out:  # checked before minutes of benchmark, not after
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {args.out}: cannot make its folder ({e.strerror or e})") from None
        _check_writable(args.out, "--out")
    prepared = _prepare(args, sys.stderr)
    if prepared.family.duplex:  # no turns: the frame clock (step time against the frame budget)
        from omnidesk.engine.duplex_bench import run as run_duplex_bench

        loaded = _load(args, prepared, sys.stderr)
        args.doing = "the benchmark"
        result = run_duplex_bench(loaded.executor, loaded.model_info, loaded.device)
    else:
        tools = _turn_tools(prepared, "bench")
        stack = _load(args, prepared, sys.stderr).stack
        args.doing = "the benchmark"
        result = tools.run_bench(stack, turns=args.turns, interrupts=args.interrupts,
                                 with_transformers=not args.no_transformers)
    text = json.dumps(result, indent=2)
    print(text, flush=True)  # the results always reach stdout, whatever happens to --out
    if args.out:
        args.doing = f"writing {args.out} (the JSON is above)"
        _write_atomic(args.out, lambda tmp: tmp.write_text(text))
    return 0


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


def _build_parser() -> argparse.ArgumentParser:
    from omnidesk.engine.turn_judge import END_OF_TURN_CHOICES
    from omnidesk.remote.frontend import add_server_options
    from omnidesk.models.families import FAMILIES, RECOMMENDED

    parser = argparse.ArgumentParser(
        prog="omnidesk", description=f"A local voice assistant ({', '.join(f.title for f in FAMILIES)}).",
        epilog="Without a command: the desktop window.  Errors: one line starting 'error:' on stderr; exit code "
               f"2 for a problem you can fix (a file, a device, a checkpoint), 1 for anything else (set "
               f"{DEBUG_ENV}=1 for the traceback).")
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
    parser.add_argument("--install-desktop-entry", action="store_true",
                        help="add OmniDesk to this user's desktop menu (entry + icons) and exit")
    sub = parser.add_subparsers(dest="command")

    models = sub.add_parser("models", help="manage model checkpoints")
    msub = models.add_subparsers(dest="models_command", required=True)
    demo = msub.add_parser("make-demo", help="write the tiny random demo checkpoint (its replies are noise)")
    demo.add_argument("--dir", help="where to write it (default: the user cache dir)")
    demo.add_argument("--force", action="store_true", help="rewrite even if it exists")
    demo.add_argument("--family", help="which model family's demo: " + ", ".join(
        f"{f.name} ({'default, ' if f is FAMILIES[0] else ''}{'full duplex, ' if f.duplex else ''}named "
        f"'{f.demo_name}')" for f in FAMILIES))
    demo.set_defaults(func=cmd_make_demo)
    mlist = msub.add_parser("list", help="checkpoints found locally (HF cache, --dir folders, and the demo "
                                         "models once made)")
    mlist.add_argument("--dir", action="append", help="also look in this folder (repeatable)")
    mlist.set_defaults(func=cmd_models_list)
    mverify = msub.add_parser("verify", help="check a checkpoint: files, headers, tensor names/shapes, a load test")
    mverify.add_argument("path", nargs="?", help="checkpoint folder, cached repo id, or 'demo' "
                                                 "(default: the model the other commands would use)")
    _model_options(mverify, device=False)
    mverify.add_argument("--no-load-test", action="store_true")
    mverify.set_defaults(func=cmd_models_verify)
    mdl = msub.add_parser("download", help="download a published checkpoint (only when you ask; resumable): "
                                           + ", ".join(RECOMMENDED))
    mdl.add_argument("repo", help="a Hugging Face repo id; the published ones OmniDesk knows (it says their size and "
                                  "what they need before downloading): " + ", ".join(RECOMMENDED))
    mdl.add_argument("--endpoint", help="another hub endpoint (a mirror)")
    mdl.add_argument("--cache-dir", help="download into this cache instead of the Hugging Face cache")
    mdl.add_argument("--no-progress", action="store_true")
    mdl.set_defaults(func=cmd_models_download)

    doctor = sub.add_parser("doctor", help="check Python, torch/GPU, audio, Qt and models, and say what to fix")
    doctor.set_defaults(func=cmd_doctor)

    reply = sub.add_parser("reply", help="answer one spoken question from a sound file")
    _model_options(reply)
    _quantize_option(reply)
    _compile_option(reply)
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

    talk = sub.add_parser("talk", help="a scripted conversation from WAV files through the engine")
    _model_options(talk)
    add_server_options(talk)
    _quantize_option(talk)
    _compile_option(talk)
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

    live = sub.add_parser("live", help="a conversation on real audio devices in the terminal")
    _model_options(live)
    add_server_options(live)
    _quantize_option(live)
    _compile_option(live)
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

    bench = sub.add_parser("bench", help="latency and throughput benchmark, JSON (vs transformers when installed); "
                           "for a full-duplex model, the per-frame step against the frame budget")
    _model_options(bench)
    _quantize_option(bench)
    _compile_option(bench)
    bench.add_argument("--turns", type=int, default=3, help="real-time turns per configuration (turn-based models)")
    bench.add_argument("--interrupts", type=int, default=50, help="interruptions timed (turn-based models)")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers side (turn-based models)")
    bench.add_argument("--out", help="also write the JSON here")
    bench.set_defaults(func=cmd_bench)
    return parser


def _log_traceback(error: BaseException, argv: list[str]) -> Path | None:
    """Append the traceback to the log file the window uses; its path, or None if it cannot be written."""
    import traceback

    from omnidesk.gui.errors import LOG_NAME, default_log_dir

    path = default_log_dir() / LOG_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR omnidesk.cli "
                    f"`omnidesk {' '.join(argv)}` failed\n")
            f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    except OSError:
        return None
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    from omnidesk.audio.device import AudioDeviceError
    from omnidesk.models.choice import DeviceError
    from omnidesk.models.checkpoint import CheckpointError, ConfigError

    if args.install_desktop_entry:
        from omnidesk.desktop import install_desktop_entry

        for path in install_desktop_entry():
            print(f"installed {path}")
        return 0
    args.doing = f"omnidesk {args.command or ''}".strip()
    try:
        _merge_options(args)
        return args.func(args) if getattr(args, "func", None) else cmd_default(args)
    except (UsageError, DeviceError, CheckpointError, ConfigError, AudioDeviceError) as e:
        print(f"error: {str(e).strip() or type(e).__name__}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"error: {args.doing} failed: {type(e).__name__}{': ' + first if first else ''}", file=sys.stderr)
        log = _log_traceback(e, argv)
        print(f"details: {f'the traceback is in {log}; ' if log else ''}rerun with {DEBUG_ENV}=1 "
              f"to print it here", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
