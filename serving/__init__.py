"""Serving kiln packages from the registry (``serving.triton``: Triton Inference Server).

Above ``registry/`` and ``compiler/``: it reads registered versions and loads packages; neither of
those imports it. ``compiler/`` knows nothing of Triton.
"""
