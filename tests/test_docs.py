"""The docs stand alone: every relative link in README.md and docs/ names a file of this repo,
and no text points into a folder outside it (a clone has nothing beside the repo)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_targets(text: str) -> list[str]:
    """The link targets of a markdown text that are paths (not URLs or in-page anchors)."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_is_a_file_of_the_repo(doc: Path):
    for target in relative_targets(doc.read_text(encoding="utf-8")):
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repo: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_points_into_a_folder_beside_the_repo(doc: Path):
    text = doc.read_text(encoding="utf-8")
    assert not re.search(r"\.\./(shared|\.\.)", text), f"{doc.name} names a path outside the repo"


def test_the_link_check_catches_an_outside_link():
    assert relative_targets("see [notes](../shared/notes/x.md) and [web](https://a.b) [s](#x)") == \
        ["../shared/notes/x.md"]
