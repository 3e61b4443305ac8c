"""What to compile: the zoo file's schema (config), compile requests (request), model sources (sources/),
input overrides (inputs), preflight checks, and test and example models built from code with random
weights (models)."""
