"""The packages' layering.  The import rules -- tierfs's folders top to bottom, no import circle, the client side
daemon-free, ``sampler`` pure, ``dslide`` on the control client alone -- are import-linter contracts in
pyproject.toml, which ``scripts/test.sh`` checks (``lint-imports``).  Here: that they hold and fail on a planted
violation, what a training job's import loads at run time, and the rules of the daemon's code an import graph
cannot see (no callables handed to parts, the policy asked, fingerprints compared in one place).  That the engine
implements each part's events Protocol is the type check's to say (tests/unit/test_types.py)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAEMON = ROOT / "tierfs" / "daemon"

#: The short names users import: each re-exports its client module
CLIENT_FACES = {"tierfs.direct": "tierfs.client.direct", "tierfs.loaders": "tierfs.client.loaders",
                "tierfs.torch": "tierfs.client.torch"}


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the packages found in ``root`` (its pyproject.toml's contracts)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout and "7 kept" in run.stdout, run.stdout


@pytest.mark.parametrize(("module", "planted"), [
    # an upward import inside the daemon: a cache-dir module importing the coordinator (under TYPE_CHECKING too)
    ("tierfs/daemon/cache/index.py", "if TYPE_CHECKING:\n    from tierfs.daemon.coordinator.engine import Engine\n"),
    # the client side importing a daemon part
    ("tierfs/client/direct.py", "from tierfs.daemon.runtime import threads\n"),
    # a circle inside one folder
    ("tierfs/daemon/tree/tree.py", "from tierfs.daemon.tree import keeper\n"),
    # sampler importing trio
    ("sampler/plan.py", "import trio\n"),
])
def test_a_planted_violation_breaks_a_contract(tmp_path, module, planted):
    for name in ("tierfs", "sampler", "dslide"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    path = tmp_path / module
    text = path.read_text()
    if "TYPE_CHECKING" in planted and "import TYPE_CHECKING" not in text:
        planted = "from typing import TYPE_CHECKING\n" + planted
    path.write_text(text + "\n" + planted)
    run = _lint_imports(tmp_path)
    assert run.returncode != 0 and " broken." in run.stdout and " 0 broken" not in run.stdout, run.stdout + run.stderr
    assert Path(module).stem in run.stdout.split("Broken contracts")[1], run.stdout  # (named where it broke)


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
    # (run time: what the contracts say of imports, seen in sys.modules; tierfs.torch's import of torch is too
    # slow for a unit test)
    loaded = _loaded_by("tierfs.client, tierfs.client.direct, tierfs.client.loaders, tierfs.direct, tierfs.loaders")
    assert not [m for m in loaded if m.split(".")[0] in ("trio", "pyfuse3", "xxhash", "prometheus_client")]
    ours = {m for m in loaded if m.split(".")[0] == "tierfs"}
    assert ours - {"tierfs", "tierfs.direct", "tierfs.loaders"} <= {
        "tierfs.common", "tierfs.common.protocol", "tierfs.common.options", "tierfs.client", "tierfs.client.direct",
        "tierfs.client.loaders"}, ours
    # the control client and direct reads load not even numpy (``tierfs status``, dslide's feedback writer)
    assert not [m for m in _loaded_by("tierfs.client, tierfs.direct") if m.split(".")[0] in ("sampler", "numpy")]


def _daemon_modules() -> list[Path]:
    return sorted(DAEMON.rglob("*.py"))


def test_the_cache_policy_is_asked_never_compared():
    # (issue 12) one object per policy (tierfs/daemon/schedule/policy.py) is chosen at mount; nothing else branches on
    # the setting's name or on an ``lru`` flag -- options.py validates it, status.py shows it
    for path in _daemon_modules():
        if path.name in ("policy.py", "status.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr != "lru", f"{path.name}:{node.lineno}: .lru"
            if isinstance(node, ast.Compare):
                names = [n.attr for n in (node.left, *node.comparators) if isinstance(n, ast.Attribute)]
                assert "policy" not in names, f"{path.name}:{node.lineno}: the policy setting compared"


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
    for path in _daemon_modules():
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
    for path in _daemon_modules():
        if path.stem in ("tree", "copier"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(map(_about_fingerprints, (node.left, *node.comparators))):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
