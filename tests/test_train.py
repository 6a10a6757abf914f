"""One peer training on the embedded corpus: loss falls, resume is exact, checkpoints are safe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_spes.checkpoint import find_checkpoint, load_checkpoint, read_state
from p2p_spes.cli import main as cli_main
from p2p_spes.config import load_config
from p2p_spes.errors import CheckpointError
from p2p_spes.hooks import PostStep
from p2p_spes.model import MoETransformer
from p2p_spes.train import Trainer

# A very small model on the real embedded corpus and tokenizer, for the fast tests.
FAST = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "moe.num_experts=4",
    "moe.ffn_dim=64",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=4",
    "train.eval_batches=2",
    "train.checkpoint_interval=4",
    "peer.count=2",
    "peer.index=1",
]


def fast_config(tmp_path: Path, *extra: str):
    return load_config(None, FAST + [f"train.run_dir={tmp_path}"] + list(extra))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 300 steps of the tiny config in a process: minutes on 2 cores
@pytest.mark.timeout(1200)  # 3-5 min alone; a loaded machine doubles it
@pytest.mark.long
def test_tiny_config_loss_falls_well_below_start(tmp_path):
    """The README's main job: the tiny config through the CLI, on the embedded corpus."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "p2p_spes", "train", "--run-dir", str(tmp_path), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    metrics = read_metrics(tmp_path)
    first = metrics[0]["ce"]
    assert first == pytest.approx(float(torch.log(torch.tensor(8192.0))), rel=0.05)  # uniform at init
    assert summary["final_val_loss"] < first - 3.0, (first, summary)
    assert summary["final_train_loss"] < first - 3.0
    assert summary["step"] == 300 and summary["local_experts"] == list(range(8))
    for key in ("loss", "ce", "z_loss", "lb_loss", "router_z_loss", "lr", "tokens", "tokens_per_s"):
        assert key in metrics[-1]
    assert "done: step 300" in proc.stdout
    assert find_checkpoint(tmp_path).name == "step_00000300"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_reproduces_the_uninterrupted_curve(tmp_path, optimizer):
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    settings = ("train.max_steps=8", f"train.optimizer={optimizer}")
    full = Trainer(fast_config(full_dir, *settings))
    full.run(progress=False)

    first = Trainer(fast_config(part_dir, *settings))
    for _ in range(4):
        first.train_step()
    first.save()
    del first
    second = Trainer(fast_config(part_dir, *settings))
    assert second.resume()
    assert second.step == 4
    second.run(progress=False)

    curve_full = [m["loss"] for m in read_metrics(full_dir)]
    curve_resumed = [m["loss"] for m in read_metrics(part_dir)]
    assert len(curve_full) == 8 and curve_resumed == curve_full[4:]
    for (k, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_peer_trains_only_its_experts_and_reports_memory(tmp_path):
    trainer = Trainer(fast_config(tmp_path, "train.max_steps=2"))
    assert trainer.model.local_experts == [2, 3]
    before = trainer.model.state_dict()
    summary = trainer.run(progress=False)
    after = trainer.model.state_dict()
    w1_before = before["layers.0.mlp.experts.mlp.w1"].view(4, 64, 64)
    w1_after = after["layers.0.mlp.experts.mlp.w1"].view(4, 64, 64)
    assert torch.equal(w1_before[:2], w1_after[:2]) and not torch.equal(w1_before[2:], w1_after[2:])
    mem = summary["memory"]
    assert mem["gradients"]["frozen_experts"] == 0 and mem["optimizer"]["frozen_experts"] == 0
    assert mem["optimizer"]["local_experts"] == mem["parameters"]["local_experts"]  # Muon's one momentum buffer
    assert mem["parameters"]["frozen_experts"] == mem["parameters"]["local_experts"]


def test_peers_read_disjoint_data(tmp_path):
    a = Trainer(fast_config(tmp_path / "a", "peer.index=0"))
    b = Trainer(fast_config(tmp_path / "b", "peer.index=1"))
    seen_a = {tuple(row.tolist()) for _ in range(5) for row in a.loader.next_batch()[0]}
    seen_b = {tuple(row.tolist()) for _ in range(5) for row in b.loader.next_batch()[0]}
    assert not seen_a & seen_b


def test_crash_mid_checkpoint_leaves_previous_usable(tmp_path):
    trainer = Trainer(fast_config(tmp_path, "train.max_steps=4"))
    trainer.run(progress=False)
    good = find_checkpoint(tmp_path)
    # a writer killed mid-way leaves a temporary directory with a partial file and no rename
    partial = tmp_path / "checkpoints" / ".tmp-step_00000008-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    assert find_checkpoint(tmp_path) == good
    resumed = Trainer(fast_config(tmp_path, "train.max_steps=6"))
    assert resumed.resume() and resumed.step == 4
    # a corrupt weights file in the newest checkpoint is refused, not loaded
    (good / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_state(good)


def test_checkpoint_from_another_model_or_not_a_checkpoint_is_refused(tmp_path):
    trainer = Trainer(fast_config(tmp_path / "run", "train.max_steps=4"))
    trainer.run(progress=False)
    other = fast_config(tmp_path / "run", "model.num_layers=3")
    with pytest.raises(CheckpointError, match="different model"):
        Trainer(other).resume()
    model = MoETransformer(other.model, other.moe)
    with pytest.raises(CheckpointError, match="not a p2p-spes checkpoint"):
        load_checkpoint(tmp_path, model)


def test_checkpoints_are_pruned_and_latest_points_at_newest(tmp_path):
    Trainer(fast_config(tmp_path, "train.max_steps=12")).run(progress=False)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_00000008", "step_00000012"]
    assert json.loads((tmp_path / "checkpoints" / "latest").read_text())["checkpoint"] == "step_00000012"


def test_cli_reports_user_errors_without_traceback(tmp_path, capsys):
    assert cli_main(["train", "--set", "model.num_layer=2"]) == 2
    assert "unknown key model.num_layer" in capsys.readouterr().err
    assert cli_main(["train", "--set", "data.train=/nonexistent", "--set", "data.validation=/nonexistent"]) == 2
    assert "/nonexistent" in capsys.readouterr().err
    assert cli_main(["config", "--config", "spes-1b"]) == 0
    assert "vocab_size: 151665" in capsys.readouterr().out


def test_decayed_load_balance_scales_local_experts_early(tmp_path):
    trainer = Trainer(fast_config(tmp_path, "experts.decayed_lb=true", "train.max_steps=10"))
    trainer._update_lb_scale()
    assert trainer.model.lb_count_scale.tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7])
    trainer.step = 1  # 20% of 10 steps = 2 steps of decay
    trainer._update_lb_scale()
    assert trainer.model.lb_count_scale.tolist() == pytest.approx([1.0, 1.0, 0.85, 0.85])
    trainer.step = 5
    trainer._update_lb_scale()
    assert trainer.model.lb_count_scale.tolist() == pytest.approx([1.0] * 4)


