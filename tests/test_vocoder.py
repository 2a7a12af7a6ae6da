"""token2wav: offline vs transformers, streaming vs offline, flush / reset / empty / cut short."""

from dataclasses import replace

import pytest
import torch

from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.vocoder import StreamingPlan

import tiny


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    path, ref = tiny_checkpoints("a")
    return load_stack(path), ref


def _codes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.CODEC_VOCAB - 6, (n,), generator=g)


def _voice(stack, name="Chelsie"):
    v = stack.voices[name]
    return stack.vocoder.voice(v.cond, v.ref_mel)


@torch.inference_mode()
def test_offline_matches_transformers_token2wav(loaded):
    stack, ref = loaded
    codes = _codes(57)
    v = stack.voices["Ethan"]
    torch.manual_seed(11)
    ref_wave = ref.token2wav(codes[None], conditioning=v.cond[None], reference_mel=v.ref_mel[None]).reshape(-1)
    torch.manual_seed(11)  # the reference draws its initial state with torch.randn([1, frames, mel_dim])
    noise = torch.randn(1, codes.numel() * stack.vocoder.repeats, 80)[0]
    ours = stack.vocoder.offline(codes, _voice(stack, "Ethan"), noise=noise)
    assert ours.shape == ref_wave.shape == (codes.numel() * 2 * 240,)
    diff = (ours - ref_wave).abs().max().item()
    print(f"offline vs transformers: max |diff| {diff:.2e}, signal max {ref_wave.abs().max():.2e}")
    assert diff <= 1e-5 * max(1.0, ref_wave.abs().max().item())


def _stream_all(stack, codes, voice, plan=None, seed=0, step=5):
    stream = stack.vocoder.stream(voice, seed=seed, plan=plan)
    chunks, first_chunk_after = [], None
    for i in range(0, codes.numel(), step):
        out = stream.push(codes[i:i + step].tolist())
        if out and first_chunk_after is None:
            first_chunk_after = min(i + step, codes.numel())
        chunks += out
    chunks += stream.flush()
    return chunks, first_chunk_after, stream


@torch.inference_mode()
def test_streaming_close_to_offline_and_seamless(loaded):
    stack, _ = loaded
    codes = _codes(180, seed=1)
    voice = _voice(stack)
    offline = stack.vocoder.offline(codes, voice, seed=3)
    chunks, first_after, _ = _stream_all(stack, codes, voice, seed=3)
    streamed = torch.cat(chunks)
    assert streamed.shape == offline.shape
    assert first_after is not None and first_after <= 40
    rel = ((streamed - offline).abs().max() / offline.abs().max()).item()
    rms_rel = ((streamed - offline).pow(2).mean().sqrt() / offline.pow(2).mean().sqrt()).item()
    # By design the windowed DiT approximates the whole-sequence ODE and BigVGAN looks only 12 of its
    # 34 context frames ahead (see vocoder.py).  Measured on this tiny random model: waveform max
    # deviation 7.3e-6 of peak, RMS 7.4e-7 of the signal RMS (mel: 3.4e-4 of peak).  Random weights
    # couple distant frames weakly, so trained weights will deviate more: measure them on real
    # checkpoints.  A misaligned noise or chunk offset would show as an O(1) deviation here.
    print(f"streaming vs offline: max {rel:.2e} of peak, rms {rms_rel:.2e} of rms; first chunk after {first_after} codes")
    assert rel < 1e-3 and rms_rel < 1e-4
    # No click at any chunk join: the jump across a join is within the signal's own sample-to-sample range.
    steps = (streamed[1:] - streamed[:-1]).abs()
    bound = torch.quantile(steps, 0.999).item() * 2
    join = 0
    for c in chunks[:-1]:
        join += c.numel()
        assert steps[join - 1].item() <= bound, (join, steps[join - 1].item(), bound)


@torch.inference_mode()
def test_lookahead_error_of_vocoder_is_small(loaded):
    """With the DiT exact (one chunk holding everything), only BigVGAN's short look-ahead differs."""
    stack, _ = loaded
    codes = _codes(60, seed=4)
    voice = _voice(stack)
    plan = StreamingPlan(chunk_frames=240, first_chunk_frames=240, past_frames=0, future_frames=0,
                         first_flow_steps=None)
    offline = stack.vocoder.offline(codes, voice, seed=5)
    chunks, _, _ = _stream_all(stack, codes, voice, plan=plan, seed=5)
    assert len(chunks) == 1
    assert torch.allclose(torch.cat(chunks), offline, atol=1e-6 * offline.abs().max().item() + 1e-7)


