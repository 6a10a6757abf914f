"""How a config field carries its documentation and scope: ``setting(default, doc=..., scope=...)``.

Every field of the config's sections is declared with :func:`setting`, which stores its doc and its
scope in the dataclass field's metadata. Code reads them from there: the published run config leaves
out the ``local`` settings (``dht/run_config.py``), the model fingerprint hashes the ``model`` ones,
``docs/configuration.md`` is rendered from them (``p2p_spes/config_docs.py``) and so is
``p2p-spes config --explain``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

# Which peers must agree on a field:
#   model: defines the model's function and weight shapes (the fingerprint; a peer that differs is refused)
#   run:   the same for every peer of a run (published in the DHT as the run config)
#   batch: run-wide as the product batch_size * grad_accum (tokens per step); each peer may split it
#   local: this machine's own choice (paths, addresses, device, logging...); never published
Scope = Literal["model", "run", "batch", "local"]
SCOPES: dict[Scope, str] = {
    "model": "defines the model (part of its fingerprint): every peer of a run has the same value",
    "run": "the same for every peer of a run: published with the run's config and compared between peers",
    "batch": "run-wide as the product train.batch_size x train.grad_accum; each peer may split it",
    "local": "this machine's own choice: never published, may differ between peers",
}


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    scope: Scope = "run",
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with its ``doc`` and ``scope`` in its metadata (``factory`` for a list default)."""
    metadata = {"doc": doc, "scope": scope}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_scope(f: dataclasses.Field) -> Scope:
    """The scope a field was declared with (KeyError for a field not declared with :func:`setting`)."""
    return f.metadata["scope"]


def field_doc(f: dataclasses.Field) -> str:
    """The doc a field was declared with (KeyError for a field not declared with :func:`setting`)."""
    return f.metadata["doc"]


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one for a field with a default factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
