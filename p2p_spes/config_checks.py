"""Checks across a config's fields: combinations that cannot train, each refused with the fix in the message.

A single field's type and choices are checked when it is read (``typed_yaml.py``); what is checked
here needs the value's range or another field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2p_spes.errors import ConfigError

if TYPE_CHECKING:
    from p2p_spes.config import Config


def validate(config: Config) -> None:
    """Reject combinations that cannot train, with the fix in the message."""
    m, moe, ex, peer, tr = config.model, config.moe, config.experts, config.peer, config.train
    positive = {
        "model.vocab_size": m.vocab_size,
        "model.d_model": m.d_model,
        "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads,
        "model.max_seq_len": m.max_seq_len,
        "moe.num_experts": moe.num_experts,
        "moe.top_k": moe.top_k,
        "moe.ffn_dim": moe.ffn_dim,
        "train.batch_size": tr.batch_size,
        "train.grad_accum": tr.grad_accum,
        "train.max_steps": tr.max_steps,
        "peer.count": peer.count,
        "train.log_interval": tr.log_interval,
        "train.eval_interval": tr.eval_interval,
        "train.checkpoint_interval": tr.checkpoint_interval,
        "train.keep_checkpoints": tr.keep_checkpoints,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if m.d_model % m.num_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.num_heads ({m.num_heads})")
    if m.head_dim % 2:
        raise ConfigError(f"head dim d_model/num_heads = {m.head_dim} must be even for rotary positions")
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"moe.top_k ({moe.top_k}) cannot exceed moe.num_experts ({moe.num_experts})")
    data = config.data
    if data.manifest is not None and (data.train is not None or data.validation is not None):
        raise ConfigError(
            "data.manifest and data.train/data.validation are both set: data.manifest names the run's data for "
            "every peer, so leave data.train and data.validation unset (or drop data.manifest to use local shards)"
        )
    if data.cache_gb is not None and data.cache_gb <= 0:
        raise ConfigError(f"data.cache_gb must be positive (or null for no limit), got {data.cache_gb}")
    if not 0 <= peer.index < peer.count:
        raise ConfigError(f"peer.index ({peer.index}) must be in [0, peer.count={peer.count})")
    if ex.placement == "explicit":
        if not ex.local:
            raise ConfigError("experts.placement=explicit needs a non-empty experts.local list of expert ids")
        bad = [e for e in ex.local if not 0 <= e < moe.num_experts]
        if bad:
            raise ConfigError(f"experts.local has ids {bad} outside [0, {moe.num_experts})")
        if len(set(ex.local)) != len(ex.local):
            raise ConfigError(f"experts.local has duplicates: {ex.local}")
    elif ex.local is not None:
        raise ConfigError("experts.local is only used with experts.placement=explicit")
    if not 0 < ex.decayed_lb_start <= 1 or not 0 < ex.decayed_lb_fraction <= 1:
        raise ConfigError("experts.decayed_lb_start and experts.decayed_lb_fraction must be in (0, 1]")
    if tr.lr <= 0 or tr.muon_adamw_lr_scale <= 0 or not 0 <= tr.min_lr_ratio <= 1:
        raise ConfigError("train.lr and train.muon_adamw_lr_scale must be positive and train.min_lr_ratio in [0, 1]")
    if not 1 <= tr.muon_ns_steps <= 10:
        raise ConfigError(f"train.muon_ns_steps must be in [1, 10] (5 is Muon's usual), got {tr.muon_ns_steps}")
    if tr.warmup_steps < 0 or tr.warmup_steps > tr.max_steps:
        raise ConfigError(f"train.warmup_steps ({tr.warmup_steps}) must be in [0, train.max_steps={tr.max_steps}]")
    if not all(0 <= b < 1 for b in tr.betas):
        raise ConfigError(f"train.betas must be in [0, 1), got {list(tr.betas)}")
    sw = config.swarm
    if sw.overlap:
        raise ConfigError(
            "swarm.overlap=true is withdrawn: rounds run in the background ended with different models on "
            "different peers and a worse loss than blocking rounds (docs/limits.md); set swarm.overlap=false"
        )
    if sw.group_retries < 0 or sw.group_size < 0 or sw.group_size == 1:
        raise ConfigError(
            f"swarm.group_retries must be 0 or more (got {sw.group_retries}) and swarm.group_size "
            f"0 (one flat group) or 2 or more (got {sw.group_size})"
        )
    if sw.sync_steps <= 0 or sw.replicas <= 0 or sw.matchmaking_time <= 0 or sw.averaging_timeout <= 0:
        raise ConfigError(
            "swarm.sync_steps, swarm.replicas, swarm.matchmaking_time and swarm.averaging_timeout must be positive"
        )
    if sw.experts_per_peer is not None and not 0 < sw.experts_per_peer <= moe.num_experts:
        raise ConfigError(
            f"swarm.experts_per_peer ({sw.experts_per_peer}) must be in [1, moe.num_experts={moe.num_experts}]"
        )
    if sw.max_experts_per_peer is not None and not 0 < sw.max_experts_per_peer <= moe.num_experts:
        raise ConfigError(
            f"swarm.max_experts_per_peer ({sw.max_experts_per_peer}) must be in [1, moe.num_experts={moe.num_experts}]"
        )
    if sw.residency == "partial" and sw.merge_interval:
        raise ConfigError(
            f"swarm.residency=partial cannot apply the SPES warm-up merge (swarm.merge_interval="
            f"{sw.merge_interval}): it needs every expert; set swarm.merge_interval=0, or swarm.residency=full"
        )
    if sw.residency == "partial" and moe.impl == "megablocks":
        raise ConfigError(
            "swarm.residency=partial needs moe.impl=torch (or auto): the MegaBlocks adapter keeps every expert"
        )
    if (
        not all(0 < f <= 1 for f in (sw.topk_fraction, sw.topk_result_fraction) if f is not None)
        or not 0 <= sw.quorum <= 1
    ):
        raise ConfigError(
            f"swarm.topk_fraction and swarm.topk_result_fraction must be in (0, 1] (got {sw.topk_fraction}, "
            f"{sw.topk_result_fraction}) and swarm.quorum in [0, 1] (a share of the live peers; got {sw.quorum})"
        )
    if sw.topk_lone_fraction is not None:
        most = sw.topk_fraction if sw.topk_result_fraction is None else sw.topk_result_fraction
        if sw.compression != "topk" or not sw.topk_fraction <= sw.topk_lone_fraction <= most:
            raise ConfigError(
                f"swarm.topk_lone_fraction ({sw.topk_lone_fraction}) sets the share of a lone holder's update under "
                f"swarm.compression=topk (here {sw.compression}), between swarm.topk_fraction ({sw.topk_fraction}) "
                f"and swarm.topk_result_fraction ({sw.topk_result_fraction}): set it in that range, or null"
            )
    if sw.feedback_decay is not None and not 0 < sw.feedback_decay <= 1:
        raise ConfigError(f"swarm.feedback_decay must be in (0, 1] or null (got {sw.feedback_decay})")
    if sw.lone_compression is not None and (sw.compression != "topk" or sw.topk_lone_fraction is not None):
        raise ConfigError(
            f"swarm.lone_compression ({sw.lone_compression}) sets the codec of a lone holder's update under "
            f"swarm.compression=topk (here {sw.compression}) in place of swarm.topk_lone_fraction (here "
            f"{sw.topk_lone_fraction}): use compression topk with topk_lone_fraction null, or lone_compression null"
        )
    if sw.compression == "sparse" and sw.aggregation != "mean":
        raise ConfigError(
            "swarm.compression=sparse averages each value over the members that sent it: it runs with "
            f"swarm.aggregation=mean (got {sw.aggregation})"
        )
    if sw.compression == "sparse" and sw.group_size:
        raise ConfigError(
            f"swarm.compression=sparse runs in flat groups (swarm.group_size=0, got {sw.group_size}): a grid's "
            "rows would re-encode their combination, and every member downloads every other member's message, "
            "so its bytes grow with the group. For a swarm large enough to need a grid, use "
            "swarm.compression=topk or topk-dense"
        )
    if sw.outer_lr <= 0 or not 0 <= sw.outer_momentum < 1:
        raise ConfigError("swarm.outer_lr must be positive and swarm.outer_momentum in [0, 1)")
    if sw.expert_sync_rounds < 1:
        raise ConfigError(
            f"swarm.expert_sync_rounds must be >= 1 (got {sw.expert_sync_rounds}): 1 averages the experts and "
            "refreshes every frozen copy every round, K every K rounds"
        )
    if sw.merge_interval < 0 or not 0 <= sw.merge_alpha_start < 1:
        raise ConfigError("swarm.merge_interval must be >= 0 and swarm.merge_alpha_start in [0, 1)")
    if not 0 <= sw.trim_fraction < 0.5 or sw.clip_tau <= 0 or sw.max_update_ratio < 0:
        raise ConfigError(
            "swarm.trim_fraction must be in [0, 0.5), swarm.clip_tau positive and "
            "swarm.max_update_ratio >= 0 (0 turns the check off)"
        )
    if not sw.run_id or any(c in sw.run_id for c in " ./"):
        raise ConfigError(f"swarm.run_id {sw.run_id!r} must be non-empty, without spaces, dots or slashes")
    if tr.grad_clip < 0 or tr.weight_decay < 0:
        raise ConfigError("train.grad_clip and train.weight_decay cannot be negative")
