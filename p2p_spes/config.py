"""Typed run configuration: YAML files and ``--set`` overrides become validated dataclasses.

Every key is checked against the dataclass fields, so a typo is an error naming the key and
the keys that exist, never a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from p2p_spes.errors import ConfigError
from p2p_spes.placement import spes_block
from p2p_spes.typed_yaml import build, parse_override, set_nested

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# Which peers must agree on a field. Every field carries its scope in its metadata (``run`` if none):
#   model: defines the model's function and weight shapes (the fingerprint; a peer that differs is refused)
#   run:   the same for every peer of a run (published in the DHT as the run config)
#   batch: run-wide as the product batch_size * grad_accum (tokens per step); each peer may split it
#   local: this machine's own choice (paths, addresses, device, logging...); never published
Scope = Literal["model", "run", "batch", "local"]
MODEL: dict[str, Scope] = {"scope": "model"}
LOCAL: dict[str, Scope] = {"scope": "local"}
BATCH: dict[str, Scope] = {"scope": "batch"}


@dataclass
class ModelConfig:
    """Shapes of the OLMoE-family decoder (docs/method.md); every field defines the model."""

    vocab_size: int = field(default=8192, metadata=MODEL)
    d_model: int = field(default=256, metadata=MODEL)
    num_layers: int = field(default=4, metadata=MODEL)
    num_heads: int = field(default=4, metadata=MODEL)
    max_seq_len: int = field(default=128, metadata=MODEL)
    rope_theta: float = field(default=500000.0, metadata=MODEL)
    norm_eps: float = field(default=1e-6, metadata=MODEL)
    # "full": one RMSNorm over the whole q (and k) projection, as OLMoE; "per_head": Qwen3-MoE style.
    qk_norm: Literal["full", "per_head", "none"] = field(default="full", metadata=MODEL)
    init_std: float = field(default=0.02, metadata=MODEL)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class MoEConfig:
    """The mixture-of-experts feed-forward layer and its auxiliary losses."""

    num_experts: int = field(default=8, metadata=MODEL)
    top_k: int = field(default=2, metadata=MODEL)
    ffn_dim: int = field(default=512, metadata=MODEL)
    normalize_top_k: bool = field(default=False, metadata=MODEL)
    impl: Literal["auto", "torch", "megablocks"] = field(default="auto", metadata=LOCAL)
    # Kernel of the torch backend: grouped_mm is fast on CUDA, a per-expert loop is faster on CPU.
    torch_kernel: Literal["auto", "grouped_mm", "loop"] = field(default="auto", metadata=LOCAL)
    lb_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.001


@dataclass
class ExpertsConfig:
    """Which experts this peer trains (the rest stay frozen: no gradient, no optimizer state)."""

    # "spes": peer p of P owns [p*n, (p+1)*n) with n = E / P (in a swarm p is the data partition the
    # peer claims, so no per-peer setting is needed); "explicit": the list in `local`; "coverage": in a
    # swarm, take the experts with the fewest live holders; "auto": coverage in a swarm, the SPES rule
    # otherwise. See p2p_spes/placement.py.
    placement: Literal["auto", "spes", "explicit", "coverage"] = "auto"
    local: list[int] | None = field(default=None, metadata=LOCAL)
    # SPES option: scale local experts' load-balance counts from decayed_lb_start to 1 over
    # the first decayed_lb_fraction of training, letting routing lean toward local experts early.
    decayed_lb: bool = False
    decayed_lb_start: float = 0.7
    decayed_lb_fraction: float = 0.2


@dataclass
class PeerConfig:
    """``count``: how many data partitions (and SPES blocks) the run has; ``index``: which one a peer
    training alone uses (a swarm peer claims a free partition itself and ignores ``index``)."""

    index: int = field(default=0, metadata=LOCAL)
    count: int = 1


@dataclass
class DataConfig:
    """Token shards made by ``p2p-spes data tokenize``; null paths mean the embedded corpus."""

    train: str | None = field(default=None, metadata=LOCAL)
    validation: str | None = field(default=None, metadata=LOCAL)
    tokenizer: str | None = field(default=None, metadata=LOCAL)
    seed: int = 0
    # disjoint: peer p of P reads its slice of each epoch's order; shared: all of it, in its own order
    partition: str = "disjoint"
    verify: bool = field(default=True, metadata=LOCAL)


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and checkpointing of one peer."""

    batch_size: int = field(default=8, metadata=BATCH)
    grad_accum: int = field(default=1, metadata=BATCH)
    max_steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    optimizer: Literal["adamw", "muon"] = "muon"  # Muon on attention/expert matrices, AdamW on the rest (optim.py)
    muon_adamw_lr_scale: float = 4.0  # with muon: embeddings, head, router and norms (AdamW) at lr x this
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    z_loss_weight: float = 1e-5
    seed: int = 0
    device: str = field(default="auto", metadata=LOCAL)
    dtype: Literal["auto", "fp32", "bf16"] = field(default="auto", metadata=LOCAL)
    log_interval: int = field(default=10, metadata=LOCAL)
    eval_interval: int = field(default=100, metadata=LOCAL)
    eval_batches: int = field(default=8, metadata=LOCAL)
    checkpoint_interval: int = field(default=100, metadata=LOCAL)
    keep_checkpoints: int = field(default=2, metadata=LOCAL)
    run_dir: str = field(default="runs/default", metadata=LOCAL)
    threads: int = field(default=0, metadata=LOCAL)
    tensorboard: bool = field(default=False, metadata=LOCAL)  # metrics.jsonl as TensorBoard scalars too
    tensorboard_dir: str = field(default="", metadata=LOCAL)
    # Checkpoint (or run directory) whose weights start this run, e.g. from `p2p-spes upcycle`.
    init_from: str | None = None


