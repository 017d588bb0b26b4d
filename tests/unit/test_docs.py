"""Every relative link in the README and docs leads somewhere, every unit's Documentation= page exists, every doc
page is linked from the README, and the reference pages list what the code has (modules, status fields, metrics)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from tierfs.cli.install import _DOCS, Layout

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


def _linked_pages(page: Path) -> set[Path]:
    """The files the relative links of ``page`` lead to (anchors dropped)."""
    return {(page.parent / t.partition("#")[0]).resolve() for t in _relative_links(page) if t.partition("#")[0]}


def test_every_doc_page_is_linked_from_the_readme():
    linked = _linked_pages(ROOT / "README.md")
    missing = [p.name for p in sorted(ROOT.glob("docs/*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md's Documentation section does not link docs/{missing}"


def _table_column(path: Path, heading: str) -> list[str]:
    """The first column's code spans (`x`) of the table rows in the section ``## heading`` of ``path``."""
    section = _FENCE.sub("", path.read_text()).split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        m = re.match(r"\|\s*([^|]*?)\s*\|", line)
        if m and not set(m.group(1)) <= set("-: "):
            out += re.findall(r"`([^`]+)`", m.group(1))
    return out


def _package_entries(root: Path = ROOT, packages: tuple[str, ...] = ("tierfs", "sampler")) -> list[str]:
    """Every folder and module of the packages the module map covers, from the filesystem (a folder or module moved
    or added shows): each folder that holds a module, as ``tierfs/daemon/cache/`` -- its row in the map stands for
    its ``__init__.py``, empty or not (``tierfs/client/``'s holds the client) -- and every other ``.py`` file."""
    out = set()
    for pkg in packages:
        for p in (root / pkg).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            out.add(f"{p.parent.relative_to(root)}/")
            if p.name != "__init__.py":
                out.add(str(p.relative_to(root)))
    return sorted(out)


def test_the_module_map_lists_exactly_the_modules_of_the_packages():
    """docs/architecture.md's module map is the folder tree: a row per folder of tierfs and sampler (standing for
    the folder's ``__init__.py``) and a row per module, no more, no fewer."""
    listed = _table_column(ROOT / "docs/architecture.md", "Modules")
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    entries = _package_entries()
    assert {"tierfs/", "tierfs/daemon/cache/", "tierfs/daemon/coordinator/engine.py", "sampler/plan.py"} <= set(entries)
    assert sorted(listed) == entries, (f"docs/architecture.md's module map lacks {sorted(set(entries) - set(listed))}"
                                       f" and names folders or modules that do not exist: "
                                       f"{sorted(set(listed) - set(entries))}")


def test_the_package_walk_sees_folders_and_modules_not_caches(tmp_path):
    for path in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py", "pkg/sub/__pycache__/b.py",
                 "pkg/gone/__pycache__/old.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert _package_entries(tmp_path, ("pkg",)) == ["pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/b.py"]


def test_the_table_readers_see_what_they_should(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# P\n[a](a.md) [b](b.md#x)\n## Modules\n\n| module | what |\n|---|---|\n| `m/a.py` | `x` |\n"
                    "| `m/b.py`, `m/c.py` | y |\n```\n| `m/fenced.py` | no |\n```\n## Next\n| `m/d.py` | no |\n")
    assert _table_column(page, "Modules") == ["m/a.py", "m/b.py", "m/c.py"]
    assert _linked_pages(page) == {tmp_path / "a.md", tmp_path / "b.md"}


def _status_paths(cls: type, prefix: str = "") -> set[str]:
    """Every field of the status object as the JSON names it (``pass_`` is ``pass``), sections dotted, the items
    of a tuple of snapshots as ``name[].field``."""
    out = set()
    for f in dataclasses.fields(cls):
        name, hint = prefix + ("pass" if f.name == "pass_" else f.name), typing.get_type_hints(cls)[f.name]
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is tuple and typing.get_args(hint) else None
        if dataclasses.is_dataclass(hint):
            out |= _status_paths(hint, name + ".")
        elif item is not None and dataclasses.is_dataclass(item):
            out |= _status_paths(item, name + "[].")
        else:
            out.add(name)
    return out


def test_the_status_reference_lists_every_field_and_metric():
    from tierfs.daemon.coordinator.status import METRICS, Status

    documented = set(_table_column(ROOT / "docs/status.md", "Status fields"))
    fields = _status_paths(Status)
    assert "staging.stuck" in fields and "consumers.consumers[].name" in fields
    assert documented == fields, (f"docs/status.md lacks {sorted(fields - documented)} and documents fields that "
                                  f"do not exist: {sorted(documented - fields)}")
    metrics = {f"tierfs_{m.name}" for m in METRICS}
    in_table = set(_table_column(ROOT / "docs/status.md", "Metrics"))
    documented = {m for m in in_table if m.startswith("tierfs_")}
    assert documented == metrics, (f"docs/status.md lacks the metrics {sorted(metrics - documented)} and lists "
                                   f"metrics that do not exist: {sorted(documented - metrics)}")
