"""The persistent, content-addressed engine cache: on this machine's disk, or shared by a fleet
through an object store (``s3://``, ``gs://``, ``file://``) with this machine's disk as its hot layer.

- :mod:`compiler.cache.entry`: keys, the metadata record, and the verification every read passes;
- :mod:`compiler.cache.local`: :class:`~compiler.cache.local.EngineCache` (memory + disk, LRU bound),
  which reads through to the object store when its location is a URL, and ``resolve_cache``;
- :mod:`compiler.cache.locks`: the per-key file locks that make one build per key across processes;
- :mod:`compiler.cache.remote`: the fleet layer (conditional-PUT publication, build leases);
- :mod:`compiler.cache.store`: the object store under it (an fsspec URL as whole objects);
- :mod:`compiler.cache.files`, :mod:`compiler.cache.paths`: reading only the cache's own regular files,
  and the private directory it keeps them in; :mod:`compiler.cache.maintenance`: ``kiln cache`` (gc, verify).

Each name is imported from its module (``compiler.EngineCache`` is the public spelling).
"""
