"""The docs rule (CONTRIBUTING.md): docs, comments, tests and benchmark scripts describe the project as
it is, never the history of the work on it. Fails, listing file:line, on the patterns that give such
text away: work-log references ("session 12", "issue #22", "#22"), paths outside the repository
("../shared", absolute paths under a home, workspace or temporary directory) and "throwaway".

    python scripts/check_docs_rules.py                 # README.md, docs/, tachyllm/, tests/, benchmarks/
    python scripts/check_docs_rules.py PATH [PATH...]  # these files or folders
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("README.md", "docs", "tachyllm", "tests", "benchmarks")
# Text files only: a binary (an image, a compiled kernel) holds no prose.
SUFFIXES = {".md", ".py", ".cpp", ".h", ".sh", ".toml", ".yaml", ".yml", ".txt", ".json", ".cfg", ".ini"}


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]


RULES = (
    # \s: a reference wrapped onto the next line counts too.
    Rule("a work session", re.compile(r"\bsessions?(?:\s+|-)\d+", re.IGNORECASE)),
    Rule("an issue reference", re.compile(r"\bissues?\s+#?\d+|(?<![\w&/#])#\d+\b", re.IGNORECASE)),
    Rule("a path outside the repository", re.compile(r"\.\./shared\b|(?<![\w.~-])/(?:root|home|work|tmp)/")),
    Rule("a throwaway", re.compile(r"\bthrow-?away\b", re.IGNORECASE)),
)


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.text.strip()}"


def files_under(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    return [p for p in found if "__pycache__" not in p.parts]


def findings_in(path: Path) -> list[Finding]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    lines = text.splitlines()
    findings = []
    for rule in RULES:
        for match in rule.pattern.finditer(text):
            number = text.count("\n", 0, match.start()) + 1
            findings.append(Finding(path, number, rule.name, lines[number - 1]))
    return sorted(findings, key=lambda f: f.line)


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [ROOT / name for name in CHECKED]
    try:
        findings = [f for path in files_under(paths) for f in findings_in(path)]
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    for finding in findings:
        print(finding)
    if findings:
        print(f"{len(findings)} line(s) break the docs rule (CONTRIBUTING.md, 'Docs')", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
