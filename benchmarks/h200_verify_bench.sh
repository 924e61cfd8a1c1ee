#!/usr/bin/env bash
# GPU calls for the reference workload (Llama-3-8B shape, random init, batch 4 x 2048, bf16, LoRA r8,
# gradient checkpointing on). Parts, each sized for one 10-minute device call:
#   verify: `tiletune verify` of every kernel on 2 decoder layers and an independent plain timing of the
#           stock step (non-re-entrant and re-entrant)
#   golden: golden save with a 3-step convergence check, then the kernel-patched model against that file
#   attention: the GPU tests of the attention op and the kernel warm-up, then TileLang attention
#           against SDPA's flash and cuDNN backends (benchmarks/kernel_bench.py --only attention)
#   lora:   the GPU tests of lora_linear, benchmarks/lora_dynamics.py at the reference shape (2 layers:
#           float32 vs stock bf16 vs the kernel's arithmetic vs the kernel) and `tiletune verify` of every
#           kernel with LoRA on all 7 linear layers
#   bench:  `tiletune bench` with the extra arguments (e.g. --ablation --steps 5 --warmup 2 --repeats 2,
#           lora_target=all)
#   speed:  `tiletune bench --ablation --profile` plus the fastest kernel set, with and without
#           `gradient_checkpointing: auto` within BUDGET_GIB (default 28.9, the stock step's peak) and without
#           a budget; LoRA on q_proj,v_proj, or on all linear layers with
#           `SPEED_NAME=lora-all PLAIN_TARGET=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj ... speed OUT
#           lora_target=all`; then the plain script's stock step (REPEATS=1 by default: ~9 min per call;
#           ABLATION=0 runs baseline, all, Liger and the fastest set only, without each op alone: ~4 min)
#   offload: the GPU tests of the activation offload, then `tiletune bench` of the fastest set under
#           `gradient_checkpointing: auto` with and without `gradient_checkpointing_offload` at the stock peak
#           (28.9 GiB) and at the lean budgets LEAN_GIB (default "17.5 18.7"), against stock and Liger
#   engine: `tiletune verify` of every kernel (as in verify) and `tiletune bench` of the stock step against the
#           fastest set (2 repeats), after a change of the patch engine: same numerics, same speed
#   qlora:  the GPU tests of quant_linear and quant_lora_linear, benchmarks/kernel_bench.py --only quant, then `tiletune
#           bench` of the 8B QLoRA step: bf16 LoRA stock (the baseline), peft + bitsandbytes QLoRA (bnb, when
#           bitsandbytes is importable), tiletune's QLoRA with every kernel, under `gradient_checkpointing: auto`
#           within BUDGET_GIB (default 28.9, the stock step's peak), and with offload at the lean budgets LEAN_GIB
#           (default "6.0 6.4"; a budget below what the step needs fails alone, named in the table); KERNELS=0 skips
#           the kernel timings
#   qlora-long: benchmarks/qlora_long_context.py: the longest sequence (of SEQS) an 8B QLoRA step trains in 24 GiB,
#           then `tiletune verify` of every kernel on 2 quantized decoder layers of the 8B
#   qlora-long70b: the same on the Llama-3-70B shape within CAP GiB (default 79: an 80 GB card), SEQS (default
#           "90112,81920,73728") tried longest first until one fits, one step each, each in a process of its own,
#           offloaded inputs within HOST_GIB (default: the host's free memory less 30 GiB)
#   qlora70b: `tiletune bench` of the QLoRA step on the Llama-3-70B shape, all 80 layers built and quantized on the
#           GPU tensor by tensor: tiletune's QLoRA without kernels (the baseline) and with every kernel under
#           `gradient_checkpointing: auto` with offload within each of BUDGETS_GIB (default 38); STEPS timed (default 3)
#   dpo:    `tiletune bench` of the DPO step (examples/bench/llama3_8b_dpo.yaml): TRL's fused head, LLaMA-Factory's
#           full logits, Liger's layer kernels, Liger's kernels with its fused linear DPO loss, every kernel; ORPO and
#           KTO with and without the kernels
#   library: the GPU tests of the kernel library, `tiletune kernels build` for the 8B preset (into build/library),
#           then `tiletune verify` with TileLang blocked (every kernel from the library)
#   library-bench: the same build (reused on a warm machine), then `tiletune bench baseline,all` with TileLang's JIT
#           and, in a second bench run, with TileLang blocked (REPEATS=1: one repeat each, to fit one call)
#   families-bench: `tiletune bench` per preset of FAMILY_BENCH (default: qwen3-8b; :N keeps the first N layers; an
#           8B preset takes about 150 s on an H100): stock, Liger, the fastest set (every kernel but `linear` and
#           `attention`), and the fastest set under `auto` with activation offload (OFFLOAD=false: without) within
#           Liger's and within stock's peak measured in the same run (budget=@liger, @baseline); REPEATS (default 1)
#   moe:    the GPU tests of moe_experts, benchmarks/kernel_bench.py --only moe (grouped GEMM against a dense GEMM over
#           the same rows and torch's grouped_mm), then `tiletune bench` of MOE_PRESET (default qwen3-30b-a3b;
#           mixtral-8x7b) on its first LAYERS (default 12) layers: stock (grouped_mm experts), Liger, the fastest dense set
#           + moe_experts, and the same under `auto` with offload within 0.55x stock's peak; MOE_VARIANTS replaces that list (e.g. "baseline,liger,rms_norm,rope,lora_linear,
#           linear_cross_entropy" to find which op costs the gap to Liger), PROFILE=1 adds `--profile`
#           (KERNELS=0 skips the GPU tests and the kernel timings)
#   families: the GPU tests of rms_norm (offset form included) and the gated MLP ops, then `tiletune verify` of every
#           kernel on 2 decoder layers of each preset in FAMILY_PRESETS (default: qwen3-8b mistral-7b gemma3-12b
#           phi3-mini)
#   pending: the GPU tests of code changed since its last GPU run, each file's tail in OUT/gpu_tests_pending.txt
#           (now the streamed lm_head's loss, the host tables and the planner's short probe)
#   dpo-fast: the DPO step with the fastest set (no `linear`), then with pref_shared_prompt, alone and under `auto`
#           within BUDGET_GIB
#   packing: benchmarks/packing_throughput.py (unpacked / neat_packing stock / neat_packing with kernels)
#   source .devkit/gpu-env.sh && TILETUNE_COMMIT=<commit> bash benchmarks/h200_verify_bench.sh verify|golden|attention|lora|bench|speed|offload|engine|qlora|qlora-long|qlora-long70b|qlora70b|families|families-bench|moe|library|library-bench|dpo|dpo-fast|packing|pending OUT_DIR [bench args...]
# (TILETUNE_COMMIT names the commit in the reports where the tree was copied without .git.) A part that needs
# neither DeepSpeed nor the LLaMA-Factory data can carry `.gpukit` instead (git-ignored: .devkit's TileLang tarball,
# wheels and gpu-env.sh, 38 MiB): the whole .devkit (41 MiB) beside the tracked tree (23 MiB) passes one call's 64.
# PACK=1 leaves OUT_DIR as one OUT_DIR.tgz when the part ends (on SIGTERM too, once the running step returns): the
# device tool brings back at most 8 files a call, and one preset of `tiletune bench` writes 5.
set -u
PART=${1:?usage: h200_verify_bench.sh verify|golden|attention|lora|bench|peers|speed|offload|engine|qlora|qlora-long|qlora-long70b|qlora70b|families|families-bench|moe|library|library-bench|dpo|dpo-fast|packing|pending OUT_DIR [bench args]}
OUT=${2:?usage: h200_verify_bench.sh verify|golden|attention|lora|bench|peers|speed|offload|engine|qlora|qlora-long|qlora-long70b|qlora70b|families|families-bench|moe|library|library-bench|dpo|dpo-fast|packing|pending OUT_DIR [bench args]}
shift 2
mkdir -p "$OUT"  # parts tee their logs into it before any tool creates it
if [ "${PACK:-0}" = 1 ]; then
    trap 'tar czf "${OUT%/}.tgz" -C "$(dirname "${OUT%/}")" "$(basename "${OUT%/}")" && rm -rf "$OUT"' EXIT
    trap 'exit 143' TERM INT
