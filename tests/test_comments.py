"""Comments explain the code (docs/development.md rule 7): a comment or docstring under model/ and service/ says why
the code is as it is, what it follows (a paper, a spec, a peer's file) and its shapes. Measurements, the machines
they came from and the history of a change belong to docs/performance.md, benchmarks/results/ and commit messages,
where they can be kept current; in a comment they go stale the day the code or the host changes.

What this looks for, in every comment and docstring of model/ and service/ (Python, and the kernels' C++):
- a measured ratio: a decimal followed by x ("1.09x", "0.74x"), or "10x faster" / "15x slower";
- a timing: a decimal duration ("0.067 s", "5.4 ms") or an approximate one ("~10 us", "about 3 s");
- a rate: "17.0 GB/s", "122.9 tok/s", "58 GFLOP/s", "140 GMAC/s";
- a host: "Zen 3", "EPYC", "Sapphire Rapids", "Xeon", "Ice Lake", "development host" / "machine" / "VM".
Arithmetic that follows from a format (an int8 weight is 4x smaller than a float32 one) is not a measurement: whole
ratios and sizes pass.

Citations: the rules of the house are numbered in docs/development.md and cited as "docs/development.md rule N";
nothing in the repository cites a file outside it (the design notes the project grew from are not part of it).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


MEASUREMENTS = {
    "a measured ratio": re.compile(r"(?<![\w.])\d+\.\d+x\b|\b\d+(?:\.\d+)?x (?:faster|slower)\b"),
    "a timing": re.compile(r"(?<![\w.])\d+\.\d+ ?(?:s|ms|us|µs|ns)\b|(?:~|\babout |\baround )\d+(?:\.\d+)? ?(?:s|ms|us|µs|ns)\b"),
    "a rate": re.compile(r"\b\d+(?:\.\d+)? ?(?:GB/s|MB/s|tok/s|tokens/s|GFLOP/s|GMAC/s|GFMA/s)"),
    "a host": re.compile(r"\bZen ?\d\b|\bEPYC\b|\bSapphire\b|\bXeon\b|\bIce Lake\b|\bAlder Lake\b"
                         r"|\bdevelopment (?:host|machine|VM)\b"),
}
CITATIONS = {
    "a house rule cited by another name than docs/development.md rule N": re.compile(r"\b[Hh]ouse rules? \d"),
    "a file outside the repository": re.compile(r"\bDESIGN\.md\b|\bshared/"),
}


def sources() -> list[Path]:
    return sorted(p for ext in ("py", "cpp", "h") for p in [*ROOT.glob(f"model/**/*.{ext}"), *ROOT.glob(f"service/**/*.{ext}")])


def python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def cpp_comments(text: str) -> list[tuple[int, str]]:
    out = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        out.append((text.count("\n", 0, m.start()) + 1, m.group()))
    return out


def comments(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return python_comments(text) if path.suffix == ".py" else cpp_comments(text)


def findings(path: Path, patterns: dict[str, re.Pattern]) -> list[str]:
    found = []
    for line, text in comments(path):
        flat = " ".join(text.split())  # a figure wrapped over two lines is still one figure
        for what, pattern in patterns.items():
            for m in pattern.finditer(flat):
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group()!r}")
    return found


def test_the_patterns_catch_what_they_say():
    assert findings_in("# int4 1.09-1.14x, 10x faster than xgrammar", MEASUREMENTS) == ["a measured ratio"] * 2
    assert findings_in("# 0.067 s -> 0.043 s; a 5-row step 10.5 ms; ~10 us", MEASUREMENTS) == ["a timing"] * 4
    assert findings_in("# read 17.0 GB/s; 122.9 tok/s", MEASUREMENTS) == ["a rate"] * 2
    assert findings_in("# on the Zen 3 host; the development VM; an EPYC", MEASUREMENTS) == ["a host"] * 3
    assert findings_in("# 4x fewer bytes; 1 s before the deadline; 64 rows; 2 MB pages", MEASUREMENTS) == []
    assert findings_in("# house rule 6", CITATIONS) and findings_in("# see shared/DESIGN.md", CITATIONS)
    assert findings_in("# docs/development.md rule 6", CITATIONS) == []


def findings_in(comment: str, patterns: dict[str, re.Pattern]) -> list[str]:
    return [what for what, p in patterns.items() for _ in p.finditer(comment)]


@pytest.mark.parametrize("patterns", [MEASUREMENTS, CITATIONS], ids=["measurements and hosts", "citations"])
def test_comments_explain_the_code(patterns):
    found = []
    for path in sources():
        found += findings(path, patterns)
    assert not found, ("move these to docs/performance.md or a commit message (tests/test_comments.py says why):\n"
                       + "\n".join(found))


def test_the_rules_cited_exist_and_nothing_cites_outside_the_repository():
    rules = {int(n) for n in re.findall(r"^(\d+)\. ", (ROOT / "docs/development.md").read_text(), re.M)}
    cited = set()
    for path in [*sources(), *ROOT.glob("tests/**/*.py"), ROOT / "pyproject.toml"]:
        text = path.read_text()
        cited |= {int(n) for n in re.findall(r"docs/development\.md rule (\d+)", text)}
        if path.name != "test_comments.py":
            assert not CITATIONS["a file outside the repository"].search(text), path
    assert cited and cited <= rules, f"cited rules {sorted(cited - rules)} are not in docs/development.md"
