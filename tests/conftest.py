"""Test-wide settings: no hub access, and one embedded-corpus cache per test session."""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Tokenize the embedded corpus once per session, away from the user's ~/.cache."""
    if "P2P_SPES_CACHE" not in os.environ:
        os.environ["P2P_SPES_CACHE"] = str(tmp_path_factory.mktemp("p2p-spes-cache"))
    yield