fi
CONFIG=examples/bench/llama3_8b_lora.yaml
GOLDEN=/tmp/llama3-8b-2layers.golden.safetensors  # too large to bring back; its report is kept
VERIFY=(python3 -m tiletune verify "$CONFIG" kernels=all --model-preset llama3-8b --layers 2 --batches 1)
qv_target() {  # LoRA on q and v: Phi-3 fuses them into qkv_proj
    case $1 in phi3*) echo lora_target=qkv_proj ;; esac
}
case $PART in
verify)
    "${VERIFY[@]}" --seq 2048 --out "$OUT/verify-llama3-8b" 2>&1 | tail -40
    python3 benchmarks/plain_step.py 2>&1 | tail -1
    python3 benchmarks/plain_step.py --reentrant 2>&1 | tail -1 ;;
golden)
    "${VERIFY[@]}" --seq 1024 --steps 3 --save-golden "$GOLDEN" \
        --out "$OUT/verify-llama3-8b-golden" 2>&1 | tail -12
    "${VERIFY[@]}" --seq 1024 --against "$GOLDEN" \
        --out "$OUT/verify-llama3-8b-against" 2>&1 | tail -30
    ls -l "$GOLDEN" ;;
attention)
    python3 -m pytest -q -m gpu tests/kernels/test_attention.py tests/patch/test_patch.py 2>&1 | tee "$OUT/gpu_tests_attention.txt" | tail -15
    python3 benchmarks/kernel_bench.py --only attention --out "$OUT" 2>&1 | tail -15 ;;
