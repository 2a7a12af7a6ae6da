"""Qwen3-Omni as a user manages it: the published layout at the real size, loader errors by file /
tensor / field, `omnidesk models list/verify/download`, `--model qwen3-demo`, doctor and the window's
model picker.

One tiny checkpoint in the published layout (tests/tiny_qwen3.py: written by transformers, experts one
tensor each, vision tensors included) serves the module; damaged checkpoints are private copies.  The
real size is checked on the meta device against the rebuilt published config and tensor list
(tests/data/qwen3_omni).  The CLI tests reuse test_cli.py's clean home (autouse ``home``) and helpers;
the Hugging Face cache is the hub's layout (blobs + symlinked snapshot + refs/main, test_inventory's
``_fake_hub``); the download runs against test_download.py's loopback Hub.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from omnidesk import cli, doctor
from omnidesk.engine.executor import StageError
from omnidesk.gui.model_loader import catalog
from omnidesk.models.checkpoint import CheckpointError, ConfigError, ModelTooLargeError, resolve_checkpoint
from omnidesk.models.choice import WHY_CACHED, choose_model
from omnidesk.models.download import DownloadError, download
from omnidesk.models.families import (MOSHI, QWEN, QWEN3, RECOMMENDED, LoadOptions, family_named, family_of,
                                      load_model, resolve_model, verify)
from omnidesk.models.qwen3_omni.config import Qwen3OmniConfig
from omnidesk.models.qwen3_omni.demo import DEMO_NOTICE, default_demo_dir, is_demo, make_demo
from omnidesk.models.qwen3_omni.executor import Qwen3OmniExecutor, executor_for
from omnidesk.models.qwen3_omni.loading import (UNUSED_PREFIXES, Qwen3OmniModel, check_mapping, load_stack,
                                                weight_map)
from omnidesk.models.qwen3_omni.memory import SMALLER_REPO, check_fits, estimate_memory
from test_cli import FAST_REPLY, QUESTION, home, one_error_line, run_cli  # noqa: F401  (home: autouse clean home)
from test_download import SHA, FakeHub, env  # noqa: F401  (env: an empty cache, sockets to 127.0.0.1 only)
from test_inventory import COMMIT, _fake_hub

DATA = Path(__file__).parent / "data" / "qwen3_omni"
REPO3 = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
THINKING = "Qwen/Qwen3-Omni-30B-A3B-Thinking"
GiB = 2**30
EXPERT = "thinker.model.layers.1.mlp.experts.3.down_proj.weight"
VISION_REASON = UNUSED_PREFIXES["thinker.visual."]


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    """Executors set torch's thread count for the event loop; give it back to the other modules."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def q3_src(tmp_path_factory) -> Path:
    """The tiny Qwen3-Omni checkpoint in the published layout (read-only: copy it to damage it)."""
    import tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_qwen3.write_checkpoint(path)
    return path


@pytest.fixture
def q3(q3_src, tmp_path) -> Path:
    """A private, damageable copy of the tiny checkpoint."""
    dst = tmp_path / "qwen3"
    shutil.copytree(q3_src, dst)
    return dst


@pytest.fixture(scope="module")
def q3_stack(q3_src):
    return load_stack(q3_src)


@pytest.fixture(scope="module")
def q3_hf(q3_src, tmp_path_factory) -> Path:
    """An HF_HOME whose hub holds the tiny checkpoint as Qwen/Qwen3-Omni-30B-A3B-Instruct (do not damage)."""
    root = tmp_path_factory.mktemp("hf-qwen3")
    _fake_hub(root / "hub", REPO3, q3_src)
    return root


@pytest.fixture(scope="module")
def q3_demo_src(tmp_path_factory) -> Path:
    return make_demo(tmp_path_factory.mktemp("qwen3-demo") / "demo")


@pytest.fixture
def q3_demo(q3_demo_src) -> Path:
    """The Qwen3-Omni demo, made, where 'qwen3-demo' finds it in this clean home."""
    target = default_demo_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(q3_demo_src, target_is_directory=True)
    return target


def _snapshot(hf: Path, repo: str) -> Path:
    """Where ``_fake_hub`` put ``repo``'s snapshot under the HF_HOME ``hf``."""
    return hf / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(root: Path, edit) -> None:
    raw = json.loads((root / "config.json").read_text())
    edit(raw)
    (root / "config.json").write_text(json.dumps(raw, indent=2))


