#!/usr/bin/env bash
# Build pyfuse3 3.5.0 with the patches below (see README.md) and install it into the virtual environment of
# $1 (a python); does nothing when that python's pyfuse3 is this build already.  Fails loudly if a patch does
# not apply or the build does not import.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=$1
version=3.5.0
local_version=$version+tierfs3  # (a new patch: a new number, so venvs built before get this build)
patches=(cache-readdir.patch nonblocking-loop.patch passthrough.patch)
check="import importlib.metadata as m, pyfuse3; assert m.version('pyfuse3') == '$local_version'
assert pyfuse3.FileInfo(cache_readdir=True).cache_readdir and pyfuse3.FileInfo(backing_id=1).backing_id == 1
assert pyfuse3.passthrough_active() is None"
if "$py" -c "$check" 2>/dev/null; then
    exit 0
fi
echo "setup: building pyfuse3 $local_version from source with its patches (scripts/pyfuse3/README.md): 1-3"
echo "setup:   minutes, most of it compiling pyfuse3 (and Cython, its build tool) quietly"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: -d "$work" "pyfuse3==$version"
tar -xzf "$work/pyfuse3-$version.tar.gz" -C "$work"
for p in "${patches[@]}"; do
    if ! patch -d "$work/pyfuse3-$version" -p1 --forward --batch --quiet < "$here/$p"; then
        echo "setup: scripts/pyfuse3/$p does not apply to pyfuse3 $version" >&2
        exit 1
    fi
done
# (setuptools_scm takes the version from the environment: the local label marks the build)
echo "setup:   compiling pyfuse3 (Cython, then C)"
SETUPTOOLS_SCM_PRETEND_VERSION=$local_version \
    "$py" -m pip wheel -q --no-deps -w "$work/wheel" "$work/pyfuse3-$version"
wheel=$(echo "$work"/wheel/pyfuse3-*.whl)
echo "setup:   installing the pyfuse3 build into the venv"
"$py" -m pip install -q --no-deps --force-reinstall "$wheel"
"$py" -m pip install -q "$wheel"  # (its dependencies, trio: in a new venv they come now, before the project)
"$py" -c "$check" || { echo "setup: the patched pyfuse3 does not import" >&2; exit 1; }
