"""The byte-accounting model of dslide.mpicomm (pure functions; no MPI needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dslide.mpicomm import (
    dataparallel_allreduce_bytes,
    ends_job_on_failure,
    launched_by_mpi,
    ring_allgather_bytes,
    ring_allreduce_bytes,
    tree_bcast_children,
)

sizes = st.integers(min_value=1, max_value=64)


@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=64))
def test_ring_allgather_delivers_every_block_to_every_other_rank_once(blocks):
    size = len(blocks)
    sent = [ring_allgather_bytes(blocks, rank) for rank in range(size)]
    assert sum(sent) == (size - 1) * sum(blocks)
    assert all(0 <= s <= sum(blocks) for s in sent)


@given(sizes, st.integers(min_value=1, max_value=10**6))
def test_ring_allgather_of_equal_blocks_sends_p_minus_one_over_p(size, block):
    for rank in range(size):
        assert ring_allgather_bytes([block] * size, rank) == (size - 1) * block


@given(sizes, st.integers(min_value=0, max_value=10**7), st.sampled_from([1, 4, 8]))
def test_ring_allreduce_sends_two_p_minus_one_over_p_of_the_buffer(size, count, itemsize):
    sent = [ring_allreduce_bytes(count, itemsize, size, rank) for rank in range(size)]
    assert sum(sent) == 2 * (size - 1) * count * itemsize
    if count % size == 0:
        assert set(sent) == {2 * (size - 1) * count // size * itemsize}


def test_dataparallel_figure():
    assert dataparallel_allreduce_bytes(1000, 1) == 0
    assert dataparallel_allreduce_bytes(1000, 2) == 1000
    assert dataparallel_allreduce_bytes(1000, 4) == 1500


@given(sizes, st.data())
def test_a_binomial_tree_reaches_every_rank_once(size, data):
    root = data.draw(st.integers(min_value=0, max_value=size - 1))
    children = [tree_bcast_children(rank, size, root) for rank in range(size)]
    assert sum(children) == size - 1
    assert children[root] == (size - 1).bit_length()


def test_launch_detection(monkeypatch):
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    assert launched_by_mpi() == 0
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert launched_by_mpi() == 3
    monkeypatch.setenv("PMI_SIZE", "2")
    assert launched_by_mpi() == 2


def test_the_cli_edge_is_transparent_outside_mpi():
    @ends_job_on_failure
    def main(code: int) -> int:
        if code < 0:
            raise KeyError("boom")
        return code

    assert main(0) == 0 and main(2) == 2
    with pytest.raises(KeyError):
        main(-1)
