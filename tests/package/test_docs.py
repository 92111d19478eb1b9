"""The docs a newcomer walks: a short README that links to pages by topic, every link
landing on a file and heading that exist, and every module named in the architecture map."""
from __future__ import annotations

import os
import re

import pytest

from tests.package.import_graph import _modules

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(os.path.join(ROOT, "docs", f)
                                                 for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces as hyphens."""
    with open(path) as f:
        heads = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_readme_is_short():
    with open(DOCS[0]) as f:
        assert len(f.readlines()) <= 200


def test_every_link_lands_on_a_file_and_heading_that_exist():
    broken = []
    for doc in DOCS:
        with open(doc) as f:
            text = f.read()
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            page, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(doc), page)) if page else doc
            if not os.path.exists(path) or (anchor and path.endswith(".md") and anchor not in _anchors(path)):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target}")
    assert broken == []


def test_every_module_is_named_in_the_architecture_map():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    missing = sorted(os.path.relpath(path, ROOT) for path in _modules().values()
                     if f"`{os.path.relpath(path, ROOT)}`" not in text)
    assert missing == []


def _note_names() -> set[str]:
    """The design notes' names: their ``###`` headings, several per heading separated by ``;``."""
    with open(os.path.join(ROOT, "docs", "design-notes.md")) as f:
        return {name.strip() for line in f if line.startswith("### ") for name in line[4:].split(";")}


def test_every_note_cited_names_a_design_note():
    """``See note: <name>`` in the code, the tests and the docs names a heading of ``docs/design-notes.md``, and
    every note is cited somewhere in the code (the mechanism it explains)."""
    names = _note_names()
    cite = re.compile(r"see note:\s+([a-z0-9][a-z0-9 \-]*?)\s*(?=[).;,]|\(|$)", re.IGNORECASE | re.MULTILINE)
    cited: dict[str, list[str]] = {}
    for top in ("zeroplus", "engine", "offload", "kernels", "tests", "tools", "docs"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".md")) and name != "design-notes.md":
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        lines = f.read().split("\n")
                    # a comment's citation ends with its line; a docstring's may go on to the next
                    in_comment = ["#" in line and "see note:" in line.split("#", 1)[1].lower() for line in lines]
                    comments = [line.split("#", 1)[1] for line, c in zip(lines, in_comment) if c]
                    prose = " ".join(line.strip() for line, c in zip(lines, in_comment) if not c)
                    for found in cite.findall("\n".join(comments)) + cite.findall(prose):
                        cited.setdefault(found.strip().lower(), []).append(os.path.relpath(path, ROOT))
    unknown = {name: where for name, where in cited.items() if name not in names}
    assert unknown == {}
    assert sorted(names - set(cited)) == []


WORK_ROUND = re.compile(r"\b(?:sessions?|issues?)(?:\s|#)+[0-9]", re.IGNORECASE)  # across a line break and a #


def test_no_text_names_a_work_round():
    """The project speaks of itself by dates and commits: no code, test, benchmark or document names the work
    round that produced it (the word session or issue and its number)."""
    found = []
    for top in ("zeroplus", "engine", "offload", "kernels", "tests", "tools", "bench", "docs", "configs"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".md", ".json", ".sh")):
                    path = os.path.join(folder, name)
                    found += _work_rounds(path)
    found += _work_rounds(os.path.join(ROOT, "README.md"))
    assert found == [], found


def _work_rounds(path: str) -> list[str]:
    """``path:line`` of each work round the file names, a phrase broken over two lines included."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for m in WORK_ROUND.finditer(text)]
