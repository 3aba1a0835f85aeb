"""The package's layering, read statically from the source (``ast``; nothing is imported).

Layers (docs/design/architecture.md): ``model`` at the bottom; ``pallas`` above it (its kernels import
the references they must equal); ``parallel`` above ``model``; ``serving`` on top. Checked:

* no cycle among ``model``, ``parallel``, ``pallas`` and ``serving`` (every import counts, lazy ones too,
  except the one seam below);
* ``model`` never imports ``parallel`` or ``serving``; ``parallel`` and ``pallas`` never import ``serving``;
* ``model`` imports ``pallas`` only lazily: inside a function body (the dispatch registry imports the
  ``dsv41_jax.pallas`` package, whose kernel modules register themselves, when a kernel is first resolved). An import is *lazy* when the nearest enclosing definition of the
  statement is a ``def`` / ``async def`` (or a lambda); one at module level — including under ``if`` /
  ``try`` there — or in a class body runs when the module is imported. ``importlib.import_module`` calls
  whose argument starts with a constant package name are imports too (f-strings included).
"""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "dsv41_jax"
LAYERS = ("model", "parallel", "pallas", "serving")


def _target(mod: str):
    """The first-level subpackage of `dsv41_jax` that dotted module `mod` names, or None."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "dsv41_jax" else None


def _importlib_target(call: ast.Call):
    """The module a ``importlib.import_module(...)`` call names (constant prefix of a str / f-string)."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and f.attr == "import_module" and call.args):
        return None
    a = call.args[0]
    if isinstance(a, ast.Constant) and isinstance(a.value, str):
        return a.value
    if isinstance(a, ast.JoinedStr) and a.values and isinstance(a.values[0], ast.Constant):
        return a.values[0].value
    return None


def imports(path: pathlib.Path):
    """[(target subpackage, lazy, line)] of every dsv41_jax import in one file."""
    out = []

    def visit(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ClassDef):
                inner = lazy  # a class body runs at import time
            mods = []
            if isinstance(child, ast.Import):
                mods = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                mods = ([f"dsv41_jax.{a.name}" for a in child.names] if child.module == "dsv41_jax"
                        else [child.module])
            elif isinstance(child, ast.Call):
                m = _importlib_target(child)
                mods = [m] if m else []
            for m in mods:
                t = _target(m)
                if t is not None:
                    out.append((t, lazy, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def graph():
    """{(from subpackage, to subpackage): [(file, line, lazy)]} over the layers."""
    edges: dict = {}
    for layer in LAYERS:
        for f in sorted((PKG / layer).rglob("*.py")):
            for t, lazy, line in imports(f):
                if t != layer and t in LAYERS:
                    edges.setdefault((layer, t), []).append((f.relative_to(PKG.parent).as_posix(), line, lazy))
    return edges


def _cycle(edges):
    """A cycle in the subpackage graph as a list of names, or None."""
    nodes = sorted({a for a, _ in edges} | {b for _, b in edges})
    color = {n: 0 for n in nodes}
    stack: list = []

    def dfs(n):
        color[n] = 1
        stack.append(n)
        for a, b in edges:
            if a == n:
                if color[b] == 1:
                    return stack[stack.index(b):] + [b]
                if color[b] == 0:
                    c = dfs(b)
                    if c:
                        return c
        stack.pop()
        color[n] = 2
        return None

    for n in nodes:
        if color[n] == 0:
            c = dfs(n)
            if c:
                return c
    return None


def test_layers_import_one_way():
    edges = graph()
    for src, forbidden in (("model", "parallel"), ("model", "serving"), ("parallel", "serving"),
                           ("pallas", "serving")):
        assert (src, forbidden) not in edges, f"{src}/ imports {forbidden}/: {edges[(src, forbidden)]}"
    eager = [e for e in edges.get(("model", "pallas"), []) if not e[2]]
    assert not eager, f"model/ imports pallas/ at module import time: {eager}"
    seam = {k: v for k, v in edges.items() if k != ("model", "pallas")}  # the lazy dispatch seam
    assert _cycle(seam) is None, f"import cycle: {' -> '.join(_cycle(seam))}"
    # the expected directions exist, so the scan itself works
    assert ("parallel", "model") in edges and ("pallas", "model") in edges and ("serving", "model") in edges
    assert edges[("model", "pallas")] and all(lazy for _, _, lazy in edges[("model", "pallas")])


def test_scanner_tells_lazy_from_import_time(tmp_path):
    """The classification on a file written for it: module level, under try, in a class body (import
    time) vs inside a function or method (lazy), importlib with an f-string."""
    src = tmp_path / "m.py"
    src.write_text(
        "import dsv41_jax.serving\n"
        "try:\n    from dsv41_jax.parallel import rules\nexcept ImportError:\n    pass\n"
        "class C:\n    from dsv41_jax import pallas\n    def f(self):\n        import dsv41_jax.model.quant\n"
        "def g(name):\n    import importlib\n    return importlib.import_module(f'dsv41_jax.pallas.{name}')\n"
        "h = lambda: __import__('os')\n")
    got = sorted((t, lazy) for t, lazy, _ in imports(src))
    assert got == [("model", True), ("pallas", False), ("pallas", True), ("parallel", False), ("serving", False)]
    assert _cycle({("a", "b"): [], ("b", "c"): [], ("c", "a"): []}) == ["a", "b", "c", "a"]
    assert _cycle({("a", "b"): [], ("b", "c"): []}) is None
