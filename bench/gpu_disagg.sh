#!/usr/bin/env bash
# Disaggregated (1 prefill + 1 decode) vs colocated (2 engines that prefill
# themselves) on one GPU split between two engine processes: the figures of
# docs/benchmarks.md, "Disaggregated vs colocated (H100)". From the repository root:
#
#   bash bench/gpu_disagg.sh prepare          # on a machine with the dev install (the embedded
#                                             # SmolLM2 supplies the tokenizer): model folder,
#                                             # tokenizer and gRPC stubs into $ASSETS
#   bash bench/gpu_disagg.sh smoke            # on the GPU: start disagg, a few requests per mix
#   bash bench/gpu_disagg.sh disagg coloc    # on the GPU: each deployment in turn, the sweeps of both mixes
#                                             # (direct: disagg with --kv-transfer direct, CUDA IPC;
#                                             # tests: the cross-process direct-transfer GPU test)
#   python -m tandem.bench.disagg_report RESULTS...   # anywhere: tables and plots from the tarballs
#
# On the GPU machine the tree runs without installing (like gpu_figures.sh); the wheels the
# image lacks travel in .whl/ (../shared/device/README.md; grpcio 1.85.1 too, the version the
# stubs were generated with). Results: $OUT/NAME.tgz (sweep.json, sweep.png and every point's
# results per mix, each engine's /metrics after each mix, the processes' logs) and $OUT/log.
#
# Environment knobs (defaults for the H100 run): PRESET llama-3-8b, DEVICE cuda, MEM 0.45 (each
# engine's share of the GPU), MIXES ("long sharegpt"), LONG_RATES, LONG_N, SHAREGPT_RATES, SHAREGPT_N, LONG_BUDGET and
# SHAREGPT_BUDGET (seconds each mix's sweep may take; points done by then are kept), PORT,
# SPY (py-spy profiles of the engines, their KV movers and the store during each sweep, SPY samples
# a second, when py-spy is on the PATH: $res/spy/MIX-NAME.txt, collapsed stacks per thread; 0, the
# default: none).
set -u -o pipefail
what=${1:?usage: bash bench/gpu_disagg.sh prepare | STEP... (tests, smoke, smoke-coloc, smoke-direct, coloc, disagg, direct)}
OUT=${OUT:-/tmp/tandem-disagg}
ASSETS=${ASSETS:-bench-results/disagg-assets}
PRESET=${PRESET:-llama-3-8b}
DEVICE=${DEVICE:-cuda}
MEM=${MEM:-0.45}
PORT=${PORT:-18500}
PY=${PY:-python3}
# Long-prompt mix: prompts uniform in [1500, 3000] words (~tokens), answers in [100, 200] tokens.
LONG=(--dataset random --random-input-len 2250 --random-output-len 150 --random-range-ratio 0.333)
LONG_RATES=${LONG_RATES:-0.5,1,2,4,8}
LONG_N=${LONG_N:-24}
LONG_BUDGET=${LONG_BUDGET:-120}
# ShareGPT-like mix, inputs capped at 1024 words, outputs at 256 tokens (a short tail keeps each point short).
SHAREGPT=(--dataset sharegpt --sharegpt-max-input-len 1024 --sharegpt-max-output-len 256)
SHAREGPT_RATES=${SHAREGPT_RATES:-4,8,16,32}
SHAREGPT_N=${SHAREGPT_N:-60}
SHAREGPT_BUDGET=${SHAREGPT_BUDGET:-75}
SLOS=(--goodput ttft:1000 tpot:50)
MIXES=${MIXES:-long sharegpt}  # which mixes the full steps sweep