@dataclass
class SwarmConfig:
    """Joining the DHT and syncing with the other peers (unused when training alone)."""

    run_id: str = field(default="p2p-spes", metadata=LOCAL)
    initial_peers: list[str] = field(default_factory=list, metadata=LOCAL)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], metadata=LOCAL)
    announce_maddrs: list[str] = field(default_factory=list, metadata=LOCAL)
    identity_path: str | None = field(default=None, metadata=LOCAL)
    client_mode: bool = field(default=False, metadata=LOCAL)
    use_relay: bool = field(default=True, metadata=LOCAL)  # libp2p circuit relay: reach peers behind NAT through others
    use_auto_relay: bool = field(default=False, metadata=LOCAL)  # behind NAT yourself: become reachable through a relay
    bootstrap_timeout: float = field(default=15.0, metadata=LOCAL)
    sync_steps: int = 50
    replicas: int = 1
    experts_per_peer: int | None = None
    # "full": every expert in memory (SPES); "partial": only the peer's own experts (tokens routed
    # elsewhere skip them, see p2p_spes/moe/router.py). A per-peer choice: a swarm may mix both.
    residency: Literal["full", "partial"] = field(default="full", metadata=LOCAL)
    # Self-healing: the most experts this peer trains, takeovers included (None: no limit). Each costs
    # gradient + optimizer memory, and under partial residency its weights too.
    max_experts_per_peer: int | None = field(default=None, metadata=LOCAL)
    # pseudo-gradient codec, with error feedback (compression.py); run-wide: peers set otherwise refuse to join
    compression: Literal["none", "fp16", "int8", "int4", "topk"] = "none"
    topk_fraction: float = 1 / 64  # share of each block of 256 values that topk sends
    topk_result_fraction: float | None = None  # topk: the share a group's averaged parts keep (None: the same)
    keep_local_progress: bool = False  # lossy codecs: weights keep what messages have not carried (outer.py)
    # run each sync round in the background while training goes on (two extra weight copies; peer.py SwarmSync)
    overlap: bool = field(default=False, metadata=LOCAL)
    matchmaking_time: float = 5.0
    averaging_timeout: float = 30.0
    # share of the live peers a round's shared group waits for past its join window (up to 3x
    # matchmaking_time; p2p_spes/averaging/matchmaking.py), so that it does not close before most arrive. 0: off
    quorum: float = 0.75
    # a group whose transfers failed (a member died or froze mid-round) forms again among the members
    # that come, up to this many more times per round (p2p_spes/averaging/allreduce.py); 0: the round is lost
    group_retries: int = 2
    # >= 2: a shared group of more peers runs in rows of at most this many and as many columns, each
    # column a group of one holder per row (p2p_spes/averaging/grid.py); a lost peer costs its row's part. 0: flat
    group_size: int = 0
    heartbeat: float = 5.0
    record_ttl: float = 15.0
    # "average": SPES (weights replaced by the average); "nesterov": DiLoCo's outer Nesterov step.
    outer_optimizer: Literal["average", "nesterov"] = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    merge_interval: int = 100
    merge_alpha_start: float = 0.05
    merge_decay_steps: int = 300
    # how a group combines what its members send: "mean" (token-weighted) trusts every peer;
    # "trimmed_mean" and "centered_clip" bound what one bad peer can do (groups of 3 or more)
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = "mean"
    trim_fraction: float = 0.2
    clip_tau: float = 1.0
    # refuse a group result that moves our values more than this many times the recent median move
    # (0: off); a refused result is logged and counted, and the peer keeps its own values
    max_update_ratio: float = 20.0
    # a private run: a shared secret (file; or the P2P_SPES_SECRET environment variable) and/or an
    # allow-list of peer ids; outsiders can neither write its records nor use its RPCs (dht/auth.py)
    secret_file: str | None = field(default=None, metadata=LOCAL)
    allowed_peers: list[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    def model_defining(self) -> dict[str, Any]:
        """Every field of scope ``model`` by section: what peers must agree on to train one model."""
        out: dict[str, Any] = {}
        for section, name in settings_of_scope("model"):
            out.setdefault(section, {})[name] = getattr(getattr(self, section), name)
        return _to_plain(out)

    def model_fingerprint(self) -> str:
        """Hash of :meth:`model_defining`."""
        blob = json.dumps(self.model_defining(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def local_experts(self, partition: int | None = None) -> list[int]:
        """The experts this peer trains by the configured rule (``partition``: the data partition a
        swarm peer claimed; ``peer.index`` when training alone)."""
        if self.experts.placement == "explicit":
            return sorted(self.experts.local or [])
        if self.experts.placement == "coverage":
            raise ConfigError(
                "experts.placement=coverage is chosen by the swarm at join time; use `p2p-spes train --initial-peers`"
            )
        index = self.peer.index if partition is None else partition
        return spes_block(index, self.peer.count, self.moe.num_experts)

    def experts_per_peer(self, partition: int | None = None) -> int:
        """How many experts least-covered placement gives a peer: ``swarm.experts_per_peer``, else its
        partition's SPES block (partition 0's is the smallest), raised to ``swarm.replicas``' share."""
        if self.swarm.experts_per_peer:
            return self.swarm.experts_per_peer
        index = self.peer.index if partition is None else partition
        block = len(spes_block(index, self.peer.count, self.moe.num_experts))
        share = -(-self.moe.num_experts * self.swarm.replicas // self.peer.count)  # ceil(E x replicas / P)
        return block if self.swarm.replicas == 1 else min(self.moe.num_experts, max(block, share))


_SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # section name -> its dataclass


def scope_of(section: str, name: str) -> Scope:
    """The scope of ``section.name`` (see :data:`Scope`); KeyError for a setting that does not exist."""
    for f in dataclasses.fields(_SECTIONS[section]):
        if f.name == name:
            return f.metadata.get("scope", "run")
    raise KeyError(f"{section}.{name}")


def settings_of_scope(scope: Scope) -> list[tuple[str, str]]:
    """Every ``(section, name)`` of ``scope``, in declaration order."""
    return [
        (section, f.name)
        for section, cls in _SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.metadata.get("scope", "run") == scope
    ]


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with ``--set``-style overrides applied and validated again."""
    return load_config(None, overrides, data=cfg.to_dict())


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, or the name of a shipped config (``tiny`` -> configs/tiny.yaml)."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    shipped = CONFIG_DIR / f"{path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config file {path} not found; give a YAML path or a shipped config name ({names})")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    data: dict[str, Any] | None = None,
) -> Config:
    """Load a YAML config (or the defaults), apply ``--set`` overrides and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        file = resolve_config_path(path)
        try:
            raw = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: the top level must be a mapping of sections, got {type(raw).__name__}")
    if data:
        raw = _merge(raw, data)
    for text in overrides:
        key, value = parse_override(text)
        set_nested(raw, key, value)
    config = build(Config, raw, "")
    validate(config)
    return config


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


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
    if config.data.partition not in ("disjoint", "shared"):
        raise ConfigError(f"data.partition must be disjoint or shared, got {config.data.partition!r}")
    if tr.lr <= 0 or tr.muon_adamw_lr_scale <= 0 or not 0 <= tr.min_lr_ratio <= 1:
        raise ConfigError("train.lr and train.muon_adamw_lr_scale must be positive and train.min_lr_ratio in [0, 1]")
    if tr.warmup_steps < 0 or tr.warmup_steps > tr.max_steps:
        raise ConfigError(f"train.warmup_steps ({tr.warmup_steps}) must be in [0, train.max_steps={tr.max_steps}]")
    if not all(0 <= b < 1 for b in tr.betas):
        raise ConfigError(f"train.betas must be in [0, 1), got {list(tr.betas)}")
    sw = config.swarm
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
    if sw.outer_lr <= 0 or not 0 <= sw.outer_momentum < 1:
        raise ConfigError("swarm.outer_lr must be positive and swarm.outer_momentum in [0, 1)")
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