def _raises(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        load_stack(*args, **kwargs)
    assert type(info.value) is exc_type, info.value  # ConfigError vs CheckpointError: not each other
    return str(info.value)


def _shard(src: Path, dst: Path, parts: int = 2) -> list[Path]:
    """``src`` rewritten as the hub shards a checkpoint: model-0000i-of-0000n.safetensors + the index."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    step = -(-len(names) // parts)
    shards, weight_map_ = [], {}
    for i in range(parts):
        shard = dst / f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i * step:(i + 1) * step]}
        save_file(chunk, str(shard), metadata={"format": "pt"})
        weight_map_.update({n: shard.name for n in chunk})
        shards.append(shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map_}, indent=2))
    return shards


def _real_config() -> Qwen3OmniConfig:
    return Qwen3OmniConfig.from_file(DATA / "config.json")


def _published_tensors() -> dict[str, tuple[int, ...]]:
    sys.path.insert(0, str(DATA))
    try:
        import dump_shapes
    finally:
        sys.path.remove(str(DATA))
    return {name: tuple(shape) for name, shape in dump_shapes.load_tensors().items()}


# ---------------------------------------------------------------- 1. the published layout at the real size

def test_every_published_tensor_maps_onto_our_modules():
    tensors = _published_tensors()
    assert len(tensors) == 28_010
    report = check_mapping(_real_config(), tensors)
    vision = sorted(n for n in tensors if n.startswith("thinker.visual."))
    assert report.ok and report.missing == [] and report.unexpected == [] and report.mismatched == []
    assert list(report.unused) == [VISION_REASON] and sorted(report.unused[VISION_REASON]) == vision
    assert len(vision) > 0 and len(report.loaded) + len(vision) == 28_010
    # experts are stored one tensor each: all 128 of every thinker layer, all of the talker's
    assert sum(".mlp.experts." in n for n in report.loaded) == 48 * 128 * 3 + 20 * 128 * 3


def test_every_parameter_of_ours_has_exactly_one_source():
    """On the meta device at the real size: every target is a slice of one of our parameters with the
    checkpoint tensor's shape, and the slices of each parameter tile it exactly (no gap, no overlap)."""
    cfg = _real_config()
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg)
    params = dict(model.named_parameters())
    pieces: dict[str, list[tuple]] = {name: [] for name in params}
    for ckpt_name, target in weight_map(cfg, model).items():
        assert target.param in params, (ckpt_name, target.param)  # a parameter, never a computed buffer
        dest = target.destination(params)
        assert tuple(dest.shape) == target.shape, (ckpt_name, tuple(dest.shape), target.shape)
        p = params[target.param]
        rows_dim = 0 if target.index is None else 1
        lo, hi = target.rows or (0, p.shape[rows_dim] if p.dim() > rows_dim else 1)
        pieces[target.param].append((target.index, lo, hi, dest.numel(), ckpt_name))
    for name, got in pieces.items():
        assert got, f"{name}: no checkpoint tensor fills it"
        assert sum(g[3] for g in got) == params[name].numel(), (name, [g[4] for g in got])
        by_entry: dict = {}
        for index, lo, hi, _, ckpt_name in got:
            by_entry.setdefault(index, []).append((lo, hi, ckpt_name))
        if None in by_entry:
            assert len(by_entry) == 1, (name, "both whole and per-entry sources")
        for spans in by_entry.values():
            spans.sort()
            for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
                assert end <= start, f"{name}: {a} and {b} overlap"


def test_memory_at_the_real_size():
    cfg = _real_config()
    tensors = _published_tensors()
    ours = sum(torch.Size(s).numel() for n, s in tensors.items() if not n.startswith("thinker.visual."))
    e = estimate_memory(cfg, torch.bfloat16, 8192)
    assert e.params == ours and round(e.params / 1e9, 2) == 34.72  # 34.72 B without vision
    assert 64.6 <= e.params * 2 / GiB <= 64.7  # ~64.6 GiB in bf16
    assert e.weights + e.vocoder // 2 == e.params * 2  # code2wav is kept in fp32: counted at 4 bytes
    for free_gib in (24, 48):
        message = check_fits(e, free_gib * GiB)
        assert message is not None
        assert message.startswith(f"Qwen3-Omni (34.7B parameters, all 128 experts resident) in bfloat16 with a "
                                  f"context of 8192 tokens needs about {e.total / GiB:.1f} GiB but only "
                                  f"{free_gib:.1f} GiB is free.")
        assert "a shorter context does not help" in message  # the weights alone do not fit
        # what it suggests exists: a published repo the registry can download, not a quantized Qwen3
        assert SMALLER_REPO == "Qwen/Qwen2.5-Omni-7B" and SMALLER_REPO in message and SMALLER_REPO in RECOMMENDED
        assert "quantiz" not in message.lower() and "int4" not in message.lower()
    assert check_fits(e, 80 * GiB) is None
    assert check_fits(estimate_memory(cfg, torch.bfloat16, 4096), 80 * GiB) is None
    # the registry quotes this estimate (8k context), which an 80 GB GPU holds
    assert abs(e.total - RECOMMENDED[REPO3].gpu_memory_gb * 1e9) <= 0.05e9
    # and the download size is the published tensors' (vision included) in bf16
    assert abs(sum(torch.Size(s).numel() for s in tensors.values()) * 2 / 1e9 - RECOMMENDED[REPO3].download_gb) < 1


