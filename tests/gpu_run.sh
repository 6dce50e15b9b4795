#!/usr/bin/env bash
# Everything the CUDA backend needs checked on a real GPU, in one call:
#   tests/gpu_run.sh [STAGE ...]   stages: env ncu kernels model prefill bench bench-all bench:SHAPE:QUANT
#                                  nopdl:SHAPE:QUANT (bench with TINYINFER_PDL=0), batch (batched
#                                  decoding's GPU tests), bench-batch (examples/bench_batch.py)
#                                  (default: env kernels model prefill bench; KERNELS_K=expr filters kernels)
# Installs the package, runs `pytest -m gpu`, benchmarks random-weight models, and leaves the logs
# in $OUT (results.tar.gz plus summary.txt, printed last). Test assets must be in ./gpu_assets
# (copies of ../shared/assets/...; ../shared does not travel to the device machine).
set -u
OUT=${OUT:-$PWD/out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TINYINFER_SHARED=$PWD/gpu_assets
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache} TINYINFER_CACHE_DIR=${TINYINFER_CACHE_DIR:-/tmp/tinyinfer_cache}
PY=${PY:-python3}
STAGES=${*:-env kernels model prefill bench}
SUMMARY=$LOGS/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
started=$(date +%s)

# The package: an editable install, or a tinyinfer/ folder of links on PYTHONPATH when that does not
# give an importable package (on the device image pip can exit 0 and still leave tinyinfer unimportable).
if ! { $PY -m pip install -q --no-deps --no-build-isolation -e . > "$LOGS/install.log" 2>&1 &&
       (cd /tmp && $PY -c "import tinyinfer.runtime") >> "$LOGS/install.log" 2>&1; }; then
    mkdir -p /tmp/ti_pkg/tinyinfer
    for p in convert runtime kernels formats; do ln -sfn "$PWD/$p" /tmp/ti_pkg/tinyinfer/$p; done
    export PYTHONPATH=/tmp/ti_pkg${PYTHONPATH:+:$PYTHONPATH}
    note "install: pip -e failed (see install.log), using a link farm on PYTHONPATH"
fi
$PY -c "import tinyinfer.runtime.cuda_backend" || { note "import failed"; }

if has env; then
    { nvidia-smi; $PY -c "import cupy, sys; cupy.show_config(); print(sys.version)"; } > "$LOGS/env.txt" 2>&1
    note "gpu: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader)"
fi

if has ncu; then    # Nsight Compute on representative GEMV and attention launches (tests/perf/profile_kernels.py)
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats -k "regex:gemv|attention" \
        $PY tests/perf/profile_kernels.py > "$LOGS/ncu.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|Block Limit Reg|stalled" \
        "$LOGS/ncu.txt" | sed -E 's/ +/ /g' | cut -c1-220 | tee -a "$SUMMARY" | head -n 0
fi

if has kernels; then
    timeout ${KERNELS_TIMEOUT:-420} $PY -m pytest -m gpu tests/test_kernels_gpu.py -q -p no:cacheprovider ${KERNELS_K:+-k "$KERNELS_K"} \
        --timeout 90 --durations=5 \
        > "$LOGS/pytest-kernels.log" 2>&1
    note "pytest kernels: $(tail -n 1 "$LOGS/pytest-kernels.log")"
    grep -E "^(FAILED|ERROR)|Error|assert" "$LOGS/pytest-kernels.log" | head -n 15 | tee -a "$SUMMARY"
    # The machine code check that needs cuobjdump (present here, not in CI): no activation loads
    # before griddepcontrol.wait.
    $PY -m pytest tests/test_cuda_compile.py -k pdl -q -p no:cacheprovider > "$LOGS/pytest-pdl.log" 2>&1
    note "pytest pdl machine code: $(tail -n 1 "$LOGS/pytest-pdl.log")"
fi

