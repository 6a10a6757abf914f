"""One result from shares of a benchmark run as separate processes, each arm against its own share's baseline.

A long benchmark is split into shares (seeds, arms, peer counts) run side by side or in later sessions,
then merged. Every share runs the baseline arm beside its other arms, and each arm's gap is taken
against the baseline run of its own share: on another machine or at another commit, a repeat of the
baseline need not match the earlier run to the bit, and comparing across shares would mix that noise
into the gap.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.lab.spread import spread

Runs = dict[str, dict[str, dict[str, Any]]]  # arm -> seed -> run (its "final" and "curve")


class MergeError(ValueError):
    pass


def differing(payloads: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """The ``keys`` on which the payloads disagree (a validation set's cache directory is not the set)."""

    def value(payload: dict[str, Any], key: str) -> Any:
        v = payload.get(key)
        return {k: x for k, x in v.items() if k != "directory"} if key == "validation" and isinstance(v, dict) else v

    return [k for k in keys if any(value(p, k) != value(payloads[0], k) for p in payloads[1:])]


def join(shares: Sequence[tuple[str, Runs]], baseline: str) -> tuple[Runs, list[dict[str, Any]]]:
    """The shares' runs as one ``arm -> seed -> run``, and the repeats of the baseline.

    Each run of another arm keeps its share's baseline run as ``baseline`` (``final`` and ``curve``; a run
    merged before keeps the one it has). The first baseline run of a seed is the one listed; each later
    one is a repeat (its share, final, the listed final and how far apart). An arm's seed in two shares,
    or with no baseline run in its share, is a :class:`MergeError`."""
    runs: Runs = {}
    repeats: list[dict[str, Any]] = []
    for name, by_arm in shares:
        base = by_arm.get(baseline, {})
        for arm, by_seed in by_arm.items():
            have = runs.setdefault(arm, {})
            for seed, run in by_seed.items():
                if arm != baseline and "baseline" not in run:
                    if seed not in base:
                        raise MergeError(f"{arm} seed {seed} in {name} has no {baseline} run of its own share")
                    run = {**run, "baseline": {k: base[seed][k] for k in ("final", "curve")}}
                if seed not in have:
                    have[seed] = run
                elif arm != baseline:
                    raise MergeError(f"{arm} seed {seed} is in more than one variant")
                else:
                    kept = have[seed]["final"]
                    repeats.append({"seed": seed, "variant": name, "final": run["final"], "kept": kept})
                    repeats[-1]["apart"] = run["final"] / kept - 1
    return runs, repeats


def baselines(by_seed: dict[str, dict[str, Any]], listed: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per seed, the baseline run an arm's runs are measured against: their own, else the listed one."""
    out = {s: r.get("baseline", listed.get(s)) for s, r in by_seed.items()}
    return {s: b for s, b in out.items() if b is not None}


def add_arguments(parser: argparse.ArgumentParser, sync: int, eval_rounds: int) -> None:
    """The options every share of such a benchmark takes: its seeds and rounds, the validation windows,
    and ``--merge`` to join shares run before."""
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sync", type=int, default=sync, help=f"steps between rounds (default {sync})")
    parser.add_argument("--rounds", type=int, default=150, help="rounds per run (default 150)")
    parser.add_argument(
        "--eval-rounds", type=int, default=eval_rounds, help=f"score every this many rounds (default {eval_rounds})"
    )
    parser.add_argument("--val-windows", type=int, default=1024, help="validation windows scored (default 1024)")
    parser.add_argument("--merge", nargs="+", metavar="VARIANT", help="combine these variants into --variant")


def compare(by_seed: dict[str, dict[str, Any]], listed: dict[str, dict[str, Any]], is_baseline: bool) -> dict[str, Any]:
    """One arm's runs against their baselines (:func:`baselines`): finals and their mean, the gap per seed
    and its mean, min, max and std (None for the baseline arm itself), and the mean gap at each scored
    round."""
    base = baselines(by_seed, listed)
    finals = {s: r["final"] for s, r in by_seed.items()}
    gaps = {s: finals[s] / base[s]["final"] - 1 for s in finals if s in base}
    curve = {}
    for k in sorted({int(k) for r in by_seed.values() for k in r["curve"]}):
        at = [r["curve"][str(k)] / base[s]["curve"][str(k)] - 1 for s, r in by_seed.items() if s in base]
        if at:
            curve[str(k)] = statistics.fmean(at)
    values = list(gaps.values())
    return {
        "finals": finals,
        "mean": statistics.fmean(finals.values()),
        "gap": spread(values) if values and not is_baseline else None,
        "gaps": gaps,
        "gap_curve": curve,
    }