def test_estimate_matches_the_bytes_of_a_loaded_tiny_stack(q3_src):
    """In bf16, as on a GPU: the LLM weights in bf16, code2wav in fp32, the caches and the talker's rows."""
    stack = load_stack(q3_src, dtype=torch.bfloat16)
    assert {p.dtype for p in stack.code2wav.parameters()} == {torch.float32}
    capacity, codes = 512, 100
    e = estimate_memory(stack.config, stack.dtype, capacity, talker_codes=codes)
    weights = sum(p.numel() * p.element_size() for p in stack.model.parameters())
    assert abs((e.weights + e.vocoder) - weights) <= 0.05 * weights
    ex = Qwen3OmniExecutor(stack, capacity=capacity, max_codec_tokens=codes)
    caches = ex.thinker_cache.nbytes + ex.talker_cache.nbytes
    rows = ex.context_rows.numel() * ex.context_rows.element_size()
    assert abs((e.thinker_kv + e.talker_kv) - caches) <= 0.05 * caches
    assert e.talker_rows == rows
    measured = weights + caches + rows
    assert abs((e.total - e.margin) - measured) <= 0.05 * measured


def test_a_gpu_too_small_is_refused_before_anything_loads(q3_src, tmp_path, monkeypatch):
    """The check comes before the tokenizer and the weights are read: a folder holding only the published
    config.json is refused on a 48 GiB GPU with the estimate and what to do instead."""
    real = tmp_path / "real"
    real.mkdir()
    shutil.copy(DATA / "config.json", real / "config.json")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (48 * GiB, 80 * GiB))
    msg = _raises(ModelTooLargeError, real, device="cuda")
    assert msg.startswith(f"{real}: Qwen3-Omni (34.7B parameters") and "only 48.0 GiB is free" in msg
    assert SMALLER_REPO in msg
    # the tiny one too: its 0.5 GiB working margin does not fit in 50 MiB (no CUDA tensor is ever made)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * 2**20, 80 * GiB))
    msg = _raises(ModelTooLargeError, q3_src, device="cuda", dtype=torch.bfloat16)
    assert msg.startswith(f"{q3_src}: Qwen3-Omni") and "only 0.0 GiB is free" in msg


# ---------------------------------------------------------------- 2. loader errors name the file, tensor or field

def test_a_missing_config_field_is_named(q3):
    _edit_config(q3, lambda raw: raw["talker_config"].pop("accept_hidden_layer"))
    msg = _raises(ConfigError, q3)
    assert msg.startswith(str(q3 / "config.json")) and "talker_config" in msg and "'accept_hidden_layer'" in msg
    report = verify(q3)
    assert not report.ok and report.problems == [msg]


def test_another_familys_config_is_named(q3):
    _edit_config(q3, lambda raw: raw.__setitem__("model_type", "qwen2_5_omni"))
    msg = _raises(ConfigError, q3)
    assert msg == (f"{q3 / 'config.json'}: not a Qwen3-Omni checkpoint (model_type is 'qwen2_5_omni'; "
                   f"expected 'qwen3_omni_moe')")
    assert family_of(q3) is QWEN  # the registry sends it to its own family


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "preprocessor_config.json", "model.safetensors"])
def test_a_missing_file_is_named(q3, name):
    (q3 / name).unlink()
    msg = _raises(CheckpointError, q3)
    assert msg.startswith(f"{q3}: missing file {name}"), msg


