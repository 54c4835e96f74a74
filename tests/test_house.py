"""The house rules of docs/design.md that a reader trips on, enforced: every document the tree cites lives in the
repository, no Python function outside the Triton kernels runs past 100 lines, and code is not written twice."""
import ast
import collections
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


# Code written twice: places sharing REPEAT_LINES identical lines (whitespace aside; blank, comment, import and
# docstring-fence lines skipped), counted as pairs of files. The budget holds what is repeated on purpose: the
# argument lists of the Triton backward kernels (a kernel's signature cannot be shared).
REPEAT_LINES = 6
MAX_REPEATED_PAIRS = 1
_SKIPPED = ("#", "//", "import ", "from ", '"""')


def _code_lines(path):
    return [(i, s) for i, s in enumerate((x.strip() for x in path.read_text(errors="replace").splitlines()), 1)
            if s and not s.startswith(_SKIPPED)]


def _repeated_pairs():
    places = collections.defaultdict(list)
    for path in _files():
        if path.suffix == ".md":
            continue
        lines = _code_lines(path)
        for j in range(len(lines) - REPEAT_LINES + 1):
            run = tuple(s for _, s in lines[j:j + REPEAT_LINES])
            if sum(map(len, run)) >= 60:  # runs of brackets and one-word lines are not code written twice
                places[run].append((path.relative_to(ROOT).as_posix(), lines[j][0]))
    pairs = collections.defaultdict(set)
    for where in places.values():
        for i, (fa, la) in enumerate(where):
            for fb, lb in where[i + 1:]:
                if fa != fb or abs(la - lb) >= REPEAT_LINES:
                    pairs[tuple(sorted((fa, fb)))].add(min(la, lb))
    return pairs


def test_code_is_not_written_twice():
    pairs = _repeated_pairs()
    listed = [f"{a} ~ {b}: runs from line {sorted(lines)[:3]}" for (a, b), lines in sorted(pairs.items())]
    assert len(pairs) <= MAX_REPEATED_PAIRS, (f"{len(pairs)} pairs of files share {REPEAT_LINES}+ identical lines "
                                              f"(budget {MAX_REPEATED_PAIRS}); fold them into one place:\n"
                                              + "\n".join(listed))
