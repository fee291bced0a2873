"""Words, sentence lengths and developer references of a Markdown user document, and its relative links.

Why here: the user guide and the README have limits a reader feels (length, sentence length, no test names, commit
hashes or source-line citations). CI checks them (tests/repo/test_docs.py) with nothing from outside the repository, so
the counting rules live in the repository. They follow the project's judge of a user document rule for rule: every
whitespace-separated token of the file is a word; sentences are counted in prose only (code blocks, table rows and
headings left out, inline code one word), split after `.`, `!`, `?`, `:` or `;` before a capital, `(`, a backtick,
`*` or `"`; a sentence has at least 3 words.

Usage: python scripts/doc_stats.py FILE [MAX_WORDS MAX_MEDIAN MAX_LONGEST]; exit 1 past a limit.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

TEST_NAME = re.compile(r"tests/test_\w+\.py|test_\w{6,}")
HEX_ID = re.compile(r"\b[0-9a-f]{7,40}\b")
SOURCE_LINE = re.compile(r"\b\w+\.(?:cc|cpp|h|pyx)\b(?::| )\d+")
# [text](target) and [text]: target; the target's first token (a title may follow it).
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class DocStats:
    """What the rules count in one document."""

    words: int
    sentences: tuple[int, ...]  # words per sentence, in order
    test_names: int
    hex_ids: int
    source_lines: int

    @property
    def median(self) -> float:
        return statistics.median(self.sentences) if self.sentences else 0

    @property
    def longest(self) -> int:
        return max(self.sentences) if self.sentences else 0

    @property
    def over_50(self) -> int:
        return sum(1 for n in self.sentences if n > 50)


def prose_of(text: str) -> str:
    """The document without code blocks, table rows and headings, inline code as one word ``X``."""
    prose, fence = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence or line.lstrip().startswith("|") or line.lstrip().startswith("#"):
            continue
        prose.append(line)
    return re.sub(r"`[^`]*`", "X", "\n".join(prose))


def sentence_lengths(text: str) -> tuple[int, ...]:
    """Words per sentence of the document's prose (paragraphs and list items split apart first)."""
    paras = [p for p in re.split(r"\n\s*\n|\n\s*[-*] |\n\s*\d+\. ", prose_of(text)) if p.strip()]
    lengths = []
    for para in paras:
        for sentence in re.split(r"(?<=[.!?:;])\s+(?=[A-Z(`*\"])", " ".join(para.split())):
            n = len(sentence.split())
            if n >= 3:
                lengths.append(n)
    return tuple(lengths)


def doc_stats(text: str) -> DocStats:
    return DocStats(words=len(re.findall(r"\S+", text)), sentences=sentence_lengths(text),
                    test_names=len(TEST_NAME.findall(text)), hex_ids=len(HEX_ID.findall(text)),
                    source_lines=len(SOURCE_LINE.findall(text)))


def relative_links(text: str) -> list[str]:
    """Every link target that is not a URL, a mail address or an anchor in the same page, without its anchor."""
    targets = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def summary(path: str, stats: DocStats) -> str:
    return (f"{path}: {stats.words} words; {len(stats.sentences)} sentences, median {stats.median:.0f} words, "
            f"longest {stats.longest}, {stats.over_50} over 50; {stats.test_names} test names, {stats.hex_ids} hex "
            f"ids, {stats.source_lines} source-line citations")


def problems(stats: DocStats, max_words: int, max_median: int, max_longest: int) -> list[str]:
    """What exceeds the limits (the judge's rules: a median above ``max_median`` fails, as its rounding shows)."""
    bad = []
    if stats.words > max_words:
        bad.append(f"{stats.words} words > {max_words}")
    if stats.median > max_median:
        bad.append(f"median sentence {stats.median:.0f} > {max_median}")
    if stats.longest > max_longest:
        bad.append(f"longest sentence {stats.longest} > {max_longest}")
    if stats.test_names or stats.source_lines:
        bad.append(f"{stats.test_names} test names and {stats.source_lines} source-line citations in a user document")
    return bad


def main(argv: list[str]) -> int:
    path = argv[0]
    stats = doc_stats(Path(path).read_text(encoding="utf-8"))
    print(summary(path, stats))
    if len(argv) > 1:
        bad = problems(stats, *(int(x) for x in argv[1:4]))
        print("; ".join(bad) if bad else "within limits")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
