#!/usr/bin/env bash
# The whole test suite (what CI runs): set-up, lint, then pytest.  Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check tierfs sampler dslide tests benchmarks examples
# the layering: the folders of tierfs top to bottom, no import circle, the client side daemon-free
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
