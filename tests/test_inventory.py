"""Checkpoint inventory, verification and memory estimates (omnidesk.models.inventory).

Damaged checkpoints are private copies of the shared tiny checkpoints.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnidesk.models import memory
from omnidesk.models.qwen2_5_omni.config import OmniConfig
from omnidesk.models.qwen2_5_omni.memory import SMALLER_SHAPE, check_fits, estimate_memory, max_context, model_shape
from omnidesk.models.inventory import find_checkpoints
from omnidesk.models.families import verify

DATA = Path(__file__).parent / "data"
GiB = 2**30
COMMIT = "0123456789abcdef0123456789abcdef01234567"






def _fake_hub(hub: Path, repo: str, src: Path) -> Path:
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        shutil.copyfile(f, blobs / f"{i:040x}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"{i:040x}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT + "\n")
    return snap


# ---------------------------------------------------------------- find_checkpoints

def test_find_checkpoints_in_hub_cache_and_extra_dirs(tiny_checkpoints, tmp_path, monkeypatch):
    src_a, _ = tiny_checkpoints("a")
    src_b, _ = tiny_checkpoints("b")
    hub = tmp_path / "hub"
    snap = _fake_hub(hub, "Org/Name", src_a)
    # a non-Omni repo in the cache is ignored
    other = hub / "models--Org--Llama" / "snapshots" / COMMIT
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    extra = tmp_path / "models"
    shutil.copytree(src_b, extra / "tiny-b")
    (extra / "notes").mkdir()
    (extra / "tiny-b" / "spk_dict.pt").unlink()

    found = find_checkpoints([extra, tmp_path / "does-not-exist"])
    assert [c.name for c in found] == ["Org/Name", str(extra / "tiny-b")]
    a, b = found
    assert a.path == snap
    assert a.size_bytes == (src_a / "model.safetensors").stat().st_size  # symlinks followed
    assert a.dtype == "float32"  # tiny config's dtype (transformers writes "dtype")
    assert a.voices == ["Chelsie", "Ethan"]
    expected_params = sum(p.numel() for p in tiny_checkpoints("a")[1].state_dict().values())
    assert a.params > 0 and abs(a.params - expected_params) <= expected_params * 0.01
    assert a.loads and a.problems == [] and not a.demo
    assert b.voices == [] and not b.loads
    assert b.problems == [f"{extra / 'tiny-b'}: missing file spk_dict.pt"]
    # the checkpoint folder itself, given directly
    assert [c.name for c in find_checkpoints([extra / "tiny-b"])] == ["Org/Name", str(extra / "tiny-b")]


# ---------------------------------------------------------------- verify

def test_verify_good_checkpoint_with_load_test(tiny_checkpoints):
    path, _ = tiny_checkpoints("a")
    report = verify(path)
    assert report.ok and report.problems == [] and report.notes == [], (report.problems, report.notes)
    assert "load test: loaded on the CPU in float32, one thinker decode step" in report.checked
    assert "spk_dict.pt (2 voices)" in report.checked
    assert any(c.startswith("tensor names and shapes (") for c in report.checked)


def test_verify_skips_load_test_without_ram(tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(memory, "available_ram", lambda: 1000)
    report = verify(tiny_checkpoints("a")[0])
    assert report.ok
    assert len(report.notes) == 1 and report.notes[0].startswith("load test skipped: the checkpoint needs about ")
    assert report.notes[0].endswith("in float32 but only 0.0 GiB of RAM is available")


def test_verify_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    report = verify(ckpt)
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith(f"{f}: truncated: tensor '"), report.problems


def test_verify_missing_shard(sharded, tmp_path):
    root = tmp_path / "sharded"
    shutil.copytree(sharded, root)
    shards = sorted(root.glob("model-*.safetensors"))
    shards[1].unlink()
    shards[2].unlink()
    report = verify(root)
    assert report.problems == [f"{root}: missing shard {s.name} (listed in model.safetensors.index.json)"
                               for s in shards[1:3]]


def test_verify_good_sharded(sharded):
    report = verify(sharded, load_test=False)
    assert report.ok, report.problems
    assert any(c.startswith("model.safetensors.index.json (") for c in report.checked)


def test_verify_wrong_shape(ckpt):
    name = "thinker.model.norm.weight"
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    tensors[name] = torch.ones(65)
    save_file(tensors, f, metadata={"format": "pt"})
    assert verify(ckpt).problems == [f"{ckpt}: tensor '{name}' has shape [65], expected [64]"]


def test_verify_missing_speakers_and_tokenizer(ckpt):
    (ckpt / "spk_dict.pt").unlink()
    (ckpt / "tokenizer.json").unlink()
    report = verify(ckpt)
    assert report.problems == [f"{ckpt}: missing file tokenizer.json", f"{ckpt}: missing file spk_dict.pt"]
    assert not any(c.startswith("load test") for c in report.checked)  # no load test on a bad checkpoint


def test_verify_not_found(tmp_path):
    assert verify(tmp_path / "nope").problems == [f"checkpoint directory not found: {tmp_path / 'nope'}"]


# ---------------------------------------------------------------- memory

def _config(size: str) -> OmniConfig:
    return OmniConfig.from_file(DATA / f"qwen2_5_omni_{size}" / "config.json")


def test_parameter_counts_of_real_configs():
    # Thinker (LLM + audio encoder, no vision) + talker; the vocoder separately.
    # Cross-check: the hub 7B index gives the thinker 17_863_627_776 bf16 bytes = 8_931_813_888 params
    # including the vision encoder (676_550_144), i.e. 8_255_263_744 without it.
    s7 = model_shape(_config("7b"))
    assert s7.llm_params == 8_255_263_744 + 1_351_360_256 == 9_606_624_000
    assert 17_863_627_776 // 2 - 8_255_263_744 == 676_550_144
    assert s7.vocoder_params == 449_051_264
    assert (s7.thinker_kv, s7.talker_kv, s7.talker_row_width) == ((28, 4, 128), (24, 4, 128), 3584)
    assert model_shape(_config("3b")) == SMALLER_SHAPE


def test_estimate_7b_bf16_8k_by_hand():
    e = estimate_memory(_config("7b"), torch.bfloat16, 8192)
    weights = 9_606_624_000 * 2  # 19.21 GB (the talker alone is 1.35B params)
    vocoder = 449_051_264 * 4  # 1.80 GB
    thinker_kv = 28 * 2 * 4 * 128 * 8192 * 2  # 0.47 GB
    talker_kv = 24 * 2 * 4 * 128 * (8192 + 4096) * 2  # 0.60 GB
    rows = 8192 * 3584 * 2  # 0.06 GB
    base = weights + vocoder + thinker_kv + talker_kv + rows  # 22.14 GB
    total = base * 1.10 + 512 * 2**20  # 24.89 GB = 23.2 GiB
    for got, want in [(e.weights, weights), (e.vocoder, vocoder), (e.thinker_kv, thinker_kv),
                      (e.talker_kv, talker_kv), (e.talker_rows, rows), (e.total, total)]:
        assert abs(got - want) <= 0.01 * want, (got, want)
    assert 24.8e9 < e.total < 25.0e9


def test_estimate_3b_bf16_8k_by_hand():
    e = estimate_memory(_config("3b"), "bfloat16", 8192)
    weights = (4_034_780_160 + 384_604_928) * 2  # 8.84 GB
    vocoder = 449_051_264 * 4
    thinker_kv = 36 * 2 * 2 * 128 * 8192 * 2  # 0.30 GB
    talker_kv = 24 * 2 * 2 * 64 * (8192 + 4096) * 2  # 0.15 GB
    rows = 8192 * 2048 * 2
    total = (weights + vocoder + thinker_kv + talker_kv + rows) * 1.10 + 512 * 2**20  # 12.77 GB = 11.9 GiB
    assert abs(e.total - total) <= 0.01 * total
    assert 12.7e9 < e.total < 12.85e9


def test_check_fits_3b_on_24gb():
    assert check_fits(estimate_memory(_config("3b"), torch.bfloat16, 8192), 24 * GiB) is None


def test_check_fits_7b_on_16gb_suggests_3b():
    e = estimate_memory(_config("7b"), torch.bfloat16, 8192)
    msg = check_fits(e, 16 * GiB)
    fit_3b = max_context(SMALLER_SHAPE, torch.bfloat16, 16 * GiB)
    assert fit_3b == 32768  # capped at max_position_embeddings
    # int8 (16.5 GiB) does not fit 16 GiB; a published 4-bit checkpoint of the 7B (13.4 GiB) does
    assert msg == ("The model (10.1B parameters) in bfloat16 with a context of 8192 tokens needs about 23.2 GiB "
                   "but only 16.0 GiB is free. Try a 4-bit checkpoint of it, Qwen/Qwen2.5-Omni-7B-GPTQ-Int4 or "
                   "Qwen/Qwen2.5-Omni-7B-AWQ (about 13.4 GiB); or the smaller model Qwen/Qwen2.5-Omni-3B (about "
                   "11.9 GiB with 8192 tokens of context; up to 32768 tokens fit); or running on the CPU (slower).")


def test_check_fits_suggests_shorter_context():
    e = estimate_memory(_config("3b"), torch.bfloat16, 32768)
    free = int(11.95 * GiB)
    n = max_context(e.shape, torch.bfloat16, free)
    assert 8192 <= n < 32768 and n % 256 == 0
    assert estimate_memory(_config("3b"), torch.bfloat16, n).total <= free
    assert estimate_memory(_config("3b"), torch.bfloat16, n + 256).total > free
    assert check_fits(e, free).endswith(f"Try a shorter context: at most {n} tokens fit; or loading it with "
                                         f"--quantize int8 (about 10.4 GiB: the thinker's linears in int8); "
                                         "or running on the CPU (slower).")


def test_the_7b_is_refused_on_a_cpu_without_the_ram(tmp_path, monkeypatch):
    """The published 7B config on a CPU with too little RAM: refused before any file but config.json is
    read, naming the need and what is free, with int8 suggested only when it would fit."""
    from omnidesk.models.checkpoint import ModelTooLargeError
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    shutil.copy(DATA / "qwen2_5_omni_7b" / "config.json", tmp_path / "config.json")
    fp32 = estimate_memory(_config("7b"), torch.float32, 8192).total
    int8 = estimate_memory(_config("7b"), torch.float32, 8192, quantization="int8").total
    assert 35 * GiB < fp32 < 50 * GiB and int8 < 0.6 * fp32  # thinker, talker and vocoder in fp32
    monkeypatch.setattr(memory, "available_ram", lambda: int8 + GiB)
    with pytest.raises(ModelTooLargeError) as e:
        load_stack(tmp_path, device="cpu")
    assert str(e.value) == (f"{tmp_path}: on the CPU in float32 this model needs about {memory.gib(fp32)} of RAM "
                            f"but only {memory.gib(int8 + GiB)} is available; load it with --quantize int8 (about "
                            f"{memory.gib(int8)}) or run it on a GPU with enough memory (--device cuda)")
    monkeypatch.setattr(memory, "available_ram", lambda: int8 - GiB)
    for quantize in (None, "int8"):  # int8 does not fit either: not suggested, and refused when asked for
        with pytest.raises(ModelTooLargeError) as e:
            load_stack(tmp_path, device="cpu", quantize=quantize)
        assert "--quantize int8" not in str(e.value) and "--device cuda" in str(e.value)
        assert f"needs about {memory.gib(int8 if quantize else fp32)} of RAM" in str(e.value)


def test_available_ram_counts_the_page_cache():
    """MemAvailable, not MemFree: after a download the page cache holds most RAM and is given back."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024
    assert 0 < memory.available_ram() <= total


def test_load_refuses_a_model_too_big_for_the_gpu_before_loading(tiny_checkpoints, monkeypatch):
    import torch

    from omnidesk.models.checkpoint import ModelTooLargeError
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    path, _ = tiny_checkpoints("a")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * 2**20, 80 * 2**30))
    with pytest.raises(ModelTooLargeError, match="only 0.0 GiB is free|GiB"):
        load_stack(path, device="cuda", dtype=torch.bfloat16)
