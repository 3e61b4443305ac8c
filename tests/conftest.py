"""Shared fixtures: a private engine cache per test session, and zoo models compiled once."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Real servers on 127.0.0.1, for every test module that asks (one Prefect server per session, one MLflow
# server per module): defined once here, so test modules neither import nor shadow them.
from tests.fixtures.mlflow_server import mlflow_server, s3_mlflow  # noqa: E402, F401
from tests.fixtures.prefect_server import prefect_api, prefect_server  # noqa: E402, F401
from tests.fixtures.s3_server import s3_server  # noqa: E402, F401

# The developer's own Inductor cache, if any: read before collection, where importing a test module can
# make torch write its default into the environment.
_GIVEN_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(scope="session", autouse=True)
def _no_signing_keys() -> None:
    """A developer's signing configuration never decides what a test loads or trusts: tests that sign
    or verify set their own keys (tests/fixtures/signing_keys.py). Processes started by tests inherit it."""
    for name in [n for n in os.environ if n.startswith("KILN_SIGNING_")]:
        del os.environ[name]


@pytest.fixture(scope="session", autouse=True)
def _private_engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tests never touch the user's cache; processes started by tests inherit this directory."""
    directory = tmp_path_factory.mktemp("engine-cache")
    os.environ["KILN_CACHE_DIR"] = str(directory)
    return directory


@pytest.fixture(scope="session", autouse=True)
def _shared_export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of kept ONNX exports for the whole run, every xdist worker and every process they
    start (compiler.engine_build.export_memo): the suite compiles the zoo's few structures in many
    processes, and each export of one costs seconds. Under xdist the session's root temp folder (the
    parent of each worker's) is shared; kept graphs are keyed by kiln's code, so none outlives an edit."""
    root = tmp_path_factory.getbasetemp()
    directory = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "export-cache"
    directory.mkdir(mode=0o700, exist_ok=True)
    os.environ["KILN_EXPORT_CACHE"] = str(directory)
    return directory


@pytest.fixture(scope="session", autouse=True)
def _run_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Inductor cache for the whole run, every xdist worker and every process they start, in the
    run's temp root, in the environment from the start.

    Left to torch, every run shared the machine's /tmp/torchinductor_$USER: a developer's second run
    found every kernel compiled (and the folder grew by each run's code, 870 MB here), while CI on a
    fresh machine compiled them all, 25-60 s more of the suite on 2 cores. A folder of the run's own
    makes every run what CI runs, and removes itself with pytest's old temp roots. A developer's own
    TORCHINDUCTOR_CACHE_DIR wins.

    Set before any test: torch itself writes the variable into ``os.environ`` at a process's first
    Inductor compile or load (torch._inductor.runtime.cache_dir_utils.cache_dir), and mid-session the
    processes tests start would then see another environment than tests/fixtures/preloaded.py's server
    was started with (a TORCH* name differs): a fresh process each instead of a fork, ~3 CPU-s."""
    root = tmp_path_factory.getbasetemp()
    directory = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "inductor-cache"
    directory.mkdir(mode=0o700, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _GIVEN_INDUCTOR_CACHE or str(directory)
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


@pytest.fixture(scope="session")
def compiled_zoo() -> dict:
    """name -> (ModelCase, CompiledModule) for the models of the compiler-core issue, compiled once."""
    import compiler
    from zoo.models import FACTORIES

    result = {}
    for name in ("tiny_bert", "tiny_vit", "tiny_resnet", "tiny_gpt2", "mlp_with_fallback"):
        case = FACTORIES[name]()
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        result[name] = (case, compiler.compile(program))
    return result


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    _private_user_folders(config)
    _threads_per_worker()
    # The tests compile in this process as a kiln command does in its own: the CLI's collector
    # thresholds, so a test's compile costs what a command's does. (Every worker imports flows.cli at
    # collection anyway: tests/matrix reads its commands from it.)
    from flows.cli import COLLECTOR_THRESHOLDS

    gc.set_threshold(*COLLECTOR_THRESHOLDS)
    # pytest-xdist's loadfile hands out the files with the most tests first (its --loadscope-reorder,
    # on by default). The suite's long files have few tests, so they came last, and one worker ran them
    # while the other had finished: the order of pytest_collection_modifyitems below is used instead.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


def _private_user_folders(config: pytest.Config) -> None:
    """A home of the test process's own for what kiln, Prefect and the libraries keep per user, set before
    collection (test modules import Prefect, which reads PREFECT_HOME once) and removed at the end; the
    processes tests start inherit it. Before, a run wrote into the developer's ~/.prefect (a temporary
    API server's database, 115 MB on this machine) and ~/.cache/kiln/registry (``kiln lookup``
    downloads from every test's store, under the same model names). XDG_CACHE_HOME: every platformdirs
    cache (kiln's registry downloads and remote-cache tier, Hugging Face's, torch's); XDG_CONFIG_HOME:
    what the report test's browser writes (~/.config/chromium)."""
    home = Path(tempfile.mkdtemp(prefix="kiln-test-home-"))
    os.environ["XDG_CACHE_HOME"] = str(home / "cache")
    os.environ["XDG_CONFIG_HOME"] = str(home / "config")
    os.environ["PREFECT_HOME"] = str(home / "prefect")
    config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))


def _threads_per_worker() -> None:
    """Under xdist, each worker and every process it starts gets its share of the cores for intra-op
    threads (torch, OpenMP, ONNX Runtime) and compiles Inductor kernels in-process: with each process
    taking every core, two workers and the processes they start oversubscribed this 2-core machine,
    and idle threads spinning for work took the cores from the processes doing it. What a test sets
    itself, or the developer's environment, wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    mine = "OMP_NUM_THREADS" not in os.environ
    for name, value in (("OMP_NUM_THREADS", threads), ("KILN_ORT_THREADS", threads),
                        ("TORCHINDUCTOR_COMPILE_THREADS", 1)):  # fmt: skip
        os.environ.setdefault(name, str(value))
    if mine:  # torch may be imported already (read OMP_NUM_THREADS at its import)
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold a test marked ``slow`` first (in their collection order, each file's tests
    in theirs): xdist hands out files in this order, and the many short files that follow even out the
    workers' ends. Without xdist the order changes nothing a test sees (no test depends on another)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the rest keep their order


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop a temporary Prefect server that Prefect started on its own (a client that found no API URL),
    while pytest's streams are still open: stopped by Prefect's atexit hook, its goodbye log met closed
    streams and printed a "--- Logging error ---" traceback after every session."""
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        for temporary in list(server.SubprocessASGIServer._instances.values()):
            temporary.stop()
