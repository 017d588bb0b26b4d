#!/usr/bin/env bash
# The whole test suite (what CI runs): set-up, lint, the import contracts, the type check, then pytest.  Extra
# arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check tierfs sampler dslide tests benchmarks examples
# the layering: the folders of tierfs top to bottom, no import circle, the client side daemon-free
.venv/bin/lint-imports
# the types: mypy over tierfs, sampler and dslide, at the strictness pyproject.toml's [tool.mypy] states
.venv/bin/mypy
# every tier, slow tests included (a plain `pytest` is the fast tier: pyproject.toml), on 4 workers (pytest-xdist)
exec .venv/bin/python -m pytest -o testpaths=tests -m "" -n 4 --dist loadgroup "$@"
