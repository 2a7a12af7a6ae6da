"""Voices (spk_dict.pt) in the published layout and the unbatched one.

The published Qwen2.5-Omni files hold per voice ``bos_token`` (int), ``cond``
[1, 192] and ``ref_mel`` [1, 400, 80]; older fixtures wrote [192] and [T, 80].
The loader takes both and normalises them in one place
(omnidesk.models.qwen2_5_omni.loading.voice_from_entry); a wrong shape is reported by the
loader and by ``models verify`` naming the file, the voice and the field.
Every fixture writer (tests/tiny.py, the demo) writes the published layout.
"""

import numpy as np
import pytest
import torch

import tiny
from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor
from omnidesk.models.qwen2_5_omni.config import OmniConfig
from omnidesk.models.qwen2_5_omni.demo import make_demo
from omnidesk.models.families import verify
from omnidesk.models.checkpoint import CheckpointError
from omnidesk.models.qwen2_5_omni.loading import load_stack, load_voices
from omnidesk.models.qwen2_5_omni.reply import talker_defaults
from omnidesk.models.sampling import SamplingParams


def _raw(path):
    return torch.load(path / "spk_dict.pt", map_location="cpu", weights_only=True)


def _published(raw: dict) -> bool:
    return all(isinstance(v["bos_token"], int) and v["cond"].shape == (1, 192) and v["ref_mel"].shape == (1, 400, 80)
               for v in raw.values())


def test_fixture_writers_write_the_published_layout(tiny_checkpoints, tmp_path):
    raw = _raw(tiny_checkpoints("a")[0])
    assert list(raw) == ["Chelsie", "Ethan"] and _published(raw)
    demo = _raw(make_demo(tmp_path / "demo"))
    assert list(demo) == ["Chelsie", "Ethan"] and _published(demo)


@torch.inference_mode()
def test_batched_and_unbatched_voices_load_alike(ckpt):
    """The published file and the same numbers without the batch dim give the same voices and
    the same vocoder speaker features."""
    published = load_stack(ckpt)
    raw = _raw(ckpt)
    torch.save({name: {"bos_token": v["bos_token"], "cond": v["cond"][0], "ref_mel": v["ref_mel"][0]}
                for name, v in raw.items()}, ckpt / "spk_dict.pt")
    unbatched = load_voices(ckpt / "spk_dict.pt", published.config)
    assert list(unbatched) == list(published.voices) == ["Chelsie", "Ethan"]
    vocoder = published.vocoder
    for name, a in published.voices.items():
        b = unbatched[name]
        assert a.bos_token == b.bos_token == raw[name]["bos_token"]
        assert a.cond.shape == (192,) and a.ref_mel.shape == (400, 80)
        assert torch.equal(a.cond, b.cond) and torch.equal(a.ref_mel, b.ref_mel)
        va, vb = vocoder.voice(a.cond, a.ref_mel), vocoder.voice(b.cond, b.ref_mel)
        assert torch.equal(va.cond, vb.cond)
        assert all(torch.equal(x, y) for x, y in zip(va.features, vb.features))
        assert all(torch.isfinite(x).all() for x in va.features)


