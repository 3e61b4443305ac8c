"""The one entry point every quantization recipe module has: ``quantize_fingerprint(call: RecipeCall)``.

A recipe quantizes the partitions of one fingerprint and returns (the fingerprint's quantized graph:
ONNX, or a saved program for Inductor; each instance's own tensors, named
``<QUANTIZED_PREFIX><partition>/<name>``). :func:`compiler.quantization.quantize.recipe_for` picks the
module: :mod:`~compiler.quantization.onnxruntime`, :mod:`~compiler.quantization.pt2e` or
:mod:`~compiler.quantization.rowwise`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from compiler.partitioning.partition import PartitionPlan


@dataclass(frozen=True)
class RecipeCall:
    """What a recipe quantizes: ``parts``, the partitions of one fingerprint of ``plan``."""

    plan: PartitionPlan
    parts: Sequence[str]
    # partition -> the activations captured at its inputs, one feed (x0..xk -> array) per sample
    feeds: Mapping[str, Sequence[Mapping[str, np.ndarray]]] = field(default_factory=dict)
    # the recipe (CompileOptions.quantization_settings); None: that of the partitions' precision
    settings: Mapping[str, Any] | None = None
    fp: str = ""  # the fingerprint, named in errors

    @property
    def recipe(self) -> Mapping[str, Any]:
        if self.settings is not None:
            return self.settings
        options = self.plan.options
        return options.partition_quantization(self.parts[0], options.precision_of(self.parts[0])) or {}
