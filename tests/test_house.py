"""The house rules of docs/design.md that a reader trips on, enforced: every document the tree cites lives in the
repository, and no Python function outside the Triton kernels runs past 100 lines."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("ndp", "ndp_kernels", "bench", "tests", "csrc", "setup.py", "README.md", "docs", "Makefile")
MAX_LINES = 100
# Markdown files the tree writes (make gpu-report's bench/results/<gpu>/report.md), not documents it relies on.
WRITTEN = {"report.md"}


def _files():
    for name in SOURCES:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".h", ".cpp", ".cu")
                        and "__pycache__" not in p.parts)


def test_every_cited_document_is_in_the_repository():
    # A citation is a Markdown file name written in code, docs or tests (e.g. `docs/design.md`).
    missing = []
    for path in _files():
        for name in set(re.findall(r"\b([\w./-]+\.md)\b", path.read_text(errors="replace"))) - WRITTEN:
            here = [ROOT / name, path.parent / name] + list(ROOT.glob(f"**/{pathlib.Path(name).name}"))
            if not any(p.is_file() for p in here if ".venv" not in p.parts):
                missing.append(f"{path.relative_to(ROOT)} cites {name}")
    assert not missing, "\n".join(sorted(missing))


def _is_kernel(fn) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_functions_fit_in_100_lines():
    long = []
    for path in _files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)
