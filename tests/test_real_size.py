"""A real-size run: Qwen2.5-Omni-3B shapes from disk, loaded in bf16 on the CPU, one spoken turn.

tests/real_checkpoint.py writes (once; it is cached, keyed by its recipe) a
checkpoint at the real 3B shapes with random weights in the published file
layout: sharded safetensors with their index, the real config.json, the side
files, a tokenizer with the added tokens at the real ids and spk_dict.pt with
the published voices.  Here it goes through the normal loader, exactly as a
user's download would, and the engine's executor runs one short turn: 0.6 s
of speech in, a few text tokens, codec tokens until the vocoder's first chunk
(36 codes), which must be audio.  The weights are noise: only shapes, layout,
finiteness and that every stage runs are checked.

Cost on the 2-core, 24 GB test machine, quiet / shared with other jobs (the
test then got ~60% of the CPU): writing the checkpoint (once per recipe,
12 GB) 72 s / 128 s; loading 10-16 s / 33-67 s; the turn 43-125 s / 365-375 s
(with the previous plan's 36-code first chunk; its 36 velocity evaluations dominated); the whole
test 3.7 min cold and 1.1 min warm / 9.4 min cold and 7.6 min warm.  Peak RSS
13.2 GB while loading (11.0 GB anonymous = one copy of the weights, 10.6 GB,
plus the mapped pages of the shard being read, up to 5 GB of page cache) and
11.3 GB during the turn.  The numbers of the last run are printed (-s) and kept
in real_size_last_run.json next to the cached checkpoint.
"""

import gc
import json
import re
import resource
import threading
import time

import numpy as np
import pytest
import torch

import real_checkpoint
from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor, thinker_defaults
from omnidesk.models.families import verify
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.reply import talker_defaults
from omnidesk.models.qwen2_5_omni.vocoder import StreamingPlan

SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
SIDE_FILES = {"config.json", "generation_config.json", "preprocessor_config.json", "chat_template.json",
              "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
              "special_tokens_map.json", "spk_dict.pt", "model.safetensors.index.json"}
_PLAN = StreamingPlan()
# first vocoder chunk: (its mel frames + its DiT look-ahead) / 2 mel frames per code
FIRST_CHUNK_CODES = (_PLAN.first_chunk_frames + _PLAN.future(0)) // 2
# The stand-in tokenizer splits the speech system prompt into 84 tokens (the real one into ~35), and
# bf16 prefill runs at ~1 token/s on the test machine's 2 cores: a short prompt keeps the turn cheap.
SYSTEM_PROMPT = "You are Qwen."
NEEDS_RAM = 13e9  # one copy of the weights (10.6 GB) plus caches and the shard being read


