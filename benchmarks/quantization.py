"""int8 on ONNX Runtime (issue 19): fp32 vs int8 static vs int8 dynamic vs the plan the gate chose.

Models (random weights, built from code):
  * ``bert``: a BERT-base-sized sequence classifier (transformers ``BertConfig``, 768 hidden, 12 heads,
    ``--layers`` layers, sequence 128), split per ``BertLayer`` so dedup builds one engine per level;
  * ``cnn``: a small ResNet-like CNN (32x32 images, 10 classes);
  * ``sensitive``: 8 residual MLP blocks of one structure, one of which carries an outlier channel
    (x1e4 before a ReLU, undone after it) that per-tensor int8 activations cannot represent: the gate
    must raise exactly that block (a benchmark row and ``tests/test_quantize.py``).

Per model and variant: latency at batch 1 and 8 (median, interleaved in one run), package bytes
(weight-stripped engines off: the int8 weights are what shrinks), top-1 agreement and relative L2 vs
eager on held-out samples (calibration takes the first ``--calibration`` samples of the recorded
data, validation the rest), and calibration + quantization seconds. The CPU (model and ISA flags:
AVX2 / AVX512-VNNI / AMX decide whether int8 is faster) is named in the JSON.

Run: python -m benchmarks.quantization [--layers 12] [--out quantization_cpu]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler

# ---------------------------------------------------------------- the deliberately sensitive model


class OutlierBlock(nn.Module):
    """``x + fc2(relu(fc1(x) * s) / s)``: with ``s`` all ones a plain MLP block; in a "hot" block one
    channel of ``s`` is 1e4, so the activation after the multiply spans 1e4 in one channel and ~1 in
    the rest: one int8 scale per tensor rounds the rest to zero. Same structure either way."""

    def __init__(self, width: int, hot: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        scale = torch.ones(2 * width)
        if hot:
            scale[0] = 1e4
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x) * self.scale) / self.scale)


class SensitiveModel(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 8, hot: int = 5, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(OutlierBlock(width, i == hot) for i in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sensitive_case(width: int = 32, blocks: int = 8, hot: int = 5, batch: int = 4, samples: int = 24):
    """(model, program, recorded data) for the sensitive model: ``samples`` inputs of ``[batch, width]``."""
    torch.manual_seed(0)
    model = SensitiveModel(width, blocks, hot).eval()
    program = compiler.export(model, (torch.randn(batch, width),))
    return model, program, {"x": torch.randn(samples, batch, width)}
