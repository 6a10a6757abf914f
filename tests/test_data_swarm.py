"""A run's data end to end on loopback, as the README's "Start a run" does it: the organiser tokenizes a
corpus that is not the embedded one, serves it with ``python -m http.server`` and starts the run with
``data.manifest``; volunteers join with nothing but the multiaddr and ``--config-from-swarm``, fetch only
their partition, and a volunteer who comes after the file server is gone gets its shards from peers.
A peer on other data, or reading the run's data with another tokenizer, is refused before it trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import P2P, SMALL, free_port, stop, wait_for

from dht.inspector import collect, open_dht
from p2p_spes.corpus import embedded_tokenizer_path
from p2p_spes.data_fetch import partition_shards
from p2p_spes.tokenization import tokenize_files

RUN = ["--run-id", "data", "--no-progress", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


def stdlib_corpus(path: Path, files: int = 80) -> Path:
    """Python's own standard library sources as JSON lines: text that is not the embedded corpus."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:files]
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(
            json.dumps({"text": source.read_text(encoding="utf-8", errors="replace")}) + "\n" for source in sources
        )
    return path


def other_tokenizer(tmp_path: Path) -> Path:
    """The embedded tokenizer with two ids swapped: it loads, but maps text to other ids."""
    out = tmp_path / "other-tokenizer"
    shutil.copytree(embedded_tokenizer_path(), out)
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return out


def peer(tmp_path: Path, name: str, args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, P2P_SPES_CACHE=str(tmp_path / f"cache-{name}"), PYTHONUNBUFFERED="1")
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process by the test)
    return subprocess.Popen(
        [*P2P, "train", "--run-dir", str(tmp_path / name), *RUN, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def training(tmp_path: Path, name: str) -> bool:
    metrics = tmp_path / name / "metrics.jsonl"
    return metrics.exists() and '"loss"' in metrics.read_text()


@pytest.mark.slow
def test_volunteers_train_on_the_runs_data_fetched_by_partition_and_from_peers_once_the_server_is_gone(tmp_path):
    data = tmp_path / "tokens"
    manifest = tokenize_files(
        [str(stdlib_corpus(tmp_path / "corpus.jsonl"))],
        embedded_tokenizer_path(),
        data,
        validation_fraction=0.05,
        shard_tokens=60_000,
        num_workers=1,
        progress=False,
    )
    assert len(manifest.shards("train")) >= 8
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/"
    run = [
        a
        for item in [*SMALL, "train.max_steps=100000", "peer.count=2", f"data.manifest={url}"]
        for a in ("--set", item)
    ]
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["organiser"] = peer(tmp_path, "organiser", ["--config", "tiny", "--swarm", *run])
        wait_for(lambda: (tmp_path / "organiser" / "peer.json").exists(), 90, "the organiser up", procs["organiser"])
        maddrs = json.loads((tmp_path / "organiser" / "peer.json").read_text())["maddrs"]
        join = ["--config-from-swarm", "--initial-peers", *maddrs]
        procs["first"] = peer(tmp_path, "first", join)
        wait_for(
            lambda: training(tmp_path, "first"),
            180,
            "the first volunteer training",
            procs["first"],
            tmp_path / "first.log",
        )
        other = subprocess.run(  # the embedded corpus, same model: refused before it trains
            [*P2P, "train", "--config", "tiny", "--run-dir", str(tmp_path / "other"), *RUN, "--initial-peers", *maddrs]
            + [a for item in [*SMALL, "peer.count=2"] for a in ("--set", item)],
            capture_output=True,
            text=True,
            timeout=180,
            start_new_session=True,
        )
        wrong = subprocess.run(  # the run's data read with another tokenizer: refused before it trains
            [*P2P, "train", "--run-dir", str(tmp_path / "wrong"), *RUN, *join]
            + ["--set", f"data.tokenizer={other_tokenizer(tmp_path)}"],
            capture_output=True,
            text=True,
            timeout=180,
            start_new_session=True,
            env=dict(os.environ, P2P_SPES_CACHE=str(tmp_path / "cache-wrong")),
        )
        stop(server)
        procs["late"] = peer(tmp_path, "late", join)
        wait_for(
            lambda: training(tmp_path, "late"), 180, "the late volunteer training", procs["late"], tmp_path / "late.log"
        )
        dht = open_dht(maddrs, "data")
        try:  # the inspector names the data each peer trains on
            seen = wait_for(
                lambda: (s := collect(dht, "data"))["run"]["peers"] == 3 and s, 60, "3 peers in the inspector"
            )
        finally:
            dht.shutdown()
    finally:
        for proc in procs.values():
            stop(proc)
        stop(server)
    assert other.returncode == 2, other.stdout + other.stderr
    assert "trains on other data (other shards)" in other.stderr and "--config-from-swarm" in other.stderr
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert "the shards were made with tokenizer" in wrong.stderr and "use the same tokenizer" in wrong.stderr
    assert not (tmp_path / "wrong" / "metrics.jsonl").exists()
    assert seen["run"]["data"] == [manifest.fingerprint]
    assert sorted(p["data_partition"] for p in seen["peers"]) in ([0, 0, 1], [0, 1, 1])

    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in procs}
    whole = sum(f.bytes for f in manifest.files())
    for name, summary in summaries.items():
        assert summary["data_fingerprint"] == manifest.fingerprint, name
        assert summary["data"]["origin"] == url and summary["steps_computed"] > 0, name
        assert summary["data"]["train_shards"] == len(manifest.shards("train")) // 2 or name == "late"
    first = summaries["first"]["data"]
    assert 0 < first["fetched_bytes"] < whole  # its partition, the validation shards and the tokenizer only
    late = summaries["late"]["data"]
    assert late["fetched_bytes"] > 0 and all(source.startswith("peer ") for source in late["fetched_from"]), late
    # every byte counted on the wire: the data the late peer fetched crossed its streams, and its sources count it served
    assert summaries["late"]["traffic"]["data_fetched"]["received"] >= late["fetched_bytes"]
    served = {n: summaries[n]["traffic"]["data_served"]["sent"] for n in ("organiser", "first")}
    assert sum(served.values()) >= late["fetched_bytes"]
    assert all(summaries[n]["bytes_served"] >= served[n] for n in served)
    late_log = (tmp_path / "late.log").read_text()
    assert "read the run's manifest from peer" in late_log
    for name, summary in summaries.items():  # each cache holds its partition's train shards, no others
        cached = tmp_path / f"cache-{name}" / "data" / manifest.fingerprint[:16]
        assert sorted(str(p.relative_to(cached)) for p in (cached / "train").iterdir()) == partition_shards(
            manifest, summary["data_partition"], 2
        ), name
