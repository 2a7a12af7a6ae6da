"""bench/random_stack.py (the random-weight Qwen2.5-Omni stack that bench/gpu.sh builds at the 3B / 7B shapes):
its main runs on the CPU with the demo's config, one real-time turn and one interruption, and writes every
section.  The GPU run is one-shot: an import that broke in a refactor must fail here, not there.  No timing
thresholds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from omnidesk.models.qwen2_5_omni.demo import make_demo

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "random_stack.py"


def test_random_stack_runs_a_demo_sized_config_on_the_cpu(tmp_path):
    threads = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("random_stack_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = make_demo(tmp_path / "demo") / "config.json"
    out = tmp_path / "stack.json"
    try:
        module.main(["--config", str(config), "--device", "cpu", "--dtype", "float32", "--turns", "1",
                     "--interrupts", "1", "--tokens", "8", "--codes", "16", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert {"machine", "checkpoint", "stages", "realtime", "interrupt", "build_s", "config"} <= set(r)
    assert r["config"] == str(config) and r["build_s"] > 0
    assert r["interrupt"] and r["stages"]
