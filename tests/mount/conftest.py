"""Real FUSE mounts.  Every mount goes through :func:`tierfs.testing.mounted`, which always unmounts."""

from __future__ import annotations

import os
import shutil

import pytest

from tierfs.testing import force_unmount, make_dataset, mounted


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.mount)


@pytest.fixture(scope="session", autouse=True)
def _fuse_available():
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("mount tests need /dev/fuse and fusermount3 (apt-get install fuse3)")


@pytest.fixture
def dataset(tmp_path):
    """A small dataset: 4 class dirs x 8 files of up to 64 KiB; returns (backing path, {relpath: size})."""
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=4, files_per_dir=8, max_size=64 << 10, seed=1)
    return backing, files


@pytest.fixture
def mount_dirs(tmp_path):
    """Fresh, empty mountpoint and cache dirs; lazily unmounted at the end whatever happened."""
    mnt = tmp_path / "mnt"
    cache = tmp_path / "cache"
    mnt.mkdir()
    yield mnt, cache
    force_unmount(mnt)


@pytest.fixture
def tierfs_mount(dataset, mount_dirs):
    """A factory: ``with tierfs_mount(capacity=..., rf=2) as m:`` mounts the ``dataset`` fixture."""
    backing, _ = dataset
    mnt, cache = mount_dirs

    def factory(capacity="1M", **options):
        return mounted(backing, mnt, cache, capacity, **options)

    return factory
