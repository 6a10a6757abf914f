"""Run one swarm peer: join, pick experts, catch up with the run, train, sync, leave."""

from __future__ import annotations

import json
import logging
import signal
from collections import Counter
from pathlib import Path
from typing import Any

from p2p_spes.config import Config
from p2p_spes.swarm import Swarm
from p2p_spes.train import Trainer

log = logging.getLogger(__name__)


class SwarmSync:
    """Trainer hook: publish status every step and run a sync round every ``sync_steps``."""

    def __init__(self, swarm: Swarm, sync_steps: int) -> None:
        self.swarm, self.sync_steps = swarm, sync_steps
        self.tokens_at_last_sync = 0

    def __call__(self, trainer: Trainer) -> None:
        m = trainer.last_metrics
        self.swarm.update_status(step=trainer.step, loss=round(m.get("loss", float("nan")), 4),
                                 tokens=trainer.tokens, tokens_per_s=round(m.get("tokens_per_s", 0.0), 1))
        if trainer.step % self.sync_steps:
            return
        report = self.swarm.sync(trainer.step // self.sync_steps, trainer.step, trainer.tokens - self.tokens_at_last_sync)
        self.tokens_at_last_sync = trainer.tokens
        groups = report["groups"]
        trainer.log_record({
            "sync_round": report["round"], "step": trainer.step, "sync_seconds": round(report["seconds"], 3),
            "shared_ok": groups["shared"]["ok"], "shared_members": groups["shared"]["members"],
            "groups_failed": sorted(g for g, v in groups.items() if not v["ok"]),
            "bytes_sent": report["bytes_sent"], "bytes_received": report["bytes_received"],
            "refreshed": report["refreshed"], "refresh_missed": report["refresh_missed"],
            "merge_alpha": report.get("merge_alpha"),
            "shared_digest": report["shared_digest"], "expert_digests": report["expert_digests"],
            "groups": groups,
        })


def data_partition(swarm: Swarm, cfg: Config) -> int:
    """The lowest data partition of ``peer.count`` no live peer reads (so peers never overlap)."""
    used = Counter(r.extra.get("data_partition") for r in swarm.live_peers().values())
    free = [i for i in range(cfg.peer.count) if not used.get(i)]
    return free[0] if free else min(range(cfg.peer.count), key=lambda i: used.get(i, 0))


def _interrupt(signum, frame) -> None:
    """SIGTERM leaves like Ctrl-C: checkpoint, announce departure, stop the DHT."""
    raise KeyboardInterrupt


def run_peer(cfg: Config, run_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Join the swarm named by ``cfg.swarm`` and train to ``train.max_steps``; returns the summary."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(cfg)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        (run_dir / "peer.json").write_text(json.dumps({"peer_id": swarm.peer_id, "maddrs": swarm.maddrs}))
        print("peer id:", swarm.peer_id, flush=True)
        print("other peers can join with: --initial-peers " + " ".join(swarm.maddrs), flush=True)
        swarm.check_model()
        experts = swarm.choose_experts()
        partition = data_partition(swarm, cfg)
        swarm.update_status(data_partition=partition)
        swarm.claim(experts)
        trainer = Trainer(cfg, run_dir=run_dir, local_experts=experts, data_partition=partition)
        swarm.update_status(device=str(trainer.device))
        swarm.attach(trainer.model)
        meta = swarm.catch_up()
        if meta is not None:
            trainer.step = int(meta["step"])
            print(f"joined the run at round {meta['round']}, step {meta['step']}", flush=True)
        swarm.update_status(step=trainer.step, round=-1 if meta is None else meta["round"])
        swarm.announce()
        print(f"training experts {experts} of {cfg.moe.num_experts}, data partition {partition}", flush=True)
        trainer.hooks.append(SwarmSync(swarm, cfg.swarm.sync_steps))
        try:
            trainer.run(progress=progress)
            swarm.linger()
        finally:  # also on Ctrl-C / SIGTERM, so the launcher's table shows what was done
            trainer.summary_extras = {
                "peer_id": swarm.peer_id,
                "rounds_joined": int(swarm.stats["rounds_joined"]),
                "rounds_failed": int(swarm.stats["rounds_failed"]),
                "bytes_sent": int(swarm.stats["bytes_sent"]),
                "bytes_received": int(swarm.stats["bytes_received"]),
                "bytes_served": int(swarm.stats["bytes_served"]),
                "refresh_missed": int(swarm.stats["refresh_missed"]),
                "last_round": swarm.rounds[-1] if swarm.rounds else None,
            }
            summary = trainer.write_summary()
        return summary
    finally:
        signal.signal(signal.SIGTERM, previous)
        swarm.leave()