def test_a_hook_that_moves_the_step_past_the_end_still_gets_the_final_evaluation(tmp_path):
    # a swarm round run beside training can move a peer's schedule on past train.max_steps (its jump):
    # that step is the end, with its evaluation and checkpoint, as reaching max_steps exactly would be
    trainer = Trainer(
        fast_config(tmp_path, "train.max_steps=6", "train.eval_interval=100", "train.checkpoint_interval=100")
    )

    def jump(t: Trainer) -> None:
        if t.step == 4:
            t.step += 3

    trainer.hooks.append(PostStep(jump))
    summary = trainer.run(progress=False)
    assert summary["step"] == 7 and summary["final_val_loss"] is not None
    assert read_state(find_checkpoint(tmp_path))["step"] == 7
    # the step computed keeps its loss; the evaluation is of the model at step 7 and logged there, so a
    # sink whose steps only go forward (W&B) gets it after a round's record at 7
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r][-1] == 4 and "val_loss" not in records[-2]
    assert records[-1]["step"] == 7 and records[-1]["val_loss"] == summary["final_val_loss"]


def test_a_full_disk_during_a_checkpoint_costs_that_checkpoint_not_the_run(tmp_path, monkeypatch):
    # the write of step 8's checkpoint fails as a full disk fails it: training goes on, the partial
    # write is removed, step 4's checkpoint stays the latest until step 12's is written
    import errno

    from safetensors import SafetensorError

    from p2p_spes import checkpoint

    real = checkpoint.save_file
    calls = {"n": 0}

    def full_disk(tensors, path, metadata=None):
        if "step_00000008" in path:  # as safetensors reports it (not an OSError)
            calls["n"] += 1
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    trainer = Trainer(fast_config(tmp_path, "train.max_steps=12", "train.keep_checkpoints=5"))
    seen = []
    trainer.hooks.append(PostStep(lambda t: seen.append(find_checkpoint(tmp_path).name) if t.step == 9 else None))
    summary = trainer.run(progress=False)
    assert calls["n"] == 1 and seen == ["step_00000004"]
    assert summary["step"] == 12 and summary["checkpoints_failed"] == 1
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004", "step_00000012"]  # no partial directory left behind
    assert read_state(find_checkpoint(tmp_path))["step"] == 12

    # the final checkpoint cannot be skipped: the run ends with the error naming the fix
    monkeypatch.setattr(
        checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
    )
    again = Trainer(fast_config(tmp_path / "again", "train.max_steps=4"))
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint.*Free space"):
        again.run(progress=False)
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "again" / "checkpoints").iterdir())


def test_a_full_disk_at_the_end_costs_the_report_not_the_run(tmp_path, monkeypatch, caplog):
    """A run whose disk is full as it writes summary.json tries again (the disk may be freed), then
    says so and ends normally: its weights are in its checkpoints."""
    import errno

    from p2p_spes import train

    monkeypatch.setattr(train.time, "sleep", lambda s: None)
    real, fails = Path.write_text, {"left": 2}

    def full_disk(self, text, *args, **kwargs):
        if self.name == "summary.json" and fails["left"]:
            fails["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert train.write_report(tmp_path / "summary.json", "{}") and (tmp_path / "summary.json").read_text() == "{}"
    fails["left"] = 99
    assert not train.write_report(tmp_path / "other" / "summary.json", "{}", attempts=3)
    assert fails["left"] == 96 and "could not write" in caplog.text
