"""How the model reaches its kernels, read statically from the source (``ast``; nothing is imported):

* no ``importlib`` in ``model/`` (the kernels are found in `dispatch`'s registry, filled when the
  ``dsv41_jax.pallas`` package is imported);
* "does this implementation run a kernel" is asked in one place: no membership test against a literal
  holding "pallas" / "pallas_interpret" in ``model/`` or ``pallas/`` outside ``model/dispatch.py``
  (the call sites use `dispatch.is_kernel`);
* no kernel module reaches another ``pallas`` module's private (underscore) names: what two kernels
  share lives in ``pallas/common.py``;
* the FP8 / E8M0 dtype constants are defined once (``model/codec.py``), and so is the fp8 activation
  quantization (`codec.fp8_act_codes`): no other function divides an amax by E4M3_MAX to take its
  ceil-log2, and no kernel builds e8m0 bytes by hand (``e + 127``);
* the benchmark inputs and bytes-moved contracts live in ``pallas/costs.py``: no kernel module defines a
  ``*_bench_inputs`` / ``*_bytes_moved`` / ``*_call_geometry`` function, and a kernel's
  ``pl.CostEstimate(bytes_accessed=...)`` is a `costs` contract, not a formula of its own.
"""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "dsv41_jax"
KERNEL_IMPL_NAMES = {"pallas", "pallas_interpret"}


def _files(*subpackages):
    return sorted(p for sub in subpackages for p in (PKG / sub).rglob("*.py"))


def _rel(path) -> str:
    return str(path.relative_to(PKG.parent))


def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _literal_strings(node) -> set:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_no_importlib_in_model():
    found = []
    for path in _files("model"):
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.split(".")[0] == "importlib" for n in names):
                found.append(f"{_rel(path)}:{node.lineno}")
            if isinstance(node, ast.Name) and node.id in ("__import__", "importlib"):
                found.append(f"{_rel(path)}:{node.lineno}")
    assert not found, f"importlib / __import__ in model/: {found}"


def test_kernel_impl_membership_only_in_dispatch():
    """`x in ("pallas", "pallas_interpret")` (or any literal holding one of them) is asked in dispatch only."""
    found = []
    for path in _files("model", "pallas"):
        if path == PKG / "model" / "dispatch.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                if any(_literal_strings(c) & KERNEL_IMPL_NAMES for c in node.comparators):
                    found.append(f"{_rel(path)}:{node.lineno}")
    assert not found, f"kernel-impl membership tests outside model/dispatch.py (use dispatch.is_kernel): {found}"


def _from_module(node) -> str:
    """The absolute module of a ``from ... import`` inside ``dsv41_jax/pallas/`` (``from .x`` is ``dsv41_jax.pallas.x``)."""
    if not node.level:
        return node.module or ""
    base = ["dsv41_jax", "pallas"][:max(0, 3 - node.level)]  # a kernel module's package is dsv41_jax.pallas
    return ".".join(base + ([node.module] if node.module else []))


def _pallas_aliases(tree) -> dict:
    """{local name: module} for every ``dsv41_jax.pallas`` module a file imports (module-level or lazy)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _from_module(node) == "dsv41_jax.pallas":
            for a in node.names:
                out[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv41_jax.pallas.") and a.asname:
                    out[a.asname] = a.name.rsplit(".", 1)[1]
    return out


def test_no_kernel_module_uses_another_pallas_modules_private_names():
    found = []
    for path in _files("pallas"):
        tree = _tree(path)
        aliases = _pallas_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _from_module(node).startswith("dsv41_jax.pallas."):
                found += [f"{_rel(path)}:{node.lineno} {_from_module(node)}.{a.name}" for a in node.names
                          if a.name.startswith("_")]
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{_rel(path)}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    assert not found, f"private names of another pallas module: {found}"


def _mentions(node, attr_names: set) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr in attr_names) or (isinstance(n, ast.Name) and n.id in attr_names)
               for n in ast.walk(node))


def test_fp8_and_e8m0_dtypes_are_defined_once():
    """Only model/codec.py binds a module-level name to the float8_e4m3fn / float8_e8m0fnu dtypes (in the whole
    package: the converters and training too)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in _tree(path).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                    and _mentions(node.value, {"float8_e4m3fn", "float8_e8m0fnu"}):
                found.append(f"{_rel(path)}:{node.lineno}")
    assert [f for f in found if not f.startswith("dsv41_jax/model/codec.py")] == [], found
    assert len(found) == 2, found  # FP8 and E8M0


def _functions(tree):
    """(qualified name, node) of every function, methods and nested functions included."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_fp8_activation_quant_is_defined_once():
    """The activation quant's scale (⌈log2(amax / 448)⌉) is computed in `codec.fp8_act_codes` only; its
    floor constant is used nowhere else; no kernel makes e8m0 bytes with a raw ``+ 127``."""
    scale_sites, floor_sites, raw_bias = [], [], []
    for path in _files("model", "pallas"):
        tree = _tree(path)
        for qual, fn in _functions(tree):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and _mentions(node.func, {"ceil_log2", "_ceil_log2"})
                        and any(isinstance(a, ast.BinOp) and isinstance(a.op, ast.Div)
                                and _mentions(a.right, {"E4M3_MAX"}) for a in node.args)):
                    scale_sites.append(f"{_rel(path)}:{qual}")
        for node in ast.walk(tree):
            if _mentions(node, {"ACT_AMAX_FLOOR", "_ACT_AMAX_FLOOR"}) and isinstance(node, (ast.Name, ast.Attribute)):
                floor_sites.append(_rel(path))
            if (path.parent.name == "pallas" and isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                    and isinstance(node.right, ast.Constant) and node.right.value == 127):
                raw_bias.append(f"{_rel(path)}:{node.lineno}")
    assert scale_sites == ["dsv41_jax/model/codec.py:fp8_act_codes"], scale_sites
    assert set(floor_sites) == {"dsv41_jax/model/codec.py"}, floor_sites
    assert not raw_bias, f"e8m0 bytes made by hand in a kernel (use codec.e8m0_encode_exponent): {raw_bias}"


def test_bench_inputs_and_bytes_contracts_live_in_costs():
    """No kernel module defines bench inputs or a bytes contract, and every ``pl.CostEstimate``'s bytes_accessed
    in one is computed by `pallas.costs` (bench_decode counts a kernel by that estimate)."""
    defs, formulas = [], []
    for path in _files("pallas"):
        if path.name == "costs.py":
            continue
        tree = _tree(path)
        for qual, fn in _functions(tree):
            if fn.name.endswith(("_bench_inputs", "_bytes_moved", "_call_geometry")):
                defs.append(f"{_rel(path)}:{qual}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _mentions(node.func, {"CostEstimate"}):
                for kw in node.keywords:
                    if kw.arg == "bytes_accessed" and not any(
                            isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "costs"
                            and n.attr.endswith("_bytes_moved") for n in ast.walk(kw.value)):
                        formulas.append(f"{_rel(path)}:{node.lineno}")
    assert not defs, f"bench inputs / bytes contracts defined in kernel modules (move them to pallas/costs.py): {defs}"
    assert not formulas, f"cost estimates whose bytes are not a pallas.costs contract: {formulas}"
