"""Moshi end to end: the demo recipe, load_moshi, the duplex executor, the family registry and
`omnidesk talk` on a Moshi checkpoint.

Everything runs on a tiny checkpoint the demo recipe writes into a temporary cache
(XDG_CACHE_HOME), so the user's cache is never touched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omnidesk import cli
from omnidesk.engine.executor import StageError
from omnidesk.models.checkpoint import ConfigError
from omnidesk.models.families import MOSHI, QWEN, family_named, family_of, resolve_model
from omnidesk.models.checkpoint import CheckpointError
from omnidesk.models.checkpoint import ModelTooLargeError
from omnidesk.models.moshi.config import DEMO as LM_DEMO
from omnidesk.models.moshi.config import MIMI_NAME, MOSHI_7B, MOSHI_NAME, TOKENIZER_NAME, MoshiSampling
from omnidesk.models.moshi.demo import (DEMO_NOTICE, default_demo_dir, is_moshi_demo, lm_checkpoint_tensors,
                                        make_moshi_demo)
from omnidesk.models.moshi.executor import check_fits, estimate_memory, load_moshi, read_config, read_mimi_config
from omnidesk.models.moshi.lm import MoshiLM, MoshiLMGen, load_moshi_lm
from omnidesk.models.moshi.mimi import load_mimi
from omnidesk.models.moshi.tokenizer import MoshiTokenizer, demo_tokenizer_bytes
from support import cache  # noqa: F401  (fixture: a private XDG cache, the Moshi demo at its default place there)

QUESTION = Path(__file__).parent / "fixtures" / "question.wav"
FRAME = 1920


@pytest.fixture(scope="module")
def demo(cache) -> Path:
    path = make_moshi_demo()
    assert path == default_demo_dir() and path.is_relative_to(cache)
    return path


def frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """n frames of a voice-like signal: a gliding tone with an envelope, plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n * FRAME) / 24000
    x = 0.3 * np.sin(2 * np.pi * (150 + 40 * np.sin(t)) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    x = (x + 0.01 * rng.standard_normal(x.size)).astype(np.float32)
    return list(x.reshape(n, FRAME))


def run(ex, inputs):
    out = [ex.step(f) for f in inputs]
    return np.stack([s.audio for s in out]), [s.text_token for s in out]


# ---------------------------------------------------------------- the demo recipe and its tokenizer

def test_demo_is_in_the_published_layout(demo):
    names = {p.name for p in demo.iterdir()}
    assert {MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME, "config.json", "mimi_config.json"} <= names
    raw = json.loads((demo / "config.json").read_text())
    assert raw["model_type"] == "moshi" and is_moshi_demo(raw) and raw["mimi_config_name"] == "mimi_config.json"
    assert not is_moshi_demo({"model_type": "moshi"}) and not is_moshi_demo(None)
    from safetensors import safe_open

    with safe_open(str(demo / MOSHI_NAME), "pt") as st:
        keys = set(st.keys())
        # published names, with the per-codebook and per-step tensors unstacked
        assert {"emb.0.weight", "emb.15.weight", "text_emb.weight", "text_linear.weight", "out_norm.alpha",
                "depformer_in.7.weight", "linears.7.weight", "depformer.layers.0.gating.7.linear_in.weight",
                "transformer.layers.1.self_attn.in_proj_weight"} <= keys
        assert tuple(st.get_tensor("out_norm.alpha").shape) == (1, 1, LM_DEMO.dim)


def test_demo_tensors_round_trip_through_the_loader(demo):
    lm = MoshiLM(LM_DEMO).init_random_(20261203)
    loaded = load_moshi_lm(demo / MOSHI_NAME, LM_DEMO)
    for (name, a), (_, b) in zip(lm.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    assert lm_checkpoint_tensors(loaded).keys() == lm_checkpoint_tensors(lm).keys()


def test_demo_is_deterministic_and_reused(demo, tmp_path):
    again = make_moshi_demo(tmp_path / "again")
    for name in (MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME, "config.json", "mimi_config.json"):
        assert (again / name).read_bytes() == (demo / name).read_bytes(), name
    stamp = (demo / MOSHI_NAME).stat().st_mtime_ns
    assert make_moshi_demo() == demo and (demo / MOSHI_NAME).stat().st_mtime_ns == stamp


def test_tokenizer_decodes_and_drops_unknown_ids(demo):
    import time

    t0 = time.perf_counter()
    model = demo_tokenizer_bytes()
    assert time.perf_counter() - t0 < 1.0 and model == demo_tokenizer_bytes()
    tok = MoshiTokenizer.from_file(demo / TOKENIZER_NAME)
    assert 0 < tok.vocab_size <= LM_DEMO.text_card
    ids = tok.encode("hello, how are you today")
    assert tok.decode(ids) == "hello, how are you today"
    assert tok.decode(ids + [tok.vocab_size, LM_DEMO.text_card - 1, -1]) == tok.decode(ids)
    assert tok.decode([tok.vocab_size + 5]) == "" and tok.decode([]) == ""
    with pytest.raises(CheckpointError, match="not a SentencePiece model"):
        MoshiTokenizer(b"garbage", "x.model")


# ---------------------------------------------------------------- the executor

@pytest.fixture(scope="module")
def executor(demo):
    return load_moshi(demo, greedy=True, seed=0)


def test_executor_shapes_and_rates(executor, demo):
    ex = executor
    assert ex.duplex and ex.sample_rate_in == ex.sample_rate_out == 24000
    assert ex.frame_samples_in == ex.frame_samples_out == FRAME
    assert torch.get_num_threads() == 1  # a model this small runs on one CPU thread
    ex.reset_conversation()
    audio, text = run(ex, frames(5))
    assert audio.shape == (5, FRAME) and audio.dtype == np.float32
    delay = LM_DEMO.max_delay
    assert text[:delay] == [None] * delay and not audio[:delay].any()  # silence while the delays fill
    assert all(isinstance(t, int) and 0 <= t < LM_DEMO.text_card for t in text[delay:])
    assert np.isfinite(audio).all() and np.abs(audio[delay:]).max() > 0
    assert ex.is_silent_text(None) and ex.is_silent_text(3) and ex.is_silent_text(0) and not ex.is_silent_text(5)
    assert isinstance(ex.decode([t for t in text if t is not None]), str)
    info = ex.model_info()
    assert info["family"] == "moshi" and info["demo"] and info["greedy"] and info["context_frames"] == 250
    with pytest.raises(StageError) as e:
        ex.step(np.zeros(100, np.float32))
    assert e.value.stage == "encoder"


def test_sampling_defaults_come_from_the_config(demo):
    ex = load_moshi(demo, seed=3)
    assert ex.sampling == MoshiSampling(greedy=False, text_temperature=0.7, text_top_k=25, audio_temperature=0.8,
                                        audio_top_k=250)
    assert ex.seed == 3


@pytest.mark.parametrize("greedy", [True, False])
def test_reset_replays_the_conversation(demo, greedy):
    ex = load_moshi(demo, greedy=greedy, seed=7)
    inputs = frames(12, seed=1)
    audio1, text1 = run(ex, inputs)
    ex.reset_conversation()
    audio2, text2 = run(ex, inputs)
    assert text1 == text2 and np.array_equal(audio1, audio2)
    if not greedy:  # another seed samples another conversation
        other = load_moshi(demo, greedy=False, seed=8)
        audio3, text3 = run(other, inputs)
        assert text3 != text1 or not np.array_equal(audio3, audio1)


def test_executor_equals_mimi_and_lmgen_by_hand(demo):
    n = 30
    ex = load_moshi(demo, seed=11)  # sampled: the generators must line up too
    cfg, _ = read_config(demo)
    mimi_cfg = read_mimi_config(demo, cfg)
    mimi = load_mimi(demo / MIMI_NAME, config=mimi_cfg, num_codebooks=LM_DEMO.user_codebooks)
    gen = MoshiLMGen(load_moshi_lm(demo / MOSHI_NAME, LM_DEMO), LM_DEMO.sampling, seed=11)
    inputs = frames(n, seed=2)
    audio, text = run(ex, inputs)
    for i, f in enumerate(inputs):
        codes = mimi.encode_frame(torch.from_numpy(f))
        out = gen.step(codes)
        if out is None:
            assert text[i] is None and not audio[i].any()
            continue
        assert text[i] == out.text_id, i
        np.testing.assert_array_equal(audio[i], mimi.decode_frame(out.audio).numpy(), err_msg=f"frame {i}")


# ---------------------------------------------------------------- loading errors and memory

@pytest.mark.parametrize("name", [MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME, "mimi_config.json"])
def test_a_missing_file_is_named(demo, tmp_path, name):
    broken = tmp_path / "ckpt"
    shutil.copytree(demo, broken)
    (broken / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing file {name}"):
        load_moshi(broken)


def test_a_damaged_config_is_a_config_error(demo, tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(demo, broken)
    raw = json.loads((broken / "config.json").read_text())
    raw["lora"] = True
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="lora"):
        load_moshi(broken)
    with pytest.raises(CheckpointError, match="not found"):
        load_moshi(tmp_path / "nowhere")


def test_memory_estimate_of_the_7b():
    est = estimate_memory(MOSHI_7B, torch.bfloat16, 3000)
    assert 17e9 <= est.total <= 18e9, est
    assert 7.5e9 < est.lm_params < 7.8e9 and est.kv_cache == 2 * 32 * 3000 * 4096 * 2
    assert estimate_memory(MOSHI_7B, torch.bfloat16, 375).total < est.total
    assert check_fits(est, 24 * 2**30) is None
    message = check_fits(est, 16 * 2**30)
    assert "16.0 GiB is free" in message and "shorter context" in message
    assert "shorter context" not in check_fits(est, 8 * 2**30)


def test_the_7b_is_refused_on_a_cpu_without_the_ram(tmp_path, monkeypatch):
    """The published layout (no config.json: the 7B's numbers) on a CPU with 8 GiB free: refused
    before a weight is read, naming the need."""
    from omnidesk.models import memory

    for name in (MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME):
        (tmp_path / name).write_bytes(b"")  # never opened: the refusal comes first
    monkeypatch.setattr(memory, "available_ram", lambda: 8 * 2**30)
    with pytest.raises(ModelTooLargeError) as e:
        load_moshi(tmp_path, device="cpu")
    need = estimate_memory(MOSHI_7B, torch.float32).total
    assert str(e.value) == (f"{tmp_path}: on the CPU in float32 this model needs about {memory.gib(need)} of RAM but "
                            f"only 8.0 GiB is available; run it on a GPU with enough memory (--device cuda)")


# ---------------------------------------------------------------- the family registry

def test_families_detect_checkpoints(demo, tmp_path):
    assert family_of(demo) is MOSHI and MOSHI.duplex and not QWEN.duplex
    published = tmp_path / "moshiko"  # the published repos: no config.json, the three files
    published.mkdir()
    for name in (MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME):
        (published / name).write_bytes(b"")
    assert family_of(published) is MOSHI
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    assert family_of(qwen) is QWEN
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama'.*Qwen2.5-Omni.*Moshi"):
        family_of(other)
    with pytest.raises(CheckpointError, match="no config.json"):
        family_of(tmp_path)
    assert family_named("moshi") is MOSHI and family_named("qwen") is QWEN
    assert MOSHI.is_demo(demo) and MOSHI.demo_notice == DEMO_NOTICE


def test_moshi_demo_name_resolves(demo, tmp_path, monkeypatch):
    assert resolve_model("moshi-demo") == (demo, MOSHI)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="make-demo --family moshi"):
        resolve_model("moshi-demo")


# ---------------------------------------------------------------- omnidesk talk / models

def talk(capsys, tmp_path, model: str, *extra):
    out_wav, timeline = tmp_path / "o.wav", tmp_path / "t.json"
    rc = cli.main(["talk", "--model", model, "--input", str(QUESTION), "--output", str(out_wav),
                   "--timeline", str(timeline), "--fast", *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, out_wav, timeline


@pytest.mark.parametrize("by_name", [False, True])
def test_talk_runs_a_moshi_checkpoint(capsys, tmp_path, demo, by_name):
    rc, out, err, out_wav, timeline = talk(capsys, tmp_path, "moshi-demo" if by_name else str(demo),
                                           "--voice", "Chelsie")
    assert rc == 0, err
    assert f"NOTE: {DEMO_NOTICE}" in out and "--voice has no meaning for Moshi" in out
    assert "duplex:" in out and "step p50" in out and "late frames" in out
    info, question = sf.info(str(out_wav)), sf.info(str(QUESTION))
    assert info.samplerate == 24000
    assert info.frames / info.samplerate >= question.duration + 2.0
    data = json.loads(timeline.read_text())
    assert data["model"]["family"] == "moshi" and data["model"]["demo"] is True
    duplex = data["duplex"]
    steps = duplex["step_ms"]
    assert len(steps) > 0 and all(ms > 0 for ms in steps)
    assert abs(len(steps) - info.frames / FRAME) <= 1  # one step per 80 ms of output
    assert len(duplex["user_speech"]) >= 1 and duplex["errors"] == []


def test_make_demo_and_list_show_the_moshi_demo(capsys, demo):
    assert cli.main(["models", "make-demo", "--family", "moshi"]) == 0
    out = capsys.readouterr().out
    assert str(demo) in out and DEMO_NOTICE in out
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "moshi-demo" in out and str(demo) in out


def test_turn_based_commands_refuse_moshi(capsys, demo):
    assert cli.main(["reply", "--model", "moshi-demo", "--input", str(QUESTION)]) == 2
    assert "full duplex" in capsys.readouterr().err


def test_bench_measures_the_frame_clock_of_a_duplex_model(capsys, demo, tmp_path):
    """`omnidesk bench` on Moshi: no turns to time, so the executor's step per 80 ms frame, as JSON."""
    out_json = tmp_path / "bench" / "moshi.json"
    assert cli.main(["bench", "--model", "moshi-demo", "--out", str(out_json)]) == 0
    out, err = capsys.readouterr()
    assert DEMO_NOTICE in err  # stdout is the JSON alone
    result = json.loads(out)
    assert json.loads(out_json.read_text()) == result
    assert result["kind"] == "duplex" and result["model"]["family"] == "moshi" and result["model"]["demo"] is True
    assert result["frame_ms"] == 80.0 and result["frames"] == 250 and result["machine"]["device"] == "cpu"
    step = result["step_ms"]
    assert 0 < step["p50"] <= step["p90"] <= step["p99"] <= step["max"]
    assert result["late_frames"] <= result["frames"] and (result["late_frames"] == 0) == (step["max"] <= 80.0)
    assert result["realtime_factor_p50"] == round(80.0 / step["p50"], 2)
    # the first text token comes out once the LM's delays have filled, as the executor steps show
    ex = load_moshi(demo)
    _, texts = run(ex, frames(8))
    first = next(i for i, t in enumerate(texts) if t is not None)
    assert result["first_output_frame"] == first and result["first_output_ms"] == (first + 1) * 80.0


def test_without_a_display_the_default_command_checks_a_duplex_model(capsys, demo, monkeypatch):
    """`omnidesk` over SSH on Moshi: no turn to take, so 2 s of frames through the step, in the terminal."""
    import omnidesk.gui.app as app

    monkeypatch.setattr(app, "display_problem", lambda: "no display")
    assert cli.main(["--model", "moshi-demo"]) == 0
    out, err = capsys.readouterr()
    assert "no display\nRunning a check of the model in the terminal instead." in err
    assert f"NOTE: {DEMO_NOTICE}" in out and f"model ready: {demo}" in out
    assert "2 s of a synthetic tone through the full-duplex step: 25 frames in, 2.00 s of audio and " in out


def test_models_verify_checks_a_moshi_checkpoint_and_names_what_is_wrong(capsys, demo, tmp_path):
    assert cli.main(["models", "verify", "moshi-demo"]) == 0
    out = capsys.readouterr().out
    assert "Moshi checkpoint at" in out and "verified: no problems" in out and DEMO_NOTICE in out
    assert "model.safetensors: tensor names, shapes and dtypes" in out and "one frame step" in out
    # a copy whose language model lost its tail and whose tokenizer is gone: both named, nothing raised
    broken = tmp_path / "broken"
    shutil.copytree(demo, broken)
    lm = broken / "model.safetensors"
    lm.write_bytes(lm.read_bytes()[: lm.stat().st_size // 2])
    (broken / "tokenizer_spm_32k_3.model").unlink()
    assert cli.main(["models", "verify", str(broken)]) == 1
    out = capsys.readouterr().out
    assert f"{lm}: truncated" in out and "missing file tokenizer_spm_32k_3.model" in out
    assert "2 problem(s)" in out
