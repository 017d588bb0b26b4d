"""The XC parser and writer: round trips, shards, and ``file:line: reason`` errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dslide.data import DataError, XCData, format_xc, load_xc, parse_xc_bytes, read_header
from dslide.gen import generate


def test_parses_labels_features_and_unlabelled_lines() -> None:
    text = b"3 10 5\n0,4 1:0.5 9:2\n 3:1e-2 4:-1.5E+1\n2\n"
    d = parse_xc_bytes(text, "t.txt")
    assert (len(d), d.n_features, d.n_labels) == (3, 10, 5)
    assert d.y_indptr.tolist() == [0, 2, 2, 3] and d.y_indices.tolist() == [0, 4, 2]
    assert d.x_indptr.tolist() == [0, 2, 4, 4] and d.x_indices.tolist() == [1, 9, 3, 4]
    np.testing.assert_allclose(d.x_values, [0.5, 2.0, 0.01, -15.0], rtol=1e-6)


def test_crlf_tabs_and_trailing_blank_lines() -> None:
    d = parse_xc_bytes(b"2 4 3\r\n1\t0:1.0\r\n0,2 3:.25\r\n\r\n\n", "t")
    assert d.y_indices.tolist() == [1, 0, 2] and d.x_indices.tolist() == [0, 3]
    np.testing.assert_allclose(d.x_values, [1.0, 0.25])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"2 10 5\n0 1:1\n0,x 2:1\n", "bad.txt:3: bad label list"),
        (b"1 10 5\n7 1:1\n", "bad.txt:2: label 7 out of range [0, 5)"),
        (b"1 10 5\n0 12:1\n", "bad.txt:2: feature 12 out of range [0, 10)"),
        (b"1 10 5\n0 3\n", "bad.txt:2: feature index without ':value'"),
        (b"1 10 5\n0 3:abc\n", "bad.txt:2: bad feature value"),
        (b"1 10 5\n0 3:1.0x\n", "bad.txt:2: bad feature value"),
        (b"1 10 5\n0 a:1\n", "bad.txt:2: bad feature"),
        (b"2 10 5\n0 1:1\n\n1 2:1\n", "bad.txt:3: empty line"),
        (b"3 10 5\n0 1:1\n1 2:1\n", "bad.txt:1: header says 3 points but the file has 2"),
        (b"3 10\n0 1:1\n", "bad.txt:1: bad header"),
        (b"", "bad.txt:1: empty file"),
    ],
)
def test_malformed_lines_name_file_and_line(text: bytes, message: str) -> None:
    with pytest.raises(DataError) as e:
        parse_xc_bytes(text, "bad.txt")
    assert str(e.value).startswith(message), str(e.value)


def test_shards_concatenate_in_order_and_must_agree(tmp_path) -> None:
    d = generate(300, 50, 20, seed=3)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(format_xc(d.subset(np.arange(0, 100))))
    b.write_bytes(format_xc(d.subset(np.arange(100, 300))))
    both = load_xc([a, b])
    assert len(both) == 300
    np.testing.assert_array_equal(both.x_indices, d.x_indices)
    np.testing.assert_array_equal(both.y_indptr, d.y_indptr)
    np.testing.assert_allclose(both.x_values, d.x_values, atol=1e-6)
    assert read_header(b) == (200, 50, 20)
    c = tmp_path / "c.txt"
    c.write_bytes(b"1 51 20\n0 1:1\n")
    with pytest.raises(DataError, match=r"c\.txt:1: header says F=51 L=20 but .*a\.txt says F=50 L=20"):
        load_xc([a, c])
    with pytest.raises(DataError, match=r"missing\.txt:0: cannot read"):
        load_xc(tmp_path / "missing.txt")


@st.composite
def xc_data(draw) -> XCData:
    n = draw(st.integers(0, 8))
    f, l = draw(st.integers(1, 1000)), draw(st.integers(1, 1000))
    xs, ys = [], []
    for _ in range(n):
        xs.append(sorted(draw(st.sets(st.integers(0, f - 1), max_size=6))))
        ys.append(sorted(draw(st.sets(st.integers(0, l - 1), max_size=4))))
    x_indptr = np.cumsum([0] + [len(x) for x in xs]).astype(np.int64)
    y_indptr = np.cumsum([0] + [len(y) for y in ys]).astype(np.int64)
    vals = draw(st.lists(st.floats(0, 1000, width=32), min_size=int(x_indptr[-1]), max_size=int(x_indptr[-1])))
    return XCData(
        f, l, x_indptr, np.array([f for x in xs for f in x], np.int32), np.array(vals, np.float32), y_indptr,
        np.array([y for ys_ in ys for y in ys_], np.int32),
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(xc_data())
def test_write_then_parse_is_identity(d: XCData) -> None:
    back = parse_xc_bytes(format_xc(d, decimals=6), "rt")
    assert (len(back), back.n_features, back.n_labels) == (len(d), d.n_features, d.n_labels)
    np.testing.assert_array_equal(back.x_indptr, d.x_indptr)
    np.testing.assert_array_equal(back.x_indices, d.x_indices)
    np.testing.assert_array_equal(back.y_indptr, d.y_indptr)
    np.testing.assert_array_equal(back.y_indices, d.y_indices)
    np.testing.assert_allclose(back.x_values, d.x_values, rtol=1e-6, atol=1e-6)


def test_generator_has_the_planted_shape() -> None:
    d = generate(4000, 20_000, 5_000, seed=1)
    nnz = np.diff(d.x_indptr)
    labels = np.diff(d.y_indptr)
    assert 55 < nnz.mean() < 75 and 4 < labels.mean() < 6
    assert np.all(np.diff(d.x_indices[: nnz[0]]) > 0)  # sorted, no duplicates
    np.testing.assert_allclose(np.add.reduceat(d.x_values.astype(np.float64) ** 2, d.x_indptr[:-1]), 1, rtol=1e-4)
    counts = np.sort(d.label_counts())[::-1]
    assert counts[0] > 20 * max(np.median(counts), 1)  # power-law popularity: a heavy head
    again = generate(4000, 20_000, 5_000, seed=1)
    np.testing.assert_array_equal(again.x_indices, d.x_indices)
