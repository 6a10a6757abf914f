"""The checks on opening token shards, and the peer-disjoint batch loader (tokenizing: test_tokenization.py)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_spes.corpus import embedded_tokenizer_path, prepare_embedded_data
from p2p_spes.data import BatchLoader, TokenDataset, validation_batches
from p2p_spes.data_manifest import Manifest, read_manifest
from p2p_spes.errors import DataError


@pytest.fixture(scope="module")
def tokenized() -> tuple[Path, Manifest]:
    """The embedded corpus as ``data tokenize`` writes it (tokenized once per test session)."""
    root = prepare_embedded_data()
    return root, read_manifest(root)


def write_token_dir(
    root: Path, shards: list[np.ndarray], *, max_ids: list[int] | None = None, vocab_size: int = 1 << 20
) -> Path:
    """A token directory written by hand, so that any field can be made wrong on purpose."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, tokens in enumerate(shards):
        data = np.asarray(tokens, dtype="<u4").tobytes()
        (root / f"shard_{i:05d}.bin").write_bytes(data)
        entries.append(
            {
                "file": f"shard_{i:05d}.bin",
                "num_tokens": len(tokens),
                "sha256": hashlib.sha256(data).hexdigest(),
                "max_token_id": max_ids[i] if max_ids else int(np.max(tokens, initial=0)),
            }
        )
    manifest = {
        "format": "p2p-spes-tokens",
        "version": 1,
        "dtype": "uint32",
        "tokenizer": {
            "name_or_path": "synthetic",
            "vocab_size": vocab_size,
            "eos_token_id": 0,
            "fingerprint": "0" * 64,
        },
        "num_documents": 1,
        "num_tokens": int(sum(len(s) for s in shards)),
        "shards": entries,
        "sources": [],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def make_tiny_tokenizer(root: Path, *, eos: bool = True) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(
        [f"document {i}: " + "alpha beta gamma delta " * (i % 7 + 1) for i in range(50)], trainer=trainer
    )
    root.mkdir(parents=True)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos:
        config["eos_token"] = "<|endoftext|>"
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


# Opening a token directory


def test_dataset_properties(tokenized):
    out, manifest = tokenized
    dataset = TokenDataset(out, vocab_size=8192, tokenizer=embedded_tokenizer_path())
    assert dataset.num_tokens == manifest.num_tokens("train")
    assert dataset.vocab_size == 8192
    assert dataset.eos_token_id == manifest.tokenizer.eos_token_id
    assert all(isinstance(s, np.memmap) and not s.flags.writeable for s in dataset.shards)


def test_missing_directory_or_manifest(tmp_path):
    with pytest.raises(DataError, match="does not exist.*p2p-spes data tokenize"):
        TokenDataset(tmp_path / "absent")
    with pytest.raises(DataError, match=r"manifest\.json is missing.*p2p-spes data tokenize"):
        TokenDataset(tmp_path)


def test_unparseable_or_foreign_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        TokenDataset(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="not a p2p-spes-tokens manifest"):
        TokenDataset(tmp_path)
    root = write_token_dir(tmp_path / "v2", [np.arange(10)])
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "version": 3}))
    with pytest.raises(DataError, match="version 3"):
        TokenDataset(root)


def test_missing_shard(tmp_path):
    root = write_token_dir(tmp_path, [np.arange(10), np.arange(10)])
    (root / "shard_00001.bin").unlink()
    with pytest.raises(DataError, match=r"shard_00001\.bin.*is missing"):
        TokenDataset(root)


def test_empty_shard(tmp_path):
    root = write_token_dir(tmp_path, [np.arange(10), np.arange(0)])
    with pytest.raises(DataError, match=r"shard_00001\.bin is empty"):
        TokenDataset(root)


def test_truncated_shard(tmp_path):
    root = write_token_dir(tmp_path, [np.arange(100)])
    shard = root / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(DataError, match=r"shard_00000\.bin is truncated.*360 bytes.*100 uint32 tokens"):
        TokenDataset(root)


