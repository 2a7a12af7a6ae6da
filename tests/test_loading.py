"""The loader on good and damaged checkpoints: every problem is reported by file / tensor name.

Damaged checkpoints are copies of the shared tiny checkpoints (never the
shared directory itself), rewritten with safetensors.torch and shutil.
"""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnidesk.models.checkpoint import CheckpointError, ConfigError, hf_hub_cache, resolve_checkpoint
from omnidesk.models.qwen2_5_omni.loading import load_stack

IDS = torch.tensor([1, 5, 42, 100, 300, 519])






def _raises(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        load_stack(*args, **kwargs)
    assert type(info.value) is exc_type  # ConfigError vs CheckpointError: both ValueError, not each other
    return str(info.value)


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@torch.inference_mode()
def _thinker_logits(stack) -> torch.Tensor:
    thinker = stack.thinker
    cache = thinker.new_cache(16)
    return thinker.logits(thinker(thinker.embed(IDS), cache))


# ---------------------------------------------------------------- missing / wrong files

@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "preprocessor_config.json", "spk_dict.pt", "model.safetensors"])
def test_missing_file_is_named(ckpt, name):
    (ckpt / name).unlink()
    msg = _raises(CheckpointError, ckpt)
    assert msg.startswith(f"{ckpt}: missing file {name}"), msg


def test_not_a_qwen_omni_checkpoint(ckpt):
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "hidden_size": 64}))
    msg = _raises(ConfigError, ckpt)
    assert msg.startswith(str(ckpt / "config.json")), msg
    assert "not a Qwen2.5-Omni checkpoint" in msg
    assert "'llama'" in msg and "LlamaForCausalLM" in msg and "'qwen2_5_omni'" in msg


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen2_5_omni", ')
    msg = _raises(ConfigError, ckpt)
    assert msg.startswith(f"{ckpt / 'config.json'}: not valid JSON"), msg


def test_generation_config_not_json(ckpt):
    (ckpt / "generation_config.json").write_text('{"temperature": ')  # a download cut short
    msg = _raises(ConfigError, ckpt)
    assert msg.startswith(f"{ckpt / 'generation_config.json'}: not valid JSON"), msg


def test_corrupt_speakers(ckpt):
    (ckpt / "spk_dict.pt").write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(3),
                                                     dtype=torch.uint8).numpy().tobytes())
    msg = _raises(CheckpointError, ckpt)
    assert msg.startswith(f"{ckpt / 'spk_dict.pt'}: cannot read voices"), msg


# ---------------------------------------------------------------- tensors

def test_wrong_shape_names_tensor_and_shapes(ckpt):
    name = "thinker.model.norm.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(name, torch.ones(t[name].shape[0] + 1)))
    msg = _raises(CheckpointError, ckpt)
    assert msg == f"{ckpt}: tensor '{name}' has shape [65], expected [64]", msg


def test_missing_weight(ckpt):
    name = "thinker.model.layers.1.mlp.down_proj.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.pop(name))
    msg = _raises(CheckpointError, ckpt)
    assert msg == f"{ckpt}: missing weights: {name}", msg


def test_unexpected_weight(ckpt):
    name = "thinker.model.extra.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(3)))
    msg = _raises(CheckpointError, ckpt)
    assert msg == f"{ckpt}: unexpected weights: {name}", msg


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = _raises(CheckpointError, ckpt)
    assert msg.startswith(f"{f}: truncated: tensor '"), msg


def test_corrupt_header_length(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 2**60)
    f.write_bytes(bytes(data))
    msg = _raises(CheckpointError, ckpt)
    assert msg.startswith(f"{f}: corrupt safetensors header (length {2**60} > file size {len(data)})"), msg


@pytest.mark.parametrize("garbage", [b"{this is not json", b"\xff\xfe\x00garbage"], ids=["text", "binary"])
def test_corrupt_header_json(ckpt, garbage):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:8 + len(garbage)] = garbage
    f.write_bytes(bytes(data))
    msg = _raises(CheckpointError, ckpt)
    assert msg.startswith(f"{f}: corrupt safetensors header ("), msg


# ---------------------------------------------------------------- sharded

def test_sharded_loads_like_single_file(tiny_checkpoints, sharded):
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    single = load_stack(tiny_checkpoints("a")[0])
    multi = load_stack(sharded)
    assert torch.equal(_thinker_logits(multi), _thinker_logits(single))
    one, many = dict(single.model.named_parameters()), dict(multi.model.named_parameters())
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    for (name, a), (_, b) in zip(multi.vocoder.named_parameters(), single.vocoder.named_parameters()):
        assert torch.equal(a, b), name


def test_sharded_missing_shard(sharded, tmp_path):
    root = tmp_path / "sharded"
    shutil.copytree(sharded, root)
    shard = sorted(root.glob("model-*.safetensors"))[1]
    shard.unlink()
    msg = _raises(CheckpointError, root)
    assert msg == f"{root}: missing shard {shard.name} (listed in model.safetensors.index.json)", msg


