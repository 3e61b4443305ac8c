"""TensorRT / TensorRT-RTX backend.

Everything that needs no GPU runs everywhere: profiles from specs, builder flags from settings,
canonical weight names, refit checks, the engine header and its compatibility checks, the op table,
and the error paths. Where TensorRT-RTX is installed (no GPU needed) the parser and CPU-only
ahead-of-time builds are tested for real. Runtime and refit tests run where a CUDA GPU and a
TensorRT that supports it are present, and are skipped with that reason elsewhere (the H100 here:
TensorRT-RTX's runtime refuses sm_90 and full TensorRT is not installable).
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from compiler.backends.base import BuildSettings, EngineIO
from compiler.backends.tensorrt.build_settings import (
    builder_flag_names,
    choose_profile,
    optimization_profile,
    optimization_profiles,
)
from compiler.backends.tensorrt.builder import TensorRTBackend, _error_node
from compiler.backends.tensorrt.engine_format import (
    EngineTarget,
    check_engine_compatible,
    check_header,
    check_refit_weights,
    decode_engine,
    encode_engine,
)
from compiler.backends.tensorrt.library import RTX_DEFAULT_COMPUTE_CAPABILITIES
from compiler.backends.tensorrt.onnx_rewrites import canonical_initializers, unfold_batch_norm
from compiler.backends.tensorrt.support import (
    _BOOL_BITWISE,
    EXPORTER_FOLDED_SEQUENCE_OPS,
    PARSER_REJECTED_ONNX_OPS,
    onnx_ops_for,
    tensorrt_supports,
    unsupported_reason,
)
from compiler.errors import (
    BackendError,
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    EngineCompatibilityError,
    InputSpecError,
    KilnError,
    RefitError,
)
from compiler.inputs.specs import InputSpec

HAS = {name: importlib.util.find_spec(mod) is not None for name, mod in
       (("tensorrt", "tensorrt"), ("tensorrt-rtx", "tensorrt_rtx"))}  # fmt: skip


# IR 10 (opset 18): readable by every ONNX Runtime and TensorRT parser in use, also older ones.
IR_VERSION = 10


def _io(width: int = 8, out: int = 4) -> EngineIO:
    spec = InputSpec("x0", "float32", (1, width), (4, width), (16, width), {0: "batch"})
    return EngineIO((spec,), ("y0",), ("float32",))


def _mlp_onnx(width: int = 8, out: int = 4, seed: int = 0, extra_op: str | None = None) -> tuple[bytes, dict]:
    """A lowered partition as kiln's lowering writes it: activations x0, outputs y0, weights w0..wN,
    plus one non-canonical constant (a structure constant, not a weight)."""
    rng = np.random.default_rng(seed)
    weights = {
        "w0": rng.standard_normal((width, width)).astype(np.float32),
        "w1": rng.standard_normal(width).astype(np.float32),
        "w2": rng.standard_normal((width, out)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x0", "w0"], ["h0"], name="node_mm0"),
        helper.make_node("Add", ["h0", "w1"], ["h1"], name="node_add0"),
        helper.make_node("Relu", ["h1"], ["h2"], name="node_relu"),
        helper.make_node("Mul", ["h2", "scale"], ["h3"], name="node_scale"),
        helper.make_node("MatMul", ["h3", "w2"], ["y0" if extra_op is None else "h4"], name="node_mm1"),
    ]
    if extra_op == "BitwiseAnd":  # an op TensorRT's parser rejects, on int32 tensors
        nodes += [
            helper.make_node("Cast", ["h4"], ["i0"], to=TensorProto.INT32, name="node_cast"),
            helper.make_node("BitwiseAnd", ["i0", "i0"], ["i1"], name="node_bitand"),
            helper.make_node("Cast", ["i1"], ["y0"], to=TensorProto.FLOAT, name="node_cast_back"),
        ]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    inits.append(numpy_helper.from_array(np.array(0.5, dtype=np.float32), "scale"))
    graph = helper.make_graph(
        nodes,
        "partition_0",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT, ["batch", out])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model.SerializeToString(), {k: torch.from_numpy(v) for k, v in weights.items()}


def _header(**over) -> dict:
    header = {
        "format": 1,
        "backend": "tensorrt-rtx",
        "library_version": "1.7.1.116",
        "targets": list(RTX_DEFAULT_COMPUTE_CAPABILITIES),
        "targets_and_later": True,
        "stripped": True,
        "refit": "weights",
        "weights": {"w0": {"shape": [8, 8], "dtype": "float32"}, "w1": {"shape": [8], "dtype": "float16"}},
        "inputs": ["x0"],
        "outputs": ["y0"],
    }
    header.update(over)
    return header


# ---------------------------------------------------------------------------------------------
# Profiles and settings
# ---------------------------------------------------------------------------------------------


def test_profile_is_min_opt_max_of_every_input_in_order():
    ids = InputSpec("x0", "int64", (1, 4), (2, 16), (8, 64), {0: "batch", 1: "seq"})
    mask = InputSpec("x1", "float32", (1, 1, 4), (2, 1, 16), (8, 1, 64), {0: "batch", 2: "seq"})
    shapes = optimization_profile(EngineIO((ids, mask), ("y0",), ("float32",)))
    assert list(shapes) == ["x0", "x1"]
    assert shapes["x0"] == ((1, 4), (2, 16), (8, 64))
    assert shapes["x1"] == ((1, 1, 4), (2, 1, 16), (8, 1, 64))


def test_profile_with_min_above_max_is_an_input_spec_error():
    bad = {"name": "x0", "dtype": "float32", "min_shape": [9, 8], "opt_shape": [4, 8], "max_shape": [2, 8],
           "dynamic_dims": {"0": "batch"}}  # fmt: skip
    with pytest.raises(InputSpecError, match=r"x0.*axis 0.*min=9 opt=4 max=2"):
        EngineIO.from_dict({"inputs": [bad], "output_names": ["y0"], "output_dtypes": ["float32"]})


def test_profile_rejects_duplicate_input_names():
    spec = _io().inputs[0]
    with pytest.raises(InputSpecError, match="listed twice"):
        optimization_profile(EngineIO((spec, spec), ("y0",), ("float32",)))


def test_each_shape_profile_is_one_more_optimization_profile_after_the_declared_range():
    ids = InputSpec("x0", "int64", (1, 4), (2, 16), (32, 64), {0: "batch", 1: "seq"})
    io = EngineIO((ids,), ("y0",), ("float32",))
    settings = BuildSettings(profiles=({"batch": 1}, {"batch": (2, 8)}, {"batch": (9, 12, 32), "seq": 64}))
    profiles = optimization_profiles(io, settings)
    assert profiles[0] == {"x0": ((1, 4), (2, 16), (32, 64))}  # every declared shape still runs
    assert profiles[1] == {"x0": ((1, 16), (1, 16), (1, 16))}  # a size: min = opt = max, seq at its opt
    assert profiles[2] == {"x0": ((2, 16), (2, 16), (8, 16))}  # a range: opt clipped into it
    assert profiles[3] == {"x0": ((9, 64), (12, 64), (32, 64))}
    # The narrowest profile holding the call's shapes runs it; the declared range takes the rest.
    assert choose_profile(profiles, {"x0": (1, 16)}) == 1
    assert choose_profile(profiles, {"x0": (5, 16)}) == 2
    assert choose_profile(profiles, {"x0": (20, 64)}) == 3
    assert choose_profile(profiles, {"x0": (20, 32)}) == 0
    with pytest.raises(ValueError, match="no optimization profile"):
        choose_profile(profiles, {"x0": (64, 16)})
    # A repeat adds nothing; a profile over a dimension the engine lacks does not apply to it.
    again = BuildSettings(profiles=({"batch": 1}, {"batch": (1, 1)}, {"other": 3}))
    assert len(optimization_profiles(io, again)) == 2


@pytest.mark.parametrize(
    ("strip", "options", "flags"),
    [
        (False, {}, ("REFIT_INDIVIDUAL",)),
        (True, {}, ("REFIT_INDIVIDUAL", "STRIP_PLAN")),
        (False, {"refit": "all"}, ("REFIT",)),
        (True, {"refit": "all"}, ("REFIT", "STRIP_PLAN")),
        (True, {"refit": "identical"}, ("REFIT_IDENTICAL", "STRIP_PLAN")),
        (False, {"refit": "none"}, ()),
    ],
)
def test_builder_flags_follow_settings(strip, options, flags):
    assert builder_flag_names(BuildSettings(strip_weights=strip, options=options)) == flags


def test_stripping_a_non_refittable_engine_fails_loudly():
    # settings mistakes are BuildSettingsError, which on_build_failure never turns into a fallback
    with pytest.raises(BuildSettingsError, match="strip_weights needs a refittable engine"):
        builder_flag_names(BuildSettings(strip_weights=True, options={"refit": "none"}))
    with pytest.raises(BuildSettingsError, match=r"options\['refit'\] is 'sometimes'; expected one of"):
        builder_flag_names(BuildSettings(options={"refit": "sometimes"}))
    with pytest.raises(BuildSettingsError, match=r"unknown backend_options \['refti'\] for TensorRT"):
        builder_flag_names(BuildSettings(options={"refti": "none"}))
    assert not issubclass(BuildSettingsError, EngineBuildError)


# ---------------------------------------------------------------------------------------------
# Canonical weights and refit checks
# ---------------------------------------------------------------------------------------------


def test_canonical_weights_are_the_w_initializers_in_index_order():
    inits = [
        numpy_helper.from_array(np.zeros((3, 2), np.float32), "w10"),
        numpy_helper.from_array(np.zeros(2, np.float16), "w2"),
        numpy_helper.from_array(np.zeros(4, np.int64), "val_3"),  # a constant of the structure
        numpy_helper.from_array(np.zeros((2, 2), np.float32), "w0"),
        helper.make_tensor("w1", TensorProto.BFLOAT16, [5], np.zeros(5, np.uint16).tobytes(), raw=True),
    ]
    graph = helper.make_graph([], "g", [], [], inits)
    weights = canonical_initializers(helper.make_model(graph))
    assert list(weights) == ["w0", "w1", "w2", "w10"]
    assert weights["w1"] == {"shape": [5], "dtype": "bfloat16"}
    assert weights["w2"] == {"shape": [2], "dtype": "float16"}
    assert weights["w10"] == {"shape": [3, 2], "dtype": "float32"}


def test_refit_weights_must_match_names_shapes_and_dtypes():
    declared = _header()["weights"]
    good = {"w0": torch.zeros(8, 8), "w1": torch.zeros(8, dtype=torch.float16)}
    check_refit_weights(declared, good, require_all=True)
    check_refit_weights(declared, {"w0": torch.ones(8, 8)}, require_all=False)
    with pytest.raises(RefitError, match=r"unknown weights \['fc.weight'\].*are \['w0', 'w1'\]"):
        check_refit_weights(declared, {**good, "fc.weight": torch.zeros(1)}, require_all=True)
    with pytest.raises(RefitError, match=r"weights \['w1'\] are missing"):
        check_refit_weights(declared, {"w0": torch.zeros(8, 8)}, require_all=True)
    with pytest.raises(RefitError, match=r"'w0': expected shape \(8, 8\), got \(8, 4\)"):
        check_refit_weights(declared, {**good, "w0": torch.zeros(8, 4)}, require_all=True)
    with pytest.raises(RefitError, match="'w1': expected dtype float16, got float32"):
        check_refit_weights(declared, {**good, "w1": torch.zeros(8)}, require_all=True)
    with pytest.raises(RefitError, match=r"expected a torch\.Tensor, got ndarray"):
        check_refit_weights(declared, {**good, "w0": np.zeros((8, 8))}, require_all=True)


def _conv_bn_onnx(dtype=np.float32) -> bytes:
    """Conv -> BatchNormalization (inference) -> Relu, as the lowering writes a ResNet stem."""
    rng = np.random.default_rng(0)
    onnx_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(dtype), "w0"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(dtype), "w1"),  # scale
        numpy_helper.from_array(rng.standard_normal(4).astype(dtype), "w2"),  # bias
        numpy_helper.from_array(rng.standard_normal(4).astype(dtype), "w3"),  # running mean
        numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(dtype), "w4"),  # running var
    ]
    nodes = [
        helper.make_node("Conv", ["x0", "w0"], ["v0"], pads=[1, 1, 1, 1], name="node_conv"),
        helper.make_node(
            "BatchNormalization", ["v0", "w1", "w2", "w3", "w4"], ["v1"], epsilon=1e-3, name="bn"
        ),
        helper.make_node("Relu", ["v1"], ["y0"], name="node_relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "stem",
        [helper.make_tensor_value_info("x0", onnx_type, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y0", onnx_type, ["batch", 4, 8, 8])],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION
    ).SerializeToString()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batch_norm_unfolds_into_named_weight_arithmetic_with_equal_outputs(dtype):
    import onnxruntime as ort

    original = _conv_bn_onnx(dtype)
    model = onnx.load_model_from_string(original)
    assert unfold_batch_norm(model) == 1
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and {"Sub", "Div", "Mul", "Sqrt"} <= set(ops)
    assert list(canonical_initializers(model)) == ["w0", "w1", "w2", "w3", "w4"]
    # each BatchNorm parameter is still consumed by name (so TensorRT can refit it)
    consumed = {i for n in model.graph.node for i in n.input}
    assert {"w1", "w2", "w3", "w4"} <= consumed
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(dtype)

    def run(m: bytes) -> np.ndarray:
        return ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"x0": x})[0]

    tol = 1e-5 if dtype == np.float32 else 1e-2  # fp16 rounds differently per op order
    np.testing.assert_allclose(run(model.SerializeToString()), run(original), rtol=tol, atol=tol)
    assert unfold_batch_norm(onnx.load_model_from_string(_mlp_onnx()[0])) == 0


# ---------------------------------------------------------------------------------------------
# Engine header and compatibility
# ---------------------------------------------------------------------------------------------


def test_engine_header_round_trips_and_keeps_the_plan_unchanged():
    plan = bytes(range(256)) * 3
    header, body = decode_engine(encode_engine(_header(), plan))
    assert header == {**_header(), "plan_encoding": "raw"} and bytes(body) == plan


def test_compressed_plans_round_trip_exactly_and_shrink_redundant_kernel_code():
    rng = np.random.default_rng(0)
    kernel = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()  # one "cubin", repeated per layer
    plan = kernel * 64 + rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    engine = encode_engine(_header(stripped=True), plan, compress=True)
    header, body = decode_engine(engine)
    assert header["plan_encoding"] == "xz" and bytes(body) == plan
    assert len(engine) < len(plan) / 20
    # re-encoding a decoded header without compression stores the plan raw, and says so
    header2, body2 = decode_engine(encode_engine(header, bytes(body)))
    assert header2["plan_encoding"] == "raw" and bytes(body2) == plan


def test_engine_from_before_compression_decodes_as_raw():
    text = json.dumps(_header(), sort_keys=True).encode()  # no plan_encoding key
    header, body = decode_engine(b"KILNTRT1" + struct.pack("<I", len(text)) + text + b"plan")
    assert bytes(body) == b"plan" and "plan_encoding" not in header


def test_corrupt_compressed_plan_or_unknown_encoding_is_a_compatibility_error():
    engine = bytearray(encode_engine(_header(), b"kernels" * 1000, compress=True))
    engine[-20] ^= 0xFF  # inside the xz stream: its CRC64 catches it
    with pytest.raises(EngineCompatibilityError, match=r"plan is corrupt \(xz: "):
        decode_engine(bytes(engine))
    text = json.dumps({**_header(), "plan_encoding": "zstd"}).encode()
    with pytest.raises(EngineCompatibilityError, match="plan encoding 'zstd'; this kiln reads"):
        decode_engine(b"KILNTRT1" + struct.pack("<I", len(text)) + text + b"plan")


@pytest.mark.parametrize("data", [b"", b"ftrt" * 10, b"KILNTRT1\x05\x00\x00\x00{oops"])
def test_foreign_or_corrupt_engine_bytes_are_a_compatibility_error(data):
    with pytest.raises(EngineCompatibilityError, match=r"not a kiln TensorRT engine|header is corrupt"):
        decode_engine(data)


def test_newer_header_format_is_refused():
    with pytest.raises(EngineCompatibilityError, match="header format 2; this kiln reads 1"):
        decode_engine(encode_engine(_header(format=2), b"plan"))


def _header_checks(engine: bytes, weights: dict) -> tuple[bytes, list, int]:
    """What a load checks of an engine's header before TensorRT reads its plan (TensorRTBackend._deserialize,
    refit_in_place, TensorRTEngine's profiles on a plan with two): the plan, the profiles and the one a
    (4, 8) input runs under, or an error."""
    header, plan = decode_engine(engine)
    check_header(header)
    check_engine_compatible(header, "tensorrt-rtx", "1.7.1.116", "sm_120")
    if header.get("refit", "none") == "none":
        raise RefitError("built without refit")  # refit_in_place's refusal
    check_refit_weights(
        header["weights"], weights, require_all=header["refit"] != "all" or header["stripped"]
    )
    profiles = [{n: tuple(tuple(s) for s in b) for n, b in p.items()} for p in header.get("profiles", [])]
    if (len(profiles) or 1) != 2:  # the plan has two
        raise EngineCompatibilityError("profiles")
    try:
        chosen = choose_profile(profiles, {"x0": (4, 8)})
    except ValueError as exc:  # TensorRTEngine.__call__
        raise InputSpecError(str(exc)) from None
    return bytes(plan), profiles, chosen


def test_every_tampered_header_field_is_a_typed_refusal_before_tensorrt():
    """Issue 23's tamper pass for the TensorRT engine header (no GPU needed: these checks come first).
    Each field changed in turn (type, hostile string, dropped, huge): a KilnError, or the same plan and
    profiles as the original; never a crash (a targets string or an empty list was a ValueError)."""
    from tests.compiler.package.untrusted_probe import MUTATIONS, _mutate, _paths

    clean = _header(
        targets=["sm_86", "sm_120"],
        profiles=[{"x0": [[1, 8], [4, 8], [8, 8]]}, {"x0": [[9, 8], [16, 8], [32, 8]]}],
    )
    weights = {"w0": torch.zeros(8, 8), "w1": torch.zeros(8, dtype=torch.float16)}
    original = _header_checks(encode_engine(clean, b"plan" * 64, compress=True), weights)
    outcomes: dict[str, str] = {}
    for path in _paths(clean, limit=6):
        for how in MUTATIONS:
            header = json.loads(json.dumps(clean))
            if not _mutate(header, path, how):
                continue
            name = f"{'.'.join(map(str, path))}: {how}"
            try:
                same = _header_checks(encode_engine(header, b"plan" * 64, compress=True), weights) == original
                outcomes[name] = "same" if same else "different"
            except KilnError:
                outcomes[name] = "refused"
            except Exception as exc:
                outcomes[name] = f"crashed: {type(exc).__name__}: {exc}"
    wrong = {k: v for k, v in outcomes.items() if v not in ("refused", "same")}
    assert not wrong, wrong
    assert len(outcomes) > 60 and set(outcomes.values()) == {"refused", "same"}, outcomes
    assert outcomes["targets: type"] == outcomes["targets.0: huge"] == "refused"
    unhashable = json.loads(json.dumps(clean))
    unhashable["weights"]["w0"]["dtype"] = ["float32"]
    with pytest.raises(KilnError, match="header field 'weights'"):
        _header_checks(encode_engine(unhashable, b"plan"), weights)


def test_engines_run_only_with_their_library_version_and_device():
    header = _header()
    check_engine_compatible(header, "tensorrt-rtx", "1.7.1.116", "sm_86")
    check_engine_compatible(header, "tensorrt-rtx", "1.7.1.116", "sm_121")  # "and later"
    with pytest.raises(
        EngineCompatibilityError, match=r"sm_80, sm_86, sm_89, sm_120 and later; this GPU is sm_90"
    ):
        check_engine_compatible(header, "tensorrt-rtx", "1.7.1.116", "sm_90")
    with pytest.raises(
        EngineCompatibilityError, match=r"built by tensorrt-rtx 1\.7\.1\.116, but this backend is tensorrt"
    ):
        check_engine_compatible(header, "tensorrt", "10.13.0", "sm_90")
    with pytest.raises(EngineCompatibilityError, match=r"this backend is tensorrt-rtx 1\.8\.0"):
        check_engine_compatible(header, "tensorrt-rtx", "1.8.0", "sm_86")
    exact = _header(backend="tensorrt", library_version="10.13.0", targets=["sm_90"], targets_and_later=False)
    check_engine_compatible(exact, "tensorrt", "10.13.0", "sm_90")
    with pytest.raises(EngineCompatibilityError, match="built for sm_90; this GPU is sm_100"):
        check_engine_compatible(exact, "tensorrt", "10.13.0", "sm_100")


def test_engine_target_is_stored_under_the_format_1_header_keys():
    # Engines on disk carry "targets"/"targets_and_later": the bytes below are spelled out by hand,
    # as kiln has written them since header format 1, so a renamed key cannot pass unnoticed.
    text = (
        b'{"backend":"tensorrt-rtx","format":1,"inputs":["x0"],"library_version":"1.7.1.116",'
        b'"outputs":["y0"],"plan_encoding":"raw","refit":"weights","stripped":false,'
        b'"targets":["sm_86"],"targets_and_later":true,"weights":{}}'
    )
    header, plan = decode_engine(b"KILNTRT1" + struct.pack("<I", len(text)) + text + b"plan")
    assert EngineTarget.from_header(header) == EngineTarget(("sm_86",), and_later=True)
    check_engine_compatible(header, "tensorrt-rtx", "1.7.1.116", "sm_89")
    with pytest.raises(EngineCompatibilityError, match="built for sm_86 and later; this GPU is sm_80"):
        check_engine_compatible(header, "tensorrt-rtx", "1.7.1.116", "sm_80")
    # and what is written now is byte for byte what format 1 wrote
    written = encode_engine({k: v for k, v in header.items() if k != "plan_encoding"}, bytes(plan))
    assert written == b"KILNTRT1" + struct.pack("<I", len(text)) + text + b"plan"
    assert EngineTarget(("sm_86",), and_later=True).header_fields() == {
        "targets": ["sm_86"],
        "targets_and_later": True,
    }


def test_engine_target_spells_cache_keys_as_before():
    # engine_target() (a cache-key and manifest field) is str(EngineTarget): its spelling must not move
    portable = EngineTarget(RTX_DEFAULT_COMPUTE_CAPABILITIES, and_later=True)
    assert str(portable) == "cuda:sm_80+sm_86+sm_89+sm_120+"
    assert str(EngineTarget(("sm_90",))) == "cuda:sm_90"
    assert portable.runs_on("sm_121") and portable.runs_on("sm_86") and not portable.runs_on("sm_90")
    assert not EngineTarget(("sm_90",)).runs_on("sm_100")
    assert EngineTarget.from_header(_header()) == portable


def test_build_errors_name_the_longest_matching_onnx_node():
    names = ["node_linear", "node_linear_1", "node_relu"]
    assert _error_node("Error in layer node_linear_1 [MatMul]: bad shape", names) == "node_linear_1"
    assert _error_node("[node_linear]: unsupported", names) == "node_linear"
    assert _error_node("Myelin: out of memory", names) is None


# ---------------------------------------------------------------------------------------------
# Supported ops
# ---------------------------------------------------------------------------------------------

aten = torch.ops.aten


@pytest.mark.parametrize(
    "op",
    [aten.addmm.default, aten.mm.default, aten.add.Tensor, aten._softmax.default, aten.gelu.default,
     aten.native_layer_norm.default, aten.convolution.default, aten.split.Tensor, aten.embedding.default,
     aten.sym_size.int, aten.where.self, aten.bitwise_and.Tensor, aten.bitwise_not.default],
)  # fmt: skip
def test_common_ops_go_to_tensorrt(op):
    assert tensorrt_supports(op), unsupported_reason(op)


@pytest.mark.parametrize(
    ("op", "why"),
    [
        (aten.bitwise_left_shift.Tensor, "BitShift"),
        (aten.linalg_det.default, "Det"),
        (aten.bernoulli.default, "Bernoulli"),
        (aten.nll_loss_forward.default, "NegativeLogLikelihoodLoss"),
        (aten.cumprod.default, "no ONNX translation"),
    ],
)
def test_ops_whose_onnx_translation_tensorrt_rejects_fall_back(op, why):
    assert not tensorrt_supports(op)
    assert why in unsupported_reason(op)


def test_custom_ops_and_control_flow_fall_back():
    import zoo.models  # registers kiln_zoo::soft_sign_clip

    assert zoo.models.soft_sign_clip is not None
    assert (
        unsupported_reason(torch.ops.kiln_zoo.soft_sign_clip.default)
        == "no ONNX translation in the torch.onnx exporter"
    )
    assert not tensorrt_supports(torch.ops.higher_order.cond)


def test_tensorrt_table_is_the_exporter_table_minus_rejected_onnx_ops():
    from compiler.backends.onnx_support import _registry, onnx_exportable

    overloads = [getattr(getattr(aten, n.split("::")[1].split(".")[0]), [*n.split("."), "default"][1], None)
                 for n in _registry().functions if isinstance(n, str) and n.startswith("aten::")]  # fmt: skip
    overloads = [o for o in overloads if isinstance(o, torch._ops.OpOverload)]
    assert len(overloads) > 300
    rejected = []
    for op in overloads:
        ops = onnx_ops_for(op)
        assert onnx_exportable(op) == (ops is not None)
        if tensorrt_supports(op) and op.name() not in _BOOL_BITWISE:
            assert not (ops - EXPORTER_FOLDED_SEQUENCE_OPS) & PARSER_REJECTED_ONNX_OPS
        else:
            rejected.append(str(op))
    # Most of the exporter's table stays; what goes is bitwise, sequence, loss, sampling and det ops.
    assert 20 <= len(rejected) <= 80, rejected


@pytest.mark.skipif(
    not HAS["tensorrt-rtx"], reason="TensorRT-RTX is not installed (pip install kiln[tensorrt-rtx])"
)
def test_rejected_onnx_ops_match_the_installed_parser():
    import onnx.defs
    import tensorrt_rtx as trt

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    parser = trt.OnnxParser(builder.create_network(0), logger)
    ops = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")}
    assert {op for op in ops if not parser.supports_operator(op)} == PARSER_REJECTED_ONNX_OPS & ops


# ---------------------------------------------------------------------------------------------
# Library and device availability
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "extra"), [("tensorrt", "kiln[tensorrt]"), ("tensorrt-rtx", "kiln[tensorrt-rtx]")]
)
def test_missing_library_names_the_extra_to_install(name, extra):
    if HAS[name]:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(BackendUnavailableError, match=re.escape(f"pip install {extra}")):
        TensorRTBackend(name)


def test_unknown_backend_and_bad_compute_capabilities_are_backend_errors():
    with pytest.raises(BackendError, match=r"unknown TensorRT backend 'tensorrt-llm'; expected one of"):
        TensorRTBackend("tensorrt-llm")
    with pytest.raises(BackendError, match="compute_capabilities is a TensorRT-RTX setting"):
        TensorRTBackend("tensorrt", compute_capabilities=("sm_90",))
    with pytest.raises(BackendError, match="one explicit target"):
        TensorRTBackend("tensorrt-rtx", compute_capabilities=("sm_86", "sm_89"))
    with pytest.raises(BackendError, match="expected the form 'sm_86'"):
        TensorRTBackend("tensorrt-rtx", compute_capabilities=("8.6",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
@pytest.mark.skipif(
    not HAS["tensorrt-rtx"], reason="TensorRT-RTX is not installed (pip install kiln[tensorrt-rtx])"
)
def test_no_gpu_is_backend_unavailable_but_parsing_and_cpu_builds_work():
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        TensorRTBackend("tensorrt-rtx")
    backend = TensorRTBackend("tensorrt-rtx", require_gpu=False)
    onnx_bytes, _ = _mlp_onnx()
    assert backend.parse(onnx_bytes, _io()) >= 5
    with pytest.raises(BackendUnavailableError, match=r"refittable engine.*needs a CUDA GPU"):
        backend.build(onnx_bytes, _io(), BuildSettings())
    # TensorRT-RTX compiles non-refittable engines ahead of time on the CPU.
    engine = backend.build(onnx_bytes, _io(), BuildSettings(options={"refit": "none"}))
    header, plan = decode_engine(engine)
    assert header["backend"] == "tensorrt-rtx" and header["library_version"] == backend.library_version()
    assert header["targets"] == list(RTX_DEFAULT_COMPUTE_CAPABILITIES) and header["targets_and_later"]
    assert header["weights"] == {
        "w0": {"shape": [8, 8], "dtype": "float32"},
        "w1": {"shape": [8], "dtype": "float32"},
        "w2": {"shape": [8, 4], "dtype": "float32"},
    }
    assert len(plan) > 1000 and not header["stripped"]
    with pytest.raises(BackendUnavailableError, match="running an engine"):
        backend.load(engine, _io(), None)


@pytest.mark.skipif(
    not HAS["tensorrt-rtx"], reason="TensorRT-RTX is not installed (pip install kiln[tensorrt-rtx])"
)
def test_parser_errors_name_the_partition_and_node():
    backend = TensorRTBackend("tensorrt-rtx", require_gpu=False)
    onnx_bytes, _ = _mlp_onnx(extra_op="BitwiseAnd")
    with pytest.raises(
        EngineBuildError, match=r"rejected partition part_7: node 'node_bitand' \(BitwiseAnd\)"
    ) as err:
        backend.parse(onnx_bytes, _io(), partition="part_7")
    assert err.value.partition == "part_7" and err.value.node == "node_bitand"


@pytest.mark.skipif(
    not HAS["tensorrt-rtx"], reason="TensorRT-RTX is not installed (pip install kiln[tensorrt-rtx])"
)
def test_unfolded_batch_norm_weights_can_be_marked_refittable():
    backend = TensorRTBackend("tensorrt-rtx", require_gpu=False)
    spec = InputSpec("x0", "float32", (1, 3, 8, 8), (2, 3, 8, 8), (4, 3, 8, 8), {0: "b"})
    io = EngineIO((spec,), ("y0",), ("float32",))
    _logger, _builder, folded, _parser = backend._parsed(_conv_bn_onnx(), io, "stem")
    assert not folded.mark_weights_refittable("w1")  # the parser folded BatchNorm's weights away
    model = onnx.load_model_from_string(_conv_bn_onnx())
    unfold_batch_norm(model)
    _logger, _builder, network, _parser = backend._parsed(model.SerializeToString(), io, "stem")
    assert all(network.mark_weights_refittable(f"w{i}") for i in range(5))


@pytest.mark.skipif(
    not HAS["tensorrt-rtx"], reason="TensorRT-RTX is not installed (pip install kiln[tensorrt-rtx])"
)
def test_engine_io_that_does_not_match_the_graph_is_refused():
    backend = TensorRTBackend("tensorrt-rtx", require_gpu=False)
    onnx_bytes, _ = _mlp_onnx()
    renamed = EngineIO(
        (InputSpec("input_ids", "float32", (1, 8), (4, 8), (16, 8), {0: "b"}),), ("y0",), ("float32",)
    )
    with pytest.raises(EngineBuildError, match=r"inputs \['x0'\].*declares inputs \['input_ids'\]"):
        backend.parse(onnx_bytes, renamed, partition="p")
    wrong_width = EngineIO(
        (InputSpec("x0", "float32", (1, 6), (4, 6), (16, 6), {0: "b"}),), ("y0",), ("float32",)
    )
    with pytest.raises(InputSpecError, match=r"'x0' has shape \(-1, 8\).*min \(1, 6\) max \(16, 6\)"):
        backend.parse(onnx_bytes, wrong_width, partition="p")


# ---------------------------------------------------------------------------------------------
# Build failures on real TensorRT: a GPU to build on (running its engines is not needed)
# ---------------------------------------------------------------------------------------------


def _first_backend(runnable: bool) -> TensorRTBackend:
    """TensorRT, else TensorRT-RTX, that can build here (and, if ``runnable``, run what it builds);
    skips the test with each library's reason otherwise."""
    reasons = []
    for name in ("tensorrt", "tensorrt-rtx"):
        try:
            backend = TensorRTBackend(name)
            if runnable:
                backend.check_runnable()
            return backend
        except BackendUnavailableError as exc:
            reasons.append(f"{name}: {exc}")
    need = "a TensorRT that supports it" if runnable else "TensorRT or TensorRT-RTX to build on"
    pytest.skip(f"needs a CUDA GPU and {need}; " + " | ".join(reasons))


