"""Config loading: YAML and --set overrides into typed dataclasses, with errors that name the fix."""

from __future__ import annotations

import pytest

from p2p_spes.config import Config, load_config, parse_override
from p2p_spes.errors import ConfigError


def test_tiny_yaml_is_the_embedded_default():
    assert load_config("tiny") == Config()
    assert load_config(None) == Config()


def test_overrides_are_typed():
    cfg = load_config(
        "tiny", ["model.num_layers=2", "train.lr=1e-3", "train.betas=[0.8, 0.9]", "experts.decayed_lb=true"]
    )
    assert cfg.model.num_layers == 2 and isinstance(cfg.model.num_layers, int)
    assert cfg.train.lr == 1e-3 and cfg.train.betas == (0.8, 0.9) and cfg.experts.decayed_lb is True
    assert parse_override("data.train=/some/where") == ("data.train", "/some/where")
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0  # ints are accepted where floats are


def test_spes_rule_and_explicit_placement():
    assert load_config(None, ["peer.count=4", "peer.index=2"]).local_experts() == [4, 5]
    cfg = load_config(None, ["experts.placement=explicit", "experts.local=[7, 1]"])
    assert cfg.local_experts() == [1, 7]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.num_layer=4"], r"unknown key model.num_layer; valid keys of model: vocab_size, d_model, num_layers"),
        (["modle.d_model=4"], r"unknown key modle; valid keys: model, moe"),
        (["model.num_layers=four"], r"model.num_layers: expected int, got 'four'"),
        (["model.num_layers=2.5"], r"model.num_layers: expected int"),
        (["train.lr=fast"], r"train.lr: expected float"),
        (["experts.decayed_lb=1"], r"experts.decayed_lb: expected bool"),
        (["data.partition=overlapping"], r"data.partition: must be one of 'disjoint', 'shared', got 'overlapping'"),
        (["moe.impl=cuda"], r"moe.impl: must be one of 'auto', 'torch', 'megablocks'"),
        (["moe.top_k=9"], r"moe.top_k \(9\) cannot exceed moe.num_experts \(8\)"),
        (["peer.count=2", "peer.index=2"], r"peer.index \(2\) must be in \[0, peer.count=2\)"),
        (["experts.placement=explicit"], r"needs a non-empty experts.local"),
        (["experts.placement=explicit", "experts.local=[0, 8]"], r"experts.local has ids \[8\] outside \[0, 8\)"),
        (["experts.local=[1]"], r"only used with experts.placement=explicit"),
        (["model.num_heads=3"], r"must be divisible by model.num_heads"),
        (["model.d_model=0"], r"model.d_model must be positive"),
        (["swarm.overlap=true"], r"swarm.overlap=true is withdrawn: .*set swarm.overlap=false"),
        (
            ["swarm.compression=sparse", "swarm.group_size=16"],
            r"runs in flat groups .*re-encode.*use swarm.compression=topk or topk",
        ),
        (
            ["swarm.compression=sparse", "swarm.aggregation=trimmed_mean"],
            r"swarm.aggregation=mean \(got trimmed_mean\)",
        ),
        (["swarm.expert_sync_rounds=0"], r"swarm.expert_sync_rounds must be >= 1 \(got 0\)"),
        (["train.warmup_steps=1000"], r"train.warmup_steps \(1000\) must be in"),
        (["train.betas=[0.9]"], r"train.betas: expected a list of 2 values"),
        (["model"], r"expected KEY=VALUE"),
        (["model.d_model=[1"], r"not valid YAML"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_malformed_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [256\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_config(bad)
    bad.write_text("model: 3\n")
    with pytest.raises(ConfigError, match=r"model: expected a mapping"):
        load_config(bad)


def test_missing_config_file_names_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"config file nope.yaml not found.*spes-1b, spes-7b, tiny"):
        load_config("nope.yaml")


def test_model_fingerprint_tracks_model_shape_only():
    base = load_config(None)
    assert base.model_fingerprint() == load_config(None, ["train.lr=0.1", "peer.count=2"]).model_fingerprint()
    assert base.model_fingerprint() != load_config(None, ["moe.num_experts=16"]).model_fingerprint()
    assert base.model_fingerprint() != load_config(None, ["model.vocab_size=100"]).model_fingerprint()


def test_scopes_live_on_the_fields_and_the_lists_derive_from_them():
    from p2p_spes.config import scope_of, settings_of_scope

    cfg = load_config(None)
    assert cfg.model_defining() == {
        "model": {
            k: getattr(cfg.model, k)
            for k in (
                "vocab_size",
                "d_model",
                "num_layers",
                "num_heads",
                "max_seq_len",
                "rope_theta",
                "norm_eps",
                "qk_norm",
                "init_std",
            )
        },
        "moe": {"num_experts": 8, "top_k": 2, "ffn_dim": 512, "normalize_top_k": False},
    }
    assert scope_of("swarm", "run_id") == "local" and scope_of("experts", "placement") == "run"
    assert scope_of("train", "lr") == "run" and scope_of("moe", "impl") == "local"
    assert settings_of_scope("batch") == [("train", "batch_size"), ("train", "grad_accum")]
    # the machine-local settings, pinned: moving one in or out of "local" changes what peers must agree on
    local = {f"{section}.{name}" for section, name in settings_of_scope("local")}
    assert local == {
        *("moe.impl", "moe.torch_kernel", "experts.local", "peer.index"),
        *("data.train", "data.validation", "data.tokenizer", "data.verify", "data.cache_dir", "data.cache_gb"),
        *("train.device", "train.dtype", "train.log_interval", "train.eval_interval", "train.eval_batches"),
        *("train.checkpoint_interval", "train.keep_checkpoints", "train.run_dir", "train.threads"),
        *("train.tensorboard", "train.tensorboard_dir"),
        *("train.wandb_project", "train.wandb_entity", "train.wandb_mode", "train.wandb_dir", "train.wandb_group"),
        "train.wandb_name",
        *("swarm.run_id", "swarm.initial_peers", "swarm.host_maddrs", "swarm.announce_maddrs"),
        *("swarm.identity_path", "swarm.client_mode", "swarm.use_relay", "swarm.use_auto_relay"),
        *("swarm.bootstrap_timeout", "swarm.residency", "swarm.max_experts_per_peer", "swarm.overlap"),
        *("swarm.secret_file", "swarm.reachability"),
    }
    # a local setting changes neither the fingerprint nor the published config's hash; a run-wide one does
    from dht.run_config import run_config_record

    base = run_config_record(cfg)["hash"]
    assert run_config_record(load_config(None, ["train.run_dir=/elsewhere", "swarm.run_id=x"]))["hash"] == base
    assert run_config_record(load_config(None, ["experts.placement=spes"]))["hash"] != base


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--run-id", "a.b"], r"swarm.run_id 'a.b' must be non-empty, without spaces, dots or slashes"),
        (["--initial-peers", "not-an-address"], None),  # a multiaddr is checked when the swarm starts, not here
    ],
)
def test_command_line_flags_are_validated_like_set(flags, message, capsys, tmp_path):
    from p2p_spes.cli_config import config_overrides
    from p2p_spes.cli_parser import build_parser

    args = build_parser().parse_args(["train", "--run-dir", str(tmp_path), *flags])
    overrides = config_overrides(args)
    assert f'train.run_dir="{tmp_path}"' in overrides
    if message is None:
        assert load_config(None, overrides).swarm.initial_peers == ["not-an-address"]
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_result_share_outside_zero_one_is_refused():
    for share in ("1.5", "0"):
        with pytest.raises(ConfigError, match="topk_result_fraction"):
            load_config(None, ["swarm.compression=topk", f"swarm.topk_result_fraction={share}"])
    assert load_config(None, ["swarm.topk_result_fraction=0.0625"]).swarm.topk_result_fraction == 0.0625