if [[ $what == prepare ]]; then
  rm -rf "$ASSETS" && mkdir -p "$ASSETS/stubs"
  $PY -m tandem.bench.presets "$PRESET" "$ASSETS/$PRESET" --tokenizer smollm2 || exit
  cp protos/tandem/v1/*_pb2*.py "$ASSETS/stubs/" || exit
  du -sh "$ASSETS"
  exit 0
fi

mkdir -p "$OUT"
# Run the tree without installing it: map the folders onto the tandem.* import tree (ahead of
# any install); tandem.v1 is a copy of protos/tandem/v1 with the stubs made by `prepare`.
PKG=/tmp/pkg-disagg
rm -rf "$PKG" && mkdir -p "$PKG/tandem/v1"
for d in engine kernels bench services; do ln -sfn "$PWD/$d" "$PKG/tandem/$d"; done
cp protos/tandem/v1/__init__.py protos/tandem/v1/*.proto "$ASSETS"/stubs/*.py "$PKG/tandem/v1/" || exit
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# The memory KV store holds every prompt's blocks until the LRU evicts them: give it room
# (128 KiB per token for Llama-3-8B in bf16). TANDEM_CAPACITY_BYTES is --capacity-bytes' env twin.
export TANDEM_CAPACITY_BYTES=${TANDEM_CAPACITY_BYTES:-48GiB}
# ... allocated at start, as a serving store's memory ends up anyway (--preallocate's twin): a sweep
# of a few minutes would otherwise measure the store growing (new slabs, which each engine on the
# host also maps and page-locks) more than a store serving.
export TANDEM_PREALLOCATE=${TANDEM_PREALLOCATE:-1}
# Room in each engine's staging arena for about three full steps' saves (--kv-staging-gib):
# with one, a prefill step waits for the last step's puts (docs/benchmarks.md).
export TANDEM_KV_STAGING_GIB=${TANDEM_KV_STAGING_GIB:-3}
[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, grpc; print('torch', torch.__version__, 'grpcio', grpc.__version__)"

scrape() {  # RES OUT: every engine's /metrics (KV transfer bytes and seconds, prompt tokens by source)
  $PY - "$1/state.json" "$2" <<'EOF'
import json, sys, urllib.request
state, out = json.load(open(sys.argv[1])), sys.argv[2]
with open(out, "w") as f:
    for c in state["children"]:
        if c["role"] in ("prefill", "decode", "kvstore") and c.get("metrics_port"):
            text = urllib.request.urlopen(f"http://127.0.0.1:{c['metrics_port']}/metrics").read().decode()
            f.write(f"# ==== {c['name']}\n{text}")
EOF
}

spy() {  # RES MIX BUDGET: py-spy profiles of the engines and the store while a sweep runs (SPY > 0)
  [[ ${SPY:-0} != 0 ]] && command -v py-spy >/dev/null || return 0
  mkdir -p "$1/spy"
  local pid role
  while read -r pid role; do
    # raw: collapsed stacks per thread, idle ones included (a thread waiting is where its time went);
    # --subprocesses takes in the engines' KV mover processes.
    py-spy record --pid "$pid" --duration "$3" --rate "$SPY" --format raw --threads --idle --subprocesses \
      --nonblocking --output "$1/spy/$2-$role.txt" > /dev/null 2>&1 &
    # The store's threads that hold the GIL (only those): how much of the time one does, and which.
    [[ $role == kvstore ]] && py-spy record --pid "$pid" --duration "$3" --rate "$SPY" --format raw --threads \
      --gil --nonblocking --output "$1/spy/$2-$role-gil.txt" > /dev/null 2>&1 &
  done < <($PY -c "import json, sys; [print(c['pid'], c['name']) for c in json.load(open(sys.argv[1]))['children']
             if c['role'] in ('prefill', 'decode', 'kvstore')]" "$1/state.json")
}

sweep() {  # NAME RES BASE MIX BUDGET RATES N DATASET-FLAGS...
  local name=$1 res=$2 base=$3 mix=$4 budget=$5 rates=$6 n=$7 t0=$(date +%s); shift 7
  echo "=== $name $mix: rates $rates, $n requests each, at most ${budget}s"
  spy "$res" "$mix" "$budget"
  # --seed-per-rate: no point re-sends an earlier point's prompts, which the engines'
  # prefix caches would still hold.
  timeout -s INT "$budget" $PY -m tandem.bench.cli bench sweep --target "$name=$base" --seed-per-rate \
    --request-rates "$rates" --num-prompts "$n" "$@" "${SLOS[@]}" --result-dir "$res/$mix" \
    2> "$res/$mix.stderr" | grep -E "^(=====|Successful|Failed req|Benchmark dur|Goodput|Requests meet|TTFT|TPOT|$name:)"
  echo "($mix: exit $?, $(( $(date +%s) - t0 )) s)"
  pkill -INT -f "py-spy record" 2>/dev/null && sleep 2  # each writes its profile as it stops
  scrape "$res" "$res/$mix.metrics.txt"
  grep -E "^tandem:(kv_transfer_(bytes_total|seconds_sum|seconds_count|phase_seconds_total|phases_total)|prompt_tokens_by_source_total|kvstore_(fresh_buffers|copy_seconds|copy_page_faults)_total|e2e_request_latency_seconds_(sum|count)|time_per_output_token_seconds_(sum|count)|request_queue_time_seconds_(sum|count))" \
    "$res/$mix.metrics.txt" | grep -v "} 0.0$" | sed -E 's/model="[^"]*",?//'
}

deployment() {  # STEP PORT: start one deployment, run its sweeps, stop it, pack its results
  local step=$1 port=$2 name shape res base started up_pid
  case $step in
    coloc|smoke-coloc) name=coloc-2; shape=(--prefill 0 --decode 2) ;;
    disagg|smoke) name=disagg-1p1d; shape=(--prefill 1 --decode 1 --prefill-threshold 0) ;;
    direct|smoke-direct) name=disagg-1p1d-direct
      shape=(--prefill 1 --decode 1 --prefill-threshold 0 --kv-transfer direct) ;;
    tests) $PY -m pytest -q -x tests/gpu/test_kv_pull_gpu.py -p no:cacheprovider 2>&1 | tail -15
      return ;;
    *) echo "unknown step $step: prepare, tests, smoke, smoke-coloc, smoke-direct, coloc, disagg or direct" >&2
      return 2 ;;
  esac
  res=/tmp/disagg-results/$name base=http://127.0.0.1:$port/v1 started=$(date +%s)
  rm -rf "$res" && mkdir -p "$res"
  $PY -m tandem.services.launcher up "${shape[@]}" --port "$port" --grpc-port 0 --store memory \
    --model "$ASSETS/$PRESET" --tokenizer "$ASSETS/$PRESET/tokenizer" --load-format dummy \
    --device "$DEVICE" --gpu-memory-utilization "$MEM" --log-dir "$res/logs" \
    --state-file "$res/state.json" --no-restart > "$res/up.log" 2>&1 &
  up_pid=$!
  ready() { $PY -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$base/models" 2>/dev/null; }
  until [[ -s $res/state.json ]] && ready; do
    if ! kill -0 "$up_pid" 2>/dev/null || (( $(date +%s) - started > 300 )); then
      echo "$name did not come up:"; tail -50 "$res/up.log"; kill -TERM "$up_pid" 2>/dev/null; wait "$up_pid"; return 1
    fi
    sleep 2
  done
  echo "$name up after $(( $(date +%s) - started )) s"
  grep -h -E "KV blocks|captured" "$res"/logs/*.log | head -4
  case $step in
    smoke*)
      sweep "$name" "$res" "$base" long 120 0.5 8 "${LONG[@]}"
      sweep "$name" "$res" "$base" sharegpt 60 2 16 "${SHAREGPT[@]}" ;;
    *)
      [[ " $MIXES " == *" long "* ]] &&
        sweep "$name" "$res" "$base" long "$LONG_BUDGET" "$LONG_RATES" "$LONG_N" "${LONG[@]}"
      [[ " $MIXES " == *" sharegpt "* ]] &&
        sweep "$name" "$res" "$base" sharegpt "$SHAREGPT_BUDGET" "$SHAREGPT_RATES" "$SHAREGPT_N" "${SHAREGPT[@]}" ;;
  esac
  echo "warnings and errors in the logs:"
  grep -h -i -E "warn|error|fail" "$res"/logs/*.log | sed -E 's/^[0-9-]+ [0-9:,]+ //' | sort | uniq -c | sort -rn | head -10
  kill -TERM "$up_pid" 2>/dev/null; wait "$up_pid"
  (cd /tmp/disagg-results && tar czf "$OUT/$name.tgz" "$name")
  echo "$name done after $(( $(date +%s) - started )) s"
}

# Several steps in one go run one after the other, each on a port of its own.
i=0
for step in "$@"; do
  deployment "$step" $(( PORT + i )); i=$(( i + 1 ))
done