@torch.inference_mode()
def test_flush_partial_reset_empty_and_cut_short(loaded):
    stack, _ = loaded
    voice = _voice(stack)
    codes = _codes(50, seed=6)
    chunks, _, stream = _stream_all(stack, codes, voice, seed=1)
    total = sum(c.numel() for c in chunks)
    assert total == 50 * 2 * 240 == stream.samples_emitted
    # reset: the same reply again gives the same audio
    stream.reset()
    again = stream.push(codes.tolist()) + stream.flush()
    assert torch.equal(torch.cat(again), torch.cat(chunks))
    # empty reply
    stream.reset()
    assert stream.flush() == []
    # cut short after 17 codes (barge-in): everything pushed so far comes out, nothing more
    stream.reset()
    partial = stream.push(codes[:17].tolist()) + stream.flush()
    assert sum(c.numel() for c in partial) == 17 * 2 * 240
    with pytest.raises(RuntimeError):
        stream.push([1])


def test_plan_must_follow_dit_blocks(loaded):
    stack, _ = loaded
    with pytest.raises(ValueError, match="multiple of the DiT block"):
        stack.vocoder.stream(_voice(stack), plan=StreamingPlan(chunk_frames=30))


@torch.inference_mode()
def test_first_chunk_needs_24_codes_then_the_chunks_grow(loaded):
    """Default plan: a 48-frame first chunk without DiT look-ahead = 24 codes, its audio out in two
    pieces (the first 12 frames at once, the rest at the next code); then 48-frame and 72-frame
    chunks, each with 24 frames of look-ahead."""
    stack, _ = loaded
    stream = stack.vocoder.stream(_voice(stack))
    ready_at = []
    for i, code in enumerate(_codes(150, seed=8).tolist(), start=1):
        if stream.push([code]):
            ready_at.append((i, stream.samples_emitted // 240))
    # (codes pushed, mel frames of audio out): BigVGAN holds back 12 frames of look-ahead each time
    assert ready_at[:5] == [(24, 12), (25, 36), (60, 84), (96, 156), (132, 228)]


@torch.inference_mode()
def test_first_chunk_is_close_to_offline_and_the_rest_as_before(loaded):
    """What the fast start costs, measured: the first chunk (coarse flow, no DiT look-ahead)
    against the offline waveform, and the rest against offline and against the previous plan
    (first chunk of 48 frames from the full flow).  On this tiny random model the flow is
    nearly linear, so the coarse grid costs little (printed with -s; the bounds below hold with
    a wide margin).  Trained weights bend the flow more; the
    bound below is what a plan must keep on this model."""
    stack, _ = loaded
    codes = _codes(160, seed=2)
    voice = _voice(stack)
    offline = stack.vocoder.offline(codes, voice, seed=3)

    def snr(a, b):
        return 10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum()).item()

    old = StreamingPlan(first_chunk_frames=48, first_future_frames=None, first_flow_steps=None, ramp_frames=(),
                        first_audio_frames=None)
    new_chunks, _, _ = _stream_all(stack, codes, voice, seed=3, step=1)
    old_chunks, _, _ = _stream_all(stack, codes, voice, plan=old, seed=3, step=1)
    whole_chunks, _, _ = _stream_all(stack, codes, voice, plan=replace(StreamingPlan(), first_audio_frames=None),
                                     seed=3, step=1)
    new, previous, whole = torch.cat(new_chunks), torch.cat(old_chunks), torch.cat(whole_chunks)
    piece = new_chunks[0].numel()
    n0 = piece + new_chunks[1].numel()  # the first chunk's audio, in two pieces
    first, rest = snr(new[:n0], offline[:n0]), snr(new[n0:], offline[n0:])
    print(f"first chunk {n0} samples: {first:.1f} dB SNR vs offline (its first {piece}: "
          f"{snr(new[:piece], offline[:piece]):.1f} dB, rendered whole: {snr(whole[:piece], offline[:piece]):.1f} dB); "
          f"after it {rest:.1f} dB (previous plan after its first chunk: {snr(previous[n0:], offline[n0:]):.1f} dB)")
    assert piece == 12 * 240 and n0 == 36 * 240 and whole_chunks[0].numel() == n0
    assert first > 60 and snr(new[:piece], offline[:piece]) > 60 and rest > 80
    assert snr(new[n0:], previous[n0:]) > 80
    # The split changes the first piece only (its BigVGAN window ends 12 frames after it): from
    # there on the samples are those of the first chunk rendered whole, bit for bit.
    assert torch.equal(new[piece:], whole[piece:])
