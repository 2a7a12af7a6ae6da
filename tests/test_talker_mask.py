"""The talker can never hand the vocoder an id past its codec table.

The published checkpoints' talker has 8448 output ids but the vocoder's codec
table only 8194 rows; transformers suppresses only the codec bos.  Here a
demo checkpoint is edited into that layout (a codec table smaller than the
talker vocabulary) with a talker head whose every in-range logit is 0 and
whose out-of-range ids get the only non-zero ones, so an unmasked talker
picks an out-of-range id at every step.
"""

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omnidesk.engine.engine import EngineConfig
from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor
from omnidesk.engine.talk import Script, run_script
from omnidesk.engine.timeline import Timeline
from omnidesk.models.qwen2_5_omni.demo import make_demo
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.reply import talker_defaults, talker_suppressed_ids
from omnidesk.models.sampling import SamplingParams

TABLE_EMBEDS = 1000  # DiT num_embeds: the table holds ids 0..1000; the demo talker has 1040 ids
FAVOURED = (1010, 1011)  # past the table, not stop ids


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    src = make_demo(tmp_path_factory.mktemp("demo") / "demo")
    dst = tmp_path_factory.mktemp("greedy-talker") / "ckpt"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["token2wav_config"]["dit_config"]["num_embeds"] = TABLE_EMBEDS
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(dst / "model.safetensors")
    table = "token2wav.code2wav_dit_model.text_embed.codec_embed.weight"
    weights[table] = weights[table][:TABLE_EMBEDS + 1].clone()
    head = weights["talker.codec_head.weight"]
    w = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
    head.zero_()
    head[FAVOURED[0]], head[FAVOURED[1]] = w, -w  # one of the two always has the only positive logit
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return load_stack(dst)


def _talk(stack, talker_sampling, wave):
    ex = QwenOmniExecutor(stack, max_reply_tokens=8, max_codec_tokens=80,
                          thinker_sampling=SamplingParams(greedy=True), talker_sampling=talker_sampling)
    timeline = Timeline(model={}, device="cpu")
    engine, speaker = asyncio.run(run_script(ex, Script([wave], no_vad=True), EngineConfig(), timeline,
                                             realtime=False))
    return engine, timeline.turns[0]


def test_suppressed_ids_are_everything_past_the_table_but_the_stops(stack):
    cfg = stack.config.talker
    suppressed = set(talker_suppressed_ids(stack))
    assert stack.vocoder.codec_table_size == TABLE_EMBEDS + 1
    assert cfg.codec_bos_id in suppressed  # as the reference
    assert not suppressed & set(cfg.stop_ids)
    beyond = set(range(TABLE_EMBEDS + 1, cfg.decoder.vocab_size)) - set(cfg.stop_ids)
    assert suppressed == beyond | {cfg.codec_bos_id}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_a_talker_that_favours_out_of_range_ids_still_gives_audio(stack, speech_like, greedy):
    wave = speech_like(1.0, seed=3).numpy().astype(np.float32)
    engine, turn = _talk(stack, talker_defaults(stack, greedy=greedy), wave)
    assert engine.failure is None
    codes = turn.codec_token_ids
    assert len(codes) == 80 and max(codes) < stack.vocoder.codec_table_size
    assert turn.reply_audio_s == pytest.approx(80 * 2 * stack.vocoder.hop_length / 24000, rel=0.01)


def test_without_the_mask_the_vocoder_refuses_the_id_by_name(stack, speech_like):
    # what the reference's settings (codec bos suppressed, nothing else) would do with this talker
    reference_like = SamplingParams(greedy=True, repetition_penalty=1.05,
                                    suppress_ids=(stack.config.talker.codec_bos_id,))
    engine, turn = _talk(stack, reference_like, speech_like(1.0, seed=3).numpy().astype(np.float32))
    assert engine.failure is not None and engine.failure.stage == "vocoder"
    assert any(f"codec id {i} is outside the vocoder's codec table (0..1000)" in engine.failure.message
               for i in FAVOURED)
    assert turn.extra["error"]["stage"] == "vocoder"
