"""Moshi's frame step through the decode runner (omnidesk/models/runner.py): compiled (CPU) and
captured as a CUDA graph (GPU only) it gives the eager step's tokens frame for frame, across a new
conversation, without a graph break and without recompiling.

On a GPU, Mimi's encode and decode are captured too and must give the eager audio.

The model is a random-weight Moshi at toy width built in memory (no checkpoint files): the demo's
LM with a 16-frame ring (it wraps within the test) and 4 instead of 8 depformer codebooks, plus
the demo's Mimi.  The compiled step unrolls one depformer sub-step per codebook and compiling it
from a cold cache dominates this file's time; nothing in the code depends on the count.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnidesk.models.moshi.config import DEMO as LM_DEMO
from omnidesk.models.moshi.config import MoshiSampling
from omnidesk.models.moshi.executor import MoshiExecutor
from omnidesk.models.moshi.lm import MoshiLM, MoshiLMGen
from omnidesk.models.moshi.mimi import DEMO as MIMI_DEMO
from omnidesk.models.moshi.mimi import Mimi, init_random_

CFG = replace(LM_DEMO, context=16, n_q=8, dep_q=4, delays=(0, 0, 1, 1, 1, 0, 1, 1, 1))
FRAMES = 40  # > 2 * context: the ring wraps; > max_delay: frames come out
GREEDY = MoshiSampling(greedy=True)
SAMPLED = MoshiSampling(text_temperature=0.9, text_top_k=10, audio_temperature=1.0, audio_top_k=50)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm() -> MoshiLM:
    return MoshiLM(CFG).init_random_(0).eval()


def executor(lm: MoshiLM, setting: str, sampling: MoshiSampling = GREEDY, seed: int = 0) -> MoshiExecutor:
    """An executor on ``lm`` (shared, read only) with its own Mimi (its streams are state) and the
    user's compile setting (off / on: the test suite's OMNIDESK_COMPILE=off only replaces auto)."""
    device = lm.text_head.weight.device
    mimi = init_random_(Mimi(MIMI_DEMO), torch.Generator().manual_seed(1)).requires_grad_(False).eval().to(device)
    return MoshiExecutor(lm, mimi, tokenizer=None, sampling=sampling, seed=seed, compile=setting)


def voice(n: int, seed: int = 0) -> list[np.ndarray]:
    """n frames of a gliding tone with a little noise: Mimi's codes change from frame to frame."""
    rng = np.random.default_rng(seed)
    t = np.arange(n * MIMI_DEMO.frame_size) / MIMI_DEMO.sample_rate
    x = 0.3 * np.sin(2 * np.pi * (150 + 60 * np.sin(1.3 * t)) * t) + 0.02 * rng.standard_normal(t.size)
    return list(x.astype(np.float32).reshape(n, -1))


def conversation(ex: MoshiExecutor, frames: list[np.ndarray]) -> tuple[list, list[torch.Tensor], np.ndarray]:
    """Per frame: Moshi's tokens (text + audio codes, None while the delays fill), the text logits, the audio."""
    tokens, logits, audio = [], [], []
    for f in frames:
        out = ex.gen.step(ex.encode_audio(f))
        logits.append(ex.gen.text_logits.cpu().clone())
        tokens.append(None if out is None else [int(out.text), *out.audio.tolist()])
        audio.append(np.zeros(ex.frame_samples_out, np.float32) if out is None
                     else ex.decode_audio(out.audio).cpu().numpy())
    return tokens, logits, np.stack(audio)


