"""docs/config.md documents every key and is generated from the current schema."""

from pathlib import Path

from jaxrl.config.reference import attribute_docs, render, undocumented
from jaxrl.config.schema import CriticModelConfig

DOC = Path(__file__).parents[2] / "docs" / "config.md"


def test_every_key_documented():
    assert undocumented() == []


def test_inherited_docs_are_merged():
    docs = attribute_docs(CriticModelConfig)
    assert "defaults to the actor's" in docs["path"]
    assert "Rematerialise" in docs["enable_gradient_checkpointing"]


def test_committed_reference_is_current():
    assert DOC.read_text() == render(), (
        "docs/config.md is stale: run python -m jaxrl.config.reference > docs/config.md"
    )
