"""Issue 46, item 2, without a mount: a mode or owner changed in the backing dir is never served on the kernel's
old permission check.  An open that finds its file's mode changed fails with ``ESTALE`` and holds nothing; the
revalidator reads directories' modes too; an ``opendir`` beneath a directory whose new mode the kernel was not
told of yet fails with ``ESTALE`` once, and the next is served (the kernel's retry, with fresh attributes)."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from tierfs.daemon.access import OWNER_UID
from tierfs.daemon.serving.datapath import AccessChanged
from tierfs.daemon.serving.namespace import Listing
from tierfs.daemon.tree.tree import KIND_DIR

from .conftest import run

NOBODY = 65534


def _dir_node(e, name: bytes) -> int:
    node = e.tree.child(0, name)
    assert node is not None and e.tree.kinds[node] == KIND_DIR
    return node


def test_an_open_that_finds_its_file_made_private_serves_nothing(open_engine):
    e = open_engine(revalidate="never")
    fidx = 0
    path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(fidx)))

    async def main() -> None:
        assert e.cache.get(fidx) is None
        with open(path, "r+b") as f:  # rewritten in place, then chmod 600
            f.write(b"private")
        os.chmod(path, 0o600)
        before = e.data.statistics()
        with pytest.raises(AccessChanged) as caught:
            await e.data.open_file(fidx, NOBODY)
        assert caught.value.errno == errno.ESTALE
        after = e.data.statistics()
        assert after.handles == 0 and after.fd_budget.others_held == 0
        assert (after.reads.hits, after.reads.misses) == (before.reads.hits, before.reads.misses)
        assert e.tree.access_of(fidx + 1)[0] & 0o777 == 0o600
        assert fidx + 1 in e.tree.access_untold  # (until the kernel is told: the namespace's)
        with pytest.raises(OSError) as again:
            await e.names.ensure_kernel_checked(e.tree.inode_of(fidx))
        assert again.value.errno == errno.ESTALE and not e.tree.access_untold
        h = await e.data.open_file(fidx, OWNER_UID)  # the kernel's retry: checked on the new mode, served
        await e.data.release(h)

    run(main)


def test_the_revalidator_reads_directories_modes_and_opendir_makes_the_kernel_check_again(open_engine):
    e = open_engine(revalidate="0.2")
    d = _dir_node(e, b"class_001")
    inside = int(e.tree.children(d)[0])

    async def main() -> None:
        os.chmod(os.path.join(e.config.backing, "class_001"), 0o700)
        async with trio.open_nursery() as n:
            n.start_soon(e.reval.run)
            with trio.fail_after(30):
                while e.tree.access_of(d)[0] & 0o777 != 0o700:
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()
        assert e.reval.dirs_changed == 1 and d in e.tree.access_untold
        for inode in (d + 1, inside + 1):  # the directory, or anything beneath it
            e.tree.access_untold[d] = e.tree.access_serial  # (as found, untold)
            with pytest.raises(OSError) as caught:
                if inode == d + 1:
                    await e.names.open_dir(inode, NOBODY, os.getpid())
                else:
                    await e.names.ensure_kernel_checked(inode)
            assert caught.value.errno == errno.ESTALE and not e.tree.access_untold
            await e.names.ensure_kernel_checked(inode)  # told: the retry passes
        assert isinstance(await e.names.open_dir(d + 1, NOBODY, os.getpid()), Listing)

    run(main)
