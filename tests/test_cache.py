"""KV cache invariants: chunked == one-shot prefill, truncate == fresh history, static == eager."""

import pytest
import torch

from omnidesk.models.kv_cache import CacheFullError, KVCache
from omnidesk.models.qwen2_5_omni.loading import load_stack


@pytest.fixture(scope="module", params=["a", "b"])
def stack(request, tiny_checkpoints):
    return load_stack(tiny_checkpoints(request.param)[0])


def _ids(stack, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g)


@torch.inference_mode()
def test_chunked_prefill_equals_one_shot(stack):
    thinker = stack.thinker
    ids = _ids(stack, 45)
    embeds = thinker.embed(ids)
    whole = thinker.new_cache(64)
    h_whole = thinker(embeds, whole)
    chunked = thinker.new_cache(64)
    parts = [thinker(embeds[i:i + 7], chunked) for i in range(0, 45, 7)]
    h_chunked = torch.cat(parts)
    assert chunked.length == whole.length == 45
    # different matmul shapes round differently: equal to float precision, not bitwise
    assert (h_chunked - h_whole).abs().max() <= 1e-5
    assert (torch.stack(chunked.k)[..., :45, :] - torch.stack(whole.k)[..., :45, :]).abs().max() <= 1e-5


@torch.inference_mode()
def test_truncate_then_decode_equals_fresh_history(stack):
    """Roll back 6 of 9 decoded tokens, decode a different token: same logits as a cache that never saw them."""
    thinker = stack.thinker
    prompt = thinker.embed(_ids(stack, 20, seed=1))
    decoded = _ids(stack, 9, seed=2)
    probe = thinker.embed(torch.tensor([7]))

    cache = thinker.new_cache(40)
    thinker(prompt, cache)
    for t in decoded:
        thinker(thinker.embed(t[None]), cache)
    cache.truncate(20 + 3)
    assert cache.length == 23
    rolled = thinker.logits(thinker(probe, cache)[-1])

    fresh = thinker.new_cache(40)
    thinker(prompt, fresh)
    for t in decoded[:3]:
        thinker(thinker.embed(t[None]), fresh)
    expected = thinker.logits(thinker(probe, fresh)[-1])
    assert torch.equal(rolled, expected)

    # and against one prefill of the kept history (different op shapes: float tolerance)
    one_shot = thinker.new_cache(40)
    thinker(torch.cat([prompt, thinker.embed(decoded[:3])]), one_shot)
    assert (thinker.logits(thinker(probe, one_shot)[-1]) - rolled).abs().max() <= 1e-4


@torch.inference_mode()
def test_static_step_equals_eager_step(stack):
    """The static-shape step (whole-capacity attention with a position mask) gives the eager step's logits."""
    thinker = stack.thinker
    prompt = thinker.embed(_ids(stack, 16, seed=3))
    eager, static = thinker.new_cache(48), thinker.new_cache(48)
    thinker(prompt, eager)
    thinker(prompt, static)
    for t in _ids(stack, 10, seed=4):
        e = thinker.embed(t[None])
        a = thinker.logits(thinker(e, eager)[-1])
        pos = torch.tensor([static.length])
        b = thinker.logits(thinker.forward_static(e, static, pos)[-1])
        static.length += 1
        assert (a - b).abs().max() <= 1e-5
    # a rollback is just the pointer for the static path too
    static.truncate(18)
    eager.truncate(18)
    e = thinker.embed(torch.tensor([3]))
    a = thinker.logits(thinker(e, eager)[-1])
    b = thinker.logits(thinker.forward_static(e, static, torch.tensor([18]))[-1])
    assert (a - b).abs().max() <= 1e-5


def test_cache_bounds():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=4, capacity=8)
    assert cache.reserve(8) == 0
    with pytest.raises(CacheFullError, match="capacity 8"):
        cache.reserve(9)
    cache.length = 5
    with pytest.raises(ValueError):
        cache.truncate(6)
    cache.truncate(0)
    assert cache.length == 0
    assert cache.nbytes == 2 * 2 * 1 * 8 * 4 * 4
