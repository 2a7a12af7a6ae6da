"""Checking this machine and measuring the model: ``omnidesk doctor`` (what is installed and what to
fix) and ``omnidesk bench`` (latency and throughput as JSON)."""

from __future__ import annotations

import sys
from pathlib import Path

from omnidesk.errors import UsageError

from .files import _check_writable, _write_atomic
from .model_setup import _load, _prepare, _turn_tools
from .options import _model_command


def cmd_doctor(args) -> int:
    from omnidesk.doctor import format_report, run_checks

    checks = run_checks()
    print(format_report(checks))
    return 0 if all(c.ok for c in checks) else 1


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


def add_doctor_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="check Python, torch/GPU, audio, Qt and models, and say what to fix")
    doctor.set_defaults(func=cmd_doctor)


def add_bench_parser(sub) -> None:
    bench = _model_command(sub, "bench", "latency and throughput benchmark, JSON (vs transformers when installed); "
                           "for a full-duplex model, the per-frame step against the frame budget")
    bench.add_argument("--turns", type=int, default=3, help="real-time turns per configuration (turn-based models)")
    bench.add_argument("--interrupts", type=int, default=50, help="interruptions timed (turn-based models)")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers side (turn-based models)")
    bench.add_argument("--out", help="also write the JSON here")
    bench.set_defaults(func=cmd_bench)
