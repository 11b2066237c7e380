"""The docs rule (scripts/check_docs_rules.py, run by `make lint`): docs, comments, tests and
benchmark scripts name no work session, issue number or path outside the repository.

The refused examples below are split into two string literals so that this file itself keeps
the rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_docs_rules.py"


def check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True)


def test_the_repository_keeps_the_docs_rule():
    result = check()
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "line",
    [
        "Measured in sess" + "ion 12 on the quiet host.",
        "as sess" + "ions 20-24 showed",
        "a simulation with sess" + "ion\n17's costs",
        "See iss" + "ue #" + "22, point 1.",
        "the fix of #" + "17 made it faster",
        "numbers from ../sh" + "ared/reference.md",
        "--model /wo" + "rk/models/qwen.gguf",
        "PYTHONPATH=/tm" + "p/torchao_pkg python",
        "cp x /ho" + "me/dev/out",
        "an ad-hoc throw" + "away script",
    ],
)
def test_each_pattern_is_refused(tmp_path, line):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\nFine text.\n{line}\n")
    result = check(page)
    assert result.returncode == 1
    assert f"{page}:4:" in result.stdout


@pytest.mark.parametrize(
    "line",
    [
        "A multi-turn session sends the history again.",
        "requests (sessions) per second",
        "the cache lives under ~/.cache/tachyllm and $TMPDIR/x",
        "see [the table](#single-stream) and colour #1f77b4",
        "kernels/csrc/attention.cpp: 64 rows",
    ],
)
def test_ordinary_text_passes(tmp_path, line):
    page = tmp_path / "page.py"
    page.write_text(f'"""{line}"""\n')
    assert check(page).returncode == 0


def test_a_missing_path_is_an_error(tmp_path):
    result = check(tmp_path / "nope")
    assert result.returncode == 2
    assert "no such file" in result.stderr
