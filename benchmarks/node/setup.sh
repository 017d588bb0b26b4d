# Sourced on a bare node, in the repository's root, after benchmarks/node/bundle.sh filled .dev/ here: unpacks
# libfuse3 under /tmp/fx (never over /), builds pyfuse3 3.5.0 with scripts/pyfuse3's patches against it, and
# installs it and trio into the node's own Python (a CUDA image's venv: torch, PIL and numpy are there).
set -e
mkdir -p /tmp/fx
for f in .dev/deb/*.deb; do dpkg -x "$f" /tmp/fx; done
# (Debian's libfuse3.so links to /lib absolutely, and a static libfuse3.a beside it would be linked instead)
rm -f /tmp/fx/usr/lib/x86_64-linux-gnu/libfuse3.a
ln -sfn /tmp/fx/lib/x86_64-linux-gnu/libfuse3.so.3 /tmp/fx/usr/lib/x86_64-linux-gnu/libfuse3.so
export PATH=/tmp/fx/usr/bin:/tmp/fx/bin:$PATH LD_LIBRARY_PATH=/tmp/fx/lib/x86_64-linux-gnu
export LDFLAGS="-L/tmp/fx/usr/lib/x86_64-linux-gnu -Wl,-rpath,/tmp/fx/lib/x86_64-linux-gnu"
export PKG_CONFIG_PATH=/tmp/fx/usr/lib/x86_64-linux-gnu/pkgconfig PKG_CONFIG_SYSROOT_DIR=/tmp/fx
PY=${PY:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/bt .dev/whl/cython*.whl \
    .dev/whl/setuptools-*.whl .dev/whl/setuptools_scm*.whl .dev/whl/vcs_versioning*.whl .dev/whl/packaging*.whl
$PY -m pip install -q --no-index --no-deps --no-compile .dev/whl/trio*.whl .dev/whl/outcome*.whl \
    .dev/whl/sniffio*.whl
rm -rf /tmp/pb && mkdir -p /tmp/pb && tar xzf .dev/whl/pyfuse3-3.5.0.tar.gz -C /tmp/pb
for p in cache-readdir.patch nonblocking-loop.patch; do
    patch -d /tmp/pb/pyfuse3-3.5.0 -p1 --forward --batch --quiet < "scripts/pyfuse3/$p"
done
(cd /tmp/pb/pyfuse3-3.5.0 && PYTHONPATH=/tmp/bt SETUPTOOLS_SCM_PRETEND_VERSION=3.5.0+tierfs2 \
    $PY -m pip wheel -q --no-build-isolation --no-deps --no-index -w /tmp/wh .)
$PY -m pip install -q --no-index --no-deps --no-compile /tmp/wh/pyfuse3*.whl
export PYTHONPATH=$(pwd)
$PY -c "import pyfuse3; assert pyfuse3.FileInfo(cache_readdir=True).cache_readdir; print('pyfuse3 patched: ok')"
set +e