lora)
    python3 -m pytest -q -m gpu tests/kernels/test_lora_linear.py 2>&1 | tee "$OUT/gpu_tests_lora_linear.txt" | tail -5
    python3 benchmarks/lora_dynamics.py --vocab 128256 --batch 4 --seq 2048 2>&1 | grep -v -i warn | tee "$OUT/lora_dynamics.md"
    "${VERIFY[@]}" lora_target=all --seq 1024 --out "$OUT/verify-llama3-8b-lora-all" 2>&1 | tail -30 ;;
engine)
    "${VERIFY[@]}" --seq 2048 --out "$OUT/verify-llama3-8b" 2>&1 | tail -12
    python3 -m tiletune bench "$CONFIG" --model-preset llama3-8b --steps 5 --warmup 2 --repeats 2 \
        --variants baseline,rms_norm+rope+swiglu+linear_cross_entropy+lora_linear --out "$OUT/bench-fastest" 2>&1 | tail -8 ;;
qlora)
    python3 -m pytest -q -m gpu tests/kernels/test_quant_linear.py tests/kernels/test_quant_lora_linear.py tests/kernels/test_linear_cross_entropy.py \
        tests/train/test_tiled_mlp.py tests/train/test_host_tables.py tests/train/test_recompute.py 2>&1 \
        | tee "$OUT/gpu_tests_qlora.txt" | tail -2
    [ "${KERNELS:-1}" = 1 ] && python3 benchmarks/kernel_bench.py --only quant --rounds 3 --out "$OUT/kernels-quant" 2>&1 \
        | grep -v Warning | tail -14
    Q=quantization_bit=4
    AUTO=gradient_checkpointing=auto
    OFF=gradient_checkpointing_offload=true
    BNB=$(python3 -c "import bitsandbytes" 2>/dev/null && echo "bnb:$Q,")
    LEAN=""; for GIB in ${LEAN_GIB:-6.0 6.4}; do LEAN="$LEAN,all:$Q:$AUTO:$OFF:gradient_checkpointing_budget=$GIB"; done
    python3 -m tiletune bench "$CONFIG" --model-preset llama3-8b --steps 5 --warmup 2 --repeats 1 \
        --variants "baseline,${BNB}all:$Q,all:$Q:$AUTO:gradient_checkpointing_budget=${BUDGET_GIB:-28.9}$LEAN" \
        --out "$OUT/bench-qlora-8b" 2>&1 | tail -10 ;;
qlora-long)
    python3 benchmarks/qlora_long_context.py --preset llama3-8b --cap 24 --seqs "${SEQS:-65536,98304,131072}" \
        --out "$OUT/long-context-8b" 2>&1 | grep -v Warning | tail -8
    "${VERIFY[@]}" quantization_bit=4 --seq 2048 --out "$OUT/verify-llama3-8b-qlora" 2>&1 | tail -30 ;;
