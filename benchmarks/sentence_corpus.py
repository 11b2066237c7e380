"""A corpus of English sentences of natural lengths, built offline from the Python standard library.

The sentences come, in this order, from the reference-manual topics that `help()` shows
(`pydoc_data.topics`) and from the docstrings of the standard library's own modules (parsed with
`ast` from the sources, files in sorted order; tests and IDLE left out). Each paragraph is split
into sentences at `.`, `!` or `?` followed by a capital letter; a sentence is kept if it starts with
a capital, ends with `.`, `!` or `?`, has 4 to 80 words and was not seen before. The result depends
only on the Python version (3.11.7 gives 2,047 + about 13,500 sentences, 14 words on average, 1 to
~120 tokens).

    python benchmarks/sentence_corpus.py [--count N]   # prints the first N sentences, one a line
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PARAGRAPH = re.compile(r"\n\s*\n")
MIN_WORDS, MAX_WORDS = 4, 80


def _sentences_of(text: str) -> Iterator[str]:
    for paragraph in _PARAGRAPH.split(text):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            if (
                sentence
                and sentence[0].isupper()
                and sentence[-1] in ".!?"
                and MIN_WORDS <= len(sentence.split()) <= MAX_WORDS
            ):
                yield sentence


def _stdlib_docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "test", "tests", "idlelib"}
    for path in sorted(root.rglob("*.py")):
        if skipped.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node)
                if docstring:
                    yield docstring


def sentences(count: int) -> list[str]:
    """The first `count` distinct sentences; ValueError if the sources hold fewer."""
    from pydoc_data.topics import topics

    found: dict[str, None] = {}
    for text in itertools.chain(topics.values(), _stdlib_docstrings()):
        for sentence in _sentences_of(text):
            found.setdefault(sentence)
            if len(found) == count:
                return list(found)
    raise ValueError(f"only {len(found)} distinct sentences in the standard library's docs, {count} asked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    args = parser.parse_args()
    print("\n".join(sentences(args.count)))


if __name__ == "__main__":
    main()