def test_a_lone_codec_is_topk_only_dense_and_not_beside_a_lone_share():
    dense = ["swarm.compression=topk", "swarm.topk_result_fraction=0.0625"]
    assert load_config(None, [*dense, "swarm.lone_compression=int4"]).swarm.lone_compression == "int4"
    assert load_config(None, []).swarm.lone_compression is None
    for bad in (
        ["swarm.compression=int8", "swarm.lone_compression=int4"],
        [*dense, "swarm.topk_lone_fraction=0.02", "swarm.lone_compression=int4"],
    ):
        with pytest.raises(ConfigError, match="swarm.lone_compression.*or lone_compression null"):
            load_config(None, bad)
    with pytest.raises(ConfigError, match=r"lone_compression: expected 'none' \| 'fp16' \| 'int8' \| 'int4' \| null"):
        load_config(None, [*dense, "swarm.lone_compression=topk"])


def test_a_lone_share_is_topk_only_and_between_the_members_and_the_results():
    dense = ["swarm.compression=topk", "swarm.topk_result_fraction=0.0625"]
    assert load_config(None, [*dense, "swarm.topk_lone_fraction=0.02"]).swarm.topk_lone_fraction == 0.02
    for bad in (
        [*dense, "swarm.topk_lone_fraction=0.1"],  # denser than the averaged parts
        [*dense, "swarm.topk_lone_fraction=0.01"],  # sparser than the members' messages
        ["swarm.compression=topk", "swarm.topk_lone_fraction=0.02"],  # no denser result to sit under
        ["swarm.compression=int8", "swarm.topk_result_fraction=0.0625", "swarm.topk_lone_fraction=0.02"],
    ):
        with pytest.raises(ConfigError, match="topk_lone_fraction.*set it in that range, or null"):
            load_config(None, bad)
