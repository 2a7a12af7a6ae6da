"""Rebuild the tensor name/shape list of the published Moshi 7B ``model.safetensors``.

Kyutai's ``moshi`` package (the test oracle, 0.2.13) builds its LMModel at the
published config (``loaders._lm_kwargs``, the config the loader uses for the
moshiko/moshika repos, which have no config.json) on the meta device: no
weights, no network.  Its state_dict names differ from the file's in one
documented way: the file stores each attention's projections as one tensor
(``self_attn.in_proj_weight``, ``self_attn.out_proj.weight``), stacked over the
depformer's 8 steps, and the oracle's load hook
(``StreamingMultiheadAttention._load_hook``) splits them into
``in_projs.{i}.weight`` / ``out_projs.{i}.weight``.  :func:`published_state_dict`
undoes that split.  Everything else is saved under its state_dict name.

Run: ``.venv/bin/python tests/data/moshi/dump_lm_shapes.py`` (a few seconds)
writes ``moshiko_7b_tensors.json`` next to this file and prints the checks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "moshiko_7b_tensors.json"
# kyutai/moshiko-pytorch-bf16 model.safetensors: 15.4 GB (FACTS.md; the hub's file listing), all bf16.
PUBLISHED_FILE_GB = 15.4

_SPLIT = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?P<kind>in_projs|out_projs)\.(?P<i>\d+)\.weight$")


def published_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle's state_dict in the published file's naming (attention projections stacked)."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        m = _SPLIT.match(name)
        if m is None:
            out[name] = tensor
            continue
        stacked = m["prefix"] + (".in_proj_weight" if m["kind"] == "in_projs" else ".out_proj.weight")
        stacks.setdefault(stacked, {})[int(m["i"])] = tensor
    for stacked, parts in stacks.items():
        assert sorted(parts) == list(range(len(parts))), stacked
        out[stacked] = torch.cat([parts[i] for i in range(len(parts))], dim=0)
    return out


def build_meta_7b():
    from moshi.models import loaders
    from moshi.models.lm import LMModel

    kwargs = dict(loaders._lm_kwargs)
    kwargs.pop("depformer_causal", None)  # deprecated; get_moshi_lm drops it the same way
    return LMModel(device="meta", dtype=torch.bfloat16, **kwargs), loaders._lm_kwargs


def main() -> int:
    model, kwargs = build_meta_7b()
    tensors = published_state_dict(model.state_dict())
    params = sum(t.numel() for t in tensors.values())
    file_bytes = 2 * params  # bf16
    print(f"oracle state_dict: {len(model.state_dict())} tensors; published naming: {len(tensors)} tensors")
    print(f"parameters: {params:,} -> bf16 tensor bytes {file_bytes:,} (~{file_bytes / 1e9:.2f} GB; "
          f"the published file is {PUBLISHED_FILE_GB} GB)")
    ok = abs(file_bytes / 1e9 - PUBLISHED_FILE_GB) < 0.05
    for name in ("transformer.layers.0.self_attn.in_proj_weight", "depformer.layers.0.self_attn.in_proj_weight",
                 "depformer.layers.0.self_attn.out_proj.weight", "depformer.layers.0.gating.7.linear_in.weight"):
        print(f"  {name}: {list(tensors[name].shape)}")
    lines = ",\n".join(f"    {json.dumps(n)}: {json.dumps(list(tensors[n].shape))}" for n in sorted(tensors))
    about = ("kyutai/moshiko-pytorch-bf16 model.safetensors (bf16): tensor name -> shape, rebuilt by "
             "dump_lm_shapes.py from the moshi package at its built-in 7B config")
    OUT.write_text("{\n"
                   f'  "_about": {json.dumps(about)},\n'
                   f'  "_lm_kwargs": {json.dumps(kwargs)},\n'
                   f'  "tensors": {{\n{lines}\n  }}\n'
                   "}\n")
    print(f"wrote {OUT.relative_to(HERE.parent.parent.parent)}; size check {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
