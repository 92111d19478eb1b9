"""The docs a newcomer walks (issue 38, item 6): a short README that links to pages by topic, every link
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
