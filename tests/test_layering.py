"""The layer table of docs/design.md, enforced: imports only point down, and lower layers read no env vars."""
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


def _imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
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
