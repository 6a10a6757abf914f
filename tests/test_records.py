"""Signed records on real loopback DHTs: forged records are refused; the run config and its hash; batch fitting."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.utils import get_dht_time

from dht.identity import load_identity, peer_id_of_owner
from dht.keys import peers_key, run_config_key
from dht.node import start_dht
from dht.records import signed_values
from dht.run_config import choose, config_from_published, config_hash, published_config, run_config_record
from p2p_spes.batch_fit import activation_bytes_per_sample, fit_batch, static_bytes
from p2p_spes.config import load_config
from p2p_spes.errors import ConfigError, SwarmError

RUN = "forgery"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def status(peer_id: str, step: int, maddrs: list[str]) -> dict:
    return {
        "peer_id": peer_id,
        "experts": [0, 1],
        "step": step,
        "round": 0,
        "fingerprint": "f" * 16,
        "maddrs": maddrs,
        "loss": 3.5,
        "time": get_dht_time(),
    }


def test_identity_file_is_the_peer_id_and_the_signing_key(tmp_path):
    path = tmp_path / "peer.key"
    first = load_identity(path)
    again = load_identity(path)
    assert first.created and not again.created
    assert first.peer_id == again.peer_id and first.owner == again.owner
    assert peer_id_of_owner(first.owner) == first.peer_id
    assert peer_id_of_owner(b"[owner:not a key]") is None and peer_id_of_owner(b"plain") is None
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(SwarmError, match="not a libp2p RSA private key"):
        load_identity(tmp_path / "junk.key")


@pytest.mark.slow
def test_forged_records_about_another_peer_are_rejected():
    victim, victim_id = start_dht(None, [RUN], host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in victim.get_visible_maddrs()]
    reader, _ = start_dht(None, [RUN], initial_peers=maddrs, client_mode=True)
    # the forger runs hivemind without the run's validators, so its forged records reach the wire
    forger = hivemind.DHT(start=True, initial_peers=maddrs, host_maddrs=LOOPBACK)
    signer, signer_id = start_dht(None, [RUN], initial_peers=maddrs, host_maddrs=LOOPBACK)
    try:
        key, later = peers_key(RUN), get_dht_time() + 60
        assert victim.store(key, status(victim_id.peer_id, 7, maddrs), get_dht_time() + 30, subkey=victim_id.owner)
        # 1. the victim's owner subkey without the victim's signature (overwrite attempt)
        forger.store(key, status(victim_id.peer_id, 666, maddrs), later, subkey=victim_id.owner)
        # 2. unsigned, under the victim's peer id as a plain subkey
        forger.store(key, status(victim_id.peer_id, 666, maddrs), later, subkey=victim_id.peer_id)
        # 3. validly signed with another key, but claiming to be the victim
        assert signer.store(key, status(victim_id.peer_id, 666, maddrs), later, subkey=signer_id.owner)
        # 4. a record that breaks the schema (a float step), even correctly signed, is refused at once
        assert not victim.store(
            key, {**status(victim_id.peer_id, 7, maddrs), "step": 7.0}, later, subkey=victim_id.owner
        )

        raw = reader.get(key, latest=True)
        subkeys = set(raw.value)
        assert victim_id.peer_id not in subkeys, "an unsigned record must not pass validation"
        assert raw.value[victim_id.owner].value["step"] == 7, "the victim's record must not be overwritten"
        records = signed_values(raw)
        assert set(records) == {victim_id.peer_id}, "a record naming someone other than its signer is dropped"
        assert records[victim_id.peer_id]["step"] == 7
    finally:
        for dht in (signer, forger, reader, victim):
            dht.shutdown()


def test_published_config_leaves_out_local_settings_and_is_checked():
    cfg = load_config(None, ["train.batch_size=4", "swarm.run_id=r1"])
    local = load_config(
        None,
        [
            "train.batch_size=2",
            "train.grad_accum=2",
            "train.device=cpu",
            "swarm.run_id=r1",
            "swarm.host_maddrs=[/ip4/127.0.0.1/tcp/5]",
            "train.run_dir=elsewhere",
        ],
    )
    other = load_config(None, ["train.lr=0.01", "swarm.run_id=r1"])
    assert published_config(local)["train"]["batch_size"] == 4 and published_config(local)["train"]["grad_accum"] == 1
    assert "device" not in published_config(cfg)["train"] and "initial_peers" not in published_config(cfg)["swarm"]
    assert config_hash(published_config(cfg)) == config_hash(published_config(local))
    assert config_hash(published_config(cfg)) != config_hash(published_config(other))

    records = {
        "a": run_config_record(cfg, since=1.0),
        "b": run_config_record(local, since=2.0),
        "c": run_config_record(other, since=0.5),
    }
    chosen = choose(records)
    assert chosen["hash"] == records["a"]["hash"] and chosen["publishers"] == ["a", "b"]
    assert chosen["alternatives"] == [records["c"]["hash"]]
    assert choose(records, expected_hash=records["c"]["hash"][:12])["publishers"] == ["c"]
    tampered = {"x": {**records["a"], "config": {**records["a"]["config"], "train": {"lr": 1.0}}}}
    with pytest.raises(SwarmError, match="failed the hash check"):
        choose(tampered)
    with pytest.raises(SwarmError, match="no peer publishes"):
        choose(records, expected_hash="0" * 64)

    rebuilt = config_from_published(chosen["config"], ["train.batch_size=2", "train.grad_accum=2", "train.device=cpu"])
    assert rebuilt.model_fingerprint() == cfg.model_fingerprint() and rebuilt.train.batch_size == 2
    assert config_hash(published_config(rebuilt)) == chosen["hash"]
    with pytest.raises(ConfigError, match="model.num_layers: the run's config fixes this setting"):
        config_from_published(chosen["config"], ["model.num_layers=2"])


def test_batch_fit_keeps_tokens_per_step_and_refuses_a_device_too_small():
    cfg = load_config(None, ["train.batch_size=8", "train.grad_accum=1"])
    fixed, per = static_bytes(cfg), activation_bytes_per_sample(cfg)
    roomy = fit_batch(cfg, int((fixed + 100 * per) / 0.8), "cpu")
    assert (roomy.batch_size, roomy.grad_accum) == (8, 1)
    tight = fit_batch(cfg, int((fixed + 3.5 * per) / 0.8), "cpu")  # room for 3 sequences: 2 divides 8
    assert (tight.batch_size, tight.grad_accum) == (2, 4)
    with pytest.raises(ConfigError, match="GB free"):
        fit_batch(cfg, fixed, "cpu")


@pytest.mark.slow
def test_run_config_key_is_schema_checked():
    dht, ident = start_dht(None, [RUN], host_maddrs=LOOPBACK)
    try:
        cfg = load_config(None, [f"swarm.run_id={RUN}"])
        good = {**run_config_record(cfg), "peer_id": ident.peer_id}
        assert dht.store(run_config_key(RUN), good, get_dht_time() + 30, subkey=ident.owner)
        assert not dht.store(run_config_key(RUN), {**good, "hash": "short"}, get_dht_time() + 30, subkey=ident.owner)
        assert signed_values(dht.get(run_config_key(RUN), latest=True))[ident.peer_id]["hash"] == good["hash"]
    finally:
        dht.shutdown()
