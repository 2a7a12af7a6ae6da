"""Mimi codec (omnidesk/models/moshi/): weight map, config, and equality with Kyutai's reference.

The oracle is Kyutai's ``moshi`` package (0.2.13, installed without its dependencies; tests
only).  Tiny random models are built with its own ``loaders.get_mimi``, their state dicts
written to safetensors in the published naming, and loaded through our ``load_mimi``.
Checked (fp32, CPU): frame-by-frame encode gives the oracle's streaming codes exactly,
frame-by-frame decode is within 1e-5 of the oracle's streaming decode, our one-shot calls
equal our streaming both ways, and the transformer's KV ring wraps several times.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omnidesk.models.checkpoint import CheckpointError, ConfigError
from omnidesk.models.moshi.mimi import (DEMO, MIMI, MIMI_NAME, Mimi, MimiConfig, QuantizerConfig, SEANetConfig,
                                        check_mimi_tensors, checkpoint_state_dict, init_random_, load_mimi,
                                        weight_map)

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # the oracle would torch.compile its RoPE otherwise

DATA = Path(__file__).parent / "data" / "moshi" / "mimi_tensors.json"
FRAME = 1920

# Published structure at toy width; context 6 steps = 3 frames, so 26 frames wrap the ring 8 times.
TINY = replace(DEMO, transformer=replace(DEMO.transformer, context=6))
# Everything optional switched the other way: transformer projections (d_model != dimension),
# no layer scale, two dilated residual layers, 10 codebooks of which 6 used.  (SEANet "replicate"
# padding is not tested: the reference cannot stream it, a frame's 2 latent steps < a k7 conv's 6.)
TINY_PROJ = MimiConfig(
    seanet=SEANetConfig(dimension=24, n_filters=4, n_residual_layers=2),
    transformer=replace(DEMO.transformer, d_model=16, num_heads=2, num_layers=2, dim_feedforward=32, context=4,
                        layer_scale=None, input_dimension=24, output_dimension=24),
    quantizer=QuantizerConfig(dimension=8, n_q=10, bins=64, input_dimension=24, output_dimension=24),
    num_codebooks=6,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A tiny codec is a few hundred small ops per frame: one intra-op thread is several times
    faster than two (which wait on each other, worse on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def signal(frames: int, seed: int = 0) -> torch.Tensor:
    """24 kHz test signal: a gliding tone with harmonics, amplitude-modulated, plus noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FRAME) / 24000
    phase = 2 * torch.pi * torch.cumsum(150 + 60 * torch.sin(2 * torch.pi * 0.5 * t), 0) / 24000
    wave = sum(0.3 / k * torch.sin(k * phase) for k in range(1, 5)) * (0.6 + 0.4 * torch.sin(2 * torch.pi * 2 * t))
    return (wave + 0.05 * torch.randn(t.shape, generator=g)).float()


def frames_of(pcm: torch.Tensor) -> list[torch.Tensor]:
    return list(pcm.split(FRAME))