def test_a_missing_expert_is_named(q3):
    _rewrite(q3 / "model.safetensors", lambda t: t.pop(EXPERT))
    assert _raises(CheckpointError, q3) == f"{q3}: missing weights: {EXPERT}"
    assert verify(q3).problems == [f"{q3}: missing weights: {EXPERT}"]


def test_a_wrong_shape_is_named(q3):
    _rewrite(q3 / "model.safetensors", lambda t: t.__setitem__(EXPERT, torch.zeros(128, 65)))
    assert _raises(CheckpointError, q3) == f"{q3}: tensor '{EXPERT}' has shape [128, 65], expected [128, 64]"


def test_a_truncated_or_corrupt_file_is_named(q3):
    f = q3 / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert _raises(CheckpointError, q3).startswith(f"{f}: truncated: tensor '")
    corrupt = bytearray(data)
    corrupt[:8] = struct.pack("<Q", 2**60)
    f.write_bytes(bytes(corrupt))
    assert _raises(CheckpointError, q3).startswith(f"{f}: corrupt safetensors header (length {2**60} > file size")
    corrupt = bytearray(data)
    corrupt[8:20] = b"{not json at"
    f.write_bytes(bytes(corrupt))
    assert _raises(CheckpointError, q3).startswith(f"{f}: corrupt safetensors header (")


def test_a_sharded_checkpoint_loads_like_the_single_file(q3_src, q3_stack, tmp_path):
    root = tmp_path / "sharded"
    shards = _shard(q3_src, root)
    multi = load_stack(root)
    one, many = dict(q3_stack.model.named_parameters()), dict(multi.model.named_parameters())
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    report = verify(root)
    assert report.ok, report.problems
    assert "model.safetensors.index.json (2 shards)" in report.checked
    # a shard gone, and an index naming a tensor its shard does not hold: both named
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["thinker.model.extra.weight"] = shards[0].name
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _raises(CheckpointError, root) == (f"{shards[0]}: tensor 'thinker.model.extra.weight' is listed in "
                                              f"the index but not in the file")
    shards[1].unlink()
    assert _raises(CheckpointError, root) == (f"{root}: missing shard {shards[1].name} (listed in "
                                              f"model.safetensors.index.json)")


def _make_thinker_only(root: Path) -> None:
    """Turn ``root`` into the layout of a -Thinking / -Captioner checkpoint: the thinker alone."""
    _edit_config(root, lambda raw: raw.__setitem__("enable_audio_output", False))
    for f in root.glob("*.safetensors"):
        _rewrite(f, lambda t: [t.pop(k) for k in list(t) if k.startswith(("talker.", "code2wav."))])


def test_a_checkpoint_without_a_talker_is_intact_but_not_supported(q3):
    _make_thinker_only(q3)
    msg = _raises(CheckpointError, q3)
    assert msg.startswith(f"{q3}: this checkpoint has no talker (enable_audio_output is false")
    assert "needs one that speaks" in msg
    # not "damaged": the download is fine (its thinker tensors all map), OmniDesk just cannot speak with it
    report = verify(q3)
    assert report.problems == [] and not report.usable
    assert report.unsupported.startswith("text only, no speech output (enable_audio_output is false")
    assert any(line.startswith("tensor names and shapes") for line in report.checked)
    assert not any(line.startswith("load test") for line in report.checked)  # the loader would refuse it


def test_a_voice_the_config_does_not_have(q3_src, q3_stack):
    ex = executor_for(q3_stack)
    ex.begin_user_turn()
    ex.add_user_audio(sf.read(str(QUESTION), dtype="float32")[0][:16000])
    ex.end_user_turn()
    with pytest.raises(StageError) as info:
        ex.start_reply(voice="nobody")
    assert info.value.stage == "voice" and isinstance(info.value.cause, KeyError)
    msg = str(info.value)
    assert str(q3_src / "config.json") in msg and "'nobody'" in msg
    assert "talker_config.speaker_id has: Aiden, Chelsie, Ethan" in msg
    ex.start_reply(voice="chELSie")  # names are the config's, any case
    assert ex._reply.voice == "Chelsie"
    # through the registry: refused at load, with what the model has
    with pytest.raises(CheckpointError, match=r"^unknown voice 'nobody'; this model has: Aiden, Chelsie, Ethan$"):
        QWEN3.load(q3_src, "cpu", LoadOptions(voice="nobody"))
    loaded = QWEN3.load(q3_src, "cpu", LoadOptions(voice="ethan"))
    assert isinstance(loaded.executor, Qwen3OmniExecutor) and not loaded.demo
    # the default speaker first (front ends start on voices[0]): Ethan, as the reference's generate()
    assert loaded.voices == ["Ethan", "Aiden", "Chelsie"] and loaded.stack.default_voice == "Ethan"
    # decode: the runner's mode (eager in the tests, omnidesk/models/runner.py)
    assert loaded.model_info == {"path": str(q3_src), "family": "qwen3_omni", "demo": False, "dtype": "float32",
                                 "decode": "eager"}


