"""docs/configuration.md is generated from RunConfig (its fields, defaults and field docstrings),
so the defaults and their meanings have one source: federation/config.py."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from federation.config import RunConfig, known_keys
from federation.tools.config_doc import field_docs, markdown

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_configuration_doc_is_what_the_generator_writes() -> None:
    assert DOC.read_text(encoding="utf-8") == markdown(), (
        "docs/configuration.md is out of date: run "
        "`python -m federation.tools.config_doc --markdown > docs/configuration.md`")


def test_every_field_has_a_docstring_and_a_row() -> None:
    docs = field_docs()
    assert set(docs) == {f.name for f in fields(RunConfig)}
    text = markdown()
    for key in known_keys():
        assert f"| `{key}` |" in text, key


def test_field_docs_pairs_each_field_with_the_string_after_it() -> None:
    source = '''
class RunConfig:
    """class doc"""
    a: int = 1
    """A's doc,
    on two lines."""
    b: int = 2
    c: str = "x"
    """C's doc."""
'''
    assert field_docs(source) == {"a": "A's doc,\non two lines.", "c": "C's doc."}
