"""Qwen2.5-Omni executor: the shared thinker conversation plus this family's talker and vocoder.

The conversation (turns, audio blocks, rollback, cache-full drops, heard-text
alignment) is :class:`~omnidesk.models.thinker_talker.ThinkerTalkerExecutor`.
What is Qwen2.5-Omni's own:

* the talker reads every thinker position: thinker hidden + input embedding,
  the embedding zeroed at audio positions (what the reference feeds it), and
  each reply position the same way, one per codec step;
* its prompt ends with the voice's bos embedding + codec pad, then the first
  reply row + codec bos; a voice is a ``spk_dict.pt`` entry (bos token and the
  vocoder's conditioning);
* one codec token per step (50 Hz), turned into audio by the DiT + BigVGAN
  vocoder in overlapping chunks (:class:`~.vocoder.StreamingPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...engine.executor import stage
from ..omni_executor import executor_with_limits
from ..sampling import Sampler, SamplingParams, device_generator, sample
from ..thinker_talker import (DEFAULT_CHARS_PER_SECOND, ReplyState, ThinkerTalkerExecutor, generation_defaults,
                              guard_finite)
from .loading import OmniStack
from .reply import SPEECH_SYSTEM_PROMPT, talker_defaults, thinker_stop_ids
from .tokenizer import SPECIAL_TOKENS
from .vocoder import StreamingPlan


# The demo's replies when the caller sets no limits: about 6 s of speech (50 codes per second).
DEMO_LIMITS = {"max_reply_tokens": 48, "max_codec_tokens": 300}


def thinker_defaults(stack: OmniStack) -> SamplingParams:
    """The checkpoint's generation_config.json for the thinker; greedy when it has none."""
    return generation_defaults(stack.generation_config)


