"""The run's data without a swarm: the manifest and its fingerprint, partitions by shard, fetching
(only the partition, resumed, checked, refetched when corrupt, from the best source), the cache limit,
and the compatibility check that refuses a peer on other data."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_spes.config import load_config
from p2p_spes.data import TokenDataset
from p2p_spes.data_fetch import Fetcher, partition_shards
from p2p_spes.data_manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ShardEntry,
    TokenizerInfo,
    decode_manifest,
    read_manifest,
    write_manifest,
)
from p2p_spes.data_sources import DirectorySource, SourceError, UrlSource
from p2p_spes.errors import ConfigError, DataError, SwarmError
from p2p_spes.export import resolve_tokenizer
from p2p_spes.run_data import identify_data, prepare_data
from p2p_spes.swarm.compat import Ours, check_data
from p2p_spes.train import peer_loader


def make_data_dir(root: Path, train: int = 8, tokens: int = 600, seed: int = 0) -> Manifest:
    """A version-2 token directory of uint16 shards written through the manifest API, plus one
    tokenizer-like file (so that fetching the tokenizer's files is exercised too)."""
    rng = np.random.default_rng(seed)
    splits: dict[str, tuple[ShardEntry, ...]] = {}
    for split, count in (("train", train), ("validation", 1)):
        entries = []
        for i in range(count):
            data = rng.integers(0, 500, tokens, dtype=np.uint16)
            path = f"{split}/shard_{i:05d}.bin"
            (root / split).mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data.tobytes())
            digest = hashlib.sha256(data.tobytes()).hexdigest()
            entries.append(ShardEntry(path, data.nbytes, digest, tokens, int(data.max())))
        splits[split] = tuple(entries)
    (root / "tokenizer").mkdir(exist_ok=True)
    vocab = b'{"vocab": "synthetic"}'
    (root / "tokenizer" / "tokenizer.json").write_bytes(vocab)
    info = TokenizerInfo(
        "synthetic",
        512,
        0,
        "f" * 64,
        (FileEntry("tokenizer/tokenizer.json", len(vocab), hashlib.sha256(vocab).hexdigest()),),
    )
    manifest = Manifest("uint16", info, splits, {"train": train, "validation": 1}, ("generated",))
    write_manifest(root, manifest)
    return manifest


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[str, Path, Manifest]]:
    """A token directory served by Python's http.server on 127.0.0.1 (no Range support, like the README's)."""
    root = tmp_path / "origin"
    manifest = make_data_dir(root)
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", root, manifest
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def cfg_for(tmp_path: Path, **data) -> object:
    overrides = [f"data.{k}={v}" for k, v in data.items()] + ["peer.count=4", f"data.cache_dir={tmp_path / 'cache'}"]
    return load_config("tiny", overrides)


# The manifest -------------------------------------------------------------------------------------
def test_the_fingerprint_names_the_tokens_not_where_they_are(tmp_path):
    manifest = make_data_dir(tmp_path / "a")
    again = read_manifest(tmp_path / "a")
    assert again == manifest and again.fingerprint == manifest.fingerprint
    moved = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    moved["sources"] = ["elsewhere"]
    moved["tokenizer"]["name_or_path"] = "/another/path"
    assert decode_manifest(json.dumps(moved).encode(), "moved").fingerprint == manifest.fingerprint
    other_tokens = make_data_dir(tmp_path / "b", seed=1)
    assert other_tokens.fingerprint != manifest.fingerprint
    other_tokenizer = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    other_tokenizer["tokenizer"]["fingerprint"] = "e" * 64
    assert decode_manifest(json.dumps(other_tokenizer).encode(), "x").fingerprint != manifest.fingerprint


def test_a_manifest_may_not_point_outside_its_directory_or_lie_about_sizes(tmp_path):
    make_data_dir(tmp_path)
    text = json.loads((tmp_path / MANIFEST_NAME).read_text())
    escaping = json.loads(json.dumps(text))
    escaping["splits"]["train"][0]["path"] = "../../etc/passwd"
    with pytest.raises(DataError, match="not a relative path inside the directory"):
        decode_manifest(json.dumps(escaping).encode(), "m")
    lying = json.loads(json.dumps(text))
    lying["splits"]["train"][0]["bytes"] += 2
    with pytest.raises(DataError, match="is said to be 1202 bytes, not 600 tokens of 2 bytes"):
        decode_manifest(json.dumps(lying).encode(), "m")


def test_uint16_shards_read_back_and_a_subset_is_one_partition(tmp_path):
    manifest = make_data_dir(tmp_path)
    mine = partition_shards(manifest, 1, 4)
    assert mine == ["train/shard_00001.bin", "train/shard_00005.bin"]
    dataset = TokenDataset(tmp_path, only=mine, vocab_size=512)
    assert dataset.num_tokens == 1200 and all(s.dtype == np.dtype("<u2") for s in dataset.shards)
    expected = np.fromfile(tmp_path / mine[0], dtype="<u2")[:17]
    assert dataset.windows([0], 16)[0].tolist() == expected.tolist()
    assert TokenDataset(tmp_path, split="validation").num_tokens == 600
    with pytest.raises(DataError, match="fewer than its 9 data partitions"):
        partition_shards(manifest, 0, 9)


