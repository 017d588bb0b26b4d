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
        # bad labels: negative, not an integer, past int32
        (b"1 10 5\n-1 1:1\n", "bad.txt:2: bad label list"),
        (b"1 10 5\n0,-2 1:1\n", "bad.txt:2: bad label list"),
        (b"1 10 5\n1.5 1:1\n", "bad.txt:2: bad label list"),
        (b"1 10 5\n0,99999999999 1:1\n", "bad.txt:2: label 99999999999 out of range [0, 5)"),
        (b"1 10 5\n0 -1:1\n", "bad.txt:2: bad feature"),
        # values the model (float32) cannot hold: NaN, Inf, and finite text that overflows
        (b"1 10 5\n0 3:nan\n", "bad.txt:2: feature 3: value nan is not a finite number"),
        (b"1 10 5\n0 3:-NaN\n", "bad.txt:2: feature 3: value -NaN is not a finite number"),
        (b"1 10 5\n0 3:inf\n", "bad.txt:2: feature 3: value inf is not a finite number"),
        (b"1 10 5\n0 3:-Infinity\n", "bad.txt:2: feature 3: value -Infinity is not a finite number"),
        (b"2 10 5\n0 1:1\n0 3:1e999 4:1\n", "bad.txt:3: feature 3: value 1e999 overflows float32 (|value| must be"),
        (b"1 10 5\n0 3:-3.4028236e38\n", "bad.txt:2: feature 3: value -3.4028236e38 overflows float32"),
        (b"1 10 5\n0 3:" + b"9" * 60 + b"\n", "bad.txt:2: feature 3: value " + "9" * 38 + "... overflows float32"),
        # headers that lie: more or fewer points than N, F or L too small for what follows, absurd sizes
        (b"1 10 5\n0 1:1\n1 2:1\n", "bad.txt:1: header says 1 points but the file has 2"),
        (b"2 2 5\n0 1:1\n1 2:1\n", "bad.txt:3: feature 2 out of range [0, 2)"),
        (b"2 10 1\n0 1:1\n1 2:1\n", "bad.txt:3: label 1 out of range [0, 1)"),
        (b"-1 10 5\n", "bad.txt:1: bad header"),
        (b"1 10 3000000000\n0 1:1\n", "bad.txt:1: header says F=10 L=3000000000; at most 2147483647"),
    ],
)
def test_malformed_lines_name_file_and_line(text: bytes, message: str) -> None:
    with pytest.raises(DataError) as e:
        parse_xc_bytes(text, "bad.txt")
    assert str(e.value).startswith(message), str(e.value)


def test_values_at_the_float32_edges_parse() -> None:
    d = parse_xc_bytes(b"1 10 5\n0 1:3.4028235e38 2:-3.4028235e+38 3:0e999 4:1e-999 5:-0.0\n", "t")
    assert d.x_values.tolist() == [np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0, 0.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["", "-", "+"]),
    st.integers(0, 10**25),
    st.one_of(st.just(""), st.integers(0, 10**12).map(str)),
    st.one_of(st.just(""), st.integers(-500, 500).map(lambda e: f"e{e}")),
)
def test_a_number_is_parsed_to_float32_or_refused(sign: str, whole: int, frac: str, exp: str) -> None:
    """Whatever digits and exponent a value has, the parser gives float32 of it, or refuses it: never inf or NaN."""
    text = f"{sign}{whole}{'.' + frac if frac else ''}{exp}"
    want = float(text)
    try:
        got = parse_xc_bytes(f"1 10 5\n0 7:{text}\n".encode(), "v").x_values[0]
    except DataError as e:
        head, tail = "v:2: feature 7: value ", " overflows float32 (|value| must be at most 3.4028235e38)"
        assert str(e).startswith(head) and str(e).endswith(tail), str(e)
        shown = str(e)[len(head):-len(tail)]
        assert shown == text or (shown.endswith("...") and text.startswith(shown[:-3])), (shown, text)  # long: cut
        assert abs(want) > 0.99999 * float(np.finfo(np.float32).max), text
        return
    assert np.isfinite(got) and abs(want) < 1.00001 * float(np.finfo(np.float32).max), text
    np.testing.assert_allclose(got, np.float32(want), rtol=1e-6, atol=0, err_msg=text)


def test_read_header_refuses_what_the_parser_refuses(tmp_path) -> None:
    lying = tmp_path / "h.txt"
    lying.write_bytes(b"1 10 3000000000\n0 1:1\n")
    with pytest.raises(DataError, match=r"h\.txt:1: header says F=10 L=3000000000; at most 2147483647"):
        read_header(lying)
    lying.write_bytes(b"1 -10 5\n0 1:1\n")
    with pytest.raises(DataError, match=r"h\.txt:1: bad header '1 -10 5'"):
        read_header(lying)


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
