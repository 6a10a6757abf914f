"""The run's config, published in the DHT so that a volunteer needs only a multiaddr to join.

Peers (and a bootstrap given ``--config``) publish the run-wide part of their config, signed with
their key (``dht/identity.py``), with the SHA-256 of its canonical JSON. Settings that only concern
one machine (device, paths, addresses, logging) are left out of it, so peers that differ only
there publish the same hash. The batch is published as tokens per step (``batch_size`` x
``grad_accum``, with ``grad_accum`` 1): how a peer splits it into micro-batches is its own choice.
A volunteer may set those locally and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from dht.auth import RunAuth
from dht.keys import run_config_key
from dht.node import start_dht
from dht.records import signed_values
from p2p_spes.config import Config, load_config, parse_override, settings_of_scope
from p2p_spes.errors import ConfigError, SwarmError

# (section, key) pairs a peer may set for itself, and those published as a product it may split:
# both come from each config field's scope (p2p_spes/config.py)
LOCAL_SETTINGS: tuple[tuple[str, str], ...] = tuple(settings_of_scope("local"))
BATCH_SPLIT: tuple[tuple[str, str], ...] = tuple(settings_of_scope("batch"))


def _is_local(section: str, key: str) -> bool:
    return (section, key) in LOCAL_SETTINGS


def published_config(cfg: Config) -> dict[str, Any]:
    """The run-wide part of ``cfg``: everything but the local settings, the batch as tokens per step."""
    out = {
        section: {k: v for k, v in values.items() if not _is_local(section, k)}
        for section, values in cfg.to_dict().items()
    }
    out["train"]["batch_size"] = cfg.train.batch_size * cfg.train.grad_accum
    out["train"]["grad_accum"] = 1
    return out


def config_hash(published: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a published config (what the inspector and --config-hash show)."""
    return hashlib.sha256(json.dumps(published, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def run_config_record(cfg: Config, since: float | None = None) -> dict[str, Any]:
    """The value a publisher stores under ``run_config_key`` (its peer id is added by the writer)."""
    published = published_config(cfg)
    return {
        "config": published,
        "hash": config_hash(published),
        "fingerprint": cfg.model_fingerprint(),
        "time": float(since if since is not None else get_dht_time()),
    }


def config_from_published(published: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Build the run's Config from a published dict plus local-only ``--set`` overrides."""
    for text in overrides:
        key, _ = parse_override(text)
        section, _, name = key.partition(".")
        if not _is_local(section, name) and (section, name) not in BATCH_SPLIT:
            allowed = ", ".join(f"{s}.{k}" for s, k in LOCAL_SETTINGS + BATCH_SPLIT)
            raise ConfigError(
                f"--set {key}: the run's config fixes this setting for every peer; with --config-from-swarm only "
                f"local settings may be changed ({allowed}). To train something else, start another run"
            )
    return load_config(None, overrides, data=published)


def choose(records: dict[str, dict[str, Any]], expected_hash: str | None = None) -> dict[str, Any]:
    """The run config to trust among the publishers' records.

    Each record's hash is recomputed from its content. With ``expected_hash`` only that config is
    accepted; otherwise the hash published by the most peers wins (ties: the earliest published).
    """
    by_hash: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    bad = []
    for peer, value in records.items():
        published = value.get("config")
        if not isinstance(published, dict) or config_hash(published) != value.get("hash"):
            bad.append(peer)
            continue
        by_hash[value["hash"]].append((peer, value))
    if expected_hash is not None:
        matches = [h for h in by_hash if h.startswith(expected_hash)]
        if not matches:
            seen = ", ".join(sorted(by_hash)) or "none"
            raise SwarmError(f"no peer publishes a run config with hash {expected_hash} (published: {seen})")
        by_hash = {matches[0]: by_hash[matches[0]]}
    if not by_hash:
        detail = f" ({len(bad)} record(s) failed the hash check)" if bad else ""
        raise SwarmError(f"no valid run config is published in the DHT{detail}")
    best = max(by_hash, key=lambda h: (len(by_hash[h]), -min(v["time"] for _, v in by_hash[h])))
    publishers = sorted(p for p, _ in by_hash[best])
    return {**by_hash[best][0][1], "publishers": publishers, "alternatives": sorted(set(by_hash) - {best})}


def read_records(dht: DHT, run_id: str) -> dict[str, dict[str, Any]]:
    """The signed run-config records of ``run_id`` (publisher peer id -> record)."""
    return signed_values(dht.get(run_config_key(run_id), latest=True))


def fetch_run_config(
    initial_peers: Iterable[str],
    run_id: str,
    *,
    expected_hash: str | None = None,
    timeout: float = 30.0,
    bootstrap_timeout: float = 15.0,
    auth: RunAuth | None = None,
) -> dict[str, Any]:
    """Join the DHT as a client, wait (bounded) for the run's published config, check it and return it.

    Returns the chosen record: ``config`` (published dict), ``hash``, ``fingerprint``, ``publishers``.
    """
    initial_peers = list(initial_peers)
    if not initial_peers:
        raise SwarmError("fetching the run's config needs --initial-peers MADDR of a live peer or bootstrap")
    try:
        run_id = auth.keyspace(run_id) if auth is not None else run_id
        dht, _ = start_dht(
            None, [run_id], auth=auth, initial_peers=initial_peers, client_mode=True, startup_timeout=bootstrap_timeout
        )
    except SwarmError:
        raise
    except Exception as exc:
        raise SwarmError(
            f"could not reach the run through {' '.join(initial_peers)}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            records = read_records(dht, run_id)
            try:
                return choose(records, expected_hash)
            except SwarmError as exc:
                if time.monotonic() > deadline:
                    raise SwarmError(
                        f"run {run_id!r}: {exc} after {timeout:.0f}s. Check --run-id; the run's first peer publishes "
                        "it (p2p-spes train --config FILE --swarm), or a bootstrap started with --config FILE --run-id"
                    ) from None
            time.sleep(1.0)
    finally:
        dht.shutdown()
