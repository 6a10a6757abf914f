"""The run's data, served peer to peer over the ``{run}.data`` RPC, so newcomers get their shards
when the organiser's file server is gone.

Every peer serves the files of its data that it holds intact (the manifest, the tokenizer, the
validation shards and the train shards of its partition) and says in its DHT record which train
shards those are. A request names the data's fingerprint, a file, an offset and a length; the answer
is a header, then the bytes in chunks. The fetcher (``data_fetch.py``) checks every file it assembles
against the manifest, so a peer that serves wrong bytes costs a retry, never a corrupt shard.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from dht.auth import RunAuth
from dht.reachability import is_private
from dht.records import PeerRecord
from p2p_spes.averaging import pack, unpack
from p2p_spes.data_manifest import MANIFEST_NAME, FileEntry, Manifest
from p2p_spes.data_sources import SourceError
from p2p_spes.swarm.runtime import Runtime

log = logging.getLogger(__name__)
WINDOW_BYTES = 4 << 20  # one request's bytes: a shard of hundreds of MB is asked for window by window
CHUNK_BYTES = 1 << 19  # one message's bytes, well under libp2p's message limit
RECORD_FIELD = "data"


@dataclass(frozen=True)
class Holding:
    """What a peer says it holds: the data's fingerprint and the indices of its train shards."""

    fingerprint: str
    shards: tuple[int, ...]

    def as_record(self) -> dict:
        return {"fingerprint": self.fingerprint, "shards": list(self.shards)}

    @classmethod
    def of(cls, record: PeerRecord) -> Holding | None:
        value = record.extra.get(RECORD_FIELD)
        if not isinstance(value, dict) or not isinstance(value.get("fingerprint"), str):
            return None
        shards = value.get("shards")
        ok = isinstance(shards, list) and all(isinstance(i, int) for i in shards)
        return cls(value["fingerprint"], tuple(shards) if ok else ())


def holding(manifest: Manifest, held: list[str] | None) -> Holding:
    """Our holding: ``held`` train shard paths (None: all of them)."""
    paths = [s.path for s in manifest.shards("train")]
    wanted = set(paths if held is None else held)
    return Holding(manifest.fingerprint, tuple(i for i, p in enumerate(paths) if p in wanted))


class DataServer:
    """Serves the files of the data we hold, from the directory they are in."""

    def __init__(self, runtime: Runtime, auth: RunAuth, refresh_members: Callable[[], Awaitable[set[str]]]) -> None:
        self.runtime, self.auth, self._refresh_members = runtime, auth, refresh_members
        self.members: set[str] = set()
        self._fingerprint: str | None = None
        self._root: Path | None = None
        self._files: dict[str, int] = {}  # path -> bytes, of the files we serve

    async def start(self) -> None:
        await self.runtime.p2p.add_protobuf_handler(
            f"{self.runtime.run_id}.data", self._rpc_data, runtime_pb2.ExpertUID, stream_output=True
        )

    def serve(self, manifest: Manifest, root: Path, held: list[str] | None) -> None:
        """Serve ``manifest``'s tokenizer and validation files and the ``held`` train shards (None: all)
        from ``root``, where they were fetched and checked."""
        wanted = None if held is None else set(held)
        train = [s for s in manifest.shards("train") if wanted is None or s.path in wanted]
        files: list[FileEntry] = [*manifest.tokenizer.files, *train]
        files += [s for name, split in manifest.splits.items() if name != "train" for s in split]
        self._files = {f.path: f.bytes for f in files if (root / f.path).is_file()}
        if (root / MANIFEST_NAME).is_file():
            self._files[MANIFEST_NAME] = (root / MANIFEST_NAME).stat().st_size
        self._root, self._fingerprint = root, manifest.fingerprint

    async def _rpc_data(self, request: runtime_pb2.ExpertUID, context):
        caller = context.remote_id.to_base58()
        if self.auth.private and caller not in self.members:
            self.members = await self._refresh_members()
        if not self.auth.admits(caller, self.members):
            yield averaging_pb2.DownloadData(metadata=pack({"error": "not authorized for this run"}))
            return
        try:
            fingerprint, offset, length, path = request.uid.split(":", 3)
            offset, length = int(offset), min(int(length), WINDOW_BYTES)
        except ValueError:
            yield averaging_pb2.DownloadData(metadata=pack({"error": f"malformed request {request.uid[:80]!r}"}))
            return
        size = self._files.get(path)
        if fingerprint != self._fingerprint or size is None or self._root is None:
            yield averaging_pb2.DownloadData(metadata=pack({"error": f"not serving {path} of data {fingerprint[:16]}"}))
            return
        length = max(0, min(length, size - offset))
        yield averaging_pb2.DownloadData(metadata=pack({"size": size, "length": length}))
        data = await asyncio.to_thread(_read_window, self._root / path, offset, length)  # off the event loop
        for start in range(0, len(data), CHUNK_BYTES):
            yield averaging_pb2.DownloadData(metadata=data[start : start + CHUNK_BYTES])


