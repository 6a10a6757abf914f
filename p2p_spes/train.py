"""The training loop of one peer: expert-subset optimizer, validation, metrics and checkpoints.

The swarm (DHT, averaging) plugs in through :class:`~p2p_spes.hooks.TrainerHook` objects that act
after each optimizer step, after the last one and on failure; this module knows nothing about the network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from p2p_spes.checkpoint import check_fingerprint, find_checkpoint, load_checkpoint, read_state, save_checkpoint
from p2p_spes.config import Config
from p2p_spes.data import BatchLoader, TokenDataset, validation_batches
from p2p_spes.device import resolve_device
from p2p_spes.distributed import Node
from p2p_spes.errors import CheckpointError
from p2p_spes.hooks import TrainerHook
from p2p_spes.metrics_log import MetricsWriter
from p2p_spes.model import MoETransformer
from p2p_spes.moe import choose_backend
from p2p_spes.optim import MuonAdamW, build_optimizer, lr_at, set_lr, trainable_parameters
from p2p_spes.progress import ProgressView
from p2p_spes.run_data import RunData, identify_data, prepare_data
from p2p_spes.run_summary import summary_path, trainer_summary, write_report
from p2p_spes.scalar_sinks import ScalarSinks

log = logging.getLogger(__name__)


def peer_loader(
    cfg: Config, data: TokenDataset, partition: int, node: Node | None, *, partitioned: bool = False
) -> BatchLoader:
    """The training batches of data partition ``partition``; rank r of a node reads slice r of it.

    With ``partitioned`` the dataset holds only the partition's own shards (a data.manifest run), so
    the partition's peers split those; otherwise every partition takes its slice of all windows.
    """
    rank, world = (node.rank, node.world) if node else (0, 1)
    if partitioned:
        index, count = rank, world
    else:
        index, count = partition * world + rank, cfg.peer.count * world
    return BatchLoader(
        data,
        cfg.model.max_seq_len,
        cfg.train.batch_size,
        seed=cfg.data.seed,
        peer_index=index,
        num_peers=count,
        shared=cfg.data.partition == "shared",
    )


def build_model(
    cfg: Config, device: torch.device, autocast_dtype: torch.dtype | None, local: list[int]
) -> tuple[Any, MoETransformer]:
    """The MoE backend chosen for ``device`` and the model training experts ``local``.

    On a GPU the MoE backend and expert kernel are checked there once against the per-expert loop,
    falling back if they fail (moe/selfcheck.py); elsewhere this is the configured choice, unchecked.
    """
    resident_only = cfg.swarm.residency == "partial"
    backend = choose_backend(
        cfg.moe, cfg.model.d_model, device, autocast_dtype, local_experts=local, resident_only=resident_only
    )
    if backend.checked:
        log.info("MoE backend %s (checked on %s)", backend.label, device)
    model = MoETransformer(
        cfg.model, backend.apply(cfg.moe), local_experts=local, device=device, resident_only=resident_only
    )
    return backend, model


class Trainer:
    """One peer's model, optimizer and data, stepping until ``train.max_steps``."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path | None = None,
        hooks: list[TrainerHook] | None = None,
        local_experts: list[int] | None = None,
        data_partition: int | None = None,
        node: Node | None = None,
        data: RunData | None = None,
        peer_id: str | None = None,
    ) -> None:
        """``peer_id``: the swarm peer's id, which names its W&B run (``train.wandb_project``)."""
        self.cfg = cfg
        self.node = node  # several processes per peer (distributed.py); rank 0 logs and saves
        self.is_main = node is None or node.main
        tr = cfg.train
        self.run_dir = Path(run_dir or tr.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tr.threads:
            torch.set_num_threads(tr.threads)
        self.device = node.device(tr.device) if node else resolve_device(tr.device)
        use_bf16 = tr.dtype == "bf16" or (tr.dtype == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.hooks = list(hooks or [])

        local = cfg.local_experts() if local_experts is None else sorted(local_experts)
        self.moe_backend, self.model = build_model(cfg, self.device, self.autocast_dtype, local)
        self.model.init_weights(tr.seed)
        if tr.init_from:
            self.load_initial_weights(tr.init_from)
        self.optimizer = build_optimizer(self.model, tr)
        if isinstance(self.optimizer, MuonAdamW):  # its bf16 iteration, checked on a GPU once
            for finding in self.optimizer.self_check():
                log.warning("%s", finding)

        partition = cfg.peer.index if data_partition is None else data_partition
        self.partition = partition
        if data is None:
            data = prepare_data(cfg, identify_data(cfg), partition, progress=self.is_main)
        self.data = data
        self.train_data, self.val_data = data.open(cfg.model.vocab_size, verify=cfg.data.verify)
        self.world = node.world if node else 1
        self.loader = peer_loader(cfg, self.train_data, partition, node, partitioned=data.partitioned)
        if self.is_main:
            log.info("training on %s: %s", data.identity.describe(), data.describe_read())
        self.val_batches = validation_batches(self.val_data, cfg.model.max_seq_len, tr.batch_size, tr.eval_batches)

        self.step = 0
        self.steps_computed = 0  # by this process: a step the schedule jumped over or a catch-up replaced is not one
        self.tokens = 0
        self.last_metrics: dict[str, Any] = {}
        self.val_loss: float | None = None
        self.summary_extras: dict[str, Any] = {}  # what the trainer itself adds (failed checkpoints, ...)
        self.metrics = MetricsWriter(self.run_dir)
        self.first_loss: float | None = None  # of this process's first step, for the summary
        self.view: ProgressView | None = None  # the live view, while run() shows one
        who = {"peer_id": peer_id, "local_experts": self.model.local_experts, "data_partition": partition}
        self.sinks = ScalarSinks.open(cfg, self.run_dir, peer_id, who) if self.is_main else ScalarSinks()

    # State -----------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "loader": self.loader.state_dict(),
            "data_partition": self.partition,
            "data_fingerprint": self.data.identity.fingerprint,
            "model_fingerprint": self.cfg.model_fingerprint(),
            "local_experts": self.model.local_experts,
            "config": self.cfg.to_dict(),
            "val_loss": self.val_loss,
        }

    def save(self, final: bool = True) -> Path | None:
        """Write a checkpoint. One that cannot be written (a full disk) ends the run only when it is the
        ``final`` one; otherwise training goes on, says so, and tries again at the next interval."""
        if not self.is_main:
            return None
        try:
            path = save_checkpoint(
                self.run_dir,
                self.step,
                self.model,
                self.optimizer,
                self.trainer_state(),
                keep=self.cfg.train.keep_checkpoints,
            )
        except CheckpointError as exc:
            if final:
                raise
            self.summary_extras["checkpoints_failed"] = self.summary_extras.get("checkpoints_failed", 0) + 1
            log.error("%s; training goes on and tries again in %d steps", exc, self.cfg.train.checkpoint_interval)
            return None
        log.info("saved checkpoint %s", path)
        return path

    def resume(self, checkpoint: str | Path | None = None) -> bool:
        """Continue from ``checkpoint`` (or the run directory's newest); False if there is none."""
        path = Path(checkpoint) if checkpoint else find_checkpoint(self.run_dir)
        if path is None:
            return False
        state = read_state(path)
        check_fingerprint(path, state, self.cfg.model_fingerprint())
        if "loader" not in state:
            raise CheckpointError(
                f"{path} holds initial weights only (no training state); start a run from it with "
                f"--set train.init_from={path}"
            )
        if state["local_experts"] != self.model.local_experts:
            self.model.set_local_experts(state["local_experts"])
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        load_checkpoint(path, self.model, self.optimizer, state=state)
        self.step, self.tokens = state["step"], state["tokens"]
        self._resume_loader(state)
        self.val_loss = state.get("val_loss")
        log.info("resumed from %s at step %d", path, self.step)
        return True

    def _resume_loader(self, state: dict[str, Any]) -> None:
        """Continue the data order where the checkpoint left it, unless it read other shards: a peer of a
        data.manifest run that restarts into another partition (its own was taken) starts afresh."""
        if self.data.resumes(
            state.get("data_partition", self.partition), state.get("data_fingerprint"), self.partition
        ):
            self.loader.load_state_dict(state["loader"])
        else:
            log.warning(
                "the checkpoint read other shards than data partition %d: starting its order afresh", self.partition
            )

    def load_initial_weights(self, checkpoint: str | Path) -> Path:
        """Start from another checkpoint's weights (an upcycled model, say): step 0, fresh optimizer."""
        path = find_checkpoint(checkpoint)
        if path is None:
            raise CheckpointError(
                f"train.init_from={checkpoint}: no checkpoint there; give a checkpoint or run directory"
            )
        load_checkpoint(path, self.model, fingerprint=self.cfg.model_fingerprint())
        log.info("initial weights from %s", path)
        return path

    # Steps -----------------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _update_lb_scale(self) -> None:
        ex = self.cfg.experts
        if not ex.decayed_lb:
            return
        progress = self.step / max(ex.decayed_lb_fraction * self.cfg.train.max_steps, 1)
        factor = ex.decayed_lb_start + (1 - ex.decayed_lb_start) * min(progress, 1.0)
        scale = torch.ones_like(self.model.lb_count_scale)
        scale[self.model.local_experts] = factor
        self.model.lb_count_scale.copy_(scale)

    def train_step(self) -> dict[str, Any]:
        tr = self.cfg.train
        self.model.train()
        self._update_lb_scale()
        lr = lr_at(self.step, tr)
        set_lr(self.optimizer, lr)
        t0 = time.perf_counter()
        parts: dict[str, float] = {}
        skips = [0.0] * self.cfg.model.num_layers
        for _ in range(tr.grad_accum):
            x, y = self.loader.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                out = self.model.loss(x, y, z_loss_weight=tr.z_loss_weight)
            (out.loss / tr.grad_accum).backward()
            for k, v in out.as_floats().items():
                parts[k] = parts.get(k, 0.0) + v / tr.grad_accum
            skips = [a + b / tr.grad_accum for a, b in zip(skips, self.model.skip_rates)]
        params = [p for _, p in trainable_parameters(self.model)]
        if self.node is not None:
            self.node.average_gradients(params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tr.grad_clip if tr.grad_clip > 0 else math.inf))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        step_tokens = tr.batch_size * tr.grad_accum * self.cfg.model.max_seq_len * self.world  # the whole peer's
        self.step += 1
        self.steps_computed += 1
        self.tokens += step_tokens
        self.last_metrics = {
            "step": self.step,
            **parts,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.tokens,
            "tokens_per_s": step_tokens / elapsed,
            "step_time_s": elapsed,
        }
        if self.model.resident_only:  # fraction of top-k assignments dropped, per layer
            self.last_metrics["skip_rate"] = [round(r, 4) for r in skips]
        return self.last_metrics

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        for x, y in self.val_batches:
            with self._autocast():
                out = self.model.loss(x.to(self.device), y.to(self.device), z_loss_weight=0.0)
            total += float(out.ce)
        self.val_loss = total / max(len(self.val_batches), 1)
        return self.val_loss

    # Loop ------------------------------------------------------------------------------------
    def log_record(self, record: dict[str, Any]) -> None:
        """Append one line to ``metrics.jsonl`` (steps, and sync rounds from the swarm), wall-clock stamped."""
        if not self.is_main:
            return
        self.sinks.write(self.metrics.append(record))
        if self.view is not None and "loss" not in record:  # rounds and takeovers; the loop feeds the steps
            self.view.update(self.run_dir.name, record)

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train to ``max_steps`` (from wherever the trainer stands) and write ``summary.json`` once, at
        the end or when the loop fails (Ctrl-C included).

        With ``progress`` the live view (``progress.py``) shows this peer's step, loss, rounds and ETA."""
        tr = self.cfg.train
        self.view = (
            ProgressView([self.run_dir.name], tr.max_steps, console=Console(stderr=True))
            if progress and self.is_main
            else None
        )
        try:
            with self.view or contextlib.nullcontext():
                while self.step < tr.max_steps:
                    self._one_step()
                if self.view is not None:
                    self.view.set_state(self.run_dir.name, "finished")
                    self.view.refresh(force=True)
            for hook in self.hooks:
                hook.post_train(self)
        except BaseException as exc:
            self._failed(exc)
            raise
        self._close()
        return self.write_summary()

    def _one_step(self) -> None:
        """A step, its hooks, and the evaluation, log line and checkpoint due after it."""
        tr = self.cfg.train
        metrics = self.train_step()
        if self.first_loss is None:
            self.first_loss = metrics["loss"]
        computed = self.step
        for hook in self.hooks:
            hook.post_step(self)
        # a hook may move the step past the end (a swarm round's schedule jump): that is the end too
        last = self.step >= tr.max_steps
        val_loss = self.evaluate() if self.is_main and (self.step % tr.eval_interval == 0 or last) else None
        if val_loss is not None and self.step == computed:
            metrics["val_loss"] = val_loss
        if self.step % tr.log_interval == 0 or "val_loss" in metrics or self.step == 1:
            self.log_record(metrics)
        if val_loss is not None and self.step != computed:  # a jump: at the model's step (W&B drops steps behind)
            self.log_record({"step": self.step, "val_loss": val_loss})
        if self.view is not None:
            self.view.update(self.run_dir.name, {**metrics, "step": self.step})
            self.view.refresh()
        if self.step % tr.checkpoint_interval == 0 or last:
            self.save(final=last)

    def _failed(self, exc: BaseException) -> None:
        """The loop raised: save on Ctrl-C, tell the hooks, and write the summary of what was done."""
        if isinstance(exc, KeyboardInterrupt):
            log.warning("interrupted at step %d: saving a checkpoint before exiting", self.step)
            self.save()
        for hook in self.hooks:
            try:
                hook.on_error(self, exc)
            except Exception as inner:  # the original error is the one to report
                log.warning("%s.on_error failed: %s", type(hook).__name__, inner)
        self._close(failed=True)
        try:
            self.write_summary()
        except Exception as inner:
            log.warning("could not write summary.json after the failure: %s", inner)

    def _close(self, failed: bool = False) -> None:
        self.view = None
        self.sinks.close(failed=failed)

    def write_summary(self) -> dict[str, Any]:
        """``summary.json`` (rank 0 writes it; every rank of a node writes its own ``node-rank<r>.json``)."""
        summary = trainer_summary(self)
        if self.is_main:
            write_report(summary_path(self.run_dir), json.dumps(summary, indent=1))
        return summary
