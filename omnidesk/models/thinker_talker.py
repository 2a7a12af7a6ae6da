"""The conversation in a thinker's KV cache: what every thinker-talker family's executor shares.

Qwen2.5-Omni and Qwen3-Omni run the same conversation: the user's audio is
encoded block by block and prefilled while they speak, the reply is decoded
token by token, a talker speaks from what the thinker read and wrote, and an
interruption keeps only what the user heard.  The families differ in what the
talker reads (its context rows), how it makes speech codes and how they become
audio; :class:`ThinkerTalkerExecutor` keeps everything else, once.

State kept across turns (all preallocated, truncated by pointer):

* the thinker KV cache, the ids it holds (``ids``) and, for every thinker
  position, the talker's context row and whether the talker reads it
  (``context_rows`` / ``context_used``: the family decides both in
  :meth:`ThinkerTalkerExecutor._forward_thinker`);
* the talker KV cache: its first rows are the used context rows of thinker
  positions ``[0, talker_context)``; the speech rows of a reply are appended
  after them and dropped when the reply ends, so the next reply only prefills
  the rows added since;
* the encoder outputs of every audio placeholder the thinker holds, by
  position (``_audio_store``), truncated with it.  When the cache is full the
  oldest turns are dropped and the rest re-prefilled from ``ids`` and these
  (``_ensure_room``): a full prefill, leaving ``drop_headroom`` free so that it
  comes every few turns; each drop is reported (``take_overflows``).

Played audio -> kept text (``kept_text_tokens``): the talker reads one reply
token per codec step, far ahead of what it is saying (it reads at 12.5-50
tokens/s and speaks ~3), so its read position does not tell what was said.  We
align text to speech linearly by characters: token j is heard once the played
fraction of the reply's speech reaches the fraction of the reply's characters
up to and including token j.  The reply's speech length is exact when the
talker has finished; before that it is estimated as the larger of the speech
made so far and the text's length at ``chars_per_second`` (a typical speaking
rate).  Deliberately simple and documented; the engine records the counts in
the timeline so a better aligner can be judged against it.  The rule itself is
:func:`omnidesk.models.alignment.heard_text_pieces`, which the remote executor
(:mod:`omnidesk.remote`) applies to a server's text deltas.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.executor import Executor, Rollback, stage
from .alignment import heard_text_pieces
from ..features import log_mel, num_frames
from .kv_cache import CacheFullError, KVCache, KVSpan
from .runner import DecodeRunner, resolve_mode
from .sampling import Sampler, SamplingParams, device_generator, sample

# Marks where an assistant reply's text sits when the chat template is rendered to find the
# text between turns; never tokenized.
_REPLY_MARK = "\x00omnidesk-reply\x00"
# The token a decode step returns when its logits held NaN or Inf (no token id is negative): the executor
# sees it at the one host read it makes per step, and ends the turn with a clear error instead of
# speaking from garbage.  Checked on the device, inside the step: no extra sync.
NONFINITE = -1


class NonFiniteLogits(RuntimeError):
    """A step's logits were NaN or Inf (damaged weights, or activations that overflowed)."""


