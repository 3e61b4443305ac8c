"""kiln's Triton Python backend file (``model.py``), copied into every version folder."""
