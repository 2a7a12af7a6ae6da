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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...engine.executor import stage
from ..sampling import Sampler, SamplingParams
from ..thinker_talker import DEFAULT_CHARS_PER_SECOND, ReplyState, ThinkerTalkerExecutor, generation_defaults
from .loading import Qwen3OmniStack

# The output rate of code2wav (12.5 frames/s x 1920 samples), from the model card: config.json has no field for it.
SAMPLE_RATE_OUT = 24000
SYSTEM_PROMPT = ("You are a voice assistant talking with the user. Reply in short, natural spoken sentences, "
                 "without lists or formatting.")


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
    speaker_id: int | None = None  # the voice's codec id in the talker's prefill
    talker_hidden: torch.Tensor | None = None  # the talker's last hidden state: the code predictor's input
    predictor_sampler: Sampler | None = None


class Qwen3OmniExecutor(ThinkerTalkerExecutor):
    reply_state = Qwen3Reply

    def __init__(self, stack: Qwen3OmniStack, capacity: int = 4096, max_reply_tokens: int = 512,
                 max_codec_tokens: int = 1500, system_prompt: str = SYSTEM_PROMPT,
                 thinker_sampling: SamplingParams | None = None, talker_sampling: SamplingParams | None = None,
                 predictor_sampling: SamplingParams | None = None,
                 chars_per_second: float = DEFAULT_CHARS_PER_SECOND):
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
        self.predictor_cache = self.talker.code_predictor.new_cache(stack.dtype, stack.device)  # one frame, reused
        self._setup(capacity, max_reply_tokens, system_prompt,
                    thinker_sampling or generation_defaults(stack.generation_config), chars_per_second)
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
        vocab = self.cfg.talker.text.vocab_size
        codec_gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        predictor_gen = torch.Generator(device=self.device).manual_seed(seed + 2)
        predictor_vocab = self.talker.code_predictor.vocab_size
        r.voice, r.speaker_id = name, self.stack.voices[name]
        r.codec_sampler = Sampler(self.talker_sampling, vocab, self.device, codec_gen)
        r.predictor_sampler = Sampler(self.predictor_sampling, predictor_vocab, self.device, predictor_gen)
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

    def _advance_talker(self, r: "Qwen3Reply", code0: int) -> None:
        """One 80 ms frame: codebook 0 chosen from the talker, the rest from the code predictor."""
        codes = self.talker.code_predictor.expand(r.talker_hidden, code0, self.talker,
                                                  lambda logits, step: r.predictor_sampler.choose(logits),
                                                  cache=self.predictor_cache)
        r.predictor_sampler.reset()  # each frame's expansion is its own sequence in the reference
        r.codes.append(codes)
        step_input = self.talker.frame_embedding(codes) + r.feed.next()
        hidden, logits = self.talker(step_input[None], self.talker_cache)
        r.talker_hidden, r.talker_logits = hidden[-1], logits[-1]

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
                 max_codec_tokens: int | None = None) -> Qwen3OmniExecutor:
    """The executor every front end (talk, live, the window) uses for a loaded stack.

    The demo model rarely says "stop" (it is untrained), so its replies are capped at about 6 s
    (75 frames) unless the caller sets limits."""
    from .demo import is_demo

    limits: dict[str, int] = {}
    if is_demo(stack.config.raw):
        limits = {"max_reply_tokens": 48, "max_codec_tokens": 75}
    if max_text_tokens:
        limits["max_reply_tokens"] = max_text_tokens
    if max_codec_tokens:
        limits["max_codec_tokens"] = max_codec_tokens
    return Qwen3OmniExecutor(
        stack, **limits,
        thinker_sampling=SamplingParams(greedy=True) if greedy else generation_defaults(stack.generation_config),
        talker_sampling=talker_defaults(stack, greedy=greedy))
