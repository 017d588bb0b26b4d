"""Real extreme-classification data from a Debian package index: predict a package's dependencies from what it is.

A point is one binary package of a ``Packages`` index (deb822 stanzas, as ``apt-cache dumpavail`` prints them or
as ``/var/lib/apt/lists/*_Packages`` hold them); its features are the tokens of its name, section, debtags and
one-line description (tf-idf, rows of unit norm, as dslide's inputs); its labels are the packages named in its
``Depends`` and ``Pre-Depends`` (version constraints dropped, every alternative of ``a | b`` counted).  Nobody
here generated it: it is the dependency graph the distribution's maintainers wrote, with the long tail of
labels extreme classification is about (libc6 is a label of most points, most labels of a handful).

Tokens and labels seen fewer than ``--min-count`` times are dropped, then points left without a token or a
label.  The test set is the packages whose name hashes into the last ``--test-share`` (stable across runs and
machines; every version of a name lands on the same side, and only the first stanza of a name is kept).

    apt-cache dumpavail > /tmp/Packages      # Debian 12: 63,666 stanzas after apt-get update
    .venv/bin/python benchmarks/xc_from_debian.py /tmp/Packages /tmp/debian-xc
    .venv/bin/python benchmarks/xc_from_debian.py - /tmp/debian-xc < /tmp/Packages

Writes ``OUT/train.txt`` and ``OUT/test.txt`` (XC format) and ``OUT/labels.txt`` (label id -> package name).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dslide.data import XCData, write_xc  # noqa: E402

_WORD = re.compile(r"[a-z][a-z0-9]+")
_DEP_NAME = re.compile(r"^\s*([a-z0-9][a-z0-9+.\-]*)")


def stanzas(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """The deb822 stanzas of ``lines``: field name -> value (continuation lines joined with a space)."""
    cur: dict[str, str] = {}
    last = None
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if cur:
                yield cur
            cur, last = {}, None
        elif line[0] in " \t":
            if last is not None:
                cur[last] += " " + line.strip()
        elif ":" in line:
            last, _, value = line.partition(":")
            cur[last] = value.strip()
    if cur:
        yield cur


def dependencies(stanza: dict[str, str]) -> list[str]:
    """Package names in Depends and Pre-Depends, without versions or architecture qualifiers, each once."""
    out: dict[str, None] = {}
    for field in ("Pre-Depends", "Depends"):
        for alt in re.split(r"[,|]", stanza.get(field, "")):
            m = _DEP_NAME.match(alt)
            if m:
                out[m.group(1)] = None
    return list(out)


def tokens(stanza: dict[str, str]) -> list[str]:
    """What the package is: words of its name, ``section:`` and ``tag:`` tokens, words of its description."""
    name = stanza.get("Package", "")
    out = ["name:" + w for w in _WORD.findall(name.lower())]
    if "Section" in stanza:
        out.append("section:" + stanza["Section"].rsplit("/", 1)[-1])
    out += ["tag:" + t.strip() for t in stanza.get("Tag", "").split(",") if t.strip()]
    out += _WORD.findall(stanza.get("Description", "").lower())
    return out


def is_test(name: str, test_share: float) -> bool:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 >= 1 - test_share


def build(
    stanza_iter: Iterable[dict[str, str]], min_count: int = 2, test_share: float = 0.25
) -> tuple[XCData, XCData, list[str]]:
    """(train, test, label names) from the stanzas; see the module docstring for the rules."""
    if min_count < 1 or not 0 < test_share < 1:
        raise ValueError(f"need min_count >= 1 and 0 < test_share < 1, got {min_count}, {test_share}")
    points: dict[str, tuple[list[str], list[str]]] = {}
    for st in stanza_iter:
        name = st.get("Package")
        if name and name not in points:
            points[name] = (tokens(st), dependencies(st))
    tok_n = Counter(t for toks, _ in points.values() for t in set(toks))
    lab_n = Counter(d for _, deps in points.values() for d in deps)
    vocab = {t: i for i, t in enumerate(sorted(t for t, n in tok_n.items() if n >= min_count))}
    labels = sorted(d for d, n in lab_n.items() if n >= min_count)
    label_id = {d: i for i, d in enumerate(labels)}
    n_docs = len(points)
    idf = {t: np.log((1 + n_docs) / (1 + tok_n[t])) + 1 for t in vocab}
    sides: dict[bool, list[tuple[dict[int, float], list[int]]]] = {False: [], True: []}
    for name in sorted(points):
        toks, deps = points[name]
        tf = Counter(t for t in toks if t in vocab)
        ys = sorted({label_id[d] for d in deps if d in label_id})
        if not tf or not ys:
            continue
        x = {vocab[t]: c * idf[t] for t, c in tf.items()}
        norm = float(np.sqrt(sum(v * v for v in x.values())))
        sides[is_test(name, test_share)].append(({i: v / norm for i, v in sorted(x.items())}, ys))
    train, test = (_to_xc(sides[s], len(vocab), len(labels)) for s in (False, True))
    return train, test, labels


def _to_xc(rows: list[tuple[dict[int, float], list[int]]], n_features: int, n_labels: int) -> XCData:
    x_indptr = np.zeros(len(rows) + 1, np.int64)
    y_indptr = np.zeros(len(rows) + 1, np.int64)
    x_indptr[1:] = np.cumsum([len(x) for x, _ in rows])
    y_indptr[1:] = np.cumsum([len(y) for _, y in rows])
    x_indices = np.fromiter((i for x, _ in rows for i in x), np.int32, int(x_indptr[-1]))
    x_values = np.fromiter((v for x, _ in rows for v in x.values()), np.float32, int(x_indptr[-1]))
    y_indices = np.fromiter((j for _, y in rows for j in y), np.int32, int(y_indptr[-1]))
    return XCData(n_features, n_labels, x_indptr, x_indices, x_values, y_indptr, y_indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("packages", help="a Packages index (deb822 text), - for stdin")
    ap.add_argument("out", help="directory for train.txt, test.txt, labels.txt")
    ap.add_argument("--min-count", type=int, default=2, help="drop tokens and labels seen fewer times")
    ap.add_argument(
        "--test-share", type=float, default=0.25, help="share of packages in the test set (Amazon-670K: 24 %%)"
    )
    a = ap.parse_args()
    if a.packages == "-":
        train, test, labels = build(stanzas(sys.stdin), a.min_count, a.test_share)
    else:
        with open(a.packages, encoding="utf-8", errors="replace") as f:
            train, test, labels = build(stanzas(f), a.min_count, a.test_share)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_xc(out / "train.txt", train)
    write_xc(out / "test.txt", test)
    (out / "labels.txt").write_text("".join(f"{i} {name}\n" for i, name in enumerate(labels)))
    lpp = np.diff(train.y_indptr).mean() if len(train) else 0.0
    print(f"{len(train):,} train / {len(test):,} test points, {train.n_features:,} features, "
          f"{train.n_labels:,} labels, {lpp:.1f} labels per point -> {out}")  # fmt: skip


if __name__ == "__main__":
    main()