@pytest.mark.parametrize("count", [100, 101])
def test_shard_of_the_wrong_dtype(tmp_path, count):
    root = write_token_dir(tmp_path, [np.arange(count)])
    (root / "shard_00000.bin").write_bytes(np.arange(count, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match=r"shard_00000\.bin.*looks like uint16 data"):
        TokenDataset(root)


def test_checksum_mismatch(tmp_path):
    root = write_token_dir(tmp_path, [np.arange(100)])
    shard = root / "shard_00000.bin"
    data = bytearray(shard.read_bytes())
    data[8] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard_00000\.bin fails its checksum"):
        TokenDataset(root)
    TokenDataset(root, verify=False)


def test_out_of_vocab_id_from_the_manifest(tmp_path):
    root = write_token_dir(tmp_path, [np.arange(10), np.array([3, 999, 4])])
    with pytest.raises(DataError, match=r"shard_00001\.bin: token id 999 .*model vocab of 500"):
        TokenDataset(root, vocab_size=500, verify=False)
    TokenDataset(root, vocab_size=1000)


def test_out_of_vocab_id_found_in_the_data(tmp_path):
    root = write_token_dir(tmp_path, [np.array([3, 999, 4])], max_ids=[4])
    TokenDataset(root, vocab_size=500, verify=False)
    with pytest.raises(DataError, match=r"token id 999 \(data\).*model vocab of 500"):
        TokenDataset(root, vocab_size=500)


def test_tokenizer_mismatch(tokenized, tmp_path):
    out, _ = tokenized
    tiny = make_tiny_tokenizer(tmp_path / "tiny")
    with pytest.raises(DataError, match="made with tokenizer.*vocab 8192.*vocab 300.*same tokenizer"):
        TokenDataset(out, tokenizer=tiny)


# Windows and batches


def stream_dataset(tmp_path: Path, sizes: list[int]) -> TokenDataset:
    """Shards holding consecutive integers, so a window's first token tells where it starts."""
    starts = np.cumsum([0] + sizes)[:-1]
    return TokenDataset(write_token_dir(tmp_path, [np.arange(a, a + n) for a, n in zip(starts, sizes, strict=True)]))


def test_windows_stay_inside_shards(tmp_path):
    dataset = stream_dataset(tmp_path, [33, 17, 8])
    assert dataset.num_windows(8) == 4 + 2 + 0
    windows = dataset.windows(np.arange(6), 8)
    assert windows[:, 0].tolist() == [0, 8, 16, 24, 33, 41]
    assert (np.diff(windows, axis=1) == 1).all()
    with pytest.raises(DataError, match="too few for one window of 34 tokens"):
        dataset.num_windows(33)


def test_batches_are_shifted_long_tensors(tmp_path):
    loader = BatchLoader(stream_dataset(tmp_path, [1000]), seq_len=16, batch_size=4, seed=0)
    inputs, targets = loader.next_batch()
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets[:, -1], inputs[:, -1] + 1)


def test_loader_is_deterministic_and_seeded(tmp_path):
    dataset = stream_dataset(tmp_path, [2000])
    first = [BatchLoader(dataset, 16, 8, seed=3).next_batch()[0] for _ in range(2)]
    assert torch.equal(first[0], first[1])
    assert not torch.equal(first[0], BatchLoader(dataset, 16, 8, seed=4).next_batch()[0])


