"""The benchmark scripts in bench/ as the tests run them: loaded from their files as modules (bench/
is no package), torch's thread count kept (a stack sets its own), the stats they report checked."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
STATS = ("p50", "p90", "p99", "max", "mean")


@contextlib.contextmanager
def threads_kept():
    """torch's intra-op thread count as it was before, once out (whatever the bench set it to)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load(name: str, module_name: str) -> ModuleType:
    """bench/<name>.py as a fresh module called ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_stats(s: dict) -> None:
    assert set(s) == set(STATS)
    assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert 0 < s["mean"] <= s["max"]


def run_random_stack(tmp_path: Path, *options: str, module_name: str = "random_stack_bench") -> tuple[Path, dict]:
    """bench/random_stack.py's main on the CPU with the Qwen2.5-Omni demo's config, one real-time turn
    and one interruption (plus ``options``): (the config's path, the JSON it wrote)."""
    from omnidesk.models.qwen2_5_omni.demo import make_demo

    out = tmp_path / "stack.json"
    with threads_kept():
        module = load("random_stack", module_name)
        config = make_demo(tmp_path / "demo") / "config.json"
        module.main(["--config", str(config), "--device", "cpu", "--dtype", "float32", "--turns", "1",
                     "--interrupts", "1", "--tokens", "8", "--codes", "16", *options, "--out", str(out)])
    return config, json.loads(out.read_text())
