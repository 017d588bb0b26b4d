"""The Extreme Classification Repository text format: parse it fast, write it fast.

A file is a header line ``N F L`` (points, features, labels) and then one point per line::

    l1,l2,... f:v f:v ...

(zero-based label and feature indices; a point without labels starts with a space).  A data set may be split
into many shard files with the same ``F`` and ``L``.

The parser is one numba pass over the raw bytes (hundreds of MB/s), into CSR arrays.  It never guesses: a
malformed line stops it with :class:`DataError` whose message is ``file:line: reason``, the form editors and
users can jump to.  The writer is the mirror image, used by ``dslide gen``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = [
    "DataError", "XCData", "check_shape", "concat", "format_xc", "load_xc", "parse_xc_bytes", "read_header", "write_xc",
]  # fmt: skip


class DataError(ValueError):
    """A data file is malformed; ``str(e)`` is ``file:line: reason``."""


@dataclass(frozen=True)
class XCData:
    """Points as CSR arrays: features ``x_*`` (values float32) and labels ``y_*``."""

    n_features: int
    n_labels: int
    x_indptr: np.ndarray  # int64, n+1
    x_indices: np.ndarray  # int32
    x_values: np.ndarray  # float32
    y_indptr: np.ndarray  # int64, n+1
    y_indices: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.x_indptr) - 1

    def subset(self, rows: np.ndarray) -> XCData:
        """The points ``rows`` (in that order) as a new data set."""
        rows = np.asarray(rows, dtype=np.int64)
        xi, xp = _gather_csr(self.x_indptr, rows)
        yi, yp = _gather_csr(self.y_indptr, rows)
        return XCData(self.n_features, self.n_labels, xp, self.x_indices[xi], self.x_values[xi], yp, self.y_indices[yi])

    def label_counts(self) -> np.ndarray:
        return np.bincount(self.y_indices, minlength=self.n_labels)


def _gather_csr(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = indptr[rows + 1] - indptr[rows]
    new_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_indptr[1:])
    # element positions: start of each row repeated, plus the offset inside the row
    starts = np.repeat(indptr[rows] - new_indptr[:-1], lengths)
    return starts + np.arange(new_indptr[-1], dtype=np.int64), new_indptr


def concat(parts: Sequence[XCData]) -> XCData:
    if not parts:
        raise ValueError("concat needs at least one data set")
    f, l = parts[0].n_features, parts[0].n_labels

    def indptr(key: str) -> np.ndarray:
        out, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            ip = getattr(p, key)
            out.append(ip[1:] + base)
            base += int(ip[-1])
        return np.concatenate(out)

    return XCData(
        f,
        l,
        indptr("x_indptr"),
        np.concatenate([p.x_indices for p in parts]),
        np.concatenate([p.x_values for p in parts]),
        indptr("y_indptr"),
        np.concatenate([p.y_indices for p in parts]),
    )


# ---------------------------------------------------------------------------------------------------------------
# parser

_OK, _E_LABEL, _E_LABEL_RANGE, _E_FEATURE, _E_FEATURE_RANGE, _E_VALUE, _E_EMPTY, _E_COLON = range(8)
_E_NOT_FINITE, _E_OVERFLOW = 8, 9
_REASONS = {
    _E_LABEL: "bad label list (expected comma-separated non-negative integers, then a space)",
    _E_LABEL_RANGE: "label {item} out of range [0, {L})",
    _E_FEATURE: "bad feature (expected index:value)",
    _E_FEATURE_RANGE: "feature {index} out of range [0, {F})",
    _E_VALUE: "bad feature value (expected a number after ':')",
    _E_EMPTY: "empty line",
    _E_COLON: "feature index without ':value'",
    _E_NOT_FINITE: "feature {index}: value {value} is not a finite number",
    _E_OVERFLOW: "feature {index}: value {value} overflows float32 (|value| must be at most 3.4028235e38)",
}

_SP, _TAB, _NL, _CR, _COMMA, _COLON, _DOT = 32, 9, 10, 13, 44, 58, 46


@njit(cache=True)
def _pow10(e: int) -> float:
    r = 1.0
    b = 10.0
    n = -e if e < 0 else e
    while n > 0:
        if n & 1:
            r *= b
        b *= b
        n >>= 1
    return 1.0 / r if e < 0 else r


@njit(cache=True)
def _read_index(buf, pos, n):
    """Digits at ``pos`` as an int, and the position after them; stops once past int32 (the caller's error)."""
    v = 0
    while pos < n and 48 <= buf[pos] <= 57:
        v = v * 10 + (buf[pos] - 48)
        pos += 1
        if v > 2147483647:
            break
    return v, pos


@njit(cache=True)
def _at_nan_or_inf(buf, pos, n):
    """``nan`` or ``inf`` (any case, ``infinity`` too) starts at ``pos``: named in the error, not just 'bad'."""
    if pos + 3 > n:
        return False
    a, b, c = buf[pos] | 32, buf[pos + 1] | 32, buf[pos + 2] | 32  # | 32: ASCII lower case
    return (a == 110 and b == 97 and c == 110) or (a == 105 and b == 110 and c == 102)


@njit(cache=True)
def _parse_body(buf, pos, first_line, n_features, n_labels, x_indptr, x_indices, x_values, y_indptr, y_indices):
    """Fill the CSR arrays from ``buf[pos:]``; returns (rows, error code, error line, where the offending
    label or ``index:value`` starts in ``buf``)."""
    n = len(buf)
    row = 0
    nx = 0
    ny = 0
    line = first_line
    while pos < n:
        c = buf[pos]
        if c == _NL or c == _CR:  # noqa: SIM109 -- numba: plain comparisons on a byte
            # an empty line is only allowed as trailing whitespace at the end of the file
            q = pos
            while q < n and (buf[q] == _NL or buf[q] == _CR or buf[q] == _SP or buf[q] == _TAB):
                q += 1
            if q == n:
                break
            return row, _E_EMPTY, line, 0
        # labels: digits(,digits)* -- or nothing when the line starts with a space
        if c != _SP and c != _TAB:
            while True:
                if pos >= n or buf[pos] < 48 or buf[pos] > 57:
                    return row, _E_LABEL, line, 0
                start = pos
                v, pos = _read_index(buf, pos, n)
                if v > 2147483647 or v >= n_labels:
                    return row, _E_LABEL_RANGE, line, start
                y_indices[ny] = v
                ny += 1
                if pos < n and buf[pos] == _COMMA:
                    pos += 1
                    continue
                if pos >= n or buf[pos] == _SP or buf[pos] == _TAB or buf[pos] == _NL or buf[pos] == _CR:
                    break
                return row, _E_LABEL, line, 0
        # features
        while True:
            while pos < n and (buf[pos] == _SP or buf[pos] == _TAB):
                pos += 1
            if pos >= n or buf[pos] == _NL or buf[pos] == _CR:
                break
            if buf[pos] < 48 or buf[pos] > 57:
                return row, _E_FEATURE, line, 0
            start = pos
            f, pos = _read_index(buf, pos, n)
            if f > 2147483647:
                return row, _E_FEATURE_RANGE, line, start
            if pos >= n or buf[pos] != _COLON:
                return row, _E_COLON, line, 0
            pos += 1
            if f >= n_features:
                return row, _E_FEATURE_RANGE, line, start
            # number: [sign] digits [. digits] [e [sign] digits]
            neg = False
            if pos < n and (buf[pos] == 45 or buf[pos] == 43):
                neg = buf[pos] == 45
                pos += 1
            if _at_nan_or_inf(buf, pos, n):
                return row, _E_NOT_FINITE, line, start
            mant = 0
            exp10 = 0
            ndig = 0
            while pos < n and 48 <= buf[pos] <= 57:
                if mant < 100000000000000000:
                    mant = mant * 10 + (buf[pos] - 48)
                else:
                    exp10 += 1
                ndig += 1
                pos += 1
            if pos < n and buf[pos] == _DOT:
                pos += 1
                while pos < n and 48 <= buf[pos] <= 57:
                    if mant < 100000000000000000:
                        mant = mant * 10 + (buf[pos] - 48)
                        exp10 -= 1
                    ndig += 1
                    pos += 1
            if ndig == 0:
                return row, _E_VALUE, line, 0
            if pos < n and (buf[pos] == 101 or buf[pos] == 69):
                pos += 1
                eneg = False
                if pos < n and (buf[pos] == 45 or buf[pos] == 43):
                    eneg = buf[pos] == 45
                    pos += 1
                e = 0
                edig = 0
                while pos < n and 48 <= buf[pos] <= 57:
                    if e < 10000:
                        e = e * 10 + (buf[pos] - 48)
                    edig += 1
                    pos += 1
                if edig == 0:
                    return row, _E_VALUE, line, 0
                exp10 += -e if eneg else e
            if pos < n and not (buf[pos] == _SP or buf[pos] == _TAB or buf[pos] == _NL or buf[pos] == _CR):
                return row, _E_VALUE, line, 0
            # mant == 0 stays 0 whatever the exponent (0 x inf would be NaN); what float32, the model's type,
            # cannot hold is refused here rather than trained on as inf
            val = mant * _pow10(exp10) if mant else 0.0
            v32 = np.float32(-val if neg else val)
            if np.isinf(v32):
                return row, _E_OVERFLOW, line, start
            x_indices[nx] = f
            x_values[nx] = v32
            nx += 1
        # end of line
        if pos < n and buf[pos] == _CR:
            pos += 1
        if pos < n and buf[pos] == _NL:
            pos += 1
        row += 1
        x_indptr[row] = nx
        y_indptr[row] = ny
        line += 1
    return row, _OK, line, 0


def _item_at(body: np.ndarray, start: int) -> str:
    """The label or ``index:value`` starting at ``start``, as the file has it (shortened if absurdly long)."""
    end = start
    while end < len(body) and end - start <= 40 and body[end] not in (_SP, _TAB, _NL, _CR, _COMMA):
        end += 1
    text = bytes(body[start:end]).decode("ascii", errors="replace")
    return text if end - start <= 40 else text[:40] + "..."


_HEADER_MAX = 1024
_INDEX_MAX = 2**31 - 1  # indices are stored as int32


def _parse_header(line: bytes, name: str) -> tuple[int, int, int]:
    """``(N, F, L)`` from a header line: the one check for ``parse_xc_bytes`` and ``read_header`` alike.

    A header that claims more features or labels than int32 indices can name is refused here: it would
    otherwise size a model that cannot exist before any point is read."""
    header = line.decode("ascii", errors="replace").split()
    try:
        if len(header) != 3:
            raise ValueError
        n_points, n_features, n_labels = (int(t) for t in header)
        if min(n_points, n_features, n_labels) < 0:
            raise ValueError
    except ValueError:
        raise DataError(f"{name}:1: bad header {' '.join(header)!r} (expected 'N F L', three integers)") from None
    if max(n_features, n_labels) > _INDEX_MAX:
        raise DataError(f"{name}:1: header says F={n_features} L={n_labels}; at most {_INDEX_MAX} each (int32 indices)")
    return n_points, n_features, n_labels


def parse_xc_bytes(buf: bytes | np.ndarray, name: str = "<bytes>") -> XCData:
    """Parse one XC-format file's contents; ``name`` is used in error messages."""
    data = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, bytes | bytearray | memoryview) else buf
    if len(data) == 0:
        raise DataError(f"{name}:1: empty file (expected a header 'N F L')")
    nl = bytes(data[:_HEADER_MAX]).find(b"\n")
    if nl < 0:
        nl = min(len(data), _HEADER_MAX)
    n_points, n_features, n_labels = _parse_header(bytes(data[:nl]), name)
    body = data[nl + 1 :]
    # upper bounds for the output sizes, from cheap vectorised byte counts
    n_lines = int(np.count_nonzero(body == _NL)) + 1
    max_x = int(np.count_nonzero(body == _COLON))
    max_y = int(np.count_nonzero(body == _COMMA)) + n_lines
    x_indptr = np.zeros(n_lines + 1, np.int64)
    y_indptr = np.zeros(n_lines + 1, np.int64)
    x_indices = np.empty(max_x, np.int32)
    x_values = np.empty(max_x, np.float32)
    y_indices = np.empty(max_y, np.int32)
    rows, err, line, arg = _parse_body(
        body, 0, 2, n_features, n_labels, x_indptr, x_indices, x_values, y_indptr, y_indices
    )
    if err != _OK:
        item = _item_at(body, arg)
        index, _, value = item.partition(":")
        reason = _REASONS[err].format(item=item, index=index, value=value, L=n_labels, F=n_features)
        raise DataError(f"{name}:{line}: {reason}")
    if rows != n_points:
        raise DataError(f"{name}:1: header says {n_points} points but the file has {rows}")
    nx, ny = int(x_indptr[rows]), int(y_indptr[rows])
    return XCData(
        n_features,
        n_labels,
        x_indptr[: rows + 1],
        x_indices[:nx].copy(),
        x_values[:nx].copy(),
        y_indptr[: rows + 1],
        y_indices[:ny].copy(),
    )


