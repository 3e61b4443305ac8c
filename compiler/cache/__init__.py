"""The persistent, content-addressed engine cache: on this machine's disk, or shared by a fleet
through an object store (``s3://``, ``gs://``, ``file://``) with this machine's disk as its hot layer.

- :mod:`compiler.cache.entry`: keys, the metadata record, and the verification every read passes;
- :mod:`compiler.cache.local`: :class:`EngineCache` (memory + disk, per-key file locks, LRU bound),
  which reads through to the object store when its location is a URL;
- :mod:`compiler.cache.remote`: the object-store layer (conditional-PUT publication, build leases).
"""

from compiler.cache.entry import (
    DEFAULT_MAX_BYTES,
    FORMAT_VERSION,
    CacheEntryInfo,
    CacheKey,
    CacheStats,
    CacheWarning,
    parse_size,
    resolve_max_bytes,
)
from compiler.cache.local import LOCAL_DIR_ENV, EngineCache
from compiler.cache.remote import CacheStoreError, ObjectStore, RemoteEntries, is_url

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "LOCAL_DIR_ENV",
    "CacheEntryInfo",
    "CacheKey",
    "CacheStats",
    "CacheStoreError",
    "CacheWarning",
    "EngineCache",
    "ObjectStore",
    "RemoteEntries",
    "is_url",
    "parse_size",
    "resolve_max_bytes",
]
