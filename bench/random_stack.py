#!/usr/bin/env python
"""Random-weight Qwen2.5-Omni stacks of the real 3B / 7B shapes, built directly on the device.

No download and no checkpoint files for the weights: the real config.json
(tests/data/qwen2_5_omni_{3b,7b}) gives the shapes, our modules are built on
the meta device and materialised on the target device in the target dtype
(the vocoder in fp32, as always), and filled with seeded random values
(omnidesk/models/random_init.py, the init of the demo and of the real-size test
checkpoint).  The tokenizer is a small stand-in written to a temp dir (the
model's vocabulary is larger than the tokenizer's, as with the real files); the
voices are random, in the published spk_dict.pt shapes (cond [1, 192], ref_mel
[1, 400, 80]), read through the loader's voice check.  Then `omnidesk bench`
runs on it and the JSON lands in --out.

    python3 bench/random_stack.py --size 7b --device cuda --dtype bfloat16 --out results/7b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnidesk.models.qwen2_5_omni import bench  # noqa: E402
from omnidesk.models.qwen2_5_omni.config import OmniConfig  # noqa: E402
from omnidesk.models.qwen2_5_omni.demo import PREPROCESSOR  # noqa: E402
from omnidesk.models.features import FeatureConfig  # noqa: E402
from omnidesk.models.checkpoint import materialize  # noqa: E402
from omnidesk.models.qwen2_5_omni.loading import OmniModel, OmniStack, VoiceDims, voice_from_entry  # noqa: E402
from omnidesk.models.random_init import init_module_  # noqa: E402
from omnidesk.models.qwen2_5_omni.tokenizer import Tokenizer, write_tokenizer_files  # noqa: E402


def build(config_path: Path, device: str, dtype: torch.dtype, seed: int = 0) -> OmniStack:
    raw = json.loads(config_path.read_text())
    text_vocab = raw["thinker_config"]["text_config"]["vocab_size"]
    first = raw["thinker_config"]["audio_token_index"] - 3  # where the real added tokens begin
    tmp = Path(tempfile.mkdtemp(prefix="omnidesk-random-"))
    ids = write_tokenizer_files(tmp, vocab_size=text_vocab, first_special_id=first)
    (tmp / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    # The stand-in tokenizer orders its special tokens its own way: point the config's ids at them
    # (same shapes, and every id still comes from config + tokenizer, as at run time).
    th, tk = raw["thinker_config"], raw["talker_config"]
    th.update(audio_token_index=ids["audio"], audio_start_token_id=ids["audio_bos"], audio_end_token_id=ids["audio_eos"])
    tk.update(tts_text_start_token_id=ids["tts_text_bos"], tts_text_end_token_id=ids["tts_text_eod"],
              tts_text_pad_token_id=ids["tts_text_pad"])
    cfg = OmniConfig.from_dict(raw, str(config_path))
    with torch.device("meta"):
        model = OmniModel(cfg)
    dev = torch.device(device)
    materialize(model.thinker, dev, dtype)
    materialize(model.talker, dev, dtype)
    materialize(model.vocoder, dev, torch.float32)
    init_module_(model, torch.Generator(device=dev).manual_seed(seed))
    model.eval()
    cpu = torch.Generator().manual_seed(seed)
    dims = VoiceDims.of(cfg)
    voices = {}
    for i, name in enumerate(("Chelsie", "Ethan")):
        entry = {"bos_token": ids[f"speaker_{i}"], "cond": torch.randn(1, dims.cond, generator=cpu),
                 "ref_mel": torch.randn(1, 400, dims.mel, generator=cpu)}
        voices[name] = voice_from_entry(name, entry, dims, "random voices")
    return OmniStack(path=tmp, config=cfg, model=model, tokenizer=Tokenizer.from_dir(tmp),
                     features=FeatureConfig.from_preprocessor_config(tmp / "preprocessor_config.json"),
                     voices=voices, generation_config={}, dtype=dtype, device=dev)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["3b", "7b"], help="real shapes from tests/data")
    p.add_argument("--config", help="any config.json instead of --size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--interrupts", type=int,
                   help="interruptions timed (default 50 on a GPU; 3 on the CPU, where a real-size stack runs "
                        "~1 token/s and the run is a smoke test that every stage works at these shapes)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    config = Path(args.config) if args.config else ROOT / "tests" / "data" / f"qwen2_5_omni_{args.size}" / "config.json"
    t0 = time.perf_counter()
    stack = build(config, args.device, getattr(torch, args.dtype))
    built = time.perf_counter() - t0
    interrupts = args.interrupts if args.interrupts is not None else (50 if stack.device.type == "cuda" else 3)
    result = bench.run(stack, turns=args.turns, interrupts=interrupts, with_transformers=False)
    result["build_s"] = built
    result["config"] = str(config)
    if torch.cuda.is_available():
        result["gpu"] = {"name": torch.cuda.get_device_name(), "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
