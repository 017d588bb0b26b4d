"""MpiComm's collectives against numpy at P = 2 and 4, and its byte counts against the ring model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslide.mpirun import run_mpi

PROGRAM = Path(__file__).parent / "programs" / "collectives.py"
ITEMSIZE = {"float32": 4, "float64": 8, "int64": 8, "int32": 4}


def expected_allgather(blocks: list[int], rank: int) -> int:
    # widths first (one int64 per rank), then every block but the next rank's
    size = len(blocks)
    return 8 * (size - 1) + sum(blocks) - blocks[(rank + 1) % size]


def expected_allreduce(n: int, itemsize: int, size: int, rank: int) -> int:
    chunks = [n // size + (1 if i < n % size else 0) for i in range(size)]
    return (2 * n - chunks[(rank + 1) % size] - chunks[(rank + 2) % size]) * itemsize


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def ledgers(request):
    result = run_mpi(request.param, [PROGRAM], timeout=120)
    assert not result.timed_out, result.stderr
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["size"] == request.param
    return report["ledgers"]


def test_every_collective_matches_numpy(ledgers):
    # the program asserts each result on every rank; here: every rank ran every check
    assert len({len(ledger) for ledger in ledgers}) == 1
    assert len(ledgers[0]) == 18


def test_allgather_bytes_follow_the_ring_model(ledgers):
    for rank, ledger in enumerate(ledgers):
        for entry in ledger:
            kind, *rest = entry["op"].split(":")
            if kind != "allgather" or rest[0] not in ITEMSIZE:
                continue
            widths = [int(w) for w in rest[1].split("-")]
            rows = int(rest[2])
            blocks = [w * rows * ITEMSIZE[rest[0]] for w in widths]
            assert entry["bytes"] == expected_allgather(blocks, rank), entry


def test_allgather_total_is_p_minus_one_copies_of_the_data(ledgers):
    size = len(ledgers)
    strided = [next(e["bytes"] for e in ledger if e["op"] == "allgather:strided") for ledger in ledgers]
    # 4 rows x 4 float32 per rank; every byte reaches P-1 other ranks once
    assert sum(strided) == (size - 1) * (size * 4 * 4 * 4) + size * 8 * (size - 1)


def test_allreduce_bytes_follow_the_ring_model(ledgers):
    size = len(ledgers)
    for rank, ledger in enumerate(ledgers):
        for entry in ledger:
            kind, _, arg = entry["op"].partition(":")
            if kind == "allreduce_sum" and arg.isdigit():
                assert entry["bytes"] == expected_allreduce(int(arg), 8, size, rank), entry
            if kind == "allreduce_max":
                assert entry["bytes"] == expected_allreduce(int(arg), 4, size, rank), entry
    # summed over ranks, a ring allreduce sends 2(P-1)/P of the buffer per rank
    total = sum(e["bytes"] for ledger in ledgers for e in ledger if e["op"] == "allreduce_sum:4097")
    assert total == 2 * (size - 1) * 4097 * 8


def test_bcast_bytes_add_up_to_one_copy_per_receiver(ledgers):
    size = len(ledgers)
    for root in {0, size - 1}:
        sent = [next(e["bytes"] for e in ledger if e["op"] == f"bcast:{root}") for ledger in ledgers]
        assert sent[root] > 0
        # a tree: every rank but the root receives (length + payload) exactly once
        children = _children(size, root)
        assert all(s == 0 for s, c in zip(sent, children, strict=True) if c == 0)
        per_copy = {s // c for s, c in zip(sent, children, strict=True) if c}
        assert len(per_copy) == 1 and sum(sent) == (size - 1) * per_copy.pop()


def _children(size: int, root: int) -> list[int]:
    from dslide.mpicomm import tree_bcast_children

    return [tree_bcast_children(rank, size, root) for rank in range(size)]
