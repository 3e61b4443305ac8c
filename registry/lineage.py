"""Select registered versions by the source they were compiled from (``kiln lookup --source``).

A version records its source in ``kiln.source.*`` tags (:func:`registry.models.lineage_tags`). A
request matches a version when:

* ``uri``: the version's recorded source URI is the requested one (for a ``models:/`` request, the
  recorded source version must also be the version that URI names now: a package compiled from
  ``models:/x@production`` when it pointed at version 3 is not what ``@production`` means once the
  alias has moved to 7, and is skipped saying so);
* ``alias``: the request is ``models:/NAME@ALIAS`` and the version was compiled from the model
  version the alias points at now (resolved at look-up with the MLflow client), whatever URI it was
  compiled under (``models:/NAME/3``, another alias);
* ``version``: the request is ``models:/NAME/N`` and the version was compiled from version N under
  an alias.

An alias that does not resolve now (deleted, or the model is not in this registry) falls back to
the exact URI, and the result says so. Tags are read as strings; nothing they name is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from registry.config import RetryPolicy, call_with_retry
from registry.models import models_uri_parts, source_of

URI = "uri"
ALIAS = "alias"
VERSION = "version"


@dataclass(frozen=True)
class SourceQuery:
    """A requested source, with the model version a ``models:/`` URI names at look-up time."""

    uri: str
    name: str | None = None  # the source's registered model, for a models:/ URI
    alias: str | None = None
    version: str | None = None  # the version the URI names now (None: match the URI as written)
    note: str = ""  # why a models:/ alias was not resolved

    def describe(self) -> str:
        if self.alias and self.version:
            return f"{self.uri} (version {self.version} now)"
        return self.uri

    def match(self, tags: Mapping[str, str]) -> tuple[dict[str, Any] | None, str | None]:
        """(how it matched, None) or (None, why not) for a version's tags."""
        recorded = source_of(tags)
        if recorded is None:
            return None, "records no source (compiled without one, or registered before lineage tags)"
        uri, version = recorded["uri"], recorded["version"]
        found = {"requested": self.uri, "recorded_uri": uri, "recorded_version": version or None}
        if self.alias:
            found["alias_version"] = self.version
        if self.version is None:
            if uri == self.uri:
                return {**found, "how": URI}, None
            return None, f"its source is {uri!r}, not {self.uri!r}"
        parts = models_uri_parts(uri)
        if parts is not None and parts[0] == self.name and version == self.version:
            how = URI if uri == self.uri else (ALIAS if self.alias else VERSION)
            return {**found, "how": how}, None
        if uri == self.uri:
            return None, (
                f"compiled from {uri} when it pointed at version {version or '?'}; "
                f"it points at version {self.version} now"
            )
        at = f" (version {version})" if version else ""
        return None, f"its source is {uri!r}{at}, not {self.describe()}"


def resolve_source(mlclient: MlflowClient, uri: str, policy: RetryPolicy | None = None) -> SourceQuery:
    """The query for ``uri``: a ``models:/NAME@ALIAS`` is resolved now, with this registry's client."""
    parts = models_uri_parts(uri)
    if parts is None:
        return SourceQuery(uri)
    name, version, alias = parts
    if version is not None:
        return SourceQuery(uri, name=name, version=version)

    def resolve() -> str | None:
        try:
            return str(mlclient.get_model_version_by_alias(name, alias).version)
        except MlflowException as exc:
            # A missing model or alias is an answer (match the URI as recorded), not an outage.
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise

    now = call_with_retry(resolve, f"resolve {uri}", policy)
    if now is None:
        note = f"{uri} does not resolve in this registry now; matched on the URI as recorded"
        return SourceQuery(uri, name=name, alias=alias, note=note)
    return SourceQuery(uri, name=name, alias=alias, version=now)
