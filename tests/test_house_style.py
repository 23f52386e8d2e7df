"""Docstrings state contracts; figures live in ``docs/measurements/`` (issue 59, CONTRIBUTING.md).

- The docstring lines of ``saguaro/`` are at most :data:`MAX_DOCSTRING_RATIO` of its code lines (non-blank
  lines that are neither docstring nor comment).
- Docstring and comment lines that carry a measurement (a time in s/ms/µs/ns, tok/s, GB/s, an x-ratio, a
  percent) number at most :data:`MAX_MEASUREMENT_LINES`, and each sits in a docstring or comment block
  that links an existing file of ``docs/measurements/``.
- No path outside the repository (``../shared``) appears in ``saguaro/``.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "saguaro"
MAX_DOCSTRING_RATIO = 0.18
MAX_MEASUREMENT_LINES = 5
MEASUREMENT = re.compile(
    r"\d(?:[\d.,]*\d)?\s*(?:s|ms|us|µs|ns)\b"  # 2.5 s, 15 us, 0.5-0.8 ms
    r"|\d\s*(?:tok/s|[GM]B/s)"  # 21 tok/s, 28 GB/s
    r"|\d(?:\.\d+)?x\b|\d\.\d+\s*x\b"  # 1.4x, 2.7 x (not a shape's 16 x 256)
    r"|\d\s*%"
)
LINK = re.compile(r"docs/measurements/[\w.\-/]+\.md")


def docstring_blocks(tree: ast.Module) -> list[tuple[int, int]]:
    """(first, last) line of every module, class and function docstring."""
    blocks = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    blocks.append((first.lineno, first.end_lineno))
    return blocks


def comment_blocks(source: str) -> list[tuple[int, int]]:
    """(first, last) line of every run of consecutive comment lines."""
    lines = sorted(
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    )
    blocks = []
    for line in lines:
        if blocks and blocks[-1][1] == line - 1:
            blocks[-1] = (blocks[-1][0], line)
        else:
            blocks.append((line, line))
    return blocks


def file_figures(path: Path) -> tuple[int, int, list[tuple[int, str, bool]]]:
    """(docstring lines, code lines, measurement lines as (line, text, linked)) of one file."""
    source = path.read_text()
    lines = source.splitlines()
    docs = docstring_blocks(ast.parse(source))
    comments = comment_blocks(source)
    in_doc = {n for a, b in docs for n in range(a, b + 1)}
    code = sum(
        1
        for n, text in enumerate(lines, 1)
        if text.strip() and n not in in_doc and not text.strip().startswith("#")
    )
    found = []
    for first, last in docs + comments:
        block = "\n".join(lines[first - 1 : last])
        links = LINK.findall(block)
        linked = bool(links) and all((REPO / link).exists() for link in links)
        for n in range(first, last + 1):
            text = lines[n - 1]
            if (first, last) in comments:
                text = text[text.index("#") :] if "#" in text else ""
            if MEASUREMENT.search(text):
                found.append((n, text.strip(), linked))
    return len(in_doc), code, found


def package_figures():
    doc = code = 0
    measurements = []
    for path in sorted(PACKAGE.rglob("*.py")):
        d, c, found = file_figures(path)
        doc, code = doc + d, code + c
        measurements += [(f"{path.relative_to(REPO)}:{n}", text, linked) for n, text, linked in found]
    return doc, code, measurements


def test_the_counter_sees_docstrings_comments_and_figures(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Module.\n\nTwo more lines, 3.5 ms each."""\n\n'
        "def f():\n"
        '    """One line."""\n'
        "    return 1  # 2x faster, docs/measurements/nowhere.md\n"
    )
    doc, code, found = file_figures(sample)
    assert (doc, code) == (4, 2)
    assert [(n, linked) for n, _, linked in found] == [(3, False), (7, False)]  # the link names no file


def test_docstrings_are_a_small_share_of_the_code():
    doc, code, _ = package_figures()
    assert code > 5000, "the counter found almost no code"
    assert doc / code <= MAX_DOCSTRING_RATIO, (
        f"saguaro/ has {doc} docstring lines against {code} code lines ({doc / code:.3f}); "
        f"at most {MAX_DOCSTRING_RATIO}: move detail to docs/ and keep the contract"
    )


def test_figures_live_in_docs_measurements():
    _, _, measurements = package_figures()
    unlinked = [f"{where}: {text}" for where, text, linked in measurements if not linked]
    assert not unlinked, "measurements in saguaro/ without a link into docs/measurements/:\n" + "\n".join(
        unlinked
    )
    assert len(measurements) <= MAX_MEASUREMENT_LINES, "\n".join(f"{w}: {t}" for w, t, _ in measurements)


def test_no_path_outside_the_repository():
    offenders = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "../shared" in p.read_text()]
    assert not offenders, offenders
