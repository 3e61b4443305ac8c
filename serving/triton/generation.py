"""Serving a generation version on Triton: token ids in, token ids out.

A generation package (``compiler.generation``: a prefill and a decode program over one copy of the
weights) is served by its ``generate``, not by its forward pass, so its served signature is its own
(:func:`generation_served`, ``ServedModel.method == "generate"``)::

    input_ids       INT64 [batch, prompt]   left-padded prompts (batch <= generation.max_batch)
    attention_mask  INT64 [batch, prompt]   optional: 1 for a token, 0 for left padding (default all 1)
    max_new_tokens  INT64 [1]               optional: default 16
    do_sample       BOOL  [1]               optional: default false (greedy)
    temperature     FP32  [1]               optional: with do_sample; default 1.0
    top_k           INT64 [1]               optional: with do_sample; 0 or absent: no limit
    top_p           FP32  [1]               optional: with do_sample; absent: no limit
    seed            INT64 [1]               optional: with do_sample; default 0
    eos_token_id    INT64 [-1]              optional: ids that end a row (default the model's; [] none)
    pad_token_id    INT64 [1]               optional: fills ended rows and short prompts (default the model's)
    ->
    output_ids      INT64 [batch, length]   what ``generate`` returns: the prompts, then the new tokens
    generated_ids   INT64 [batch, new]      the new tokens alone

Streaming (``kiln serve triton export --stream-tokens``: the decoupled transaction policy, for gRPC
streaming clients): a request is answered as it is generated, one response per step holding
``generated_ids`` [batch, 1] (that step's token of every row; a row that ended holds the pad token),
the last one flagged final (``TRITONSERVER_RESPONSE_COMPLETE_FINAL``); the tokens are the ones
``generated_ids`` holds unstreamed. An error ends the stream with a final response carrying it; a
request the client cancelled stops generating at the next token.

Each request is one ``generate`` call over its own rows, so the answer equals ``compiler.load(package)
.generate(...)`` of the same arguments. Triton does not batch requests together (``max_batch_size``
0): prompts of other lengths and other sampling parameters would change each other's tokens (padding
changes the shapes a greedy argmax is computed at). A request outside the compiled limits (a prompt
over the range, ``max_new_tokens`` past the cache, a batch over ``max_batch``, a token id past the
vocabulary) gets INVALID_ARG with the GenerationError or InputSpecError naming the limit and the zoo
field; the other requests of the same execution are answered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.triton.config import ServedModel, TensorSig
from serving.triton.runtime import ServedRuntime

GENERATE = "generate"
DEFAULT_MAX_NEW_TOKENS = 16  # generate's own default
# (name, dtype, dims) of the optional inputs, in the order the config lists them.
PARAMETERS = (
    ("max_new_tokens", "int64", (1,)),
    ("do_sample", "bool", (1,)),
    ("temperature", "float32", (1,)),
    ("top_k", "int64", (1,)),
    ("top_p", "float32", (1,)),
    ("seed", "int64", (1,)),
    ("eos_token_id", "int64", (-1,)),
    ("pad_token_id", "int64", (1,)),
)
OUTPUTS = ("output_ids", "generated_ids")


def generation_served(
    package_dir: Path, manifest: Any, *, name: str, registered: str, version: str
) -> ServedModel:
    """The served signature of a verified generation package (the module docstring). Its
    ``generation.json`` is read (checked against the manifest) so a package whose spec is unreadable is
    refused here, at export, rather than when Triton loads it. Torch-free."""
    from compiler.generation.package import read_spec

    read_spec(package_dir, manifest)
    prompt = [
        TensorSig("input_ids", "int64", (-1, -1)),
        TensorSig("attention_mask", "int64", (-1, -1), optional=True),
    ]
    parameters = [TensorSig(n, dtype, dims, optional=True) for n, dtype, dims in PARAMETERS]
    outputs = tuple(TensorSig(n, "int64", (-1, -1)) for n in OUTPUTS)
    return ServedModel(
        name,
        registered,
        version,
        manifest.content_hash,
        manifest.engine_target,
        (*prompt, *parameters),
        outputs,
        method=GENERATE,
    )


class GenerationRuntime(ServedRuntime):
    """One Triton model instance serving a loaded GenerationModule: one ``generate`` per request."""

    def warm_up(self) -> None:
        """A short generation at the smallest and the largest batch and prompt the package takes, so
        the first requests pay no first-run cost (and, on a GPU, the decode graphs are captured)."""
        import torch

        spec = self.module.spec
        floor = self.module.prompt_floor
        for batch, length in ((1, floor), (spec.max_batch, spec.prompt_max)):
            ids = torch.randint(0, max(spec.vocab_size, 1), (batch, length), device=self.device)
            new = min(2, spec.max_cache_len - length)
            self.module.generate(ids, max_new_tokens=new, eos_token_id=[])

    def execute(self, requests: list) -> list | None:
        if self.decoupled:  # each request answered through its sender, as its tokens come
            for request in requests:
                self._stream(request)
            return None
        responses = []
        for request in requests:
            try:
                responses.append(self.pb.InferenceResponse(output_tensors=self._generate(request)))
            except Exception as exc:  # that request's answer, not the others'
                responses.append(self._error(exc))
        return responses

    def _stream(self, request: Any) -> None:
        """One generate whose every step's tokens go out as a response (the module docstring)."""
        import torch
        from torch.utils import dlpack

        sender = request.get_response_sender()
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        ended = False

        def send(tokens: torch.Tensor, last: bool) -> None:
            nonlocal ended
            if sender.is_cancelled():
                raise _Cancelled
            value = tokens.detach().to("cpu", torch.int64).reshape(-1, 1).contiguous()
            tensor = self.pb.Tensor.from_dlpack(OUTPUTS[1], dlpack.to_dlpack(value))
            sender.send(self.pb.InferenceResponse(output_tensors=[tensor]), flags=final if last else 0)
            ended = last

        try:
            self._call_generate(request, send)
        except _Cancelled:
            sender.send(flags=final)  # Triton needs the final flag even for a cancelled request
        except Exception as exc:  # that request's answer, not the others'
            if not ended:
                sender.send(self._error(exc), flags=final)

    def _tensor(self, request: Any, name: str, dtype: str) -> Any:
        """The request's input ``name`` as a CPU tensor of kiln dtype ``dtype``, or None when left out."""
        import torch

        from compiler.inputs.specs import dtype_name

        found = self.pb.get_input_tensor_by_name(request, name)
        if found is None:
            return None
        tensor = torch.from_dlpack(found.to_dlpack())
        if dtype_name(tensor.dtype) != dtype:
            raise ValueError(f"input {name!r}: expected dtype {dtype}, got {dtype_name(tensor.dtype)}")
        return tensor

    def _scalar(self, request: Any, name: str, dtype: str) -> Any:
        tensor = self._tensor(request, name, dtype)
        if tensor is None:
            return None
        if tensor.numel() != 1:
            raise ValueError(f"input {name!r} holds {tensor.numel()} values; send one (shape [1])")
        return tensor.reshape(()).item()

    def _generate(self, request: Any) -> list:
        import torch
        from torch.utils import dlpack

        ids, out = self._call_generate(request)
        # generate left-pads a prompt shorter than the compiled minimum: the new tokens follow that
        prompt = max(ids.shape[1], self.module.prompt_floor)
        tensors = []
        for name, value in zip(OUTPUTS, (out, out[:, prompt:]), strict=True):
            value = value.detach().to("cpu", torch.int64).contiguous()
            tensors.append(self.pb.Tensor.from_dlpack(name, dlpack.to_dlpack(value)))
        return tensors

    def _call_generate(self, request: Any, on_token: Any = None) -> tuple[Any, Any]:
        """(the request's input_ids, what ``generate`` returned) for the request's inputs."""
        import torch

        ids = self._tensor(request, "input_ids", "int64")
        if ids is None:
            raise ValueError("input 'input_ids' is missing")
        mask = self._tensor(request, "attention_mask", "int64")
        top_k = self._scalar(request, "top_k", "int64")
        eos = self._tensor(request, "eos_token_id", "int64")
        max_new = self._scalar(request, "max_new_tokens", "int64")
        seed = self._scalar(request, "seed", "int64")
        with torch.inference_mode():
            out = self.module.generate(
                ids,
                mask,
                max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new),
                do_sample=bool(self._scalar(request, "do_sample", "bool") or False),
                temperature=_or(self._scalar(request, "temperature", "float32"), 1.0),
                top_k=int(top_k) if top_k else None,
                top_p=self._scalar(request, "top_p", "float32"),
                seed=None if seed is None else int(seed),
                eos_token_id=None if eos is None else [int(v) for v in eos.reshape(-1).tolist()],
                pad_token_id=self._scalar(request, "pad_token_id", "int64"),
                on_token=on_token,
            )
        return ids, out


class _Cancelled(Exception):
    """The client cancelled a streamed request: generation stops at the next token."""


def _or(value: Any, default: float) -> float:
    return default if value is None else float(value)
