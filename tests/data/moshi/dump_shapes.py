#!/usr/bin/env python
"""Rebuild the tensor list of the published Mimi checkpoint from public sources.

The file is ``tokenizer-e351c8d8-checkpoint125.safetensors`` in kyutai/moshiko-pytorch-bf16
(and the other Moshi repos).  Kyutai's ``moshi`` package (0.2.13, installed without its
dependencies) builds the real-config ``MimiModel`` with its own built-in config
(``loaders._mimi_config``, the one it uses for that file) on the meta device: no weights,
no network.  Its ``state_dict()`` names are the checkpoint's, except for the attention
projections, which the published file spells the legacy way (``self_attn.in_proj_weight``,
``self_attn.out_proj.weight``; the package's load hook maps them onto ``in_projs.0`` /
``out_projs.0``); see tests/data/README.md for the sources.

Writes tests/data/moshi/mimi_tensors.json and checks the total against the published file
size (385 MB, fp32).  Usage:  python tests/data/moshi/dump_shapes.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")

import torch  # noqa: E402
from moshi.models import loaders  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "mimi_tensors.json"
# The hub lists the file at 385 MB (FACTS.md); every tensor is float32.
PUBLISHED_MB = 385
LEGACY_NAMES = {"self_attn.in_projs.0.weight": "self_attn.in_proj_weight",
                "self_attn.out_projs.0.weight": "self_attn.out_proj.weight"}


def published_name(name: str) -> str:
    for new, old in LEGACY_NAMES.items():
        if name.endswith(new):
            return name[: -len(new)] + old
    return name


def tensor_list() -> dict:
    """What mimi_tensors.json holds."""
    with torch.device("meta"):
        model = loaders.get_mimi(None, loaders._mimi_config, device="meta")
    state = model.state_dict()
    assert {v.dtype for v in state.values()} == {torch.float32}
    tensors = {published_name(k): list(v.shape) for k, v in state.items()}
    return {
        "file": loaders.MIMI_NAME,
        "repo": loaders.DEFAULT_REPO,
        "source": "moshi 0.2.13 loaders.get_mimi(None, loaders._mimi_config) on the meta device; "
                  "attention projections renamed to the published in_proj_weight / out_proj.weight",
        "dtype": "F32",
        "tensor_count": len(tensors),
        "elements": sum(int(torch.Size(s).numel()) for s in tensors.values()),
        "config": loaders._mimi_config,
        "tensors": tensors,
    }


def main() -> int:
    data = tensor_list()
    tensors = data["tensors"]
    # one tensor per line: compact, and diffs read well
    head = json.dumps({k: v for k, v in data.items() if k != "tensors"}, indent=1)[:-2]
    body = ",\n".join(f"  {json.dumps(n)}: {json.dumps(s)}" for n, s in tensors.items())
    OUT.write_text(f'{head},\n "tensors": {{\n{body}\n }}\n}}\n')
    assert json.loads(OUT.read_text()) == data
    mb = data["elements"] * 4 / 1e6
    print(f"{len(tensors)} tensors, {data['elements']:,} fp32 numbers, {mb:.1f} MB -> {OUT}")
    if abs(mb - PUBLISHED_MB) > 1:
        print(f"FAIL: expected ~{PUBLISHED_MB} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
