"""kiln's MLflow side: tracking runs, the model registry, look-ups and release aliases.

``compiler/`` never imports this package; Prefect tasks and flows (``tasks/registry.py``,
``flows/release.py``) call it. See :mod:`registry.models` for the registered-model name scheme and
tags, :mod:`registry.config` for where data lives (embedded sqlite by default) and retries.
"""
