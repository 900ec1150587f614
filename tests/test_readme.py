"""README.md is the front door (issue 22 item 7): at most 100 lines, no links out of the
repository, and every relative link in it and in docs/ leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str) -> list[str]:
    """Lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def test_readme_is_at_most_100_lines() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 100


def test_readme_prose_lines_are_at_most_120_characters() -> None:
    long = [line for line in _prose_lines(README.read_text(encoding="utf-8")) if len(line) > 120]
    assert not long, long


def test_readme_links_nowhere_outside_the_repository() -> None:
    """Loopback URLs (a local server's address in an example) lead nowhere outside."""
    assert not re.search(r"https?://(?!127\.0\.0\.1[:/])", README.read_text(encoding="utf-8"))


def test_readme_has_the_two_commands_ci_runs() -> None:
    """.ci/run takes the two ```bash blocks under "## Two commands" and compares them to its copy."""
    section = README.read_text(encoding="utf-8").split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for block in blocks:
        assert f"'{block.strip()}'" in ci


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file(doc: Path) -> None:
    missing = []
    for target in LINK.findall("\n".join(_prose_lines(doc.read_text(encoding="utf-8")))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # an absolute URL (docs/ may cite one) or an anchor in the same file
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(REPO)}: {missing}"


def test_readme_links_every_docs_page() -> None:
    text = README.read_text(encoding="utf-8")
    for name in ("configuration", "architecture", "cache", "serving", "deployment", "threat-model", "privacy",
                 "results"):
        assert f"(docs/{name}.md)" in text, name
