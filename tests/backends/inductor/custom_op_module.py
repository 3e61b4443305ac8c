"""A custom op for the AOTInductor tests: its package calls it through the dispatcher, so the fresh
process that checks a build must import this module first (as a load does, by the package's op modules)."""

from __future__ import annotations

import torch


@torch.library.custom_op("kilntest::shifted_tanh", mutates_args=())
def shifted_tanh(x: torch.Tensor, shift: float) -> torch.Tensor:
    return torch.tanh(x) + shift


@shifted_tanh.register_fake
def _(x: torch.Tensor, shift: float) -> torch.Tensor:
    return torch.empty_like(x)