def published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle's state dict under the published checkpoint's names (legacy attention spelling)."""
    out = {}
    for name, value in state.items():
        name = name.replace("self_attn.in_projs.0.weight", "self_attn.in_proj_weight")
        name = name.replace("self_attn.out_projs.0.weight", "self_attn.out_proj.weight")
        out[name] = value.detach().contiguous()
    return out


def oracle_model(cfg: MimiConfig, seed: int):
    """A random Mimi built by the reference's own loader, its weights redrawn (seeded) so that the
    signal keeps its scale through the stack (the default init flattens the latent to a near
    constant), codebooks that look trained (fresh ones are all zero), and layer scales / norms
    that make the transformers matter."""
    loaders = pytest.importorskip("moshi.models.loaders")
    torch.manual_seed(seed)
    model = loaders.get_mimi(None, cfg.to_dict(), num_codebooks=cfg.num_codebooks)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_scale" in name:
                p.normal_(0.0, 0.5)
            elif ".norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:  # conv [out, in/groups, k]; linear; transposed conv [in, out/groups, k], k/stride taps each
                fan_in = p[0].numel()
                if "convtr" in name:  # the 12.5 -> 25 Hz upsampling is depthwise: one input channel
                    fan_in = (1 if name.startswith("upsample.") else p.shape[0]) * p.shape[2] // 2
                p.normal_(0.0, fan_in ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("cluster_usage"):
                b.uniform_(0.5, 2.0)
            elif name.endswith("embedding_sum"):  # codewords = sum / usage ~ N(0, 1)
                b.normal_().mul_(model.get_buffer(name.replace("embedding_sum", "cluster_usage"))[:, None])
            elif name.endswith("_initialized"):
                b.fill_(1.0)
    return model.eval()


def oracle_encode_stream(oracle, pcm: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), oracle.streaming(1):
        return torch.cat([oracle.encode(f.view(1, 1, -1)) for f in frames_of(pcm)], dim=-1)[0]


def oracle_decode_stream(oracle, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), oracle.streaming(1):
        return torch.cat([oracle.decode(codes[None, :, i:i + 1]) for i in range(codes.shape[1])], -1).view(-1)


@pytest.fixture(scope="module", params=["tiny", "tiny_proj"])
def pair(request, tmp_path_factory):
    """(config, oracle, ours loaded from the oracle's weights written in the published layout)."""
    from safetensors.torch import save_file

    cfg = {"tiny": TINY, "tiny_proj": TINY_PROJ}[request.param]
    oracle = oracle_model(cfg, seed=1 + len(request.param))
    path = tmp_path_factory.mktemp("mimi") / MIMI_NAME
    save_file(published_names(oracle.state_dict()), str(path))
    return cfg, oracle, load_mimi(path.parent, config=cfg)


# ---------------------------------------------------------------- weight map and config

def test_published_checkpoint_maps_one_to_one():
    data = json.loads(DATA.read_text())
    shapes = {name: tuple(shape) for name, shape in data["tensors"].items()}
    assert len(shapes) == data["tensor_count"] == 318
    assert MimiConfig.from_dict(data["config"]) == MIMI
    report = check_mimi_tensors(MIMI, {name: (shape, "F32") for name, shape in shapes.items()})
    assert report.ok, report.error("published Mimi")
    # the only tensors not loaded: one training flag per codebook
    assert {r: len(n) for r, n in report.unused.items()} == {
        "codebook k-means initialisation flag (training only)": MIMI.quantizer.n_q}
    assert len(report.loaded) + MIMI.quantizer.n_q == len(shapes)
    # each of our weights has exactly one source
    wmap = weight_map(MIMI)
    sources = collections.Counter(slot.param for slot in wmap.values())
    with torch.device("meta"):
        ours = Mimi(MIMI).state_dict()
    assert set(sources) == set(ours) and set(sources.values()) == {1}
    for name, slot in wmap.items():
        assert tuple(ours[slot.param].shape) == shapes[name] == slot.shape, name
    assert sum(p.numel() for p in ours.values()) + MIMI.quantizer.n_q == data["elements"]


def test_stored_list_equals_a_rebuild():
    pytest.importorskip("moshi.models.loaders")
    import importlib.util

    spec = importlib.util.spec_from_file_location("dump_mimi_shapes", DATA.parent / "dump_shapes.py")
    dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump)
    assert dump.tensor_list() == json.loads(DATA.read_text())


def test_config_reads_the_reference_dict():
    loaders = pytest.importorskip("moshi.models.loaders")
    assert MimiConfig.from_dict(loaders._mimi_config) == MIMI
    for cfg in (MIMI, DEMO, TINY, TINY_PROJ):
        assert MimiConfig.from_dict(cfg.to_dict(), num_codebooks=cfg.num_codebooks) == cfg
    assert MIMI.frame_size == 1920 and MIMI.steps_per_frame == 2 and MIMI.num_codebooks == 8


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["seanet"].update(norm="weight_norm"), "seanet: norm='weight_norm' is not supported"),
    (lambda d: d["transformer"].update(gating="silu"), "transformer: gating='silu' is not supported"),
    (lambda d: d["transformer"].pop("context"), "transformer: context=None is not supported"),
    (lambda d: d["quantizer"].update(codebook_dim=3), "quantizer: unknown field(s) 'codebook_dim'"),
    (lambda d: d.pop("frame_rate"), "missing field 'frame_rate'"),
    (lambda d: d["seanet"].pop("pad_mode"), "pad_mode='reflect' is not supported"),  # the reference default
])
def test_config_errors_name_the_field(edit, message):
    d = MIMI.to_dict()
    edit(d)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MimiConfig.from_dict(d)


# ---------------------------------------------------------------- against the oracle

def test_streaming_encode_equals_oracle(pair):
    cfg, oracle, ours = pair
    pcm = signal(26, seed=3)
    expected = oracle_encode_stream(oracle, pcm)
    ours.reset()
    codes = torch.stack([ours.encode_frame(f) for f in frames_of(pcm)], dim=1)
    assert codes.shape == (cfg.num_codebooks, 26) and codes.dtype == torch.int64
    assert len(set(map(tuple, codes.t().tolist()))) > 20  # frames get different codes: a meaningful comparison
    assert torch.equal(codes, expected)
    # the ring has wrapped: context is a few frames, the stream 26
    assert ours.encoder_transformer.offset.item() == 26 * cfg.steps_per_frame > 4 * cfg.transformer.context