# ---------------------------------------------------------------- 3. models list / verify / download, the demo name

def test_models_list_and_verify_a_cached_qwen3(capsys, monkeypatch, q3_hf, q3_src):
    monkeypatch.setenv("HF_HOME", str(q3_hf))
    snap = _snapshot(q3_hf, REPO3)
    assert resolve_checkpoint(REPO3) == snap and resolve_model(REPO3) == (snap, QWEN3)
    rc, out, _ = run_cli(capsys, "models", "list")
    lines = out.splitlines()
    assert rc == 0 and lines[:2] == [REPO3, f"    {snap}"], out
    assert lines[2].startswith("    Qwen3-Omni, 0.01 GB, ") and lines[2].endswith(
        " params, float32, voices: Aiden, Chelsie, Ethan, ok"), lines[2]
    assert "no real checkpoint found" not in out
    # the automatic choice (CLI and window) takes it
    choice = choose_model(None)
    assert (choice.source, choice.why) == (REPO3, WHY_CACHED)

    rc, out, _ = run_cli(capsys, "models", "verify", REPO3)
    assert rc == 0 and "verified: no problems" in out, out
    assert f"  Qwen3-Omni checkpoint at {snap}" in out
    vision = sum(1 for n in load_file(q3_src / "model.safetensors") if n.startswith("thinker.visual."))
    assert f"; {vision} vision tensors not used)" in out
    assert "  ok  load test: loaded on the CPU in float32, one thinker decode step" in out
    assert "noise" not in out  # not the demo
    rc, out, _ = run_cli(capsys, "--model", REPO3, "models", "verify", "--no-load-test")
    assert rc == 0 and "load test skipped (--no-load-test)" in out and "verified: no problems" in out


def test_models_verify_and_list_name_what_is_wrong(capsys, monkeypatch, q3_src, tmp_path):
    hf = tmp_path / "hf"
    snap = _fake_hub(hf / "hub", REPO3, q3_src)
    _make_thinker_only(_fake_hub(hf / "hub", THINKING, q3_src))  # writes through the hub's symlinks
    monkeypatch.setenv("HF_HOME", str(hf))
    _rewrite(snap / "model.safetensors", lambda t: t.pop(EXPERT))  # writes through the hub's symlink
    (snap / "tokenizer.json").unlink()
    rc, out, _ = run_cli(capsys, "models", "verify", REPO3)
    assert rc == 1 and out.splitlines()[-1] == "2 problem(s)", out
    assert f"  !!  {snap}: missing file tokenizer.json" in out
    assert f"  !!  {snap}: missing weights: {EXPERT}" in out
    assert "load test:" not in out  # no load test on a damaged checkpoint
    rc, out, _ = run_cli(capsys, "models", "verify", THINKING)
    assert rc == 1 and "verified: no problems" in out
    assert "  !!  OmniDesk cannot run this checkpoint: text only, no speech output" in out
    rc, out, _ = run_cli(capsys, "models", "list")
    assert rc == 0 and out.count("BROKEN") == 1
    assert f"    problem: {snap}: missing weights: {EXPERT}" in out
    assert "NOT SUPPORTED (text only, no speech output" in out and "problem:" not in out.split(THINKING)[1]
    # the window's picker says the same, not "damaged"
    labels = {e.source: e.label for e in catalog() if not e.demo}
    assert labels[REPO3] == f"{REPO3} (damaged)"
    assert labels[THINKING].startswith(f"{THINKING} (not supported: text only, no speech output")
    # neither is chosen automatically: the demo comes first
    assert choose_model(None).source == "demo"
    # a truncated file is named too
    f = snap / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, out, _ = run_cli(capsys, "models", "verify", REPO3, "--no-load-test")
    assert rc == 1 and f"  !!  {f}: truncated: tensor '" in out