NAN = float("nan")
BAD = {
    # case: (field, edit of Ethan's entry, message after "field '<field>' ")
    "cond width": ("cond", lambda t: torch.zeros(1, 191), "has shape [1, 191], expected [192] or [1, 192]"),
    "cond unbatched width": ("cond", lambda t: torch.zeros(256), "has shape [256], expected [192] or [1, 192]"),
    "cond batch of 2": ("cond", lambda t: t.repeat(2, 1),
                        "has shape [2, 192]: a batch of 2 voices; expected [192] or [1, 192] (one voice)"),
    "ref_mel mel bins": ("ref_mel", lambda t: torch.zeros(1, 400, 128),
                         "has shape [1, 400, 128], expected [T, 80] or [1, T, 80]"),
    "ref_mel rank": ("ref_mel", lambda t: t.reshape(-1), "has shape [32000], expected [T, 80] or [1, T, 80]"),
    "ref_mel batch of 3": ("ref_mel", lambda t: t.repeat(3, 1, 1),
                           "has shape [3, 400, 80]: a batch of 3 voices; expected [T, 80] or [1, T, 80] (one voice)"),
    "ref_mel empty": ("ref_mel", lambda t: t[:, :0], "is empty (shape [1, 0, 80]), expected [T, 80] or [1, T, 80]"),
    "ref_mel NaN": ("ref_mel", lambda t: t.index_fill(1, torch.tensor([7]), NAN),
                    "holds NaN or infinite values (shape [1, 400, 80])"),
    "cond inf": ("cond", lambda t: t.index_fill(1, torch.tensor([0]), float("inf")),
                 "holds NaN or infinite values (shape [1, 192])"),
    "cond not float": ("cond", lambda t: t.long(), "is torch.int64, expected a float tensor"),
    "bos_token outside vocab": ("bos_token", lambda b: 10**6, "is 1000000, outside the thinker vocabulary (0..639)"),
    "bos_token not int": ("bos_token", lambda b: "Ethan", "is 'Ethan', expected an integer token id"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_voice_is_named_by_loader_and_verify(ckpt, case):
    field, edit, why = BAD[case]
    raw = _raw(ckpt)
    raw["Ethan"][field] = edit(raw["Ethan"][field])
    torch.save(raw, ckpt / "spk_dict.pt")
    expected = f"{ckpt / 'spk_dict.pt'}: voice 'Ethan' field '{field}' {why}"
    with pytest.raises(CheckpointError) as info:
        load_stack(ckpt)
    assert str(info.value) == expected
    report = verify(ckpt, load_test=False)
    assert report.problems == [expected]


def test_missing_voice_field_is_named(ckpt):
    raw = _raw(ckpt)
    del raw["Chelsie"]["ref_mel"]
    torch.save(raw, ckpt / "spk_dict.pt")
    expected = f"{ckpt / 'spk_dict.pt'}: voice 'Chelsie' lacks ref_mel"
    with pytest.raises(CheckpointError, match="lacks ref_mel") as info:
        load_stack(ckpt)
    assert str(info.value) == expected
    assert verify(ckpt, load_test=False).problems == [expected]


def test_voice_dims_come_from_the_checkpoint_config(ckpt):
    """A checkpoint whose DiT takes 96-wide speaker vectors wants 96-wide voices, not 192."""
    cfg = OmniConfig.from_file(ckpt / "config.json")
    raw = dict(cfg.raw)
    raw["token2wav_config"] = {**raw["token2wav_config"],
                               "dit_config": {**raw["token2wav_config"]["dit_config"], "enc_emb_dim": 96}}
    with pytest.raises(CheckpointError, match=r"field 'cond' has shape \[1, 192\], expected \[96\] or \[1, 96\]"):
        load_voices(ckpt / "spk_dict.pt", OmniConfig.from_dict(raw))
    # without a config (config.json itself broken) only the config-free checks run
    assert set(load_voices(ckpt / "spk_dict.pt", None)) == {"Chelsie", "Ethan"}


@torch.inference_mode()
def test_reply_with_published_voices_speaks(tiny_checkpoints, speech_like):
    """The first reply with published-format voices (it used to crash in DiT.speaker_features)."""
    stack = load_stack(tiny_checkpoints("a")[0])
    assert stack.voices["Chelsie"].ref_mel.shape == (tiny.VOICE_REF_FRAMES, 80)
    threads = torch.get_num_threads()
    try:
        ex = QwenOmniExecutor(stack, capacity=1024, max_reply_tokens=8, max_codec_tokens=60,
                              thinker_sampling=SamplingParams(greedy=True),
                              talker_sampling=talker_defaults(stack))
        for turn, voice in enumerate(("Ethan", None)):  # a named voice, then the default (Chelsie)
            ex.begin_user_turn()
            ex.add_user_audio(speech_like(1.2, seed=4 + turn).numpy())
            ex.end_user_turn()
            ex.start_reply(voice, seed=3)
            chunks = []
            while not (ex.thinker_done and ex.talker_done):
                ex.thinker_step()
                if ex.talker_step() is not None:
                    chunks += ex.vocoder_step()
            chunks += ex.vocoder_step(final=True)
            assert ex.reply_codec_ids
            ex.finish_reply()
            audio = np.concatenate(chunks)
            assert audio.size > 0 and np.isfinite(audio).all() and np.abs(audio).max() > 0
    finally:
        torch.set_num_threads(threads)  # the executor leaves a core to an event loop this test does not run
