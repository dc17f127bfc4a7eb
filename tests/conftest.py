"""Shared fixtures: tiny random-weight checkpoints in Hugging Face format, built locally once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.engine.models.synthetic import SIZES, build_tokenizer
from kvpilot.engine.models.synthetic import build_checkpoint as _build_checkpoint


def build_checkpoint(
    out_dir: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0, **overrides
) -> Path:
    """A ``test``-size random checkpoint of ``arch`` sharing the session tokenizer."""
    return _build_checkpoint(out_dir, tokenizer_dir, size="test", arch=arch, seed=seed, **overrides)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, SIZES["test"][1])
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> Path:
    """The session's tiny Llama checkpoint (float32, random weights)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)
