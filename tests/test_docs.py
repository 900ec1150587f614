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


# A path a clone does not have: a folder beside the repo (../shared, ../..), the notes folder
# shared/ named on its own, or an absolute path into one machine's home or work folders.
OUTSIDE = re.compile(r"\.\./(?:shared|\.\.)\S*|(?<![\w./~-])shared/\S*|file://\S+"
                     r"|(?<![\w.~-])/(?:work|home|root|Users|mnt|srv)/\S*")


def outside_paths(text: str) -> list[str]:
    """The paths in a text that lead outside the repo on some machine (examples a user picks,
    /tmp/... or ~/.fedkv/..., are not such paths)."""
    return OUTSIDE.findall(text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_is_a_file_of_the_repo(doc: Path):
    for target in relative_targets(doc.read_text(encoding="utf-8")):
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the repo: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_points_into_a_folder_beside_the_repo(doc: Path):
    found = outside_paths(doc.read_text(encoding="utf-8"))
    assert not found, f"{doc.name} names paths outside the repo: {found}"


def test_the_link_check_catches_an_outside_link():
    assert relative_targets("see [notes](../shared/notes/x.md) and [web](https://a.b) [s](#x)") == \
        ["../shared/notes/x.md"]


def test_the_outside_check_catches_absolute_and_sibling_paths():
    text = ("see ../shared/notes/x.md, `shared/flower.md`, /work/main/docs/a.md, /home/ann/x, "
            "file:///root/y and ../../z; not ~/.fedkv/nodes, /tmp/run, docs/shared/x or /abs/path.json")
    assert outside_paths(text) == ["../shared/notes/x.md,", "shared/flower.md`,", "/work/main/docs/a.md,",
                                   "/home/ann/x,", "file:///root/y", "../../z;"]
