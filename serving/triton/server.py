"""Running ``tritonserver`` on a kiln repository (``kiln serve triton run``; tests; the benchmark).

Which binary: ``$KILN_TRITONSERVER``, else the one inside the ``nvidia-pytriton`` wheel (installed with
``--no-deps``: kiln uses its server, not its Python package, which pins numpy<2), else
``tritonserver`` on PATH. The Python backend comes from beside the binary (``backends/python``) with
the stub built for this interpreter's Python version (the wheel ships one per version); they are
linked into a private backend folder, as the stub must sit beside ``libtriton_python.so``.

The server runs with explicit model control (every model of the repository loaded at start, later
changes only through the load API), auto-completion off (kiln's ``config.pbtxt`` is complete), and
HTTP and gRPC bound to 127.0.0.1 unless told otherwise. The stub ignores PYTHONPATH, so the server's
environment carries ``KILN_TRITON_PYTHONPATH`` (see ``backend/model.py``): this kiln's checkout and
this interpreter's site-packages; and where the Python the stub links is another build than the one
running kiln, a ``python3`` of the stub's own is first on the server's PATH (:func:`server_environment`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from compiler.package.signing import PUBLIC_KEY_ENV, TRUSTED_CERTIFICATES_ENV, Trust
from serving.triton.control import TritonControl
from serving.triton.errors import ServerStartError, ServerUnavailableError, TritonNotFoundError
from serving.triton.repository import check_repository

ENV_BINARY = "KILN_TRITONSERVER"
ENV_PYTHONPATH = "KILN_TRITON_PYTHONPATH"


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    python_backend: Path  # the folder holding libtriton_python.so
    stub: Path  # triton_python_backend_stub for this interpreter's Python version


def find_tritonserver() -> TritonInstall:
    """The server to run and its Python backend; TritonNotFoundError saying how to get one."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates: list[Path] = []
    if os.environ.get(ENV_BINARY):
        candidates.append(Path(os.environ[ENV_BINARY]))
    else:
        spec = importlib.util.find_spec("pytriton")  # finds the folder; imports nothing of it
        if spec is not None and spec.submodule_search_locations:
            candidates.append(
                Path(next(iter(spec.submodule_search_locations))) / "tritonserver" / "bin" / "tritonserver"
            )
        on_path = shutil.which("tritonserver")
        if on_path:
            candidates.append(Path(on_path))
    for binary in candidates:
        if not binary.is_file():
            continue
        home = binary.resolve().parent.parent
        backend = home / "backends" / "python"
        stubs = [
            home / "python_backend_stubs" / version / "triton_python_backend_stub",
            backend / "triton_python_backend_stub",
        ]
        stub = next((s for s in stubs if s.is_file()), None)
        if (backend / "libtriton_python.so").is_file() and stub is not None:
            return TritonInstall(binary, backend, stub)
    raise TritonNotFoundError(
        f"no tritonserver with a Python backend for Python {version} found (looked at "
        f"{[str(c) for c in candidates] or 'nothing'}); install the server with "
        "`pip install --no-deps nvidia-pytriton==0.7.0` (as the README does), or set "
        f"{ENV_BINARY} to a tritonserver whose folder has backends/python"
    )


def backend_directory(install: TritonInstall, home: Path) -> Path:
    """``home/backends/python``: the backend's files and the stub, linked (their RPATHs are relative to
    where they really are, which a copy would break)."""
    python = home / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in [*install.python_backend.iterdir(), install.stub]:
        if source.is_file():
            link = python / source.name
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            link.symlink_to(source.resolve())
    return home / "backends"


