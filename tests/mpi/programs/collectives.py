"""Exercise every MpiComm collective against numpy on data each rank can rebuild for every rank.

Run under ``mpiexec -n P``; any mismatch raises, which aborts the job (non-zero exit).  Rank 0 prints one
JSON line: per-rank byte counts by collective, for the test to check against the accounting model.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from dslide.mpicomm import MpiComm, abort_on_failure, get_comm


def block(rank: int, width: int, rows: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng((salt, rank))
    return (rng.standard_normal((rows, width)) * 100).astype(dtype)


def main() -> None:
    comm = get_comm()
    assert isinstance(comm, MpiComm), type(comm)
    P, r = comm.size, comm.rank
    ledger = []

    def check(name: str, got: np.ndarray, want: np.ndarray, before: int) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)
        ledger.append({"op": name, "bytes": comm.bytes_sent - before})

    # allgather along axis 1: uneven widths, one rank empty, several dtypes, 1-D and 3-D.
    for salt, dtype in enumerate(["float32", "float64", "int64", "int32"]):
        widths = [(k * 7 + salt) % 5 + (0 if k == P - 1 else 1) for k in range(P)]
        rows = 3 + salt
        before = comm.bytes_sent
        got = comm.allgather(block(r, widths[r], rows, dtype, salt))
        want = np.concatenate([block(k, widths[k], rows, dtype, salt) for k in range(P)], axis=1)
        check(f"allgather:{dtype}:{'-'.join(map(str, widths))}:{rows}", got, want, before)
    before = comm.bytes_sent
    got = comm.allgather(np.arange(r + 1, dtype=np.float32) + 10 * r)
    check("allgather:1d", got, np.concatenate([np.arange(k + 1, dtype=np.float32) + 10 * k for k in range(P)]), before)
    cube = np.arange(2 * (r + 1) * 3, dtype=np.float64).reshape(2, r + 1, 3) * (r + 1)
    before = comm.bytes_sent
    got = comm.allgather(cube)
    want = np.concatenate(
        [np.arange(2 * (k + 1) * 3, dtype=np.float64).reshape(2, k + 1, 3) * (k + 1) for k in range(P)], axis=1
    )
    check("allgather:3d", got, want, before)
    # a non-contiguous view must gather by value
    wide = block(r, 8, 4, "float32", 99)
    before = comm.bytes_sent
    got = comm.allgather(wide[:, ::2])
    check(
        "allgather:strided",
        got,
        np.concatenate([block(k, 8, 4, "float32", 99)[:, ::2] for k in range(P)], axis=1),
        before,
    )

    # allreduce: sum of integers is exact in any order; max is exact for floats.
    for n in (1, 5, 1000, 4097):
        before = comm.bytes_sent
        got = comm.allreduce_sum(np.arange(n, dtype=np.int64) * (r + 1))
        check(f"allreduce_sum:{n}", got, np.arange(n, dtype=np.int64) * (P * (P + 1) // 2), before)
        parts = [block(k, n, 1, "float32", 7)[0] for k in range(P)]
        before = comm.bytes_sent
        got = comm.allreduce_max(parts[r])
        check(f"allreduce_max:{n}", got, np.max(parts, axis=0), before)
    grid = block(r, 6, 4, "float64", 3)
    before = comm.bytes_sent
    got = comm.allreduce_sum(grid)
    want = np.sum([block(k, 6, 4, "float64", 3) for k in range(P)], axis=0)
    assert got.shape == (4, 6)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    ledger.append({"op": "allreduce_sum:2d:float64", "bytes": comm.bytes_sent - before})
    assert got is not grid

    # bcast of Python objects from rank 0 and from the last rank.
    for root in {0, P - 1}:
        before = comm.bytes_sent
        files = comm.bcast([f"shard-{i:03d}.txt" for i in range(17)] if r == root else None, root=root)
        assert files == [f"shard-{i:03d}.txt" for i in range(17)], files
        ledger.append({"op": f"bcast:{root}", "bytes": comm.bytes_sent - before})
    comm.barrier()

    assert comm.bytes_sent == sum(comm.bytes_by_op.values())
    from mpi4py import MPI

    ledgers = MPI.COMM_WORLD.gather(ledger, root=0)
    if r == 0:
        print(json.dumps({"size": P, "ledgers": ledgers}))


if __name__ == "__main__":
    comm = get_comm()
    with abort_on_failure(comm):
        main()
    sys.exit(0)