def test_the_demo_name_make_demo_and_verify(capsys, q3_demo_src):
    assert family_named("qwen3") is QWEN3 and family_named("Qwen3-Omni") is QWEN3 and QWEN3.demo_name == "qwen3-demo"
    rc, out, _ = run_cli(capsys, "models", "verify", "qwen3-demo")
    assert rc == 1 and "the Qwen3-Omni demo model is not made yet" in out
    assert "omnidesk models make-demo --family qwen3_omni" in out
    with pytest.raises(CheckpointError, match="make-demo --family qwen3_omni"):
        resolve_model("qwen3-demo")
    # what the message says to run works (the default place is in this test's clean cache)
    rc, out, _ = run_cli(capsys, "models", "make-demo", "--family", "qwen3_omni")
    assert rc == 0 and str(default_demo_dir()) in out and "--model qwen3-demo names it" in out and DEMO_NOTICE in out
    assert resolve_model("qwen3-demo") == (default_demo_dir(), QWEN3) and QWEN3.is_demo(default_demo_dir())
    # the recipe is deterministic: the same files as the module's demo
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (default_demo_dir() / name).read_bytes() == (q3_demo_src / name).read_bytes(), name
    rc, out, _ = run_cli(capsys, "models", "verify", "qwen3-demo")
    assert rc == 0 and "Qwen3-Omni checkpoint at" in out and DEMO_NOTICE in out and "verified: no problems" in out
    rc, out, _ = run_cli(capsys, "models", "list")
    assert out.splitlines()[0] == "qwen3-demo  (the demo model: random weights, its replies are noise)"
    loaded = load_model("qwen3-demo", "cpu")
    assert loaded.family is QWEN3 and loaded.demo and isinstance(loaded.executor, Qwen3OmniExecutor)
    assert is_demo(loaded.stack.config.raw) and loaded.voices[0] == "Ethan"


def test_talk_and_reply_with_the_qwen3_demo(capsys, tmp_path):
    """`--model qwen3-demo` in a clean home: the demo is made on first use, then talks (noise)."""
    out_wav, timeline = tmp_path / "o.wav", tmp_path / "t.json"
    assert not default_demo_dir().exists()
    rc, out, err = run_cli(capsys, "--model", "qwen3-demo", "talk", "--input", QUESTION, "--output", out_wav,
                           "--timeline", timeline, "--fast", "--end-of-turn", "fixed")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("model: qwen3-demo (given with --model); device: cpu (")
    assert lines[1].startswith(f"demo model at {default_demo_dir()} (") and QWEN3.is_demo(default_demo_dir())
    assert f"NOTE: {DEMO_NOTICE}" in out and "noise" in out
    assert f"wrote {out_wav}" in out
    info = sf.info(str(out_wav))
    assert info.samplerate == 24000 and info.frames / info.samplerate > sf.info(str(QUESTION)).duration
    data = json.loads(timeline.read_text())
    assert data["model"]["family"] == "qwen3_omni" and data["model"]["demo"] is True
    (turn,) = data["turns"]
    assert turn["text_token_ids"] and 0 < len(turn["codec_token_ids"]) <= 75 and turn["reply_audio_s"] > 0
    # an unknown voice is a user error, said in one line when the model loads (before the conversation)
    rc, _, err = run_cli(capsys, "--model", "qwen3-demo", "talk", "--voice", "nobody", "--input", QUESTION,
                         "--output", out_wav, "--timeline", timeline, "--fast")
    assert rc == 2 and one_error_line(err) == "error: unknown voice 'nobody'; this model has: Chelsie, Ethan, Aiden"
    # the one-turn tools (`omnidesk reply`) are the family's own
    rc, out, err = run_cli(capsys, "--model", "qwen3-demo", "reply", "--input", QUESTION, *FAST_REPLY,
                           "--output", tmp_path / "r.wav")
    assert rc == 0, err
    assert f"NOTE: {DEMO_NOTICE}" in out and "heard 2.20 s" in out and "speech tokens: " in out
    assert sf.info(str(tmp_path / "r.wav")).samplerate == 24000


@contextlib.contextmanager
def _hub_serving(monkeypatch, repo: str, files: dict[str, bytes]):
    """test_download's loopback Hub, serving ``files`` as ``repo``; no other request may arrive."""
    import test_download

    monkeypatch.setattr(test_download, "REPO", repo)  # the Hub answers for its module's REPO
    hub = FakeHub(files)
    hub.thread.start()
    try:
        yield hub
    finally:
        hub.server.shutdown()
        hub.server.server_close()
        hub.thread.join(5)
    assert not hub.unexpected, f"unexpected requests: {hub.unexpected}"


