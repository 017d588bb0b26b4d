"""The packages' layering: no import circle inside ``tierfs`` (TYPE_CHECKING imports included), ``sampler``
imports nothing of ours nor trio/pyfuse3/mpi4py, ``dslide`` never imports the FUSE binding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(package: str) -> dict[str, set[str]]:
    """module -> the modules it imports (absolute or relative), for every module of ``package``."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        mod = f"{package}.{path.stem}"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = f"{package}.{base}" if base else package
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
        graph[mod] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    edges = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("package", ["tierfs", "sampler", "dslide"])
def test_no_import_circle(package):
    assert _cycle(_imports(package)) is None


def test_sampler_is_pure():
    for mod, deps in _imports("sampler").items():
        bad = {d for d in deps if d.split(".")[0] in ("tierfs", "dslide", "trio", "pyfuse3", "mpi4py")}
        assert not bad, (mod, bad)


def test_dslide_imports_of_tierfs_only_its_control_client():
    # (atomic writes come from sampler.atomic; the mount is reached through tierfs.client, no FUSE binding)
    for mod, deps in _imports("dslide").items():
        tierfs = {d for d in deps if d.split(".")[0] in ("tierfs", "pyfuse3")}
        assert tierfs <= {"tierfs.client", "tierfs.client.Client", "tierfs.client.NotAMount"}, (mod, tierfs)


def test_the_cache_policy_is_asked_never_compared():
    # (issue 12) one object per policy (tierfs/policy.py) is chosen at mount; nothing else branches on the
    # setting's name or on an ``lru`` flag -- options.py validates it, stats.py shows it
    for path in sorted((ROOT / "tierfs").glob("*.py")):
        if path.name in ("options.py", "policy.py", "stats.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr != "lru", f"{path.name}:{node.lineno}: .lru"
            if isinstance(node, ast.Compare):
                names = [n.attr for n in (node.left, *node.comparators) if isinstance(n, ast.Attribute)]
                assert "policy" not in names, f"{path.name}:{node.lineno}: the policy setting compared"
