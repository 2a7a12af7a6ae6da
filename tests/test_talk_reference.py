"""Acceptance: ``omnidesk talk --no-vad --greedy`` on a transformers-written checkpoint says what
transformers' ``generate`` says for the same audio - same prompt, text ids and codec ids.

The CLI runs as a subprocess (the whole path: WAV reading, the scripted microphone, the engine's
interleaved thinker/talker/vocoder steps, the timeline JSON); the oracle is transformers' full
``Qwen2_5OmniForConditionalGeneration.generate`` run in-process, exactly as in test_reference.py
(one left pad so its talker gets the codec pad/bos embeddings; greedy = do_sample=False on both
stages, the talker's repetition penalty 1.05 still applied; eos ids from our config).  Voice:
the default on both sides (no --voice; the reference gets speaker="Chelsie", the first voice).

Limits, like with like:

* text: ``--max-text-tokens 12`` vs ``thinker_max_new_tokens=12``.  Both count the stop token:
  our executor emits the thinker's stop token (<|im_end|>) as its last text token and transformers
  keeps the eos it generated in the sequence, so the timeline's ``text_token_ids`` equal the
  reference's generated ids as they are, whether the text stopped by itself or hit the limit.
* speech: ``--max-codec-tokens 40`` vs ``talker_max_new_tokens=40``.  transformers counts the stop
  code among its 40 new tokens; our executor stops at a stop code without emitting it, and emits
  at most 40 codes.  So: stopped at step k <= 40 -> reference has k-1 codes + the stop, we have
  the k-1 codes; no stop within 40 -> both have 40 codes.  Comparing our codes with the
  reference's codes *before the first stop id* is exact in both cases.

The random tiny checkpoints never stop by themselves within those limits (greedy decoding loops),
so ``test_talk_stops_like_transformers`` edits a checkpoint's output heads until both the text
and the speech end early, and checks the stop paths too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
import torch

from omnidesk.models.qwen2_5_omni.loading import load_stack
from test_reference import _reference_generate, _reference_inputs

REPO = Path(__file__).resolve().parent.parent
MAX_TEXT, MAX_CODEC = 12, 40
SAMPLES_PER_CODE, RATE_OUT = 480, 24000  # the tiny vocoder: hop 240 x repeats 2, at 24 kHz


def _write_question(tmp_path: Path, wave: torch.Tensor) -> torch.Tensor:
    """Write q.wav (float: the CLI reads back bit-identical samples) and return what it holds."""
    sf.write(str(tmp_path / "q.wav"), wave.numpy(), 16000, subtype="FLOAT")
    data, rate = sf.read(str(tmp_path / "q.wav"), dtype="float32")
    assert rate == 16000
    return torch.from_numpy(data)


def _talk(model: Path, tmp_path: Path) -> dict:
    """Run ``omnidesk talk`` on q.wav; returns its one turn from the timeline JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "omnidesk", "talk", "--model", str(model), "--input", str(tmp_path / "q.wav"),
           "--no-vad", "--greedy", "--fast", "--max-text-tokens", str(MAX_TEXT),
           "--max-codec-tokens", str(MAX_CODEC), "--output", str(tmp_path / "out.wav"),
           "--timeline", str(tmp_path / "t.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"omnidesk talk failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    turns = json.loads((tmp_path / "t.json").read_text())["turns"]
    assert len(turns) == 1, turns  # --no-vad: one file, one turn
    assert not turns[0]["interrupted"]
    return turns[0]


@torch.inference_mode()
def _reference(stack, ref, wave):
    inputs = _reference_inputs(stack, wave)
    text, codes, logits = _reference_generate(stack, ref, inputs, speaker="Chelsie",
                                              thinker_max_new_tokens=MAX_TEXT, talker_max_new_tokens=MAX_CODEC)
    # our prompt is the reference's input without its one left pad
    return inputs["input_ids"][0, 1:].tolist(), text, codes, logits


def _check(turn: dict, stack, ref_prompt, ref_text, ref_codes, tmp_path: Path) -> None:
    assert stack.default_voice == "Chelsie"  # the CLI ran without --voice
    assert turn["prompt_token_ids"] == ref_prompt
    assert turn["text_token_ids"] == ref_text
    assert len(ref_codes) > 0  # a reply with speech, or the comparison below proves little
    assert turn["codec_token_ids"] == ref_codes
    # audio: 24 kHz out, and exactly SAMPLES_PER_CODE samples of reply per codec id
    assert sf.info(str(tmp_path / "out.wav")).samplerate == RATE_OUT
    assert turn["reply_audio_s"] == pytest.approx(len(turn["codec_token_ids"]) * SAMPLES_PER_CODE / RATE_OUT,
                                                  abs=1e-9)


@pytest.mark.parametrize("variant,seed", [("a", 11), ("b", 12)])
def test_talk_matches_transformers_generate(variant, seed, tiny_checkpoints, speech_like, tmp_path):
    path, ref = tiny_checkpoints(variant)
    wave = _write_question(tmp_path, speech_like(1.6, seed=seed))
    turn = _talk(path, tmp_path)
    stack = load_stack(path)
    ref_prompt, ref_text, ref_codes, _ = _reference(stack, ref, wave)
    _check(turn, stack, ref_prompt, ref_text, ref_codes, tmp_path)


def _first_new(ids: list[int], lo: int, hi: int, exclude=()) -> list[int]:
    """Steps in [lo, hi) whose token was not produced before (nor is in ``exclude``)."""
    return [i for i in range(lo, min(hi, len(ids))) if ids[i] not in ids[:i] and ids[i] not in exclude]


def _stop_like(head: torch.Tensor, stop: int, token: int, logit: float) -> None:
    """Make ``stop``'s logit a slightly stronger copy of ``token``'s (so it wins where ``token`` did)."""
    head[stop] = head[token] * (1.02 if logit > 0 else 0.98)


@torch.inference_mode()
def test_talk_stops_like_transformers(speech_like, tmp_path):
    """Text that ends with <|im_end|> before the limit and speech that ends at a stop code."""
    import tiny

    ckpt = tmp_path / "ckpt"
    ref = tiny.write_checkpoint(ckpt, "a")  # a fresh model: the session's shared one stays untouched
    stack = load_stack(ckpt)
    wave = _write_question(tmp_path, speech_like(1.6, seed=13))
    tcfg = stack.config.talker
    im_end = stack.tokenizer.special_ids["im_end"]
    inputs = _reference_inputs(stack, wave)

    # Thinker (variant a: lm_head is not tied to the embeddings): <|im_end|> takes over a token
    # first chosen in the middle of the reply.
    out = ref.thinker.generate(**inputs, max_new_tokens=MAX_TEXT, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, eos_token_id=im_end)
    text = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    for j in _first_new(text, 3, MAX_TEXT - 2, exclude=(im_end,)):
        saved = ref.thinker.lm_head.weight[im_end].clone()
        _stop_like(ref.thinker.lm_head.weight, im_end, text[j], out.logits[j][0, text[j]].item())
        _, new_text, codes, logits = _reference(stack, ref, wave)
        if new_text[-1] == im_end and len(new_text) < MAX_TEXT and len(codes) == MAX_CODEC:
            break
        ref.thinker.lm_head.weight[im_end] = saved
    else:
        pytest.fail(f"setup: could not make the thinker stop early (greedy text {text})")

    # Talker (codec_head is its own matrix): the end code takes over a code first chosen mid-reply.
    specials = (tcfg.codec_mask_id, tcfg.codec_pad_id, tcfg.codec_bos_id)
    # (greedy codes soon repeat one code, so the latest new code gives the longest speech)
    for k in reversed(_first_new(codes, 2, MAX_CODEC - 2, exclude=specials)):
        saved = ref.talker.codec_head.weight[tcfg.codec_eos_id].clone()
        _stop_like(ref.talker.codec_head.weight, tcfg.codec_eos_id, codes[k], logits[k][codes[k]].item())
        ref_prompt, ref_text, ref_codes, _ = _reference(stack, ref, wave)
        if ref_text == new_text and 0 < len(ref_codes) < MAX_CODEC - 1:
            break
        ref.talker.codec_head.weight[tcfg.codec_eos_id] = saved
    else:
        pytest.fail(f"setup: could not make the talker stop early (greedy codes {codes})")

    ref.save_pretrained(ckpt)  # the edited heads, written by transformers like the rest
    turn = _talk(ckpt, tmp_path)
    stack = load_stack(ckpt)
    _check(turn, stack, ref_prompt, ref_text, ref_codes, tmp_path)
    # the stop paths were taken: <|im_end|> emitted as the last text token, the stop code not emitted
    assert turn["text_token_ids"][-1] == im_end and len(turn["text_token_ids"]) < MAX_TEXT
    assert len(turn["codec_token_ids"]) < MAX_CODEC - 1