# Fetching -----------------------------------------------------------------------------------------
def test_a_peer_fetches_only_its_partition_and_the_validation_shards(tmp_path, served):
    url, origin, manifest = served
    cfg = cfg_for(tmp_path, manifest=url)
    identity = identify_data(cfg)
    assert identity.fingerprint == manifest.fingerprint and identity.fetch
    data = prepare_data(cfg, identity, 2, progress=False)
    root = identity.train_root
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.bin")) == [
        "train/shard_00002.bin",
        "train/shard_00006.bin",
        "validation/shard_00000.bin",
    ]
    assert (root / "tokenizer" / "tokenizer.json").is_file() and (root / MANIFEST_NAME).read_bytes() == (
        origin / MANIFEST_NAME
    ).read_bytes()
    whole = sum(f.bytes for f in manifest.files())
    assert data.fetched.bytes_fetched == 3 * 1200 + len(b'{"vocab": "synthetic"}') < whole
    summary = data.summary()
    assert summary["fingerprint"] == manifest.fingerprint and summary["train_shards"] == 2
    assert summary["train_tokens"] == 1200 and summary["train_shards_in_run"] == 8
    again = prepare_data(cfg, identify_data(cfg), 2, progress=False)  # all cached: nothing fetched
    assert again.fetched.bytes_fetched == 0 and again.fetched.reused == 4


class Recording:
    """A source over a directory that records the offsets asked for and can corrupt what it serves."""

    def __init__(self, root: Path, name: str, flip: int = 0, fail: bool = False) -> None:
        self.inner, self.name, self.fingerprint = DirectorySource(root), name, None
        self.flip, self.fail, self.offsets = flip, fail, []

    def manifest(self) -> bytes:
        return self.inner.manifest()

    def read(self, path: str, offset: int) -> Iterator[bytes]:
        self.offsets.append(offset)
        if self.fail:
            raise SourceError(f"{self.name} is down")
        for chunk in self.inner.read(path, offset):
            if self.flip:
                self.flip -= 1
                chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
            yield chunk


def test_a_cut_download_resumes_where_it_stopped(tmp_path):
    manifest = make_data_dir(tmp_path / "origin")
    entry = manifest.shards("train")[0]
    target = tmp_path / "cache" / entry.path
    target.parent.mkdir(parents=True)
    whole = (tmp_path / "origin" / entry.path).read_bytes()
    (target.parent / (target.name + ".part")).write_bytes(whole[:500])
    source = Recording(tmp_path / "origin", "origin")
    report = Fetcher(tmp_path / "cache", lambda e: [source], progress=False).fetch([entry])
    assert source.offsets == [500] and report.bytes_fetched == len(whole) - 500
    assert target.read_bytes() == whole and not (target.parent / (target.name + ".part")).exists()


def test_a_flipped_byte_is_refused_and_the_shard_fetched_again(tmp_path):
    manifest = make_data_dir(tmp_path / "origin")
    entry = manifest.shards("train")[3]
    liar = Recording(tmp_path / "origin", "liar", flip=1)
    honest = Recording(tmp_path / "origin", "honest")
    fetcher = Fetcher(tmp_path / "cache", lambda e: [liar, honest], progress=False, attempts=2)
    report = fetcher.fetch([entry])
    assert report.refetched == 1 and liar.offsets == [0] and honest.offsets == [0]
    assert (tmp_path / "cache" / entry.path).read_bytes() == (tmp_path / "origin" / entry.path).read_bytes()
    assert fetcher.tracks["liar"].failures == 1
    # a file corrupted on disk later is noticed on the next fetch and fetched again
    cached = tmp_path / "cache" / entry.path
    broken = bytearray(cached.read_bytes())
    broken[7] ^= 0x40
    cached.write_bytes(bytes(broken))
    report = Fetcher(tmp_path / "cache", lambda e: [honest], progress=False).fetch([entry])
    assert report.reused == 0 and report.bytes_fetched == entry.bytes
    assert cached.read_bytes() == (tmp_path / "origin" / entry.path).read_bytes()