@pytest.fixture(scope="module")
def buildable():
    return _first_backend(runnable=False)


@pytest.mark.gpu
def test_stripped_builds_lose_their_weights_and_are_stored_compressed(buildable):
    onnx_bytes, weights = _mlp_onnx(width=1024, out=1024)
    io = _io(1024, 1024)
    full = buildable.build(onnx_bytes, io, BuildSettings())
    stripped = buildable.build(onnx_bytes, io, BuildSettings(strip_weights=True))
    (full_header, full_plan), (header, plan) = decode_engine(full), decode_engine(stripped)
    assert full_header["plan_encoding"] == "raw" and header["plan_encoding"] == "xz" and header["stripped"]
    weight_bytes = sum(w.nbytes for w in weights.values())
    assert len(full_plan) - len(plan) >= 0.99 * weight_bytes  # stripping removed the weights
    assert len(stripped) <= 0.02 * len(full)  # the 2% target, on the bytes kiln stores


@pytest.mark.gpu
def test_shape_profiles_build_into_one_engine_with_an_optimization_profile_each(buildable):
    onnx_bytes, _ = _mlp_onnx(width=64, out=64)
    io = _io(64, 64)
    settings = BuildSettings(profiles=({"batch": 1}, {"batch": 8}, {"batch": (2, 16)}))
    header, plan = decode_engine(buildable.build(onnx_bytes, io, settings))
    assert header["profiles"] == [
        {"x0": [[1, 64], [4, 64], [16, 64]]},  # the declared range, first
        {"x0": [[1, 64], [1, 64], [1, 64]]},
        {"x0": [[8, 64], [8, 64], [8, 64]]},
        {"x0": [[2, 64], [4, 64], [16, 64]]},
    ]
    single = decode_engine(buildable.build(onnx_bytes, io, BuildSettings()))
    assert "profiles" not in single[0] and len(plan) > len(single[1])  # more kernels, one per profile


