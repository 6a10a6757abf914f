"""Functions that the offline ``spes_*`` lm-eval task files call (``!function spes_tasks.NAME``).

lm-eval imports this file by path, so it only holds thin per-dataset adapters; locating the
data lives in :mod:`p2p_spes.evaluate`.
"""

from __future__ import annotations

import re
from typing import Any

from p2p_spes.evaluate import load_local_split


def load_local(subset: str, spes_data_dir: str | None = None, **_: Any):
    """The validation split of ``subset`` (e.g. ``piqa/plain_text``) from local Arrow files.

    lm-eval calls this with the task's metadata and ``dataset_kwargs`` as keyword arguments;
    ``spes_data_dir`` comes from ``run_eval(data_dir=...)`` or ``--metadata``.
    """

    return load_local_split(subset, spes_data_dir)


def boolq_label(doc: dict) -> int:
    """BoolQ's ``answer`` is a boolean here; choice 1 is "yes"."""
    return int(doc["answer"])


def winogrande_answer(doc: dict) -> int:
    """Index of the correct option (the context that the shared continuation should follow)."""
    return {"1": 0, "2": 1}[str(doc["answer"])]


def winogrande_continuation(doc: dict) -> str:
    """The part of the sentence after the blank, scored under each filled-in context."""
    return doc["sentence"][doc["sentence"].index("_") + 1 :].strip()


def winogrande_contexts(doc: dict) -> list[str]:
    """The sentence up to the blank, filled with each option."""
    head = doc["sentence"][: doc["sentence"].index("_")]
    return [head + doc["option1"], head + doc["option2"]]


def _clean_hellaswag(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_docs(dataset):
    """Build HellaSwag's query and cleaned endings (WikiHow bracket artefacts removed)."""

    def convert(doc: dict) -> dict:
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _clean_hellaswag(doc["activity_label"] + ": " + context),
            "choices": [_clean_hellaswag(ending) for ending in doc["endings"]],
            "label": int(doc["label"]),
        }

    return dataset.map(convert)
