#!/usr/bin/env bash
# One GPU call: `tiletune verify` of every TileLang kernel on a Llama-3-8B-shaped model (random init,
# 2 decoder layers), then `tiletune bench --ablation` on the reference workload (Llama-3-8B shape,
# batch 4 x 2048, bf16, LoRA r8 on q_proj,v_proj, gradient checkpointing on).
#   source .devkit/gpu-env.sh && TILETUNE_COMMIT=<commit> bash benchmarks/h200_verify_bench.sh OUT_DIR [bench args...]
# (TILETUNE_COMMIT names the commit in the reports where the tree was copied without .git.)
set -u
OUT=${1:?usage: h200_verify_bench.sh OUT_DIR [extra bench args]}
shift
CONFIG=examples/bench/llama3_8b_lora.yaml
python3 -m tiletune verify "$CONFIG" kernels=all --model-preset llama3-8b --layers 2 --seq 2048 --batches 1 \
    --out "$OUT/verify-llama3-8b" 2>&1 | tail -40
python3 -m tiletune verify "$CONFIG" kernels=all --model-preset llama3-8b --layers 2 --seq 1024 --batches 1 \
    --steps 5 --save-golden "$OUT/llama3-8b-2layers.golden.safetensors" --out "$OUT/verify-llama3-8b-golden" 2>&1 | tail -4
python3 -m tiletune verify "$CONFIG" kernels=all --model-preset llama3-8b --layers 2 --seq 1024 --batches 1 \
    --against "$OUT/llama3-8b-2layers.golden.safetensors" --out "$OUT/verify-llama3-8b-against" 2>&1 | tail -4
python3 benchmarks/plain_step.py --reentrant 2>&1 | tail -1   # independent timing of the stock step
python3 -m tiletune bench "$CONFIG" --model-preset llama3-8b --out "$OUT/bench-llama3-8b-lora-qv" "$@" 2>&1 | tail -20
