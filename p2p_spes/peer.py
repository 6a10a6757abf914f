"""Run one swarm peer: join, pick experts, catch up with the run, train, sync, leave."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from dht.node import sigterm_as_interrupt
from p2p_spes.checkpoint import check_fingerprint, find_checkpoint, read_state, write_json
from p2p_spes.config import Config
from p2p_spes.data_sources import DirectorySource
from p2p_spes.distributed import Node, NodeSync
from p2p_spes.errors import CheckpointError
from p2p_spes.healing import take_on_experts
from p2p_spes.hooks import TrainerHook
from p2p_spes.run_data import identify_data, manifest_root, prepare_data
from p2p_spes.swarm import RoundReport, Swarm
from p2p_spes.train import Trainer

log = logging.getLogger(__name__)


class SwarmSync(TrainerHook):
    """Trainer hook: publish status every step and take part in every sync round of the swarm.

    Rounds are paced by the swarm (``swarm/pacing.py``): round r is due when this peer reaches step
    ``r * sync_steps``, and it also starts as soon as another peer has opened it, at the end of the
    step in progress. Each peer contributes the tokens it processed since its last round (the average
    is token-weighted), and after the round takes the round's place in the schedule (step ``r *
    sync_steps``), so a slower peer or one back from a long download meets the same rounds as the
    others and no step it computed is thrown away.
    """

    def __init__(
        self,
        swarm: Swarm,
        sync_steps: int,
        tokens: int = 0,
        next_round: int = 1,
        partition: int | None = None,
        started_at: int = 0,
    ) -> None:
        self.swarm, self.sync_steps, self.partition = swarm, sync_steps, partition
        self.started_at = started_at  # the step this process started from (resumed, or taken from the swarm)
        self.tokens_at_last_sync = tokens  # a resumed peer weighs only what it trained since
        self.rounds_applied = 0  # rounds whose result reached the live weights (NodeSync watches it)
        self.next_round = next_round
        self.tokens_averaged = 0  # tokens of ours that went into rounds averaged with other peers
        swarm.expect_round(next_round)

    def _due(self, trainer: Trainer) -> bool:
        """Round ``next_round`` is ours to run now: we reached its step, or another peer opened it."""
        if self.next_round * self.sync_steps > trainer.cfg.train.max_steps:
            return False  # no round past the end of the run
        return trainer.step >= self.next_round * self.sync_steps or self.swarm.round_opened(self.next_round)

    def post_train(self, trainer: Trainer) -> None:
        """Serve the others a while before leaving (they may still be refreshing from our last round)."""
        self.swarm.linger()

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """The swarm's counters and settings, for ``summary.json`` (also after Ctrl-C or SIGTERM, so the
        launcher's table shows what was done)."""
        sw, swarm = trainer.cfg.swarm, self.swarm
        return {
            "peer_id": swarm.peer_id,
            "reachability": swarm.runtime.reachability.as_dict(),  # its role: public reduces, private only contributes
            **swarm.stats.as_dict(),
            "traffic": swarm.stats.traffic(),
            "rounds": swarm.stats.rounds(),
            # the step a peer reached is where it started (its checkpoint, or the state it took when it
            # joined) plus the steps it computed, those a catch-up replaced (skipped) and those the schedule
            # moved past to the swarm's round (jumped); only computed ones trained anything
            "steps": {
                "started_at": self.started_at,
                "computed": trainer.steps_computed,
                "skipped": swarm.stats.steps_skipped,
                "jumped": swarm.stats.schedule_steps_advanced,
            },
            "tokens_averaged": self.tokens_averaged,
            "residency": sw.residency,
            "compression": sw.compression,
            "sync_memory": swarm.sync_memory().to_dict(),
            "data_partition": self.partition,
            "last_round": swarm.rounds[-1].metrics(trainer.step) if swarm.rounds else None,
        }

    def post_step(self, trainer: Trainer) -> None:
        m = trainer.last_metrics
        self.swarm.update_status(
            step=trainer.step,
            loss=round(m.get("loss", float("nan")), 4),
            tokens=trainer.tokens,
            tokens_per_s=round(m.get("tokens_per_s", 0.0), 1),
        )
        if not self._due(trainer):
            return
        self.swarm.reach_others()  # nobody answers at a boundary: reconnect before running a round alone
        if self._passed(trainer):
            return
        round_no, weight = self.next_round, trainer.tokens - self.tokens_at_last_sync
        self.tokens_at_last_sync = trainer.tokens
        # every member runs the round at its agreed step (the merge schedule and the served snapshots
        # follow it), wherever its own step count stands
        last = (round_no + 1) * self.sync_steps > trainer.cfg.train.max_steps
        self._after(trainer, self.swarm.sync(round_no, round_no * self.sync_steps, weight, last), trainer.step)

    def _after(self, trainer: Trainer, report: RoundReport, started: int) -> None:
        """Log the round, take its place in the schedule, rejoin if we fell behind, heal coverage."""
        self.rounds_applied += 1
        # the schedule follows the swarm: round r ends at step r * sync_steps for every member (a slower
        # peer moves its schedule on; the steps it computed are all in the round, weighted by tokens)
        jump = max(min(report.round * self.sync_steps - started, trainer.cfg.train.max_steps - trainer.step), 0)
        trainer.step += jump
        self.swarm.stats.schedule_steps_advanced += jump
        if report.outcome == "averaged":
            self.tokens_averaged += report.tokens
        trainer.log_record({**report.metrics(trainer.step), "schedule_jump": jump})
        self.next_round = max(self.next_round, report.round + 1)
        if report.outcome in ("failed", "alone") and not report.shared.refused:
            # alone with others in the swarm: we were frozen or cut off past their round's records
            self._rejoin(trainer)
        self.swarm.expect_round(self.next_round)
        self._heal(trainer)

    def _passed(self, trainer: Trainer) -> bool:
        """Whether the swarm has finished our due round and the one after it (we were frozen, cut off or
        restarted from an older checkpoint), and we took its state instead of running the round.

        Running it would find nobody, spend a join window and the adopt wait alone, and then catch up
        anyway. One round behind is left to the round itself: its late member adopts the result the
        group agreed on, which costs less than the whole state.
        """
        ahead = self.swarm.swarm_round()
        if ahead is None or ahead <= self.next_round or not self._rejoin(trainer):
            return False
        self.swarm.expect_round(self.next_round)
        return True

    def _heal(self, trainer: Trainer) -> None:
        """At a sync boundary, take over the under-replicated experts the plan gives us (healing.py)."""
        mine = self.swarm.experts_to_take()
        if not mine:
            return
        weights = {}
        if trainer.model.resident_only:  # the weights are not here: download them first
            for e in mine:
                tensors = self.swarm.fetch_copy(e)
                if tensors is not None:
                    weights[e] = tensors
            mine = sorted(weights)
        if not mine:
            return
        trainer.optimizer = take_on_experts(trainer.model, trainer.optimizer, mine, trainer.cfg.train)
        self.swarm.took_on(mine, weights)
        trainer.log_record(
            {
                "step": trainer.step,
                "took_over": mine,
                "local_experts": trainer.model.local_experts,
                "bytes_received_total": self.swarm.stats.wire.received,
            }
        )

    def _rejoin(self, trainer: Trainer) -> bool:
        """After a round that failed for us (or that we spent alone), rejoin like a newcomer if the swarm
        has moved past it; whether we did.

        A peer that was frozen or cut off misses rounds the others complete; it takes the swarm's
        latest agreed weights (keeping the experts only it trains, whose newest version is its own) and
        its place in the schedule, and says so (a metrics line with the rounds it skipped and the digest
        of the shared weights it took). Its local progress since its last round is replaced.
        """
        ahead = self.swarm.swarm_round()
        if ahead is None or ahead < self.next_round:
            return False
        meta = self.swarm.catch_up(keep=self.swarm.sole_experts())
        if meta is None:
            return False
        target = max(int(meta["step"]), trainer.step)
        log.warning(
            "behind the swarm (round %d, others at %d): took the state of round %s, step %d -> %d",
            self.next_round - 1,
            ahead,
            meta["round"],
            trainer.step,
            target,
        )
        self.swarm.stats.steps_skipped += target - trainer.step
        trainer.step = target
        skipped = list(range(self.next_round, int(meta["round"]) + 1))
        self.next_round = max(self.next_round, int(meta["round"]) + 1)
        self.tokens_at_last_sync = trainer.tokens  # what we trained since our last round was replaced
        self.swarm.stats.rounds_skipped += len(skipped)
        trainer.log_record(
            {
                "step": trainer.step,
                "rounds_skipped": skipped,
                "caught_up_round": int(meta["round"]),
                "shared_digest": meta.get("digest"),
            }
        )
        return True


