"""Talking to a running Triton server over HTTP: health, repository index, load, unload, statistics.

The KServe v2 protocol and Triton's model-repository extension, as JSON over the standard library's
HTTP client (no tritonclient needed to release). Every call has a timeout; a server that does not
answer is a :class:`ServerUnavailableError` naming the URL, the call and the seconds waited; one that
answers with an error is a :class:`ServerRefusedError` carrying the server's message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from compiler import json_reader
from serving.triton.errors import ServerRefusedError, ServerUnavailableError

DEFAULT_TIMEOUT_S = 10.0
# A load starts a stub process that imports torch and verifies and loads the package.
DEFAULT_LOAD_TIMEOUT_S = 300.0


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class TritonControl:
    """Model control of one server (``--model-control-mode explicit``)."""

    def __init__(
        self, url: str, *, timeout: float = DEFAULT_TIMEOUT_S, load_timeout: float = DEFAULT_LOAD_TIMEOUT_S
    ):
        self.url = normalize_url(url)
        self.timeout = timeout
        self.load_timeout = load_timeout

    def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        wait = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        what = f"{method} {path}"
        try:
            with urllib.request.urlopen(request, timeout=wait) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except TimeoutError as exc:
            raise ServerUnavailableError(
                f"Triton at {self.url} did not answer {what} within {wait:g} s (timeout); nothing was changed"
            ) from exc
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise ServerUnavailableError(
                    f"Triton at {self.url} did not answer {what} within {wait:g} s (timeout); nothing was "
                    "changed"
                ) from exc
            raise ServerUnavailableError(
                f"Triton at {self.url} cannot be reached for {what} ({reason}); is `kiln serve triton run` "
                "running there? Nothing was changed"
            ) from exc

    def _ok(
        self, method: str, path: str, body: Any = None, timeout: float | None = None, doing: str = ""
    ) -> Any:
        status, data = self._call(method, path, body, timeout)
        if status != 200:
            message = data.get("error", "") if isinstance(data, dict) else str(data)
            raise ServerRefusedError(
                f"Triton at {self.url} refused {doing or f'{method} {path}'} (HTTP {status}): {message}",
                status=status,
                server_message=message,
            )
        return data

    def ready(self) -> None:
        """ServerUnavailableError unless the server answers and is ready."""
        status, _ = self._call("GET", "/v2/health/ready")
        if status != 200:
            raise ServerUnavailableError(f"Triton at {self.url} answers but is not ready (HTTP {status})")

    def live(self) -> None:
        """ServerUnavailableError unless the server answers (its models may be loading or unloading)."""
        status, _ = self._call("GET", "/v2/health/live")
        if status != 200:
            raise ServerUnavailableError(f"Triton at {self.url} answers but is not live (HTTP {status})")

    def index(self) -> list[dict]:
        return list(self._ok("POST", "/v2/repository/index", {}) or [])

    def load(self, model: str) -> None:
        """Re-read the model's folder and config: load the versions its policy names, unload the rest.
        Triton keeps serving what it had when the load fails."""
        self._ok(
            "POST", f"/v2/repository/models/{quote(model)}/load", {}, self.load_timeout, f"to load {model}"
        )

    def unload(self, model: str) -> None:
        self._ok(
            "POST",
            f"/v2/repository/models/{quote(model)}/unload",
            {},
            self.load_timeout,
            f"to unload {model}",
        )

    def version_ready(self, model: str, version: str) -> bool:
        status, _ = self._call("GET", f"/v2/models/{quote(model)}/versions/{quote(str(version))}/ready")
        return status == 200

    def served_versions(self, model: str) -> list[str]:
        """The versions of ``model`` the server has READY."""
        return sorted(
            (
                str(row.get("version"))
                for row in self.index()
                if row.get("name") == model and row.get("state") == "READY"
            ),
            key=lambda v: int(v) if v.isdigit() else -1,
        )

    def statistics(self, model: str, version: str = "") -> dict:
        path = (
            f"/v2/models/{quote(model)}" + (f"/versions/{quote(str(version))}" if version else "") + "/stats"
        )
        return self._ok("GET", path)


def _json(raw: bytes) -> Any:
    try:
        return json_reader.loads(raw, "the Triton server's answer") if raw else None
    except ValueError:
        return {"error": raw.decode(errors="replace")[:2000]}
