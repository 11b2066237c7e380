"""docs/options.md is generated from the flag definitions (tachyllm/entrypoints/options_doc.py): the
committed page must be exactly the generated text, and every `tachy serve` flag must be on it."""

from __future__ import annotations

import re
from pathlib import Path

from tachyllm.entrypoints import options_doc

PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def test_committed_options_page_is_the_generated_one():
    assert PAGE.is_file(), "docs/options.md is missing: run `make options-doc`"
    assert PAGE.read_text() == options_doc.render(), "docs/options.md is out of date: run `make options-doc`"


def test_every_serve_flag_is_documented():
    page = options_doc.render()
    groups = [g for g in options_doc.serve_parser()._action_groups if g.title.split(" ")[0] in options_doc.SECTIONS]
    flags = [flag for g in groups for action in g._group_actions for flag in action.option_strings]
    assert len(flags) > 40
    missing = [flag for flag in flags if f"`{flag}`" not in page]
    assert not missing


def test_check_fails_on_a_stale_or_missing_page(tmp_path, capsys):
    stale = tmp_path / "options.md"
    stale.write_text(options_doc.render().replace("--max-num-seqs", "--max-seqs"))
    assert options_doc.main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert options_doc.main(["--check", str(tmp_path / "absent.md")]) == 1
    fresh = tmp_path / "fresh.md"
    fresh.write_text(options_doc.render())
    assert options_doc.main(["--check", str(fresh)]) == 0


def test_every_flag_row_has_four_cells():
    """A help text's line break or '|' must not split or widen its row."""
    rows = [line for line in options_doc.render().splitlines() if line.startswith("| `--")]
    assert rows
    for row in rows:
        assert len(re.split(r"(?<!\\)\|", row)) == 6, row
