"""A run's ``summary.json``: what one peer did, written once when its training loop ends (or fails),
and read back by the launcher, the benchmarks and the tests."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2p_spes.memory import measure_memory

if TYPE_CHECKING:
    from p2p_spes.train import Trainer

log = logging.getLogger(__name__)
SUMMARY_FILE = "summary.json"


def summary_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SUMMARY_FILE


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A peer's summary, or ``{}`` if it has not written one (still running, or killed)."""
    path = summary_path(run_dir)
    return json.loads(path.read_text()) if path.exists() else {}


def write_report(path: Path, text: str, attempts: int = 5, wait: float = 1.0) -> bool:
    """Write ``text`` to ``path``; whether it was written. A failed write (a full disk) is tried again
    ``attempts`` times ``wait`` seconds apart, then logged, not raised: the weights are in the run's
    checkpoints, and a run must not fail at its very end over its report."""
    for attempt in range(attempts):
        try:
            path.write_text(text)
            return True
        except OSError as exc:
            if attempt + 1 == attempts:
                log.error("could not write %s: %s (is the disk full?); the run itself is done", path, exc)
                return False
            time.sleep(wait)
    return False


def trainer_summary(trainer: Trainer) -> dict[str, Any]:
    """The summary of ``trainer``'s run: its own numbers, then what each of its hooks adds."""
    summary = {
        "step": trainer.step,
        "steps_computed": trainer.steps_computed,
        "tokens": trainer.tokens,
        "first_train_loss": trainer.first_loss,
        "final_train_loss": trainer.last_metrics.get("loss"),
        "final_val_loss": trainer.val_loss,
        "local_experts": trainer.model.local_experts,
        "num_experts": trainer.cfg.moe.num_experts,
        "device": str(trainer.device),
        "moe_backend": trainer.moe_backend.label,
        "moe_backend_checked": trainer.moe_backend.checked,
        "moe_backend_findings": trainer.moe_backend.findings,
        "memory": measure_memory(trainer.model, trainer.optimizer).to_dict(),
        "data": trainer.data.summary(),
        "data_fingerprint": trainer.data.identity.fingerprint,
        **trainer.summary_extras,
    }
    if trainer.metrics.lost:
        summary["metrics_lines_lost"] = trainer.metrics.lost
    for hook in trainer.hooks:
        summary.update(hook.summary(trainer))
    if trainer.node is not None:  # one line per rank: equal digests mean the ranks stayed identical
        node = {
            "rank": trainer.node.rank,
            "world": trainer.node.world,
            "step": trainer.step,
            "steps_computed": trainer.steps_computed,
            "local_experts": trainer.model.local_experts,
            "digest": trainer.node.digest(trainer.model),
        }
        (trainer.run_dir / f"node-rank{trainer.node.rank}.json").write_text(json.dumps(node))
        summary["node"] = node
    return summary