def read_header(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """``(N, F, L)`` from a file's header line, without reading the rest."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            head = f.read(_HEADER_MAX)
    except OSError as e:
        raise DataError(f"{name}:0: cannot read ({e.strerror or e})") from None
    return _parse_header(head.split(b"\n", 1)[0], name)


def check_shape(data: XCData, name: str, n_features: int, n_labels: int, owner: str = "the model") -> None:
    """Refuse data whose header's ``F``/``L`` differ from the model's: its indices would mean other neurons."""
    if (data.n_features, data.n_labels) != (n_features, n_labels):
        raise DataError(
            f"{name}:1: header says F={data.n_features} L={data.n_labels}, {owner} has F={n_features} L={n_labels}"
        )


def load_xc(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> XCData:
    """Parse one file or many shards (all with the same F and L) into one data set, in the order given."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    parts: list[XCData] = []
    for p in paths:
        name = os.fspath(p)
        try:
            raw = np.fromfile(name, dtype=np.uint8)
        except OSError as e:
            raise DataError(f"{name}:0: cannot read ({e.strerror or e})") from None
        part = parse_xc_bytes(raw, name)
        if parts and (part.n_features, part.n_labels) != (parts[0].n_features, parts[0].n_labels):
            raise DataError(
                f"{name}:1: header says F={part.n_features} L={part.n_labels} but {os.fspath(paths[0])} "
                f"says F={parts[0].n_features} L={parts[0].n_labels}"
            )
        parts.append(part)
    if not parts:
        raise DataError("no data files given")
    return parts[0] if len(parts) == 1 else concat(parts)


# ---------------------------------------------------------------------------------------------------------------
# writer


@njit(cache=True)
def _put_int(out, pos, v):
    if v == 0:
        out[pos] = 48
        return pos + 1
    start = pos
    while v > 0:
        out[pos] = 48 + v % 10
        v //= 10
        pos += 1
    # reverse the digits in place
    i, j = start, pos - 1
    while i < j:
        out[i], out[j] = out[j], out[i]
        i += 1
        j -= 1
    return pos


@njit(cache=True)
def _format_body(x_indptr, x_indices, x_values, y_indptr, y_indices, decimals, out):
    scale = 10**decimals
    pos = 0
    for r in range(len(x_indptr) - 1):
        if y_indptr[r] == y_indptr[r + 1] and x_indptr[r] == x_indptr[r + 1]:
            out[pos] = _SP  # an empty point is a lone space: an empty line would be malformed
            pos += 1
        for p in range(y_indptr[r], y_indptr[r + 1]):
            if p > y_indptr[r]:
                out[pos] = _COMMA
                pos += 1
            pos = _put_int(out, pos, y_indices[p])
        for p in range(x_indptr[r], x_indptr[r + 1]):
            out[pos] = _SP
            pos += 1
            pos = _put_int(out, pos, x_indices[p])
            out[pos] = _COLON
            pos += 1
            v = x_values[p]
            if v < 0:
                out[pos] = 45
                pos += 1
                v = -v
            q = int(v * scale + 0.5)
            pos = _put_int(out, pos, q // scale)
            out[pos] = _DOT
            pos += 1
            frac = q % scale
            d = scale // 10
            while d > 0:
                out[pos] = 48 + (frac // d) % 10
                pos += 1
                d //= 10
        out[pos] = _NL
        pos += 1
    return pos


def format_xc(data: XCData, decimals: int = 6) -> bytes:
    """The XC text of ``data`` (header included); values are written with ``decimals`` decimal places."""
    header = f"{len(data)} {data.n_features} {data.n_labels}\n".encode()
    # bound: each entry needs its digits, a separator and the value's digits
    per_x = len(str(max(data.n_features, 1))) + 3 + decimals + 12
    per_y = len(str(max(data.n_labels, 1))) + 1
    size = len(data.x_indices) * per_x + len(data.y_indices) * per_y + len(data) + 16
    out = np.empty(size, np.uint8)
    vals = data.x_values.astype(np.float64)
    if len(vals) and np.abs(vals).max() * 10**decimals >= 2**62:
        raise ValueError("feature values too large for the fixed-point writer")
    used = _format_body(data.x_indptr, data.x_indices, vals, data.y_indptr, data.y_indices, decimals, out)
    return header + out[:used].tobytes()


def write_xc(path: str | os.PathLike[str], data: XCData, decimals: int = 6) -> None:
    """Write ``data`` to ``path`` atomically."""
    from sampler.atomic import atomic_write

    atomic_write(path, format_xc(data, decimals), mode=0o644)
