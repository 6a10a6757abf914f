"""Several GPUs per peer: data parallelism inside a node, one peer in the swarm.

Under ``torchrun --nproc-per-node N -m p2p_spes train ...`` each process trains the same model on
its own slice of the peer's data partition, and the gradients are averaged across the node after
every step (``Node.average_gradients``; one all-reduce of the flattened gradients). Only rank 0
is a peer: it opens the DHT, joins averaging groups, writes checkpoints, logs and evaluates. The
other ranks follow it through a small per-step control message (``NodeSync``): the step (a peer
that skipped ahead), the experts it trains (a takeover), and whether its weights changed (a sync
round, in the foreground or finishing in the background), in which case rank 0's weights are
broadcast to all. The optimizer state needs no broadcast: every rank starts from the same one
(fresh, or the same checkpoint file) and applies the same averaged gradients.

Why not ``DistributedDataParallel``: the trainer's loss is not the model's ``forward`` and the
trainable parameters change when a peer takes an expert over, which would mean rebuilding the
wrapper; one flat all-reduce per step is simple and correct, at the price of not overlapping it
with the backward pass.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from p2p_spes.averaging import tensor_digest
from p2p_spes.device import resolve_device
from p2p_spes.healing import take_on_experts
from p2p_spes.hooks import TrainerHook


@dataclass
class Node:
    """This process's place in a multi-process peer (set up by torchrun)."""

    rank: int
    world: int
    local_rank: int

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, name: str) -> torch.device:
        """``train.device`` for this rank: GPU ``local_rank`` of the node when CUDA is used."""
        return resolve_device(name, self.local_rank)

    # Collectives ---------------------------------------------------------------------------
    def send_json(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank, as JSON (plain data only: nothing is unpickled)."""
        if self.main:
            data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0)
        if not self.main:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0)
        return json.loads(bytes(data.tolist())) if not self.main else value

    def average_gradients(self, params: list[nn.Parameter]) -> None:
        """Replace each gradient by its mean over the node's ranks (a missing one counts as zero)."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
            offset += n

    def broadcast_weights(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers (frozen experts included) on every rank, bit for bit.

        The tensors themselves, not ``state_dict()``: that one assembles the expert matrices into
        new tensors (the checkpoint layout), and writing into those would change nothing.
        """
        with torch.no_grad():
            for tensor in model_tensors(model):
                dist.broadcast(tensor, 0)

    def digest(self, model: nn.Module) -> str:
        """What must be equal on every rank: all parameters and buffers."""
        return tensor_digest(model_tensors(model))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer (frozen experts are buffers), in an order a deep copy shares."""
    return [*model.parameters(), *model.buffers()]


def node_from_env() -> Node | None:
    """The node this process belongs to under torchrun (``WORLD_SIZE`` > 1), else None.

    Collectives on CPU tensors go over gloo, those on GPU tensors over NCCL.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    node = Node(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return node


class NodeSync(TrainerHook):
    """Trainer hook on every rank (after the swarm's hook on rank 0): keep the ranks identical.

    ``changes`` (rank 0 only) counts what altered the weights outside the optimizer step (sync
    rounds applied); when it moved since the last step, the weights are broadcast.
    """

    def __init__(self, node: Node, num_experts: int, changes: Callable[[], int] | None = None) -> None:
        self.node, self.num_experts, self.changes = node, num_experts, changes
        self._seen = changes() if changes else 0

    @classmethod
    def attach(cls, node: Node, trainer: Any, changes: Callable[[], int] | None = None) -> NodeSync:
        """Bring every rank to rank 0's state now, then keep them there after every step."""
        hook = cls(node, trainer.cfg.moe.num_experts, changes)
        hook.start(trainer)
        trainer.hooks.append(hook)
        return hook

    def start(self, trainer: Any) -> None:
        """Before the first step: rank 0's step and weights (after resuming or catching up) everywhere."""
        self._exchange(trainer, force=True)

    def post_step(self, trainer: Any) -> None:
        self._exchange(trainer, force=False)

    def _exchange(self, trainer: Any, force: bool) -> None:
        changed = force
        if self.node.main and self.changes is not None:
            count = self.changes()
            changed, self._seen = changed or count != self._seen, count
        experts = trainer.model.local_experts
        control = torch.full((2 + self.num_experts,), -1, dtype=torch.int64)
        control[0], control[1] = trainer.step, int(changed)
        control[2 : 2 + len(experts)] = torch.tensor(experts, dtype=torch.int64)
        dist.broadcast(control, 0)
        if not self.node.main:
            trainer.step = int(control[0])
            theirs = [int(e) for e in control[2:] if e >= 0]
            added = sorted(set(theirs) - set(experts))
            if added:
                trainer.optimizer = take_on_experts(trainer.model, trainer.optimizer, added, trainer.cfg.train)
        if int(control[1]):
            self.node.broadcast_weights(trainer.model)