def _own_checkpoint(run_dir: Path, resume: str | None, cfg: Config) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint a restarting peer resumes from and its validated state (None, None without one)."""
    if resume is None:
        return None, None
    path = find_checkpoint(run_dir if resume == "auto" else resume)
    if path is None:
        if resume != "auto":
            raise CheckpointError(f"--resume {resume}: no checkpoint found")
        return None, None
    state = read_state(path)
    check_fingerprint(path, state, cfg.model_fingerprint())
    if "loader" not in state:
        raise CheckpointError(f"{path} holds initial weights only; start from it with --set train.init_from={path}")
    return path, state


def run_follower(cfg: Config, run_dir: str | Path, node: Node, resume: str | None = None) -> dict[str, Any]:
    """A rank > 0 of a multi-process peer (distributed.py): train beside rank 0, never touch the swarm.

    Mirrors :func:`run_peer`'s collectives in order: the experts and data partition rank 0 chose,
    the same checkpoint file, then rank 0's weights and step, then one control message per step.
    """
    run_dir = Path(run_dir)
    checkpoint, _ = _own_checkpoint(run_dir, resume, cfg)
    plan = node.send_json()
    # rank 0 fetched the data into this machine's cache before it sent the plan: read it from there
    cached = DirectorySource(manifest_root(cfg, plan["data"]), fingerprint=plan["data"])
    data = prepare_data(cfg, identify_data(cfg, peers=lambda: [cached]), plan["partition"], progress=False)
    trainer = Trainer(
        cfg, run_dir=run_dir, local_experts=plan["experts"], data_partition=plan["partition"], node=node, data=data
    )
    if checkpoint is not None:
        trainer.resume(checkpoint)
    NodeSync.attach(node, trainer)
    return trainer.run(progress=False)


def run_peer(
    cfg: Config, run_dir: str | Path, progress: bool = True, resume: str | None = None, node: Node | None = None
) -> dict[str, Any]:
    """Join the swarm named by ``cfg.swarm`` and train to ``train.max_steps``; returns the summary.

    With ``resume`` ("auto" or a checkpoint path) a restarting peer takes back the experts, optimizer
    state and data position of its own checkpoint; the weights then come from the live peers (they
    moved on meanwhile), or stay those of the checkpoint when no peer is left, so a whole swarm that
    went down restarts from its checkpoints. With ``node`` this is rank 0 of a multi-process peer
    whose other ranks run :func:`run_follower`.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint, saved = _own_checkpoint(run_dir, resume, cfg)
    swarm = Swarm(cfg)
    previous = sigterm_as_interrupt()  # SIGTERM leaves like Ctrl-C: checkpoint, announce departure, stop the DHT
    try:
        write_json(run_dir / "peer.json", {"peer_id": swarm.peer_id, "maddrs": swarm.maddrs})
        print("peer id:", swarm.peer_id, flush=True)
        print("other peers can join with: --initial-peers " + " ".join(swarm.maddrs), flush=True)
        identity = identify_data(cfg, peers=swarm.run_data_sources)
        swarm.check_model(identity.fingerprint, identity.train.tokenizer.fingerprint)
        print(f"training on {identity.describe()}", flush=True)
        partition = swarm.data_partition(
            saved.get("data_partition", saved["loader"].get("peer_index")) if saved else None
        )
        experts = saved["local_experts"] if saved else swarm.choose_experts(partition)
        swarm.claim(experts, partition)
        if not saved:
            partition, experts = swarm.settle_claim(partition, experts)
        data = prepare_data(cfg, identity, partition, swarm.data_holders(identity.train), progress=progress)
        swarm.serve_data(identity.train, identity.train_root, data.train_shards)
        if node is not None:
            node.send_json({"experts": experts, "partition": partition, "data": identity.fingerprint})
        trainer = Trainer(
            cfg,
            run_dir=run_dir,
            local_experts=experts,
            data_partition=partition,
            node=node,
            data=data,
            peer_id=swarm.peer_id,
        )
        if checkpoint is not None:
            trainer.resume(checkpoint)
            print(f"resumed from {checkpoint} at step {trainer.step}", flush=True)
        swarm.update_status(device=str(trainer.device), moe_backend=trainer.moe_backend.label)
        swarm.attach(trainer.model)
        meta = swarm.catch_up()
        if meta is not None:
            trainer.step = int(meta["step"])
            print(f"joined the run at round {meta['round']}, step {meta['step']}", flush=True)
        swarm.update_status(step=trainer.step, round=-1 if meta is None else meta["round"])
        swarm.announce()
        print(f"training experts {experts} of {cfg.moe.num_experts}, data partition {partition}", flush=True)
        # the first round after the one we took (a run that has not synced yet is before round 1)
        next_round = max(int(meta["round"]) if meta is not None else trainer.step // cfg.swarm.sync_steps, 0) + 1
        sync = SwarmSync(
            swarm,
            cfg.swarm.sync_steps,
            trainer.tokens,
            next_round=next_round,
            partition=partition,
            started_at=trainer.step,
        )
        trainer.hooks.append(sync)
        if node is not None:
            NodeSync.attach(node, trainer, changes=lambda: sync.rounds_applied)
        return trainer.run(progress=progress)  # its summary.json carries the swarm's counters (SwarmSync.summary)
    finally:
        signal.signal(signal.SIGTERM, previous)
        swarm.leave()
