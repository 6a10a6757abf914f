"""`p2p-spes plot` and the TensorBoard scalars: both read back what peers write to metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2p_spes.cli import main as cli_main
from p2p_spes.errors import DataError
from p2p_spes.plots import Curves, run_dirs
from p2p_spes.tensorboard_log import ScalarLog, scalars


def write_peer(d: Path, loss0: float) -> None:
    d.mkdir(parents=True)
    lines = []
    for step in range(1, 31):
        lines.append({"step": step, "loss": loss0 - step * 0.05, "tokens": step * 256, "time": 1000.0 + step})
        if step % 10 == 0:
            lines[-1]["val_loss"] = loss0 - step * 0.04
            lines.append(
                {
                    "sync_round": step // 10,
                    "step": step,
                    "sync_seconds": 1.0 + step / 10,
                    "bytes_sent": 1_000_000,
                    "bytes_received": 2_500_000,  # every byte, downloads included
                    "outcome": "averaged",
                    "shared_ok": True,
                    "shared_digest": "ab" * 32,
                }
            )
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 31, "lo')


def test_curves_are_read_from_metrics_and_a_parent_directory_stands_for_its_peers(tmp_path):
    write_peer(tmp_path / "swarm" / "peer0", 9.0)
    write_peer(tmp_path / "swarm" / "peer1", 8.0)
    write_peer(tmp_path / "alone", 8.5)
    found = run_dirs([tmp_path / "swarm", tmp_path / "alone"])
    assert [label for _, label in found] == ["swarm/peer0", "swarm/peer1", "alone"]
    c = Curves.read(tmp_path / "alone", "alone")
    assert len(c.train) == 30 and c.train[-1] == (30 * 256, pytest.approx(8.5 - 1.5))
    assert [x for x, _ in c.val] == [2560, 5120, 7680]
    assert c.rounds[0] == (1, 2.0, 3.5)  # seconds, MB sent + received
    with pytest.raises(DataError, match="no metrics.jsonl"):
        run_dirs([tmp_path / "nothing-here"])


def test_plot_writes_a_png_of_several_runs_through_the_cli(tmp_path, capsys):
    write_peer(tmp_path / "swarm" / "peer0", 9.0)
    write_peer(tmp_path / "swarm" / "peer1", 8.0)
    write_peer(tmp_path / "alone", 8.5)
    out = tmp_path / "figs" / "curves.png"
    assert cli_main(["plot", str(tmp_path / "swarm"), str(tmp_path / "alone"), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # four panels of lines, not an empty canvas
    assert str(out) in capsys.readouterr().out
    assert cli_main(["plot", str(tmp_path / "empty"), "--out", str(out)]) == 2  # a clear error, no traceback
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_scalars_take_the_numbers_of_steps_and_rounds():
    step = {"step": 4, "loss": 3.5, "val_loss": 3.9, "lr": 1e-3, "skip_rate": [0.1], "time": 5.0}
    assert scalars(step) == {"train/loss": 3.5, "val/loss": 3.9, "train/lr": 1e-3}
    sync = {
        "sync_round": 2,
        "step": 20,
        "sync_seconds": 1.25,
        "shared_ok": False,
        "outcome": "failed",
        "bytes_sent": 10,
        "shared_digest": "ff",
    }
    assert scalars(sync) == {"sync/seconds": 1.25, "sync/bytes_sent": 10.0, "sync/shared_ok": 0.0}


def test_tensorboard_reads_back_what_a_training_run_wrote(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from p2p_spes.config import load_config
    from p2p_spes.train import Trainer

    cfg = load_config(
        None,
        [
            "model.d_model=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.max_seq_len=32",
            "moe.num_experts=4",
            "moe.ffn_dim=64",
            "train.batch_size=4",
            "train.max_steps=4",
            "train.warmup_steps=1",
            "train.log_interval=1",
            "train.eval_interval=2",
            "train.eval_batches=1",
            f"train.run_dir={tmp_path}",
            "train.tensorboard=true",
        ],
    )
    Trainer(cfg).run(progress=False)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses == [(r["step"], pytest.approx(r["loss"])) for r in logged]
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    log = ScalarLog(tmp_path / "direct")
    log.write({"sync_round": 1, "step": 10, "sync_seconds": 2.0, "time": 7.0})
    log.close()
    direct = EventAccumulator(str(tmp_path / "direct"))
    direct.Reload()
    assert [(e.step, e.value, e.wall_time) for e in direct.Scalars("sync/seconds")] == [(10, 2.0, 7.0)]