def mem_available() -> float:
    """MemAvailable of /proc/meminfo (free memory plus reclaimable page cache); inf where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


class PeakMemory:
    """Peak resident memory of this process while in the block: all of it, and the anonymous part
    (weights, caches) apart from file pages mapped while reading the shards."""

    def __init__(self, every_s: float = 0.05):
        self.every_s = every_s
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()

    def _sample(self):
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)

    def _run(self):
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def gb(self) -> dict:
        return {k: round(v / 1e9, 2) for k, v in self.peak.items()}


@torch.inference_mode()
def test_real_3b_checkpoint_from_disk_speaks_one_turn(speech_like):
    if mem_available() < NEEDS_RAM:  # loading would get this whole test run killed
        pytest.skip(f"the real-size run needs about {NEEDS_RAM / 1e9:.0f} GB of RAM, "
                    f"{mem_available() / 1e9:.1f} GB is available")
    t_start, cpu_start = time.perf_counter(), time.process_time()
    log = []
    try:
        path, write_s = real_checkpoint.ensure_checkpoint(log=log.append)
    except real_checkpoint.NoRoom as e:
        pytest.skip(str(e))
    write_cpu_s = time.process_time() - cpu_start

    # -- the published layout
    files = {p.name for p in path.iterdir()}
    shards = sorted(f for f in files if SHARD.fullmatch(f))
    assert files - set(shards) == SIDE_FILES
    assert len(shards) >= 2 and all(SHARD.fullmatch(s).group(2) == f"{len(shards):05d}" for s in shards)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert len(index["weight_map"]) == 2544  # transformers' 2543 + the hub-only DiT inv_freq
    assert sum(n.startswith("thinker.visual.") for n in index["weight_map"]) == 518
    assert max((path / s).stat().st_size for s in shards) <= real_checkpoint.MAX_SHARD_BYTES + 10**6
    assert (path / "config.json").read_bytes() == real_checkpoint.CONFIG.read_bytes()
    report = verify(path, load_test=False)
    assert report.ok, report.problems
    assert "spk_dict.pt (2 voices)" in report.checked

    # -- the normal loader, from disk, bf16 on the CPU
    with PeakMemory() as load_mem:
        t0, c0 = time.perf_counter(), time.process_time()
        stack = load_stack(path, device="cpu", dtype=torch.bfloat16)
        load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    cfg = stack.config
    assert (cfg.thinker.text.hidden_size, cfg.thinker.text.num_layers) == (2048, 36)
    assert stack.thinker.embed_tokens.weight.dtype == torch.bfloat16
    assert stack.vocoder.dit.proj_out.weight.dtype == torch.float32
    assert {n: v.bos_token for n, v in stack.voices.items()} == {"Chelsie": 151872, "Ethan": 151870}
    assert stack.default_voice == "Chelsie"
    assert all(v.cond.shape == (192,) and v.ref_mel.shape == (400, 80) for v in stack.voices.values())
    assert stack.tokenizer.special_ids["audio"] == cfg.thinker.audio_token_id == 151646
    weights_gb = sum(p.numel() * p.element_size() for p in stack.model.parameters()) / 1e9

    # -- one spoken turn through the engine's executor
    threads = torch.get_num_threads()
    try:
        with PeakMemory() as turn_mem:
            t0, c0 = time.perf_counter(), time.process_time()
            # as executor_for builds it for the front ends (the checkpoint's decoding defaults)
            ex = QwenOmniExecutor(stack, capacity=512, max_reply_tokens=3, max_codec_tokens=FIRST_CHUNK_CODES + 12,
                                  system_prompt=SYSTEM_PROMPT, thinker_sampling=thinker_defaults(stack),
                                  talker_sampling=talker_defaults(stack))
            torch.set_num_threads(threads)  # no event loop runs here: give torch every core again
            ex.begin_user_turn()
            ex.add_user_audio(speech_like(0.6, seed=11).numpy())
            prompt = ex.end_user_turn()
            t_prompt, c_prompt = time.perf_counter() - t0, time.process_time() - c0
            # the random init keeps 36 bf16 layers finite: the thinker's output rows of the prompt
            assert torch.isfinite(ex.context_rows[:ex.prompt_end]).all()
            ex.start_reply(seed=0)
            chunks = []
            while not chunks and not (ex.thinker_done and ex.talker_done):
                ex.thinker_step()
                if ex.talker_step() is not None:
                    chunks += ex.vocoder_step()
            streamed = bool(chunks)
            if not chunks:  # the talker stopped before a whole first chunk: the rest is flushed
                chunks += ex.vocoder_step(final=True)
            turn_s, turn_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(threads)
    text, codes = ex.reply_text_ids, ex.reply_codec_ids
    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    assert audio.size > 0 and np.isfinite(audio).all()
    assert text and codes
    assert all(0 <= c < stack.vocoder.codec_table_size for c in codes)
    if streamed:
        assert len(codes) >= FIRST_CHUNK_CODES

    result = {
        "checkpoint": str(path), "write_s": round(write_s, 1), "write_cpu_s": round(write_cpu_s, 1) if write_s else 0,
        "load_s": round(load_s, 1), "load_cpu_s": round(load_cpu_s, 1),
        "prompt_tokens": len(prompt), "prompt_s": round(t_prompt, 1), "prompt_cpu_s": round(c_prompt, 1),
        "turn_s": round(turn_s, 1), "turn_cpu_s": round(turn_cpu_s, 1),
        "text_tokens": len(text), "codec_tokens": len(codes), "audio_s": round(audio.size / ex.sample_rate_out, 2),
        "first_chunk_streamed": streamed, "weights_gb": round(weights_gb, 2), "peak_load_gb": load_mem.gb(),
        "peak_turn_gb": turn_mem.gb(),
        "ru_maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        "test_s": round(time.perf_counter() - t_start, 1), "threads": threads, "write_log": log,
    }
    del ex, stack
    gc.collect()
    print(json.dumps(result, indent=2))
    (real_checkpoint.cache_root() / "real_size_last_run.json").write_text(json.dumps(result, indent=2) + "\n")
