"""TensorBoard scalars of a peer's metrics (``train.tensorboard``): the numbers of ``metrics.jsonl``.

A step record's numbers go under ``train/`` (``val_loss`` under ``val/loss``), a sync round's under
``sync/`` (its bytes per kind of stream under ``sync/traffic/``), each at the record's training step and
wall time. Lists, digests and names stay in ``metrics.jsonl`` only. The writer is torch's ``SummaryWriter``, which needs the ``tensorboard``
package (the ``tensorboard`` extra); without it the run refuses to start and says how to install it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from p2p_spes.errors import ConfigError

SKIPPED = {"step", "time", "sync_round"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard tags and values of one ``metrics.jsonl`` record (W&B's keys too, ``wandb_log.py``)."""
    prefix = "sync/" if "sync_round" in record else "train/"
    out = {}
    for key, value in record.items():
        if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tag = "val/loss" if key == "val_loss" else prefix + key.removeprefix("sync_")
        out[tag] = float(value)
    if "sync_round" in record and isinstance(record.get("shared_ok"), bool):
        out["sync/shared_ok"] = float(record["shared_ok"])
    traffic = record.get("traffic")
    for kind, pair in traffic.items() if isinstance(traffic, dict) else ():
        if isinstance(pair, list) and len(pair) == 2:  # bytes [sent, received] on this kind of stream
            out[f"sync/traffic/{kind}_sent"], out[f"sync/traffic/{kind}_received"] = float(pair[0]), float(pair[1])
    return out


def summary_writer() -> type:
    """torch's ``SummaryWriter``, or a :class:`ConfigError` saying how to install what it needs."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(
            f"train.tensorboard needs the tensorboard package ({exc}): "
            "pip install 'p2p-spes[tensorboard]', or leave train.tensorboard false"
        ) from None
    return SummaryWriter


class ScalarLog:
    """Writes records as scalars into one TensorBoard log directory."""

    def __init__(self, log_dir: str | Path) -> None:
        SummaryWriter = summary_writer()
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        walltime = record.get("time") if isinstance(record.get("time"), float) else None
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
