"""README.md's Numbers and benchmarks/README.md's table are what ``benchmarks/render.py`` makes of the result
files: a figure edited by hand, or a result run again without rendering, fails here (and in
``python -m benchmarks.render --check``). The marker handling names the file when a marker is missing,
duplicated, unknown or unclosed."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import render
from benchmarks.lab import results

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = {"numbers": lambda: "- a bullet"}


@pytest.mark.parametrize("rel", sorted(render.TARGETS))
def test_each_file_is_what_the_result_files_render_to(rel):
    text = (ROOT / rel).read_text(encoding="utf-8")
    assert render.render_text(text, render.TARGETS[rel], rel) == text, (
        f"{rel} differs from what the result files give: run .venv/bin/python -m benchmarks.render"
    )


def test_check_exits_1_with_a_diff_when_a_figure_was_edited_by_hand(tmp_path, capsys):
    for rel in render.TARGETS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    readme = tmp_path / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert "421 of 421 consistency checks" in text
    readme.write_text(text.replace("421 of 421 consistency checks", "422 of 422 consistency checks"))
    assert render.main(["--check"], repo=tmp_path) == 1
    out = capsys.readouterr()
    assert "-" in out.out and "+" in out.out and "422 of 422" in out.out and "README.md" in out.err
    assert render.main([], repo=tmp_path) == 0  # rendering puts the figure back
    assert readme.read_text(encoding="utf-8") == (ROOT / "README.md").read_text(encoding="utf-8")
    assert render.main(["--check"], repo=tmp_path) == 0


def _results_copy(tmp_path: Path, monkeypatch) -> Path:
    base = tmp_path / "results"
    shutil.copytree(results.RESULTS, base)
    monkeypatch.setenv(results.ROOT_ENV, str(base))
    return base


def test_a_result_run_again_without_rendering_shows_as_a_difference(tmp_path, monkeypatch):
    base = _results_copy(tmp_path, monkeypatch)
    chaos = base / "chaos" / "main.json"
    data = json.loads(chaos.read_text())
    data["consistency_failures"] = ["round 3: peer 1's expert 2 differs"]
    chaos.write_text(json.dumps(data))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rendered = render.render_text(readme, render.TARGETS["README.md"], "README.md")
    assert rendered != readme and "passed 420 of 421 consistency checks" in rendered
    table = (ROOT / "benchmarks/README.md").read_text(encoding="utf-8")
    assert "420/421 consistency checks" in render.render_text(table, render.TARGETS["benchmarks/README.md"], "x")


def test_a_legacy_file_is_marked_and_one_with_provenance_names_its_commit(tmp_path, monkeypatch):
    base = _results_copy(tmp_path, monkeypatch)
    assert "(legacy: no provenance)" in render.chaos()[0]
    chaos = base / "chaos" / "main.json"
    data = json.loads(chaos.read_text())
    provenance = {"script": "chaos", "variant": "main", "commit": "0123456789" * 4, "dirty": True}
    chaos.write_text(json.dumps({"provenance": {**provenance, "seeds": [0]}, **data}))
    bullet = render.chaos()[0]
    assert "legacy" not in bullet and "(commit 0123456, uncommitted changes)" in bullet


def test_one_seed_several_seeds_and_no_seed_are_said():
    legacy = results.Result(Path("x/main.json"), {}, None)
    assert render.seeds(legacy, [0]) == "one seed"
    assert render.seeds(legacy, [0, 1, 2]) == "3 seeds"
    assert render.seeds(legacy) == "one run"
    assert render.span([0.109, 0.111], ".1%") == "10.9% to 11.1%"
    assert render.span([1.0, 1.0], ".0%") == "100% on every seed"


# figures the results give without measuring them: counts of list items (seeds, rounds, kills), names
# (memory's setup "spes 4/16", the projections' peer counts and sync_overhead's intervals are strings or
# keys), a mode (simulate's group size), an override (`swarm.topk_result_fraction: 0.0625`), and the 1%
# topk-dense aims at
NOT_MEASURED = {
    "README": {"4", "16", "3", "0.0625", "1%"},
    "wan": {"3"},
    "sync_overhead": {"100", "25"},
    "convergence": {"3"},
    "quality": {"3"},
    "scale": {"1", "0"},  # one kill; 0 peer-rounds neither averaged nor adopted (two equal counts stay equal)
    "simulate": {"16", "3"},
    "equal_time": {"3"},  # its seeds
    "codec_rounds": {"4", "3"},  # the peer count (a key) and the seeds
    "refresh_cadence": {"3"},  # the seeds
}
NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?(?:%|x|B)?")


def test_every_figure_rendered_moves_with_its_result(tmp_path, monkeypatch):
    """Every measured number in every result file changed: each figure in the bullets and headlines
    changes too, so none of them is typed (the "what", "command" and "minutes" cells are static)."""
    before = _figures()
    base = _results_copy(tmp_path, monkeypatch)
    for file in base.rglob("*.json"):
        file.write_text(json.dumps(_changed(json.loads(file.read_text()))))
    after = _figures()
    typed = []
    for place, old in before.items():
        new = after[place]
        # figure by figure; where a clause came or went (topk's "within 1%"), figures found in both texts
        stayed = [o for o, n in zip(old, new) if o == n] if len(old) == len(new) else Counter(old) & Counter(new)
        typed += [(place, n) for n in stayed if n not in NOT_MEASURED.get(place.split()[0], set())]
    assert not typed, f"figures that did not follow their result: {typed}"


def _figures() -> dict[str, list[str]]:
    """The numbers of each README bullet and of each headline cell of the table, in order."""
    rows = [row.split(" | ") for row in render.scripts_table().splitlines()[2:]]
    bullets = [(f"README {i}", text) for i, text in enumerate(render.numbers().split("\n- "))]
    texts = [*bullets, *((row[0].strip("|` "), row[4]) for row in rows)]
    words = {where: [word.rstrip(".,:;)") for word in re.split(r"[\s(]+", text)] for where, text in texts}
    return {where: [word for word in ws if NUMBER.fullmatch(word)] for where, ws in words.items()}


STRUCTURE = {"seed", "seeds", "round", "peer", "group_size"}  # keys that line the files' rows up, or flag a mode


def _changed(value, key=""):
    """Every number changed, recursively, but under ``STRUCTURE``: equal numbers stay equal (rows still
    line up), and a float's factor depends on its value, so a ratio of two moves too."""
    if isinstance(value, dict):
        return {k: _changed(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_changed(v, key) for v in value]
    if isinstance(value, bool) or not isinstance(value, int | float) or key in STRUCTURE:
        return value
    factor = 1.1 + int(abs(value) * 1e6) % 97 * 0.003
    return int(value * factor) + 1 if isinstance(value, int) else value * factor + 0.01


@pytest.mark.parametrize(
    "text, says",
    [
        ("# title\n\nno markers here\n", "no marker <!-- rendered: numbers -->"),
        ("<!-- rendered: numbers -->\nold\n", "never closed"),
        (
            "<!-- rendered: numbers -->\n<!-- end rendered -->\n<!-- rendered: numbers -->\n<!-- end rendered -->\n",
            "twice",
        ),
        ("<!-- rendered: tables -->\n<!-- end rendered -->\n", "'tables'"),
        ("text\n<!-- end rendered -->\n", "without an opening"),
        ("<!-- rendered: numbers -->\n<!-- rendered: numbers -->\n<!-- end rendered -->\n", "inside"),
        ("<!-- rendered numbers -->\n<!-- end rendered -->\n", "malformed"),
    ],
)
def test_a_marker_missing_duplicated_or_out_of_place_is_an_error_naming_the_file(text, says):
    with pytest.raises(render.RenderError, match="docs/SOME.md") as error:
        render.render_text(text, NUMBERS, "docs/SOME.md")
    assert says in str(error.value)


def test_only_the_text_between_the_markers_changes():
    text = "# t\n\nbefore\n<!-- rendered: numbers -->\nstale\nlines\n<!-- end rendered -->\nafter\n"
    assert render.render_text(text, NUMBERS, "x.md") == (
        "# t\n\nbefore\n<!-- rendered: numbers -->\n- a bullet\n<!-- end rendered -->\nafter\n"
    )


def test_a_target_file_without_its_markers_fails_the_check(tmp_path, capsys):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "README.md").write_text("# no markers\n")
    shutil.copy(ROOT / "benchmarks" / "README.md", tmp_path / "benchmarks" / "README.md")
    assert render.main(["--check"], repo=tmp_path) == 2
    assert "README.md" in capsys.readouterr().err


