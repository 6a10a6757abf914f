"""Error feedback through a codec over replicas held in one process, as the swarm's groups run it.

The one-process benchmarks (``local_steps``, ``refresh_cadence``) replay a group's compressed round
without the network: each member sends its pseudo-gradient plus what its earlier messages dropped, the
reducer may encode the members' mean again with its own residual, and every member takes the anchor
minus the result. These are those steps, shared so that both benchmarks run the same round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from p2p_spes.swarm.outer import split_like

Through = Callable[[torch.Tensor], torch.Tensor]  # a vector as its message decodes


def send(
    deltas: Sequence[torch.Tensor], residuals: list[torch.Tensor], through: Through, decay: float = 1.0
) -> list[torch.Tensor]:
    """Each member's message as it decodes: its delta plus ``decay`` x its residual, through ``through``.
    ``residuals`` is updated in place to what each message dropped."""
    decoded = []
    for i, delta in enumerate(deltas):
        sent = delta + decay * residuals[i]
        decoded.append(through(sent))
        residuals[i] = sent - decoded[-1]
    return decoded


def restage(mean: torch.Tensor, residual: torch.Tensor, through: Through) -> tuple[torch.Tensor, torch.Tensor]:
    """The reducer's second encoding: ``mean`` plus its own residual through ``through``; returns what
    decodes and the new residual (what that message dropped)."""
    compensated = mean + residual
    out = through(compensated)
    return out, compensated - out


@torch.no_grad()
def write(anchor: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy the flat ``anchor`` into ``params``, in order."""
    for p, v in zip(params, split_like(anchor, list(params))):
        p.copy_(v)
