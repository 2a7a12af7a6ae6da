#!/usr/bin/env bash
# The one prepared GPU check (run from the repository root on a CUDA machine whose python3 has
# torch, safetensors, tokenizers, jinja2 and numpy - no install, no download):
#   bench/gpu.sh [OUT_DIR]
# Builds random-weight stacks of the real Qwen2.5-Omni 3B and 7B shapes on the GPU in bf16
# (bench/random_stack.py) and runs `omnidesk bench` on each; JSON per size in OUT_DIR.
# Eager decode steps: the static-shape variants (Thinker/Talker.forward_static) that CUDA graphs
# would capture exist, the capture itself is not wired up yet.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench/results}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" || true
for size in 3b 7b; do
  PYTHONPATH=. python3 bench/random_stack.py --size "$size" --device cuda --dtype bfloat16 \
    --turns 3 --out "$out/omni_${size}.json"
done
