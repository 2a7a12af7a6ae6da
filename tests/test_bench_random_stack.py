"""bench/random_stack.py (the random-weight Qwen2.5-Omni stack that bench/gpu.sh builds at the 3B / 7B shapes):
its main runs on the CPU with the demo's config, one real-time turn and one interruption, and writes every
section.  The GPU run is one-shot: an import that broke in a refactor must fail here, not there.  No timing
thresholds."""

from __future__ import annotations

from bench_script import run_random_stack


def test_random_stack_runs_a_demo_sized_config_on_the_cpu(tmp_path):
    config, r = run_random_stack(tmp_path)
    assert {"machine", "checkpoint", "stages", "realtime", "interrupt", "build_s", "config"} <= set(r)
    assert r["config"] == str(config) and r["build_s"] > 0
    assert r["interrupt"] and r["stages"]
