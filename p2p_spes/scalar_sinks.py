"""Where a peer's records go besides ``metrics.jsonl``: TensorBoard (``train.tensorboard``) and Weights &
Biases (``train.wandb_project``), each only when asked for. One object owns both, so the trainer writes a
record once and finishes both once, whether training ended or failed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from p2p_spes.config import Config
from p2p_spes.tensorboard_log import ScalarLog
from p2p_spes.wandb_log import WandbLog, peer_target

log = logging.getLogger(__name__)


class ScalarSinks:
    """The TensorBoard and W&B logs of one peer (either may be absent)."""

    def __init__(self, tensorboard: ScalarLog | None = None, wandb: WandbLog | None = None) -> None:
        self.tensorboard, self.wandb = tensorboard, wandb

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, peer_id: str | None, who: dict[str, Any]) -> ScalarSinks:
        """The logs ``cfg`` asks for; ``who`` (the peer's id, experts, data partition) joins the resolved
        config as what the W&B run shows."""
        tr = cfg.train
        tensorboard = ScalarLog(tr.tensorboard_dir or run_dir / "tensorboard") if tr.tensorboard else None
        target = peer_target(cfg, run_dir, peer_id)
        wandb = None if target is None else WandbLog(target, {**cfg.to_dict(), "this_peer": who})
        return cls(tensorboard, wandb)

    def write(self, record: dict[str, Any]) -> None:
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.wandb is not None:
            self.wandb.write(record)

    def close(self, failed: bool = False) -> None:
        """Flush TensorBoard and finish the W&B run (marked failed when training raised); idempotent."""
        if self.tensorboard is not None:
            self.tensorboard.flush()
        if self.wandb is not None:
            try:
                self.wandb.close(failed=failed)
            except Exception as exc:  # a W&B service that died loses its run, never the peer's summary
                log.warning("could not finish the W&B run: %s", exc)
            self.wandb = None
