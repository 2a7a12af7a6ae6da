"""token2wav: codec tokens -> 24 kHz waveform, offline or streaming.

Two stages: the DiT turns codes into mel frames by flow matching (dit.py),
BigVGAN turns mel frames into samples (bigvgan.py).

Streaming (:class:`VocoderStream`) follows the published recipe for this
model: the DiT makes mel in chunks of ``chunk_frames`` (72), each computed
on a window that adds ``past_frames`` (48) of look-back and
``future_frames`` (24) of look-ahead; the first chunks are smaller and the
first one is made with a coarser flow, to cut time to first audio (see
:class:`StreamingPlan`).  All sizes are multiples of the DiT block (24
frames) so every window starts on a block boundary.

What is exact and what is not:

* ODE noise is a fixed function of (seed, absolute mel frame): streaming and
  offline integrate from the same initial state.
* BigVGAN runs on the concatenated mel with its full left context; on the
  right it waits only ``vocoder_lookahead_frames`` (12) of the 34 frames its
  convolutions formally reach, and treats the rest as the utterance end (zero
  padding).  The far frames weigh almost nothing (measured in the tests), and
  waiting for all 34 would add 340 ms to the first audio.
* The DiT windows are an approximation by design: one velocity evaluation
  reaches ``reach_back``/``reach_ahead`` blocks, and the ODE chains 36 of them,
  so a window cannot hold the whole dependency.  The deviation from offline is
  measured in tests/test_vocoder.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .bigvgan import BigVGAN, BigVGANConfig
from ..checkpoint import ConfigError
from .dit import DEFAULT_GUIDANCE_SCALE, DEFAULT_NUM_STEPS, DEFAULT_SWAY_COEFFICIENT, DiT, DiTConfig

# Multiplier that spreads block seeds apart (any large odd constant works).
_BLOCK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class StreamingPlan:
    """Chunking in mel frames (100/s).  DiT: the published recipe (chunk 72, past 48,
    future 24) in steady state, after a first chunk made for an early start:

    * the first chunk (48 frames) has no DiT look-ahead and is integrated with
      ``first_flow_steps`` ODE points: it needs 24 codes, not 36, and a third of the flow's
      velocity evaluations, so on the CPU demo the first audio comes ~150 ms after the
      talker starts instead of ~240-280 ms;
    * then ``ramp_frames`` chunks (48), then ``chunk_frames`` (72).  Each is due only once
      the audio before it is playing.  Smaller first chunks were tried: a 24-frame one comes
      at ~100-115 ms but the next chunk's DiT window costs as much as a whole chunk, so on
      this CPU playback ran dry unless it waited until ~180-390 ms (tests/test_vocoder.py,
      bench/live_latency.py).  Again with BigVGAN's fused stages (one core, whole pipeline,
      no devices): 24 frames first at 66 ms but gapless only from 105 ms; this plan 92 ms, and
      77 ms with the DiT step and BigVGAN's activations compiled (the executor's compile mode).

    * BigVGAN renders the first chunk in two pieces: its first ``first_audio_frames`` (12: 120 ms)
      on a window of those plus its look-ahead (24 frames), returned alone, and the rest (240 ms)
      at the next push, on the whole chunk as before.  The first audio comes after half of the
      first chunk's BigVGAN time (CPU demo, compiled, one core: 57 instead of 70 ms after the
      reply's start); the two windows cost BigVGAN 24 more frames once, inside the 120 ms the
      first piece plays.  A 6-frame piece saved ~2 ms more (BigVGAN's fixed cost per call) and ran
      dry on half a core.

    What this costs: the first 360 ms of audio (the first chunk minus BigVGAN's look-ahead)
    come from a coarser ODE grid and see no DiT look-ahead, and its first 120 ms see 12 frames of
    mel ahead instead of 12-36; everything after them is made as with the published recipe, and
    from 120 ms on the samples are those of the plan without the split, bit for bit
    (tests/test_vocoder.py measures both).  Set ``first_chunk_frames=48, first_future_frames=None,
    first_flow_steps=None, ramp_frames=(), first_audio_frames=None`` for the previous plan (first
    audio after 36 codes, every chunk from the full flow, rendered whole)."""

    chunk_frames: int = 72
    past_frames: int = 48
    future_frames: int = 24
    first_chunk_frames: int = 48
    vocoder_lookahead_frames: int = 12
    first_future_frames: int | None = 0  # the first chunk's DiT look-ahead (None: future_frames)
    first_flow_steps: int | None = 4  # the first chunk's ODE time points (None: the vocoder's, 10)
    ramp_frames: tuple[int, ...] = (48,)  # chunks between the first and the steady chunk_frames
    first_audio_frames: int | None = 12  # the first chunk's first piece of audio (None: the chunk whole)

    def chunk_size(self, index: int) -> int:
        """Mel frames of chunk ``index`` (0 = the first)."""
        if index == 0:
            return self.first_chunk_frames
        if index <= len(self.ramp_frames):
            return self.ramp_frames[index - 1]
        return self.chunk_frames

    def future(self, index: int) -> int:
        if index == 0 and self.first_future_frames is not None:
            return self.first_future_frames
        return self.future_frames

    def check(self, block: int) -> None:
        if not 0 <= self.vocoder_lookahead_frames <= self.first_chunk_frames:
            raise ValueError(f"StreamingPlan.vocoder_lookahead_frames={self.vocoder_lookahead_frames} must be in "
                             f"[0, first_chunk_frames]")
        sizes = [("chunk_frames", self.chunk_frames), ("past_frames", self.past_frames),
                 ("future_frames", self.future_frames), ("first_chunk_frames", self.first_chunk_frames)]
        sizes += [(f"ramp_frames[{i}]", v) for i, v in enumerate(self.ramp_frames)]
        if self.first_future_frames is not None:
            sizes.append(("first_future_frames", self.first_future_frames))
        for name, value in sizes:
            positive = name in ("chunk_frames", "first_chunk_frames") or name.startswith("ramp")
            if value < 0 or value % block or (value == 0 and positive):
                raise ValueError(f"StreamingPlan.{name}={value} must be a positive multiple of the DiT block "
                                 f"({block} mel frames)")
        if self.first_audio_frames is not None and self.first_audio_frames <= 0:
            raise ValueError(f"StreamingPlan.first_audio_frames={self.first_audio_frames} must be positive (or None)")
        if self.first_flow_steps is not None and self.first_flow_steps < 2:
            raise ValueError(f"StreamingPlan.first_flow_steps={self.first_flow_steps} must be >= 2")


@dataclass(frozen=True)
class VoiceCondition:
    """What the vocoder needs of a voice: its speaker vector and speaker-encoder features."""

    cond: torch.Tensor
    features: tuple[torch.Tensor, torch.Tensor]


class Token2Wav(nn.Module):
    """DiT + BigVGAN, always run in fp32 (as the reference does)."""

    def __init__(self, token2wav_config: dict):
        super().__init__()
        if not isinstance(token2wav_config, dict):
            raise ConfigError("config.json: missing token2wav_config")
        try:
            dit_cfg = token2wav_config["dit_config"]
            bigvgan_cfg = token2wav_config["bigvgan_config"]
        except KeyError as e:
            raise ConfigError(f"token2wav_config: missing field {e}") from None
        self.dit = DiT(DiTConfig.from_dict(dit_cfg))
        self.bigvgan = BigVGAN(BigVGANConfig.from_dict(bigvgan_cfg))
        self.num_steps = DEFAULT_NUM_STEPS
        self.guidance_scale = DEFAULT_GUIDANCE_SCALE
        self.sway_coefficient = DEFAULT_SWAY_COEFFICIENT

    @property
    def repeats(self) -> int:
        return self.dit.cfg.repeats

    @property
    def hop_length(self) -> int:
        return self.bigvgan.hop_length

    @property
    def codec_table_size(self) -> int:
        """Codec ids 0 .. size-1 are what the DiT's codec embedding holds (num_embeds + 1 rows)."""
        return self.dit.cfg.num_embeds + 1

    def voice(self, cond: torch.Tensor, ref_mel: torch.Tensor) -> VoiceCondition:
        w = self.dit.proj_out.weight
        return VoiceCondition(cond.to(w.device, w.dtype), self.dit.speaker_features(ref_mel))

    def noise(self, seed: int, start: int, end: int) -> torch.Tensor:
        """Initial ODE state for mel frames [start, end): a fixed function of (seed, frame)."""
        block = self.dit.cfg.block_size
        mel_dim = self.dit.cfg.mel_dim
        parts = []
        for b in range(start // block, (end + block - 1) // block):
            g = torch.Generator().manual_seed(seed * _BLOCK_SEED_STRIDE + b)
            parts.append(torch.randn(block, mel_dim, generator=g))
        first = (start // block) * block
        noise = torch.cat(parts)[start - first:end - first]
        return noise.to(self.dit.proj_out.weight.device)

    def mel(self, codes: torch.Tensor, voice: VoiceCondition, noise: torch.Tensor,
            num_steps: int | None = None, flow=None) -> torch.Tensor:
        """codes [n] -> mel [mel_dim, n * repeats] with the given initial state (``flow``: the decode
        runner's compiled :meth:`DiT.solve_step`, or None)."""
        return self.dit.sample(codes, voice.cond, None, noise, num_steps=num_steps or self.num_steps,
                               guidance_scale=self.guidance_scale, sway_coefficient=self.sway_coefficient,
                               speaker_feats=voice.features, step=flow)

    @torch.no_grad()
    def offline(self, codes: torch.Tensor, voice: VoiceCondition, seed: int = 0,
                noise: torch.Tensor | None = None) -> torch.Tensor:
        """The whole reply at once (the reference's way): codes [n] -> waveform [n * repeats * hop]."""
        if codes.numel() == 0:
            return torch.zeros(0)
        n = codes.numel() * self.repeats
        if noise is None:
            noise = self.noise(seed, 0, n)
        return self.bigvgan(self.mel(codes.to(noise.device), voice, noise)).reshape(-1).float()

    def stream(self, voice: VoiceCondition, seed: int = 0, plan: StreamingPlan | None = None,
               flow=None, activation=None) -> "VocoderStream":
        """``flow``, ``activation``: the decode runner's compiled DiT solve step and BigVGAN activation
        (:meth:`mel`, :meth:`BigVGAN.forward`), or None (eager)."""
        return VocoderStream(self, voice, seed, plan or StreamingPlan(), flow, activation)


class VocoderStream:
    """Codec tokens in, waveform chunks out, for one reply.

    ``push(codes)`` returns the chunks that became ready (the first chunk's first piece
    alone: whatever else its codes complete comes at the next push, see
    ``StreamingPlan.first_audio_frames``); ``flush()`` when the talker stopped (or the
    reply was cut short) returns the rest; ``reset()`` starts a new reply.  Chunks are
    1-D float32 tensors at 24 kHz.
    """

    def __init__(self, t2w: Token2Wav, voice: VoiceCondition, seed: int, plan: StreamingPlan, flow=None,
                 activation=None):
        plan.check(t2w.dit.cfg.block_size)
        self.t2w, self.voice, self.seed, self.plan = t2w, voice, seed, plan
        self.flow, self.activation = flow, activation
        self.left_ctx, _ = t2w.bigvgan.context_frames()
        self.right_ctx = plan.vocoder_lookahead_frames
        self.reset()

    def reset(self) -> None:
        self.codes: list[int] = []
        self.chunks_made = 0  # DiT chunks so far (the plan's ramp counts them)
        self.mel_done = 0  # mel frames made by the DiT so far
        self.audio_done = 0  # mel frames whose samples were emitted
        self._mel = torch.zeros(self.t2w.dit.cfg.mel_dim, 0, device=self.t2w.dit.proj_out.weight.device)
        self._mel_start = 0  # absolute frame of self._mel[:, 0]
        self.finished = False

    @property
    def samples_emitted(self) -> int:
        return self.audio_done * self.t2w.hop_length

    def _next_chunk_end(self) -> int:
        return self.mel_done + self.plan.chunk_size(self.chunks_made)

    def _make_mel(self, end: int, window_end: int) -> None:
        """DiT on [mel_done - past, window_end), keeping frames [mel_done, end)."""
        r = self.t2w.repeats
        start = max(0, self.mel_done - self.plan.past_frames)
        codes = torch.tensor(self.codes[start // r:(window_end + r - 1) // r], dtype=torch.long,
                             device=self._mel.device)
        window_end = codes.numel() * r + start
        steps = self.plan.first_flow_steps if self.chunks_made == 0 else None
        mel = self.t2w.mel(codes, self.voice, self.t2w.noise(self.seed, start, window_end), num_steps=steps,
                           flow=self.flow)
        self._mel = torch.cat([self._mel, mel[:, self.mel_done - start:end - start]], dim=1)
        self.mel_done = end
        self.chunks_made += 1

    def _emit_audio(self, until: int, at_end: bool) -> torch.Tensor | None:
        """Samples for mel frames [audio_done, until): full left context, ``right_ctx`` frames on the right."""
        if until <= self.audio_done:
            return None
        lo = max(0, self.audio_done - self.left_ctx)
        hi = self.mel_done if at_end else min(self.mel_done, until + self.right_ctx)
        window = self._mel[:, lo - self._mel_start:hi - self._mel_start]
        left = self.audio_done - lo
        right = hi - until
        samples = self.t2w.bigvgan.forward_window(window, left, right, self.activation).reshape(-1).float()
        self.audio_done = until
        # Drop mel that no future window can need (memory stays flat in long replies).
        keep_from = max(0, self.audio_done - self.left_ctx)
        if keep_from > self._mel_start:
            self._mel = self._mel[:, keep_from - self._mel_start:]
            self._mel_start = keep_from
        return samples

    @torch.no_grad()
    def push(self, codes) -> list[torch.Tensor]:
        if self.finished:
            raise RuntimeError("VocoderStream.push after flush; call reset() for a new reply")
        new = [int(c) for c in ([codes] if isinstance(codes, int) else codes)]
        table = self.t2w.codec_table_size
        bad = [c for c in new if not 0 <= c < table]
        if bad:  # an embedding lookup past the table would only say "index out of range"
            raise ValueError(f"codec id {bad[0]} is outside the vocoder's codec table (0..{table - 1})")
        self.codes.extend(new)
        return self._ready_chunks()

    def _ready_chunks(self) -> list[torch.Tensor]:
        """What the codes so far complete: the rest of a chunk split in two, then every whole chunk,
        unless the first chunk's first piece goes out (then it alone)."""
        available = len(self.codes) * self.t2w.repeats
        chunks = []
        rest = self._emit_audio(self.mel_done - self.right_ctx, at_end=False)
        if rest is not None:
            chunks.append(rest)
        while True:
            end = self._next_chunk_end()
            future = self.plan.future(self.chunks_made)
            if available < end + future:
                break
            self._make_mel(end, end + future)
            until = self.mel_done - self.right_ctx
            split = self.audio_done == 0 and self.plan.first_audio_frames is not None \
                and self.plan.first_audio_frames < until
            out = self._emit_audio(self.plan.first_audio_frames if split else until, at_end=False)
            if out is not None:
                chunks.append(out)
            if split:  # the first audio goes out alone, now; the rest of the chunk at the next push
                break
        return chunks

    @torch.no_grad()
    def flush(self) -> list[torch.Tensor]:
        """The reply ended (or was cut short): make and emit everything left.  Chunks the codes
        complete come out as :meth:`push` would have made them, so the audio does not depend on
        how the codes were handed over."""
        chunks = []
        while ready := self._ready_chunks():
            chunks += ready
        total = len(self.codes) * self.t2w.repeats
        while self.mel_done < total:
            end = min(self._next_chunk_end(), total)
            self._make_mel(end, min(end + self.plan.future(self.chunks_made), total))
        out = self._emit_audio(self.mel_done, at_end=True)
        if out is not None:
            chunks.append(out)
        self.finished = True
        return chunks