def test_download_help_and_a_download_of_the_published_name(capsys, monkeypatch, env, q3_src):
    """`models --help` lists the repo; `models download` says what it needs once, then fetches the files the
    loader reads (from a Hub on 127.0.0.1 serving the tiny checkpoint under the published name)."""
    def help_text(*argv) -> str:
        with pytest.raises(SystemExit) as info:
            cli.main(list(argv))
        assert info.value.code == 0
        return "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too

    models = help_text("models", "--help")
    assert "resumable):Qwen/Qwen2.5-Omni-3B," in models and REPO3 in models
    top = help_text("--help")
    assert REPO3 in top and "'qwen3-demo'(Qwen3-Omni)" in top and "(Qwen2.5-Omni,Moshi,Qwen3-Omni)" in top
    assert help_text("models", "download", "--help").startswith("usage:omnideskmodelsdownload")
    rec = RECOMMENDED[REPO3]
    assert QWEN3.repos == {REPO3: rec} and rec.gpu_memory_gb == 78.5

    files = {p.name: p.read_bytes() for p in sorted(q3_src.iterdir()) if p.is_file()}
    with _hub_serving(monkeypatch, REPO3, {**files, "README.md": b"# Qwen3-Omni\n"}) as hub:
        rc, out, err = run_cli(capsys, "models", "download", REPO3, "--endpoint", hub.endpoint, "--no-progress")
    snap = env / ("models--" + REPO3.replace("/", "--")) / "snapshots" / SHA
    assert rc == 0, err
    assert out.splitlines() == [f"{REPO3}: {rec.summary()}", f"downloaded to {snap}",
                                f"use it with: omnidesk --model {REPO3}"]
    assert out.count("GB to download") == 1 and "80 GB GPU" in out
    assert {p.name for p in snap.iterdir()} == set(files)  # not the README
    report = verify(REPO3)
    assert report.ok and report.family == "qwen3_omni" and report.path == snap, report.problems


def test_download_takes_every_familys_published_layout(monkeypatch, env):
    """The check after a download asks the registry: Moshi's published repos have no config.json."""
    from omnidesk.models.moshi.config import MIMI_NAME, MOSHI_NAME, TOKENIZER_NAME

    repo = "kyutai/moshiko-pytorch-bf16"
    with _hub_serving(monkeypatch, repo, {MOSHI_NAME: b"lm", MIMI_NAME: b"mimi", TOKENIZER_NAME: b"spm"}) as hub:
        snap = download(repo, endpoint=hub.endpoint, progress=False)
    assert not (snap / "config.json").exists() and family_of(snap) is MOSHI and resolve_checkpoint(repo) == snap
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights"}
    with _hub_serving(monkeypatch, "Org/Llama", files) as hub:
        with pytest.raises(DownloadError) as info:
            download("Org/Llama", endpoint=hub.endpoint, progress=False)
    # refused on its config.json: the weights were never fetched
    assert str(info.value) == (f"Org/Llama on {hub.endpoint} is not a checkpoint OmniDesk can run (its config.json "
                               f"has model_type 'llama'; supported: Qwen2.5-Omni, Moshi, Qwen3-Omni); nothing else "
                               f"was downloaded.")
    assert hub.gets() == {"config.json"}
    # a repo with no config.json that no family knows is judged once its files are there
    with _hub_serving(monkeypatch, "Org/Odd", {"model.safetensors": b"weights"}) as hub:
        with pytest.raises(DownloadError) as info:
            download("Org/Odd", endpoint=hub.endpoint, progress=False)
    assert str(info.value).startswith(f"Org/Odd on {hub.endpoint} does not look like a checkpoint OmniDesk can "
                                      f"run (no family recognises the files in ")


def test_a_text_only_qwen3_repo_is_refused_before_its_weights(monkeypatch, env, q3_src):
    """Qwen3-Omni-30B-A3B-Thinking is ~70 GB that cannot speak: refused once its config.json is read."""
    raw = json.loads((q3_src / "config.json").read_text())
    raw["enable_audio_output"] = False
    files = {"config.json": json.dumps(raw).encode(), "model.safetensors": (q3_src / "model.safetensors").read_bytes()}
    with _hub_serving(monkeypatch, THINKING, files) as hub:
        with pytest.raises(DownloadError) as info:
            download(THINKING, endpoint=hub.endpoint, progress=False)
    assert str(info.value) == (f"{THINKING} is a Qwen3-Omni checkpoint OmniDesk cannot run: text only, no speech "
                               f"output (enable_audio_output is false: a -Thinking or -Captioner model); use "
                               f"Qwen/Qwen3-Omni-30B-A3B-Instruct. Nothing else was downloaded.")
    assert hub.gets() == {"config.json"}


