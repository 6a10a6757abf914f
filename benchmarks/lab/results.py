"""The benchmarks' result files, one way: ``benchmarks/results/<script>/<variant>.json``.

``<script>`` is the module name of a benchmark script (``benchmarks/<script>.py``, run as ``python -m
benchmarks.<script>``), ``<variant>`` names one configuration of it (``main`` unless the command says
otherwise, ``--variant``); a plot sits beside its JSON as ``<variant>.png``. Every file is written by
:meth:`Run.write`, which puts a ``provenance`` block first and the script's payload after it:

* ``script``, ``variant``: who wrote the file, and as what;
* ``commit``: ``git rev-parse HEAD`` when the run started; ``dirty``: whether ``git status --porcelain``
  (``benchmarks/results/`` left out) showed changes then or when the file was written, with the changed
  paths in ``changes`` (a result of code that no commit holds says so);
* ``date``: when the file was written (UTC), ``started``: when the run began;
* ``argv``: the command as run, ``python -m benchmarks.<script> ...``;
* ``seeds``: the seeds the results rest on, as the script reports them;
* ``machine``: platform, Python, torch and CPU count;
* ``merged`` (only when the script merged earlier files into this one, ``--add`` and the like): the
  provenance of each, oldest first, with its path. :func:`own` reads such an earlier file and refuses
  one that the same script did not write (and record): a file without provenance, one another script
  wrote, one from anywhere but ``benchmarks/results/<script>/``.

:func:`read` returns any result file with its provenance; a file without one (written before this
module) reads as ``legacy``: its numbers stand as they were measured, but no command is known to
rebuild them, and no script merges them. ``P2P_SPES_RESULTS`` sets another results root (tests).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
ROOT_ENV = "P2P_SPES_RESULTS"
MAIN = "main"
# what a complete provenance block holds; `changes`, `started`, `machine` and `merged` come on top
PROVENANCE_KEYS = ("script", "variant", "commit", "dirty", "date", "argv", "seeds")
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
MAX_CHANGES = 50


class ResultError(ValueError):
    """A result that cannot be written or merged as asked."""


def root() -> Path:
    """Where the result files live: ``benchmarks/results``, or ``$P2P_SPES_RESULTS``."""
    return Path(os.environ.get(ROOT_ENV) or RESULTS)


NOT_BENCHMARKS = ("__init__", "render")  # the package, and the script that renders tables from the results


def scripts() -> list[str]:
    """The benchmark scripts' names (``benchmarks/<script>.py``)."""
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def variant_name(text: str) -> str:
    """``text`` if it can name a result file (lowercase letters, digits, ``-`` and ``_``), else an error."""
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"variant {text!r}: lowercase letters, digits, '-' and '_' only (it names benchmarks/results/<script>/<variant>.json)"
        )
    return text


def add_variant(parser: argparse.ArgumentParser, default: str | None = MAIN, help: str | None = None) -> None:
    """The ``--variant`` option every script has."""
    parser.add_argument(
        "--variant",
        type=variant_name,
        default=default,
        help=help or f"writes benchmarks/results/<script>/<variant>.json (default {default})",
    )


def path(script: str, variant: str, suffix: str = ".json", base: Path | None = None) -> Path:
    """``<root>/<script>/<variant><suffix>`` (``suffix`` .json or .png)."""
    if script not in scripts():
        raise ResultError(f"{script!r} is not a benchmark script (benchmarks/<script>.py): {', '.join(scripts())}")
    try:
        variant_name(variant)
    except argparse.ArgumentTypeError as exc:
        raise ResultError(str(exc)) from None
    return (base or root()) / script / f"{variant}{suffix}"


def _git(repo: Path, *args: str) -> str | None:
    """``git args`` in ``repo`` (its stdout), None when git fails. ``safe.directory`` lets a run under
    sudo (the network lab) read a checkout another user owns."""
    try:
        out = subprocess.run(
            ["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def tree_state(repo: Path = REPO) -> dict[str, Any]:
    """The commit and the uncommitted changes of ``repo`` (``benchmarks/results/`` left out); commit None
    (and dirty True) when git cannot say."""
    commit = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    changes = [line for line in (status or "").splitlines() if line.strip()]
    return {
        "commit": commit.strip() if commit else None,
        "dirty": status is None or bool(changes),
        "changes": changes,
    }


def machine() -> dict[str, Any]:
    """What this process runs on, as a provenance records it: results from another platform are not
    bit-for-bit repeatable here (its CPU may take other kernels), so a reused run must come from this one."""
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch,
        "cpus": os.cpu_count(),
    }


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Result:
    """One result file: its payload, and its provenance (None: a legacy file, written before it existed)."""

    path: Path
    payload: dict[str, Any]
    provenance: dict[str, Any] | None

    @property
    def legacy(self) -> bool:
        return self.provenance is None

    @property
    def missing(self) -> list[str]:
        """The keys a complete provenance block has and this one lacks (all of them for a legacy file)."""
        return [k for k in PROVENANCE_KEYS if k not in (self.provenance or {})]

    @property
    def platform(self) -> str | None:
        """The platform the file was measured on (None: not recorded)."""
        return (self.provenance or {}).get("machine", {}).get("platform")

    @property
    def command(self) -> str | None:
        """The command that wrote the file, ready to paste (None for a legacy file)."""
        argv = (self.provenance or {}).get("argv")
        return " ".join(_quote(a) for a in argv) if argv else None


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\"'\"'") + "'"