def test_a_dead_source_goes_to_the_back_and_the_fastest_is_asked_first(tmp_path):
    manifest = make_data_dir(tmp_path / "origin")
    dead = Recording(tmp_path / "origin", "dead", fail=True)
    alive = Recording(tmp_path / "origin", "alive")
    fetcher = Fetcher(tmp_path / "cache", lambda e: [dead, alive], progress=False)
    report = fetcher.fetch(list(manifest.shards("train")[:3]))
    assert dead.offsets == [0] and len(alive.offsets) == 3  # after its failure the dead source is not asked first
    assert report.by_source == {"alive": 3 * 1200}
    nobody = Fetcher(tmp_path / "c2", lambda e: [dead], progress=False, attempts=1)
    with pytest.raises(DataError, match=r"could not fetch train/shard_00003\.bin.*dead is down"):
        nobody.fetch([manifest.shards("train")[3]])


def test_the_cache_limit_evicts_shards_the_peer_no_longer_reads(tmp_path):
    manifest = make_data_dir(tmp_path / "origin")
    source = Recording(tmp_path / "origin", "origin")
    shards = manifest.shards("train")
    limit = 2.5 * 1200 / (1 << 30)  # room for two shards and a half
    Fetcher(tmp_path / "cache", lambda e: [source], progress=False, cache_gb=limit).fetch([shards[0], shards[4]])
    report = Fetcher(tmp_path / "cache", lambda e: [source], progress=False, cache_gb=limit).fetch(
        [shards[1], shards[5]]
    )
    assert report.evicted_bytes == 2 * 1200
    assert sorted(p.name for p in (tmp_path / "cache" / "train").iterdir()) == ["shard_00001.bin", "shard_00005.bin"]
    with pytest.raises(DataError, match="needs 0.00 GB.*more than data.cache_gb"):
        Fetcher(tmp_path / "cache", lambda e: [source], progress=False, cache_gb=limit).fetch(list(shards[:3]))


def test_an_unreachable_manifest_url_names_the_fix(tmp_path):
    cfg = cfg_for(tmp_path, manifest="http://127.0.0.1:9/")
    with pytest.raises(DataError, match="cannot connect.*organiser's file server is up"):
        identify_data(cfg)
    assert UrlSource("http://h:1/data/manifest.json").base == "http://h:1/data/"


def test_a_peer_on_other_data_or_another_tokenizer_is_refused():
    ours = Ours("model", {}, {}, "hash", data="a" * 64, tokenizer="t" * 64)
    check_data(
        "run", "me", {"me": {"data": "b" * 64}, "old": {"fingerprint": "model"}}, ours
    )  # ourselves, pre-data peers
    with pytest.raises(SwarmError, match=r"trains on other data \(other shards\).*--config-from-swarm"):
        check_data("run", "me", {"p": {"data": "b" * 64, "tokenizer": "t" * 64}}, ours)
    with pytest.raises(SwarmError, match="trains on another tokenizer.*leave data.tokenizer unset"):
        check_data("run", "me", {"p": {"data": "b" * 64, "tokenizer": "u" * 64}}, ours)


def test_peers_sharing_a_cache_fetch_a_file_once(tmp_path):
    manifest = make_data_dir(tmp_path / "origin")
    entry = manifest.shards("validation")[0]
    source = Recording(tmp_path / "origin", "origin")
    reports = []

    def fetch() -> None:
        reports.append(Fetcher(tmp_path / "cache", lambda e: [source], progress=False).fetch([entry]))

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(reports) == 3 and source.offsets == [0]  # one download; the others found it done
    assert sorted(r.bytes_fetched for r in reports) == [0, 0, entry.bytes]
    assert (tmp_path / "cache" / entry.path).read_bytes() == (tmp_path / "origin" / entry.path).read_bytes()


def test_export_finds_the_tokenizer_a_manifest_run_trained_with(tmp_path, served):
    url, origin, manifest = served
    local = cfg_for(tmp_path, manifest=str(origin))
    assert resolve_tokenizer(local, None) == origin / "tokenizer"  # a path manifest: its own directory
    remote = cfg_for(tmp_path, manifest=url)
    with pytest.raises(ConfigError, match="tokenizer is not on this machine.*--tokenizer DIR"):
        resolve_tokenizer(remote, None, manifest.fingerprint)  # nothing fetched yet
    prepare_data(remote, identify_data(remote), 0, progress=False)
    assert resolve_tokenizer(remote, None, manifest.fingerprint) == identify_data(remote).train_root / "tokenizer"
    assert resolve_tokenizer(remote, origin / "tokenizer") == origin / "tokenizer"  # --tokenizer wins


def test_with_a_shared_partition_every_peer_reads_all_shards_in_its_own_order(tmp_path, served):
    url = served[0]
    cfg = cfg_for(tmp_path, manifest=url, partition="shared")
    orders = []
    for partition in (0, 1):
        data = prepare_data(cfg, identify_data(cfg), partition, progress=False)
        assert not data.partitioned and data.summary()["train_shards"] == 8
        train = TokenDataset(data.identity.train_root, vocab_size=512)  # (its tokenizer file is synthetic)
        orders.append(peer_loader(cfg, train, partition, None, partitioned=data.partitioned).next_batch()[0])
    assert not torch.equal(orders[0], orders[1])
