"""The MLflow ``python_function`` face of a kiln package.

``load_context`` calls ``compiler.load`` on the package artifact, which verifies the format version,
the content hash and every checksum before anything runs. The modules it may import (to register the
package's custom ops) are the ones the verified manifest recorded when the model was logged, plus the
process's policy (``compiler.program.module_policy``): never a module named in a registry tag. In the strict
mode (``KILN_ALLOWED_OP_MODULES`` set empty) the logged list is ignored too. The logged model carries
``compiler``, ``registry`` and those modules' packages as ``code_paths``, so ``mlflow.pyfunc.load_model``
works in a fresh process without kiln installed (torch, onnxruntime and safetensors must be, as the
model's requirements say). MLflow itself unpickles this class from the logged model: whoever may write
the artifact store may run code in a pyfunc loader; ``kiln lookup`` never uses this path.

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


class KilnPackageModel(mlflow.pyfunc.PythonModel):
    """Wraps a kiln package directory; the compiled module is loaded once per process.

    ``allowed_modules``: modules the load may import (the package's recorded ``op_modules`` at log
    time: they register the custom ops its fallback graph calls).
    """

    def __init__(self, allowed_modules: Sequence[str] = ()) -> None:
        self.allowed_modules = tuple(allowed_modules)
        self.module: Any = None
        self.package_dir: str | None = None

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        import compiler
        from compiler.program.module_policy import is_strict

        self.package_dir = context.artifacts[PACKAGE_ARTIFACT]
        # The logged list was kiln's choice at log time, not this user's: strict mode drops it.
        allowed = () if is_strict() else self.allowed_modules
        self.module = compiler.load(self.package_dir, allowed_modules=allowed)

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.module.input_specs]

    def _tensors(self, values: Sequence[Any]) -> list:
        import torch

        specs = self.module.input_specs
        # numpy arrives on the host; a CUDA package takes its inputs on its device
        device = getattr(self.module, "device", None)
        tensors = []
        for spec, value in zip(specs, values, strict=False):
            tensor = (
                value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
            )
            tensor = tensor.to(spec.torch_dtype) if tensor.dtype != spec.torch_dtype else tensor
            tensors.append(
                tensor.to(device) if device is not None and not isinstance(value, torch.Tensor) else tensor
            )
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

    # ``np.ndarray`` is one of the hints MLflow infers no schema from (mlflow.types.type_hints:
    # type_hints_no_signature_inference): it enforces the TensorSpec signature built from the input
    # specs instead, and warns about nothing. A dict or list of arrays is accepted all the same.
    def predict(
        self,
        context: mlflow.pyfunc.PythonModelContext | None,
        model_input: np.ndarray,
        params: dict[str, Any] | None = None,
    ) -> np.ndarray | list[np.ndarray]:
        """numpy in (one array, ``{name: array}`` or a list in input order), numpy out. A generation
        package is called through ``generate`` (:meth:`generate`)."""
        if hasattr(self.module, "generate"):
            return self.generate(model_input, params)
        flat = self.module.run_flat(self._tensors(self._ordered(model_input)))
        arrays = [t.detach().cpu().numpy() for t in flat]
        return arrays[0] if len(arrays) == 1 else arrays

    def generate(self, model_input: Any, params: Mapping[str, Any] | None = None) -> np.ndarray:
        """A generation package's ``generate``: ``{"input_ids": [B, T], "attention_mask": [B, T]}`` (or
        the two in a list) in, ``output_ids`` [B, T + new] out; ``params`` as its signature names them
        (registry.generation.generate_params; ``top_k`` 0 and ``top_p`` 1.0: no limit)."""
        import torch

        values = self._ordered(model_input)
        ids = torch.as_tensor(np.ascontiguousarray(values[0]))
        mask = torch.as_tensor(np.ascontiguousarray(values[1])) if len(values) > 1 else None
        given = dict(params or {})
        eos = given.get("eos_token_id")
        top_k, top_p = int(given.get("top_k") or 0), float(given.get("top_p", 1.0))
        out = self.module.generate(
            ids,
            mask,
            max_new_tokens=int(given.get("max_new_tokens", 16)),
            do_sample=bool(given.get("do_sample", False)),
            temperature=float(given.get("temperature", 1.0)),
            top_k=top_k or None,
            top_p=None if top_p >= 1.0 else top_p,
            seed=int(given.get("seed", 0)),
            eos_token_id=None if eos is None else [int(v) for v in np.asarray(eos).reshape(-1)],
        )
        return out.cpu().numpy()
