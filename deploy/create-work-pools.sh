#!/usr/bin/env bash
# Create kiln's work pools and engine-build concurrency limits on the Prefect server that
# PREFECT_API_URL points at. Idempotent: re-running updates what exists.
#
#   kiln-cpu        process pool: CPU workers, ONNX Runtime engines
#   kiln-gpu-<dev>  one process pool per GPU device class (engines are device-specific); start its
#                   workers only on machines with that GPU
set -euo pipefail

GPU_POOLS=${KILN_GPU_POOLS:-"h100"}   # e.g. KILN_GPU_POOLS="h100 l4"

prefect work-pool create kiln-cpu --type process --overwrite
for gpu in $GPU_POOLS; do
  prefect work-pool create "kiln-gpu-${gpu}" --type process --overwrite
done

# Engine builds hold leased slots of global concurrency limits engine-build:<device> (a killed run's
# slot frees itself when its lease ends); these stop parallel builds from oversubscribing a device.
# kiln also sets them from the zoo's build_concurrency at run start.
for limit in "engine-build:cpu 2" "engine-build:cuda 1" "engine-build:cuda:0 1"; do
  set -- $limit
  prefect gcl create "$1" --limit "$2" 2>/dev/null || prefect gcl update "$1" --limit "$2"
done
