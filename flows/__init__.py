"""Prefect flows and the `kiln` CLI: compile one model, recompile the zoo, release."""