def assert_same(got, want) -> None:
    tokens, logits, audio = got
    assert tokens[:CFG.max_delay] == [None] * CFG.max_delay
    assert tokens == want[0]
    for frame, (a, b) in enumerate(zip(logits, want[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=lambda m: f"frame {frame}: {m}")
    np.testing.assert_allclose(audio, want[2], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def eager_run(lm):
    """The eager reference: FRAMES frames, then the first 20 again after a reset."""
    ex = executor(lm, "off")
    assert ex.runner.mode == "eager" and ex.model_info()["decode"] == "eager"
    frames = voice(FRAMES)
    first = conversation(ex, frames)
    assert len({tuple(t) for t in first[0][CFG.max_delay:]}) > FRAMES // 2  # not a constant stream
    ex.reset_conversation()
    again = conversation(ex, frames[:20])
    return frames, first, again


@pytest.fixture(scope="module")
def compiled(lm, eager_run):
    """A compiling executor: its first frames run eagerly while the step compiles in the background on
    a scratch state, then the whole conversation and a second one after reset_conversation."""
    frames, _, _ = eager_run
    ex = executor(lm, "on")
    assert ex.runner.mode == "compile"
    early = conversation(ex, frames[:3])  # on the live state, alongside the background compile
    assert ex.runner.wait_ready(600)
    ex.reset_conversation()
    first = conversation(ex, frames)
    ex.reset_conversation()
    again = conversation(ex, frames[:20])
    return ex, early, first, again


def test_compiled_frame_step_equals_eager_across_a_reset(compiled, eager_run):
    ex, early, first, again = compiled
    _, want_first, want_again = eager_run
    # compiling on a scratch state left the conversation that ran meanwhile untouched
    assert early[0] == want_first[0][:3]
    assert_same(first, want_first)
    assert_same(again, want_again)


def test_compiled_step_is_one_fullgraph_without_recompiles(compiled):
    ex, *_ = compiled
    step = ex.runner.steps["moshi_frame"]
    assert step.stats.error is None  # fullgraph=True: a graph break would have been an error
    assert step.stats.calls["compile"] >= FRAMES + 20  # every frame after warm-up ran compiled
    assert step.stats.compiles == 1 and ex.runner.recompiles == 0  # resets and 60 frames: no recompile
    info = ex.model_info()["decode"]
    assert info.startswith("compile (ready in") and "eager:" not in info


def test_eager_sampling_is_reproducible_with_a_seed(lm):
    codes = torch.randint(0, CFG.card, (24, CFG.user_codebooks), generator=torch.Generator().manual_seed(3))

    def run(seed):
        gen = MoshiLMGen(lm, SAMPLED, seed=seed)
        return [None if f is None else [int(f.text), *f.audio.tolist()] for f in map(gen.step, codes)]

    a = run(5)
    assert a == run(5) and a != run(6)
    greedy = MoshiLMGen(lm, GREEDY)
    assert a != [None if f is None else [int(f.text), *f.audio.tolist()] for f in map(greedy.step, codes)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (none here)")
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_graphs_replay_equals_eager_on_cuda(lm, sampling):
    frames = voice(FRAMES)
    on_gpu = copy.deepcopy(lm).cuda()  # fp32, as on the CPU: only the mode differs
    want = executor(on_gpu, "off", sampling, seed=4)
    ex = executor(on_gpu, "on", sampling, seed=4)
    assert ex.runner.mode == "graphs"
    for run in (lambda e: conversation(e, frames), lambda e: conversation(e, frames[:20])):
        # the captured frame replays with the noise drawn into the same buffers each frame, and
        # Mimi's captured streams with their state in the codec's buffers
        assert_same(run(ex), run(want))
        ex.reset_conversation()
        want.reset_conversation()
    steps = ex.runner.steps
    assert set(steps) == {"moshi_frame", "mimi_encode", "mimi_decode"}
    for name, frames_in in (("moshi_frame", FRAMES + 20), ("mimi_encode", FRAMES + 20),
                            ("mimi_decode", FRAMES + 20 - 2 * CFG.max_delay)):  # no audio while the delays fill
        stats = steps[name].stats
        assert stats.error is None, name
        assert stats.graphs == 1, name  # captured once: the resets wrote the same buffers
        assert stats.calls == {"eager": 1, "compile": 0, "graphs": frames_in - 1}, name
    assert ex.model_info()["decode"] == "graphs (3 graphs captured)"


# ---------------------------------------------------------------- bench/moshi_stack.py --compile

@pytest.fixture
def moshi_stack():
    import importlib.util
    from pathlib import Path

    threads = torch.get_num_threads()  # the demo size sets one thread, as load_moshi does
    spec = importlib.util.spec_from_file_location("moshi_stack_bench",
                                                  Path(__file__).resolve().parents[1] / "bench" / "moshi_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    torch.set_num_threads(threads)


def test_bench_reports_the_mode_and_the_runner(moshi_stack, tmp_path):
    import json

    out = tmp_path / "moshi.json"
    assert moshi_stack.main(["--size", "demo", "--device", "cpu", "--frames", "4", "--warmup", "2",
                             "--no-stages", "--compile", "eager", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "eager" and r["decode"] == "eager" and r["errors"] == {}
    frame = r["runner"]["steps"]["moshi_frame"]
    assert frame["calls"]["eager"] >= 4 + 2 and frame["recompiles"] == 0 and frame["error"] is None
    assert r["step_calls"] == {"eager": 4 + 2, "compile": 0, "graphs": 0}
    assert 0 < r["step_ms"]["p50"] <= r["step_ms"]["p90"] <= r["step_ms"]["p99"]
    with pytest.raises(SystemExit):  # argparse: graphs on the CPU is refused before anything is built
        moshi_stack.main(["--size", "demo", "--device", "cpu", "--compile", "graphs", "--out", str(out)])


def test_bench_falls_back_to_eager_figures_when_the_step_fails(moshi_stack, tmp_path, monkeypatch):
    """A step that fails in its mode (say a graph replay) is named in the JSON, and the frames are timed
    again eagerly; every part's figures are written as they come."""
    import json

    from omnidesk.models.runner import DecodeRunner

    # no compile (seconds, not a minute): the step stays eager, the bench still thinks it compiles
    monkeypatch.setattr(DecodeRunner, "warm_up", lambda self, background=True: None)
    timed = moshi_stack.time_steps

    def failing_in_compile_mode(ex, *args):
        if ex.runner.mode != "eager":
            raise RuntimeError("replay failed\nsecond line")
        return timed(ex, *args)

    monkeypatch.setattr(moshi_stack, "time_steps", failing_in_compile_mode)
    out = tmp_path / "moshi.json"
    r = moshi_stack.run(size="demo", device="cpu", frames=4, warmup=2, stages=True, mode="compile", out=out)
    assert json.loads(out.read_text()) == r
    assert r["mode"] == "compile" and r["fallback"] == "eager"
    assert r["errors"] == {"step": "RuntimeError: replay failed"}
    assert r["step_calls"]["eager"] == 4 + 2 and r["step_ms"]["p50"] > 0 and r["stages_ms"]["lm"]["p50"] > 0
