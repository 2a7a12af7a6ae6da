"""The conversation in a thinker's KV cache, across turns: what a thinker-talker executor listens with.

:class:`ThinkerConversation` is the part of
:class:`~omnidesk.models.thinker_talker.ThinkerTalkerExecutor` that holds the conversation
between replies: the user's turns (their chat-template text, their audio encoded block by
block and prefilled while they speak), the talker's context, and what a full cache, a
rollback or a failed turn does to them.  Pointer moves throughout: nothing is recomputed
except where a full cache drops old turns.

State kept across turns (all preallocated, truncated by pointer):

* the thinker KV cache, the ids it holds (``ids``) and, for every thinker
  position, the talker's context row and whether the talker reads it
  (``context_rows`` / ``context_used``: the family decides both in
  :meth:`~omnidesk.models.thinker_talker.ThinkerTalkerExecutor._forward_thinker`);
* the talker KV cache: its first rows are the used context rows of thinker
  positions ``[0, talker_context)``; the speech rows of a reply are appended
  after them and dropped when the reply ends; the talker reads the rows added
  since block by block while the user speaks, so a reply prefills only the
  turn's last rows;
* the encoder outputs of every audio placeholder the thinker holds, by
  position (``_audio_store``), truncated with it.  When the cache is full the
  oldest turns are dropped and the rest re-prefilled from ``ids`` and these
  (``_ensure_room``): a full prefill, leaving ``drop_headroom`` free so that it
  comes every few turns; each drop is reported (``take_overflows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engine.executor import stage
from ..features import log_mel, num_frames
from .kv_cache import CacheFullError

# Marks where an assistant reply's text sits when the chat template is rendered to find the
# text between turns; never tokenized.
_REPLY_MARK = "\x00omnidesk-reply\x00"
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


class ThinkerConversation:
    """The conversation state of a thinker-talker executor and the calls that change it between
    replies: the user's turn (``begin_user_turn`` / ``add_user_audio`` / ``end_user_turn``),
    ``mark`` / ``rollback``, ``reset_conversation`` and the cache-full drops (module docstring).

    A mixin of :class:`~omnidesk.models.thinker_talker.ThinkerTalkerExecutor`, which sets what
    it reads (``stack``, ``thinker``, ``device``, ``capacity``, ``max_reply_tokens``,
    ``system_prompt``, ``chat_tokens``, ``audio_token_id``, ``im_end_id``, ``block_frames`` /
    ``block_samples`` / ``block_tokens``, ``sample_rate_in``, the caches and context rows) and
    runs the thinker (``_forward_thinker``); ``_reply`` is the reply in flight, which a
    rollback or a drop forgets."""

    drop_headroom = 0.25  # fraction of the cache a cache-full drop leaves free (see _ensure_room)

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
            self._talker_reads_turn()
            self._blocks_done += 1
            added += len(ids)
        return added

    def _talker_reads_turn(self) -> None:
        """The talker reads the context rows the thinker holds beyond what it has read, while the user
        speaks: block by block, as the thinker prefills them, so a reply's start prefills only the rows
        of the turn's end.  On the CPU demo (a 3 s turn) the talker's prefill at a reply's start went
        from 6.2-6.8 ms to 2.8-2.9, all of it on the way to the first audio.  The talker reads the same
        rows in the same pieces however the audio arrives (whole blocks), so a streamed turn and a
        one-shot one (run_turn) stay identical.  Not while a reply holds the talker's cache (its speech
        rows follow the context)."""
        if self._reply is not None:
            return
        end = self.thinker_cache.length
        rows = self._unread_context(end)
        if rows.shape[0]:
            with stage("talker"):
                self.talker_cache.reserve(rows.shape[0])
                self._talker_prefill(rows)
        self.talker_context = end

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
