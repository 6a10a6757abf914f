"""Self-healing expert coverage: who takes over an expert whose live holders fell below the target.

Every peer computes the same plan from the same live peer records (their expert lists and their
published capacity), so normally exactly the planned peers take an expert on: the ones with the
most spare capacity, ties broken by a hash of (peer id, expert). Peers whose views of the DHT differ
for a moment may both take the same expert; over-replication is harmless (the holders average it in
its group) and is not shed. While a run is still filling up (fewer live peers than it takes to
cover every expert at the configured experts per peer) only experts that lost a holder are planned:
fewer holders now than this peer has seen them have; an expert nobody claimed yet is left to the
peers that join. Once enough peers are live, any gap (two joins that raced) is planned too. A peer acts on its part of the plan only when two
sync boundaries in a row gave it the same expert (``Swarm.experts_to_take``), and counts a peer's
last-round digests as proof that it holds its experts, so one late heartbeat does not move a live
peer's experts.

Taking an expert on makes it trainable here: the expert moves from the frozen buffers (full
residency: the peer already has the agreed copy) or from nowhere (partial residency: the swarm
downloads it first) into the local parameters, and the optimizer state of the experts kept is carried
over row by row; the new expert's starts at zero.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from p2p_spes.config import Config, TrainConfig
from p2p_spes.model import MoETransformer
from p2p_spes.moe import MATRICES
from p2p_spes.optim import build_optimizer


def _tiebreak(peer_id: str, expert: int) -> int:
    return int.from_bytes(hashlib.sha256(f"heal/{peer_id}/{expert}".encode()).digest()[:8], "big")


def plan_takeover(
    held: Mapping[str, Sequence[int]],
    capacity: Mapping[str, int],
    num_experts: int,
    replicas: int,
    experts: Iterable[int] | None = None,
) -> dict[str, list[int]]:
    """Which peer takes which under-replicated expert: {peer id: experts to take on}.

    ``held`` maps each live peer to the experts it trains; ``capacity`` to the most experts it will
    train (a peer missing from it takes nothing); ``experts`` limits the plan to these (default
    all). Experts with the fewest holders go first; each goes to the peer with the most spare
    capacity that does not hold it yet.
    """
    load = {p: len(set(es)) for p, es in held.items()}
    owners = {e: {p for p, es in held.items() if e in es} for e in range(num_experts)}
    considered = range(num_experts) if experts is None else sorted(set(experts) & set(range(num_experts)))
    plan: dict[str, list[int]] = {}
    for e in sorted(considered, key=lambda e: (len(owners[e]), e)):
        while len(owners[e]) < replicas:
            candidates = [p for p in held if p in capacity and p not in owners[e] and load[p] < capacity[p]]
            if not candidates:
                break
            taker = min(candidates, key=lambda p: (load[p] - capacity[p], load[p], _tiebreak(p, e)))
            plan.setdefault(taker, []).append(e)
            owners[e].add(taker)
            load[taker] += 1
    return plan


def initial_expert(cfg: Config, expert: int) -> list[torch.Tensor]:
    """Expert ``expert``'s seeded initial weights (per layer w1, v1, w2), as every peer starts them.

    The last resort of a partial swarm: an expert that no live peer holds and of which no full peer
    keeps a copy either was never trained or is lost; restarting it from its initial value keeps the
    model complete. Builds a model with only that expert resident (shared weights + one expert).
    """

    model = MoETransformer(cfg.model, cfg.moe, local_experts=[expert], resident_only=True)
    model.init_weights(cfg.train.seed)
    return [
        getattr(store, f"local_{name}")[0].detach().clone() for store in model.expert_modules() for name in MATRICES
    ]


def take_on_experts(
    model: nn.Module, optimizer: torch.optim.Optimizer, experts: Sequence[int], cfg: TrainConfig
) -> torch.optim.Optimizer:
    """Make ``experts`` trainable in ``model`` too; returns the optimizer for the new parameters.

    Shared parameters keep their optimizer state as is; each kept expert keeps its optimizer state.
    """
    stores = model.expert_modules()
    old_ids = list(stores[0].local_ids)
    old = [{name: getattr(store, f"local_{name}") for name in MATRICES} for store in stores]
    model.set_local_experts(sorted(set(old_ids) | set(experts)))
    new_ids = list(stores[0].local_ids)
    fresh = build_optimizer(model, cfg)
    replaced = {id(p) for params in old for p in params.values()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in replaced and p in optimizer.state:
                fresh.state[p] = optimizer.state[p]
    rows = [(new_ids.index(e), i) for i, e in enumerate(old_ids)]
    for store, params in zip(stores, old):
        for name, old_param in params.items():
            state = optimizer.state.get(old_param)
            if not state:
                continue
            new_param = getattr(store, f"local_{name}")
            moved = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == old_param.shape:
                    grown = torch.zeros_like(new_param, memory_format=torch.preserve_format)
                    for new_row, old_row in rows:
                        grown[new_row] = value[old_row]
                    moved[key] = grown
                else:
                    moved[key] = value.clone() if torch.is_tensor(value) else value
            fresh.state[new_param] = moved
    return fresh
