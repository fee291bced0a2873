"""The user documents stay readable: the guide's and the README's length and sentence limits, no test names, commit
hashes or source-line citations in them, and every relative link in the docs resolves to a file of the repository.

Pure: reads files, starts no process. The counting is scripts/doc_stats.py (the project judge's rules, kept in the
repository so that CI needs nothing outside it); the negative controls below show each rule rejecting a document
that breaks it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "reduce_to_owner.md"
README = ROOT / "README.md"
LINKED_DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]

# (words, median sentence, longest sentence): the guide is read in fifteen minutes, the README in three.
GUIDE_LIMITS = (4000, 19, 50)
README_LIMITS = (700, 19, 50)


def _doc_stats():
    spec = importlib.util.spec_from_file_location("_scripts_doc_stats", ROOT / "scripts" / "doc_stats.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


doc_stats = _doc_stats()


def commit_like_ids(text: str) -> list[str]:
    """Hex tokens of 7-40 characters with a digit and a letter: a commit hash (a plain number is not one)."""
    return [token for token in doc_stats.HEX_ID.findall(text)
            if re.search(r"[0-9]", token) and re.search(r"[a-f]", token)]


def user_document_problems(text: str, limits: tuple[int, int, int]) -> list[str]:
    stats = doc_stats.doc_stats(text)
    problems = doc_stats.problems(stats, *limits)
    if commit_like_ids(text):
        problems.append(f"commit hashes {commit_like_ids(text)[:5]}")
    return problems


@pytest.mark.parametrize(("path", "limits"), [(GUIDE, GUIDE_LIMITS), (README, README_LIMITS)],
                         ids=["guide", "readme"])
def test_user_document_within_limits(path: Path, limits: tuple[int, int, int]) -> None:
    text = path.read_text(encoding="utf-8")
    assert user_document_problems(text, limits) == [], doc_stats.summary(str(path.relative_to(ROOT)),
                                                                          doc_stats.doc_stats(text))


def test_guide_has_no_developer_references() -> None:
    """Named separately from the limits so that a failure says what to remove."""
    text = GUIDE.read_text(encoding="utf-8")
    stats = doc_stats.doc_stats(text)
    assert (stats.test_names, stats.source_lines, commit_like_ids(text)) == (0, 0, [])


@pytest.mark.parametrize("path", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    if not path.exists():
        pytest.fail(f"{path.relative_to(ROOT)} is missing")
    missing = [target for target in doc_stats.relative_links(path.read_text(encoding="utf-8"))
               if target and not (path.parent / target).resolve().exists()]
    assert missing == [], f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"


# ---- negative controls: each rule rejects a document that breaks it -----------------------------------------------

SHORT = "A short sentence here. Another one follows it."


def test_control_too_many_words() -> None:
    assert any("words >" in p for p in user_document_problems(SHORT + " word" * 4000, GUIDE_LIMITS))


def test_control_long_sentence_and_median() -> None:
    long_sentence = " ".join(["word"] * 60) + "."
    problems = user_document_problems(f"{long_sentence}\n\n{long_sentence}\n", GUIDE_LIMITS)
    assert any("longest sentence 60" in p for p in problems)
    assert any("median sentence 60" in p for p in problems)


def test_control_code_and_tables_are_not_sentences() -> None:
    long_line = " ".join(["word"] * 60)
    text = f"{SHORT}\n\n```\n{long_line}\n```\n\n| {long_line} |\n\n# {long_line}\n"
    assert doc_stats.doc_stats(text).longest == 4


def test_control_developer_references() -> None:
    text = ("See tests/test_flush_choice.py and enqueue.cc 434 for why. Fixed in 1f5ef35 last week. A number such as "
            "52428800 is no commit.")
    stats = doc_stats.doc_stats(text)
    assert (stats.test_names, stats.source_lines) == (1, 1)
    assert commit_like_ids(text) == ["1f5ef35"]
    assert user_document_problems(text, GUIDE_LIMITS)


def test_control_relative_links() -> None:
    text = ("[guide](docs/reduce_to_owner.md), [gone](docs/nowhere.md#part), [web](https://example.com/x.md), "
            "[here](#status)\n[ref]: CHANGELOG.md\n")
    assert doc_stats.relative_links(text) == ["docs/reduce_to_owner.md", "docs/nowhere.md", "CHANGELOG.md"]
