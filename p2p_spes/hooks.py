"""The moments of the training loop that other parts of a run act on: after each optimizer step, after
the last step, and when the loop fails; and what each part adds to the run's ``summary.json``.

The swarm (``peer.SwarmSync``) and the ranks of a multi-GPU peer (``distributed.NodeSync``) are hooks;
the trainer knows nothing about the network.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2p_spes.train import Trainer


class TrainerHook:
    """A part of a run acting at the loop's named moments; each does nothing unless overridden."""

    def post_step(self, trainer: Trainer) -> None:
        """After each optimizer step (and its step count), before its evaluation, log line and checkpoint."""

    def post_train(self, trainer: Trainer) -> None:
        """After the last step, before the summary is written."""

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        """The loop raised (Ctrl-C and SIGTERM included); the summary is written after this."""

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """What this part adds to ``summary.json`` (read once, when it is written)."""
        return {}


class PostStep(TrainerHook):
    """A plain function run after each step."""

    def __init__(self, fn: Callable[[Trainer], None]) -> None:
        self.fn = fn

    def post_step(self, trainer: Trainer) -> None:
        self.fn(trainer)
