"""``registry.targets.resolve_target``: what ``--target`` resolves to, given the registered targets and
this host's GPU (passed in: the hosts here have none; tests/flows/test_cli_targets.py runs the commands)."""

from __future__ import annotations

import pytest

from registry.errors import NoMatchingVersionError, UnknownEngineTargetError
from registry.targets import resolve_target, target_part

REGISTERED = ["cpu", "cuda_sm_80", "cuda_sm_90"]


def test_a_registered_target_in_either_spelling_is_itself() -> None:
    assert target_part("cuda:sm_90") == "cuda_sm_90"
    assert resolve_target("bert", "cuda:sm_90", REGISTERED, gpu=None) == "cuda_sm_90"
    assert resolve_target("bert", "cuda_sm_80", REGISTERED, gpu="sm_90") == "cuda_sm_80"  # typed: no choice
    assert resolve_target("bert", "CPU", REGISTERED, gpu="sm_90") == "cpu"


def test_cuda_is_the_version_built_for_this_gpu() -> None:
    assert resolve_target("bert", "cuda", REGISTERED, gpu="sm_90") == "cuda_sm_90"
    assert resolve_target("bert", "cuda", REGISTERED, gpu="sm_80") == "cuda_sm_80"
    # TensorRT-RTX builds for several architectures: one naming this GPU's counts.
    rtx = ["cpu", "cuda_sm_80_sm_86_sm_89_sm_120"]
    assert resolve_target("bert", "cuda", rtx, gpu="sm_86") == rtx[1]
    with pytest.raises(UnknownEngineTargetError, match=r"none is built for this machine's GPU \(sm_75\)"):
        resolve_target("bert", "cuda", REGISTERED, gpu="sm_75")


def test_cuda_without_a_gpu_is_the_only_cuda_target_or_an_error_listing_them() -> None:
    assert resolve_target("vit", "cuda", ["cpu", "cuda_sm_90"], gpu=None) == "cuda_sm_90"
    with pytest.raises(UnknownEngineTargetError) as caught:
        resolve_target("bert", "cuda", REGISTERED, gpu=None)
    assert "2 CUDA targets are registered" in str(caught.value)
    assert "registered targets: cpu, cuda_sm_80, cuda_sm_90" in str(caught.value)
    assert caught.value.registered == REGISTERED
    with pytest.raises(UnknownEngineTargetError, match="no CUDA target is registered"):
        resolve_target("bert", "cuda", ["cpu"], gpu=None)


def test_a_target_matching_nothing_is_a_no_match_listing_the_registered_ones() -> None:
    with pytest.raises(NoMatchingVersionError, match=r"'cuda:sm_89' matches nothing .* cpu, cuda_sm_80"):
        resolve_target("bert", "cuda:sm_89", REGISTERED, gpu=None)
    with pytest.raises(UnknownEngineTargetError, match="nothing is registered for 'nope'"):
        resolve_target("nope", "cpu", [], gpu=None)
    with pytest.raises(UnknownEngineTargetError, match="'::' matches nothing"):
        resolve_target("bert", "::", REGISTERED, gpu=None)  # no usable characters: still typed


def test_no_target_is_the_models_one_target_else_this_hosts() -> None:
    """No --target: the only registered target whatever the host (a GPU-only model exports and looks up
    without one), else cuda on a GPU host that has a CUDA target registered, else cpu."""
    assert resolve_target("gpt2", None, ["cuda_sm_90"], gpu=None) == "cuda_sm_90"
    assert resolve_target("gpt2", None, ["cpu"], gpu="sm_90") == "cpu"
    assert resolve_target("bert", None, REGISTERED, gpu="sm_90") == "cuda_sm_90"
    assert resolve_target("bert", None, REGISTERED, gpu=None) == "cpu"
    with pytest.raises(UnknownEngineTargetError, match=r"none is built for this machine's GPU \(sm_75\)"):
        resolve_target("bert", None, ["cuda_sm_80", "cuda_sm_90"], gpu="sm_75")
    with pytest.raises(UnknownEngineTargetError, match=r"'cpu' matches nothing .* cuda_sm_80, cuda_sm_90"):
        resolve_target("bert", None, ["cuda_sm_80", "cuda_sm_90"], gpu=None)
    with pytest.raises(UnknownEngineTargetError, match="nothing is registered for 'nope'"):
        resolve_target("nope", None, [], gpu="sm_90")
