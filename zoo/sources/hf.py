"""``hf:`` sources: a Hugging Face ``save_pretrained`` folder or a hub id, loaded for one ``task``.

``hf:<folder>`` (absolute, or relative to the zoo file's directory) or ``hf:<org>/<name>`` (a hub id,
with an optional ``revision``). Loading uses the transformers Auto class of the task, safetensors
weights only (a folder with only ``pytorch_model.bin`` is refused: loading it would unpickle), fp32
weights (precision is the compiler's job) and ``trust_remote_code`` only when the entry sets it.

Identity without loading: the resolved revision (a hub commit; a folder has none) and the sha256 of
``config.json``, the safetensors weights and their index (with remote code, every ``*.py`` below the
folder, keyed by its path: whatever that code can import), plus the task, the entry's
``attn_implementation`` and the transformers and torch versions that turn them into a graph. An
``attn_implementation`` (the entry's or in ``config.json``) that would make transformers fetch a kernel
from the hub is refused before loading (``hf_tasks.attention_problem``). A hub id is
resolved to a snapshot in the local Hugging Face cache first (online: those files are downloaded, never
tokenizers or ``*.bin``); with ``HF_HUB_OFFLINE=1`` only the cache is used, and a hub id not in it is a
:class:`ZooConfigError` naming the source. A source object resolves its hub id once and loads that
commit, so a branch that moves mid-compile cannot swap the model under its key.

Inputs from the config and the task: text models take what a tokenizer gives that their ``forward``
takes and their config uses (``input_ids``; ``attention_mask``; ``token_type_ids`` where
``type_vocab_size > 1``, its example a sentence pair spanning the segment ids), int64, batch 1..8 and
sequence 1..min(512, max_position_embeddings); vision models take float32 ``pixel_values`` at the
config's ``image_size`` (224 where the config has none), batch 1..8. The entry's ``inputs:`` override
these ranges, or drop an optional input, as for every source (``zoo.inputs``).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from compiler import json_reader
from compiler.errors import SpecialFileError
from compiler.inputs.files import regular_file
from compiler.quantization.torchao_guard import keep_torchao_out_of_transformers
from zoo.errors import UntrustedCodeError, ZooConfigError
from zoo.sources.base import LoadedCase, SourceIdentity, digest_of, torch_version
from zoo.sources.common import example_size, fit_example_shape, override_dims, resolve_path, sha256_file
from zoo.sources.hf_tasks import HF_TASKS, check_attention, check_task

MAX_BATCH = 8
MAX_SEQ = 512
DEFAULT_IMAGE_SIZE = 224
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 16
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TRUE = ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, not when huggingface_hub was imported."""
    return any(os.environ.get(v, "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_cache() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ZooConfigError(
            "source: hf: sources need transformers; install kiln[models] (pip install 'transformers>=5.17')"
        ) from None


@dataclass(frozen=True)
class HfSource:
    """A Hugging Face model (see the module docstring)."""

    location: str  # what follows "hf:": a folder or a hub id
    task: str
    revision: str | None = None
    trust_remote_code: bool = False
    inputs: Mapping[str, Any] = field(default_factory=dict)  # the entry's ranges: examples sit inside
    base_dir: str | None = None  # the zoo file's directory, for relative folders
    attn_implementation: str | None = None  # transformers' built-in ones only (hf_tasks.check_attention)
    # A hub id's snapshot, resolved once: load() reads the commit identity() keyed, even if the branch
    # moved since (and a compile asks the hub once, not at every identity()).
    pinned: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # transformers registers the output types (ModelOutput pytrees) its programs return.
    trusted_modules: tuple[str, ...] = field(default=("transformers",), init=False, compare=False)

    @property
    def uri(self) -> str:
        return f"hf:{self.location}"

    # ------------------------------------------------------------------ identity (no model is loaded)

    def identity(self) -> SourceIdentity:
        check_task(self.task)
        folder, revision = self.snapshot()
        config = self.read_config(folder)
        # Keyed by the path inside the folder: remote code imports modules by their place.
        files = {
            path.relative_to(folder).as_posix(): sha256_file(path)
            for path in self.model_files(folder, config)
        }
        parts: list[Any] = ["hf", self.task, self.trust_remote_code, files]
        parts += [_transformers_version(), torch_version()]
        if self.attn_implementation is not None:  # unset keeps the identities of earlier compiles
            parts.append({"attn_implementation": self.attn_implementation})
        return SourceIdentity("hf", self.uri, revision, digest_of(*parts))

    def snapshot(self) -> tuple[Path, str]:
        """(local folder holding the model, resolved revision: the hub commit, "" for a folder)."""
        path = resolve_path(self.location, self.base_dir)
        if path.is_dir():
            if self.revision:
                raise ZooConfigError(
                    f"revision: {self.revision!r} applies to hub ids; {self.uri} is a local folder "
                    f"({path}), which has no revisions; remove revision"
                )
            return path, ""
        looks_like_path = self.location.startswith(("/", ".", "~")) or path.exists()
        if looks_like_path or not _HUB_ID.match(self.location):
            relative = self.base_dir and not Path(self.location).is_absolute()
            where = f" (relative to {self.base_dir})" if relative else ""
            raise ZooConfigError(
                f"source: {self.uri}: folder {str(path)!r}{where} does not exist"
                + ("" if looks_like_path else ", and it is not a hub id ('org/name')")
                + "; write the save_pretrained folder's path"
            )
        if not self.pinned:
            folder, commit = self._hub_snapshot()
            self.pinned.update(folder=str(folder), commit=commit)
        return Path(self.pinned["folder"]), self.pinned["commit"]

    def _hub_snapshot(self) -> tuple[Path, str]:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        from zoo.errors import SourceUnavailableError

        offline = hub_offline()
        patterns = ["config.json", "*.safetensors", "*.safetensors.index.json"]
        if self.trust_remote_code:
            patterns.append("*.py")
        revision = f" at revision {self.revision!r}" if self.revision else ""
        try:
            folder = snapshot_download(
                self.location,
                revision=self.revision,
                allow_patterns=patterns,
                local_files_only=offline,
                cache_dir=_hub_cache(),
            )
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
            if offline:
                raise ZooConfigError(
                    f"source: {self.uri}: hub id {self.location!r}{revision} is not in the local Hugging "
                    f"Face cache ({_hub_cache() or 'the default cache'}) and HF_HUB_OFFLINE is set; "
                    "download it where the hub can be reached (huggingface-cli download "
                    f"{self.location}), or unset HF_HUB_OFFLINE"
                ) from None
            raise SourceUnavailableError(
                f"source: {self.uri}: the Hugging Face hub cannot be reached and the model is not cached: "
                f"{exc}; retry, or download it first"
            ) from None
        except RevisionNotFoundError:
            raise ZooConfigError(
                f"revision: {self.revision!r} does not exist in hub repository {self.location!r}; "
                "use a branch, tag or commit it has"
            ) from None
        except (RepositoryNotFoundError, GatedRepoError) as exc:
            raise ZooConfigError(
                f"source: {self.uri}: hub repository {self.location!r} does not exist or is not "
                f"accessible with this machine's token ({type(exc).__name__})"
            ) from None
        except HfHubHTTPError as exc:
            raise SourceUnavailableError(f"source: {self.uri}: the Hugging Face hub failed: {exc}") from None
        # The snapshot folder is named by the commit it holds: an immutable revision.
        return Path(folder), Path(folder).name

    def read_config(self, folder: Path) -> dict[str, Any]:
        """config.json as data (nothing is imported from it), checked for the task and remote code."""
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ZooConfigError(
                f"source: {self.uri}: {str(folder)!r} has no config.json; point at a folder written by "
                "save_pretrained"
            )
        try:
            config = json_reader.read_file(config_path, f"source: {self.uri}: config.json")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ZooConfigError(f"source: {self.uri}: config.json is not readable JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ZooConfigError(f"source: {self.uri}: config.json must hold a JSON object")
        self._check_code(config)
        self._check_attention(config)
        return config

    def _check_attention(self, config: Mapping[str, Any]) -> None:
        """The entry's and config.json's attn_implementation (sub-configs too) load no hub kernel."""
        check_attention(self.attn_implementation, "attn_implementation")
        chosen = [("attn_implementation", self.attn_implementation)] if self.attn_implementation else []
        for where, value in _attention_settings(config, "config.json"):
            check_attention(value, f"source: {self.uri}: {where}")
            chosen.append((f"source: {self.uri}: {where}", value))
        for where, value in chosen:
            for one in value.values() if isinstance(value, dict) else [value]:
                if isinstance(one, str) and one.startswith("flash_attention_"):
                    _check_flash_attention(one, where)

    def _check_code(self, config: dict[str, Any]) -> None:
        from transformers.models.auto import modeling_auto
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        auto_class, table = HF_TASKS[check_task(self.task)]
        model_type = config.get("model_type")
        auto_map = config.get("auto_map") or {}
        if model_type in CONFIG_MAPPING_NAMES:
            # transformers uses its own code for a known model type unless remote code is trusted.
            if self.trust_remote_code and auto_class in auto_map:
                self._check_local_code(auto_map)
                return
            if model_type not in getattr(modeling_auto, table):
                raise ZooConfigError(
                    f"task: {self.task!r} does not fit {self.uri}: transformers "
                    f"{_transformers_version()} has no {auto_class} for model_type {model_type!r}"
                )
            return
        if not auto_map:
            raise ZooConfigError(
                f"source: {self.uri}: config.json model_type {model_type!r} is not known to transformers "
                f"{_transformers_version()}; upgrade transformers, or check the folder"
            )
        if not self.trust_remote_code:
            raise UntrustedCodeError(
                f"trust_remote_code: {self.uri} (model_type {model_type!r}) needs the Python code shipped "
                "with the model (config.json auto_map); loading it runs that code. Set "
                "trust_remote_code: true on this entry only if you trust its author (docs/sources.md)"
            )
        if auto_class not in auto_map:
            raise ZooConfigError(
                f"task: {self.task!r} does not fit {self.uri}: its auto_map has no {auto_class} "
                f"(it has {', '.join(sorted(auto_map))})"
            )
        self._check_local_code(auto_map)

    def _check_local_code(self, auto_map: Mapping[str, Any]) -> None:
        refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if r]
        if any("--" in str(r) for r in refs):
            raise UntrustedCodeError(
                f"trust_remote_code: {self.uri}'s auto_map names code in another repository "
                f"({[r for r in refs if '--' in str(r)]}); kiln runs code only from the source it names"
            )

    def model_files(self, folder: Path, config: Mapping[str, Any]) -> list[Path]:
        """The files that decide the graph and weights: config.json, safetensors (+ index), code."""
        weights = sorted(folder.glob("*.safetensors"))
        if not weights:
            pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
            raise ZooConfigError(
                f"source: {self.uri}: {str(folder)!r} has no *.safetensors weights"
                + (f" (only {pickled}, which loading would unpickle)" if pickled else "")
                + "; save the model with save_pretrained(..., safe_serialization=True)"
            )
        files = [folder / "config.json", *weights, *sorted(folder.glob("*.safetensors.index.json"))]
        if self.trust_remote_code and config.get("auto_map"):
            # Whatever the remote code can import: transformers copies a module's relative imports
            # (dotted names too) into its module cache, and the code may import by path below the folder.
            files += sorted(folder.rglob("*.py"))
        for file in files:  # transformers would block on a FIFO or read /dev/zero forever
            try:
                regular_file(file, f"source: {self.uri}:")
            except SpecialFileError as exc:
                raise ZooConfigError(str(exc)) from None
        return files

    # ------------------------------------------------------------------ load

    def load(self) -> LoadedCase:
        folder, _ = self.snapshot()
        config = self.read_config(folder)
        self.model_files(folder, config)  # safetensors present
        # its modeling code would import torchao (compiler.quantization.torchao_guard)
        keep_torchao_out_of_transformers()
        import transformers

        auto = getattr(transformers, HF_TASKS[self.task][0])
        chosen = {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}
        try:
            model = auto.from_pretrained(
                str(folder),
                use_safetensors=True,
                local_files_only=True,
                trust_remote_code=self.trust_remote_code,
                dtype=torch.float32,
                **chosen,
            )
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for bad folders
            raise ZooConfigError(
                f"source: {self.uri}: transformers could not load it as task {self.task!r}: "
                f"{type(exc).__name__}: {exc}"[:2000]
            ) from exc
        model.eval()
        _without_cache(model)
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input == "input_ids":
            return self._text_case(model, config)
        if main_input == "pixel_values":
            return self._vision_case(model, config)
        raise ZooConfigError(
            f"source: {self.uri}: the model's main input is {main_input!r}; kiln derives inputs for text "
            "(input_ids) and vision (pixel_values) models; export it yourself and use a pt2: source"
        )

    def _text_case(self, model: torch.nn.Module, config: Mapping[str, Any]) -> LoadedCase:
        vocab = int(config.get("vocab_size") or getattr(model.config, "vocab_size", 0) or 2)
        positions = getattr(model.config, "max_position_embeddings", None)
        max_seq = min(MAX_SEQ, int(positions)) if positions else MAX_SEQ
        if self.task == "causal-lm":
            model = LogitsOnly(model).eval()
        if getattr(self.inputs.get("input_ids"), "drop", False):
            raise ZooConfigError(
                "inputs.input_ids.drop: input_ids is the model's main input (the token ids); it cannot be "
                "dropped; remove drop"
            )
        names = _tokenizer_inputs(model)
        # seq min 1: torch.export accepts it for these models (a one-token request is real traffic).
        batch, seq = Dim("batch", min=1, max=MAX_BATCH), Dim("seq", min=1, max=max_seq)
        default = [EXAMPLE_BATCH, example_size(EXAMPLE_SEQ, 1, max_seq)]
        ids_dims = override_dims(self.inputs, "input_ids")
        b, s = fit_example_shape(default, ids_dims)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (b, s), generator=generator)
        # The example's values set the range validation draws token ids from: the whole vocabulary.
        ids.view(-1)[0], ids.view(-1)[-1] = 0, vocab - 1
        kwargs: dict[str, Any] = {"input_ids": ids}
        if "attention_mask" in names:
            kwargs["attention_mask"] = torch.ones_like(ids)
        if "token_type_ids" in names:
            # A sentence pair (segment A, then B, ...): its values span 0..type_vocab_size-1, the range
            # validation draws segment ids from.
            types = _type_vocab_size(model)
            kwargs["token_type_ids"] = (torch.arange(s) * types // s).expand(b, s).clone()
            kwargs["token_type_ids"].view(-1)[-1] = types - 1
        shapes: dict[str, Any] = {name: {0: batch, 1: seq} for name in names}
        if ids_dims is not None:
            # One tokenizer call gives them all, of input_ids' shape: an input the entry does not list
            # takes input_ids' listed dims (an entry written before token_type_ids was an input keeps
            # compiling).
            for name in names:
                if name not in self.inputs:
                    shapes[name] = {d.axis: Dim(d.name, min=d.min, max=d.max) for d in ids_dims} or None
        return LoadedCase(model, (), kwargs, shapes)

    def _vision_case(self, model: torch.nn.Module, config: Mapping[str, Any]) -> LoadedCase:
        size = config.get("image_size") or DEFAULT_IMAGE_SIZE
        height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
        channels = int(config.get("num_channels") or 3)
        shape = [EXAMPLE_BATCH, channels, int(height), int(width)]
        shape = fit_example_shape(shape, override_dims(self.inputs, "pixel_values"))
        pixels = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        return LoadedCase(
            model, (), {"pixel_values": pixels}, {"pixel_values": {0: Dim("batch", min=1, max=MAX_BATCH)}}
        )


def _without_cache(model: torch.nn.Module) -> None:
    """``use_cache`` off in the model's config and its sub-configs (a decoder inside an encoder-decoder or
    a multimodal model): a decoder run for ``feature-extraction`` would otherwise return its KV cache, a
    ``DynamicCache`` that torch.export cannot carry out of the graph. A compiled package answers one
    forward pass; generation with a cache is not what it serves. Encoders have no cache: their graph is
    unchanged, so the source identity is too."""
    configs = [getattr(model, "config", None)]
    while configs:
        config = configs.pop()
        if config is None:
            continue
        if getattr(config, "use_cache", None):
            config.use_cache = False
        configs += [getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {}]


def _type_vocab_size(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "type_vocab_size", 0) or 0)


