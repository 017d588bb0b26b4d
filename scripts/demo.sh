#!/usr/bin/env bash
# The main job on an embedded default (see README).  Placeholder until the end-to-end demo lands.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
echo "demo: not yet available"
exit 1
