"""Assemble the full model of a live run from its peers: ``p2p-spes export --from-swarm``.

In a swarm of partial peers no single peer holds every expert, but the full model still exists:
the shared parameters are on every peer and each expert is on its holders. This joins the DHT as a
client (it publishes no peer record, trains and serves nothing), reads the run's published config,
and downloads through the ``{run}.state`` RPC the shared parameters from the most advanced peer and
each expert from the most advanced of its holders, asking for the digest that the peers published
for their newest round (the majority among them) and checking every download against it. An expert
with no live holder is taken from a full peer's frozen copy; an expert that cannot be found at all
is an error, never a silently initialised one.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from p2p_spes.errors import SwarmError


def _majority(digests: Sequence[Any]) -> str | None:
    counts = Counter(d for d in digests if isinstance(d, str))
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else None


def assemble_from_swarm(initial_peers: Sequence[str], run_id: str, timeout: float = 30.0):
    """Download the run's current full model; returns (config, model, report).

    ``report`` names, per expert, the peer it came from and whether it was a holder or a frozen copy.
    """
    from dht.keys import version_key
    from dht.run_config import config_from_published, fetch_run_config
    from p2p_spes.model import MoETransformer
    from p2p_spes.swarm import Swarm

    record = fetch_run_config(initial_peers, run_id, timeout=timeout)
    cfg = config_from_published(record["config"])
    sw = cfg.swarm
    sw.run_id, sw.initial_peers, sw.client_mode = run_id, list(initial_peers), True
    sw.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    swarm = Swarm(cfg)
    try:
        model = MoETransformer(cfg.model, cfg.moe, local_experts=[])  # every expert a frozen buffer
        swarm.model = model  # not attached: we publish no record and serve nothing
        peers = {p: r for p, r in swarm.live_peers().items() if r.extra.get("serving")}
        if not peers:
            raise SwarmError(f"run {run_id!r} has no live peer serving weights; nothing to assemble")
        order = sorted(peers, key=lambda p: (-peers[p].round, -peers[p].step, p))
        newest = peers[order[0]].round
        versions = swarm.call(swarm._get(version_key(run_id, newest))) if newest >= 0 else {}
        report: dict[str, Any] = {"round": newest, "step": peers[order[0]].step, "experts": {}}

        shared_digest = _majority([v.get("shared") for v in versions.values() if v.get("ok")])
        uid = f"shared@{shared_digest}" if shared_digest else "shared"
        shared_items = swarm._shared_items()
        errors: list[str] = []
        report["shared"] = _fetch(swarm, order, uid, [p.detach() for _, p in shared_items],
                                  [p for _, p in shared_items], errors)

        missing = []
        for e in range(cfg.moe.num_experts):
            holders = [p for p in order if e in peers[p].experts]
            digest = _majority([versions.get(p, {}).get("experts", {}).get(str(e)) for p in holders])
            targets = swarm._expert_tensors(e)
            like = [t.detach() for t in targets]
            source = None
            if holders:
                source = _fetch(swarm, holders, f"expert:{e}@{digest}" if digest else f"expert:{e}", like, targets, errors)
            kind = "holder"
            if source is None:
                copies = [p for p in order if p not in holders and peers[p].extra.get("residency", "full") == "full"]
                source, kind = _fetch(swarm, copies, f"expert:{e}", like, targets, errors), "frozen copy"
            if source is None:
                missing.append(e)
            report["experts"][str(e)] = {"from": source, "kind": kind}
        if missing or report["shared"] is None:
            raise SwarmError(
                f"could not download {'experts ' + str(missing) if missing else 'the shared parameters'} from any live "
                "peer of the run; retry when their holders are reachable (" + "; ".join(errors[-4:]) + ")"
            )
        return cfg, model, report
    finally:
        swarm.model = None
        swarm.shutdown()


def _fetch(swarm, peers: Sequence[str], uid: str, like, targets, errors: list[str]) -> str | None:
    """Download ``uid`` from the first of ``peers`` that serves it (digest checked) into ``targets``."""
    import torch

    for peer in peers:
        try:
            _, tensors = swarm.download(peer, uid, like, attempts=2)
        except Exception as exc:
            errors.append(f"{uid} from {peer[:12]}: {exc}")
            continue
        with torch.no_grad():
            for target, value in zip(targets, tensors):
                target.copy_(value)
        return peer
    return None


def export_from_swarm(initial_peers: Sequence[str], run_id: str, out_dir: str | Path,
                      tokenizer: str | Path | None = None, timeout: float = 30.0) -> tuple[Path, dict[str, Any]]:
    """Assemble the run's full model from its peers and write it as a Hugging Face OLMoE directory."""
    from p2p_spes.checkpoint import save_checkpoint
    from p2p_spes.export import export_hf

    cfg, model, report = assemble_from_swarm(initial_peers, run_id, timeout=timeout)
    tmp = Path(tempfile.mkdtemp(prefix="p2p-spes-assembled-"))
    try:
        state = {"model_fingerprint": cfg.model_fingerprint(), "config": cfg.to_dict(), "local_experts": [],
                 "assembled_from_swarm": report}
        path = save_checkpoint(tmp, max(int(report["step"]), 0), model, None, state, keep=1)
        return export_hf(path, out_dir, tokenizer=tokenizer), report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
