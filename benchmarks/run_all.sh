#!/usr/bin/env bash
# The GPU check of a change in one go: GPU tests, every benchmark, and the main job on the GPU.
# Everything printed also goes to $OUT/all.log ($OUT: the device tool's folder; else ./bench-logs).
#     bash benchmarks/run_all.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-logs}
mkdir -p "$out"
exec > >(tee "$out/all.log") 2>&1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 -m pytest -m gpu -q -rf ${1:+-k "$1"} > "$out/tests.log" 2>&1
tail -n 25 "$out/tests.log"
for b in topk routing_metadata aggregation swiglu fp8_quant grouped_gemm; do
  [ -f "benchmarks/bench_$b.py" ] || continue
  echo "== bench_$b"
  python3 "benchmarks/bench_$b.py"
done
echo "== bench_grouped_gemm --fp8 --ceiling (block-scaled FP8 beside bf16 and cuBLAS's dense FP8)"
python3 benchmarks/bench_grouped_gemm.py --fp8 --ceiling
echo "== bench_moe (with the per-kernel breakdown of sonic's forward+backward)"
python3 benchmarks/bench_moe.py --profile
echo "== bench_host (host µs per call beside GPU time, 7B)"
python3 benchmarks/bench_host.py
echo "== bench_moe, sparse configs (E=256, K=8, n=1024): top-K and token rounding on the same data"
python3 benchmarks/bench_moe.py --router both --config 8192,4096,1024,256,8 \
    --config 16384,4096,1024,256,8 --config 32768,1536,1024,256,8
echo "== bench_compile (eager vs torch.compile vs reduce-overhead)"
python3 benchmarks/bench_compile.py
echo "== stress_gpu: random cases against the reference"
python3 benchmarks/stress_gpu.py --random 500 --seconds 180 --seed 0 | tail -n 3
echo "== python -m sonic.train"
python3 -m sonic.train --json --no-progress 2>&1 | tail -n 3
