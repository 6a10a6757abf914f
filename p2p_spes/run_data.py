"""Which data a peer trains on, found before it joins and brought to disk once its partition is known.

Three kinds of data, in the order a run's config is read:

- ``data.manifest`` (a URL or path, published with the run's config): the run's own token directory.
  A peer reads its manifest (from the URL, or from a peer of the run when the URL is gone), then
  fetches the tokenizer, the validation shards and only the train shards of its data partition into
  its cache. The partition is the train shards ``i`` with ``i mod peer.count == partition``.
- ``data.train`` / ``data.validation``: token directories already on this machine (not published:
  every peer must have the same files; the fingerprint check says when they do not).
- neither: the embedded corpus, tokenized once into the cache.

Whatever the kind, the data's fingerprint (``Manifest.fingerprint``) is what peers compare before they
average, so a peer on other data or another tokenizer is refused before its first step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_spes.config import Config
from p2p_spes.corpus import default_cache_dir, embedded_tokenizer_path, prepare_embedded_data
from p2p_spes.data import TokenDataset
from p2p_spes.data_fetch import Fetcher, FetchReport, partition_shards
from p2p_spes.data_manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    combined_fingerprint,
    decode_manifest,
    read_manifest,
)
from p2p_spes.data_sources import Source, local_root, origin_source
from p2p_spes.errors import ConfigError, DataError

log = logging.getLogger(__name__)
EMBEDDED = "embedded"
LOCAL = "local"


@dataclass(frozen=True)
class DataIdentity:
    """The data a peer will train on, known before any shard is read: what peers compare."""

    fingerprint: str
    origin: str  # "embedded", "local", or the data.manifest URL
    train: Manifest
    validation: Manifest
    train_root: Path  # where the files are or will be: the cache, or a local directory
    validation_root: Path
    manifest_bytes: bytes | None = None  # a data.manifest run's manifest, as served to peers
    fetch: bool = False  # the files come from sources into train_root (data.manifest over HTTP or peers)

    @property
    def validation_split(self) -> str:
        return "validation" if "validation" in self.validation.splits else "train"

    def describe(self) -> str:
        where = {EMBEDDED: "the embedded corpus (no data.manifest)", LOCAL: f"local shards in {self.train_root}"}
        return f"data {self.fingerprint[:16]} from {where.get(self.origin, self.origin)}"


@dataclass(frozen=True)
class RunData:
    """The data a peer trains and validates on, on disk: its identity and the shards it reads."""

    identity: DataIdentity
    train_shards: list[str] | None  # this partition's shards; None: all (the loader splits windows)
    tokenizer: Path | None
    fetched: FetchReport | None = None

    @property
    def partitioned(self) -> bool:
        return self.train_shards is not None

    def open(self, vocab_size: int, verify: bool = True) -> tuple[TokenDataset, TokenDataset]:
        """The train shards this peer reads and the validation shards, checked against the model's vocab."""
        ident = self.identity

        def dataset(root: Path, manifest: Manifest, split: str, only: list[str] | None) -> TokenDataset:
            checks = {"vocab_size": vocab_size, "tokenizer": self.tokenizer, "verify": verify}
            return TokenDataset(
                root, manifest=manifest, split=split, only=only, hashed=self.fetched is not None, **checks
            )

        train = dataset(ident.train_root, ident.train, "train", self.train_shards)
        validation = dataset(ident.validation_root, ident.validation, ident.validation_split, None)
        return train, validation

    def resumes(self, partition: int, fingerprint: str | None, current: int) -> bool:
        """Whether a checkpoint's data position (of ``partition`` of data ``fingerprint``) applies here:
        always for window-split data; for a data.manifest run only on the same shards."""
        same = partition == current and fingerprint in (None, self.identity.fingerprint)
        return same or not self.partitioned

    def describe_read(self) -> str:
        """What this peer reads, for its log: its train shards and tokens, and the validation tokens."""
        s = self.summary()
        return (
            f"{s['train_shards']} of {s['train_shards_in_run']} train shards ({s['train_tokens']:,} tokens), "
            f"{s['validation_tokens']:,} validation tokens ({s['dtype']})"
        )

    def summary(self) -> dict[str, Any]:
        """What the peer's log and summary.json say about its data."""
        ident = self.identity
        read = set(self.train_shards) if self.train_shards is not None else None
        shards = [s for s in ident.train.shards("train") if read is None or s.path in read]
        out: dict[str, Any] = {
            "fingerprint": ident.fingerprint,
            "origin": ident.origin,
            "train_shards": len(shards),
            "train_shards_in_run": len(ident.train.shards("train")),
            "train_tokens": sum(s.num_tokens for s in shards),
            "validation_tokens": ident.validation.num_tokens(ident.validation_split),
            "dtype": ident.train.dtype,
        }
        if self.fetched is not None:
            out["fetched_bytes"] = self.fetched.bytes_fetched
            out["fetched_from"] = dict(self.fetched.by_source)
            out["reused_files"] = self.fetched.reused
        return out


