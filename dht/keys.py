"""The names of a run's DHT keys. Every key starts with the run id (or its secret key space, ``dht/auth.py``).

Pure string functions with no imports, at the bottom of the ``dht`` package: the trainer, the
bootstrap, the inspector and the record schemas all name keys the same way through them. Which
value each key holds is in ``dht/records.py``.
"""

from __future__ import annotations


def peers_key(run_id: str) -> str:
    """Subkey per peer: that peer's status (experts held, step, round, loss, ...)."""
    return f"{run_id}_peers"


def config_key(run_id: str) -> str:
    """Subkey per peer: the model fingerprint and model-defining config it trains."""
    return f"{run_id}_model"


def run_config_key(run_id: str) -> str:
    """Subkey per publisher: the full run config, its hash and the model fingerprint."""
    return f"{run_id}_run_config"


def group_key(run_id: str, round_no: int, group: str) -> str:
    """Subkey per peer: who joined averaging group ``group`` of round ``round_no``."""
    return f"{run_id}.round{round_no}.{group}"


def decided_key(group: str) -> str:
    """Subkey per peer (the first arrival, or whoever believes it is): the membership it decided for the
    group under the key ``group`` (a :func:`group_key`), which every member adopts."""
    return f"{group}.decided"


def version_key(run_id: str, round_no: int) -> str:
    """Subkey per peer: digests of the shared parameters and experts it holds after a round."""
    return f"{run_id}.round{round_no}.versions"