def _read_window(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as stream:
        stream.seek(offset)
        return stream.read(length)


class PeerSource:
    """One peer's data, read window by window over its ``{run}.data`` RPC."""

    def __init__(self, runtime: Runtime, peer: str, fingerprint: str, timeout: float = 120.0) -> None:
        """``timeout`` bounds one window: 4 MiB take 34 s at 1 Mbit/s."""
        self.runtime, self.peer, self.fingerprint, self.timeout = runtime, peer, fingerprint, timeout
        self.name = f"peer {peer[:12]}"

    async def _window(self, path: str, offset: int, length: int) -> tuple[int, bytes]:
        stream = await self.runtime.p2p.iterate_protobuf_handler(
            PeerID.from_base58(self.peer),
            f"{self.runtime.run_id}.data",
            runtime_pb2.ExpertUID(uid=f"{self.fingerprint}:{offset}:{length}:{path}"),
            averaging_pb2.DownloadData,
        )
        header: dict | None = None
        parts: list[bytes] = []
        async for message in stream:
            if header is None:
                header = unpack(message.metadata)
                if not isinstance(header, dict) or "error" in header:
                    raise SourceError(
                        f"{self.name} did not serve {path}: {header.get('error') if isinstance(header, dict) else header}"
                    )
            else:
                parts.append(message.metadata)
        if header is None:
            raise SourceError(f"{self.name} closed the stream of {path} before answering")
        data = b"".join(parts)
        if len(data) != header["length"]:
            raise SourceError(f"{self.name} cut {path} short ({len(data)} of {header['length']} bytes)")
        return int(header["size"]), data

    def _call(self, path: str, offset: int, length: int) -> tuple[int, bytes]:
        try:
            return self.runtime.call(self._window(path, offset, length), timeout=self.timeout)
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(f"{self.name}: {type(exc).__name__}: {exc}") from None

    def manifest(self) -> bytes:
        size, data = self._call(MANIFEST_NAME, 0, WINDOW_BYTES)
        if size > len(data):
            raise SourceError(f"{self.name} serves a manifest larger than one window")
        return data

    def read(self, path: str, offset: int) -> Iterator[bytes]:
        while True:
            size, data = self._call(path, offset, WINDOW_BYTES)
            if not data:
                return
            yield data
            offset += len(data)
            if offset >= size:
                return


def peer_sources(
    runtime: Runtime, records: dict[str, PeerRecord], fingerprint: str, me: str, shard: int | None = None
) -> list[PeerSource]:
    """Peers that hold data ``fingerprint`` (and, given ``shard``, that train shard), in random order, so
    that newcomers spread over them; holders nobody can dial only when no other holds it."""
    peers = []
    for peer, record in records.items():
        held = Holding.of(record)
        if (
            peer != me
            and held is not None
            and held.fingerprint == fingerprint
            and (shard is None or shard in held.shards)
        ):
            peers.append(peer)
    random.shuffle(peers)
    # a dial to a private peer fails (after a timeout, behind a firewall that drops it) unless a connection
    # it opened to us carries it: worth a try only when nobody else holds the file
    reachable = [p for p in peers if not is_private(records[p].extra)]
    return [PeerSource(runtime, p, fingerprint) for p in reachable or peers]


def holders_of(
    runtime: Runtime, records: dict[str, PeerRecord], manifest: Manifest, entry: FileEntry, me: str
) -> list[PeerSource]:
    """Peers that hold ``entry`` of ``manifest``: any holder for the tokenizer and validation files, those
    that say they hold it for a train shard."""
    index = next((i for i, s in enumerate(manifest.shards("train")) if s.path == entry.path), None)
    return peer_sources(runtime, records, manifest.fingerprint, me, index)