def test_the_lone_copies_table_reads_a_files_result_share_as_the_benchmark_writes_it():
    from benchmarks import refresh_cadence  # a file names its result share only when it is not the default

    assert render.DENSE_RESULT == refresh_cadence.RESULT


def test_the_lone_copies_table_refuses_rows_from_another_machine_than_its_baseline(tmp_path, monkeypatch):
    base = _results_copy(tmp_path, monkeypatch)
    render.lone_copies_table()  # the stored files: one machine
    moved = base / "refresh_cadence" / "p8-r8-topk.json"
    data = json.loads(moved.read_text())
    data["provenance"]["machine"]["platform"] = "another machine"
    moved.write_text(json.dumps(data))
    with pytest.raises(render.RenderError, match="different machines"):
        render.lone_copies_table()


def test_a_swarm_mode_names_only_the_settings_it_changes_and_shows_a_peer_count_not_run(monkeypatch):
    row = ("a share of their own", "lone5", "spes-topk-dense-lone5", (None, "lone5-8peers-150r"))
    monkeypatch.setattr(render, "SWARM_MODES", (row,))
    line = render.swarm_codec().splitlines()[2]
    # the arm sets the result share to topk-dense's own value: only the lone share is named
    assert line.startswith("| a share of their own (`swarm.topk_lone_fraction: 0.01953125`) | ")
    assert "result_fraction" not in line
    assert line.split(" | ")[2] == "not run" and "3 seeds" in line.split(" | ")[3]
    # bytes measured with another lone share than the arm trained with are refused
    monkeypatch.setattr(render, "SWARM_MODES", (("x", "main", *row[2:]),))
    with pytest.raises(render.RenderError, match="topk_lone_fraction=None, the arm spes-topk-dense-lone5 runs"):
        render.swarm_codec()


def test_a_swarm_mode_run_at_one_seed_says_so(monkeypatch):
    variant, arm = "dense8-lone8-guarded-8peers-150r", "spes-topk-dense8-lone8"
    monkeypatch.setattr(render, "SWARM_MODES", (("at 8", "dense8-lone8", arm, (None, variant)),))
    cell = render.swarm_codec().splitlines()[2].split(" | ")[3]
    summary = render.load("convergence", variant).payload["summary"]
    [seed] = summary[arm]["finals"]
    gap = summary[arm]["finals"][seed] / summary["spes"]["finals"][seed] - 1
    assert cell == f"{gap:+.2%} (seed {seed} only) |"
