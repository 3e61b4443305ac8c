"""TensorRT and TensorRT-RTX engines: one code path for both libraries (same Python API).

``TensorRTBackend("tensorrt")`` drives NVIDIA TensorRT 10/11 (``pip install kiln[tensorrt]``),
``TensorRTBackend("tensorrt-rtx")`` drives TensorRT for RTX (``pip install kiln[tensorrt-rtx]``).
Constructing a backend imports the library and needs a CUDA GPU (BackendUnavailableError
otherwise); the op table (:func:`tensorrt_supports`) needs neither. ``check_runnable()`` says
whether engines built here can also run here (TensorRT-RTX builds on an H100 but refuses to run
on sm_90).

Words: the *engine target* is what an engine is built for, the GPU compute capabilities it runs on
(``cuda:sm_90``; :class:`EngineTarget`, the backend protocol's ``engine_target()``).
The *device* is where a model runs (``cuda:1``), which is not decided here.

One module per job, each name imported from its module (this file only describes them); the first
three call into TensorRT, the other four run (and are tested) on any CPU without it:

- ``builder``: :class:`TensorRTBackend`: parse, build (profile, flags, timing cache), load, refit.
- ``runtime``: deserializing and refitting plans, and the callable :class:`TensorRTEngine`.
- ``library``: importing the library, the GPU's compute capability, TensorRT's log messages.
- ``support``: the op table: which ATen ops go into an engine, and why not.
- ``engine_format``: kiln's engine file (header + xz-compressed stripped plan) and its checks.
- ``onnx_rewrites``: canonical weights and the rewrites that keep them refittable.
- ``build_settings``: optimization profile, refit mode and builder flags from kiln's settings.
"""
