"""The config's ``swarm`` section: joining the DHT and syncing with the other peers.

Each field is a :func:`~p2p_spes.config_fields.setting`: its default, its doc (what
``docs/configuration.md`` and ``p2p-spes config --explain`` show) and its scope (``run`` unless said).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from p2p_spes.config_fields import setting


@dataclass
class SwarmConfig:
    """Joining the DHT and syncing with the other peers (unused when training alone)."""

    run_id: str = setting(
        "p2p-spes",
        scope="local",
        doc="Run id that prefixes every DHT key, without spaces, dots or slashes (--run-id).",
    )
    initial_peers: list[str] = setting(  # noqa: RUF009 (a field specifier, as dataclasses.field)
        scope="local",
        factory=list,
        doc="Multiaddrs of any live peers of the run, /ip4/HOST/tcp/PORT/p2p/PEER_ID (--initial-peers).",
    )
    host_maddrs: list[str] = setting(  # noqa: RUF009 (a field specifier, as dataclasses.field)
        scope="local", factory=lambda: ["/ip4/0.0.0.0/tcp/0"], doc="Addresses to listen on (--host-maddrs)."
    )
    announce_maddrs: list[str] = setting(  # noqa: RUF009 (a field specifier, as dataclasses.field)
        scope="local", factory=list, doc="Addresses others should dial, behind NAT (--announce-maddrs)."
    )
    identity_path: str | None = setting(
        None,
        scope="local",
        doc="Private key file; keeps this peer's id and multiaddr across restarts (--identity); null: a new id.",
    )
    client_mode: bool = setting(
        False, scope="local", doc="Join the DHT as a client: it dials others and serves no DHT requests."
    )
    use_relay: bool = setting(True, scope="local", doc="libp2p circuit relay: reach peers behind NAT through others")
    use_auto_relay: bool = setting(False, scope="local", doc="Behind NAT yourself: become reachable through a relay")
    reachability: Literal["auto", "public", "private"] = setting(
        "auto",
        scope="local",
        doc='Whether other peers can dial this one (--reachability): "auto" asks one or two peers of the run to '
        'dial it back at start (dht/reachability.py); "private" (behind a NAT or firewall) contributes to its '
        'groups and fetches their results but reduces nothing, and joins the DHT as a client; "public" reduces',
    )
    bootstrap_timeout: float = setting(
        15.0, scope="local", doc="Seconds to wait for the DHT to start and reach the initial peers."
    )
    sync_steps: int = setting(50, doc="A sync round every sync_steps local optimizer steps (round r at step r x this).")
    replicas: int = setting(
        1, doc="Holders per expert the placement aims for (with r, each peer trains E x r / P experts)."
    )
    experts_per_peer: int | None = setting(
        None,
        doc="Experts least-covered placement gives a peer (null: its partition's SPES block, raised to the "
        "replicas' share).",
    )
    residency: Literal["full", "partial"] = setting(
        "full",
        scope="local",
        doc='"full": every expert in memory (SPES); "partial": only the peer\'s own experts (tokens routed '
        "elsewhere skip them, see p2p_spes/moe/router.py). A per-peer choice: a swarm may mix both.",
    )
    max_experts_per_peer: int | None = setting(
        None,
        scope="local",
        doc="Self-healing: the most experts this peer trains, takeovers included (null: no limit). Each costs "
        "gradient + optimizer memory, and under partial residency its weights too.",
    )
    compression: Literal["none", "fp16", "int8", "int4", "topk", "sparse"] = setting(
        "none",
        doc="Pseudo-gradient codec, with error feedback (p2p_spes/averaging/compression.py); sparse: top-k per "
        "chunk at 2 bits, forwarded by reducers and averaged over the senders of each value "
        "(p2p_spes/averaging/sparse.py); run-wide: peers set otherwise refuse to join",
    )
    topk_fraction: float = setting(
        1 / 64, doc="Share of each block of 256 values that topk sends (sparse: of each chunk of 4,096)"
    )
    topk_result_fraction: float | None = setting(
        None, doc="topk: the share a group's averaged parts keep (null: the same)"
    )
    topk_lone_fraction: float | None = setting(
        None,
        doc="topk: the share a group of one keeps (a lone holder's expert update, what its frozen copies "
        "download; null: topk_result_fraction's); between topk_fraction and topk_result_fraction",
    )
    lone_compression: Literal["none", "fp16", "int8", "int4"] | None = setting(
        None,
        doc="topk: a dense codec for a group of one's result instead of top-k (a lone holder's expert update, "
        "what its frozen copies download; null: top-k at topk_lone_fraction). With expert_sync_rounds K, a "
        "copy then lags its holder by at most K rounds instead of by what top-k has not carried yet",
    )
    expert_sync_rounds: int = setting(
        1,
        doc="Experts are averaged among their holders, and every frozen copy refreshed, every this many sync "
        "rounds and at the run's last (the shared weights every round); between, a holder trains on and serves "
        "its expert's last agreed value, and one update then covers the rounds since (p2p_spes/swarm/sync_round.py). "
        "Above 1, peers must agree on train.max_steps too",
    )
    keep_local_progress: bool = setting(
        False, doc="Lossy codecs: weights keep what messages have not carried (p2p_spes/swarm/outer.py)"
    )
    feedback_decay: float | None = setting(
        None,
        doc="Lossy codecs: what a peer's residual of error feedback is multiplied by each time it is sent "
        "again, in (0, 1] (null: the codec's, 0.95 under sparse and 1 otherwise)",
    )
    overlap: bool = setting(
        False,
        scope="local",
        doc="Withdrawn: must stay false. Rounds run in the background ended with different models on "
        "different peers and a worse loss (docs/limits.md); every round holds training until it ends.",
    )
    matchmaking_time: float = setting(5.0, doc="Seconds a round waits for the peers it expects.")
    averaging_timeout: float = setting(
        30.0, doc="Seconds a group's transfers may take (their deadline) before the attempt fails."
    )
    quorum: float = setting(
        0.75,
        doc="Share of the peers it expects a round's group (shared, or an expert's holders) waits for past its "
        "join window (up to 3x matchmaking_time; p2p_spes/averaging/matchmaking.py), so that it does not close "
        "before most arrive. 0: off",
    )
    group_retries: int = setting(
        2,
        doc="A group whose transfers failed (a member died or froze mid-round) forms again among the members "
        "that come, up to this many more times per round (p2p_spes/averaging/allreduce.py); 0: the round is lost",
    )
    group_size: int = setting(
        0,
        doc=">= 2: a shared group of more peers runs in rows of at most this many and as many columns, each "
        "column a group of one holder per row (p2p_spes/averaging/grid.py); a lost peer costs its row's part. "
        "0: flat",
    )
    heartbeat: float = setting(5.0, doc="Seconds between renewals of this peer's record in the DHT.")
    record_ttl: float = setting(
        15.0, doc="Seconds a peer's record lives in the DHT: a peer whose record lapses counts as gone."
    )
    outer_optimizer: Literal["average", "nesterov"] = setting(
        "average",
        doc='"average": SPES (weights replaced by the average); "nesterov": DiLoCo\'s outer Nesterov step.',
    )
    outer_lr: float = setting(0.7, doc="nesterov: the outer step's learning rate.")
    outer_momentum: float = setting(0.9, doc="nesterov: the outer step's momentum, in [0, 1).")
    merge_interval: int = setting(
        100,
        doc="SPES warm-up expert merging at steps that are multiples of this (0: off); make it a multiple of "
        "sync_steps.",
    )
    merge_alpha_start: float = setting(
        0.05, doc="Warm-up merging: the weight of an expert's neighbours at step 0, in [0, 1)."
    )
    merge_decay_steps: int = setting(300, doc="Warm-up merging: steps over which that weight decays linearly to 0.")
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = setting(
        "mean",
        doc='How a group combines what its members send: "mean" (token-weighted) trusts every peer; '
        '"trimmed_mean" and "centered_clip" bound what one bad peer can do (groups of 3 or more)',
    )
    trim_fraction: float = setting(0.2, doc="trimmed_mean: share of the group dropped at each end (at least 1 peer)")
    clip_tau: float = setting(1.0, doc="centered_clip: clip radius, in units of the contributions' median spread")
    max_update_ratio: float = setting(
        20.0,
        doc="Refuse a group result that moves our values more than this many times the larger of the recent "
        "median move and our own training's move since the round's anchor (0: off); a refused result is logged "
        "and counted, and the peer keeps its own values",
    )
    secret_file: str | None = setting(
        None,
        scope="local",
        doc="A private run: a shared secret (file; or the P2P_SPES_SECRET environment variable); outsiders can "
        "neither write its records nor use its RPCs (dht/auth.py)",
    )
    allowed_peers: list[str] = setting(  # noqa: RUF009 (a field specifier, as dataclasses.field)
        factory=list,
        doc="A private run: an allow-list of peer ids; outsiders can neither write its records nor use its RPCs "
        "(dht/auth.py)",
    )
