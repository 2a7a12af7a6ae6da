"""The decode runner: every family's hot steps, run eager, compiled or as captured CUDA graphs.

A family registers its hot steps (the thinker's and talker's one-token decode, Qwen3-Omni's
code-predictor frame, Moshi's frame; on the CPU also Qwen2.5-Omni's vocoder: the DiT's RK4 step and
BigVGAN's anti-aliased activation, over windows of any length) as plain functions over tensors: small
inputs (token ids, positions, sampling noise) in, small outputs (hidden states, the next token) out,
caches written in place.  Sampling happens inside the step (:func:`omnidesk.models.sampling.sample`);
nothing in a step reads a tensor on the host, so one function serves every mode:

* ``eager``: the function as written;
* ``compile``: ``torch.compile(fullgraph=True)`` (a graph break is an error, not a slowdown).  Its
  shapes are static but for the dimensions a step marks dynamic itself (on the CPU, the attended
  length of a KV cache: :meth:`omnidesk.models.kv_cache.KVCache.span`; a vocoder window's length
  and width, marked on the step's example inputs).  Inductor writes the code around the kernels
  in C++ (``cpp_wrapper``) unless a step asks for Python (:data:`CPP_WRAPPER`);
* ``graphs`` (CUDA only): each step is captured as a CUDA graph per input signature (shapes, dtypes
  and the identity of its state objects) and replayed, after one eager call of that signature that
  warms it up; a signature not captured yet runs eagerly, as nano-vllm's and moshi's runners fall
  back.  A replay copies the step's tensor inputs into the graph's static buffers and returns
  copies of its outputs, so callers can keep them.

Start-up stays fast: compilation runs on a background thread (:meth:`DecodeRunner.warm_up`) over
scratch inputs of the same shapes that each step's ``example`` builds, while the conversation runs
eagerly; a step switches to its compiled form once that is ready.  Inductor's cache lives in
``~/.cache/omnidesk/inductor`` (set before torch compiles anything), so a second start reuses the
compiled code.  Capture is quick and runs on the engine thread at the step's second call.

Recompiles are counted per step (every call of the compile backend is one); after warm-up a
conversation (rollback, cache-full drops, barge-in) must not add any: they write the same
buffers at other positions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine.cpu_priority import lower_this_thread

log = logging.getLogger(__name__)

MODES = ("eager", "compile", "graphs")
SETTINGS = ("auto", "off", "on")

# Families whose compiled CPU steps the bench (bench/decode_runner.py) shows paying off at the demo
# sizes; "auto" compiles only these on the CPU.  See the README's performance section.
CPU_COMPILE_PAYS: frozenset[str] = frozenset({"qwen2_5_omni", "qwen3_omni"})


# Inductor's code around the kernels (allocations, views, size checks, the calls into matmul) in C++
# rather than Python: at the demo's sizes a decode step is mostly that code.  Measured on the CPU demo
# (one torch thread, a reply's first audio chunk, three alternating runs, ms in the compiled steps per
# chunk): thinker 19.7-22.2 -> 18.7-19.6, talker 17.2-19.3 -> 15.6-15.8, the DiT's RK4 step 9.7-10.9
# -> 8.1-8.6; the whole chunk 88-100 -> 87-90.  BigVGAN's activation (window lengths marked dynamic)
# was slower with it (13.3-13.9 -> 14.7-15.7, another core busy) and keeps the Python wrapper.  A cold
# compile of the demo's steps took no longer (69 s; 99 s without), a warm start as long (~11.5 s).
CPP_WRAPPER = True


def inductor_cache_dir() -> Path:
    """Where compiled steps are cached between starts (inductor's FX graph and code caches)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "omnidesk" / "inductor"


def resolve_mode(setting: str | None, device: torch.device | str, family: str | None = None) -> str:
    """The runner mode for a ``--compile`` setting on ``device``.

    ``off``: eager.  ``on``: CUDA graphs on a GPU, torch.compile on the CPU.  ``auto`` (the default):
    CUDA graphs on a GPU; on the CPU torch.compile only for a family the bench shows it pays for
    (:data:`CPU_COMPILE_PAYS`), else eager.  ``OMNIDESK_COMPILE`` in the environment replaces ``auto``
    (the test suite sets ``off``: it runs eager unless a test asks for a mode).  A mode's own name (``eager``,
    ``compile``, ``graphs``) is taken as it is."""
    if setting in (None, "auto"):  # the environment sets the default, never overrides a choice
        setting = os.environ.get("OMNIDESK_COMPILE") or "auto"
    device = torch.device(device)
    if setting in MODES:  # a mode named outright (benchmarks compare them)
        if setting == "graphs" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use 'compile' or 'eager' on the CPU")
        return setting
    if setting not in SETTINGS:
        raise ValueError(f"compile setting must be one of {', '.join(SETTINGS + MODES)}, got {setting!r}")
    if setting == "off":
        return "eager"
    if device.type == "cuda":
        return "graphs"
    if setting == "on" or (family is not None and family in CPU_COMPILE_PAYS):
        return "compile"
    return "eager"


# Runners compiling in the background: told to stop when the interpreter starts to exit (before it joins
# their threads), so an exit waits for one step's compile at most, not for all of them.
_live_runners: "weakref.WeakSet[DecodeRunner]" = weakref.WeakSet()


def _stop_compiling() -> None:
    for runner in list(_live_runners):
        runner.stop()


# threading's own exit hook runs before the interpreter joins non-daemon threads (atexit runs after)
getattr(threading, "_register_atexit", lambda fn: None)(_stop_compiling)


def _signature(args: tuple) -> tuple:
    """What a captured graph is specific to: tensor shapes/dtypes and the identity of everything else."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else id(a) for a in args)


class _Graph:
    """One captured CUDA graph of a step: static input buffers, the graph, its static outputs."""

    def __init__(self, fn: Callable, args: tuple, pool, stream: torch.cuda.Stream):
        self.inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.outputs = fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self, args: tuple):
        for dst, src in zip(self.inputs, args):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return _clone(self.outputs)


def _clone(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out


@dataclass
class StepStats:
    calls: dict[str, int] = field(default_factory=lambda: {m: 0 for m in MODES})
    compiles: int = 0  # calls of the compile backend: 1 after warm-up, more = recompiles
    graphs: int = 0  # captured CUDA graphs
    warmup_s: float | None = None  # seconds to compile (or capture) until the step switched
    error: str | None = None  # why the step stays eager

    @property
    def recompiles(self) -> int:
        return max(0, self.compiles - 1)


class Step:
    """One registered hot step (see the module docstring); call it like the function it wraps."""

    def __init__(self, runner: "DecodeRunner", name: str, fn: Callable, example: Callable[[], tuple] | None,
                 cpp_wrapper: bool = CPP_WRAPPER):
        self.runner, self.name, self.fn, self.example = runner, name, fn, example
        self.cpp_wrapper = cpp_wrapper
        self.stats = StepStats()
        self._compiled: Callable | None = None  # the torch.compile wrapper (compile mode)
        self._ready = False  # compiled code has run on example inputs: use it
        self._graphs: dict[tuple, _Graph | None] = {}  # signature -> graph (None: warmed up, capture next)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- compile
    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.stats.compiles += 1
        if self.stats.compiles > 1:
            log.warning("decode step %s recompiled (%d compiles)", self.name, self.stats.compiles)
        cpp = self.cpp_wrapper and self.runner.device.type == "cpu"
        return compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": cpp})

    def compiled(self) -> Callable:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, backend=self._backend)
        return self._compiled

    def warm_up(self) -> None:
        """Compile on the step's example inputs (scratch state) and switch to the compiled form."""
        if self.example is None:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                fn = self.compiled()
                args = self.example()
                fn(*args)
                fn(*args)  # a second call: any recompile from state the first call set shows now
            self.stats.warmup_s = time.perf_counter() - t0
            self._ready = True
        except Exception as e:  # noqa: BLE001 - the step stays eager, and says why
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if self.cpp_wrapper and isinstance(e, torch._dynamo.exc.BackendCompilerFailed) \
                    and not self.runner._stop.is_set():
                # the C++ wrapper is built as a Python extension: it needs Python's headers, which a
                # system Python may lack; the Python wrapper does not
                log.info("decode step %s: compiling with inductor's Python wrapper, the C++ one failed: %s",
                         self.name, why)
                self.cpp_wrapper, self._compiled, self.stats.compiles = False, None, 0
                return self.warm_up()
            self.stats.error = why
            if self.runner._stop.is_set():  # the process is ending: its compile was cut short, nothing failed
                log.debug("decode step %s: compile cut short by the exit: %s", self.name, self.stats.error)
                return
            log.warning("decode step %s stays eager: compile failed: %s", self.name, self.stats.error,
                        exc_info=True)

    @property
    def ready(self) -> bool:
        """Compiled and in use (compile mode only)."""
        return self._ready

    # ---------------------------------------------------------------- call
    def __call__(self, *args):
        mode = self.runner.mode
        with torch.no_grad():
            if mode == "compile" and self._ready:
                self.stats.calls["compile"] += 1
                return self._compiled(*args)
            if mode == "graphs" and self.stats.error is None:
                return self._graph_call(args)
            self.stats.calls["eager"] += 1
            return self.fn(*args)

    def _graph_call(self, args: tuple):
        key = _signature(args)
        graph = self._graphs.get(key, False)
        if graph is False:  # first call of this signature: eager, which also warms up kernels and handles
            self._graphs[key] = None
            self.stats.calls["eager"] += 1
            return self.fn(*args)
        if graph is None:
            t0 = time.perf_counter()
            try:
                graph = self._graphs[key] = _Graph(self.fn, args, self.runner.pool, self.runner.stream)
            except Exception as e:  # noqa: BLE001 - capture failed: this step runs eagerly from now on
                self.stats.error = f"{type(e).__name__}: {e}"
                log.warning("decode step %s stays eager: capture failed: %s", self.name, e, exc_info=True)
                self.stats.calls["eager"] += 1
                return self.fn(*args)
            self.stats.graphs += 1
            if self.stats.warmup_s is None:
                self.stats.warmup_s = time.perf_counter() - t0
        self.stats.calls["graphs"] += 1
        return graph.replay(args)


# While steps compile, the interpreter lock changes hands every millisecond instead of every 5 ms:
# tracing a step is Python that holds the lock for long stretches, and the sound devices' callbacks
# (Python, 10 ms blocks) and the capture loop queued behind it.  Measured with bench/live_latency.py
# (the first question spoken during a warm start's ~6 s of compiling): 39-53 ALSA underruns in an
# idle run, all then, at the default; 2-8 with this (ten runs, idle and loaded).
COMPILE_SWITCH_INTERVAL_S = 0.001
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.005


@contextlib.contextmanager
def _compile_yields_often():
    """:data:`COMPILE_SWITCH_INTERVAL_S` while any runner compiles (the setting is per process)."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, COMPILE_SWITCH_INTERVAL_S))
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


# The compile thread runs at a lower CPU priority (nice +10, Linux, that thread only; inductor's C++
# compiler processes it starts inherit it): a conversation that starts during the compile runs its
# steps eagerly meanwhile, and where the two share a core (a busy machine) the reply's first seconds
# went dry.  The compile takes no longer on an otherwise idle core.
COMPILE_NICE = 10


class DecodeRunner:
    """The hot steps of one loaded model and the mode they run in.

    ``mode`` is one of :data:`MODES` (``resolve_mode`` turns the user's setting into one).  A family
    calls :meth:`step` once per hot step; the executor calls the returned :class:`Step`."""

    def __init__(self, mode: str = "eager", device: torch.device | str = "cpu"):
        if mode not in MODES:
            raise ValueError(f"runner mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.device = torch.device(device)
        if mode == "graphs" and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use 'compile' or 'eager' on the CPU")
        self.mode = mode
        self.steps: dict[str, Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self.stream = torch.cuda.Stream(self.device) if mode == "graphs" else None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warm_started: float | None = None
        self.warmup_s: float | None = None
        if mode == "compile":
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
            # Dynamo keeps its compiled entries per code object: every executor of a family compiles the
            # same step methods (a model switch in the window makes a new executor), and past the default
            # limit of 8 entries dynamo would silently fall back to eager.
            import torch._dynamo.config as dynamo_config

            for name, at_least in (("recompile_limit", 64), ("cache_size_limit", 64),  # (older torch's name)
                                   ("accumulated_recompile_limit", 1024), ("accumulated_cache_size_limit", 1024)):
                if hasattr(dynamo_config, name):
                    setattr(dynamo_config, name, max(getattr(dynamo_config, name), at_least))

    def step(self, name: str, fn: Callable, example: Callable[[], tuple] | None = None,
             cpp_wrapper: bool = CPP_WRAPPER) -> Step:
        """Register a hot step.  ``example`` builds scratch inputs of the shapes the step will see
        (its state objects too: compiling runs the step on them); without it the step stays eager
        in compile mode.  ``cpp_wrapper``: inductor's code around the kernels in C++ (see
        :data:`CPP_WRAPPER`)."""
        if name in self.steps:
            raise ValueError(f"decode step {name!r} is registered twice")
        s = self.steps[name] = Step(self, name, fn, example, cpp_wrapper)
        return s

    # ---------------------------------------------------------------- warm-up
    def warm_up(self, background: bool = True) -> None:
        """Compile every step (compile mode) in a background thread, or here with ``background=False``.
        Nothing to do in the other modes (graphs capture at a step's second call)."""
        if self.mode != "compile":
            return
        if self._thread is not None:  # already started: here, wait for it
            if not background:
                self.wait_ready()
            return
        self._warm_started = time.perf_counter()

        def run():
            if background:
                lower_this_thread(COMPILE_NICE, "compile")
            with _compile_yields_often():
                for s in list(self.steps.values()):
                    if self._stop.is_set():
                        return
                    s.warm_up()
            self.warmup_s = time.perf_counter() - self._warm_started

        if background:
            # Not a daemon: a process that ends while inductor compiles would crash in its teardown (seen:
            # SIGSEGV / "terminate called without an active exception").  At exit the interpreter waits
            # for the step being compiled; the ones after it are skipped (stop()).
            self._thread = threading.Thread(target=run, name="omnidesk-compile", daemon=False)
            self._thread.start()
            _live_runners.add(self)
        else:
            self._thread = threading.current_thread()
            run()

    def stop(self) -> None:
        """Compile no further step (the one under way finishes: it cannot be interrupted safely)."""
        self._stop.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the background warm-up is over (True) or ``timeout`` passed (False)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            return not t.is_alive()
        return True

    @property
    def ready(self) -> bool:
        """Whether every step runs in the runner's mode now (eager is always ready)."""
        if self.mode == "compile":  # a step without an example stays eager by design: nothing to wait for
            return all(s.ready or s.stats.error or s.example is None for s in self.steps.values())
        return True

    # ---------------------------------------------------------------- report
    def describe(self) -> str:
        """One line for the CLI, the window and doctor: which mode runs and how far warm-up is."""
        if self.mode == "eager":
            return "eager"
        failed = [s.name for s in self.steps.values() if s.stats.error]
        if self.mode == "compile":
            compiled = [s for s in self.steps.values() if s.example is not None]
            done = sum(s.ready for s in compiled)
            state = (f"ready in {self.warmup_s:.1f} s" if self.warmup_s is not None and self.ready
                     else f"compiling ({done}/{len(compiled)} steps ready, eager meanwhile)")
        else:
            state = f"{sum(s.stats.graphs for s in self.steps.values())} graphs captured"
        return f"{self.mode} ({state}" + (f"; eager: {', '.join(failed)}" if failed else "") + ")"

    def stats(self) -> dict[str, Any]:
        """Per step: calls by mode, compiles, recompiles, graphs, warm-up seconds, error (for bench JSON)."""
        return {"mode": self.mode, "warmup_s": self.warmup_s,
                "steps": {name: {"calls": dict(s.stats.calls), "compiles": s.stats.compiles,
                                 "recompiles": s.stats.recompiles, "graphs": s.stats.graphs,
                                 "warmup_s": s.stats.warmup_s, "error": s.stats.error}
                          for name, s in self.steps.items()}}

    @property
    def recompiles(self) -> int:
        return sum(s.stats.recompiles for s in self.steps.values())


__all__ = ["CPP_WRAPPER", "CPU_COMPILE_PAYS", "DecodeRunner", "MODES", "SETTINGS", "Step", "StepStats",
           "inductor_cache_dir", "resolve_mode"]
