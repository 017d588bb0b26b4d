"""Every relative link in the README and docs leads somewhere, and every unit's Documentation= page exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tierfs.install import _DOCS, Layout

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/*.md")])
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _prose(path: Path) -> str:
    """The page without fenced code blocks and inline code (links there are examples, not links)."""
    text = _FENCE.sub("", path.read_text())
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, blanks as dashes."""
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
            out.add(slug.replace(" ", "-"))
    return out


def _relative_links(path: Path) -> list[str]:
    links = [a or b for a, b in _LINK.findall(_prose(path))]
    return [t for t in links if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, mailto:, file: ...


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_checker_sees_links_and_would_catch_a_broken_one(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](b.md) [c](#two) ![i](img.png) [web](https://x.org/y) `[no](code.md)`\n# One\n## Two (`x.y`)\n")
    assert _relative_links(page) == ["b.md", "#two", "img.png"]
    assert _anchors(page) == {"one", "two-xy"}


def _documentation_targets() -> list[tuple[str, str]]:
    out = []
    for unit in sorted((ROOT / "systemd").iterdir()):
        for line in unit.read_text().splitlines():
            if line.startswith("Documentation="):
                out += [(unit.name, uri) for uri in line.split("=", 1)[1].split()]
    return out


def test_every_unit_names_documentation_that_exists():
    targets = _documentation_targets()
    assert {unit for unit, _ in targets} >= {"tierfs@.service", "tierfs-train@.service", "mnt-imagenet.mount"}
    doc_dir = Layout().doc_dir  # where `tierfs install` copies docs/*.md
    for unit, uri in targets:
        assert uri.startswith(f"file:{doc_dir}/"), f"{unit}: {uri} is not a page tierfs install puts in {doc_dir}"
        page = uri.removeprefix(f"file:{doc_dir}/")
        assert (ROOT / "docs" / page).is_file(), f"{unit}: Documentation={uri} names docs/{page}, which is missing"
        assert page in _DOCS, f"{unit}: tierfs install does not copy docs/{page}"
