"""Test-wide settings: no hub access, one embedded-corpus cache per session, ``gpu`` tests only with CUDA.

Shared helpers live in ``helpers.py`` (``from helpers import ...``), not here.
"""

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


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when torch sees no CUDA device (torch is imported only if there are any)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in gpu:
        item.add_marker(skip)
