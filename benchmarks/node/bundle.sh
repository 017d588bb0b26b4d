#!/usr/bin/env bash
# Gather, here (a Debian box with the registries), what a bare GPU node with no network needs to mount tierfs and
# run the benchmarks: libfuse3 and fusermount3 as .debs, trio and pyfuse3's sources as wheels and an sdist, into
# .dev/ (git-ignored).  On the node, from the repository's root: `source benchmarks/node/setup.sh`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
py=${PYTHON:-.venv/bin/python}
mkdir -p .dev/deb .dev/whl
(cd .dev/deb && apt-get download -q fuse3 libfuse3-3 libfuse3-dev pkgconf pkgconf-bin libpkgconf3)
# pure-Python wheels: trio and what it needs beyond a CUDA image's packages; the build tools of pyfuse3
"$py" -m pip download -q --no-deps -d .dev/whl trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 \
    setuptools==80.9.0 setuptools_scm==10.3.4 vcs-versioning==2.6.0 packaging==26.2
"$py" -m pip download -q --no-deps --only-binary :all: --implementation py --platform any -d .dev/whl cython==3.1.4
"$py" -m pip download -q --no-deps --no-binary :all: -d .dev/whl pyfuse3==3.5.0
du -sh .dev