def read(file: Path) -> Result:
    """A result file with its provenance split off; a JSON without one reads as ``legacy``."""
    data = json.loads(Path(file).read_text())
    if not isinstance(data, dict):
        raise ResultError(f"{file}: a result file holds a JSON object")
    provenance = data.pop("provenance", None)
    return Result(Path(file), data, provenance if isinstance(provenance, dict) else None)


def own(script: str, variant: str, base: Path | None = None) -> Result:
    """The earlier result ``script`` merges into its new one (``--add`` and the like): only a file under
    ``<root>/<script>/`` that ``script`` itself wrote and recorded. Refused (:class:`ResultError`): a
    legacy file without provenance, a file another script wrote (copied there, or written through
    another script's ``--out``), a complete provenance missing."""
    file = path(script, variant, base=base)
    result = read(file)
    if result.legacy:
        raise ResultError(
            f"{file} has no provenance (written before benchmarks/lab/results.py): no command is known to "
            "rebuild it, so nothing is merged into it; run its arms again without merging"
        )
    if result.provenance.get("script") != script:
        raise ResultError(
            f"{file} was written by {result.provenance.get('script')!r}, not {script!r}: a script merges only "
            "its own results"
        )
    if result.missing:
        raise ResultError(f"{file}: provenance without {', '.join(result.missing)}")
    return result


@dataclass
class Run:
    """One run of a benchmark script: its provenance taken when it starts (:func:`start`), then written
    with every result file (:meth:`write`; a script that writes as it goes calls it more than once)."""

    script: str
    variant: str
    seeds: list[int]
    argv: list[str]
    base: Path | None = None
    repo: Path = REPO
    started: str = field(default_factory=_now)
    state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        path(self.script, self.variant, base=self.base)  # a bad name fails now, not after hours of work
        if not self.state:
            self.state = tree_state(self.repo)

    @property
    def file(self) -> Path:
        """The JSON this run writes."""
        return path(self.script, self.variant, base=self.base)

    def sibling(self, suffix: str = ".json", variant: str | None = None) -> Path:
        """Another file of this run: its plot (``.png``), or another variant of the same script."""
        return path(self.script, variant or self.variant, suffix, base=self.base)

    def provenance(self, variant: str, merged: Sequence[Result] = ()) -> dict[str, Any]:
        now = tree_state(self.repo)  # code changed while the run went on is no commit's code either
        changed = now["commit"] != self.state["commit"] or now["changes"] != self.state["changes"]
        changes = sorted(set(self.state["changes"]) | set(now["changes"]))
        if len(changes) > MAX_CHANGES:
            changes = [*changes[:MAX_CHANGES], f"... and {len(changes) - MAX_CHANGES} more"]
        block = {
            "script": self.script,
            "variant": variant,
            "commit": self.state["commit"],
            "dirty": self.state["dirty"] or now["dirty"] or changed,
            "changes": changes,
            "date": _now(),
            "started": self.started,
            "argv": self.argv,
            "seeds": list(self.seeds),
            "machine": machine(),
        }
        if changed:
            block["changed_during_run"] = {"commit": now["commit"]}
        history = []
        for earlier in merged:
            own_block = {k: v for k, v in earlier.provenance.items() if k != "merged"}
            history += [*earlier.provenance.get("merged", []), {"path": _shown(earlier.path), **own_block}]
        if history:
            block["merged"] = history
        return block

    def write(self, payload: dict[str, Any], merged: Sequence[Result] = (), variant: str | None = None) -> Path:
        """``payload`` with this run's provenance to ``<root>/<script>/<variant>.json`` (this run's variant
        unless ``variant`` names another, as wan_codecs' per-run files do); ``merged``: the earlier results
        (from :func:`own`) whose contents the payload carries on."""
        if "provenance" in payload:
            raise ResultError("the payload carries its own 'provenance'")
        for earlier in merged:
            if earlier.legacy or earlier.provenance.get("script") != self.script:
                raise ResultError(f"{earlier.path}: not a result of {self.script} (read it with results.own)")
        variant = variant or self.variant
        out = path(self.script, variant, base=self.base)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"provenance": self.provenance(variant, merged), **payload}, indent=1)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)  # a reader never sees half a file
        return out


def _shown(file: Path) -> str:
    try:
        return str(file.resolve().relative_to(REPO))
    except ValueError:
        return str(file)


def start(
    script: str,
    variant: str = MAIN,
    seeds: Sequence[int] = (),
    argv: list[str] | None = None,
    base: Path | None = None,
    repo: Path = REPO,
) -> Run:
    """A run of ``benchmarks/<script>.py`` writing ``variant``: the commit and the tree's state now, the
    command (``argv``: its arguments, default ``sys.argv[1:]``) and the seeds."""
    args = sys.argv[1:] if argv is None else list(argv)
    return Run(script, variant, list(seeds), ["python", "-m", f"benchmarks.{script}", *args], base, repo)


def write(
    script: str,
    variant: str,
    payload: dict[str, Any],
    seeds: Sequence[int],
    argv: list[str] | None = None,
    merged: Sequence[Result] = (),
    base: Path | None = None,
    repo: Path = REPO,
) -> Path:
    """``start(...).write(payload)``: for a script whose run is over when it writes."""
    return start(script, variant, seeds, argv, base, repo).write(payload, merged)
