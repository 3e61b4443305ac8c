#!/usr/bin/env bash
# Issue 41 on the GPU machine, one device call per step, the machine kept warm between them (what a call
# installs under /tmp stays; $OUT is emptied before each call, so every step writes its results there).
# Here first: bash benchmarks/gpu_stage_wheels.sh (fills .whl/ and .whl2/). Then, with the device tool:
#
#   1. carry [".whl"]:  bash benchmarks/gpu_issue41.sh wheels1          (~1 min)
#   2. carry [".whl2"]: bash benchmarks/gpu_issue41.sh wheels2          (installs, checks imports)
#   3. bash benchmarks/gpu_issue41.sh zoo        # models, signing init, kiln zoo (signed)
#   4. bash benchmarks/gpu_issue41.sh registry   # kiln lookup (like eager), kiln release x5, GPT-2 v2
#   5. bash benchmarks/gpu_issue41.sh triton     # export, run (KIND_GPU, native), tritonclient,
#                                                # release live under 16 clients, rollback
#   6. bash benchmarks/gpu_issue41.sh serving    # item 5: Triton + kiln vs mlflow serve vs in-process
#
# Steps 3-5 share /tmp/kiln-e2e and each writes the merged $OUT/gpu_e2e_$(gpu).json (copy it to
# benchmarks/results/); step 6 writes $OUT/triton_serving_cuda_<gpu>.json. A failed step says which
# command failed and why, with its output's tail; fix and rerun that step alone.
set -uo pipefail
step=${1:?usage: gpu_issue41.sh wheels1|wheels2|zoo|registry|triton|serving [extra gpu_e2e.py flags]}
shift
out=${OUT:-/tmp/kiln-out}
mkdir -p "$out"
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
# Keep NVLink multicast off (the device README): set here too, for servers started with their own env.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# h100 / h200: the results file names the card it ran on (timings on one are not the other's)
gpu() { nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h[0-9]+' | head -1 | tr 'H' 'h'; }
e2e() { timeout 580 python3 benchmarks/gpu_e2e.py --work /tmp/kiln-e2e --out "$out/gpu_e2e_$(gpu).json" "$@" 2>&1 |
  grep -v -e Warning -e warnings.warn | tee "$out/e2e-$step.log" | tail -60; }
case $step in
wheels1) nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
  bash benchmarks/gpu_stage_wheels.sh install .whl ;;
wheels2) bash benchmarks/gpu_stage_wheels.sh install .whl2 && bash benchmarks/gpu_stage_wheels.sh check ;;
zoo) e2e --steps models,signing,zoo "$@" ;;
registry) e2e --steps lookup,release,zoo_v2 "$@" ;;
triton) e2e --steps export,serve,tritonclient,release_live,rollback "$@"
  cp /tmp/kiln-e2e/logs/tritonserver.log "$out/" 2>/dev/null ;;
serving) timeout 580 python3 -m benchmarks.triton_serving --device cuda --seconds 6 --warmup 2 \
    --out "$out/triton_serving_cuda_$(gpu).json" "$@" 2>&1 | grep -v -e Warning -e warnings.warn |
    tee "$out/serving.log" | tail -60 ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
