"""bench/qwen3_stack.py (the random-weight Qwen3-Omni stack that bench/gpu.sh builds at the 30B-A3B shapes):
its main runs on the CPU with the Qwen3 demo's config and writes every section, the decode steps timed
through the executor's decode runner; a mode that cannot run reports why, with eager figures; the real
config, with the stand-in tokenizer's ids, parses and is accepted by the executor on the meta device
(nothing allocated).  The GPU run is one-shot: an import or id mix-up that broke in a refactor must fail
here, not there.  No timing thresholds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench_script import check_stats as _check_stats, load, threads_kept
from omnidesk.models.qwen3_omni.demo import make_demo


@pytest.fixture
def qwen3_stack():
    with threads_kept():  # the executor sets cores - 1 on the CPU
        yield load("qwen3_stack", "qwen3_stack_bench")


def _check_runner(runner: dict, mode: str) -> None:
    """The executor's two decode steps ran in ``mode`` (stats as DecodeRunner.stats gives them)."""
    assert runner["mode"] == mode and runner["describe"].startswith(mode)
    assert set(runner["steps"]) == {"thinker", "talker_frame"}
    for name, step in runner["steps"].items():
        assert step["error"] is None and step["calls"][mode] > 0, (name, step)


def test_demo_config_on_the_cpu(qwen3_stack, tmp_path):
    config = make_demo(tmp_path / "demo") / "config.json"
    out = tmp_path / "qwen3.json"
    assert qwen3_stack.main(["--config", str(config), "--device", "cpu", "--prompt", "40", "--tokens", "6",
                             "--frames", "5", "--warmup", "2", "--reps", "2", "--turns", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"config", "device", "device_name", "dtype", "code2wav_dtype", "shapes", "params", "ids_overridden",
            "build_s", "mode", "decode_mode", "runner", "thinker", "talker", "code2wav", "first_audio",
            "executor_stages", "realtime", "memory",
            "machine", "method"} <= set(r)
    assert (r["config"], r["device"], r["dtype"], r["code2wav_dtype"]) == (str(config), "cpu", "float32", "float32")
    assert r["build_s"] > 0
    assert r["ids_overridden"] == {}  # the demo's ids are the stand-in tokenizer's already
    raw = json.loads(config.read_text())
    assert r["shapes"]["thinker"]["hidden"] == raw["thinker_config"]["text_config"]["hidden_size"]
    assert r["shapes"]["code_groups"] == raw["talker_config"]["num_code_groups"]
    assert all(n > 0 for n in r["params"].values())
    assert r["params"]["total"] == sum(v for k, v in r["params"].items() if k != "total")

    assert (r["mode"], r["decode_mode"]) == ("eager", "eager") and "mode_error" not in r
    _check_runner(r["runner"], "eager")

    th = r["thinker"]
    assert (th["prompt_tokens"], th["decode_steps"], th["warmup_steps"]) == (40, 6, 2)
    assert th["prefill_ms"] > 0 and len(th["prefill_ms_all"]) == 3 and th["tokens_per_s"] > 0
    assert th["context_tokens"] > 0 and th["logits_finite"]
    _check_stats(th["step_ms"])

    tk = r["talker"]
    groups = raw["talker_config"]["num_code_groups"]
    assert (tk["frames"], tk["code_groups"], tk["code_predictor_steps"]) == (5, groups, groups - 1)
    _check_stats(tk["frame_ms"])
    assert len(tk["last_codes"]) == groups and tk["hidden_finite"]
    assert tk["meets_target"] == (tk["frame_ms"]["p50"] <= tk["target_p50_ms"]) and 0 <= tk["late_frames"] <= 5
    assert tk["late_frames"] == 0 or tk["frame_ms"]["max"] > tk["frame_budget_ms"] == 80.0

    c2w = r["code2wav"]
    _check_stats(c2w["push_ms"])
    assert c2w["samples_per_frame"] == 1920 and c2w["audio_samples"] == 5 * 1920 and c2w["audio_finite"]

    fa = r["first_audio"]
    assert fa["turns"] == 2 and len(fa["per_turn"]) == 2 and fa["utterance_s"] == 2.0
    assert fa["target_ms"] == 250.0 and fa["vllm_omni_ms"] == 523.0
    m = fa["median_ms"]
    assert all(m[k] is not None and m[k] > 0 for k in m), m  # every stage ran, audio came
    parts = sum(m[k] for k in m if k != "total_ms")
    assert parts <= m["total_ms"] * 1.5  # medians of parts vs median of totals: close, not equal
    for turn in fa["per_turn"]:
        assert turn["first_chunk_samples"] > 0 and turn["first_chunk_finite"]
        assert turn["thinker_steps"] == 2  # the talker's prefill reads token 1, its first frame token 2
    assert fa["meets_target"] == (m["total_ms"] <= 250.0)

    st = r["executor_stages"]
    assert st["text_tokens"] > 0 and st["prefill_ms"] > 0

    assert [x["preemptive"] for x in r["realtime"]] == [True, False]
    for x in r["realtime"]:
        assert len(x["turns"]) == 1 and x["turns_with_audio"] == 1  # a failing engine turn has no audio
        assert x["limits"] == qwen3_stack.REPLY_LIMITS

    assert r["memory"]["estimate_gb"] > 0 and r["memory"]["host_max_rss_gb"] > 0
    assert "max_allocated_gb" not in r["memory"]  # CUDA only
    assert r["machine"]["threads"] >= 1 and r["machine"]["gpu_memory_gb"] is None


def test_a_mode_that_cannot_run_reports_why_with_eager_figures(qwen3_stack, tmp_path):
    """CUDA graphs on the CPU cannot run: the JSON says so (mode_error) and holds the eager figures;
    the decode figures are saved before the real-time part."""
    config = make_demo(tmp_path / "demo") / "config.json"
    saved = []
    r = qwen3_stack.run(config=config, device="cpu", prompt=8, tokens=2, frames=2, warmup=2, reps=1, turns=0,
                        mode="graphs", save=lambda result: saved.append(json.loads(json.dumps(result))))
    assert (r["mode"], r["decode_mode"]) == ("graphs", "eager")
    assert "CUDA" in r["mode_error"]["run"]
    _check_runner(r["runner"], "eager")
    assert r["realtime"] is None
    first = saved[0]  # the first save: the decode figures, before the stage rates and the real-time engine
    assert {"thinker", "talker", "code2wav", "first_audio", "runner", "memory"} <= set(first)
    assert "executor_stages" not in first and "realtime" not in first


def test_real_config_with_the_stand_in_tokenizer(qwen3_stack, tmp_path, monkeypatch):
    """The 30B-A3B config: every size stays the file's, every token id the stand-in's, and the
    product's executor accepts the result (its chat-template and id checks), all on the meta device."""
    from omnidesk.features import FeatureConfig
    from omnidesk.models.qwen2_5_omni.tokenizer import Tokenizer
    from omnidesk.models.qwen3_omni.config import Qwen3OmniConfig
    from omnidesk.models.qwen3_omni.executor import Qwen3OmniExecutor
    from omnidesk.models.qwen3_omni.loading import Qwen3OmniModel, Qwen3OmniStack

    file_raw = json.loads(qwen3_stack.DEFAULT_CONFIG.read_text())
    raw = json.loads(qwen3_stack.DEFAULT_CONFIG.read_text())
    ids, changed = qwen3_stack.write_stand_in(raw, tmp_path)
    cfg = Qwen3OmniConfig.from_dict(raw)
    real = Qwen3OmniConfig.from_dict(file_raw)
    assert qwen3_stack.shapes(cfg) == qwen3_stack.shapes(real)
    assert cfg.talker == real.talker  # codec ids and speakers are the file's
    assert cfg.code2wav == real.code2wav
    assert (cfg.thinker.text, cfg.thinker.audio) == (real.thinker.text, real.thinker.audio)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.id_to_token(cfg.thinker.audio_token_id) == "<|audio_pad|>"
    assert tok.id_to_token(cfg.im_start_id) == "<|im_start|>" and cfg.im_start_id == real.im_start_id
    assert tok.id_to_token(cfg.im_end_id) == "<|im_end|>" and cfg.im_end_id == real.im_end_id
    for name, i in (("<tts_pad>", cfg.tts_pad_id), ("<tts_text_bos>", cfg.tts_bos_id),
                    ("<tts_text_eod>", cfg.tts_eos_id)):
        assert tok.id_to_token(i) == name
    for role, i in (("user", cfg.user_id), ("assistant", cfg.assistant_id), ("system", cfg.system_id)):
        assert tok.encode(role) == [i]
    assert changed["tts_pad_token_id"] == [file_raw["tts_pad_token_id"], cfg.tts_pad_id]
    assert "im_start_token_id" not in changed
    assert json.loads((tmp_path / "config.json").read_text()) == raw

    with torch.device("meta"):
        model = Qwen3OmniModel(cfg)
    assert 34e9 < sum(p.numel() for p in model.parameters()) < 36e9  # 30B-A3B: ~34.7 B without vision
    features = dataclasses.replace(FeatureConfig.from_preprocessor_config(tmp_path / "preprocessor_config.json"),
                                   pad_to_longest=True)
    stack = Qwen3OmniStack(path=tmp_path, config=cfg, model=model, tokenizer=tok, features=features,
                           generation_config=json.loads((tmp_path / "generation_config.json").read_text()),
                           dtype=torch.bfloat16, device=torch.device("meta"))
    ex = Qwen3OmniExecutor(stack)
    assert ex.stop_ids == {ids["im_end"], ids["endoftext"]}
    assert ex._turn_pieces["tail"][-3:-1] == [cfg.im_start_id, cfg.assistant_id]
