#!/usr/bin/env bash
# Idempotent set-up on a Debian machine: system packages, a virtual environment in .venv, the project in it.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (does only what is missing).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)

apt_pkgs=(fuse3 libfuse3-dev pkg-config gcc patch python3-dev python3-venv iproute2 rsync strace util-linux
          slurm-wlm munge sshfs openssh-server)
missing=()
for p in "${apt_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing system packages (apt-get, about a minute): ${missing[*]}"
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$py" -m venv .venv
fi
# pyfuse3 with the kernel's readdir cache and the non-blocking request loop first (scripts/pyfuse3/README.md): the
# project's own install below keeps it, since 3.5.0+tierfs3 satisfies its pyfuse3 requirement
bash scripts/pyfuse3/install.sh .venv/bin/python
# The stamp holds the commit installed: the version is git's, taken at install (setuptools-scm, pyproject.toml),
# so a new commit reinstalls the project alone (no dependencies: seconds) and `tierfs --version` names it.
stamp=.venv/.tierfs-installed
head=$(git rev-parse HEAD 2>/dev/null || echo "no git")
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing the project and its dependencies into .venv (torch, numba, mpich, ...: a few minutes"
    echo "setup:   the first time, pip is quiet meanwhile)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[test,bench,torch]"
    echo "$head" > "$stamp"
elif [ "$(cat "$stamp")" != "$head" ]; then
    echo "setup: reinstalling the project for its version (commit $head)"
    .venv/bin/python -m pip install -q --no-deps -e .
    echo "$head" > "$stamp"
fi
echo "setup: .venv ready ($root/.venv)"
