"""Qwen3-Omni's decode steps through the decode runner (omnidesk/models/runner.py): the thinker's
reply token and the ``talker_frame`` step (the code predictor's sub-steps + the talker's step).

Compiled (torch.compile, fullgraph) they give eager's greedy replies - text and every codebook -
turn after turn; no step breaks its graph; a conversation with an interruption, a preemptive
start rolled back and cache-full drops adds no recompile.  CUDA graphs, where a GPU exists, the
same.  The tiny checkpoint of tests/tiny_qwen3.py (the other Qwen3 tests' oracle), its talker's
stop code switched off so every reply runs to its frame limit.

One compiled executor serves the module: compiling is the slow part (about a minute on 2 cores
with inductor's cache cold, seconds once ~/.cache/omnidesk/inductor holds it), so it compiles in
the background while the eager executor runs the same conversation.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from omnidesk.models.qwen3_omni.executor import Qwen3OmniExecutor, talker_defaults  # noqa: E402
from omnidesk.models.qwen3_omni.loading import load_stack  # noqa: E402
from omnidesk.models.sampling import SamplingParams  # noqa: E402

CAPACITY = 128  # a few turns fill it: the conversation below drops old turns
TEXT, FRAMES = 8, 8
STEPS = {"thinker", "talker_frame"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-qwen3-runner")
    ref = tiny_qwen3.write_checkpoint(path)
    with torch.no_grad():
        ref.talker.codec_head.weight[ref.config.talker_config.codec_eos_token_id] = 0
    ref.save_pretrained(path)
    return path


def _executor(stack, mode: str) -> Qwen3OmniExecutor:
    return Qwen3OmniExecutor(stack, capacity=CAPACITY, max_reply_tokens=TEXT, max_codec_tokens=FRAMES,
                             thinker_sampling=SamplingParams(greedy=True),
                             talker_sampling=talker_defaults(stack, greedy=True), compile=mode)


def _reply(ex: Qwen3OmniExecutor, frames: int | None = None) -> tuple[list[int], list[list[int]]]:
    """Thinker and talker interleaved as the engine runs them, until the reply ends (or ``frames``)."""
    while not (ex.thinker_done and ex.talker_done):
        ex.thinker_step()
        ex.talker_step()
        if frames is not None and len(ex.reply_codec_frames) >= frames:
            break
    return ex.reply_text_ids, ex.reply_codec_frames


def conversation(ex: Qwen3OmniExecutor, speech_like) -> dict:
    """Two whole turns, then an interrupted one, a preemptive start rolled back (the user went on
    talking), and turns until the cache has been full twice and one more: every reply's text and
    frames, and the cache-full drops."""
    replies = []

    def user(seconds: float, seed: int, cut: int | None = None):
        wave = speech_like(seconds, seed=seed).numpy()
        ex.begin_user_turn()
        ex.add_user_audio(wave if cut is None else wave[:cut])
        return wave

    for seed in (1, 2):
        user(1.0, seed)
        ex.end_user_turn()
        ex.start_reply()
        replies.append(_reply(ex))
        ex.finish_reply()
    user(1.0, 3)
    ex.end_user_turn()
    ex.start_reply()
    replies.append(_reply(ex, frames=4))
    ex.interrupt(heard_samples=2 * ex.samples_per_code)
    wave = user(1.4, 4, cut=12000)
    mark = ex.mark()
    ex.end_user_turn()
    ex.start_reply()
    _reply(ex, frames=2)
    ex.rollback(mark)
    ex.add_user_audio(wave[12000:])
    ex.end_user_turn()
    ex.start_reply()
    replies.append(_reply(ex))
    ex.finish_reply()
    drops = len(ex.take_overflows())
    for seed in range(5, 15):
        user(0.9, seed)
        ex.end_user_turn()
        ex.start_reply()
        replies.append(_reply(ex))
        ex.finish_reply()
        if drops >= 2:  # this turn came after them
            break
        drops += len(ex.take_overflows())
    return {"replies": replies, "drops": drops}


@pytest.fixture(scope="module")
def compiled_and_eager(checkpoint, speech_like):
    """(compiled executor, its conversation, the eager executor's conversation)."""
    stack = load_stack(checkpoint)
    compiled = _executor(stack, "compile")  # starts compiling in the background
    assert compiled.runner.mode == "compile"
    eager = conversation(_executor(stack, "eager"), speech_like)
    compiled.runner.wait_ready()
    assert compiled.runner.ready
    return compiled, conversation(compiled, speech_like), eager


def test_compiled_replies_equal_eager(compiled_and_eager):
    """Greedy text ids and every codebook of every frame, two whole turns, compiled == eager."""
    _, got, want = compiled_and_eager
    for (text, frames), (want_text, want_frames) in zip(got["replies"][:2], want["replies"][:2]):
        assert len(text) == TEXT and len(frames) == FRAMES
        assert len(set(text)) > 2 and len({tuple(f) for f in frames}) > 2  # varied, not one repeated code
        assert text == want_text
        assert frames == want_frames


def test_every_step_compiles_as_one_graph(compiled_and_eager):
    """fullgraph held for every registered step (an error would mean it stayed eager), and the
    conversation ran on the compiled code only."""
    ex, _, _ = compiled_and_eager
    steps = ex.runner.stats()["steps"]
    assert set(steps) == STEPS
    for name, s in steps.items():
        assert s["error"] is None, (name, s["error"])
        assert s["compiles"] >= 1 and s["calls"]["compile"] > 0 and s["calls"]["eager"] == 0, (name, s)


def test_no_recompiles_over_rollback_interrupt_and_cache_full_drops(compiled_and_eager):
    """The interrupted turn, the preemptive start rolled back, the cache-full drops and the turns after
    them write the same buffers at other positions: no recompile, and the same replies as eager."""
    ex, got, want = compiled_and_eager
    assert got["drops"] == want["drops"] >= 2
    assert ex.runner.recompiles == 0, ex.runner.stats()
    assert got["replies"] == want["replies"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_equal_eager(checkpoint, speech_like):
    """On a GPU: each step captured once (one signature: the whole caches, the same state objects) and
    replayed for the whole conversation, with eager's replies."""
    stack = load_stack(checkpoint, device="cuda", dtype=torch.float32)
    graphs = _executor(stack, "graphs")
    got = conversation(graphs, speech_like)
    want = conversation(_executor(stack, "eager"), speech_like)
    assert got == want and got["drops"] >= 2
    steps = graphs.runner.stats()["steps"]
    assert set(steps) == STEPS
    for name, s in steps.items():
        assert s["error"] is None, (name, s["error"])
        assert s["graphs"] == 1 and s["calls"]["graphs"] > 0, (name, s)