def kiln_pythonpath() -> list[str]:
    """Where this process finds kiln and torch, for the stub's interpreter: kiln's checkout first."""
    import serving

    kiln_root = str(Path(serving.__file__).resolve().parents[1])
    # PYTHONPATH's folders too: packages installed with `pip --target` there (a GPU host's carried
    # wheels) are part of this interpreter's environment, and the stub ignores PYTHONPATH.
    paths = [kiln_root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    for key in ("purelib", "platlib"):
        paths.append(sysconfig.get_paths()[key])
    with contextlib.suppress(AttributeError):
        paths += site.getsitepackages()
    seen: list[str] = []
    for p in paths:
        if p not in seen and Path(p).is_dir():
            seen.append(p)
    return seen


def server_command(
    install: TritonInstall,
    repository: Path,
    backends: Path,
    *,
    http_port: int,
    grpc_port: int,
    address: str = "127.0.0.1",
    metrics_port: int | None = None,
) -> list[str]:
    command = [
        str(install.binary),
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        "--load-model=*",
        "--disable-auto-complete-config",
        f"--backend-directory={backends}",
        f"--http-address={address}",
        f"--http-port={http_port}",
        f"--grpc-address={address}",
        f"--grpc-port={grpc_port}",
        "--exit-timeout-secs=10",
    ]
    if metrics_port is None:
        command.append("--allow-metrics=false")
    else:
        command += [f"--metrics-address={address}", f"--metrics-port={metrics_port}"]
    return command


def stub_python_home(stub: Path) -> str | None:
    """The prefix of the Python library the stub links (``/usr`` for a distribution's libpython), when
    its standard library is there. The stub embeds that library but, left alone, finds its standard
    library through the ``python3`` on PATH: a virtual environment of another build of the same
    version (pyenv's 3.11.7 over Debian's 3.11.2) then gives it extension modules built for another
    patch release, and ``import ssl`` (so transformers, so every Hugging Face model) fails in the stub
    with an undefined symbol. None when it cannot be told (the stub then runs as it always did)."""
    try:
        linked = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for line in linked.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if not name.startswith(f"lib{version}") or not rest:
            continue
        library = Path(rest.split(" (")[0]).resolve()
        for home in library.parents:
            if (home / "lib" / version / "os.py").is_file():
                return str(home)
    return None


def server_environment(
    extra: dict[str, str] | None = None, stub: Path | None = None, home: Path | None = None
) -> dict[str, str]:
    """The server's environment: ``KILN_TRITON_PYTHONPATH``, and where the stub's own Python differs
    from the one running kiln, a ``python3`` first on PATH that is the stub's (the stub takes its
    standard library from the first ``python3`` on PATH and ignores ``PYTHONHOME``)."""
    env = dict(os.environ)
    env[ENV_PYTHONPATH] = os.pathsep.join(
        kiln_pythonpath() + [p for p in env.get(ENV_PYTHONPATH, "").split(os.pathsep) if p]
    )
    prefix = stub_python_home(stub) if stub is not None and home is not None else None
    interpreter = Path(prefix or "/", "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    if (
        prefix is not None
        and Path(sys.base_prefix).resolve() != Path(prefix).resolve()
        and interpreter.is_file()
    ):
        folder = home / "stub-python"
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "python3"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(interpreter)
        env["PATH"] = os.pathsep.join([str(folder), env.get("PATH", "")])
    env.update(extra or {})
    # The stubs read the verification key (compiler.load, in the backend) from their own working folder:
    # the server gets it as an absolute path, so a signed package is verified and runs natively there.
    for name in (PUBLIC_KEY_ENV, TRUSTED_CERTIFICATES_ENV):
        if env.get(name):
            env[name] = os.pathsep.join(str(Path(p).resolve()) for p in env[name].split(os.pathsep) if p)
    return env


class TritonServer:
    """A ``tritonserver`` child process in its own process group, with its log in ``home``."""

    def __init__(
        self,
        repository: str | os.PathLike,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        address: str = "127.0.0.1",
        metrics_port: int | None = None,
        home: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        inherit_output: bool = False,
    ):
        # Foreground (`kiln serve triton run`): the server's log on this process's stdout, and the server
        # in this process's group, so Ctrl-C or a signal to the group stops it with its stubs.
        self.inherit_output = inherit_output
        self.repository = check_repository(repository, write=False)
        self.install = find_tritonserver()
        self.http_port, self.grpc_port, self.address = http_port, grpc_port, address
        self._own_home = home is None
        self.home = Path(home) if home else Path(tempfile.mkdtemp(prefix="kiln-triton-"))
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = self.home / "tritonserver.log"
        self.command = server_command(
            self.install,
            self.repository,
            backend_directory(self.install, self.home),
            http_port=http_port,
            grpc_port=grpc_port,
            address=address,
            metrics_port=metrics_port,
        )
        self.env = server_environment(env, self.install.stub, self.home)
        # A key the stubs cannot use fails here, once, not in every model's load.
        self.trust = Trust.from_env(self.env)
        if self.trust is not None:
            self.trust.config()
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address
        return f"http://{host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address
        return f"{host}:{self.grpc_port}"

    def start(self, timeout: float = 300.0) -> TritonServer:
        log = None if self.inherit_output else open(self.log_path, "ab")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=not self.inherit_output,
        )
        if log is not None:
            log.close()
        control = TritonControl(self.http_url, timeout=2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                message = (
                    f"tritonserver exited with {self.proc.returncode} while loading {self.repository}:\n"
                    f"{self.log_tail()}"
                )
                self.stop()
                raise ServerStartError(message)
            with contextlib.suppress(ServerUnavailableError):
                control.ready()
                return self
            time.sleep(0.2)
        message = f"tritonserver not ready after {timeout:g} s:\n{self.log_tail()}"
        self.stop()
        raise ServerStartError(message)

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, grace: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            # Own group: the server and its stubs; foreground: the server, which stops its stubs.
            kill = proc.send_signal if self.inherit_output else lambda sig: os.killpg(proc.pid, sig)
            with contextlib.suppress(ProcessLookupError):
                kill(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    kill(signal.SIGKILL)
                proc.wait(timeout=15)
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