def _tokenizer_inputs(model: torch.nn.Module) -> list[str]:
    """What a tokenizer gives that this model's ``forward`` takes and its config uses, in the tokenizer's
    order: ``input_ids``; ``attention_mask``; ``token_type_ids`` where there are several segment types
    (BERT-style sentence pairs; a RoBERTa's single type, or a GPT-2's none, is only ever 0)."""
    parameters = inspect.signature(model.forward).parameters
    names = ["input_ids"]
    if "attention_mask" in parameters:
        names.append("attention_mask")
    if "token_type_ids" in parameters and _type_vocab_size(model) > 1:
        names.append("token_type_ids")
    return names


def _attention_settings(config: Mapping[str, Any], where: str) -> list[tuple[str, Any]]:
    """(where, value) of every attn_implementation in a config, its sub-configs' included."""
    found = []
    for key, value in config.items():
        if key in ("attn_implementation", "_attn_implementation") and value is not None:
            found.append((f"{where}.{key}", value))
        elif isinstance(value, Mapping):
            found += _attention_settings(value, f"{where}.{key}")
    return found


def _check_flash_attention(value: str, where: str) -> None:
    """flash_attention_<N> without its package: where the ``kernels`` package is installed,
    transformers then fetches the hub kernel it names as the fallback (FLASH_ATTN_KERNEL_FALLBACK)."""
    import importlib.util

    if importlib.util.find_spec("kernels") is None:
        return  # nothing to fetch with: transformers uses the package or raises its own error
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

        local = bool(
            FLASH_ATTENTION_COMPATIBILITY_MATRIX[int(value.rsplit("_", 1)[1])]["general_availability_check"]()
        )
    except Exception:  # a version or layout this kiln does not know: assume the fallback
        local = False
    if not local:
        raise ZooConfigError(
            f"{where}: attn_implementation {value!r} cannot run from an installed flash-attn package here, "
            "so transformers would fetch a flash attention kernel from the Hugging Face hub and run it; kiln "
            "compiles offline. Install the flash-attn package on this machine, or use sdpa or eager"
        )


class LogitsOnly(torch.nn.Module):
    """A causal LM without its KV cache: logits only, so no cache object crosses the export boundary."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