library|library-bench)
    # #23: this GPU's kernel library for the 8B preset (built into build/library, which a warm machine keeps between
    # calls: the second part's build reuses every object), then verify (library) or the step with TileLang blocked
    # (every kernel from the library) against the step with TileLang's JIT, each against stock in its own bench run
    [ $PART = library ] && python3 -m pytest -q -m gpu tests/kernels/test_library.py 2>&1 | tee "$OUT/gpu_tests_library.txt" | tail -2
    ( time python3 -m tiletune kernels build "$CONFIG" kernels=all --model-preset llama3-8b --out build/library ) 2>&1 | tail -5
    LIB=$(ls -d build/library/cuda-* | head -1)
    mkdir -p "$OUT/library" && cp "$LIB"/manifest.json "$OUT/library/"
    BLOCKED=(env TILETUNE_KERNEL_LIBRARY="$LIB" PYTHONPATH="$PWD/benchmarks/no_tilelang:$PYTHONPATH")
    if [ $PART = library ]; then
        "${BLOCKED[@]}" "${VERIFY[@]}" --seq 2048 --out "$OUT/verify-llama3-8b-library" 2>&1 | tail -14
    else
        for RUN in jit library; do
            PREFIX=(); [ $RUN = library ] && PREFIX=("${BLOCKED[@]}")
            "${PREFIX[@]}" python3 -m tiletune bench "$CONFIG" --model-preset llama3-8b --steps 5 --warmup 2 --repeats "${REPEATS:-2}" \
                --variants baseline,all --out "$OUT/bench-$RUN" 2>&1 | tail -5
        done
    fi ;;
dpo)
    # #20: the DPO step (4 pairs x 2048 tokens) on TRL's trainer: TRL's fused LM head (stock), LLaMA-Factory's
    # full-logits log-probs, Liger's kernels, Liger's kernels + its fused linear DPO loss (liger_fused), every tiletune
    # kernel (linear_logprobs included); ORPO and KTO stock and with every kernel. First the GPU tests of
    # linear_logprobs' TileLang kernels (selected by name until they pass here)
    python3 -m pytest -q -m gpu tests/kernels/test_linear_logprobs.py 2>&1 | tail -4 | tee "$OUT/gpu_tests_linear_logprobs.txt"
    python3 -m tiletune bench examples/bench/llama3_8b_dpo.yaml --model-preset llama3-8b --steps 5 --warmup 2 --repeats 1 \
        --variants "baseline,llamafactory,liger,liger_fused,all,baseline:pref_loss=orpo,all:pref_loss=orpo,baseline:stage=kto,all:stage=kto" \
        --out "$OUT/bench-dpo" 2>&1 | tail -12 ;;
dpo-fast)
    # #20: the fastest set for the DPO step (no `linear`: 1.02x stock alone on the SFT step), then with each pair's
    # prompt run once (pref_shared_prompt), alone and under `auto` within half of LLaMA-Factory's peak (BUDGET_GIB,
    # default 23.3: half of its 46.7 GiB on 2026-12-05), against TRL (the baseline bench needs), LLaMA-Factory's run
    # of TRL and Liger's kernels in the same bench run
    FAST=rms_norm+rope+swiglu+linear_logprobs+lora_linear
    SHARED=$FAST:pref_shared_prompt=true
    python3 -m tiletune bench examples/bench/llama3_8b_dpo.yaml --model-preset llama3-8b --steps 5 --warmup 2 --repeats 1 \
        --variants "baseline,llamafactory,liger,$FAST,$SHARED,$SHARED:gradient_checkpointing=auto:gradient_checkpointing_budget=${BUDGET_GIB:-23.3}" \
        --out "$OUT/bench-dpo-fast" 2>&1 | tail -10 ;;
packing)
    # #21: non-padding tokens/s, unpacked stock against neat_packing stock and with the fastest set + varlen attention;
    # LLaMA-Factory's demo data from LF_DATA (alpaca_en_demo.json and dataset_info.json, carried with the call)
    python3 benchmarks/packing_throughput.py --dataset-dir "${LF_DATA:-.devkit/lfdata}" --steps "${STEPS:-20}" \
        --out "$OUT/packing" 2>&1 | grep -v -i warn | tail -8 ;;
pending)
    gpu_tests() {
        echo "== $*" | tee -a "$OUT/gpu_tests_pending.txt"
        python3 -m pytest -q -m gpu "$@" 2>&1 | tail -6 | tee -a "$OUT/gpu_tests_pending.txt"
    }
    # the streamed lm_head, the short probe and binding.SideCopy (e34080d, 997218c): not yet run on a GPU
    gpu_tests tests/kernels/test_linear_cross_entropy.py
    gpu_tests tests/train/test_host_tables.py
    gpu_tests tests/train/test_recompute.py ;;