gpu_pytest() {   # stage file timeout: one GPU test file, its errors and relative-error lines into the summary
    timeout "$3" $PY -m pytest -m gpu "tests/$2" -q -s -p no:cacheprovider --timeout 240 --durations=8 \
        > "$LOGS/pytest-$1.log" 2>&1
    note "pytest $1: $(tail -n 1 "$LOGS/pytest-$1.log")"
    grep -E "relative error|^(FAILED|ERROR)" "$LOGS/pytest-$1.log" | head -n 30 | tee -a "$SUMMARY"
}
if has model; then gpu_pytest model test_cuda_model_gpu.py ${MODEL_TIMEOUT:-500}; fi
if has prefill; then gpu_pytest prefill test_prefill_gpu.py ${PREFILL_TIMEOUT:-500}; fi

bench() {   # shape quant [label], environment passed through (e.g. TINYINFER_PDL=0)
    local name="bench-$1-$2${3:+-$3}"
    echo -n "${3:+[$3] }" | tee -a "$SUMMARY"
    timeout ${BENCH_TIMEOUT:-300} $PY examples/bench_random.py --shape "$1" --quant "$2" --json "$LOGS/$name.json" --verbose \
        > "$LOGS/$name.log" 2>&1
    $PY - "$LOGS/$name.json" <<'EOF' | tee -a "$SUMMARY" || note "$name: failed, see $name.log"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['config']['dim']}x{r['config']['n_layers']} {r['encodings']['wqkv']}: {r['tok_s']:.0f} tok/s "
      f"(graph {r['graph_tok_s']:.0f}), {r['achieved_gbs']:.0f} GB/s = {r['pct_of_read_bandwidth']:.1f}% of "
      f"{r['read_bandwidth_gbs']:.0f}, kernels {r['kernel_sum_us']:.0f} us + gaps {r['gap_us']:.0f} us, "
      f"load {r['load']['load_s']:.2f} s, second load {r['second_load']['load_s']:.2f} s")
print("  first load: " + ", ".join(f"{k} {v:.2f}" for k, v in r["load"].items() if isinstance(v, float)))
p = r.get("prefill", {})
print(f"  prefill: pp512 {p.get('pp512', 0):.0f} tok/s, pp2048 {p.get('pp2048', 0):.0f} tok/s, "
      f"first token after 512 prompt tokens {p.get('ttft512_ms', 0):.1f} ms")
EOF
}
if has batch; then gpu_pytest batch test_batch_gpu.py ${BATCH_TIMEOUT:-500}; fi
if has bench-batch; then   # batched decoding at 1-32 streams (examples/bench_batch.py)
    timeout ${BATCH_BENCH_TIMEOUT:-400} $PY examples/bench_batch.py ${BATCH_BENCH_ARGS:-} --json "$LOGS/bench-batch.json" \
        > "$LOGS/bench-batch.log" 2>&1 || note "bench_batch: failed or timed out, see bench-batch.log"
    grep -E "^\||q4 on|B=" "$LOGS/bench-batch.log" | cut -c1-400 | tee -a "$SUMMARY"
fi
if has bench; then
    bench tinyllama q4
    bench llama2-7b q4
fi
for stage in $STAGES; do
    if [[ $stage == bench:*:* ]]; then IFS=: read -r _ shape quant <<< "$stage"; bench "$shape" "$quant"; fi
    if [[ $stage == nopdl:*:* ]]; then    # the same benchmark without programmatic dependent launch
        IFS=: read -r _ shape quant <<< "$stage"; TINYINFER_PDL=0 bench "$shape" "$quant" nopdl
    fi
done
if has bench-all; then
    bench tinyllama q4
    bench tinyllama q8
    bench tinyllama f16
    bench llama2-7b q4
    bench llama2-7b f16
fi

note "elapsed: $(( $(date +%s) - started )) s"
tar -czf "$OUT/results.tar.gz" -C "$LOGS" .
cp "$SUMMARY" "$OUT/summary.txt"
echo "================ summary"
cat "$SUMMARY"
