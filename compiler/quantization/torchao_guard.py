"""torchao is imported only by the recipes that need it (Inductor int8: ``compiler.quantization.pt2e``).

Importing torchao logs on every run (native extensions it cannot load here, pytree registrations
torch deprecates) and costs seconds. kiln imports it only inside those recipes, through
:func:`import_torchao`. transformers, though, imports it as a side effect wherever it is installed:
its modeling code imports its quantizers, which import torchao when ``is_torchao_available()`` says
yes. transformers caches that answer for the process, so :func:`keep_torchao_out_of_transformers`
hooks the first import of ``transformers.quantizers`` and has transformers ask once while torchao is
hidden. kiln loads transformers models in fp32 and quantizes with its own recipes, so transformers'
torchao quantizer (for checkpoints saved quantized by torchao) is never what kiln wants.

:data:`TORCHAO_LOCK` keeps that moment apart from a recipe importing torchao in another thread.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from types import ModuleType

TORCHAO_LOCK = threading.RLock()
_QUANTIZERS = "transformers.quantizers"
_install_lock = threading.Lock()


def import_torchao(name: str = "torchao") -> ModuleType:
    """``importlib.import_module(name)`` for a module of torchao, never while transformers is asked."""
    with TORCHAO_LOCK:
        return importlib.import_module(name)


class _AskWithoutTorchao(importlib.abc.MetaPathFinder):
    """Answers nothing itself: on the import of transformers' quantizers it has transformers decide,
    with torchao hidden, that torchao is absent, then steps aside for the real finders."""

    # It stays in sys.meta_path (a string compare per import): removing it while the import system
    # iterates that list would skip the finder after it.
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == _QUANTIZERS:
            _ask_without_torchao()
        return None


def _ask_without_torchao() -> None:
    import_utils = sys.modules.get("transformers.utils.import_utils")
    ask = getattr(import_utils, "is_torchao_available", None)
    if ask is None:  # another transformers layout: nothing to answer (a test notices torchao then)
        return
    with TORCHAO_LOCK:
        if "torchao" in sys.modules:  # already imported (by a recipe): hiding it now would break it
            return
        sys.modules["torchao"] = None  # importlib.util.find_spec answers None for it
        try:
            ask()  # cached by transformers (lru_cache): every later question gets False
        except Exception:  # its check failing is transformers' business, not a reason to fail a load
            pass
        finally:
            if "torchao" in sys.modules and sys.modules["torchao"] is None:
                del sys.modules["torchao"]


def keep_torchao_out_of_transformers() -> None:
    """Install the hook (once per process) before anything may import transformers' modeling code.

    Too late (transformers' quantizers already imported) it does nothing, and costs nothing."""
    if _QUANTIZERS in sys.modules:
        return
    with _install_lock:
        if not any(isinstance(f, _AskWithoutTorchao) for f in sys.meta_path):
            sys.meta_path.insert(0, _AskWithoutTorchao())
