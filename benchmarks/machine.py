"""The machine a benchmark ran on, named in every result (machines here differ: AVX2 vs AVX512/AMX)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_machine(device: int = 0) -> dict:
    """The GPU machine a result came from: GPU, host CPU, core count, torch and CUDA, platform."""
    import os

    import torch

    return {
        "gpu": torch.cuda.get_device_name(device),
        "host_cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
