#!/usr/bin/env python
"""Decode steps eager vs compiled, per family and step, on the demo models (CPU), as JSON.

Each family's demo is loaded through the registry (the way every front end loads it) once per mode
(``--modes``, default ``eager,compile``; ``graphs`` on a CUDA device), and its hot steps are timed
through the executor's own calls, so through the decode runner (omnidesk/models/runner.py):

* turn-based families (Qwen2.5-Omni, Qwen3-Omni): ``thinker_step`` ms per reply token and
  ``talker_step`` ms per talker step (bench/turn_bench.py's decode_rates: stop ids off,
  greedy text, bounded counts), the first audio after the endpoint without preemption;
* full-duplex families (Moshi): the whole ``step`` per 80 ms frame (Mimi encode + the LM's frame,
  temporal transformer and depformer + Mimi decode) and the LM's frame step alone.

Per mode also: the warm-up (compile) seconds and the runner's stats (calls per mode, compiles,
recompiles, captured graphs).  A compiled mode is timed after its background compile finished.
Passes alternate between modes (``--repeats``) so load from other processes hits both alike.

    .venv/bin/python bench/decode_runner.py --out bench/results/decode_runner.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from omnidesk.engine.duplex_bench import percentiles, speech_like  # noqa: E402
from omnidesk.models.families import FAMILIES, LoadOptions  # noqa: E402
from omnidesk.models.turn_bench import synthetic_utterance  # noqa: E402
from report import RESULTS, machine, prepare, write  # noqa: E402
from turn_bench import decode_rates  # noqa: E402


def turn_based(loaded, tokens: int, codes: int) -> dict:
    ex = loaded.executor
    audio = synthetic_utterance(rate=ex.sample_rate_in)
    return decode_rates(ex, audio, tokens=tokens, codes=codes, warmup=8, vocoder=False)


def duplex(loaded, frames: int) -> dict:
    ex = loaded.executor
    ex.reset_conversation()
    pcm = speech_like(frames + 10, ex.sample_rate_in, ex.frame_samples_in)
    step_ms, lm_ms = [], []
    gen = getattr(ex, "gen", None)
    for i, frame in enumerate(pcm):
        t0 = time.perf_counter()
        ex.step(frame)
        t1 = time.perf_counter()
        if i >= 10:
            step_ms.append((t1 - t0) * 1e3)
    out = {"frames": len(step_ms), "step_ms": percentiles(step_ms)}
    if gen is not None:  # the LM's frame step alone (temporal + depformer + sampling), on fixed user codes
        codes = torch.zeros(ex.cfg.user_codebooks, dtype=torch.long, device=ex.device)
        for i in range(frames + 10):
            t0 = time.perf_counter()
            f = gen.step(codes)
            if f is not None:
                f.text_id  # the host sync the executor makes per frame
            t1 = time.perf_counter()
            if i >= 10:
                lm_ms.append((t1 - t0) * 1e3)
        out["lm_frame_ms"] = percentiles(lm_ms)
    runner = getattr(ex, "runner", None)
    if runner is not None:
        out["runner"] = runner.stats()
    return out


_WARM_UP = """
import json, sys, time
t0 = time.perf_counter()
from omnidesk.models.families import family_named, LoadOptions
family = family_named(sys.argv[1])
loaded = family.load(family.make_demo(), sys.argv[2], LoadOptions(compile=sys.argv[3]))
t1 = time.perf_counter()
loaded.executor.runner.wait_ready()
print(json.dumps({"load_s": t1 - t0, "warm_up_s": loaded.executor.runner.warmup_s, "to_ready_s": time.perf_counter() - t0,
                  "steps": {k: v["warmup_s"] for k, v in loaded.executor.runner.stats()["steps"].items()}}))
"""


def cold_and_warm(family: str, device: str, mode: str) -> dict:
    """Start-up in a fresh process twice over one new inductor cache: the first compiles from scratch
    (a first start), the second finds the compiled code on disk (every later start)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="omnidesk-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        env.pop("OMNIDESK_COMPILE", None)
        runs = []
        for _ in range(2):
            p = subprocess.run([sys.executable, "-c", _WARM_UP, family, device, mode], env=env, capture_output=True,
                               text=True, timeout=900)
            if p.returncode:
                return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return {"cold": runs[0], "warm": runs[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(f.name for f in FAMILIES), help="comma-separated family names")
    ap.add_argument("--modes", default="eager,compile", help="comma-separated runner modes (eager, compile, graphs)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64, help="timed thinker steps per pass")
    ap.add_argument("--codes", type=int, default=100, help="timed talker steps per pass")
    ap.add_argument("--frames", type=int, default=100, help="timed duplex frames per pass")
    ap.add_argument("--repeats", type=int, default=2, help="passes per mode, alternating between modes")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: as each family's loader sets)")
    ap.add_argument("--no-cold-warm", dest="cold_warm", action="store_false",
                    help="skip the start-up pair (a fresh process compiling from scratch, then from the disk cache)")
    ap.add_argument("--out", default=str(RESULTS / "decode_runner.json"))
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    wanted = [f for f in FAMILIES if f.name in args.families.split(",")]
    result = {"machine": machine("platform", "cpus", "torch", device=args.device, load_avg_before=os.getloadavg()),
              "modes": modes, "families": {}}
    out = prepare(args.out)
    for family in wanted:
        root = family.make_demo()
        loaded, fam = {}, {"demo": str(root), "modes": {}}
        for mode in modes:
            t0 = time.perf_counter()
            loaded[mode] = family.load(root, args.device, LoadOptions(greedy=True, compile=mode))
            if args.threads:
                torch.set_num_threads(args.threads)
            runner = loaded[mode].executor.runner
            runner.wait_ready()
            fam["modes"][mode] = {"load_and_warm_up_s": round(time.perf_counter() - t0, 2),
                                  "warm_up_s": runner.warmup_s, "passes": []}
        for _ in range(args.repeats):
            for mode in modes:
                run = duplex(loaded[mode], args.frames) if family.duplex else \
                    turn_based(loaded[mode], args.tokens, args.codes)
                fam["modes"][mode]["passes"].append(run)
        # per step: the median over passes of each pass's p50, and compiled over eager
        keys = ("step_ms", "lm_frame_ms") if family.duplex else ("thinker_ms", "talker_ms")
        summary = {}
        for key in keys:
            p50 = {m: float(np.median([p[key]["p50"] for p in fam["modes"][m]["passes"] if p.get(key)]))
                   for m in modes if any(p.get(key) for p in fam["modes"][m]["passes"])}
            summary[key] = {"p50_ms": p50}
            if "eager" in p50:
                summary[key]["speedup_over_eager"] = {m: round(p50["eager"] / v, 2) for m, v in p50.items()
                                                      if m != "eager"}
        fam["summary"] = summary
        compiled = [m for m in modes if m != "eager"]
        if args.cold_warm and compiled:
            fam["start_up"] = cold_and_warm(family.name, args.device, compiled[0])
        result["families"][family.name] = fam
        print(family.name, json.dumps(summary), file=sys.stderr)
        write(result, out)
        del loaded
    result["machine"]["load_avg_after"] = os.getloadavg()
    write(result, out)
    print(json.dumps({k: v["summary"] for k, v in result["families"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
