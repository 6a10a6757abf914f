"""``p2p-spes plot``: a run's curves in one PNG, read back from its peers' ``metrics.jsonl``.

Four panels: training loss and validation loss against the tokens each peer processed, and each sync
round's seconds and megabytes (sent, received and downloaded) against the round number. Several run
directories are drawn side by side, one line each; a directory without a ``metrics.jsonl`` of its own
stands for its subdirectories that have one (``runs/swarm`` is its peers). matplotlib is an optional
dependency (the ``plot`` extra) and draws off-screen (Agg), so no display is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from p2p_spes.errors import ConfigError, DataError
from p2p_spes.metrics_log import metrics_path, read_metrics


@dataclass
class Curves:
    """One peer's (or one single-process run's) series."""

    label: str
    train: list[tuple[int, float]] = field(default_factory=list)  # (tokens, loss)
    val: list[tuple[int, float]] = field(default_factory=list)  # (tokens, validation loss)
    rounds: list[tuple[int, float, float]] = field(default_factory=list)  # (round, seconds, MB)

    @classmethod
    def read(cls, run_dir: Path, label: str) -> Curves:
        curves = cls(label)
        tokens = 0
        for r in read_metrics(run_dir):
            if "sync_round" in r:
                moved = sum(int(r.get(k) or 0) for k in ("bytes_sent", "bytes_received"))  # every byte of the round
                curves.rounds.append((int(r["sync_round"]), float(r.get("sync_seconds") or 0.0), moved / 1e6))
                continue
            if isinstance(r.get("tokens"), int):
                tokens = r["tokens"]
            if isinstance(r.get("loss"), (int, float)):
                curves.train.append((tokens, float(r["loss"])))
            if isinstance(r.get("val_loss"), (int, float)):
                curves.val.append((tokens, float(r["val_loss"])))
        return curves


def run_dirs(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Each directory holding a ``metrics.jsonl``, with its label: the given directories, or their
    subdirectories when they hold none themselves. Raises :class:`DataError` naming a path with none."""
    out = []
    for given in map(Path, paths):
        if metrics_path(given).exists():
            out.append((given, given.name or str(given)))
            continue
        found = sorted(d for d in given.glob("*") if metrics_path(d).exists()) if given.is_dir() else []
        if not found:
            raise DataError(
                f"{given}: no metrics.jsonl in it or in its subdirectories; give the run directory of "
                "`p2p-spes train` (--run-dir) or of `p2p-spes swarm` (runs/swarm)"
            )
        out += [(d, f"{given.name}/{d.name}") for d in found]
    return out


def plot_runs(paths: Iterable[str | Path], out: str | Path, title: str = "") -> Path:
    """Draw the curves of ``paths`` (see :func:`run_dirs`) into the PNG ``out``; returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ConfigError(f"plotting needs matplotlib ({exc}): pip install 'p2p-spes[plot]'") from None
    runs = [Curves.read(d, label) for d, label in run_dirs(paths)]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        (axes[0][0], "training loss", "tokens", lambda c: c.train),
        (axes[0][1], "validation loss", "tokens", lambda c: c.val),
        (axes[1][0], "seconds per sync round", "round", lambda c: [(r, s) for r, s, _ in c.rounds]),
        (
            axes[1][1],
            "MB moved per sync round (sent + received + downloaded)",
            "round",
            lambda c: [(r, mb) for r, _, mb in c.rounds],
        ),
    ]
    for ax, name, xlabel, points in panels:
        drawn = False
        for c in runs:
            xy = points(c)
            if xy:
                marker = "o" if len(xy) < 30 else None
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker=marker, markersize=3, label=c.label)
                drawn = True
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        if xlabel == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5,
                0.5,
                "no data (no sync rounds: trained alone?)" if "round" in xlabel else "no data",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    fig.suptitle(title or ", ".join(c.label for c in runs))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