def _activation_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch rows for compiling ``SnakeResample``: channels and length marked dynamic, so one graph
    serves every stage and window (sizes > 1 and unlike each other, or dynamo would tie them)."""
    x, alpha, inv_beta = torch.randn(1, 6, 50), torch.ones(1, 6, 1), torch.ones(1, 6, 1)
    for t, dims in ((x, (1, 2)), (alpha, (1,)), (inv_beta, (1,))):
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
    return x, alpha, inv_beta


@dataclass(eq=False)
class QwenReply(ReplyState):
    bos_embed: torch.Tensor | None = None  # the voice's bos token embedding: opens the talker's speech


class QwenOmniExecutor(ThinkerTalkerExecutor):
    reply_state = QwenReply
    family = "qwen2_5_omni"

    def __init__(self, stack: OmniStack, capacity: int = 4096, max_reply_tokens: int = 512,
                 max_codec_tokens: int = 4096, system_prompt: str = SPEECH_SYSTEM_PROMPT,
                 thinker_sampling: SamplingParams | None = None, talker_sampling: SamplingParams | None = None,
                 plan: StreamingPlan | None = None, chars_per_second: float = DEFAULT_CHARS_PER_SECOND,
                 compile: str | None = None):
        if stack.talker is None:
            raise ValueError(f"{stack.path}: this checkpoint has no talker (enable_audio_output is false)")
        self.stack = stack
        self.cfg = stack.config
        self.thinker, self.talker, self.vocoder = stack.thinker, stack.talker, stack.vocoder
        self.audio_token_id = self.cfg.thinker.audio_token_id
        self.chat_tokens = {"audio": SPECIAL_TOKENS["audio"], "im_end": SPECIAL_TOKENS["im_end"]}
        self.stop_ids = set(thinker_stop_ids(stack))
        self.talker_stop_ids = set(self.cfg.talker.stop_ids)
        self.max_codec_tokens = max_codec_tokens
        self.talker_sampling = talker_sampling or talker_defaults(stack)
        self.plan = plan or StreamingPlan()
        self.sample_rate_out = self.vocoder.hop_length * 100  # 100 mel frames per second
        self.samples_per_code = self.vocoder.hop_length * self.vocoder.repeats
        self.talker_width = self.cfg.thinker.text.hidden_size  # the talker reads thinker-space rows
        self.talker_cache = self.talker.new_cache(capacity + max_codec_tokens + 2)
        self._voice_cache: dict[str, object] = {}
        tcfg = self.cfg.talker
        # allocated once (re-seeded and cleared per reply) so a captured talker step keeps its buffers
        self.codec_sampler = Sampler(self.talker_sampling, tcfg.decoder.vocab_size, stack.device,
                                     device_generator(stack.device))
        with torch.inference_mode(False):
            self._talker_pos = torch.zeros(1, dtype=torch.long, device=stack.device)
        self._setup(capacity, max_reply_tokens, system_prompt, thinker_sampling or thinker_defaults(stack),
                    chars_per_second, compile)

    # ------------------------------------------------------------------ what the talker reads
    def _forward_thinker(self, ids, embeds):
        hidden = self.thinker(embeds, self.thinker_cache)
        is_audio = (ids == self.audio_token_id)[:, None]
        rows = hidden + embeds.masked_fill(is_audio, 0.0)
        return hidden, rows, torch.ones(ids.shape[0], dtype=torch.bool, device=self.device)

    def _decode_thinker(self, embeds, cache, input_pos):
        hidden = self.thinker.forward_static(embeds, cache, input_pos)
        return hidden, hidden + embeds  # a reply token is text: its embedding counts

    def _register_steps(self) -> None:
        for decoder, cache in ((self.thinker.decoder, self.thinker_cache), (self.talker.decoder, self.talker_cache)):
            decoder.rotary.table(cache.capacity, self.stack.dtype)  # grown here, not inside a compiled step
        row = torch.zeros(self.talker_width, dtype=self.stack.dtype, device=self.device)
        self._talker_decode_step = self.runner.step(
            "talker", self._talker_decode,
            lambda: self._example(self.talker_cache, self.codec_sampler, (row.clone(),)))
        # The vocoder's hot parts, compiled once for every window length (marked dynamic): the DiT's RK4
        # step (DiT.solve_step: its time nearly halves on the demo) and BigVGAN's anti-aliased activations
        # (bigvgan.SnakeResample: a quarter of its time), until ready eager
        self._flow_step = self._activation_step = None
        if self.runner.mode == "compile" and self.device.type == "cpu":
            self._flow_step = self.runner.step("vocoder_flow", self.vocoder.dit.solve_step, self._flow_example)
            self._activation_step = self.runner.step("vocoder_activation", self.vocoder.bigvgan.snake_resample(),
                                                     _activation_example, cpp_wrapper=False)  # slower in C++ (runner)

    def _talker_decode(self, cache, sampler: Sampler, code: torch.Tensor, reply_row: torch.Tensor,
                       input_pos: torch.Tensor) -> torch.Tensor:
        """The talker's decode step: the last code [1] + the next reply row [W] at input_pos [1] -> the
        next code [1], chosen and marked in ``sampler``."""
        x = self.talker.codec_embed(code) + reply_row
        logits = self.talker.forward_static(x, cache, input_pos)[-1]
        nxt = sample(logits, sampler.params, sampler.seen, sampler.noise, sampler.suppress)
        sampler.mark(nxt)
        return guard_finite(logits, nxt)

    def _flow_example(self) -> tuple:
        """Scratch inputs for compiling the DiT's RK4 step: 72 frames (3 blocks), marked dynamic (a
        length unlike the model's widths, or dynamo would tie them)."""
        t2w, cfg, n = self.vocoder, self.vocoder.dit.cfg, 72
        code = torch.zeros(n // t2w.repeats, dtype=torch.long, device=self.device)
        x = t2w.noise(0, 0, n)
        feat = torch.zeros(cfg.enc_dim, device=self.device)  # a voice's shapes (the real ones need the encoder)
        inputs = t2w.dit._conditioning(code, torch.zeros(cfg.enc_emb_dim, device=self.device), (feat, feat),
                                       t2w.guidance_scale)
        code_embed, spk, feats, cos, sin, masks = inputs
        for t, dims in ((x, (0,)), (code_embed, (1,)), (cos, (0,)), (sin, (0,)), *((m, (0, 1)) for m in masks)):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        times = t2w.dit.time_points(4, t2w.sway_coefficient, device=x.device)
        return (x, times[0], times[1], *inputs, t2w.guidance_scale)

    def _feed_ends(self):
        w, tcfg = self.thinker.embed_tokens.weight, self.cfg.talker
        return w[tcfg.text_eos_id], w[tcfg.text_pad_id]

    # ------------------------------------------------------------------ reply, talker side
    def _voice(self, name: str | None):
        name = name or self.stack.default_voice
        if name not in self.stack.voices:
            raise KeyError(f"voice '{name}' is not in {self.stack.path / 'spk_dict.pt'} "
                           f"(have: {', '.join(self.stack.voices)})")
        if name not in self._voice_cache:
            v = self.stack.voices[name]
            self._voice_cache[name] = self.vocoder.voice(v.cond, v.ref_mel)
        return name, self._voice_cache[name]

    def _start_speech(self, r: "QwenReply", voice: str | None, seed: int) -> None:
        with stage("voice"):
            name, vcond = self._voice(voice)
        tcfg = self.cfg.talker
        codec_sampler = self.codec_sampler
        codec_sampler.generator.manual_seed(seed + 1)
        codec_sampler.reset()
        codec_sampler.observe([tcfg.codec_mask_id, tcfg.codec_pad_id, tcfg.codec_bos_id])
        r.voice, r.codec_sampler = name, codec_sampler
        r.bos_embed = self.thinker.embed_tokens.weight[self.stack.voices[name].bos_token]
        with stage("vocoder"):
            r.stream = self.vocoder.stream(vcond, seed=seed, plan=self.plan, flow=self._flow_step,
                                           activation=self._activation_step)

    def _start_talker(self) -> None:
        """Prefill the talker: context rows added since the last reply, then voice bos + first reply row."""
        r = self._reply
        tcfg = self.cfg.talker
        new_rows = self._unread_context()
        self.talker_cache.reserve(new_rows.shape[0] + 2)
        speech = torch.stack([r.bos_embed + self.talker.codec_embed(tcfg.codec_pad_id),
                              r.first_vector + self.talker.codec_embed(tcfg.codec_bos_id)])
        logits = self.talker(torch.cat([new_rows, speech]), self.talker_cache)
        self.talker_context = self.prompt_end
        r.talker_logits = logits[-1]
        r.next_code = guard_finite(r.talker_logits, r.codec_sampler.pick(r.talker_logits))

    def _advance_talker(self, r: "QwenReply", code: int) -> None:
        r.codes.append(code)
        start = self.talker_cache.reserve(1)
        self._talker_pos.fill_(start)
        r.codec_sampler.draw()
        r.next_code = self._talker_decode_step(self._cache_arg(self.talker_cache, start + 1), r.codec_sampler,
                                               r.next_code, r.feed.next(), self._talker_pos)
        self.talker_cache.length = start + 1

    def vocoder_step(self, final: bool = False) -> list[np.ndarray]:
        r = self._reply
        if r is None:
            return []
        stream = r.stream
        new = r.codes[r.vocoded:]
        r.vocoded = len(r.codes)
        chunks = stream.push(new) if new else []
        if final:
            chunks += stream.flush()
        return [c.cpu().numpy() for c in chunks]


def executor_for(stack: OmniStack, greedy: bool = False, max_text_tokens: int | None = None,
                 max_codec_tokens: int | None = None, compile: str | None = None) -> QwenOmniExecutor:
    """The executor every front end (talk, live, the window) uses for a loaded stack.

    The demo model rarely says "stop" (it is untrained), so its replies are capped
    at about 6 s unless the caller sets limits."""
    from .demo import is_demo

    return executor_with_limits(QwenOmniExecutor, stack, talker_defaults(stack, greedy=greedy),
                                DEMO_LIMITS if is_demo(stack.config.raw) else None, greedy, max_text_tokens,
                                max_codec_tokens, compile)