def guard_finite(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``token``, or :data:`NONFINITE` where ``logits`` hold a NaN or Inf (no host sync)."""
    return torch.where(torch.isfinite(logits).all(), token, torch.full_like(token, NONFINITE))


def read_token(token: torch.Tensor | int, what: str) -> int:
    """The host's one read of a step's chosen token; :class:`NonFiniteLogits` for :data:`NONFINITE`."""
    value = int(token)
    if value == NONFINITE:
        raise NonFiniteLogits(f"the {what} produced NaN or Inf values: this reply stops here (the weights may be "
                              f"damaged: omnidesk models verify checks every tensor)")
    return value


# A typical conversational speaking rate, used only until the talker has finished a reply.
DEFAULT_CHARS_PER_SECOND = 14.0
FLOOR_DB_RANGE = 8.0  # log10 dynamic range of the features (the reference's max - 8)


@dataclass(frozen=True)
class Mark:
    thinker_length: int
    talker_context: int
    blocks_done: int
    audio_length: int
    turn_open: bool
    floor: float | None
    prompt_end: int = 0
    # positions dropped from the front of the conversation (cache-full re-prefills) when the mark
    # was taken: a rollback across a re-prefill maps the mark's positions by the difference
    dropped: int = 0


class ReplyFeed:
    """Thinker reply positions handed to the talker, one per talker step.

    ``push`` a reply position (the talker's row for a reply token the thinker has
    already read); ``finish`` when the thinker stopped.  ``next`` returns the next
    vector, ``None`` while the thinker is behind, and after the reply the text-eos
    vector once, then text-pad forever (both families' talkers are fed this way).
    """

    def __init__(self, eos_vector: torch.Tensor, pad_vector: torch.Tensor):
        self._eos, self._pad = eos_vector, pad_vector
        self._queue: deque[torch.Tensor] = deque()
        self.finished = False
        self._eos_sent = False

    def push(self, vector: torch.Tensor) -> None:
        if self.finished:
            raise RuntimeError("ReplyFeed.push after finish")
        self._queue.append(vector)

    def finish(self) -> None:
        self.finished = True

    @property
    def ready(self) -> bool:
        """Whether next() will return a vector now."""
        return bool(self._queue) or self.finished

    def next(self) -> torch.Tensor | None:
        if self._queue:
            return self._queue.popleft()
        if not self.finished:
            return None
        if not self._eos_sent:
            self._eos_sent = True
            return self._eos
        return self._pad


def generation_defaults(g: dict) -> SamplingParams:
    """Sampling from a generation_config.json dict; greedy when it does not sample."""
    if not g.get("do_sample", False):
        return SamplingParams(greedy=True, repetition_penalty=float(g.get("repetition_penalty", 1.0)))
    return SamplingParams(temperature=float(g.get("temperature", 1.0)), top_k=int(g.get("top_k", 0) or 0),
                          top_p=float(g.get("top_p", 1.0)), repetition_penalty=float(g.get("repetition_penalty", 1.0)))


@dataclass(eq=False)
class ReplyState:
    """One reply in flight, from ``start_reply`` until it finishes or is cut.

    The thinker's side is shared; a family's talker keeps what it needs in a subclass
    (:attr:`ThinkerTalkerExecutor.reply_state`)."""

    text_sampler: Sampler
    feed: ReplyFeed  # thinker reply rows -> talker, one per talker step
    voice: str | None = None  # the voice it speaks with (set by the family's _start_speech)
    text: list[int] = field(default_factory=list)  # reply ids emitted so far
    next_token: torch.Tensor | None = None  # chosen ([1] on the device), not yet emitted
    thinker_done: bool = False
    first_vector: torch.Tensor | None = None  # the first reply row: it ends the talker's prefill
    codes: list = field(default_factory=list)  # one entry per talker step (a frame of codebooks where there are several)
    talker_done: bool = False
    talker_logits: torch.Tensor | None = None  # the talker prefill's last logits (None until the prefill)
    next_code: torch.Tensor | None = None  # the next code ([1] on the device), chosen inside the talker's step
    codec_sampler: Sampler | None = None
    stream: object = None  # the family's streaming vocoder
    vocoded: int = 0  # codes already handed to the vocoder


class ThinkerTalkerExecutor(Executor):
    """The thinker-side conversation of a thinker-talker family (see the module docstring).

    A family's ``__init__`` sets what the shared code reads, then calls :meth:`_setup`:
    ``stack`` (``tokenizer``, ``features``, ``dtype``, ``path``), ``thinker`` (``embed``,
    ``embed_tokens``, ``logits``, ``audio_encoder`` with ``block_frames`` / ``encode_block`` /
    ``output_length``), ``audio_token_id``, ``chat_tokens`` (the audio placeholder and
    im_end strings of its chat template), ``stop_ids``, ``talker_stop_ids`` (codes that end the
    speech), ``talker_cache``, ``talker_width``, ``sample_rate_out``, ``samples_per_code``
    (output samples per speech step).  It implements :meth:`_forward_thinker` (thinker forward
    + the talker's rows), :meth:`_decode_thinker` (the same for one reply token, as a static-shape
    step) and the reply's talker side: :meth:`_start_speech`, :meth:`_start_talker`,
    :meth:`_advance_talker`, :meth:`vocoder_step`, :meth:`_feed_ends`, with what it keeps per reply
    in a :class:`ReplyState` subclass (:attr:`reply_state`); :meth:`_register_steps` adds its
    talker's hot steps to the decode runner.

    Decode steps (one reply token of the thinker, one talker step) run through a
    :class:`~omnidesk.models.runner.DecodeRunner` (eager, compiled or CUDA graphs: ``compile``
    is the user's setting, see :func:`~omnidesk.models.runner.resolve_mode`).  They choose their
    next token on the device; the executor reads it once, at the start of the next step.
    """

    family = ""  # the registry's name of the family (picks where compiling pays on the CPU)

    drop_headroom = 0.25  # fraction of the cache a cache-full drop leaves free (see _ensure_room)
    reply_state: type[ReplyState] = ReplyState
    _reply: ReplyState | None

    def _setup(self, capacity: int, max_reply_tokens: int, system_prompt: str, thinker_sampling: SamplingParams,
               chars_per_second: float, compile: str | None = None) -> None:
        stack = self.stack
        if stack.device.type == "cpu":
            # Leave a core to the event loop and the audio thread: with every core in torch's
            # pool, the pool's spinning threads and the loop fight and steps take several times longer.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        self.device = stack.device
        self.capacity = capacity
        self.max_reply_tokens = max_reply_tokens
        self.system_prompt = system_prompt
        self.thinker_sampling = thinker_sampling
        self.chars_per_second = chars_per_second
        self.sample_rate_in = stack.features.sampling_rate
        enc = self.thinker.audio_encoder
        self.block_frames = enc.block_frames
        self.block_samples = self.block_frames * stack.features.hop_length
        self.block_tokens = enc.output_length(self.block_frames)
        self.im_end_id = stack.tokenizer.token_to_id(self.chat_tokens["im_end"])
        self.thinker_cache = self.thinker.new_cache(capacity)
        self.context_rows = torch.zeros(capacity, self.talker_width, dtype=stack.dtype, device=self.device)
        self.context_used = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self._turn_pieces = self._template_pieces()
        # Decode state allocated once, so a captured step sees the same buffers every reply: the
        # text sampler (re-seeded and cleared per reply) and the position input.
        with torch.inference_mode(False):
            self._pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.text_sampler = Sampler(thinker_sampling, self.thinker.lm_head.out_features, self.device,
                                    device_generator(self.device))
        self.runner = DecodeRunner(resolve_mode(compile, self.device, self.family), self.device)
        self._thinker_decode_step = self.runner.step(
            "thinker", self._thinker_decode, lambda: self._example(self.thinker_cache, self.text_sampler))
        self._register_steps()
        self.reset_conversation()
        self.runner.warm_up()

    # ------------------------------------------------------------------ family hooks
    @abstractmethod
    def _forward_thinker(self, ids: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
        """Run the thinker over ``embeds`` (the input embeddings of ``ids``, appended at position
        ``thinker_cache.length``); return its final hidden states [T, H], the talker's context row
        for each position [T, talker_width] and whether the talker reads it [T] (bool)."""

    @abstractmethod
    def _decode_thinker(self, embeds: torch.Tensor, cache: KVCache | KVSpan, input_pos: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """One reply token through the thinker as a static-shape step (no host sync): ``embeds`` [1, H]
        written at ``input_pos`` [1] -> its final hidden state [1, H] and the talker's row [1, W]."""

    def _decode_used(self, token: int) -> bool:
        """Whether the talker reads the row of reply token ``token`` (appended at the end of ``ids``)."""
        return True

    def _register_steps(self) -> None:
        """Register the talker's hot steps with ``self.runner`` (the thinker's is shared)."""

    @abstractmethod
    def _feed_ends(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The talker rows fed after the reply's last token: text-eos once, then text-pad."""

    @abstractmethod
    def _start_speech(self, r: ReplyState, voice: str | None, seed: int) -> None:
        """Reply start, talker side: check the voice, set up the talker's sampler and the vocoder
        stream in ``r`` (``r.voice`` names the voice used)."""

    @abstractmethod
    def _start_talker(self) -> None:
        """Prefill the talker (the context rows it has not read, the reply's opening), keep its last
        logits in ``talker_logits`` and choose the first code into ``next_code``."""

    @abstractmethod
    def _advance_talker(self, r: ReplyState, code: int) -> None:
        """Keep the step's ``code`` (``r.next_code`` read on the host; expanded to a frame where the
        family has several codebooks) in ``r.codes`` and feed it with the next reply row; choose the
        next code into ``r.next_code``."""

    # ------------------------------------------------------------------ decode steps (the runner's)
    def _cache_arg(self, cache: KVCache, n: int) -> KVCache | KVSpan:
        """What a decode step attends over with ``n`` valid positions: the whole cache for a CUDA graph
        (one fixed shape), else exactly the first ``n`` (a fraction of the work on the CPU; marked
        dynamic when compiled, so one compiled step serves every length)."""
        mode = self.runner.mode
        return cache if mode == "graphs" else cache.span(n, dynamic=mode == "compile")

    @staticmethod
    def _example(cache: KVCache, sampler: Sampler, extra: tuple = ()) -> tuple:
        """Scratch inputs of a decode step's shapes for compiling it in the background: a private
        16-position span shaped like ``cache`` and a sampler like ``sampler`` (nothing of the
        conversation is touched)."""
        scratch = Sampler(sampler.params, sampler.seen.shape[0], sampler.seen.device, torch.Generator(sampler.seen.device))
        scratch.draw()
        device = sampler.seen.device
        token = torch.zeros(1, dtype=torch.long, device=device)
        return (KVSpan.scratch(cache, 16, dynamic=True), scratch, token, *extra,
                torch.full((1,), 3, dtype=torch.long, device=device))

    def _thinker_decode(self, cache, sampler: Sampler, token: torch.Tensor, input_pos: torch.Tensor):
        """The thinker's decode step: reply token [1] at input_pos [1] -> (hidden [H], talker row [W],
        the next token [1] chosen and marked in ``sampler``)."""
        hidden, row = self._decode_thinker(self.thinker.embed_tokens(token), cache, input_pos)
        logits = self.thinker.logits(hidden[-1])
        nxt = sample(logits, sampler.params, sampler.seen, sampler.noise, sampler.suppress)
        sampler.mark(nxt)
        return hidden[-1], row[-1], guard_finite(logits, nxt)

    def _unread_context(self) -> torch.Tensor:
        """The talker rows of prompt positions ``[talker_context, prompt_end)`` it reads, i.e. what
        the talker has not read yet; cuts the talker cache back to its context first.  The family
        prefills them and sets ``talker_context = prompt_end``."""
        self.talker_cache.truncate(self._talker_context_length(self.talker_context))
        lo, hi = self.talker_context, self.prompt_end
        return self.context_rows[lo:hi][self.context_used[lo:hi]]

    def _talker_context_length(self, thinker_positions: int) -> int:
        """Talker cache rows holding the context of the first ``thinker_positions`` positions."""
        return int(self.context_used[:thinker_positions].sum())

    # ------------------------------------------------------------------ prompt text
    def _template_pieces(self) -> dict[str, list[int]]:
        """Token ids around the audio of a user turn, cut out of the checkpoint's own chat template."""
        tok = self.stack.tokenizer
        audio = self.chat_tokens["audio"]
        user = {"role": "user", "content": [{"type": "audio", "audio": "utterance"}]}
        system = {"role": "system", "content": self.system_prompt}
        first = tok.render_chat([system, user])
        later = tok.render_chat([system, user, {"role": "assistant", "content": _REPLY_MARK}, user])
        later = later[later.index(_REPLY_MARK) + len(_REPLY_MARK):]
        head_first, tail = first.split(audio)
        head_later, tail_later = later.split(audio)
        if tail_later != tail:
            raise ValueError("the chat template renders the end of a user turn differently in later turns")
        im_end = self.chat_tokens["im_end"]
        pieces = {"first_head": tok.encode(head_first), "later_head": tok.encode(head_later), "tail": tok.encode(tail)}
        # after a reply that stopped by itself its closing <|im_end|> is already in the cache
        pieces["later_head_closed"] = tok.encode(head_later[len(im_end):]) if head_later.startswith(im_end) \
            else pieces["later_head"]
        return pieces

    # ------------------------------------------------------------------ conversation
    def reset_conversation(self) -> None:
        self.thinker_cache.reset()
        self.talker_cache.reset()
        self.talker_context = 0
        self.ids: list[int] = []
        self.turn_starts: list[int] = []
        self.head_lengths: list[int] = []  # tokens of each turn's text prefix
        self.prompt_end = 0
        # The encoder outputs the thinker holds, kept so that dropping old turns can re-prefill the
        # rest without re-encoding: one entry (start, tokens) per run of consecutive audio
        # placeholders, in position order; entry (s, a) fills positions s .. s + len(a) - 1.
        # Invariant: the entries cover exactly the placeholders in ``ids`` (see _stored_audio).
        self._audio_store: list[tuple[int, torch.Tensor]] = []
        self._dropped = 0  # positions dropped from the front by cache-full re-prefills (maps marks)
        self.overflows: list[dict] = []  # cache-full drops not yet reported (the engine collects them)
        self._audio = np.zeros(0, dtype=np.float32)
        self._blocks_done = 0
        self._floor: float | None = None
        self._turn_open = False
        self._reply = None

    @property
    def thinker_cache_length(self) -> int:
        return self.thinker_cache.length

    def decode(self, text_ids: list[int]) -> str:
        return self.stack.tokenizer.decode(text_ids)

    def take_overflows(self) -> list[dict]:
        out, self.overflows = self.overflows, []
        return out

    @property
    def turn_prompt_ids(self) -> list[int]:
        return self.ids[self.turn_starts[-1]:self.prompt_end] if self.turn_starts else []

    def _prefill(self, ids: list[int], audio_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Append ids (audio placeholders filled from audio_tokens) to the thinker; returns the hidden states."""
        if not ids:
            return torch.zeros(0, self.thinker.embed_tokens.weight.shape[1], dtype=self.stack.dtype,
                               device=self.device)
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = self.thinker.embed(t, audio_tokens)
        start = self.thinker_cache.length
        hidden, rows, used = self._forward_thinker(t, embeds)
        self.context_rows[start:start + len(ids)] = rows
        self.context_used[start:start + len(ids)] = used
        used = 0  # embed checked that audio_tokens holds one row per placeholder
        for lo, hi in self._audio_runs(ids):
            self._audio_store.append((start + lo, audio_tokens[used:used + hi - lo]))
            used += hi - lo
        self.ids.extend(ids)
        self._last_hidden = hidden[-1]
        return hidden

    def _audio_runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """[lo, hi) index ranges of the runs of consecutive audio placeholders in ids."""
        audio_id = self.audio_token_id
        runs: list[tuple[int, int]] = []
        lo = None
        for i, x in enumerate(ids):
            if x == audio_id and lo is None:
                lo = i
            elif x != audio_id and lo is not None:
                runs.append((lo, i))
                lo = None
        if lo is not None:
            runs.append((lo, len(ids)))
        return runs

    def _stored_audio(self, lo: int, hi: int) -> torch.Tensor | None:
        """The stored encoder outputs of the audio placeholders at thinker positions [lo, hi), in order."""
        parts = [a[max(lo, s) - s:min(hi, s + a.shape[0]) - s] for s, a in self._audio_store
                 if s < hi and s + a.shape[0] > lo]
        return torch.cat(parts) if parts else None

    def begin_user_turn(self) -> None:
        if self._turn_open:
            raise RuntimeError("begin_user_turn: the previous user turn is still open")
        pieces = self._turn_pieces
        self._ensure_room(len(pieces["later_head"]) + self.block_tokens + len(pieces["tail"]),
                          fresh=len(pieces["first_head"]) + self.block_tokens + len(pieces["tail"]),
                          at="begin_user_turn")
        closed = bool(self.ids) and self.ids[-1] == self.im_end_id
        head = self._turn_pieces["first_head"] if not self.ids else \
            self._turn_pieces["later_head_closed" if closed else "later_head"]
        self.turn_starts.append(self.thinker_cache.length)
        self.head_lengths.append(len(head))
        self._prefill(head)
        self._audio = np.zeros(0, dtype=np.float32)
        self._blocks_done = 0
        self._floor = None
        self._turn_open = True
        self._turn_pending = True  # until the reply to this turn is finished or cut (abandon_turn)

    def _features(self) -> torch.Tensor:
        """Log-mel frames of the utterance so far, with the running dynamic-range floor.

        The reference's floor is (max over the whole utterance) - 8; while the user
        is still speaking we only know the max of the audio received so far, so
        blocks are encoded with the floor as it stands (it can only rise).  Given
        the whole utterance at once this is exactly the reference; streamed, it is
        identical unless an early block holds values 80 dB below a later peak.
        """
        wave = torch.from_numpy(self._audio)
        with stage("encoder"):
            raw = log_mel(wave, self.stack.features, floor=float("-inf"))
        # log_mel returns (log10 + 4) / 4; the floor applies to log10 values
        peak = float(raw.max()) * 4 - 4
        floor = peak - FLOOR_DB_RANGE if self._floor is None else max(self._floor, peak - FLOOR_DB_RANGE)
        self._floor = floor
        return torch.clamp(raw, min=(floor + 4) / 4)

    def _encode(self, frames: torch.Tensor, start: int) -> torch.Tensor:
        """Encode the block of feature frames that begins at frame ``start`` of the utterance."""
        with stage("encoder"):
            feats = frames.to(self.device, self.stack.dtype)
            # first: whether this block starts the utterance (Qwen3-Omni's encoder pads a short
            # last chunk only when earlier frames exist)
            return self.thinker.audio_encoder.encode_block(feats, first=start == 0)

    def add_user_audio(self, samples: np.ndarray) -> int:
        if not self._turn_open:
            raise RuntimeError("add_user_audio outside a user turn")
        self._audio = np.concatenate([self._audio, np.asarray(samples, dtype=np.float32)])
        added = 0
        margin = self.stack.features.n_fft // 2  # the STFT window of a block's last frame reaches past it
        feats = None
        while len(self._audio) >= (self._blocks_done + 1) * self.block_samples + margin:
            start = self._blocks_done * self.block_frames
            if feats is None:
                feats = self._features()
            tokens = self._encode(feats[:, start:start + self.block_frames], start)
            ids = [self.audio_token_id] * tokens.shape[0]
            self._ensure_room(len(ids) + len(self._turn_pieces["tail"]), at="add_user_audio")
            self._prefill(ids, tokens)
            self._blocks_done += 1
            added += len(ids)
        return added

    def end_user_turn(self) -> list[int]:
        if not self._turn_open:
            raise RuntimeError("end_user_turn without begin_user_turn")
        total_frames = num_frames(len(self._audio), self.stack.features)
        start = self._blocks_done * self.block_frames
        ids: list[int] = []
        tokens = None
        if total_frames > start:
            feats = self._features()
            # The rest can exceed one block by a frame or so: add_user_audio waits for the STFT
            # margin past a block, and the turn may end inside it.  Whole blocks first, then the
            # tail, as the one-shot encoder splits the utterance.
            parts = [self._encode(feats[:, lo:min(lo + self.block_frames, total_frames)], lo)
                     for lo in range(start, total_frames, self.block_frames)]
            tokens = torch.cat(parts) if len(parts) > 1 else parts[0]
            ids = [self.audio_token_id] * tokens.shape[0]
        ids += self._turn_pieces["tail"]
        self._ensure_room(len(ids) + 1, reserve=self._reply_room(), at="end_user_turn")
        self._prefill(ids, tokens)
        self._turn_open = False
        self.prompt_end = self.thinker_cache.length
        return self.ids[self.turn_starts[-1]:]

    def mark(self) -> Mark:
        return Mark(self.thinker_cache.length, self.talker_context, self._blocks_done, len(self._audio),
                    self._turn_open, self._floor, self.prompt_end, self._dropped)

    def _truncate_thinker(self, length: int) -> None:
        """Keep the first ``length`` thinker positions (pointer moves); the audio store follows,
        cutting a run of audio in two where ``length`` falls inside it."""
        self.thinker_cache.truncate(length)
        del self.ids[length:]
        while self._audio_store and self._audio_store[-1][0] >= length:
            self._audio_store.pop()
        if self._audio_store:
            s, a = self._audio_store[-1]
            if s + a.shape[0] > length:
                self._audio_store[-1] = (s, a[:length - s])

    def rollback(self, mark: Mark) -> None:
        """Undo everything since ``mark`` (a preemptive reply the user talked over): pointer moves.

        A cache-full re-prefill since the mark (the preemptive start's end_user_turn made room)
        stays: the dropped turns are gone for good and were reported; the mark's positions are
        mapped to the re-prefilled layout.  The open turn is never dropped, so they stay valid."""
        self._reply = None
        shift = self._dropped - mark.dropped
        length = min(self.thinker_cache.length, max(0, mark.thinker_length - shift))
        self._truncate_thinker(length)
        while self.turn_starts and self.turn_starts[-1] >= length:  # turns begun after the mark
            self.turn_starts.pop()
            self.head_lengths.pop()
        # the talker's context rows below ``length`` are still valid (causal); without a
        # re-prefill in between this is exactly the mark's talker context
        talker = mark.talker_context if shift == 0 else min(self.talker_context, length)
        self.talker_cache.truncate(min(self.talker_cache.length, self._talker_context_length(talker)))
        self.talker_context = talker
        self.prompt_end = min(length, max(0, mark.prompt_end - shift))
        self._blocks_done = mark.blocks_done
        self._audio = self._audio[:mark.audio_length]
        self._turn_open = mark.turn_open
        self._floor = mark.floor

    drop_headroom = 0.25  # fraction of the cache a cache-full drop leaves free (see _ensure_room)

    def max_turn_audio_s(self) -> float:
        """Seconds of one user turn that fit a fresh conversation with room for the reply: the user's
        audio at the encoder's token rate, after the turn's text and before the reply's share."""
        pieces = self._turn_pieces
        room = self.capacity - len(pieces["first_head"]) - len(pieces["tail"]) - 1 - self._reply_room()
        tokens_per_s = self.block_tokens / (self.block_samples / self.sample_rate_in)
        return max(0.0, room / tokens_per_s)

    def _reply_room(self) -> int:
        """Positions end_user_turn tries to leave free for the reply (so a full cache does not cut
        it short): a whole reply, but at most a quarter of the cache."""
        return min(self.max_reply_tokens, self.capacity // 4)

    def _ensure_room(self, n: int, fresh: int | None = None, reserve: int = 0, at: str = "") -> None:
        """Make room for n more thinker positions: drop the oldest turns and re-prefill the rest.

        The kept turns are re-read after the system prompt (the first kept turn takes the first
        turn's header); their audio comes from the stored encoder outputs, sliced by position.
        The talker context is rebuilt from the new prefill (the talker cache restarts empty and
        the next reply prefills its context rows).  Each drop is recorded in ``overflows``
        (``at``: the call that made room).  Between turns every earlier turn may go; the
        conversation then restarts empty and needs ``fresh`` positions.  ``reserve``: more room
        wanted where dropping turns can give it (the reply), not required.

        A drop leaves ``drop_headroom`` of the cache free beyond that where it can: each drop
        costs a prefill of the whole kept history, so once the cache is full it should come
        every few turns, not at every turn.
        """
        length = self.thinker_cache.length
        if length + n + reserve <= self.capacity:
            return
        headroom = int(self.capacity * self.drop_headroom)
        fresh = n if fresh is None else fresh
        # headroom and reply room never cost the whole conversation; only the turn's own need may
        k = self._drop_plan(n + reserve + headroom)
        if k is None and reserve:
            k = self._drop_plan(n + reserve)
        if k is None:
            if length + n <= self.capacity:
                return  # the reply gets the room there is
            k = self._drop_plan(n, fresh)
        if k is None:
            raise CacheFullError(f"this turn does not fit the thinker cache ({self.capacity} tokens) even "
                                 f"after dropping every earlier turn; use a larger context")
        self._drop_turns(k, at)

    def _drop_plan(self, need: int, need_fresh: int | None = None) -> int | None:
        """The fewest oldest turns to drop so that ``need`` more positions fit (``need_fresh``
        when every turn goes; None: keep at least one turn); None when no choice fits.  The open
        turn is never dropped."""
        length = self.thinker_cache.length
        first = len(self._turn_pieces["first_head"])
        droppable = len(self.turn_starts) - (1 if self._turn_open else 0)
        for k in range(1, droppable + 1):
            if k == len(self.turn_starts):  # everything (only between turns)
                if need_fresh is not None and need_fresh <= self.capacity:
                    return k
            elif first + length - (self.turn_starts[k] + self.head_lengths[k]) + need <= self.capacity:
                return k
        return None

    def _drop_turns(self, k: int, at: str) -> None:
        """Drop the oldest k turns and re-prefill the rest from ``ids`` and the stored audio."""
        length = self.thinker_cache.length
        first_head = self._turn_pieces["first_head"]
        if k < len(self.turn_starts):
            cut = self.turn_starts[k] + self.head_lengths[k]  # turn k keeps its audio and text, not its head
            shift = cut - len(first_head)  # old position p >= cut is now p - shift
            ids = first_head + self.ids[cut:]
            audio = self._stored_audio(cut, length)
            starts = [0] + [s - shift for s in self.turn_starts[k + 1:]]
            heads = [len(first_head)] + self.head_lengths[k + 1:]
            prompt_end = self.prompt_end - shift if self.prompt_end >= cut else 0  # else: its turn was dropped
        else:
            shift, ids, audio, starts, heads, prompt_end = length, [], None, [], [], 0
        n_audio = 0 if audio is None else audio.shape[0]
        if ids.count(self.audio_token_id) != n_audio:  # checked before anything changes
            raise RuntimeError(f"cache-full re-prefill: {ids.count(self.audio_token_id)} audio "
                               f"placeholders kept but {n_audio} stored audio tokens (bookkeeping bug)")
        self.thinker_cache.reset()
        self.talker_cache.reset()
        self.talker_context = 0
        self.ids, self._audio_store = [], []
        self._prefill(ids, audio)
        self.turn_starts, self.head_lengths = starts, heads
        self.prompt_end = prompt_end
        self._dropped += shift
        self.overflows.append({"at": at, "dropped_turns": k, "reprefilled_tokens": len(ids),
                               "cache_before": length, "cache_after": self.thinker_cache.length})

    def start_reply(self, voice: str | None = None, seed: int = 0) -> None:
        # one generator per stage: their draws do not depend on how the stages interleave
        # (the family's talker takes seed + 1)
        text_sampler = self.text_sampler
        text_sampler.generator.manual_seed(seed)
        text_sampler.reset()
        text_sampler.observe(self.ids)
        r = self.reply_state(text_sampler=text_sampler, feed=ReplyFeed(*self._feed_ends()))
        self._start_speech(r, voice, seed)
        self._reply = r
        logits = self.thinker.logits(self._last_hidden)
        r.next_token = guard_finite(logits, text_sampler.pick(logits))

    @property
    def thinker_done(self) -> bool:
        return self._reply is None or self._reply.thinker_done

    @property
    def talker_done(self) -> bool:
        return self._reply is None or self._reply.talker_done

    @property
    def pending_codes(self) -> int:
        return 0 if self._reply is None else len(self._reply.codes) - self._reply.vocoded

    @property
    def reply_text_ids(self) -> list[int]:
        return [] if self._reply is None else list(self._reply.text)

    @property
    def reply_codec_ids(self) -> list[int]:
        return [] if self._reply is None else list(self._reply.codes)

    def thinker_step(self) -> int | None:
        """Emit the chosen token; feed it to the thinker unless it ends the text; choose the next."""
        r = self._reply
        if r is None or r.thinker_done:
            return None
        token = read_token(r.next_token, "thinker")  # the step's one host sync: the last step's token
        r.text.append(token)
        if token in self.stop_ids or len(r.text) >= self.max_reply_tokens \
                or self.thinker_cache.length + 1 > self.capacity:
            r.thinker_done = True
            r.feed.finish()
            return token
        start = self.thinker_cache.reserve(1)
        self._pos.fill_(start)
        r.text_sampler.draw()
        hidden, row, r.next_token = self._thinker_decode_step(
            self._cache_arg(self.thinker_cache, start + 1), r.text_sampler, r.next_token, self._pos)
        self.thinker_cache.length = start + 1
        self.context_rows[start] = row
        self.context_used[start] = self._decode_used(token)
        self.ids.append(token)
        self._last_hidden = hidden
        if r.first_vector is None:  # the talker's prefill ends with it
            r.first_vector = row
        else:
            r.feed.push(row)
        return token

    def talker_step(self) -> int | None:
        """One talker step: the next code (codebook 0 where there are several), None while the
        thinker is behind or once the speech has ended."""
        r = self._reply
        if r is None or r.talker_done:
            return None
        if r.next_code is None:
            if r.first_vector is None:
                if r.thinker_done:  # the text ended before any reply token: nothing to say
                    r.talker_done = True
                return None
            self._start_talker()
        if not r.feed.ready:  # the thinker is behind: wait for the row this code is fed with
            return None
        code = read_token(r.next_code, "talker")  # the step's one host sync
        if code in self.talker_stop_ids or len(r.codes) >= self.max_codec_tokens:
            r.talker_done = True
            return None
        self._advance_talker(r, code)
        return code

    def _close_reply(self) -> None:
        # speech rows of this reply are not context: the next reply re-adds the reply's text rows
        # (where the family's talker reads them)
        self.talker_cache.truncate(self._talker_context_length(self.talker_context))
        self._reply = None
        self._turn_pending = False

    def abandon_turn(self) -> bool:
        """Forget a turn that failed part-way (pointer moves): the thinker goes back to where the
        turn began, the talker context to at most that.  If the failure left the bookkeeping
        inconsistent (it struck inside a cache-full re-prefill), the conversation is cleared."""
        self._reply = None
        self._turn_open = False
        self._audio = np.zeros(0, dtype=np.float32)
        self._blocks_done = 0
        self._floor = None
        length = self.thinker_cache.length
        if len(self.ids) != length or len(self.turn_starts) != len(self.head_lengths) \
                or (self.turn_starts and self.turn_starts[-1] > length):
            self.reset_conversation()
            self._turn_pending = False
            return False
        if getattr(self, "_turn_pending", False) and self.turn_starts:
            cut = self.turn_starts.pop()
            self.head_lengths.pop()
            self._truncate_thinker(cut)
            self._turn_pending = False
        length = self.thinker_cache.length
        self.talker_context = min(self.talker_context, length)
        self.talker_cache.truncate(min(self.talker_cache.length, self._talker_context_length(self.talker_context)))
        self.prompt_end = min(self.prompt_end, length)
        return True

    def finish_reply(self) -> None:
        r = self._reply
        if r is None:
            return
        if r.text and r.text[-1] == self.im_end_id and self.thinker_cache.length < self.capacity:
            # the closing <|im_end|> was chosen but never fed; with no room left the next turn's
            # header brings it instead
            self._prefill([self.im_end_id])
        self._close_reply()

    def kept_text_tokens(self, heard_samples: int) -> int:
        """Reply tokens the user heard (see the module docstring for the alignment)."""
        r = self._reply
        fed = self.thinker_cache.length - self.prompt_end
        if r is None or heard_samples <= 0 or fed <= 0:
            return 0
        tok = self.stack.tokenizer
        pieces = [len(tok.decode([t])) for t in r.text[:fed]]
        return heard_text_pieces(pieces, heard_samples, len(r.codes) * self.samples_per_code,
                                 r.talker_done, self.chars_per_second, self.sample_rate_out)

    def interrupt(self, heard_samples: int) -> Rollback:
        """Keep the heard part of the reply in the thinker cache; drop the rest (pointer moves).

        Interrupted before the reply began (still in the user's turn): the user's words stay,
        the reply is empty."""
        if self._turn_open:
            self.end_user_turn()
        before = self.thinker_cache.length
        kept = self.kept_text_tokens(heard_samples)
        after = self.prompt_end + kept
        self._truncate_thinker(after)
        self._close_reply()
        return Rollback(heard_samples=heard_samples, kept_text_tokens=kept, rolled_back_tokens=before - after,
                        thinker_cache_before=before, thinker_cache_after=after)




@dataclass
class Reply:
    """One turn run start to finish (:func:`run_turn`)."""

    prompt_ids: list[int]
    text_ids: list[int] = field(default_factory=list)
    codec_ids: list[int] = field(default_factory=list)  # one per talker step (codebook 0 where there are several)
    text: str = ""
    codec_frames: list[list[int]] = field(default_factory=list)  # every codebook per step, where there are several
    dropped_audio_s: float = 0.0  # the start of an utterance too long for the context, not heard (run_turn)


def run_turn(ex: ThinkerTalkerExecutor, waveform: torch.Tensor, voice: str | None = None, seed: int = 0,
             speak: bool = True) -> Reply:
    """One spoken turn without streaming: listen to the whole utterance, think to the end, then
    talk to the end (no audio).  The same executor the engine streams with, driven sequentially:
    used by ``omnidesk reply``, by the tests against transformers' ``generate`` and as the
    unstreamed run the streamed one must equal.  A failure raises
    :class:`~omnidesk.engine.executor.StageError` naming its stage.

    An utterance longer than the context holds is handled as a long conversation is: its oldest part is
    dropped and the newest that fits is heard (``Reply.dropped_audio_s`` says how much was dropped)."""
    audio = waveform.detach().cpu().float().numpy()
    keep = int(ex.max_turn_audio_s() * ex.sample_rate_in)
    dropped = max(0, audio.size - keep)
    with stage("thinker"):  # the encoder and the voice tag their own failures
        ex.begin_user_turn()
        ex.add_user_audio(audio[dropped:])
        reply = Reply(prompt_ids=list(ex.end_user_turn()), dropped_audio_s=dropped / ex.sample_rate_in)
        ex.start_reply(voice, seed)
        while not ex.thinker_done:
            ex.thinker_step()
    with stage("talker"):
        while speak and not ex.talker_done:
            ex.talker_step()
    reply.text_ids, reply.codec_ids = ex.reply_text_ids, ex.reply_codec_ids
    reply.codec_frames = getattr(ex, "reply_codec_frames", [])
    reply.text = ex.decode(reply.text_ids)
    return reply