def test_streaming_decode_within_1e5_of_oracle(pair):
    cfg, oracle, ours = pair
    codes = oracle_encode_stream(oracle, signal(26, seed=4))
    expected = oracle_decode_stream(oracle, codes)
    ours.reset()
    pcm = torch.cat([ours.decode_frame(codes[:, i]) for i in range(codes.shape[1])])
    assert pcm.shape == (26 * FRAME,) and pcm.abs().max() > 1e-2
    assert (pcm - expected).abs().max().item() <= 1e-5


def test_one_shot_equals_streaming_both_ways(pair):
    cfg, _, ours = pair
    pcm = signal(26, seed=5)
    ours.reset()
    streamed = torch.stack([ours.encode_frame(f) for f in frames_of(pcm)], dim=1)
    assert torch.equal(ours.encode(pcm), streamed)
    assert torch.equal(ours.encode(pcm, chunk_frames=4), streamed)  # 7 chunks, the last one short
    pcm_streamed = torch.cat([ours.decode_frame(streamed[:, i]) for i in range(26)])
    torch.testing.assert_close(ours.decode(streamed), pcm_streamed, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.decode(streamed, chunk_frames=4), pcm_streamed, rtol=0, atol=1e-5)
    # a one-shot call leaves the stream where streaming those frames would have
    ours.encode(pcm[:10 * FRAME])
    rest = torch.stack([ours.encode_frame(f) for f in frames_of(pcm[10 * FRAME:])], dim=1)
    assert torch.equal(rest, streamed[:, 10:])
    ours.decode(streamed[:, :10])
    tail = torch.cat([ours.decode_frame(streamed[:, i]) for i in range(10, 26)])
    torch.testing.assert_close(tail, pcm_streamed[10 * FRAME:], rtol=0, atol=1e-5)


def test_reset_restarts_both_streams(pair):
    cfg, _, ours = pair
    pcm = signal(8, seed=6)
    ours.reset()
    first = [ours.encode_frame(f) for f in frames_of(pcm)]
    first_pcm = [ours.decode_frame(c) for c in first]
    ours.reset()
    again = [ours.encode_frame(f) for f in frames_of(pcm)]
    again_pcm = [ours.decode_frame(c) for c in again]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first_pcm, again_pcm))


def test_fewer_codebooks_at_runtime(pair):
    cfg, oracle, ours = pair
    pcm = signal(6, seed=7)
    full = ours.encode(pcm)
    ours.num_codebooks = cfg.quantizer.n_q_semantic + 1
    try:
        assert torch.equal(ours.encode(pcm), full[:2])  # residual stages: a prefix of the full codes
    finally:
        ours.num_codebooks = cfg.num_codebooks
    expected = oracle_decode_stream(oracle, full[:3])
    ours.reset()
    got = torch.cat([ours.decode_frame(full[:3, i]) for i in range(6)])
    assert (got - expected).abs().max().item() <= 1e-5


def test_checkpoint_state_dict_loads_in_the_reference():
    """What a demo checkpoint writes (our weights, published names) is what the reference loads."""
    oracle = oracle_model(TINY, seed=9)
    ours = init_random_(Mimi(TINY), torch.Generator().manual_seed(0))
    oracle.load_state_dict(checkpoint_state_dict(ours), strict=True)
    pcm = signal(5, seed=8)
    ours.reset()
    codes = torch.stack([ours.encode_frame(f) for f in frames_of(pcm)], dim=1)
    assert torch.equal(codes, oracle_encode_stream(oracle, pcm))


# ---------------------------------------------------------------- loader errors

def write(tmp_path, state) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / MIMI_NAME
    save_file(state, str(path))
    return path


