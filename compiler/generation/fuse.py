"""A decoder's query, key and value projections as one linear layer, for the programs kiln compiles.

In a decode step each layer's RMSNorm feeds three matrix-vector products (q, k, v). Inductor fuses a
norm into the prologue of the one product that reads it, and two products of one shape into one
kernel (a Llama MLP's gate and up: 96% of copy bandwidth on the H100), but not three products of
different widths: the norm stays a one-row reduction kernel of its own and q, k, v three small kernels
(issue 44: ~30 us a layer where their bytes take ~7 us; benchmarks/probes/probe_decode_profile_op).
One [q + k + v, hidden] weight makes them one product, as many serving stacks store it.

:func:`fused_projections` returns a structural copy of the model (new module objects, the same
parameter tensors) whose attention layers hold ``qkv_proj`` (the three weights concatenated, once per
model: both programs of a generation bind the same tensors) and call it through ``q_proj``, ``k_proj``
and ``v_proj`` stand-ins that each return their slice of one product. The model the caller passed is
not changed (validation runs it as eager). Layers whose three projections are not plain
``nn.Linear`` of one input width and one bias kind are left as they are.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

_FUSED: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
NAMES = ("q_proj", "k_proj", "v_proj")


class FusedProjections(nn.Module):
    """The three projections' weights (and biases) concatenated; :meth:`part` computes the product once
    per input and hands out each projection's slice."""

    def __init__(self, projections: tuple[nn.Linear, ...]):
        super().__init__()
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([p.weight for p in projections]), requires_grad=False)
            biases = [p.bias for p in projections]
            bias = torch.cat(biases) if biases[0] is not None else None
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = [p.out_features for p in projections]
        self._input: torch.Tensor | None = None
        self._version = -1
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        # The layer's q call: one product for all three (the same tensor, not changed in place since).
        if self._input is not x or self._version != x._version:
            self._input, self._version, self._taken = x, x._version, 0
            self._parts = torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        out = self._parts[index]
        self._taken += 1
        if self._taken == len(self.sizes):  # hold no tensor (or trace proxy) past the layer's call
            self._input, self._parts = None, ()
        return out


class _Slice(nn.Module):
    """Stands in for one projection: its slice of the fused product (no parameters of its own; its
    ``weight`` and ``bias`` are views of the fused ones, for model code that reads their dtype)."""

    def __init__(self, fused: FusedProjections, index: int, projection: nn.Linear):
        super().__init__()
        object.__setattr__(self, "_fused", fused)  # not a submodule: its weight is named once
        self.index, self.in_features, self.out_features = (
            index,
            projection.in_features,
            projection.out_features,
        )
        self._rows = slice(sum(fused.sizes[:index]), sum(fused.sizes[: index + 1]))

    @property
    def weight(self) -> torch.Tensor:
        return self._fused.weight[self._rows]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self._fused.bias is None else self._fused.bias[self._rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused.part(x, self.index)


def _fusable(module: nn.Module) -> tuple[nn.Linear, ...] | None:
    projections = tuple(getattr(module, name, None) for name in NAMES)
    if not all(type(p) is nn.Linear for p in projections):
        return None
    first = projections[0]
    same = all(
        p.in_features == first.in_features
        and (p.bias is None) == (first.bias is None)
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        for p in projections
    )
    return projections if same else None


def _structural_copy(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = {name: _structural_copy(child) for name, child in module._modules.items()}
    return new


def fused_projections(model: nn.Module) -> nn.Module:
    """``model`` with each attention layer's q/k/v projections fused (see the module docstring); the
    same object for the same model, ``model`` itself where no layer has them."""
    if model in _FUSED:
        return _FUSED[model]
    if not any(_fusable(m) for m in model.modules()):
        return model
    fused_model = _structural_copy(model)
    for module in fused_model.modules():
        projections = _fusable(module)
        if projections is None:
            continue
        fused = FusedProjections(projections)
        module.qkv_proj = fused
        for index, (name, projection) in enumerate(zip(NAMES, projections, strict=True)):
            setattr(module, name, _Slice(fused, index, projection))
    _FUSED[model] = fused_model
    return fused_model
