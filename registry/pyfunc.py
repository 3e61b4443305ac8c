"""The MLflow ``python_function`` face of a kiln package.

``load_context`` calls ``compiler.load`` on the package artifact, which verifies the format version
and every checksum before anything runs. The logged model carries ``compiler`` and ``registry`` as
``code_paths``, so ``mlflow.pyfunc.load_model`` works in a fresh process without kiln installed
(torch, onnxruntime and safetensors must be, as the model's requirements say).

Calling it:

* ``loaded.predict(array)`` for a single-input model, ``loaded.predict({"x": array, ...})`` or a list
  in input order otherwise: numpy in, numpy out (one array, or a list for several outputs). MLflow
  checks the signature (dtype, rank, static dims) before kiln checks the ranges.
* ``loaded.unwrap_python_model().run(tensor, ...)``: torch tensors (or numpy arrays) in the model's input
  order, torch tensors out; MLflow's signature enforcement does not accept tensors, so this is the
  tensor path. ``.module`` is the loaded ``compiler.CompiledModule`` itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlflow.pyfunc
import numpy as np

PACKAGE_ARTIFACT = "package"


def import_op_modules(modules: Sequence[str]) -> None:
    """Import the modules that register the model's custom ops (its fallback ops).

    A torch.export program that calls a custom op (``kiln_zoo::soft_sign_clip``) only deserialises
    once that op is registered, i.e. once the module defining it has been imported.
    """
    import importlib

    for name in modules:
        if name:
            importlib.import_module(name)


class KilnPackageModel(mlflow.pyfunc.PythonModel):
    """Wraps a kiln package directory; the compiled module is loaded once per process.

    ``op_modules``: modules to import before loading (the zoo factory's module, which registers any
    custom ops the fallback graph calls).
    """

    def __init__(self, op_modules: Sequence[str] = ()) -> None:
        self.op_modules = tuple(op_modules)
        self.module: Any = None
        self.package_dir: str | None = None

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        import compiler

        import_op_modules(self.op_modules)
        self.package_dir = context.artifacts[PACKAGE_ARTIFACT]
        self.module = compiler.load(self.package_dir)

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.module.input_specs]

    def _tensors(self, values: Sequence[Any]) -> list:
        import torch

        specs = self.module.input_specs
        tensors = []
        for spec, value in zip(specs, values, strict=False):
            tensor = (
                value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
            )
            tensors.append(tensor.to(spec.torch_dtype) if tensor.dtype != spec.torch_dtype else tensor)
        if len(values) != len(specs):
            from compiler.errors import InputSpecError

            raise InputSpecError(f"expected {len(specs)} inputs {self.input_names}, got {len(values)}")
        return tensors

    def _ordered(self, model_input: Any) -> list:
        if isinstance(model_input, Mapping):
            missing = [n for n in self.input_names if n not in model_input]
            if missing:
                from compiler.errors import InputSpecError

                raise InputSpecError(f"inputs {missing} are missing; expected {self.input_names}")
            return [model_input[n] for n in self.input_names]
        if isinstance(model_input, (list, tuple)):
            return list(model_input)
        if hasattr(model_input, "to_numpy") and len(self.input_names) == 1:  # a DataFrame of one column set
            return [model_input.to_numpy()]
        return [model_input]

    # Not __call__: MLflow treats a callable python_model as a bare predict function and skips
    # load_context.
    def run(self, *inputs: Any) -> Any:
        """Tensors (or arrays) in input order -> torch outputs, as the original model returns them."""
        flat = self.module.run_flat(self._tensors(list(inputs)))
        return flat[0] if len(flat) == 1 else tuple(flat)

    # No type hints here on purpose: MLflow would try to derive (and enforce) a signature from them
    # instead of the TensorSpec signature built from the input specs.
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        """numpy in (one array, ``{name: array}`` or a list in input order), numpy out."""
        flat = self.module.run_flat(self._tensors(self._ordered(model_input)))
        arrays = [t.detach().cpu().numpy() for t in flat]
        return arrays[0] if len(arrays) == 1 else arrays