def test_loader_errors_name_file_and_tensor(tmp_path):
    cfg = TINY
    state = checkpoint_state_dict(init_random_(Mimi(cfg)))
    with pytest.raises(CheckpointError, match="missing file"):
        load_mimi(tmp_path, config=cfg)
    name = "decoder_transformer.transformer.layers.0.linear1.weight"
    bad = dict(state, **{name: torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match=rf"{MIMI_NAME}: tensor '{name}' has shape \[3, 3\], expected"):
        load_mimi(write(tmp_path, bad), config=cfg)
    gone = {k: v for k, v in state.items() if k != "downsample.conv.conv.conv.weight"}
    with pytest.raises(CheckpointError, match="missing weights: downsample.conv.conv.conv.weight"):
        load_mimi(write(tmp_path, gone), config=cfg)
    extra = dict(state, **{"encoder.model.99.conv.conv.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="unexpected weights: encoder.model.99.conv.conv.weight"):
        load_mimi(write(tmp_path, extra), config=cfg)
    # the moshi package's own spelling loads too, but not both spellings at once
    attn = "encoder_transformer.transformer.layers.0.self_attn"
    renamed = {k.replace(f"{attn}.in_proj_weight", f"{attn}.in_projs.0.weight"): v for k, v in state.items()}
    assert load_mimi(write(tmp_path, renamed), config=cfg) is not None
    both = dict(state, **{f"{attn}.in_projs.0.weight": state[f"{attn}.in_proj_weight"].clone()})
    with pytest.raises(CheckpointError, match=rf"unexpected weights: {attn}.in_projs.0.weight"):
        load_mimi(write(tmp_path, both), config=cfg)
    (tmp_path / MIMI_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_mimi(tmp_path, config=cfg)


# ---------------------------------------------------------------- the real config

def test_real_config_streams_like_one_shot(tmp_path):
    """The published shapes with random weights: through the loader, frame by frame == one-shot,
    and the oracle (loading the same file's tensors strictly) gives the same codes and audio."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    ours = init_random_(Mimi(MIMI), torch.Generator().manual_seed(0))
    save_file(checkpoint_state_dict(ours), str(tmp_path / MIMI_NAME))
    del ours
    ours = load_mimi(tmp_path)
    assert sum(p.numel() for p in ours.parameters()) == 79_308_609
    pcm = signal(3, seed=10)
    streamed = torch.stack([ours.encode_frame(f) for f in frames_of(pcm)], dim=1)
    assert streamed.shape == (8, 3)
    assert torch.equal(ours.encode(pcm), streamed)
    audio = torch.cat([ours.decode_frame(streamed[:, i]) for i in range(3)])
    assert audio.shape == (3 * FRAME,) and 0.01 < audio.std() < 0.5  # init_random_'s noise: audible, no clipping
    torch.testing.assert_close(ours.decode(streamed), audio, rtol=0, atol=1e-5)

    loaders = pytest.importorskip("moshi.models.loaders")
    oracle = loaders.get_mimi(tmp_path / MIMI_NAME)  # the reference's own loader, strict
    assert torch.equal(oracle_encode_stream(oracle, pcm), streamed)
    assert (oracle_decode_stream(oracle, streamed) - audio).abs().max().item() <= 1e-5
    print(f"real-config Mimi test: {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------- timing (run this file; asserts nothing)

def measure(cfg: MimiConfig, frames: int = 60, warmup: int = 10, threads: int = 1) -> dict:
    """ms per 80 ms frame for encode_frame and decode_frame (p50, p90), random weights: wall time,
    and with one thread also the CPU time the thread used (what the wall time is on an idle
    machine; on a shared one the wall time includes waiting for a core)."""
    torch.set_num_threads(threads)
    model = init_random_(Mimi(cfg), torch.Generator().manual_seed(0))
    pcm = signal(frames + warmup)
    times = collections.defaultdict(list)
    for i, frame in enumerate(frames_of(pcm)):
        w0, c0 = time.perf_counter(), time.thread_time()
        codes = model.encode_frame(frame)
        w1, c1 = time.perf_counter(), time.thread_time()
        model.decode_frame(codes)
        w2, c2 = time.perf_counter(), time.thread_time()
        if i >= warmup:
            times["encode"].append((w1 - w0) * 1e3)
            times["decode"].append((w2 - w1) * 1e3)
            times["encode_cpu"].append((c1 - c0) * 1e3)
            times["decode_cpu"].append((c2 - c1) * 1e3)
    out = {"threads": threads}
    for key, xs in times.items():
        if key.endswith("_cpu") and threads != 1:
            continue
        xs.sort()
        out[f"{key}_p50"], out[f"{key}_p90"] = round(xs[len(xs) // 2], 2), round(xs[int(0.9 * (len(xs) - 1))], 2)
    return out


if __name__ == "__main__":
    print("load average:", os.getloadavg())
    for name, cfg, frames in (("demo", DEMO, 200), ("mimi", MIMI, 30)):
        for threads in (1, 2):
            print(name, measure(cfg, frames=frames, threads=threads))
