"""The packages' layering: no import circle inside ``tierfs`` (TYPE_CHECKING imports included), ``sampler``
imports nothing of ours nor trio/pyfuse3/mpi4py, ``dslide`` never imports the FUSE binding, and the client side
of ``tierfs`` (what a training job imports) stands on the protocol and the options alone."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _imports(package: str) -> dict[str, set[str]]:
    """module -> the modules it imports (absolute or relative), for every module of ``package`` and its
    sub-packages."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        mod = _module_name(path)
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]  # what a relative import starts from
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    start = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{start}.{base}" if base else start
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
        graph[mod] = found
    return graph


def _ours(deps: set[str]) -> set[str]:
    """The modules of ``tierfs`` among ``deps`` (``from tierfs.x import Name`` counts as ``tierfs.x``)."""
    modules = set(_imports("tierfs"))
    return {d for d in deps if d in modules} | {d.rpartition(".")[0] for d in deps
                                                if d not in modules and d.rpartition(".")[0] in modules}


#: The client side: the package, and the short names users import (faces re-exporting its modules).
CLIENT_FACES = {"tierfs.direct": "tierfs.client.direct", "tierfs.loaders": "tierfs.client.loaders",
                "tierfs.torch": "tierfs.client.torch"}
#: What both sides may import: the protocol and the option table it parses with.
SHARED = {"tierfs.protocol", "tierfs.options"}
#: Modules that use both sides: the command line (it mounts, and it is a client of a mount) and the test helper.
BOTH = {"tierfs", "tierfs.__main__", "tierfs.cli", "tierfs.testing"}


def _client_side(mod: str) -> bool:
    return mod == "tierfs.client" or mod.startswith("tierfs.client.") or mod in CLIENT_FACES


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


def test_the_client_imports_only_the_protocol_and_the_options():
    graph = _imports("tierfs")
    client = sorted(m for m in graph if _client_side(m))
    assert {"tierfs.client", "tierfs.client.direct", "tierfs.client.loaders", "tierfs.client.torch"} <= set(client)
    for mod in client:
        bad = {d for d in _ours(graph[mod]) if not _client_side(d) and d not in SHARED and d != "tierfs"}
        assert not bad, (mod, bad)
        assert not {d for d in graph[mod] if d.split(".")[0] in ("trio", "pyfuse3", "xxhash")}, mod
    for face, module in CLIENT_FACES.items():
        assert _ours(graph[face]) == {module}, face  # a face re-exports, nothing more
    # the protocol is daemon-free too: it stands on the option table alone
    assert _ours(graph["tierfs.protocol"]) == {"tierfs.options"}


def test_the_daemon_never_imports_the_client():
    graph = _imports("tierfs")
    for mod, deps in graph.items():
        if not _client_side(mod) and mod not in BOTH:
            assert not {d for d in _ours(deps) if _client_side(d)}, mod


def test_each_face_is_its_client_module():
    import importlib

    for face, module in CLIENT_FACES.items():
        if face == "tierfs.torch":
            pytest.importorskip("torch")
        f, m = importlib.import_module(face), importlib.import_module(module)
        assert f.__all__ == m.__all__ and all(getattr(f, n) is getattr(m, n) for n in m.__all__), face


def _loaded_by(imports: str) -> list[str]:
    """The modules a fresh interpreter holds after ``import`` of ``imports``: what a training job's import loads."""
    code = f"import sys, {imports}; print('\\n'.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


def test_importing_the_client_pulls_neither_trio_pyfuse3_xxhash_nor_a_daemon_module():
    # (tierfs.torch is checked by the AST test above: its torch import is too slow for a unit test)
    loaded = _loaded_by("tierfs.client, tierfs.client.direct, tierfs.client.loaders, tierfs.direct, tierfs.loaders")
    assert not [m for m in loaded if m.split(".")[0] in ("trio", "pyfuse3", "xxhash", "prometheus_client")]
    ours = [m for m in loaded if m.split(".")[0] == "tierfs"]
    assert {m for m in ours if not _client_side(m)} <= SHARED | {"tierfs"}, ours
    # the control client and direct reads load not even numpy (``tierfs status``, dslide's feedback writer)
    assert not [m for m in _loaded_by("tierfs.client, tierfs.direct") if m.split(".")[0] in ("sampler", "numpy")]


def test_dslide_imports_of_tierfs_only_its_control_client():
    # (and the progress line every training job shows, and the one version of the distribution -- the package's
    # __init__ imports nothing; atomic writes come from sampler.atomic; the mount is reached through
    # tierfs.client, no FUSE binding)
    for mod, deps in _imports("dslide").items():
        tierfs = {d for d in deps if d.split(".")[0] in ("tierfs", "pyfuse3")}
        assert tierfs <= {"tierfs", "tierfs.__version__", "tierfs.client", "tierfs.client.Client",
                          "tierfs.client.NotAMount", "tierfs.client.progress", "tierfs.client.progress.PassProgress"}, (
            mod, tierfs)


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


