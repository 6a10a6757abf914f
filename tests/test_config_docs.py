"""The config documents itself: every field's doc and scope, docs/configuration.md and ``config --explain``."""

from __future__ import annotations

import dataclasses

from p2p_spes.cli import main as cli_main
from p2p_spes.config import Config, sections
from p2p_spes.config_docs import REFERENCE, REGENERATE, explain, markdown_text, render_reference, setting_docs
from p2p_spes.config_docs import main as docs_main
from p2p_spes.config_fields import SCOPES


def test_every_field_has_a_doc_and_a_scope():
    for section, cls in sections().items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc", "").strip(), f"{section}.{f.name}: declare it with setting(doc=...)"
            assert f.metadata.get("scope") in SCOPES, f"{section}.{f.name}: scope {f.metadata.get('scope')!r}"


def test_the_reference_is_what_the_generator_renders():
    """docs/configuration.md cannot drift from the fields: after changing one, run the generator."""
    assert REFERENCE.read_text() == render_reference(), f"docs/configuration.md is stale: run {REGENERATE}"
    assert docs_main(["--check"]) == 0


def test_the_reference_has_every_section_and_key(tmp_path):
    text = render_reference()
    assert REGENERATE in text.splitlines()[0]  # the header says how to regenerate it
    for section in sections():
        assert f"\n## {section}\n" in text
    for d in setting_docs():
        assert f"\n### {d.key}\n" in text
    assert '`"disjoint" | "shared"`, default `"disjoint"`, scope **run**' in text
    assert '`list[str]`, default `["/ip4/0.0.0.0/tcp/0"]`, scope **local**' in text
    assert "`str | null`, default `null`, scope **local**" in text  # data.train
    assert "`[float, float]`, default `[0.9, 0.95]`" in text
    out = tmp_path / "configuration.md"
    assert docs_main(["--check", "--out", str(out)]) == 1  # missing: stale
    assert docs_main(["--out", str(out)]) == 0 and out.read_text() == text


def test_markdown_escapes_leave_code_alone():
    assert markdown_text("owns [p*n, (p+1)*n) with `a*b`") == "owns [p\\*n, (p+1)\\*n) with `a*b`"
    assert markdown_text(">= 2: rows") == "\\>= 2: rows"


def test_explain_marks_what_differs_from_the_default(capsys):
    assert cli_main(["config", "--explain", "--set", "train.lr=0.1", "--set", "swarm.run_id=mine"]) == 0
    out = capsys.readouterr().out
    assert "train.lr = 0.1  [run] changed (default 0.003)\n    Peak learning rate" in out
    assert 'swarm.run_id = "mine"  [local] changed (default "p2p-spes")' in out
    assert "model.vocab_size = 8192  [model] default\n" in out
    assert "train.batch_size = 8  [batch] default\n" in out
    assert "# data: The run's tokens: a published manifest" in out
    assert out.rstrip().splitlines()[-1].startswith("# model fingerprint: ")
    assert sum(line.startswith("    ") is False and " = " in line for line in out.splitlines()) == len(setting_docs())
    assert "changed" not in explain(Config())


def test_config_without_explain_still_prints_yaml(capsys):
    assert cli_main(["config", "--config", "spes-1b"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size: 151665" in out and "[model]" not in out
