"""``omnidesk models``: the checkpoints on this machine (``list``), checking one (``verify``), getting
a published one (``download``, only when the user asks) and writing a tiny demo (``make-demo``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omnidesk.errors import UsageError

from .model_setup import _choose_model
from .options import _model_options


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
        choice = _choose_model(None)
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


def add_parsers(sub) -> None:
    """``models`` and its commands: make-demo, list, verify, download."""
    from omnidesk.models.families import FAMILIES, RECOMMENDED

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