def cache_root(cfg: Config) -> Path:
    """Where fetched run data lives: ``data.cache_dir``, else ``$P2P_SPES_CACHE/data``."""
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else default_cache_dir() / "data"


def manifest_root(cfg: Config, fingerprint: str) -> Path:
    """Where a data.manifest run's files are on this machine: the directory a path names (read in place),
    else this peer's cache of data ``fingerprint``."""
    local = local_root(cfg.data.manifest) if cfg.data.manifest is not None else None
    return local if local is not None else cache_root(cfg) / fingerprint[:16]


def load_manifest(location: str, peers: Callable[[], Sequence[Source]] = lambda: ()) -> tuple[Manifest, bytes]:
    """The manifest ``data.manifest`` names: from its URL, else from a peer of the run (checked against
    the fingerprint the peer says it holds)."""
    errors = []
    candidates: list[Callable[[], Sequence[Source]]] = [lambda: [origin_source(location)], peers]
    for listed in candidates:
        for source in listed():
            try:
                raw = source.manifest()
                manifest = decode_manifest(raw, f"{location} (from {source.name})")
            except DataError as exc:
                errors.append(str(exc))
                continue
            if source.fingerprint is not None and manifest.fingerprint != source.fingerprint:
                errors.append(f"{source.name} serves data {manifest.fingerprint[:16]}, not {source.fingerprint[:16]}")
                continue
            if source.fingerprint is not None:
                log.warning("%s does not answer: read the run's manifest from %s", location, source.name)
            return manifest, raw
    raise DataError(
        f"cannot read the run's data manifest {location}: "
        + "; ".join(errors or ["no peer of the run serves it"])
        + ". Check that the organiser's file server is up, or wait until a peer that holds the data is online"
    )


def identify_data(cfg: Config, peers: Callable[[], Sequence[Source]] = lambda: ()) -> DataIdentity:
    """Which data ``cfg`` trains on; ``peers`` are asked for a data.manifest's manifest if its URL fails."""
    data = cfg.data
    if data.manifest is not None:  # config_checks.py refuses data.train/data.validation beside it
        manifest, raw = load_manifest(data.manifest, peers)
        if "validation" not in manifest.splits:
            raise DataError(
                f"the run's data {data.manifest} has no validation split; tokenize it with --validation-fraction F "
                "or --validation-input FILES"
            )
        root = manifest_root(cfg, manifest.fingerprint)
        fetch = local_root(data.manifest) is None
        return DataIdentity(manifest.fingerprint, data.manifest, manifest, manifest, root, root, raw, fetch=fetch)
    if data.train is None:
        if data.validation is not None:
            raise ConfigError("data.validation is set but data.train is not; set both or neither")
        root = prepare_embedded_data()
        manifest = read_manifest(root)
        return DataIdentity(manifest.fingerprint, EMBEDDED, manifest, manifest, root, root)
    train_root = Path(data.train).expanduser()
    train = read_manifest(train_root)
    if data.validation is None:
        if "validation" not in train.splits:
            raise ConfigError(
                "data.train is set but data.validation is not, and its directory has no validation split; "
                "tokenize a held-out split (--validation-fraction) or set data.validation"
            )
        return DataIdentity(train.fingerprint, LOCAL, train, train, train_root, train_root)
    validation_root = Path(data.validation).expanduser()
    validation = read_manifest(validation_root)
    return DataIdentity(combined_fingerprint(train, validation), LOCAL, train, validation, train_root, validation_root)


