#!/usr/bin/env bash
# The one prepared GPU check (run from the repository root on a CUDA machine whose python3 has
# torch, safetensors, tokenizers, jinja2 and numpy - no install, no download):
#   bench/gpu.sh [OUT_DIR] [PART ...]      PART: qwen, qwen3b, quant, moshi, qwen3 (default: qwen moshi qwen3)
# Random-weight stacks at the real shapes, in bf16, built on the GPU: Qwen2.5-Omni 7B (bench/random_stack.py;
# qwen3b adds the 3B, quant the 7B in int4 and int8), Moshi 7B + Mimi (bench/moshi_stack.py), Qwen3-Omni
# 30B-A3B (bench/qwen3_stack.py).  Each family runs its decode steps eagerly and as captured CUDA graphs
# (omnidesk/models/runner.py) in the same process, so one device call compares them; JSON per run in OUT_DIR,
# written after every part (a run cut off by its timeout still reports what it measured).
# Targets (issue 24): Qwen2.5-Omni-7B thinker decode >= 4x eager per token with graphs; Moshi 7B frame step
# p50 <= 30 ms; Qwen3-Omni talker + code predictor <= 25 ms per 80 ms frame.
# One device command may run at most 10 minutes: every step has its own timeout, and the default parts fit
# one call (about 7 minutes on an H200).  A failing run does not stop the next one; exit status 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-${OUT:-bench/results}}
shift || true
parts=" ${*:-qwen moshi qwen3} "
want() { [[ "$parts" == *" $1 "* ]]; }
mkdir -p "$out" || exit 1
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$out/gpu.txt" || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >> "$out/gpu.txt" || true
rc=0
step() {  # step NAME SECONDS CMD...: runs CMD with a timeout, its log in OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
  [ $code -eq 0 ] || { rc=1; tail -n 5 "$out/$name.log"; }
}
# Qwen2.5-Omni: thinker ms/token, talker ms/step and the vocoder, eager then graphs; then one real-time turn
want qwen && step omni_7b 170 python3 bench/random_stack.py --size 7b --device cuda --dtype bfloat16 \
  --compile eager,graphs --tokens 64 --codes 150 --turns 1 --interrupts 10 --out "$out/omni_7b.json"
want qwen3b && step omni_3b 150 python3 bench/random_stack.py --size 3b --device cuda --dtype bfloat16 \
  --compile eager,graphs --tokens 64 --codes 150 --turns 1 --interrupts 10 --out "$out/omni_3b.json"
# Low VRAM: the 7B's thinker linears in 4 bits (group 128, the published GPTQ/AWQ layout) and in int8
want quant && for mode in int4 int8; do
  step "omni_7b_$mode" 150 python3 bench/random_stack.py --size 7b --device cuda --dtype bfloat16 \
    --quantize "$mode" --compile graphs --tokens 64 --codes 100 --turns 0 --out "$out/omni_7b_$mode.json"
done
# Moshi 7B: 250 timed frames (20 s) after 25 warm-up frames per mode
want moshi && for mode in eager graphs; do
  step "moshi_7b_$mode" 120 python3 bench/moshi_stack.py --size 7b --device cuda --dtype bfloat16 \
    --frames 250 --warmup 25 --compile "$mode" --out "$out/moshi_7b_$mode.json"
done
# Qwen3-Omni 30B-A3B (~65 GiB in bf16): thinker, talker + code predictor, code2wav, first audio per mode
want qwen3 && for mode in eager graphs; do
  step "qwen3_30b_a3b_$mode" 170 python3 bench/qwen3_stack.py --device cuda --dtype bfloat16 \
    --tokens 64 --frames 60 --reps 3 --turns 1 --compile "$mode" --out "$out/qwen3_30b_a3b_$mode.json"
done
exit $rc
