"""A peer of the swarm: joins the DHT, picks experts, and syncs with the others every ``sync_steps``.

One round of sync (no server anywhere):

1. the shared parameters are all-reduced across every live peer, weighted by tokens since the
   last sync;
2. each expert this peer holds is all-reduced among that expert's holders (a lone holder's copy is
   the truth);
3. digests of what each peer now holds are published; every peer downloads the experts it does
   not hold from a holder, once, and checks the digest;
4. at merge rounds every peer applies the same warm-up merge to the same state.

A group that fails (a peer died, a deadline passed) is discarded whole: the peer keeps its own
values for that group and tries again next round.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import hashlib
import logging
import os
import signal
import statistics
import threading
import time
from collections import Counter, deque
from typing import Any, Collection, Coroutine

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time

from dht.auth import load_auth
from dht.keys import config_key, peers_key, run_config_key, version_key
from dht.node import start_dht
from dht.records import PeerRecord, signed_values
from dht.run_config import run_config_record
from p2p_spes import __version__
from p2p_spes.aggregation import build_aggregator
from p2p_spes.allreduce import GroupAllReduce, GroupResult
from p2p_spes.config import Config
from p2p_spes.errors import SwarmError
from p2p_spes.healing import initial_expert, plan_takeover
from p2p_spes.merging import merge_alpha, merge_experts
from p2p_spes.placement import free_partition, least_covered
from p2p_spes.transport import TransportError, collect_tensors, pack, parse_tensor, serialize_parts, tensor_digest, unpack

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this (forked) process when its parent dies, so no DHT outlives a trainer."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _patch_child_spawns() -> None:
    """In the DHT process: make the p2pd daemon it spawns die with it, too."""
    _die_with_parent()
    import asyncio.subprocess as aio_subprocess

    original = aio_subprocess.create_subprocess_exec

    async def exec_dying_with_parent(*args, **kwargs):
        kwargs.setdefault("preexec_fn", _die_with_parent)
        return await original(*args, **kwargs)

    aio_subprocess.create_subprocess_exec = exec_dying_with_parent


_FORK_HOOK_INSTALLED = False
DHT_REQUEST_TIMEOUT = 20.0  # seconds; a DHT get/store that takes longer is given up on


def version_window(sw) -> float:
    """How long a peer waits after its groups for the others' digests: their rounds start up to a
    join window apart."""
    return sw.matchmaking_time + 2.0


def sync_deadline(sw) -> float:
    """The longest a sync round can hold a peer up, whatever the others do: join window, averaging
    timeout, then the version window (downloads of refreshed experts come on top, bounded by size)."""
    return sw.matchmaking_time + sw.averaging_timeout + version_window(sw)


def group_id(members) -> str:
    """A short name for a group's exact membership: peers with the same one must agree on its result."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:12]


def flatten(tensors) -> torch.Tensor:
    """One flat fp32 CPU vector of ``tensors``, in order: the unit every group averages."""
    return torch.cat([t.detach().float().cpu().reshape(-1) for t in tensors])


def model_defining(cfg: Config) -> dict[str, Any]:
    model = dataclasses.asdict(cfg.model)
    moe = {k: getattr(cfg.moe, k) for k in ("num_experts", "top_k", "ffn_dim", "normalize_top_k")}
    return {"model": model, "moe": moe}


def describe_difference(ours: dict, theirs: dict) -> str:
    diffs = []
    for section in sorted(set(ours) | set(theirs)):
        a, b = ours.get(section, {}), theirs.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{section}.{key}: ours {a.get(key)!r}, run's {b.get(key)!r}")
    return "; ".join(diffs) or "fingerprints differ"


def round_summary(report: dict[str, Any]) -> dict[str, Any]:
    """What the inspector shows of a round (published in the peer's record, so kept small)."""
    groups = report["groups"]
    return {
        "round": report["round"], "step": report["step"], "members": groups["shared"]["members"],
        "ok": bool(groups["shared"]["ok"]), "seconds": round(report["seconds"], 3),
        "bytes_sent": report["bytes_sent"], "bytes_received": report["bytes_received"],
        "failed_groups": sum(1 for g in groups.values() if not g["ok"]),
    }


