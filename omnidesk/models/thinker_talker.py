"""The turn-based executor every thinker-talker family shares: the conversation in a thinker's
KV cache, and the reply streamed from it.

Qwen2.5-Omni and Qwen3-Omni run the same conversation: the user's audio is
encoded block by block and prefilled while they speak, the reply is decoded
token by token, a talker speaks from what the thinker read and wrote, and an
interruption keeps only what the user heard.  The families differ in what the
talker reads (its context rows), how it makes speech codes and how they become
audio; :class:`ThinkerTalkerExecutor` keeps everything else, once: the
conversation between replies is its :class:`~omnidesk.models.thinker_conversation.ThinkerConversation`
part (the state kept across turns, the user's turn, rollback and cache-full drops),
one reply in flight a :class:`~omnidesk.models.thinker_reply.ReplyState`; this module
runs the reply (decode steps, thinker and talker steps, the end of a reply or its
interruption) and :func:`run_turn` drives a whole turn without streaming.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.executor import Executor, Rollback, stage
from .alignment import heard_text_pieces
from .kv_cache import KVCache, KVSpan
from .runner import DecodeRunner, resolve_mode
from .sampling import Sampler, SamplingParams, device_generator, sample
from .thinker_conversation import ThinkerConversation
from .thinker_reply import ReplyFeed, ReplyState, guard_finite, read_token

# A typical conversational speaking rate, used only until the talker has finished a reply.
DEFAULT_CHARS_PER_SECOND = 14.0


def generation_defaults(g: dict) -> SamplingParams:
    """Sampling from a generation_config.json dict; greedy when it does not sample."""
    if not g.get("do_sample", False):
        return SamplingParams(greedy=True, repetition_penalty=float(g.get("repetition_penalty", 1.0)))
    return SamplingParams(temperature=float(g.get("temperature", 1.0)), top_k=int(g.get("top_k", 0) or 0),
                          top_p=float(g.get("top_p", 1.0)), repetition_penalty=float(g.get("repetition_penalty", 1.0)))


class ThinkerTalkerExecutor(ThinkerConversation, Executor):
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

    def _talker_prefill(self, rows: torch.Tensor) -> None:
        """Append context rows [N, talker_width] to the talker's cache (its forward over them; what it
        says about them is not needed)."""
        self.talker(rows, self.talker_cache)

    def _unread_context(self, end: int | None = None) -> torch.Tensor:
        """The talker rows of thinker positions ``[talker_context, end)`` (default ``prompt_end``) it
        reads, i.e. what the talker has not read yet; cuts the talker cache back to its context first.
        The caller prefills them and sets ``talker_context = end``."""
        self.talker_cache.truncate(self._talker_context_length(self.talker_context))
        lo, hi = self.talker_context, self.prompt_end if end is None else end
        return self.context_rows[lo:hi][self.context_used[lo:hi]]

    # ------------------------------------------------------------------ the reply
    def decode(self, text_ids: list[int]) -> str:
        return self.stack.tokenizer.decode(text_ids)

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