@pytest.mark.gpu
def test_timing_cache_persists_beside_the_engine_cache_where_the_library_has_one(buildable, tmp_path):
    onnx_bytes, _ = _mlp_onnx()
    buildable.build(onnx_bytes, _io(), BuildSettings(), cache_dir=tmp_path)
    files = sorted(p.name for p in (tmp_path / "timing").glob("*.timing"))
    if buildable.rtx:  # TensorRT-RTX's timing cache changes no engine and would force a GPU query
        assert files == []
        return
    assert files == [f"{buildable.name}-{buildable.library_version()}-{buildable.engine_target()[5:]}.timing"]
    first = (tmp_path / "timing" / files[0]).stat().st_size
    buildable.build(_mlp_onnx(width=16, out=8)[0], _io(16, 8), BuildSettings(), cache_dir=tmp_path)
    assert (tmp_path / "timing" / files[0]).stat().st_size >= first > 0  # read, extended, written back


class _IntegerMask(torch.nn.Module):
    """The op table takes bitwise_and (And on the bool masks of every transformer); on int64 it lowers
    to BitwiseAnd, which TensorRT's ONNX parser rejects: a real build failure."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.bitwise_and(ids, 1).unsqueeze(-1).to(x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fallback", ["onnxruntime", "torch"])
def test_a_partition_the_parser_rejects_falls_back_and_the_report_names_the_node(
    buildable, fallback, tmp_path
):
    import compiler

    torch.manual_seed(0)
    model = _IntegerMask().eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    x, ids = torch.randn(3, 8), torch.arange(3)
    program = compiler.export(model, (x, ids), dynamic_shapes=({0: batch}, {0: batch}))
    compiled = compiler.compile(program, backend=buildable.name, on_build_failure=fallback, cache=tmp_path)
    (failure,) = compiled.report.build_failures
    assert failure["backend"] == buildable.name and failure["fell_back_to"] == fallback
    assert "BitwiseAnd" in failure["error"] and failure["node"]
    assert [a.backend for a in compiled.engines.values()] == [fallback]
    assert compiled.report.engines_built == (1 if fallback == "onnxruntime" else 0)
    for n in (1, 5, 16):
        x, ids = torch.randn(n, 8), torch.arange(n)
        torch.testing.assert_close(compiled(x, ids), model(x, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(EngineBuildError, match="BitwiseAnd") as err:
        compiler.compile(program, backend=buildable.name, on_build_failure="error", cache=tmp_path)
    assert err.value.partition == "engine_0" and err.value.node


# ---------------------------------------------------------------------------------------------
# Runtime and refit: a CUDA GPU and a TensorRT that runs on it
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runnable():
    return _first_backend(runnable=True)


def _reference(x: torch.Tensor, w: dict) -> torch.Tensor:
    return (torch.relu(x @ w["w0"] + w["w1"]) * 0.5) @ w["w2"]


@pytest.mark.gpu
def test_full_engine_runs_and_matches_torch_on_the_current_stream(runnable):
    onnx_bytes, weights = _mlp_onnx()
    engine = runnable.load(runnable.build(onnx_bytes, _io(), BuildSettings()), _io(), None)
    for batch in (1, 4, 16):
        x = torch.randn(batch, 8, device="cuda")
        (y,) = engine(x)
        torch.cuda.current_stream().synchronize()
        assert y.shape == (batch, 4) and y.device.type == "cuda"
        torch.testing.assert_close(y.cpu(), _reference(x.cpu(), weights), rtol=1e-3, atol=1e-3)
    with pytest.raises(InputSpecError, match="outside the spec"):
        engine(torch.randn(17, 8, device="cuda"))


@pytest.mark.gpu
def test_stripped_engine_is_small_needs_weights_and_refits_exactly(runnable):
    onnx_bytes, weights = _mlp_onnx(width=512, out=512)
    io = _io(512, 512)
    full = runnable.build(onnx_bytes, io, BuildSettings())
    stripped = runnable.build(onnx_bytes, io, BuildSettings(strip_weights=True))
    assert len(stripped) < len(full) - 4 * 512 * 512
    with pytest.raises(RefitError, match="weight-stripped; load it with its weights"):
        runnable.load(stripped, io, None)
    with pytest.raises(RefitError, match=r"expected shape \(512, 512\), got \(512, 4\)"):
        runnable.load(stripped, io, {**weights, "w0": torch.zeros(512, 4)})
    with pytest.raises(RefitError, match=r"weights \['w2'\] are missing"):
        runnable.load(stripped, io, {"w0": weights["w0"], "w1": weights["w1"]})
    x = torch.randn(4, 512, device="cuda")
    (y_full,) = runnable.load(full, io, None)(x)
    (y_stripped,) = runnable.load(stripped, io, weights)(x)
    torch.testing.assert_close(y_stripped, y_full, rtol=0, atol=0)


@pytest.mark.gpu
def test_refit_with_other_weights_equals_a_build_with_them(runnable):
    onnx_bytes, _ = _mlp_onnx(seed=0)
    other_bytes, other = _mlp_onnx(seed=1)
    refitted = runnable.refit(runnable.build(onnx_bytes, _io(), BuildSettings()), other)
    x = torch.randn(4, 8, device="cuda")
    (y_refit,) = runnable.load(refitted, _io(), None)(x)
    (y_built,) = runnable.load(runnable.build(other_bytes, _io(), BuildSettings()), _io(), None)(x)
    torch.testing.assert_close(y_refit, y_built, rtol=1e-5, atol=1e-5)
    assert not decode_engine(refitted)[0]["stripped"]


@pytest.mark.gpu
def test_engine_from_another_library_version_is_refused_before_use(runnable):
    onnx_bytes, _ = _mlp_onnx()
    header, plan = decode_engine(runnable.build(onnx_bytes, _io(), BuildSettings()))
    forged = encode_engine({**header, "library_version": "0.0.1"}, bytes(plan))
    with pytest.raises(EngineCompatibilityError, match=r"built by .* 0\.0\.1"):
        runnable.load(forged, _io(), None)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_engines_run_close_to_eager_and_round_trip_stripped(runnable, precision, tmp_path):
    """int8 / fp8 (issue 19): calibrated symmetric Q/DQ graphs, scales compiled into each instance's
    engine, weights refit into stripped engines at load."""
    import compiler
    from benchmarks.quantization import sensitive_case

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 engines need compute capability 8.9+")
    model, program, data = sensitive_case(width=64, blocks=4, hot=-1, batch=8, samples=12)  # no hot block
    options = compiler.CompileOptions(
        backend=runnable.name,
        precision=precision,
        split_modules=("OutlierBlock",),
        strip_weights=True,
        calibration={"samples": 8},
    )
    compiled = compiler.compile(program, options, cache=False, calibration_data=data)
    blocks = [f"engine_{i}" for i in range(4)]
    assert set(blocks) <= set(compiled.report.quantization["partitions"])
    assert compiled.report.unique_fingerprints >= len(blocks)  # scales compiled in: an engine each
    x = data["x"][10]  # held out: calibration took the first 8
    with torch.no_grad():
        expected, actual = model(x), compiled(x)
    error = float((actual - expected).norm() / expected.norm())
    assert 0 < error < 0.3, error  # random 64-wide blocks: ONNX Runtime's own int8 build is at 0.11
    compiler.save(compiled, tmp_path / f"{precision}.kiln")
    loaded = compiler.load(tmp_path / f"{precision}.kiln")
    torch.testing.assert_close(loaded(x), actual)