families)
    python3 -m pytest -q -m gpu tests/kernels/test_rms_norm.py tests/kernels/test_swiglu.py 2>&1 \
        | tee "$OUT/gpu_tests_families.txt" | tail -2
    for PRESET in ${FAMILY_PRESETS:-qwen3-8b mistral-7b gemma3-12b phi3-mini}; do
        python3 -m tiletune verify "$CONFIG" kernels=all $(qv_target "$PRESET") --model-preset "$PRESET" --layers 2 --batches 1 --seq 2048 \
            --out "$OUT/verify-$PRESET" 2>&1 | tail -3
    done ;;
moe)
    if [ "${KERNELS:-1}" = 1 ]; then
        python3 -m pytest -q -m gpu tests/kernels/test_moe_experts.py 2>&1 | tee "$OUT/gpu_tests_moe.txt" | tail -2
        python3 benchmarks/kernel_bench.py --only moe --rounds 3 --out "$OUT/kernels-moe" 2>&1 | grep -v Warning | tail -80
    fi
    MOE_PRESET=${MOE_PRESET:-qwen3-30b-a3b}
    FAST=rms_norm+rope+swiglu+linear_cross_entropy+lora_linear  # the fastest dense set (no `linear`: 1.02x alone)
    # #19's target: <= 0.38x stock's time within Unsloth's memory, 0.55x stock's peak (recomputation or offload
    # planned within it)
    WITHIN=gradient_checkpointing=auto:gradient_checkpointing_offload=true:gradient_checkpointing_budget=@baseline*0.55
    python3 -m tiletune bench "$CONFIG" --model-preset "$MOE_PRESET" --layers "${LAYERS:-12}" --steps 5 --warmup 2 \
        --variants "${MOE_VARIANTS:-baseline,liger,$FAST+moe_experts,$FAST+moe_experts:$WITHIN}" ${PROFILE:+--profile} \
        --out "$OUT/bench-$MOE_PRESET" 2>&1 | tail -8 ;;
families-bench)
    # per family: stock, Liger, the fastest set, and the fastest set under `auto` (offload on unless OFFLOAD=false) at
    # Liger's and at stock's peak (same run)
    FAST=rms_norm+rope+swiglu+geglu+linear_cross_entropy+lora_linear
    AUTO=$FAST:gradient_checkpointing=auto:gradient_checkpointing_offload=${OFFLOAD:-true}:gradient_checkpointing_budget
    for ENTRY in ${FAMILY_BENCH:-qwen3-8b}; do
        PRESET=${ENTRY%%:*}; LAYERS=(); [ "$ENTRY" != "$PRESET" ] && LAYERS=(--layers "${ENTRY##*:}")
        python3 -m tiletune bench "$CONFIG" $(qv_target "$PRESET") --model-preset "$PRESET" "${LAYERS[@]}" --steps 5 --warmup 2 \
            --repeats "${REPEATS:-1}" --variants "baseline,liger,$FAST,$AUTO=@liger,$AUTO=@baseline" \
            --out "$OUT/bench-$PRESET" 2>&1 | tail -8
    done ;;
qlora-long70b)
    # Q3 at 70B: longest first (a step at 90k tokens takes minutes), each length in a process of its own; for the
    # inputs the host's free memory less 30 GiB (what the process holds itself: 23 GiB on 2026-12-06)
    HOST_GIB=${HOST_GIB:-$(free -g | awk '/Mem:/ {print $7 - 30}')}
    python3 benchmarks/qlora_long_context.py --preset llama3-70b --cap "${CAP:-79}" --seqs "${SEQS:-90112,81920,73728}" \
        --longest-first --host-budget "$HOST_GIB" --steps 1 --out "$OUT/long-context-70b" 2>&1 | grep -v Warning | tail -8 ;;
qlora70b)
    Q=quantization_bit=4
    PLANNED=""; for GIB in ${BUDGETS_GIB:-38}; do
        PLANNED="$PLANNED,all:gradient_checkpointing=auto:gradient_checkpointing_offload=true:gradient_checkpointing_budget=$GIB"
    done
    python3 -m tiletune bench "$CONFIG" $Q --model-preset llama3-70b --steps "${STEPS:-3}" --warmup 1 --repeats 1 \
        --variants "baseline$PLANNED" --out "$OUT/bench-qlora-70b" 2>&1 | tail -8 ;;
