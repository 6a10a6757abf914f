"""The benchmarks' result files, one way (``benchmarks/lab/results.py``):

1. every file under ``benchmarks/results`` is ``<script>/<variant>.json`` or ``.png``, ``<script>`` a
   benchmark script (``benchmarks/<script>.py``), a plot beside its JSON;
2. every JSON there has a complete provenance block (commit, dirty, date, argv, seeds) written by that
   script as that variant, or is listed in ``LEGACY`` with the reason it has none: a new file without
   provenance fails, and so does an entry left here after its file was re-run;
3. every benchmark script writes through ``benchmarks.lab.results`` and nothing else (read with ``ast``:
   nothing imported or run), with no ``--out`` or ``--json`` that could put a result elsewhere;
4. the writer records a dirty tree as dirty (a temporary git repository), and the merge helper refuses
   a file another script wrote, and one without provenance.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.lab import results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPTS = results.scripts()  # every benchmarks/*.py but the package and the renderer

# Written before benchmarks/lab/results.py: no provenance (no commit, date or seeds known; where a command
# was kept it is the file's own, unchecked), so no script merges them. Each gains one when its command is
# run again (then it leaves this list). Never add a file here: write it through benchmarks.lab.results.
LEGACY: dict[str, str] = {
    "chaos/main.json": "its command field leaves out the config overrides; no commit",
    "comms/topk-dense.json": "command kept (--compressions topk topk-dense --rounds 3), no commit",
    "convergence/main.json": "command kept, no commit",
    "convergence/lone-holder.json": "written through --out convergence_lone_holder; no commit",
    "convergence/topk-dense.json": "written through --out convergence_topk_dense; no commit",
    "convergence/topk-dense-8peers.json": "written through --out convergence_topk_dense_8peers; no commit",
    "convergence/topk-dense-sync10.json": "written through --out convergence_topk_dense_sync10; no commit",
    "convergence/topk-keep.json": "written through --out convergence_topk_keep; no commit",
    "convergence/topk-keep-sync10.json": "written through --out convergence_topk_keep_sync10; no commit",
    "convergence/topk-sync10.json": "written through --out convergence_topk_sync10; no commit",
    "grad_norms/main.json": "command kept, no commit",
    "local_steps/main.json": "merged (--add) from files under /tmp over many sessions; no commit",
    "local_steps/1600.json": "two commands merged with --add; no commit",
    "local_steps/b32.json": "written through --out; no commit",
    "local_steps/d128.json": "written through --out; no commit",
    "local_steps/d256.json": "written through --out; no commit",
    "local_steps/dense.json": "merged from files under /tmp/ls; no commit",
    "quality/main.json": "37 arms merged with --add over sessions, a command per arm; no commit",
    "residency/main.json": "its arguments kept, no command or commit",
    "scale/main.json": "command kept, no commit",
    "scale/churn-seed1.json": "command kept, no commit",
    "scale/churn-seed2.json": "command kept, no commit",
    "scale/churn-seed3.json": "command kept, no commit",
    "scale/churn-8-seed1.json": "written to /tmp/runs and copied here; no commit",
    "scale/churn-8-seed2.json": "written to /tmp/runs and copied here; no commit",
    "scale/churn-8-seed3.json": "written to /tmp/runs and copied here; no commit",
    "scale/churn-grid.json": "written to /tmp/bench and copied here; no commit",
    "sync_overhead/main.json": "command kept, no commit",
    "wan/2x20.json": "commit 192519c recorded, on a dirty tree",
    "wan/2x20-overlap.json": "commit 192519c recorded, on a dirty tree",
    "wan/4x20.json": "commit 192519c recorded (clean), no date",
    "wan/4x100-slow.json": "commit 192519c recorded (clean), no date",
    "wan_codecs/main.json": "a table of per-run files written by another script (wan.py) at five commits",
    "wan_codecs/none-blocking.json": "written by wan.py --out, not this script (commit d4b11e2, dirty)",
    "wan_codecs/none-overlap.json": "written by wan.py --out, not this script (commit 3d8799a, dirty)",
    "wan_codecs/fp16-blocking.json": "written by wan.py --out, not this script (commit d4b11e2, dirty)",
    "wan_codecs/fp16-overlap.json": "written by wan.py --out, not this script (commit 42c3d4b)",
    "wan_codecs/int8-blocking.json": "written by wan.py --out, not this script (commit d4b11e2, dirty)",
    "wan_codecs/int8-overlap.json": "written by wan.py --out, not this script (commit 42c3d4b, dirty)",
    "wan_codecs/int4-blocking.json": "written by wan.py --out, not this script (commit d4b11e2, dirty)",
    "wan_codecs/int4-overlap.json": "written by wan.py --out, not this script (commit 42c3d4b, dirty)",
    "wan_codecs/topk-blocking.json": "written by wan.py --out, not this script (commit d4b11e2, dirty)",
    "wan_codecs/topk-overlap.json": "written by wan.py --out, not this script (commit 133c44c)",
    "wan_codecs/topk-dense-blocking.json": "written by wan.py --out, not this script (commit 516526e)",
    "wan_codecs/topk-dense-overlap.json": "written by wan.py --out, not this script (commit 516526e)",
}
# writes a script may make besides its results, (script, call) -> why
ALLOWED_WRITES: dict[tuple[str, str], str] = {
    ("convergence", "open"): "a centralized run's log, in the run's temporary directory",
    ("tokenize_throughput", "open"): "the generated JSONL corpus it tokenizes, in the run's temporary directory",
}


def stored() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def test_every_result_file_follows_the_scheme():
    wrong = []
    for file in stored():
        parts = file.relative_to(RESULTS).parts
        ok = (
            len(parts) == 2
            and parts[0] in SCRIPTS
            and file.suffix in (".json", ".png")
            and results.NAME.fullmatch(file.stem) is not None
        )
        if not ok:
            wrong.append("/".join(parts))
        elif file.suffix == ".png" and not file.with_suffix(".json").exists():
            wrong.append(f"{'/'.join(parts)} (a plot without its JSON)")
    assert not wrong, f"not benchmarks/results/<script>/<variant>.json|png (scripts: {SCRIPTS}): {wrong}"


def test_every_result_has_a_complete_provenance_or_is_listed_as_legacy():
    problems = []
    for file in stored():
        if file.suffix != ".json":
            continue
        name = file.relative_to(RESULTS).as_posix()
        result = results.read(file)
        if result.legacy:
            if name not in LEGACY:
                problems.append(f"{name}: no provenance (write it through benchmarks.lab.results)")
            continue
        if name in LEGACY:
            problems.append(f"{name}: has a provenance now; drop it from LEGACY")
        p, script = result.provenance, file.parent.name
        if result.missing:
            problems.append(f"{name}: provenance without {result.missing}")
            continue
        if (p["script"], p["variant"]) != (script, file.stem):
            problems.append(f"{name}: written by {p['script']} as {p['variant']}")
        if not re.fullmatch(r"[0-9a-f]{40}", p["commit"] or ""):
            problems.append(f"{name}: commit {p['commit']!r}")
        if not isinstance(p["dirty"], bool) or not all(isinstance(s, int) for s in p["seeds"]):
            problems.append(f"{name}: dirty {p['dirty']!r}, seeds {p['seeds']!r}")
        if p["argv"][:3] != ["python", "-m", f"benchmarks.{script}"]:
            problems.append(f"{name}: argv {p['argv'][:3]}")
        for earlier in p.get("merged", []):
            if earlier.get("script") != script or not earlier.get("path", "").startswith(
                f"benchmarks/results/{script}/"
            ):
                problems.append(f"{name}: merged {earlier.get('path')} of {earlier.get('script')}")
    missing = sorted(set(LEGACY) - {f.relative_to(RESULTS).as_posix() for f in stored()})
    assert not problems, problems
    assert not missing, f"LEGACY lists files that are gone: {missing}"


def _writes(script: str, tree: ast.Module) -> tuple[bool, list[str]]:
    """Whether ``tree`` writes through ``benchmarks.lab.results``, and the other writes it makes."""
    modules, functions = set(), set()  # local names of the results module, and of its writers
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks.lab":
            modules |= {a.asname or a.name for a in node.names if a.name == "results"}
        elif isinstance(node, ast.ImportFrom) and node.module == "benchmarks.lab.results":
            functions |= {a.asname or a.name for a in node.names if a.name in ("start", "write")}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "benchmarks.lab.results" and a.asname}
    through, other = False, []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
            through |= f.attr in ("start", "write")
        if isinstance(f, ast.Name) and f.id in functions:
            through = True
        call = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "json" and call == "dump":
            other.append(f"json.dump (line {node.lineno})")
        if call in ("write_text", "write_bytes") or (call == "open" and (script, "open") not in ALLOWED_WRITES):
            other.append(f"{call} (line {node.lineno})")
        if call == "add_argument" and any(
            isinstance(a, ast.Constant) and a.value in ("--out", "--json") for a in node.args
        ):
            other.append(f"an option {node.args[0].value} (line {node.lineno})")
    return through, other


def test_every_benchmark_script_writes_through_the_results_module():
    problems = []
    for script in SCRIPTS:
        path = ROOT / "benchmarks" / f"{script}.py"
        through, other = _writes(script, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if not through:
            problems.append(f"{script}: writes nothing through benchmarks.lab.results (start / write)")
        if other:
            problems.append(f"{script}: writes outside it: {other}")
        if re.search(r"python benchmarks/\w+\.py", ast.get_docstring(ast.parse(path.read_text())) or ""):
            problems.append(f"{script}: its docstring runs python benchmarks/<script>.py, not -m")
    assert not problems, problems


def test_the_ast_check_sees_a_write_outside_the_results_module():
    tree = ast.parse(
        "from benchmarks.lab import results\nimport json\n"
        "def main():\n    results.start('comms').write({})\n    json.dump({}, open('x', 'w'))\n"
        "    p.add_argument('--out')\n"
    )
    through, other = _writes("comms", tree)
    assert through
    assert sorted(o.split(" ")[0] for o in other) == ["an", "json.dump", "open"]
    assert _writes("comms", ast.parse("import json\nPath('x').write_text('{}')\n")) == (False, ["write_text (line 2)"])


# The writer and the merge helper, on a temporary git repository -----------------------------------------
def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "code.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return repo


def write(repo: Path, script: str = "comms", variant: str = "main", payload: dict | None = None, **kw) -> Path:
    base = repo / "benchmarks" / "results"
    return results.write(
        script, variant, payload or {"x": 1}, [0, 1], argv=["--rounds", "3"], base=base, repo=repo, **kw
    )


def test_the_writer_records_the_commit_and_a_dirty_tree_as_dirty(repo):
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "benchmarks" / "results" / "scratch.json").write_text("{}")  # results never make a tree dirty
    clean = results.read(write(repo))
    assert clean.provenance["commit"] == head and clean.provenance["dirty"] is False
    assert clean.provenance["argv"] == ["python", "-m", "benchmarks.comms", "--rounds", "3"]
    assert clean.provenance["seeds"] == [0, 1] and not clean.missing and clean.payload == {"x": 1}
    assert clean.path == repo / "benchmarks" / "results" / "comms" / "main.json"

    (repo / "code.py").write_text("x = 2\n")
    dirty = results.read(write(repo, variant="dirty")).provenance
    assert dirty["dirty"] is True and dirty["changes"] == [" M code.py"] and dirty["commit"] == head
    (repo / "code.py").write_text("x = 1\n")
    (repo / "new.py").write_text("")  # an untracked file is code no commit holds too
    assert results.read(write(repo, variant="untracked")).provenance["dirty"] is True


def test_a_tree_changed_during_the_run_is_recorded_dirty(repo):
    run = results.start("comms", "main", seeds=[0], argv=[], base=repo / "benchmarks" / "results", repo=repo)
    (repo / "code.py").write_text("x = 3\n")
    provenance = results.read(run.write({"x": 1})).provenance
    assert provenance["dirty"] is True and "changed_during_run" in provenance


def test_outside_git_the_commit_is_unknown_and_the_tree_counts_as_dirty(tmp_path):
    state = results.tree_state(tmp_path)
    assert state["commit"] is None and state["dirty"] is True


def test_the_merge_helper_refuses_another_scripts_file_and_one_without_provenance(repo):
    base = repo / "benchmarks" / "results"
    other = write(repo, script="wan", variant="none-blocking")  # wan.py --out into wan_codecs' directory, say
    (base / "wan_codecs").mkdir()
    shutil.copy(other, base / "wan_codecs" / "none-blocking.json")
    with pytest.raises(results.ResultError, match="written by 'wan', not 'wan_codecs'"):
        results.own("wan_codecs", "none-blocking", base=base)
    (base / "wan_codecs" / "old.json").write_text(json.dumps({"command": "python benchmarks/wan.py"}))
    assert results.read(base / "wan_codecs" / "old.json").legacy
    with pytest.raises(results.ResultError, match="no provenance"):
        results.own("wan_codecs", "old", base=base)
    with pytest.raises(results.ResultError, match="not a result of comms"):  # nor by handing it to the writer
        write(repo, merged=[results.read(other)])


def test_a_merged_file_keeps_the_provenance_of_every_file_it_carries_on(repo):
    base = repo / "benchmarks" / "results"
    first = write(repo, payload={"arms": ["a"]})
    second = write(repo, payload={"arms": ["a", "b"]}, merged=[results.own("comms", "main", base=base)])
    third = write(repo, payload={"arms": ["a", "b", "c"]}, merged=[results.own("comms", "main", base=base)])
    assert second == third == first
    merged = results.read(third).provenance["merged"]
    assert len(merged) == 2 and all(m["script"] == "comms" and m["path"].endswith("comms/main.json") for m in merged)
    assert "merged" not in merged[1]  # flat: oldest first, each without its own history


def test_names_outside_the_scheme_are_refused(repo):
    with pytest.raises(results.ResultError, match="not a benchmark script"):
        results.path("nonesuch", "main")
    for bad in ("../x", "Main", "a.b", ""):
        with pytest.raises(results.ResultError):
            results.path("comms", bad)
    with pytest.raises(results.ResultError, match="provenance"):
        write(repo, payload={"provenance": {}})