def test_doctor_knows_qwen3(monkeypatch, q3_hf, q3_demo, tmp_path):
    monkeypatch.setenv("HF_HOME", str(q3_hf))
    check = doctor.check_models()
    assert check.ok and f"{REPO3} (Qwen3-Omni)" in check.detail
    assert f"qwen3-demo at {q3_demo}" in doctor.check_demo().detail
    assert "78.5 GB for Qwen3-Omni" in doctor._gpu_needs()
    # a download that stopped before any file landed
    hub = tmp_path / "hf" / "hub"
    (hub / ("models--" + REPO3.replace("/", "--")) / "blobs").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    check = doctor.check_models()
    assert not check.ok and f"incomplete download of {REPO3}" in check.detail
    assert check.fix == f"omnidesk models download {REPO3}"


# ---------------------------------------------------------------- 4. the window's model picker

def test_model_picker_lists_qwen3_and_opens_the_cached_checkpoint(request, monkeypatch, tmp_path, q3_hf, q3_demo):
    pytest.importorskip("pytestqt")
    qtbot = request.getfixturevalue("qtbot")
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from omnidesk.gui.model_loader import DEMO, catalog
    from omnidesk.gui.settings import Settings
    from test_gui import close_window, open_window, say, turn, wait_listening

    monkeypatch.setenv("HF_HOME", str(q3_hf))
    QApplication.setOrganizationName("OmniDesk-tests")
    entries = catalog()
    assert [(e.source, e.label, e.usable, e.demo) for e in entries] == [
        (REPO3, REPO3, True, False),
        (DEMO, "Demo model (replies are noise)", True, True),
        ("moshi-demo", "Moshi demo (full duplex) (replies are noise)", True, True),
        ("qwen3-demo", "Qwen3-Omni demo (replies are noise)", True, True)]

    settings = Settings(QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    w = open_window(qtbot, settings, tmp_path, "qwen3-demo", find_models=None)  # the real find_checkpoints
    try:
        wait_listening(qtbot, w)
        assert w.loaded.demo and w.loaded.family_title == "Qwen3-Omni"
        assert isinstance(w.loaded.executor, Qwen3OmniExecutor)
        assert w.demo_banner.isVisible() and "Qwen3-Omni demo model" in w.demo_banner.text
        voices = [w.voice_picker.itemText(i) for i in range(w.voice_picker.count())]
        assert voices == ["Ethan", "Chelsie", "Aiden"] and w.voice_picker.currentText() == "Ethan"
        # int8 on load is a Qwen2.5-Omni option: greyed out here, saying so
        assert not w.weights_picker.isEnabled()
        assert w.weights_picker.toolTip().startswith("Qwen3-Omni loads its weights as stored")
        # one turn on the demo through the window's engine
        say(qtbot, w)
        qtbot.waitUntil(lambda: turn(w, 1) is not None and turn(w, 1).done, timeout=60000)
        assert turn(w, 1).text_tokens > 0

        qtbot.waitUntil(lambda: w.model_picker.count() == 6)
        items = [w.model_picker.itemText(i) for i in range(w.model_picker.count())]
        assert items[:4] == [e.label for e in entries] and "folder" in items[4] and items[5] == "Server…"
        assert w.model_picker.currentData() == "qwen3-demo"
        index = w.model_picker.findData(REPO3)
        w.model_picker.setCurrentIndex(index)
        w.model_picker.activated.emit(index)
        qtbot.waitUntil(lambda: w.loaded is not None and w.loaded.choice.source == REPO3, timeout=60000)
        loaded = w.loaded
        assert isinstance(loaded.executor, Qwen3OmniExecutor) and not loaded.demo
        assert loaded.family_title == "Qwen3-Omni" and not loaded.duplex
        assert loaded.stack.path == resolve_checkpoint(REPO3)
        assert loaded.timeline_model_info()["family"] == "qwen3_omni"
        assert not w.demo_banner.isVisible() and settings.model == REPO3
        assert w.voice_picker.currentText() == "Ethan"
        wait_listening(qtbot, w)
    finally:
        close_window(w)