bench)
    python3 -m tiletune bench "$CONFIG" --model-preset llama3-8b --out "$OUT/bench" "$@" 2>&1 | tail -20 ;;
peers)
    # Unsloth on the stock step, in a call of its own that carries .peerkit (../shared/device/peers/* and the devkit's
    # wheels) instead of .devkit: the two kits exceed one call. A machine that ran a .devkit call before keeps
    # TileLang's kit in /tmp/site: tiletune's variants then run in the same bench run as Unsloth's (a budget of
    # `@unsloth` takes its peak). PEERS_BENCH lists preset[:layers]; VARIANTS add Unsloth's other settings
    # (unsloth:quantization_bit=4: its QLoRA) and tiletune's
    mkdir -p /tmp/peers && tar xJf .peerkit/unsloth-bnb-py312-site.tar.xz -C /tmp/peers
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers-wheels .peerkit/wheels/*.whl
    SITE=""; [ -f /tmp/site/.kit-ready ] && SITE=:/tmp/site
    for ENTRY in ${PEERS_BENCH:-llama3-8b}; do
        PRESET=${ENTRY%%:*}; LAYERS=(); [ "$ENTRY" != "$PRESET" ] && LAYERS=(--layers "${ENTRY##*:}")
        PYTHONPATH=/tmp/peers:/tmp/peers-wheels$SITE:$PWD/src python3 -m tiletune bench "$CONFIG" $(qv_target "$PRESET") \
            --model-preset "$PRESET" "${LAYERS[@]}" --steps 5 --warmup 3 --repeats 1 --variants "${VARIANTS:-baseline,unsloth}" \
            ${PROFILE:+--profile} --out "$OUT/peers-$PRESET" 2>&1 | tail -8
    done ;;
speed)
    # the whole ablation (each op alone, all, Liger) plus the fastest set with and without
    # `gradient_checkpointing: auto`, in one run; extra args are config overrides (lora_target=all)
    FAST=rms_norm+rope+swiglu+linear_cross_entropy+lora_linear
    AUTO=gradient_checkpointing=auto
    BUDGET=gradient_checkpointing_budget=${BUDGET_GIB:-28.9}
    EXTRA="$FAST,$FAST:$AUTO:$BUDGET,$FAST:$AUTO"
    if [ "${ABLATION:-1}" = 1 ]; then SET=(--ablation --variants "baseline,$EXTRA")
    else SET=(--variants "baseline,all,liger,$EXTRA"); fi
    python3 -m tiletune bench "$CONFIG" "$@" --model-preset llama3-8b --profile --steps 5 --warmup 2 \
        --repeats "${REPEATS:-1}" "${SET[@]}" --out "$OUT/speed-${SPEED_NAME:-lora-qv}" 2>&1 | tail -20
    # the independent timing of the stock step in the same call (re-entrant, as the bench baseline)
    python3 benchmarks/plain_step.py --reentrant --lora-target "${PLAIN_TARGET:-q_proj,v_proj}" 2>&1 | tail -1 ;;
offload)
    python3 -m pytest -q -m gpu tests/train/test_offload.py 2>&1 | tee "$OUT/gpu_tests_offload.txt" | tail -5
    FAST=rms_norm+rope+swiglu+linear_cross_entropy+lora_linear
    AUTO=gradient_checkpointing=auto
    OFF=gradient_checkpointing_offload=true
    SET="baseline,liger,$FAST:$AUTO:gradient_checkpointing_budget=28.9,$FAST:$AUTO:$OFF:gradient_checkpointing_budget=28.9"
    for GIB in ${LEAN_GIB:-17.5 18.7}; do SET="$SET,$FAST:$AUTO:$OFF:gradient_checkpointing_budget=$GIB"; done
    python3 -m tiletune bench "$CONFIG" "$@" --model-preset llama3-8b --steps 5 --warmup 2 --variants "$SET" \
        --out "$OUT/offload-${SPEED_NAME:-lora-qv}" 2>&1 | tail -20 ;;
*) echo "unknown part $PART (verify, golden, attention, lora, bench, speed, offload, engine, qlora, qlora-long, qlora-long70b, qlora70b, families, families-bench, moe, library, library-bench, dpo, dpo-fast, packing or pending)"; exit 2 ;;
esac