def manifest_tokenizer(cfg: Config, fingerprint: str | None) -> Path | None:
    """Where the tokenizer of a data.manifest run is on this machine (its directory, or this peer's cache
    of data ``fingerprint``), or None if it is not here."""
    if cfg.data.manifest is None or (fingerprint is None and local_root(cfg.data.manifest) is None):
        return None
    candidate = manifest_root(cfg, fingerprint or "") / "tokenizer"
    return candidate if (candidate / "tokenizer.json").is_file() else None


def _tokenizer(cfg: Config, identity: DataIdentity) -> Path | None:
    if cfg.data.tokenizer is not None:
        return Path(cfg.data.tokenizer).expanduser()
    if identity.origin == EMBEDDED:
        return embedded_tokenizer_path()
    if identity.train.tokenizer.files:
        return identity.train_root / "tokenizer"
    return None


def prepare_data(
    cfg: Config,
    identity: DataIdentity,
    partition: int,
    sources_for: Callable[[FileEntry], Sequence[Source]] | None = None,
    *,
    progress: bool = True,
) -> RunData:
    """Bring the files this peer reads to disk: a data.manifest run fetches its partition's shards,
    the validation shards and the tokenizer; the other kinds are on disk already."""
    if identity.origin in (EMBEDDED, LOCAL):
        return RunData(identity, None, _tokenizer(cfg, identity))
    manifest = identity.train
    shared = cfg.data.partition == "shared"
    shards = (
        [s.path for s in manifest.shards("train")] if shared else partition_shards(manifest, partition, cfg.peer.count)
    )
    read = None if shared else shards  # shared: every peer reads all of it, its loader seeded by its partition
    if not identity.fetch:  # a local data.manifest: read in place
        return RunData(identity, read, _tokenizer(cfg, identity))
    wanted = set(shards)
    entries = [
        *manifest.tokenizer.files,
        *manifest.shards("validation"),
        *(s for s in manifest.shards("train") if s.path in wanted),
    ]
    root = identity.train_root
    root.mkdir(parents=True, exist_ok=True)
    origin = origin_source(identity.origin)

    def sources(entry: FileEntry) -> list[Source]:
        return [origin, *(sources_for(entry) if sources_for is not None else ())]

    fetcher = Fetcher(root, sources, cache_root=cache_root(cfg), cache_gb=cfg.data.cache_gb, progress=progress)
    report = fetcher.fetch(entries)
    if identity.manifest_bytes is not None:
        _keep_manifest(root, identity.manifest_bytes)
    log.info(
        "data %s: %d files (%d already cached), %.1f MB fetched (%s)",
        identity.fingerprint[:16],
        report.files,
        report.reused,
        report.bytes_fetched / 1e6,
        ", ".join(f"{name}: {n / 1e6:.1f} MB" for name, n in report.by_source.items()) or "nothing new",
    )
    return RunData(identity, read, _tokenizer(cfg, identity), report)


def _keep_manifest(root: Path, raw: bytes) -> None:
    """The manifest next to the files, so that this peer can serve both, and read the data again offline."""
    path = root / MANIFEST_NAME
    if not path.is_file() or path.read_bytes() != raw:
        tmp = root / f".{MANIFEST_NAME}.{os.getpid()}.tmp"  # peers sharing a cache write their own
        tmp.write_bytes(raw)
        tmp.replace(path)
