"""Test and example models built from code with random weights (never downloaded)."""
