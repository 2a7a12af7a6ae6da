"""The real 3B and 7B checkpoints' tensor names and shapes map completely onto our modules.

The config.json files in tests/data were rebuilt from public sources
(tests/data/README.md).  transformers instantiates each on the meta device; the
names save_pretrained would write are the hub names.  Every one must be either
loaded into our thinker, talker or vocoder (token2wav) with the right shape,
or be a known unused part (the vision encoder, a recomputed buffer) - and
every parameter of ours must have a source.
"""

import sys
from pathlib import Path

import pytest
import torch

from omnidesk.models.qwen2_5_omni.config import OmniConfig
from omnidesk.models.qwen2_5_omni.loading import OmniModel, check_mapping

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))


@pytest.mark.parametrize("size", ["3b", "7b"])
def test_real_checkpoint_names_and_shapes_map_completely(size):
    from dump_real_shapes import build_meta, saved_names

    _, ref = build_meta(DATA / f"qwen2_5_omni_{size}")
    shapes = {name: tuple(t.shape) for name, t in saved_names(ref, ref.state_dict()).items()}
    cfg = OmniConfig.from_file(DATA / f"qwen2_5_omni_{size}" / "config.json")
    with torch.device("meta"):
        ours = OmniModel(cfg)
    report = check_mapping(cfg, shapes, ours)
    assert report.mismatched == []
    assert report.missing == []
    assert report.unexpected == []
    assert len(report.loaded) + sum(map(len, report.unused.values())) == len(shapes)
    assert set(report.unused) == {"vision encoder (OmniDesk takes audio only)"}
    assert all(n.startswith("thinker.visual.") for n in next(iter(report.unused.values())))
    vocoder = [n for n in report.loaded if n.startswith("token2wav.")]
    assert len(vocoder) == 808  # DiT 359 + BigVGAN 449 (the hub adds the recomputed rotary inv_freq)
    # every parameter of ours is filled, fused ones exactly row by row
    from omnidesk.models.qwen2_5_omni.loading import weight_map

    covered = {}
    for target in weight_map(cfg, ours).values():
        covered.setdefault(target.param, []).append(target.rows)
    params = dict(ours.named_parameters())
    assert set(covered) == set(params)
    for name, rows in covered.items():
        if rows != [None]:
            spans = sorted(rows)
            assert spans[0][0] == 0 and spans[-1][1] == params[name].shape[0]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("size,hidden,layers,vocab", [("3b", 2048, 36, 151936), ("7b", 3584, 28, 152064)])
def test_real_configs_parse(size, hidden, layers, vocab):
    cfg = OmniConfig.from_file(DATA / f"qwen2_5_omni_{size}" / "config.json")
    assert (cfg.thinker.text.hidden_size, cfg.thinker.text.num_layers, cfg.thinker.text.vocab_size) == (hidden, layers, vocab)
    assert cfg.talker.decoder.embedding_size == hidden
    assert cfg.talker.stop_ids == (cfg.talker.codec_pad_id, cfg.talker.codec_eos_id)
