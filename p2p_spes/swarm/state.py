"""What a peer serves and fetches: frozen snapshots of its weights over the ``{run}.state`` RPC.

A peer serves, by uid, the shared parameters (``shared``), each expert it trains (``expert:E``), its
Nesterov momentum and anchors, a frozen copy of any other expert it holds (so an expert whose
holders all left survives), and each group's last encoded average (``update:UID``), from which a
peer holding the group's anchor rebuilds the new value without downloading it whole. Each entry is frozen at a sync boundary and named by its digest, so a
peer that asks for ``expert:3@<digest>`` gets exactly the agreed version or an error, never a newer
one; the previous version is kept one round so late refreshers still find it. Tensors go out as
hivemind protobuf parts (never pickles) and every download is checked against the digest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from dht.auth import RunAuth
from dht.reachability import reachable_first
from p2p_spes.averaging import (
    TransportError,
    TruncatedStream,
    collect_tensors,
    pack,
    parse_tensor,
    serialize_parts,
    tensor_digest,
    unpack,
)
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.pacing import Deadlines
from p2p_spes.swarm.runtime import Runtime

log = logging.getLogger(__name__)
Entry = tuple[dict, list[torch.Tensor]]  # (meta: round, step, digest; tensors)


class StateServer:
    """The snapshot this peer serves and the RPC handler that streams it to members of the run."""

    def __init__(
        self,
        runtime: Runtime,
        auth: RunAuth,
        stats: SwarmCounters,
        refresh_members: Callable[[], Awaitable[set[str]]],
        anchors: Callable[[], dict[str, torch.Tensor]],
        public: Callable[[MoETransformer], dict[str, list[torch.Tensor]]] | None = None,
    ) -> None:
        """``refresh_members`` re-reads the run's members (private runs); ``anchors`` returns the outer
        optimizer's anchors by group uid (they are replaced, never written in place: safe to stream);
        ``public`` the values to serve instead of the model's for groups whose weights run ahead of
        what the others can follow (a lone holder under a lossy codec)."""
        self.runtime, self.auth, self.stats = runtime, auth, stats
        self._refresh_members, self._anchors = refresh_members, anchors
        self._public = public or (lambda model: {})
        self.members: set[str] = set()
        self.model: MoETransformer | None = None
        self._snapshot: dict[str, list[Entry]] = {}
        self._updates: dict[str, list[Entry]] = {}  # uid -> [(meta: digest, base; encoded parts)], newest last
        self._kept: tuple[int, dict[str, Entry]] = (-1, {})  # (round, frozen copies as they were before a merge)

    async def start(self) -> None:
        await self.runtime.p2p.add_protobuf_handler(
            f"{self.runtime.run_id}.state", self._rpc_state, runtime_pb2.ExpertUID, stream_output=True
        )

    def take_snapshot(self, round_no: int, step: int, momentum: dict[str, torch.Tensor]) -> None:
        """Freeze what this peer serves: the round's shared parameters, trained experts and momentum.

        The previous version of each entry is kept too, so a peer still refreshing from this round
        gets the pre-merge tensors it asks for (by digest) even after we merged.
        """
        model = self.model
        entries = {"shared": [p.detach().cpu().clone() for _, p in model.shared_parameters()]}
        for e in model.local_experts:
            entries[f"expert:{e}"] = [t.detach().cpu().clone() for t in model.expert_tensors(e)]
        entries.update({uid: [t.cpu().clone() for t in tensors] for uid, tensors in self._public(model).items()})
        for uid, value in momentum.items():
            entries[f"momentum:{uid}"] = [value.clone()]
        snapshot = {}
        for uid, tensors in entries.items():
            meta = {"round": round_no, "step": step, "digest": tensor_digest(tensors)}
            previous = [v for v in self._snapshot.get(uid, [])[-1:] if v[0]["digest"] != meta["digest"]]
            snapshot[uid] = previous + [(meta, tensors)]
        self._snapshot = snapshot
        if self._kept[0] < round_no:
            self._kept = (-1, {})

    def keep_copies(self, round_no: int) -> None:
        """Serve our frozen copies as they are now (the agreed versions) until the next round's snapshot:
        a warm-up merge is about to change them, and a private peer refreshing an expert only private
        peers train can take the agreed version from no one but a reachable peer's copy."""
        model = self.model
        held = [e for e in model.held_experts() if e not in model.local_experts]
        copies = {f"expert:{e}": self._frozen_copy(f"expert:{e}") for e in held}
        self._kept = (round_no, {uid: entry for uid, entry in copies.items() if entry is not None})

    def keep_update(self, uid: str, base: str, digest: str, messages: list[torch.Tensor]) -> None:
        """Serve the encoded average that took ``uid`` from the anchor ``base`` (a flat digest) to the
        value ``digest``, as ``update:UID@digest``; the previous one is kept one round, like snapshots."""
        entry = ({"digest": digest, "base": base, "parts": len(messages)}, list(messages))
        self._updates[uid] = [e for e in self._updates.get(uid, [])[-1:] if e[0]["digest"] != digest] + [entry]

    def current(self, uid: str) -> dict:
        """The meta (round, step, digest) of the newest version of ``uid`` we serve."""
        return self._snapshot[uid][-1][0]

    def _frozen_copy(self, uid: str) -> Entry | None:
        """A frozen expert's current copy, served so that an expert whose holders all left survives."""
        try:
            expert = int(uid.split(":", 1)[1])
        except ValueError:
            return None
        model = self.model
        if model is None or expert not in model.held_experts() or expert in model.local_experts:
            return None
        tensors = [t.detach().cpu().clone() for t in model.expert_tensors(expert)]
        shared = self.current("shared")
        return {"round": shared["round"], "step": shared["step"], "digest": tensor_digest(tensors)}, tensors

    def lookup(self, uid: str, digest: str) -> Entry | None:
        """The entry served for ``uid`` (at ``digest`` when given), or None. ``meta:UID`` is the newest
        entry's meta (round, step, digest) with no tensors: what a joiner asks before downloading."""
        if uid.startswith("meta:"):
            versions = self._snapshot.get(uid[len("meta:") :], [])
            return (versions[-1][0], []) if versions else None
        if uid.startswith("update:"):
            return next((v for v in self._updates.get(uid[len("update:") :], []) if v[0]["digest"] == digest), None)
        versions = self._snapshot.get(uid, [])
        entry = next((v for v in versions if v[0]["digest"] == digest), None) if digest else (versions or [None])[-1]
        anchors = self._anchors()
        if entry is None and uid.startswith("anchor:") and uid[len("anchor:") :] in anchors:
            anchor = anchors[uid[len("anchor:") :]]
            entry = ({"digest": tensor_digest([anchor])}, [anchor])
        if entry is None and uid.startswith("expert:"):
            entry = self._frozen_copy(uid)
            if entry is not None and digest and entry[0]["digest"] != digest:
                kept = self._kept[1].get(uid)
                entry = kept if kept is not None and kept[0]["digest"] == digest else None
        return entry

    async def _rpc_state(self, request: runtime_pb2.ExpertUID, context):
        uid, _, digest = request.uid.partition("@")
        caller = context.remote_id.to_base58()
        if self.auth.private and caller not in self.members:
            self.members = await self._refresh_members()
        if not self.auth.admits(caller, self.members):
            log.warning("refused %s to %s: not a member of this private run", request.uid, caller)
            yield averaging_pb2.DownloadData(metadata=pack({"error": "not authorized for this run"}))
            return
        entry = self.lookup(uid, digest)
        if entry is None:
            yield averaging_pb2.DownloadData(metadata=pack({"error": f"not serving {request.uid!r}"}))
            return
        meta, tensors = entry
        if not tensors:  # a meta-only answer
            yield averaging_pb2.DownloadData(metadata=pack(meta))
            return
        first = True
        for tensor in tensors:
            for chunk in serialize_parts(tensor):
                yield averaging_pb2.DownloadData(tensor_part=chunk, metadata=pack(meta) if first else b"")
                first = False