def test_sharded_truncated_shard(sharded, tmp_path):
    root = tmp_path / "sharded"
    shutil.copytree(sharded, root)
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    shard = root / index["thinker.model.embed_tokens.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    msg = _raises(CheckpointError, root)
    assert msg.startswith(f"{shard}: truncated"), msg


# ---------------------------------------------------------------- variants and options

def test_tied_embeddings(tiny_checkpoints):
    path, ref = tiny_checkpoints("b")
    stack = load_stack(path)
    assert stack.config.thinker.tie_word_embeddings
    thinker = stack.thinker
    assert thinker.lm_head.weight is thinker.embed_tokens.weight
    assert thinker.lm_head.weight.data_ptr() == thinker.embed_tokens.weight.data_ptr()
    assert torch.equal(thinker.embed_tokens.weight, ref.thinker.get_input_embeddings().weight)
    assert torch.equal(thinker.lm_head.weight, ref.thinker.lm_head.weight)


def test_bfloat16_on_cpu(tiny_checkpoints):
    path, _ = tiny_checkpoints("a")
    stack = load_stack(path, dtype=torch.bfloat16)
    assert stack.dtype == torch.bfloat16
    assert {p.dtype for p in stack.thinker.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in stack.talker.parameters()} == {torch.bfloat16}
    # the vocoder stays fp32, as in the reference (flow matching needs it)
    assert {p.dtype for p in stack.vocoder.parameters()} == {torch.float32}
    fp32 = load_stack(path)
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    logits = _thinker_logits(stack)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (logits - _thinker_logits(fp32)).abs().max() < 0.05


def test_without_talker_needs_no_speakers(tiny_checkpoints, ckpt):
    (ckpt / "spk_dict.pt").unlink()
    stack = load_stack(ckpt, enable_talker=False)
    assert stack.talker is None and stack.config.talker is None
    assert stack.voices == {} and stack.default_voice is None
    assert not any(n.startswith("talker.") for n, _ in stack.model.named_parameters())
    assert torch.equal(_thinker_logits(stack), _thinker_logits(load_stack(tiny_checkpoints("a")[0])))


# ---------------------------------------------------------------- repo ids in the HF cache

def _fake_hub(hub: Path, repo: str, src: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The hub cache layout: refs/main -> commit, snapshots/<commit>/<file> -> ../../blobs/<name>."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / commit
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        blob = blobs / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit + "\n")
    return snap


def test_repo_id_from_hf_hub_cache(tiny_checkpoints, tmp_path, monkeypatch):
    src, _ = tiny_checkpoints("a")
    hub = tmp_path / "hub-cache"
    snap = _fake_hub(hub, "Org/Name", src)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    assert hf_hub_cache() == hub
    assert resolve_checkpoint("Org/Name") == snap
    stack = load_stack("Org/Name")
    assert stack.path == snap
    assert torch.equal(_thinker_logits(stack), _thinker_logits(load_stack(src)))
    assert set(stack.voices) == {"Chelsie", "Ethan"}


def test_repo_id_from_hf_home(tiny_checkpoints, tmp_path, monkeypatch):
    src, _ = tiny_checkpoints("a")
    snap = _fake_hub(tmp_path / "hf-home" / "hub", "Org/Name", src)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert load_stack("Org/Name").path == snap


def test_repo_id_without_refs_uses_snapshot(tiny_checkpoints, tmp_path, monkeypatch):
    src, _ = tiny_checkpoints("a")
    hub = tmp_path / "hub"
    snap = _fake_hub(hub, "Org/Name", src)
    (hub / "models--Org--Name" / "refs" / "main").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_checkpoint("Org/Name") == snap


def test_repo_id_not_in_cache(tmp_path, monkeypatch):
    hub = tmp_path / "empty-hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    msg = _raises(CheckpointError, "Org/Missing")
    assert f"'Org/Missing' is not in the local Hugging Face cache ({hub})" in msg, msg
    # an unknown name is said to be unknown, with the repos that exist: no download of a made-up repo suggested
    assert "omnidesk models download Org/Missing" not in msg, msg
    assert "'Org/Missing' is not in the local Hugging Face cache" in msg and "not a model repo OmniDesk knows" in msg


def test_unknown_repo_is_not_suggested_for_download(tmp_path, monkeypatch):
    """`--model Qwen/Qwen2.5-Omni-14B` (no such repo): the error lists the known repos and suggests no
    download of the made-up one; a known repo that is not cached is suggested as before."""
    from omnidesk.models.families import RECOMMENDED

    hub = tmp_path / "empty-hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    msg = _raises(CheckpointError, "Qwen/Qwen2.5-Omni-14B")
    assert "download Qwen/Qwen2.5-Omni-14B" not in msg and "not a model repo OmniDesk knows" in msg, msg
    for repo in RECOMMENDED:
        assert repo in msg, (repo, msg)
    msg = _raises(CheckpointError, "Qwen/Qwen2.5-Omni-7B")
    assert msg.endswith("download it first with: omnidesk models download Qwen/Qwen2.5-Omni-7B"), msg


def test_nonexistent_directory(tmp_path):
    missing = tmp_path / "no" / "such-checkpoint"
    msg = _raises(CheckpointError, missing)
    assert msg == f"checkpoint directory not found: {missing}", msg


def test_header_that_is_not_an_object_names_the_file(tmp_path):
    from omnidesk.models.checkpoint import read_safetensors_header

    bad = tmp_path / "model.safetensors"
    body = b"[1, 2]"
    bad.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        read_safetensors_header(bad)
    body = b'{"w": {"dtype": "F32"}}'
    bad.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(CheckpointError, match="bad entry for tensor 'w'"):
        read_safetensors_header(bad)