class Swarm:
    """Owns the DHT, an event loop thread, the RPC handlers and the sync rounds of one peer."""

    def __init__(self, cfg: Config) -> None:
        global _FORK_HOOK_INSTALLED
        self.cfg = cfg
        sw = cfg.swarm
        self.auth = load_auth(sw.secret_file, sw.allowed_peers)
        self.run_id = self.auth.keyspace(sw.run_id)  # a private run's keys live under a secret-derived name
        self._members: set[str] = set()  # peers with a valid record in the run (private runs: proof of the secret)
        self.fingerprint = cfg.model_fingerprint()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="p2p-spes-swarm", daemon=True)
        self._thread.start()
        if not _FORK_HOOK_INSTALLED:
            os.register_at_fork(after_in_child=_patch_child_spawns)
            _FORK_HOOK_INSTALLED = True
        self.dht, self.identity = self._start_dht()
        self.peer_id = self.identity.peer_id
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.p2p = self.call(self.dht.replicate_p2p())
        self.reducer = GroupAllReduce(
            self.dht, self.p2p, self.peer_id, self.run_id, owner=self.identity.owner, compression=sw.compression,
            matchmaking_time=sw.matchmaking_time, timeout=sw.averaging_timeout,
            aggregate=build_aggregator(sw.aggregation, trim_fraction=sw.trim_fraction, clip_tau=sw.clip_tau),
        )
        self.call(self.reducer.start())
        self.call(self.p2p.add_protobuf_handler(
            f"{self.run_id}.state", self._rpc_state, runtime_pb2.ExpertUID, stream_output=True
        ))
        self.model = None
        self.status: dict[str, Any] = {}
        self.stats = Counter()
        self._snapshot: dict[str, tuple[dict, list[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self._heartbeat: asyncio.Future | None = None
        self.rounds: list[dict[str, Any]] = []
        self._last_versions: dict[str, dict] = {}  # the digests published in our last round, by peer
        self._planned_before: set[int] = set()  # experts the takeover plan gave us at the last boundary
        self._most_holders: Counter = Counter()  # per expert, the most holders we have seen it have
        self._claimed: list[int] = []
        self.run_config = run_config_record(cfg)  # published once the model check passed
        self._published: list[tuple[str, dict[str, Any]]] = []
        self._momentum: dict[str, torch.Tensor] = {}  # Nesterov outer momentum per group uid
        self._anchor: dict[str, torch.Tensor] = {}  # Nesterov: the value each group last agreed on
        self._moves: dict[str, deque[float]] = {}  # recent relative moves of accepted results, per kind

    # Plumbing ------------------------------------------------------------------------------
    def call(self, coro: Coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _start_dht(self):
        from hivemind.utils.multiaddr import Multiaddr

        sw = self.cfg.swarm
        for maddr in list(sw.initial_peers) + list(sw.host_maddrs) + list(sw.announce_maddrs):
            try:
                Multiaddr(maddr)
            except Exception:
                raise SwarmError(f"{maddr!r} is not a multiaddr; expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/PEER_ID") from None
        for maddr in sw.initial_peers:
            if "/p2p/" not in maddr:
                raise SwarmError(f"{maddr!r} lacks the peer id: a bootstrap address ends in /p2p/PEER_ID")
        try:
            return start_dht(
                sw.identity_path, [self.run_id], auth=self.auth, initial_peers=list(sw.initial_peers) or None,
                host_maddrs=list(sw.host_maddrs), announce_maddrs=list(sw.announce_maddrs) or None,
                client_mode=sw.client_mode, use_relay=sw.use_relay, use_auto_relay=sw.use_auto_relay,
                startup_timeout=sw.bootstrap_timeout,
            )
        except SwarmError:
            raise
        except Exception as exc:
            peers = ", ".join(sw.initial_peers) or "(none)"
            raise SwarmError(
                f"could not join the DHT through {peers}: {type(exc).__name__}: {exc}. Check that the address is "
                "complete (/ip4/HOST/tcp/PORT/p2p/PEER_ID), that a peer of the run is listening there, and that no "
                "firewall blocks the port"
            ) from None

    async def _get(self, key: str) -> dict[str, Any]:
        """The signed values under ``key`` (bounded: a DHT request that never answers reads as empty)."""
        try:
            found = await asyncio.wait_for(self.dht.get(key, latest=True, return_future=True), DHT_REQUEST_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("DHT read of %s timed out after %.0f s", key, DHT_REQUEST_TIMEOUT)
            return {}
        return signed_values(found)

    async def _store(self, key: str, value: dict[str, Any], ttl: float) -> None:
        """Write our own record under ``key``: signed, under our owner subkey, naming our peer id."""
        now = get_dht_time()
        try:
            await asyncio.wait_for(self.dht.store(key, {**value, "peer_id": self.peer_id}, expiration_time=now + ttl,
                                                  subkey=self.identity.owner, return_future=True), DHT_REQUEST_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("DHT write of %s timed out after %.0f s", key, DHT_REQUEST_TIMEOUT)

    # Membership ----------------------------------------------------------------------------
    def live_peers(self) -> dict[str, PeerRecord]:
        records = self.call(self._get(peers_key(self.run_id)))
        out = {}
        for peer, value in records.items():
            record = PeerRecord.from_value(peer, value)
            if record is not None and record.fingerprint == self.fingerprint and not value.get("left"):
                out[peer] = record
        return out

    def check_model(self) -> None:
        """Refuse to join a run that trains a different model (nothing of ours is sent before this)."""
        records = self.call(self._get(config_key(self.run_id)))
        run_configs = self.call(self._get(run_config_key(self.run_id)))
        ours = model_defining(self.cfg)
        for peer, value in run_configs.items():
            published = value.get("config") if isinstance(value.get("config"), dict) else {}
            moe = published.get("moe") if isinstance(published.get("moe"), dict) else {}
            records.setdefault(peer, {"fingerprint": value.get("fingerprint"), "model": {
                "model": published.get("model", {}), "moe": {k: moe.get(k) for k in ours["moe"]}}})
        for peer, value in records.items():
            if isinstance(value, dict) and value.get("fingerprint") != self.fingerprint:
                theirs = value.get("model") if isinstance(value.get("model"), dict) else {}
                raise SwarmError(
                    f"run {self.run_id!r} trains a different model than this config (peer {peer}): "
                    f"{describe_difference(ours, theirs)}. Join with --config-from-swarm to use the run's config, "
                    "or pick another --run-id"
                )
        theirs = {v.get("hash") for p, v in run_configs.items() if p != self.peer_id}
        if theirs and self.run_config["hash"] not in theirs:
            log.warning("this config (hash %s) differs from the one the run publishes (%s) in settings other than "
                        "the model; join with --config-from-swarm to train with the run's", self.run_config["hash"][:16],
                        ", ".join(h[:16] for h in sorted(h for h in theirs if isinstance(h, str))))
        self._published = [(config_key(self.run_id), {"fingerprint": self.fingerprint, "model": ours}),
                           (run_config_key(self.run_id), self.run_config)]
        for key, value in self._published:
            self.call(self._store(key, value, ttl=self.cfg.swarm.record_ttl))

    def swarm_step(self) -> int | None:
        """The median step the other live peers report, or None when we are alone."""
        steps = sorted(r.step for p, r in self.live_peers().items() if p != self.peer_id)
        return steps[len(steps) // 2] if steps else None

    def sole_experts(self) -> list[int]:
        """Our experts that no other live peer trains (their newest version is ours)."""
        others = {e for p, r in self.live_peers().items() if p != self.peer_id for e in r.experts}
        return [e for e in self.model.local_experts if e not in others]

    def data_partition(self, preferred: int | None = None) -> int:
        """The data partition no other live peer reads (``preferred``, a restarting peer's own, when
        free); it is also the SPES block index of ``experts.placement: spes`` (placement.py)."""
        used = Counter(r.extra.get("data_partition") for p, r in self.live_peers().items() if p != self.peer_id)
        return free_partition(used, self.cfg.peer.count, preferred)

    def choose_experts(self, partition: int) -> list[int]:
        """The experts a peer reading ``partition`` trains: that partition's SPES block (``spes``), the
        explicit list, or the least-covered experts by the live peers' records (as many as the block)."""
        cfg = self.cfg
        if cfg.experts.placement in ("spes", "explicit"):
            return cfg.local_experts(partition)
        holders = Counter(e for p, r in self.live_peers().items() if p != self.peer_id for e in r.experts)
        return least_covered(holders, cfg.moe.num_experts, cfg.experts_per_peer(partition), self.peer_id,
                             cfg.swarm.replicas)

    def claim(self, experts: list[int], partition: int) -> None:
        """Publish our experts and data partition at once, so peers joining right after us see them taken."""
        self._claimed = list(experts)
        with self._lock:
            self.status["data_partition"] = partition
            self.status.setdefault("claimed_at", get_dht_time())
        self.announce()

    def settle_claim(self, partition: int, experts: list[int], attempts: int = 3) -> tuple[int, list[int]]:
        """Resolve racing joins: peers that claimed at the same moment may have picked the same data
        partition (and SPES block) or the same experts, leaving others without a reader or holder. The
        later claimant (by claim time, then peer id) re-picks from the others' claims while a partition
        is free or an expert lacks holders; bounded to ``attempts`` looks, one short wait each."""
        cfg = self.cfg
        num_experts, replicas, count = cfg.moe.num_experts, cfg.swarm.replicas, cfg.peer.count
        for _ in range(attempts):
            time.sleep(min(cfg.swarm.heartbeat, 1.5))
            others = {p: r for p, r in self.live_peers().items() if p != self.peer_id}
            ours = (self.status["claimed_at"], self.peer_id)
            earlier = {p: r for p, r in others.items() if (float(r.extra.get("claimed_at", float("inf"))), p) < ours}
            used = Counter(r.extra.get("data_partition") for r in others.values())
            taken = any(r.extra.get("data_partition") == partition for r in earlier.values())
            full = all(used.get(i) for i in range(count))  # more peers than partitions: sharing is expected
            moved = free_partition(used, count) if taken and not full else partition
            if cfg.experts.placement in ("spes", "explicit"):
                chosen = cfg.local_experts(moved)
            else:
                holders = Counter(e for r in others.values() for e in r.experts)
                clash = [e for e in experts if any(e in r.experts for r in earlier.values()) and holders[e] >= replicas]
                short = [e for e in range(num_experts) if holders[e] < replicas and e not in experts]
                chosen = sorted(experts)
                if (clash and short) or moved != partition:
                    chosen = least_covered(holders, num_experts, cfg.experts_per_peer(moved), self.peer_id, replicas)
            if moved == partition and chosen == sorted(experts):
                return partition, experts
            log.info("data partition %d / experts %s were claimed first by another peer: reading partition %d, "
                     "training %s instead", partition, experts, moved, chosen)
            partition, experts = moved, chosen
            self.claim(experts, partition)
        return partition, experts

    def attach(self, model) -> None:
        self.model = model
        self._take_snapshot(round_no=-1, step=0)
        self._set_anchors()
        self.update_status(serving=True)
        self._heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat_loop(), self.loop)

    def update_status(self, **fields: Any) -> None:
        with self._lock:
            self.status.update(fields)

    def _record(self) -> dict[str, Any]:
        with self._lock:
            status = dict(self.status)
        experts = self.model.local_experts if self.model is not None else self._claimed
        return PeerRecord(
            self.peer_id, list(experts), int(status.pop("step", 0)), int(status.pop("round", -1)),
            self.fingerprint, self.maddrs,
            extra={"version": __version__, "time": get_dht_time(), "num_experts": self.cfg.moe.num_experts,
                   "replicas": self.cfg.swarm.replicas, "residency": self.cfg.swarm.residency,
                   "max_experts": self.cfg.swarm.max_experts_per_peer or self.cfg.moe.num_experts, **status, **{k: int(v) for k, v in self.stats.items()}},
        ).to_value()

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._store(peers_key(self.run_id), self._record(), ttl=self.cfg.swarm.record_ttl)
                for key, value in self._published:  # the model and run config live as long as a peer does
                    await self._store(key, value, ttl=self.cfg.swarm.record_ttl)
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.cfg.swarm.heartbeat)

    def announce(self) -> None:
        self.call(self._store(peers_key(self.run_id), self._record(), ttl=self.cfg.swarm.record_ttl))

    # State served to others ----------------------------------------------------------------
    def _shared_items(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if ".experts." not in n]

    def held_experts(self) -> list[int]:
        """The experts with weights in memory here: all of them, or only our own in partial residency."""
        return self.model.expert_modules()[0].resident_ids

    def _expert_tensors(self, expert: int) -> list[torch.Tensor]:
        """Expert ``expert``'s w1, v1, w2 of every layer (views into the model's storage)."""
        out = []
        for store in self.model.expert_modules():
            if expert in store.local_ids:
                slot, group = store.local_ids.index(expert), "local"
            else:
                slot, group = store.frozen_ids.index(expert), "frozen"
            out += [getattr(store, f"{group}_{m}")[slot] for m in ("w1", "v1", "w2")]
        return out

    def _take_snapshot(self, round_no: int, step: int) -> None:
        """Freeze what this peer serves: the round's shared parameters and held experts.

        The previous version of each entry is kept too, so a peer still refreshing from this round
        gets the pre-merge tensors it asks for (by digest) even after we merged.
        """
        entries = {"shared": [p.detach().cpu().clone() for _, p in self._shared_items()]}
        for e in self.model.local_experts:
            entries[f"expert:{e}"] = [t.detach().cpu().clone() for t in self._expert_tensors(e)]
        for uid, momentum in self._momentum.items():
            entries[f"momentum:{uid}"] = [momentum.clone()]
        snapshot = {}
        for uid, tensors in entries.items():
            meta = {"round": round_no, "step": step, "digest": tensor_digest(tensors)}
            previous = [v for v in self._snapshot.get(uid, [])[-1:] if v[0]["digest"] != meta["digest"]]
            snapshot[uid] = previous + [(meta, tensors)]
        self._snapshot = snapshot

    def _frozen_copy(self, uid: str) -> tuple[dict, list[torch.Tensor]] | None:
        """A frozen expert's current copy, served so that an expert whose holders all left survives."""
        try:
            expert = int(uid.split(":", 1)[1])
        except ValueError:
            return None
        if expert not in self.held_experts() or expert in self.model.local_experts:
            return None
        tensors = [t.detach().cpu().clone() for t in self._expert_tensors(expert)]
        shared = self.current("shared")
        return {"round": shared["round"], "step": shared["step"], "digest": tensor_digest(tensors)}, tensors

    def current(self, uid: str) -> dict:
        return self._snapshot[uid][-1][0]

    async def _rpc_state(self, request: runtime_pb2.ExpertUID, context):
        uid, _, digest = request.uid.partition("@")
        caller = context.remote_id.to_base58()
        if self.auth.private and caller not in self._members:
            self._members = set(await self._get(peers_key(self.run_id)))
        if not self.auth.admits(caller, self._members):
            log.warning("refused %s to %s: not a member of this private run", request.uid, caller)
            yield averaging_pb2.DownloadData(metadata=pack({"error": "not authorized for this run"}))
            return
        versions = self._snapshot.get(uid, [])
        entry = next((v for v in versions if v[0]["digest"] == digest), None) if digest else (versions or [None])[-1]
        if entry is None and uid.startswith("anchor:") and uid[len("anchor:"):] in self._anchor:
            anchor = self._anchor[uid[len("anchor:"):]]  # replaced, never written in place: safe to stream
            entry = ({"digest": tensor_digest([anchor])}, [anchor])
        if entry is None and uid.startswith("expert:") and self.model is not None:
            entry = self._frozen_copy(uid)
            if entry is not None and digest and entry[0]["digest"] != digest:
                entry = None
        if entry is None:
            yield averaging_pb2.DownloadData(metadata=pack({"error": f"not serving {request.uid!r}"}))
            return
        meta, tensors = entry
        first = True
        for tensor in tensors:
            for chunk in serialize_parts(tensor, "none"):
                self.stats["bytes_served"] += chunk.ByteSize()
                yield averaging_pb2.DownloadData(tensor_part=chunk, metadata=pack(meta) if first else b"")
                first = False

    async def _download(self, peer: str, uid: str, like: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        stream = await self.p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer), f"{self.run_id}.state", runtime_pb2.ExpertUID(uid=uid), averaging_pb2.DownloadData
        )
        metadata, parts = await collect_tensors(stream)
        meta = unpack(metadata) if metadata else {}
        if not isinstance(meta, dict) or "error" in meta or "digest" not in meta:
            raise TransportError(f"{peer} did not serve {uid}: {meta.get('error') if isinstance(meta, dict) else meta}")
        if len(parts) != len(like):
            raise TransportError(f"{peer} sent {len(parts)} tensors for {uid}, expected {len(like)}")
        tensors = [parse_tensor(p, tuple(t.shape), t.dtype) for p, t in zip(parts, like)]
        self.stats["bytes_received"] += sum(c.ByteSize() for p in parts for c in p)
        wanted = uid.partition("@")[2] or meta["digest"]
        if tensor_digest(tensors) != meta["digest"] or meta["digest"] != wanted:
            raise TransportError(f"{uid} from {peer} does not match the digest it announced")
        return meta, tensors

    def download(self, peer: str, uid: str, like: list[torch.Tensor], attempts: int = 4) -> tuple[dict, list[torch.Tensor]]:
        """Fetch ``uid`` from ``peer``, retrying briefly: a fresh libp2p dial can be refused once.

        A peer that did not answer within ``averaging_timeout`` is not asked again: it is frozen or
        gone, and a retry would only hold the round up for another timeout.
        """
        for attempt in range(attempts):
            try:
                return self.call(asyncio.wait_for(self._download(peer, uid, like), self.cfg.swarm.averaging_timeout))
            except (TransportError, asyncio.TimeoutError):
                raise
            except Exception as exc:
                if attempt == attempts - 1:
                    raise
                log.info("download of %s from %s failed (%s); retrying", uid, peer, exc)
                time.sleep(2.0 * (attempt + 1))  # libp2p refuses re-dials for a few seconds after a failure
        raise AssertionError("unreachable")

    # Joining mid-run -----------------------------------------------------------------------
    def catch_up(self, keep: Collection[int] = ()) -> dict[str, Any] | None:
        """Load the swarm's current shared parameters and experts from live peers (not from a file).

        Experts in ``keep`` are not downloaded: a peer that fell behind keeps the experts only it
        trains, whose latest version is its own.
        """
        live = self.live_peers()
        # only peers that already serve a snapshot; others are starting up like us
        peers = {p: r for p, r in live.items() if p != self.peer_id and r.extra.get("serving")}
        if not peers:
            return None
        shared_like = [p.detach() for _, p in self._shared_items()]
        errors = []
        for source in sorted(peers, key=lambda p: (-peers[p].round, -peers[p].step, p)):
            try:
                meta, shared = self.download(source, "shared", shared_like)
                break
            except Exception as exc:
                errors.append(f"{source}: {exc}")
        else:
            raise SwarmError("could not download the run's current weights from any live peer: " + "; ".join(errors))
        with torch.no_grad():
            for (_, p), value in zip(self._shared_items(), shared):
                p.copy_(value.to(p.device))
        self._fetch_momentum(source, "shared")
        wanted = [e for e in self.held_experts() if e not in set(keep)]
        fetched, _ = self._refresh_experts(peers, wanted, any_copy=True)
        self._set_anchors()
        self._fetch_anchor(source, "shared")
        self._take_snapshot(meta["round"], meta["step"])
        log.info("caught up from %s at round %s step %s (%d experts fetched)", source, meta["round"], meta["step"], fetched)
        return meta

    def _fetch_momentum(self, peer: str, uid: str) -> None:
        """Take a peer's outer momentum for ``uid`` so our outer steps match theirs (Nesterov only)."""
        if self.cfg.swarm.outer_optimizer == "average":
            return
        size = sum(t.numel() for _, t in self._shared_items()) if uid == "shared" else None
        if size is None:
            return
        try:
            _, (momentum,) = self.download(peer, f"momentum:{uid}", [torch.empty(size)], attempts=2)
        except TransportError:
            self._momentum.pop(uid, None)  # the run has not taken an outer step yet
            return
        self._momentum[uid] = momentum

    def _fetch_anchor(self, peer: str, uid: str) -> None:
        """Take a peer's Nesterov anchor for ``uid``: its last agreed value, which may differ from the
        weights it serves when its last round failed. Every member of a group needs the same one."""
        if uid not in self._anchor:
            return
        try:
            _, (anchor,) = self.download(peer, f"anchor:{uid}", [torch.empty_like(self._anchor[uid])], attempts=2)
        except TransportError as exc:
            log.warning("could not fetch the outer-step anchor of %s from %s: %s", uid, peer, exc)
            return
        self._anchor[uid] = anchor

    def _refresh_experts(self, peers: dict[str, PeerRecord], experts, versions: dict[str, dict] | None = None,
                         preferred: dict[str, dict] | None = None, any_copy: bool = False) -> tuple[int, int]:
        """Download each of ``experts`` once from a holder; with ``versions`` only the agreed digest,
        counted among the ``preferred`` versions when any of them has the expert.

        With ``any_copy`` (joining), an expert nobody holds any more is taken from another peer's
        frozen copy, so an expert is not lost while any copy exists. Returns (fetched, missed): missed
        counts experts that have a holder but could not be fetched (an expert with no holder left
        keeps the copy every peer already has).
        """
        fetched = missed = 0
        unreachable: set[str] = set()
        for e in experts:
            holders = [p for p, r in peers.items() if e in r.experts and p != self.peer_id]
            if any_copy:  # holders first, then anyone's frozen copy
                holders += sorted(p for p in peers if p != self.peer_id and p not in holders)
            if versions is not None:
                digests = Counter()
                for pool in (preferred or {}, versions):  # holders as the versions name them: the same for everyone
                    digests = Counter(v["experts"][str(e)] for p, v in pool.items() if p != self.peer_id and str(e) in v["experts"])
                    if digests:
                        break
                if not digests:
                    missed += bool(holders)
                    continue
                best = max(digests.items(), key=lambda kv: (kv[1], kv[0]))[0]
                holders = sorted(p for p, v in versions.items() if p != self.peer_id and v["experts"].get(str(e)) == best)
            uid = f"expert:{e}@{best}" if versions is not None else f"expert:{e}"
            for holder in (h for h in holders if h not in unreachable):
                try:
                    _, tensors = self.download(holder, uid, self._expert_like(e), attempts=2)
                except TransportError as exc:
                    log.warning("could not fetch expert %d from %s: %s", e, holder, exc)
                    continue
                except Exception as exc:
                    log.warning("could not reach %s for expert %d: %s", holder, e, exc)
                    unreachable.add(holder)
                    continue
                self._write_expert(e, tensors)
                fetched += 1
                break
            else:
                missed += bool(holders)
        self.stats["refresh_missed"] += missed
        return fetched, missed

    def _expert_like(self, e: int) -> list[torch.Tensor]:
        """Templates (shape, dtype) for receiving expert ``e``."""
        return [t.detach() for t in self._expert_tensors(e)]

    def _write_expert(self, e: int, tensors: list[torch.Tensor]) -> None:
        """Overwrite our copy of expert ``e`` in place with received tensors."""
        with torch.no_grad():
            for target, value in zip(self._expert_tensors(e), tensors):
                target.copy_(value.to(target.device))

    def _agree_on_copies(self, orphaned: list[int], versions: dict[str, dict]) -> int:
        """Bring every copy of an expert nobody trains to one version: the most common copy among the
        peers' published digests (ties to the larger digest), so all peers pick the same one."""
        fetched = 0
        for e in orphaned:
            digests = Counter(v.get("copies", {}).get(str(e)) for v in versions.values() if isinstance(v.get("copies"), dict))
            digests.pop(None, None)
            if not digests:
                continue
            best = max(digests.items(), key=lambda kv: (kv[1], kv[0]))[0]
            if tensor_digest(self._expert_tensors(e)) == best:
                continue
            sources = sorted(p for p, v in versions.items() if p != self.peer_id and v.get("copies", {}).get(str(e)) == best)
            for peer in sources:
                try:
                    _, tensors = self.download(peer, f"expert:{e}@{best}", self._expert_like(e), attempts=2)
                except Exception as exc:
                    log.warning("could not fetch the agreed copy of orphaned expert %d from %s: %s", e, peer, exc)
                    continue
                self._write_expert(e, tensors)
                fetched += 1
                break
            else:
                self.stats["refresh_missed"] += 1
        return fetched

    # Sync ----------------------------------------------------------------------------------
    def sync(self, round_no: int, step: int, weight: float,
             on_joined: Callable[[], None] | None = None) -> dict[str, Any]:
        """One round: shared group, expert groups, digests, refresh of frozen experts, merge.

        ``on_joined`` is called once the shared group's membership is decided (an overlapped round
        lets training go on only from then: see ``SwarmSync``).
        """
        try:
            return self._sync(round_no, step, weight, on_joined)
        finally:
            if on_joined is not None:
                on_joined()  # also when the round failed before matchmaking

    def _sync(self, round_no: int, step: int, weight: float, on_joined: Callable[[], None] | None) -> dict[str, Any]:
        t0 = time.monotonic()
        downloaded0, served0 = self.stats["bytes_received"], self.stats["bytes_served"]
        reduced_in0, reduced_out0 = self.reducer.served_in, self.reducer.served_out
        sw = self.cfg.swarm
        peers = self.live_peers()
        peers[self.peer_id] = PeerRecord.from_value(self.peer_id, self._record())
        report: dict[str, Any] = {"round": round_no, "step": step, "groups": {}}
        weight = max(float(weight), 1e-6)

        shared_items = self._shared_items()
        flat = flatten(p for _, p in shared_items)
        shared_res = self.call(self.reducer.run(round_no, "shared", flat, weight, set(peers), on_members=on_joined))
        report["groups"]["shared"] = self._apply(shared_res, [p for _, p in shared_items], "shared", flat)

        # a peer that missed the shared group is dead, frozen or late: waiting for it in every expert
        # group would cost one join window per expert, so the expert groups expect only its members.
        # When we are the late one (the group closed without us), its members expect nobody else.
        late = not shared_res.ok and bool(shared_res.members) and self.peer_id not in shared_res.members
        decided = shared_res.ok or late  # the shared group's membership is the round's, with or without us
        shared_members = set(shared_res.members) if decided else set(peers)
        present = {self.peer_id} if late else shared_members
        # all expert groups at once: they share one join window and one deadline, where one after
        # another a member that froze mid-round would cost a window or a timeout per expert
        flats = {e: flatten(self._expert_tensors(e)) for e in self.model.local_experts}
        groups = {e: {p for p, r in peers.items() if e in r.experts and p in present} | {self.peer_id} for e in flats}
        pooled = [e for e in flats if len(groups[e]) > 1]  # a lone holder's copy is the truth

        async def expert_groups() -> list[GroupResult]:
            return await asyncio.gather(*(
                self.reducer.run(round_no, f"expert{e}", flats[e], weight, groups[e]) for e in pooled))

        results = dict(zip(pooled, self.call(expert_groups()))) if pooled else {}
        for e, flat in flats.items():
            res = results[e] if e in results else GroupResult(flat, [self.peer_id])
            report["groups"][f"expert{e}"] = self._apply(res, self._expert_tensors(e), f"expert:{e}", flat)

        self._take_snapshot(round_no, step)
        # experts no live peer trains: every peer keeps a copy, and the copies must agree
        held = self.held_experts()
        orphaned = [e for e in range(self.cfg.moe.num_experts) if not any(e in r.experts for r in peers.values())]
        mine = {"ok": report["groups"]["shared"]["ok"], "shared": self.current("shared")["digest"],
                "experts": {str(e): self.current(f"expert:{e}")["digest"] for e in self.model.local_experts},
                "copies": {str(e): tensor_digest(self._expert_tensors(e)) for e in orphaned if e in held}}
        self.call(self._store(version_key(self.run_id, round_no), mine, ttl=sw.record_ttl))
        # wait for the digests of the peers that took part in this round; a peer that did not join the
        # shared group is dead or late, and waiting for it would only slow everyone down
        versions = self._wait_versions(round_no, shared_members)
        report["versions_missing"] = len(shared_members - set(versions))
        if not report["groups"]["shared"]["ok"] and not report["groups"]["shared"].get("refused"):
            report["adopted_shared_from"] = self._adopt_shared(round_no, versions)
        # choose versions from the shared group's members first: a late peer (thawed, or out of its group)
        # publishes a digest some members see and others do not, and must not tip anyone's choice
        agreed = {p: v for p, v in versions.items() if p in shared_members} if decided else versions
        self._last_versions = versions
        frozen = [e for e in held if e not in self.model.local_experts]  # none in partial residency
        report["refreshed"], report["refresh_missed"] = self._refresh_experts(peers, frozen, versions, agreed)
        report["orphaned"] = orphaned
        # an expert a peer trained this round is not orphaned, even if its record came too late for
        # our snapshot of the live peers (a joiner): its holder's version, refreshed above, stands
        trained = {e for v in versions.values() for e in v["experts"]}
        report["orphans_agreed"] = self._agree_on_copies([e for e in orphaned if e in held and str(e) not in trained], agreed)

        if sw.merge_interval and step % sw.merge_interval == 0:
            alpha = merge_alpha(step, sw.merge_alpha_start, sw.merge_decay_steps)
            if alpha > 0:
                merge_experts(self.model, alpha)
                for e in self.model.local_experts:
                    if f"expert:{e}" in self._anchor:
                        self._anchor[f"expert:{e}"] = flatten(self._expert_tensors(e))
                self._take_snapshot(round_no, step)
                report["merge_alpha"] = alpha

        report["seconds"] = time.monotonic() - t0
        report["bytes_sent"] = sum(g.get("bytes_sent", 0) for g in report["groups"].values())
        report["bytes_received"] = sum(g.get("bytes_received", 0) for g in report["groups"].values())
        report["shared_digest"] = tensor_digest(p.detach() for _, p in self._shared_items())
        report["expert_digests"] = {
            str(e): tensor_digest(self._expert_tensors(e)) for e in self.held_experts()
        }
        self.stats["rounds_joined" if report["groups"]["shared"]["ok"] else "rounds_failed"] += 1
        # everything this round moved, expert refresh and what others downloaded from us included
        report["downloaded_bytes"] = self.stats["bytes_received"] - downloaded0
        report["served_bytes"] = self.stats["bytes_served"] - served0
        report["reducer_in_bytes"] = self.reducer.served_in - reduced_in0
        report["reducer_out_bytes"] = self.reducer.served_out - reduced_out0
        self.stats["bytes_sent"] += report["bytes_sent"]
        self.stats["bytes_received"] += report["bytes_received"]
        self.rounds.append(report)
        self.update_status(round=round_no, step=step, sync_seconds=round(report["seconds"], 3),
                           recent_rounds=[round_summary(r) for r in self.rounds[-5:]])
        asyncio.run_coroutine_threadsafe(
            self._store(peers_key(self.run_id), self._record(), ttl=sw.record_ttl), self.loop
        )
        return report

    def _apply(self, res: GroupResult, targets: list[torch.Tensor], uid: str, local: torch.Tensor) -> dict[str, Any]:
        """Write a successful group's result (after the outer step) into the model; a failed one is dropped,
        and so is one that fails :meth:`_implausible` (refused: we keep our values and take no one's)."""
        info = {"ok": res.ok, "members": len(res.members), "group_id": group_id(res.members), "bytes_sent": res.bytes_sent,
                "bytes_received": res.bytes_received, "seconds": round(res.seconds, 3)}
        if not res.ok:
            info["error"] = res.error
            return info
        if len(res.members) > 1:
            reason = self._implausible(uid.split(":")[0], local, res.tensor)
            if reason:
                log.warning("refused the %s result of this round: %s", uid, reason)
                self.stats["updates_refused"] += 1
                info.update(ok=False, refused=reason, error=f"refused: {reason}")
                return info
        result = self._outer_step(uid, res.tensor)
        offset = 0
        with torch.no_grad():
            for t in targets:
                n = t.numel()
                t.copy_(result[offset:offset + n].view_as(t).to(t.dtype))
                offset += n
        return info

    def _implausible(self, kind: str, local: torch.Tensor, averaged: torch.Tensor) -> str | None:
        """Why a group result must not be applied: not finite, or moving our values far more than
        results of this kind (shared / expert) recently did. The move is ``|averaged - local| / |local|``."""
        if not torch.isfinite(averaged).all():
            return "the result is not finite"
        move = float((averaged - local).norm()) / max(float(local.norm()), 1e-12)
        history = self._moves.setdefault(kind, deque(maxlen=20))
        limit = self.cfg.swarm.max_update_ratio
        if limit and len(history) >= 3:
            typical = statistics.median(history)
            if move > limit * max(typical, 1e-6):
                return f"it moves our values by {move:.3g} of their norm, {move / max(typical, 1e-6):.0f}x the recent median"
        history.append(move)
        return None

    def _set_anchors(self) -> None:
        """Nesterov anchors = the weights as they stand now, agreed (at start, or just downloaded)."""
        if self.cfg.swarm.outer_optimizer == "average":
            self._anchor = {}
            return
        self._anchor = {"shared": flatten(p for _, p in self._shared_items())}
        for e in self.model.local_experts:
            self._anchor[f"expert:{e}"] = flatten(self._expert_tensors(e))

    def _outer_step(self, uid: str, averaged: torch.Tensor) -> torch.Tensor:
        """SPES replaces the weights by the average; DiLoCo's Nesterov outer step is the option.

        The pseudo-gradient is the anchor (the value the group last agreed on) minus the new average.
        The anchor moves only when a group succeeds, so after a failed round every member still
        has the same anchor, average and momentum, and results stay identical.
        """
        sw = self.cfg.swarm
        if sw.outer_optimizer == "average" or uid not in self._anchor:
            return averaged
        anchor = self._anchor[uid]
        delta = anchor - averaged
        momentum = self._momentum.get(uid)
        momentum = delta.clone() if momentum is None else momentum.mul_(sw.outer_momentum).add_(delta)
        self._momentum[uid] = momentum
        result = anchor - sw.outer_lr * (delta + sw.outer_momentum * momentum)
        self._anchor[uid] = result.clone()
        return result

    def _adopt_shared(self, round_no: int, versions: dict[str, dict]) -> str | None:
        """After missing the shared group, take the result the others agreed on (as a joiner would)."""
        digests = Counter(v.get("shared") for p, v in versions.items() if p != self.peer_id and v.get("ok"))
        digests.pop(None, None)
        if not digests:
            return None
        best = digests.most_common(1)[0][0]
        like = [p.detach() for _, p in self._shared_items()]
        for peer in sorted(p for p, v in versions.items() if v.get("shared") == best and p != self.peer_id):
            try:
                meta, tensors = self.download(peer, f"shared@{best}", like)
            except Exception as exc:
                log.warning("could not adopt round %d shared parameters from %s: %s", round_no, peer, exc)
                continue
            with torch.no_grad():
                for (_, p), value in zip(self._shared_items(), tensors):
                    p.copy_(value.to(p.device))
            self._fetch_momentum(peer, "shared")
            if "shared" in self._anchor:
                self._anchor["shared"] = flatten(tensors)
            self._take_snapshot(round_no, self.current("shared")["step"])
            self.stats["rounds_adopted"] += 1
            return peer
        return None

    def _wait_versions(self, round_no: int, peers: set[str]) -> dict[str, dict]:
        """Digests published for this round by the live peers (waiting a bounded time for all)."""
        deadline = time.monotonic() + version_window(self.cfg.swarm)
        while True:
            raw = self.call(self._get(version_key(self.run_id, round_no)))
            versions = {p: v for p, v in raw.items() if isinstance(v, dict) and isinstance(v.get("experts"), dict)}
            if set(peers) <= set(versions) or time.monotonic() > deadline:
                return versions
            time.sleep(0.2)

    # Self-healing coverage -----------------------------------------------------------------
    def takeover_plan(self) -> dict[str, list[int]]:
        """The experts live peers should take on now (the same plan on every peer; see healing.py).

        A peer counts as holding what its live record says and what it averaged in the last round
        (its published digests): a record that lapsed under load does not make its experts look lost.
        """
        peers = self.live_peers()
        peers[self.peer_id] = PeerRecord.from_value(self.peer_id, self._record())
        held = {p: set(r.experts) for p, r in peers.items()}
        for p, v in self._last_versions.items():
            held.setdefault(p, set()).update(int(e) for e in v["experts"])
        holders = Counter(e for es in held.values() for e in es)
        for e, n in holders.items():
            self._most_holders[e] = max(self._most_holders[e], n)
        experts = [e for e, most in self._most_holders.items() if holders[e] < most]  # lost a holder
        cfg = self.cfg
        per_peer = cfg.experts_per_peer(partition=0)  # the smallest share a peer is given
        if len(held) * per_peer >= cfg.moe.num_experts * cfg.swarm.replicas:
            experts = list(range(cfg.moe.num_experts))  # enough peers to cover all: a gap is a racing join's
        capacity = {p: int(r.extra["max_experts"]) for p, r in peers.items() if isinstance(r.extra.get("max_experts"), int)}
        return plan_takeover({p: sorted(es) for p, es in held.items()}, capacity, cfg.moe.num_experts,
                             cfg.swarm.replicas, experts=experts)

    def experts_to_take(self) -> list[int]:
        """Our part of the plan, once it gave them to us at two sync boundaries in a row: one slow
        heartbeat or one late record must not make us take over a live peer's experts."""
        planned = [e for e in self.takeover_plan().get(self.peer_id, []) if e not in self.model.local_experts]
        confirmed = [e for e in planned if e in self._planned_before]
        self._planned_before = set(planned) - set(confirmed)
        return confirmed

    def fetch_copy(self, expert: int) -> list[torch.Tensor] | None:
        """Expert ``expert``'s latest weights from a live holder, else from a full peer's frozen copy.

        When no live peer has any copy at all (a partial swarm whose only holder left, or an expert
        nobody took yet), the expert restarts from its seeded initial value, loudly logged.
        """
        peers = {p: r for p, r in self.live_peers().items() if p != self.peer_id}
        holders = sorted(p for p, r in peers.items() if expert in r.experts)
        copies = sorted(p for p, r in peers.items() if p not in holders and r.extra.get("residency", "full") == "full")
        if not holders and not copies:
            log.warning("no live peer has a copy of expert %d: restarting it from its initial weights", expert)
            self.stats["experts_reinitialised"] += 1
            return initial_expert(self.cfg, expert)
        store = self.model.expert_modules()[0]
        like = [torch.empty(store.ffn_dim, store.d_model, dtype=store.local_w1.dtype)
                for _ in self.model.expert_modules() for _ in ("w1", "v1", "w2")]
        for peer in holders + copies:
            try:
                _, tensors = self.download(peer, f"expert:{expert}", like, attempts=2)
                return tensors
            except Exception as exc:
                log.warning("could not fetch expert %d from %s to take it over: %s", expert, peer, exc)
        return None

    def took_on(self, experts: list[int], weights: dict[int, list[torch.Tensor]]) -> None:
        """After the model made ``experts`` local: load downloaded weights, serve them, announce."""
        with torch.no_grad():
            for e, tensors in weights.items():
                for target, value in zip(self._expert_tensors(e), tensors):
                    target.copy_(value.to(target.device))
        if self.cfg.swarm.outer_optimizer != "average":
            for e in experts:
                self._anchor[f"expert:{e}"] = flatten(self._expert_tensors(e))
        last = self.rounds[-1] if self.rounds else {"round": -1, "step": 0}
        self._take_snapshot(last["round"], last["step"])
        self.stats["experts_taken_over"] += len(experts)
        self.announce()
        log.warning("took over experts %s (now training %s)", experts, self.model.local_experts)

    # Leaving -------------------------------------------------------------------------------
    def linger(self) -> None:
        """Keep serving after our last round until the others have refreshed from it (bounded)."""
        if not self.rounds:
            return
        last = self.rounds[-1]["round"]
        deadline = time.monotonic() + self.cfg.swarm.matchmaking_time + self.cfg.swarm.averaging_timeout / 3
        while time.monotonic() < deadline:
            behind = [p for p, r in self.live_peers().items() if p != self.peer_id and r.round < last]
            if not behind:
                break
            time.sleep(0.5)

    def leave(self) -> None:
        """Tell the others we are gone (our experts' coverage drops at once) and stop everything."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            if self.model is not None:
                record = self._record()
                record["left"] = True
                self.call(self._store(peers_key(self.run_id), record, ttl=5), timeout=5)
        except Exception as exc:
            log.warning("could not announce leaving: %s", exc)
        self.shutdown()

    def shutdown(self) -> None:
        try:
            self.dht.shutdown()
        finally:
            async def cancel_pending() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self.call(cancel_pending(), timeout=5)
            except Exception as exc:
                log.debug("pending swarm tasks did not stop cleanly: %s", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