class Downloader:
    """Fetches served entries from other peers, checking each against the digest it was served under."""

    def __init__(
        self,
        runtime: Runtime,
        stats: SwarmCounters,
        timeout: float,
        deadlines: Deadlines | None = None,
        private: Callable[[], set[str]] = set,
    ) -> None:
        """``timeout`` bounds every download; with ``deadlines`` a download's deadline is its size over
        the rate observed so far (at most ``timeout``), and each finished download is measured.
        ``private`` names the peers nobody can dial: :meth:`first_of` asks them last."""
        self.runtime, self.stats, self.timeout, self.deadlines = runtime, stats, timeout, deadlines
        self.private = private

    def deadline(self, like: Sequence[torch.Tensor]) -> float:
        """Seconds one download of tensors shaped like ``like`` may take."""
        if self.deadlines is None:
            return self.timeout
        return min(self.deadlines.transfer_timeout(sum(t.numel() * t.element_size() for t in like)), self.timeout)

    async def fetch(self, peer: str, uid: str, like: Sequence[torch.Tensor]) -> Entry:
        """One download of ``uid`` from ``peer`` into tensors shaped like ``like``."""
        stream = await self.runtime.p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer),
            f"{self.runtime.run_id}.state",
            runtime_pb2.ExpertUID(uid=uid),
            averaging_pb2.DownloadData,
        )
        metadata, parts = await collect_tensors(stream)
        if not metadata and not parts:
            raise TruncatedStream(f"{peer} closed the stream of {uid} before sending anything")
        meta = unpack(metadata) if metadata else {}
        if not isinstance(meta, dict) or "error" in meta or "digest" not in meta:
            raise TransportError(f"{peer} did not serve {uid}: {meta.get('error') if isinstance(meta, dict) else meta}")
        if uid.startswith("meta:"):
            return meta, []  # what it serves, not the tensors: nothing to check against the digest
        if uid.startswith("update:"):  # encoded parts: the caller decodes them and checks the result's digest
            if not parts or len(parts) > 4096 or not isinstance(meta.get("base"), str):
                raise TransportError(f"{peer} served a malformed update for {uid}")
            messages = [parse_tensor(p) for p in parts]
            if any(m.dtype != torch.uint8 or m.dim() != 1 for m in messages):
                raise TransportError(f"{peer} served an update for {uid} that is not encoded messages")
            return meta, messages
        if len(parts) != len(like):
            raise TransportError(f"{peer} sent {len(parts)} tensors for {uid}, expected {len(like)}")
        tensors = [parse_tensor(p, tuple(t.shape), t.dtype) for p, t in zip(parts, like)]
        wanted = uid.partition("@")[2] or meta["digest"]
        if tensor_digest(tensors) != meta["digest"] or meta["digest"] != wanted:
            raise TransportError(f"{uid} from {peer} does not match the digest it announced")
        return meta, tensors

    def download(self, peer: str, uid: str, like: Sequence[torch.Tensor], attempts: int = 4) -> Entry:
        """Fetch ``uid`` from ``peer``, retrying briefly: a fresh libp2p dial can be refused once.

        A peer that did not answer within ``timeout`` is not asked again: it is frozen or gone, and a
        retry would only hold the round up for another timeout.
        """
        for attempt in range(attempts):
            try:
                t0 = time.monotonic()
                entry = self.runtime.call(asyncio.wait_for(self.fetch(peer, uid, like), self.deadline(like)))
                if self.deadlines is not None:
                    self.deadlines.observe_transfer(
                        sum(t.numel() * t.element_size() for t in entry[1]), time.monotonic() - t0
                    )
                return entry
            except TruncatedStream as exc:  # the connection closed mid-stream: ask again at once
                if attempt == attempts - 1:
                    raise
                log.info("download of %s from %s was cut short (%s); retrying", uid, peer, exc)
            except (TransportError, asyncio.TimeoutError):
                raise
            except Exception as exc:
                if attempt == attempts - 1:
                    raise
                log.info("download of %s from %s failed (%s); retrying", uid, peer, exc)
                time.sleep(2.0 * (attempt + 1))  # libp2p refuses re-dials for a few seconds after a failure
        raise AssertionError("unreachable")

    def update(self, peer: str, uid: str, digest: str, wire_bytes: int) -> Entry:
        """The encoded average that brought ``uid`` to ``digest``, from ``peer`` (meta names its base)."""
        deadline = (
            self.timeout if self.deadlines is None else min(self.deadlines.transfer_timeout(wire_bytes), self.timeout)
        )
        return self._fetch_uncut(peer, f"update:{uid}@{digest}", deadline)

    def meta(self, peer: str, uid: str) -> dict:
        """The (round, step, digest) of the newest ``uid`` that ``peer`` serves, without its tensors."""
        meta, _ = self._fetch_uncut(peer, f"meta:{uid}", self.timeout)
        return meta

    def _fetch_uncut(self, peer: str, uid: str, deadline: float, attempts: int = 3) -> Entry:
        """A tensor-less fetch (an update or a meta), asked again at once when the stream was cut short
        (hivemind ends a stream silently when its connection closes, as :meth:`download` also allows)."""
        for attempt in range(attempts):
            try:
                return self.runtime.call(asyncio.wait_for(self.fetch(peer, uid, []), deadline))
            except TruncatedStream as exc:
                if attempt == attempts - 1:
                    raise
                log.info("download of %s from %s was cut short (%s); retrying", uid, peer, exc)
        raise AssertionError("unreachable")

    def first_of(
        self,
        peers: Sequence[str],
        uid: str,
        like: Sequence[torch.Tensor],
        errors: list[str] | None = None,
        attempts: int = 2,
    ) -> tuple[str, Entry] | None:
        """The first of ``peers`` that serves ``uid`` (digest checked), with what it served; None if none did.
        Peers that can be dialled are asked first, in their order: a dial to a private peer fails (after
        a timeout, behind a firewall that drops it) unless a connection it opened to us carries it."""
        for peer in reachable_first(peers, self.private()):
            try:
                return peer, self.download(peer, uid, like, attempts=attempts)
            except Exception as exc:
                log.warning("could not fetch %s from %s: %s", uid, peer, exc)
                if errors is not None:
                    errors.append(f"{uid} from {peer[:12]}: {exc}")
        return None
