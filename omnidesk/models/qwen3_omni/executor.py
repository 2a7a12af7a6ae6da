"""Qwen3-Omni executor: the shared thinker conversation plus this family's talker, code predictor and code2wav.

The conversation (turns, audio blocks, rollback, cache-full drops, heard-text
alignment) is :class:`~omnidesk.models.thinker_talker.ThinkerTalkerExecutor`.
What is Qwen3-Omni's own, as the reference's ``generate`` feeds its talker:

* the talker reads only the **user** turns of the conversation (system turns
  and earlier replies are skipped): at audio positions the thinker's hidden
  state after layer ``accept_hidden_layer`` through ``hidden_projection``, at
  text positions the thinker's *input* embedding through ``text_projection``.
  A position belongs to the turn whose ``<|im_start|>`` came last, and the
  token after that names the role;
* a reply's talker prompt: the projected ``<|im_start|>assistant\\n``, four
  tts_pad and tts_bos rows plus the codec control ids (nothink, think bos/eos,
  the speaker, codec pad), then the first reply token's row plus codec bos;
* each talker step gives codebook 0 of one 80 ms frame; the code predictor
  expands the other codebooks from the talker's last hidden state; the next
  talker input is the sum of the frame's code embeddings plus the next reply
  token's projected embedding (then tts_eos once, then tts_pad);
* code2wav turns every frame into 1920 samples at 24 kHz as soon as it exists
  (exact streaming: one frame, once), so the first audio follows the first
  codec frame.

The talker cache therefore holds fewer rows than the thinker's: ``context_used``
marks the user positions and the shared code counts them.

Decode steps (omnidesk.models.runner): the thinker's reply token is the shared
step (:meth:`_decode_thinker`: the static thinker, the row from ``text_projection``
of the token's embedding, since a reply token is text); a frame is ONE step,
``talker_frame``: the code predictor's G-1 sub-steps (its own G-position cache,
codes sampled on the device with noise drawn for all G-1 rows before the step),
then the talker's step on the frame's embeddings + the next reply row, which
chooses the next code 0 (repetition penalty, suppressed ids).  The executor reads
the frame's codes and that next code 0 with one host sync per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...engine.executor import stage
from ..kv_cache import KVCache, KVSpan
from ..omni_executor import executor_with_limits
from ..sampling import Sampler, SamplingParams, device_generator, sample
from ..thinker_talker import (DEFAULT_CHARS_PER_SECOND, ReplyState, ThinkerTalkerExecutor, generation_defaults,
                              guard_finite)
from .loading import Qwen3OmniStack

# The output rate of code2wav (12.5 frames/s x 1920 samples), from the model card: config.json has no field for it.
SAMPLE_RATE_OUT = 24000
SYSTEM_PROMPT = ("You are a voice assistant talking with the user. Reply in short, natural spoken sentences, "
                 "without lists or formatting.")
# The demo's replies when the caller sets no limits: about 6 s of speech (75 frames of 80 ms).
DEMO_LIMITS = {"max_reply_tokens": 48, "max_codec_tokens": 75}


def turn_roles(ids: list[int], im_start: int, before: list[int] = ()) -> list[int | None]:
    """The role token of each of ``ids`` (appended after ``before``): the token after the last
    <|im_start|> at or before it, the reference's rule for what its talker reads; None where that
    is not known (before the first <|im_start|>, or one that ends ``ids``)."""
    role, pending = None, False
    for j in range(len(before) - 1, -1, -1):
        if before[j] == im_start:
            pending = j == len(before) - 1
            role = None if pending else before[j + 1]
            break
    out: list[int | None] = []
    for i, x in enumerate(ids):
        if x == im_start:
            role = ids[i + 1] if i + 1 < len(ids) else None
            pending = False
        elif pending:
            role, pending = x, False
        out.append(role)
    return out


def talker_defaults(stack: Qwen3OmniStack, greedy: bool = False) -> SamplingParams:
    """The reference's talker sampling (generate's defaults: top-k 50, temperature 0.9, repetition
    penalty 1.05, control ids suppressed), overridden by the checkpoint's generation_config.json
    ``talker_*`` keys where it has them.  Greedy keeps the penalty and the suppression, as the
    reference's ``talker_do_sample=False`` does."""
    g = stack.generation_config
    suppress = stack.config.talker.suppressed_ids
    penalty = float(g.get("talker_repetition_penalty", 1.05))
    if greedy:
        return SamplingParams(greedy=True, repetition_penalty=penalty, suppress_ids=suppress)
    return SamplingParams(temperature=float(g.get("talker_temperature", 0.9)), top_k=int(g.get("talker_top_k", 50)),
                          top_p=float(g.get("talker_top_p", 1.0)), repetition_penalty=penalty, suppress_ids=suppress)


