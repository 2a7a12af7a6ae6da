"""bench/moshi_stack.py (the random-weight Moshi stack bench that bench/gpu.sh runs at the 7B shapes):
its main runs at the demo size on the CPU for a few frames and writes every field.  No timing thresholds."""

from __future__ import annotations

import json

import pytest

from bench_script import check_stats as _check_stats, load, threads_kept


@pytest.fixture
def moshi_stack():
    with threads_kept():  # the demo size sets one thread, as load_moshi does
        yield load("moshi_stack", "moshi_stack_bench")


def test_demo_size_on_cpu(moshi_stack, tmp_path):
    out = tmp_path / "moshi_demo.json"
    assert moshi_stack.main(["--size", "demo", "--device", "cpu", "--frames", "6", "--warmup", "2",
                             "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["size"], r["device"], r["dtype"], r["mimi_dtype"]) == ("demo", "cpu", "float32", "float32")
    lm_cfg, _ = moshi_stack.SIZES["demo"]
    assert r["config"]["dim"] == lm_cfg.dim and r["config"]["num_layers"] == lm_cfg.num_layers
    assert r["config"]["layers_overridden"] is False
    assert r["params"]["lm"] > 0 and r["params"]["mimi"] > 0
    assert r["context"] == lm_cfg.context and r["context_s"] == pytest.approx(lm_cfg.context * 0.08)
    assert r["frames"] == 6 and r["warmup"] == 2 and r["frame_ms"] == 80.0
    _check_stats(r["step_ms"])
    assert 0 <= r["late_frames"] <= 6
    assert r["meets_target"] == (r["step_ms"]["p50"] <= r["target_p50_ms"])
    assert r["stages_ms"]["timer"] == "perf_counter"
    for stage in ("encode", "lm", "decode", "step"):
        _check_stats(r["stages_ms"][stage])
    assert r["output"]["audio_finite"] and r["output"]["text_logits_finite"]
    assert r["output"]["audio_samples"] == 1920 and isinstance(r["output"]["text_token"], int)
    assert r["memory"]["host_max_rss_gb"] > 0 and r["memory"]["estimate_gb"] > 0
    assert "max_allocated_gb" not in r["memory"]  # CUDA only
    assert r["build_s"] >= 0 and r["machine"]["threads"] == 1


def test_layer_overrides(moshi_stack):
    lm_cfg, mimi_cfg = moshi_stack.configs("7b", layers=1, depformer_layers=2)
    assert (lm_cfg.dim, lm_cfg.num_layers, lm_cfg.depformer_num_layers) == (4096, 1, 2)
    assert mimi_cfg.transformer.d_model == 512  # the published Mimi
    full, _ = moshi_stack.configs("7b")
    assert (full.num_layers, full.depformer_num_layers, full.context) == (32, 6, 3000)