#: what runs inside a user's training job, and the tools around the daemon: a callable there is the user's own
_NOT_DAEMON = {"cli", "client", "direct", "loaders", "testing", "torch"}


def _is_callable(ann: ast.expr) -> bool:
    """Whether an annotation is a callable (``Callable[...]``, ``Awaitable``-returning or not, or ``X | None``
    of one)."""
    if isinstance(ann, ast.BinOp):
        return _is_callable(ann.left) or _is_callable(ann.right)
    if isinstance(ann, ast.Subscript):
        ann = ann.value
    return isinstance(ann, ast.Name | ast.Attribute) and (getattr(ann, "id", None) or ann.attr) == "Callable"


def test_no_part_takes_a_callable():
    # (issue 25) a part that needs another part gets that part, or reports through a typed events Protocol the
    # engine implements: a reader following a call never hits a lambda.  So no daemon class's constructor takes
    # a callable, none is made with a lambda or a bound method of its maker, and the engine holds no lambda.
    found = []
    for path in sorted((ROOT / "tierfs").glob("*.py")):
        if path.stem in _NOT_DAEMON:
            continue
        tree = ast.parse(path.read_text())
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                       and not any(getattr(d, "id", None) == "property" for d in f.decorator_list)}
            for f in cls.body:
                if not isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                if f.name == "__init__":
                    a = f.args
                    found += [f"{path.name}:{f.lineno}: {cls.name}({p.arg}: Callable)"
                              for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                              if p.annotation is not None and _is_callable(p.annotation)]
                    found += [f"{path.name}:{d.lineno}: {cls.name}.__init__ defaults to a lambda"
                              for d in (*a.defaults, *a.kw_defaults) if isinstance(d, ast.Lambda)]
                # a part made with a lambda or one of its maker's own methods
                for call in (c for c in ast.walk(f) if isinstance(c, ast.Call)):
                    name = getattr(call.func, "id", getattr(call.func, "attr", ""))
                    if not name[:1].isupper() or name not in classes | _imported_classes(tree):
                        continue
                    for arg in (*call.args, *(k.value for k in call.keywords)):
                        bound = (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)
                                 and arg.value.id == "self" and arg.attr in methods)
                        if isinstance(arg, ast.Lambda) or bound:
                            found.append(f"{path.name}:{call.lineno}: {name}(...) given a callable")
        if path.stem == "engine":
            found += [f"engine.py:{n.lineno}: lambda" for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
    assert not found, "\n".join(found)


def _imported_classes(tree: ast.Module) -> set[str]:
    """The capitalised names a module imports from ``tierfs`` (the parts it may make)."""
    return {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(
        "tierfs") for a in n.names if a.name[:1].isupper()}


def _about_fingerprints(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        return getattr(node.func, "id", getattr(node.func, "attr", "")) in ("fingerprint", "fingerprint_of",
                                                                             "fingerprints")
    return isinstance(node, ast.Attribute) and node.attr == "fp"


def test_fingerprints_are_compared_in_one_place():
    # (issue 25) "is this still our backing file" is decided once: a copy's fingerprint against the tree's by
    # Tree.holds (holds_many: a plan's copies, the cache index's at mount), a backing answer by
    # Revalidator.verdict (which asks Tree.holds); the copier's own check that
    # the file did not change while it read it (in its worker thread, against what it was asked to copy) is the
    # one other comparison
    found = []
    for path in sorted((ROOT / "tierfs").glob("*.py")):
        if path.stem in _NOT_DAEMON | {"tree", "copier"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(map(_about_fingerprints, (node.left, *node.comparators))):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def test_the_engine_implements_every_parts_events_as_declared():
    # (the events Protocols are the parts' typed interface upward; nothing type-checks them at run time, so
    # here: every method of each, with the same parameters, async where declared so)
    import importlib
    import inspect

    from tierfs.engine import Engine

    checked = 0
    for path in sorted((ROOT / "tierfs").glob("*.py")):
        if path.stem in _NOT_DAEMON or path.stem == "__main__":
            continue
        mod = importlib.import_module(f"tierfs.{path.stem}")
        for name, proto in vars(mod).items():
            if not (name.endswith("Events") and getattr(proto, "_is_protocol", False)
                    and proto.__module__ == mod.__name__):
                continue
            for meth, declared in vars(proto).items():
                if meth.startswith("_") or not inspect.isfunction(declared):
                    continue
                mine = getattr(Engine, meth, None)
                assert mine is not None, f"Engine lacks {name}.{meth}"
                assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(declared), (name, meth)
                want = list(inspect.signature(declared).parameters.values())
                got = list(inspect.signature(mine).parameters.values())
                # (the same names and kinds; a default the engine adds is no harm, one declared must be kept)
                assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want], (name, meth)
                assert all(w.default in (inspect.Parameter.empty, g.default) for g, w in zip(got, want, strict=True))
                checked += 1
    assert checked >= 15  # (the stager's, data path's, revalidator's, pusher's, namespace's, planner's, rescan's)
