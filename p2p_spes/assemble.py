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

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dht.auth import load_auth
from dht.run_config import config_from_published, fetch_run_config
from p2p_spes.checkpoint import save_checkpoint
from p2p_spes.config import Config
from p2p_spes.errors import SwarmError
from p2p_spes.export import export_hf
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.agreement import expert_version, majority, read_versions
from p2p_spes.swarm.membership import Membership
from p2p_spes.swarm.runtime import Runtime
from p2p_spes.swarm.state import Downloader


def assemble_from_swarm(
    initial_peers: Sequence[str], run_id: str, timeout: float = 30.0
) -> tuple[Config, MoETransformer, dict[str, Any]]:
    """Download the run's current full model; returns (config, model, report).

    ``report`` names, per expert, the peer it came from and whether it was a holder or a frozen copy.
    """
    record = fetch_run_config(initial_peers, run_id, timeout=timeout)
    cfg = config_from_published(
        record["config"],
        [
            f"swarm.run_id={json.dumps(run_id)}",
            f"swarm.initial_peers={json.dumps(list(initial_peers))}",
            "swarm.client_mode=true",
            'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        ],
    )
    sw = cfg.swarm
    # a client of the run: its DHT view and downloads, no record, no RPC served, no group joined
    runtime = Runtime(sw, load_auth(sw.secret_file, sw.allowed_peers))
    try:
        stats: Counter = Counter()
        downloader = Downloader(runtime, stats, timeout=sw.averaging_timeout)
        model = MoETransformer(cfg.model, cfg.moe, local_experts=[])  # every expert a frozen buffer
        live = Membership(runtime, cfg, stats, experts=list).live_peers()
        peers = {p: r for p, r in live.items() if r.extra.get("serving")}
        if not peers:
            raise SwarmError(f"run {run_id!r} has no live peer serving weights; nothing to assemble")
        order = sorted(peers, key=lambda p: (-peers[p].round, -peers[p].step, p))
        newest = peers[order[0]].round
        versions = read_versions(runtime, newest) if newest >= 0 else {}
        report: dict[str, Any] = {"round": newest, "step": peers[order[0]].step, "experts": {}}

        errors: list[str] = []
        shared_digest = majority(v.shared for v in versions.values() if v.ok)
        uid = f"shared@{shared_digest}" if shared_digest else "shared"
        found = downloader.first_of(order, uid, [p.detach() for _, p in model.shared_parameters()], errors)
        if found is not None:
            model.write_shared(found[1][1])
        report["shared"] = None if found is None else found[0]

        missing = []
        for e in range(cfg.moe.num_experts):
            holders = [p for p in order if e in peers[p].experts]
            digest = expert_version({p: versions[p] for p in holders if p in versions}, e)
            like = [t.detach() for t in model.expert_tensors(e)]
            found, kind = None, "holder"
            if holders:
                found = downloader.first_of(holders, f"expert:{e}@{digest}" if digest else f"expert:{e}", like, errors)
            if found is None:
                copies = [p for p in order if p not in holders and peers[p].extra.get("residency", "full") == "full"]
                found, kind = downloader.first_of(copies, f"expert:{e}", like, errors), "frozen copy"
            if found is None:
                missing.append(e)
            else:
                model.write_expert(e, found[1][1])
            report["experts"][str(e)] = {"from": None if found is None else found[0], "kind": kind}
        if missing or report["shared"] is None:
            raise SwarmError(
                f"could not download {'experts ' + str(missing) if missing else 'the shared parameters'} from any live "
                "peer of the run; retry when their holders are reachable (" + "; ".join(errors[-4:]) + ")"
            )
        return cfg, model, report
    finally:
        runtime.shutdown()


def export_from_swarm(
    initial_peers: Sequence[str],
    run_id: str,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    timeout: float = 30.0,
) -> tuple[Path, dict[str, Any]]:
    """Assemble the run's full model from its peers and write it as a Hugging Face OLMoE directory."""
    cfg, model, report = assemble_from_swarm(initial_peers, run_id, timeout=timeout)
    tmp = Path(tempfile.mkdtemp(prefix="p2p-spes-assembled-"))
    try:
        state = {
            "model_fingerprint": cfg.model_fingerprint(),
            "config": cfg.to_dict(),
            "local_experts": [],
            "assembled_from_swarm": report,
        }
        path = save_checkpoint(tmp, max(int(report["step"]), 0), model, None, state, keep=1)
        return export_hf(path, out_dir, tokenizer=tokenizer), report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
