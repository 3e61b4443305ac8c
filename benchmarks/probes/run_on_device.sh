#!/usr/bin/env bash
# One device session's work for issue 15, in steps that each fit one 600 s device call.
# Before it, stage TensorRT-RTX (it only builds there): here `bash ../shared/gpu/stage-trt-rtx.sh`, then
# device runs with carry [".trt/p1"]: `bash .trt/p1/recv.sh`, and with carry [".trt/p2"]:
#   bash .trt/p2/recv.sh && export PYTHONPATH=/tmp/trt/site:$PYTHONPATH && bash benchmarks/probes/run_on_device.sh tests
# then, while the machine is warm (/tmp/trt stays):
#   export PYTHONPATH=/tmp/trt/site:$PYTHONPATH && bash benchmarks/probes/run_on_device.sh bench
# Results land in $OUT (the device tool brings them back): copy gpu_runtime_h100.json to
# benchmarks/results/ and write what the run found into its "notes".
set -uo pipefail
step=${1:?usage: run_on_device.sh tests|bench|graphs|bench20 [model]|round3|aoti}
out=${OUT:-/tmp/kiln-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
case $step in
tests)  # the CUDA runtime through Inductor, and the TensorRT tests that can run where TensorRT-RTX builds
  timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu tests/backends/tensorrt/test_tensorrt_backend.py \
    2>&1 | tee "$out/tests.log" | tail -40
  python3 tests/fixtures/make_cuda_fixture.py "$out/mlp-cuda-inductor.kiln" 2>&1 | tail -3 ;;
bench)  # every row of issue 15's table that fits; the script writes after each step
  python3 benchmarks/gpu_runtime.py --out "$out/gpu_runtime_h100.json" --budget-s 420 \
    2>&1 | grep -v Warning | tee "$out/bench.log" | tail -30 ;;
graphs)  # issue 20: the CUDA-graph runtime tests, then the issue-15 CUDA tests
  timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_graphs_gpu.py \
    tests/gpu/test_inductor_gpu.py 2>&1 | tee "$out/tests.log" | tail -40 ;;
bench20)  # issue 20's table for the models named (default both), BERT-base with the cold start
  python3 benchmarks/gpu_runtime.py --out "$out/gpu_runtime_${2:-all}.json" --budget-s 420 \
    ${2:+--models $2} --cold-start 2>&1 | grep -v Warning | tee "$out/bench.log" | tail -40
  ;;
round3)  # refit in place while graphed, TensorRT profiles built, then BERT-base's trusted cold start
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_graphs_gpu.py \
    tests/backends/tensorrt/test_tensorrt_backend.py -k "refit or shape_profiles_build or specialization" 2>&1 \
    | tee "$out/tests.log" | tail -15
  timeout 330 python3 benchmarks/gpu_runtime.py --out "$out/gpu_cold.json" --models bert_base \
    --cold-start-only --cold-start-runs trusted,trusted_second 2>&1 | grep -v Warning | tail -15 ;;
aoti)  # AOTInductor once more, with the system compiler instead of /opt/gcc (the segfault's suspect)
  CXX=/usr/bin/g++ timeout 560 python3 benchmarks/probes/probe_inductor_aoti.py "$out/probe_aoti.json" \
    2>&1 | tail -30 ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
