"""The layer table of docs/design.md, enforced: imports only point down, no module import circle, and lower
layers read no env vars."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package dir -> module prefixes it must not import
# ndp.plan is the top row: it reads ndp.parallel's config rules and ndp.train's presets, and no layer imports it.
# accelerate and trl are optional (pip install ndp[hf]): only ndp.accelerate, the top of the house, imports them.
OPTIONAL = ("accelerate", "trl", "ndp.accelerate", "ndp.trainer")
FORBIDDEN = {
    "ndp_kernels": ("torch.distributed", "ndp", "transformers") + OPTIONAL,
    "ndp/ops": ("transformers", "ndp.cp", "ndp.parallel", "ndp.hf", "ndp.train", "ndp.plan") + OPTIONAL,
    "ndp/cp": ("transformers", "ndp.parallel", "ndp.hf", "ndp.train", "ndp.plan") + OPTIONAL,
    "ndp/parallel": ("transformers", "ndp.hf", "ndp.train", "ndp.plan") + OPTIONAL,
    "ndp/hf": ("ndp.train", "ndp.plan") + OPTIONAL,
    "ndp/train": ("ndp.plan",) + OPTIONAL,
    # the planner predicts; it never runs kernels or collectives
    "ndp/plan": ("ndp.cp", "ndp.ops", "ndp.hf", "ndp_kernels", "torch.distributed"),
}
NO_ENV = ("ndp/ops", "ndp/cp", "ndp/parallel")


def _modules(rel):
    return sorted((ROOT / rel).rglob("*.py"))


def _type_checking_only(tree):
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations, never run)."""
    return {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)}


def _imports(path):
    """Every module an import in ``path`` names (function-level ones included, TYPE_CHECKING ones not)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    annotations_only = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod
            for a in node.names:
                yield f"{mod}.{a.name}"


def _hits(mod, prefixes):
    return [p for p in prefixes if mod == p or mod.startswith(p + ".")]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_point_down(layer):
    bad = []
    for path in _modules(layer):
        for mod in _imports(path):
            if _hits(mod, FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "layering violations (docs/design.md):\n" + "\n".join(bad)


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # An import inside a function still closes a circle (it only hides it from the import system): counted.
    mods = {_module_name(p): p for d in ("ndp", "ndp_kernels") for p in _modules(d)}
    graph = {m: {name for name in _imports(p) if name in mods and name != m and not m.startswith(name + ".")}
             for m, p in mods.items()}
    assert not _circles(graph), _circles(graph)


@pytest.mark.parametrize("layer", NO_ENV)
def test_lower_layers_read_no_env_vars(layer):
    bad = []
    for path in _modules(layer):
        src = path.read_text()
        for needle in ("os.environ", "os.getenv"):
            if needle in src:
                bad.append(f"{path.relative_to(ROOT)} uses {needle}")
    assert not bad, "only ndp.train parses config/env (docs/design.md):\n" + "\n".join(bad)


def test_kernels_know_nothing_of_ndp():
    # ndp_kernels may be imported without ndp (it ships the kernels and their references).
    for path in _modules("ndp_kernels"):
        for mod in _imports(path):
            assert not _hits(mod, ("ndp",)), f"{path} imports {mod}"