def predictor_defaults(greedy: bool = False) -> SamplingParams:
    """The code predictor's sampling in the reference (top-k 50, top-p 0.8; greedy with the talker)."""
    return SamplingParams(greedy=True) if greedy else SamplingParams(top_k=50, top_p=0.8)


@dataclass(eq=False)
class Qwen3Reply(ReplyState):
    """A Qwen3-Omni reply.  ``next_code`` is the next code 0 as the shared talker_step reads it: after
    the first frame a host copy (read with the frame's codes in the frame's one sync, so reading it
    costs no second sync); ``code0`` is the same code on the device, the next frame step's input."""

    speaker_id: int | None = None  # the voice's codec id in the talker's prefill
    talker_hidden: torch.Tensor | None = None  # the talker's last hidden state: the code predictor's input
    code0: torch.Tensor | None = None  # the next code 0 ([1] on the device)
    predictor_sampler: Sampler | None = None


class Qwen3OmniExecutor(ThinkerTalkerExecutor):
    """The Qwen3-Omni conversation (see the module docstring); ``compile`` is the decode-step
    setting (omnidesk.models.runner.resolve_mode)."""

    reply_state = Qwen3Reply
    family = "qwen3_omni"

    def __init__(self, stack: Qwen3OmniStack, capacity: int = 4096, max_reply_tokens: int = 512,
                 max_codec_tokens: int = 1500, system_prompt: str = SYSTEM_PROMPT,
                 thinker_sampling: SamplingParams | None = None, talker_sampling: SamplingParams | None = None,
                 predictor_sampling: SamplingParams | None = None,
                 chars_per_second: float = DEFAULT_CHARS_PER_SECOND, compile: str | None = None):
        cfg = stack.config
        if cfg.talker is None or stack.talker is None:
            raise ValueError(f"{stack.path}: this checkpoint has no talker (enable_audio_output is false)")
        self.stack, self.cfg = stack, cfg
        self.thinker, self.talker, self.code2wav = stack.thinker, stack.talker, stack.code2wav
        tok = stack.tokenizer
        self.audio_token_id = cfg.thinker.audio_token_id
        self.chat_tokens = {"audio": tok.id_to_token(cfg.thinker.audio_token_id), "im_end": tok.id_to_token(cfg.im_end_id)}
        eos = stack.generation_config.get("eos_token_id", cfg.im_end_id)
        self.stop_ids = {cfg.im_end_id, *(eos if isinstance(eos, list) else [eos])}
        self.talker_stop_ids = {cfg.talker.codec_eos_id}
        self.max_codec_tokens = max_codec_tokens  # talker steps = 80 ms frames
        self.talker_sampling = talker_sampling or talker_defaults(stack)
        self.predictor_sampling = predictor_sampling or predictor_defaults(self.talker_sampling.greedy)
        self.sample_rate_out = SAMPLE_RATE_OUT
        self.samples_per_code = self.code2wav.samples_per_frame
        self.talker_width = cfg.talker.text.hidden_size  # rows are projected into the talker's width
        self.talker_cache = self.talker.new_cache(capacity + max_codec_tokens + 16)
        predictor = self.talker.code_predictor
        groups = predictor.num_code_groups
        # Frame-step state allocated once (re-seeded and cleared per reply), so a captured frame keeps its
        # buffers: the samplers (the predictor's draws noise for its G-1 codes at once), the predictor's
        # one-frame cache, its positions 0..G-1 and the talker's position input.  Normal tensors even when
        # made under inference_mode: the engine's worker thread writes them outside it.
        self.codec_sampler = Sampler(self.talker_sampling, cfg.talker.text.vocab_size, stack.device,
                                     device_generator(stack.device))
        self.predictor_sampler = Sampler(self.predictor_sampling, predictor.vocab_size, stack.device,
                                         device_generator(stack.device), rows=groups - 1)
        with torch.inference_mode(False):
            self.predictor_cache = predictor.new_cache(stack.dtype, stack.device)
            self._frame_pos = torch.arange(groups, device=stack.device)
            self._talker_pos = torch.zeros(1, dtype=torch.long, device=stack.device)
        self._setup(capacity, max_reply_tokens, system_prompt,
                    thinker_sampling or generation_defaults(stack.generation_config), chars_per_second, compile)
        tail = self._turn_pieces["tail"]
        if len(tail) < 3 or tail[-3] != cfg.im_start_id or tail[-2] != cfg.assistant_id:
            # the talker's prompt takes the last three prompt rows as <|im_start|>assistant\n, as the reference does
            raise ValueError(f"{stack.path}: the chat template's assistant header does not end with "
                             f"<|im_start|>assistant and one token (got ids {tail[-3:]})")

    # ------------------------------------------------------------------ what the talker reads
    def _forward_thinker(self, ids, embeds):
        tcfg = self.cfg.talker
        hidden, layer = self.thinker(embeds, self.thinker_cache, hidden_layer=tcfg.accept_hidden_layer)
        is_audio = ids == self.audio_token_id
        rows = torch.empty(ids.shape[0], self.talker_width, dtype=hidden.dtype, device=hidden.device)
        if bool(is_audio.any()):
            rows[is_audio] = self.talker.hidden_projection(layer[is_audio])
        if not bool(is_audio.all()):
            rows[~is_audio] = self.talker.text_projection(embeds[~is_audio])
        user = self.cfg.user_id
        roles = turn_roles(ids.tolist(), self.cfg.im_start_id, before=self.ids)
        used = torch.tensor([r == user for r in roles], dtype=torch.bool, device=self.device)
        return hidden, rows, used

    def _decode_thinker(self, embeds, cache, input_pos):
        # a reply token is text: its row is its input embedding's projection, as _forward_thinker
        # makes it for a text position
        return self.thinker.forward_static(embeds, cache, input_pos), self.talker.text_projection(embeds)

    def _decode_used(self, token: int) -> bool:
        # turn_roles' rule, as a prefill of the whole conversation applies it: a reply token belongs to the
        # assistant turn (not read), unless the model opened another turn itself.  An <|im_start|> takes the
        # role of the token after it, unknown when it was decoded: once that token says "user", the
        # <|im_start|> before it is read too.
        before, cfg = self.ids, self.cfg
        used = turn_roles([token], cfg.im_start_id, before=before)[0] == cfg.user_id
        if used and before and before[-1] == cfg.im_start_id:
            self.context_used[len(before) - 1] = True
        return used

    def _register_steps(self) -> None:
        predictor = self.talker.code_predictor
        for decoder, cache in ((self.thinker.decoder, self.thinker_cache), (self.talker.decoder, self.talker_cache),
                               (predictor.decoder, self.predictor_cache)):
            decoder.rotary.table(cache.capacity, self.stack.dtype)  # grown here, not inside a compiled step
        self._talker_frame_step = self.runner.step("talker_frame", self._talker_frame, self._frame_example)

    def _frame_example(self) -> tuple:
        """Scratch inputs of the frame step's shapes (compiling runs it on them): a private span of
        the talker cache, a private predictor cache, samplers like the executor's, zero inputs."""
        device, dtype = self.device, self.stack.dtype
        predictor = self.talker.code_predictor
        codec = Sampler(self.talker_sampling, self.codec_sampler.seen.shape[0], device, device_generator(device))
        codes = Sampler(self.predictor_sampling, predictor.vocab_size, device, device_generator(device),
                        rows=predictor.num_code_groups - 1)
        codec.draw()
        codes.draw()
        with torch.inference_mode(False):
            cache = predictor.new_cache(dtype, device)
            hidden = torch.zeros(self.talker_width, dtype=dtype, device=device)
            code0 = torch.zeros(1, dtype=torch.long, device=device)
            row = torch.zeros(self.talker_width, dtype=dtype, device=device)
            pos = torch.full((1,), 3, dtype=torch.long, device=device)
        return KVSpan.scratch(self.talker_cache, 16, dynamic=True), cache, codec, codes, hidden, code0, row, pos

    def _talker_frame(self, cache: KVCache | KVSpan, predictor_cache: KVCache, codec: Sampler, predictor: Sampler,
                      hidden: torch.Tensor, code0: torch.Tensor, reply_row: torch.Tensor, input_pos: torch.Tensor):
        """One 80 ms frame as a decode step: the talker's last hidden state [H] and its code 0 [1] -> the
        code predictor's codes 1..G-1 (sampled with ``predictor``'s noise, one row per code), then the
        frame's embeddings + ``reply_row`` [H] through the talker at ``input_pos`` [1] -> (the frame [G],
        the talker's hidden state [H], the next code 0 [1] chosen and marked in ``codec``)."""
        params = predictor.params
        seen = None
        if params.repetition_penalty != 1.0:  # each frame's expansion is its own sequence in the reference
            seen = predictor.seen
            seen.zero_()
        noise = None if predictor.noise is None else predictor.noise.view(-1, predictor.noise.shape[-1])

        def choose(logits: torch.Tensor, group: int) -> torch.Tensor:
            code = sample(logits, params, seen, None if noise is None else noise[group - 1], predictor.suppress)
            if seen is not None:
                predictor.mark(code)
            return code

        frame, embedding = self.talker.code_predictor.expand_static(hidden, code0, self.talker, predictor_cache,
                                                                    self._frame_pos, choose)
        h, logits = self.talker.forward_static((embedding + reply_row)[None], cache, input_pos)
        nxt = sample(logits[-1], codec.params, codec.seen, codec.noise, codec.suppress)
        codec.mark(nxt)
        return frame, h[-1], guard_finite(logits[-1], nxt)

    def _text_rows(self, token_ids: list[int]) -> torch.Tensor:
        w = self.thinker.embed_tokens.weight
        return self.talker.text_projection(w[torch.tensor(token_ids, device=self.device)])

    def _feed_ends(self):
        eos, pad = self._text_rows([self.cfg.tts_eos_id, self.cfg.tts_pad_id])
        return eos, pad

    # ------------------------------------------------------------------ reply, talker side
    def _start_speech(self, r: "Qwen3Reply", voice: str | None, seed: int) -> None:
        with stage("voice"):
            name = self.stack.voice_named(voice)
            if name is None:
                raise KeyError(f"voice '{voice}' is not a speaker of {self.stack.path / 'config.json'} "
                               f"(talker_config.speaker_id has: {', '.join(self.stack.voices)})")
        r.voice, r.speaker_id = name, self.stack.voices[name]
        # one generator per stage (the text takes seed): draws do not depend on how the stages interleave
        for sampler, offset in ((self.codec_sampler, 1), (self.predictor_sampler, 2)):
            sampler.generator.manual_seed(seed + offset)
            sampler.reset()
        r.codec_sampler, r.predictor_sampler = self.codec_sampler, self.predictor_sampler
        with stage("vocoder"):
            r.stream = self.code2wav.stream()

    def _start_talker(self) -> None:
        """Prefill the talker: user rows added since the last reply, then the reply's header."""
        r, cfg, tcfg = self._reply, self.cfg, self.cfg.talker
        new_rows = self._unread_context()
        header = self.context_rows[self.prompt_end - 3:self.prompt_end]  # <|im_start|>assistant\n
        pad, bos = self._text_rows([cfg.tts_pad_id, cfg.tts_bos_id])
        text = torch.cat([header, pad.expand(4, -1), bos[None], r.first_vector[None]])
        codec_ids = [tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id, r.speaker_id,
                     tcfg.codec_pad_id, tcfg.codec_bos_id]
        codec = self.talker.codec_embedding(torch.tensor(codec_ids, device=self.device))
        codec = torch.cat([torch.zeros(3, codec.shape[1], dtype=codec.dtype, device=codec.device), codec])
        self.talker_cache.reserve(new_rows.shape[0] + text.shape[0])
        hidden, logits = self.talker(torch.cat([new_rows, text + codec]), self.talker_cache)
        self.talker_context = self.prompt_end
        r.talker_hidden, r.talker_logits = hidden[-1], logits[-1]
        r.code0 = r.next_code = guard_finite(r.talker_logits, r.codec_sampler.pick(r.talker_logits))

    def _advance_talker(self, r: "Qwen3Reply", code0: int) -> None:
        """One 80 ms frame (one decode step): the code predictor completes the frame of ``code0``
        (= ``r.code0`` on the device), the talker reads it with the next reply row and chooses the
        next code 0."""
        start = self.talker_cache.reserve(1)
        self._talker_pos.fill_(start)
        r.predictor_sampler.draw()
        r.codec_sampler.draw()
        frame, r.talker_hidden, r.code0 = self._talker_frame_step(
            self._cache_arg(self.talker_cache, start + 1), self.predictor_cache, r.codec_sampler,
            r.predictor_sampler, r.talker_hidden, r.code0, r.feed.next(), self._talker_pos)
        self.talker_cache.length = start + 1
        codes = torch.cat((frame, r.code0)).tolist()  # the frame's one host sync
        r.codes.append(codes[:-1])
        r.next_code = torch.tensor(codes[-1:])  # on the host: talker_step's int() waits for nothing

    def vocoder_step(self, final: bool = False) -> list[np.ndarray]:
        """Every new frame becomes audio now (code2wav is causal: nothing waits for later frames)."""
        r = self._reply
        if r is None or r.vocoded == len(r.codes):
            return []
        new = torch.tensor(r.codes[r.vocoded:], dtype=torch.long, device=self.device).T  # [Q, n]
        r.vocoded = len(r.codes)
        wave = r.stream.push(new)
        return [wave.float().cpu().numpy()]

    @property
    def reply_codec_frames(self) -> list[list[int]]:
        """All codebooks of every frame of the current reply ([frames][num_code_groups])."""
        return [] if self._reply is None else [list(c) for c in self._reply.codes]

    @property
    def reply_codec_ids(self) -> list[int]:
        return [] if self._reply is None else [c[0] for c in self._reply.codes]


def executor_for(stack: Qwen3OmniStack, greedy: bool = False, max_text_tokens: int | None = None,
                 max_codec_tokens: int | None = None, compile: str | None = None) -> Qwen3OmniExecutor:
    """The executor every front end (talk, live, the window) uses for a loaded stack; ``compile``:
    the decode-step setting (omnidesk.models.runner.resolve_mode).

    The demo model rarely says "stop" (it is untrained), so its replies are capped at about 6 s
    (75 frames) unless the caller sets limits."""
    from .demo import is_demo

    return executor_with_limits(Qwen3OmniExecutor, stack, talker_defaults(stack, greedy=greedy),
                                DEMO_LIMITS if is_demo(stack.config.raw) else None, greedy, max_text_tokens,
                                max_codec_tokens, compile)
