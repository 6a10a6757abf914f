"""Fetch the files of a run's data a peer reads into its cache: resumable, checked, from the best source.

Every file is downloaded to ``NAME.part`` and resumed from its size when a download is cut short, then
checked against the manifest's size and SHA-256 before it is renamed into place: a truncated or
corrupt file is deleted and fetched again (from another source if the first keeps failing), never
trained on. Sources are tried by what we know of them: one that failed goes to the back, the others
by the rate they delivered so far (an untried source is tried before a slow one). With a cache limit,
files this peer no longer reads are evicted, oldest first, to make room.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from p2p_spes.data_manifest import FileEntry, Manifest
from p2p_spes.data_sources import Source, SourceError
from p2p_spes.errors import DataError
from p2p_spes.tokenizer_files import file_sha256

log = logging.getLogger(__name__)
GB = 1 << 30


def partition_shards(manifest: Manifest, partition: int, count: int) -> list[str]:
    """The train shards data partition ``partition`` of ``count`` reads: shard i goes to partition i mod count.

    Round-robin keeps partitions within one shard of each other in size and lets every peer know every
    partition's shards from the manifest alone.
    """
    shards = manifest.shards("train")
    if len(shards) < count:
        raise DataError(
            f"the run's data has {len(shards)} train shards, fewer than its {count} data partitions "
            "(peer.count), so some peers would read nothing; tokenize it into more shards (a smaller "
            "--shard-tokens) or run fewer partitions"
        )
    if not 0 <= partition < count:
        raise DataError(f"data partition {partition} is not in [0, {count})")
    return [s.path for i, s in enumerate(shards) if i % count == partition]


@dataclass
class FetchReport:
    """What a fetch did: files and bytes by where they came from, and what it evicted."""

    files: int = 0
    reused: int = 0  # already in the cache and intact
    bytes_fetched: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    refetched: int = 0  # downloads that failed their check and were fetched again
    evicted_bytes: int = 0
    seconds: float = 0.0

    def count(self, source: str, nbytes: int) -> None:
        """``nbytes`` came from ``source`` (whether or not that download then succeeded)."""
        self.bytes_fetched += nbytes
        if nbytes:
            self.by_source[source] = self.by_source.get(source, 0) + nbytes


@dataclass
class _Track:
    """What we measured of one source."""

    failures: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class Fetcher:
    """Brings files of a manifest into ``root`` from the sources ``sources_for`` names for each file."""

    def __init__(
        self,
        root: Path,
        sources_for: Callable[[FileEntry], Sequence[Source]],
        *,
        cache_root: Path | None = None,
        cache_gb: float | None = None,
        attempts: int = 4,
        progress: bool = True,
    ) -> None:
        """``cache_root`` (the directory holding every run's data, ``root`` among them) is what the
        ``cache_gb`` limit counts and evicts from."""
        self.root = Path(root)
        self.sources_for = sources_for
        self.cache_root = Path(cache_root) if cache_root is not None else self.root
        self.cache_gb = cache_gb
        self.attempts = attempts
        self.progress = progress
        self.tracks: dict[str, _Track] = {}

    def fetch(self, entries: Sequence[FileEntry]) -> FetchReport:
        """Make every entry present and intact under ``root``; DataError if one cannot be fetched."""
        t0 = time.monotonic()
        report = FetchReport(files=len(entries))
        missing = [e for e in entries if not self._intact(e)]
        report.reused = len(entries) - len(missing)
        if not missing:
            return report
        report.evicted_bytes = self._make_room(entries, sum(e.bytes for e in missing))
        total = sum(e.bytes - self._partial_size(e) for e in missing)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="fetching data", disable=not self.progress, leave=False
        ) as bar:
            for entry in missing:
                self._fetch_one(entry, report, bar)
        report.seconds = time.monotonic() - t0
        return report

    # One file --------------------------------------------------------------------------------------
    def _target(self, entry: FileEntry) -> Path:
        return self.root / entry.path

    def _part(self, entry: FileEntry) -> Path:
        """Where ``entry`` is downloaded to before it is checked."""
        target = self._target(entry)
        return target.with_name(target.name + ".part")

    def _partial_size(self, entry: FileEntry) -> int:
        part = self._part(entry)
        return part.stat().st_size if part.is_file() else 0

    def _intact(self, entry: FileEntry) -> bool:
        target = self._target(entry)
        if not target.is_file() or target.stat().st_size != entry.bytes:
            return False
        if file_sha256(target) == entry.sha256:
            return True
        log.warning("%s in the cache fails its checksum: fetching it again", target)
        target.unlink()
        return False

    def _ordered(self, entry: FileEntry) -> list[Source]:
        sources = list(self.sources_for(entry))
        if not sources:
            raise DataError(
                f"no source has {entry.path}: the URL data.manifest names does not answer and no live peer "
                "holds it; start the organiser's file server again, or wait for a peer that holds it"
            )
        tracks = [self.tracks.setdefault(s.name, _Track()) for s in sources]
        order = sorted(range(len(sources)), key=lambda i: (tracks[i].failures, -tracks[i].rate))
        return [sources[i] for i in order]

    def _fetch_one(self, entry: FileEntry, report: FetchReport, bar: tqdm) -> None:
        """Fetch one file, holding its lock: peers on one machine share a cache, and the validation
        shards and the tokenizer are wanted by all of them at once."""
        target = self._target(entry)
        target.parent.mkdir(parents=True, exist_ok=True)
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        with open(locks / (entry.path.replace("/", "__") + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._intact(entry):  # another process fetched it while we waited
                report.reused += 1
                return
            self._download(entry, target, report, bar)

    def _download(self, entry: FileEntry, target: Path, report: FetchReport, bar: tqdm) -> None:
        part = self._part(entry)
        errors: list[str] = []
        for attempt in range(self.attempts):
            for source in self._ordered(entry):
                track = self.tracks[source.name]
                offset = self._partial_size(entry)
                if offset > entry.bytes:
                    part.unlink()
                    offset = 0
                t0 = time.monotonic()
                got = 0
                try:
                    if offset < entry.bytes:
                        with open(part, "ab") as out:
                            for chunk in source.read(entry.path, offset):
                                if offset + got + len(chunk) > entry.bytes:
                                    raise SourceError(
                                        f"{source.name} sent more than the {entry.bytes} bytes of {entry.path}"
                                    )
                                out.write(chunk)
                                got += len(chunk)
                                bar.update(len(chunk))
                    track.bytes += got
                    track.seconds += time.monotonic() - t0
                    report.count(source.name, got)
                except (SourceError, OSError) as exc:
                    track.failures += 1
                    report.count(source.name, got)
                    errors.append(str(exc))
                    log.info("fetching %s from %s failed (%s)", entry.path, source.name, exc)
                    continue
                size = self._partial_size(entry)
                if size < entry.bytes:
                    track.failures += 1
                    errors.append(f"{source.name} ended {entry.path} at {size} of {entry.bytes} bytes")
                    continue
                digest = file_sha256(part)
                if digest != entry.sha256:
                    track.failures += 1
                    report.refetched += 1
                    bar.update(-min(got, entry.bytes))
                    errors.append(f"{entry.path} from {source.name} fails its checksum")
                    log.warning(
                        "%s from %s fails its checksum (sha256 %s...): fetching it again",
                        entry.path,
                        source.name,
                        digest[:12],
                    )
                    part.unlink()
                    continue
                os.replace(part, target)
                return
            time.sleep(min(2.0 * (attempt + 1), 5.0))
        raise DataError(
            f"could not fetch {entry.path} ({entry.bytes} bytes) after {self.attempts} rounds over its sources: "
            + "; ".join(errors[-4:])
        )

    # The cache limit -------------------------------------------------------------------------------
    def _make_room(self, keep: Sequence[FileEntry], incoming: int) -> int:
        """Evict files we do not read (oldest first) until ``incoming`` bytes fit under ``cache_gb``."""
        if self.cache_gb is None:
            return 0
        limit = int(self.cache_gb * GB)
        kept = {self._target(e).resolve() for e in keep}
        files = [p for p in self.cache_root.rglob("*") if p.is_file()]
        used = sum(p.stat().st_size for p in files)
        freed = 0
        victims = sorted(
            (p for p in files if p.resolve() not in kept and p.name != "manifest.json" and p.suffix != ".lock"),
            key=lambda p: p.stat().st_mtime,
        )
        for victim in victims:
            if used - freed + incoming <= limit:
                break
            size = victim.stat().st_size
            victim.unlink()
            freed += size
            log.info("evicted %s (%d bytes) from the data cache", victim, size)
        if used - freed + incoming > limit:
            need = (sum(e.bytes for e in keep)) / GB
            raise DataError(
                f"the data this peer reads needs {need:.2f} GB in its cache, more than data.cache_gb "
                f"{self.cache_gb:g}; raise data.cache_gb or free space under {self.cache_root}"
            )
        return freed