def test_peers_are_disjoint_and_cover_every_window_each_epoch(tmp_path):
    dataset = stream_dataset(tmp_path, [645, 320, 100])
    total = dataset.num_windows(10)
    assert total == 64 + 31 + 9
    loaders = [BatchLoader(dataset, 10, 2, seed=7, peer_index=p, num_peers=4) for p in range(4)]
    assert all(loader.windows_per_epoch == total // 4 == 26 for loader in loaders)
    every_window = set(dataset.windows(np.arange(total), 10)[:, 0].tolist())
    for epoch in range(2):
        seen = [[] for _ in loaders]
        for peer, loader in enumerate(loaders):
            for _ in range(loader.windows_per_epoch // 2):
                seen[peer].extend(loader.next_batch()[0][:, 0].tolist())
            assert loader.state_dict()["epoch"] == epoch + 1
        sets = [set(s) for s in seen]
        assert all(len(s) == 26 for s in sets)
        assert sum(len(s) for s in sets) == len(set().union(*sets)) == total
        assert set().union(*sets) == every_window
        if epoch == 0:
            first_epoch = seen
    assert seen != first_epoch


def test_shared_partition_gives_every_peer_the_whole_split_in_its_own_order(tmp_path):
    dataset = stream_dataset(tmp_path, [645, 320])
    total = dataset.num_windows(10)
    assert total == 95
    loaders = [BatchLoader(dataset, 10, 5, seed=7, peer_index=p, num_peers=2, shared=True) for p in range(2)]
    assert all(loader.windows_per_epoch == total for loader in loaders)
    every_window = set(dataset.windows(np.arange(total), 10)[:, 0].tolist())
    orders = []
    for loader in loaders:
        seen = [w for _ in range(total // 5) for w in loader.next_batch()[0][:, 0].tolist()]
        assert len(seen) == total and set(seen) == every_window  # each peer: every window once per epoch
        assert loader.state_dict()["epoch"] == 1
        orders.append(seen)
    assert orders[0] != orders[1]
    # resuming a shared loader continues its own order
    state = loaders[1].state_dict()
    expected = loaders[1].next_batch()[0]
    resumed = BatchLoader(dataset, 10, 5, seed=7, peer_index=1, num_peers=2, shared=True)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0], expected)


def test_resume_gives_exactly_the_same_batches(tmp_path):
    dataset = stream_dataset(tmp_path, [500, 300])
    loader = BatchLoader(dataset, 12, 5, seed=11, peer_index=1, num_peers=3)
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(6)]
    assert loader.state_dict()["epoch"] >= 1
    resumed = BatchLoader(dataset, 12, 5, seed=11, peer_index=1, num_peers=3)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(6)), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert resumed.state_dict() == loader.state_dict()


def test_resume_refuses_another_seed_or_data(tmp_path):
    dataset = stream_dataset(tmp_path, [500])
    state = BatchLoader(dataset, 12, 5, seed=11).state_dict()
    with pytest.raises(DataError, match="seed=11.*seed=12"):
        BatchLoader(dataset, 12, 5, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len=12.*seq_len=10"):
        BatchLoader(dataset, 10, 5, seed=11).load_state_dict(state)
    with pytest.raises(DataError, match="lacks position"):
        BatchLoader(dataset, 12, 5, seed=11).load_state_dict({k: v for k, v in state.items() if k != "position"})


def test_loader_argument_checks(tmp_path):
    dataset = stream_dataset(tmp_path, [50])
    with pytest.raises(DataError, match="peer_index must be in"):
        BatchLoader(dataset, 8, 2, seed=0, peer_index=2, num_peers=2)
    with pytest.raises(DataError, match="fewer than the 8 peers"):
        BatchLoader(dataset, 8, 2, seed=0, num_peers=8)


def test_validation_batches_are_the_first_windows(tmp_path):
    dataset = stream_dataset(tmp_path, [1000])
    batches = validation_batches(dataset, 16, 4, max_batches=3)
    assert len(batches) == 3
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == [16 * i for i in range(12)]
    assert len(validation_batches(dataset, 16, 4, max_batches=100)) == 62 // 4
    small = validation_batches(dataset, 16, 100, max_batches=5)
    assert len(small) == 1 and small[0][0].shape == (62, 16)
