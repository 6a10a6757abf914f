"""The config's sections for the model, its experts, the data and training (``swarm`` is in config_swarm.py).

Each field is a :func:`~p2p_spes.config_fields.setting`: its default, its doc (what
``docs/configuration.md`` and ``p2p-spes config --explain`` show) and its scope (``run`` unless said).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from p2p_spes.config_fields import setting


@dataclass
class ModelConfig:
    """Shapes of the OLMoE-family decoder (docs/method.md); every field defines the model."""

    vocab_size: int = setting(
        8192, scope="model", doc="Token ids the model knows: rows of the embedding and of the output head."
    )
    d_model: int = setting(256, scope="model", doc="Width of the residual stream (the hidden size).")
    num_layers: int = setting(4, scope="model", doc="Decoder layers, each attention then a mixture-of-experts layer.")
    num_heads: int = setting(
        4, scope="model", doc="Attention heads; d_model / num_heads (the head dim) must be even for rotary positions."
    )
    max_seq_len: int = setting(128, scope="model", doc="Tokens per training sequence (the context length).")
    rope_theta: float = setting(500000.0, scope="model", doc="Base of the rotary position embedding's frequencies.")
    norm_eps: float = setting(1e-6, scope="model", doc="Epsilon of the RMSNorm layers.")
    qk_norm: Literal["full", "per_head", "none"] = setting(
        "full",
        scope="model",
        doc='"full": one RMSNorm over the whole q (and k) projection, as OLMoE; "per_head": Qwen3-MoE style; '
        '"none": no norm on q and k.',
    )
    init_std: float = setting(
        0.02, scope="model", doc="Standard deviation of the normal distribution the weights are initialised from."
    )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class MoEConfig:
    """The mixture-of-experts feed-forward layer and its auxiliary losses."""

    num_experts: int = setting(8, scope="model", doc="Experts in each MoE layer.")
    top_k: int = setting(2, scope="model", doc="Experts each token is routed to (at most num_experts).")
    ffn_dim: int = setting(512, scope="model", doc="Hidden width of each expert's SwiGLU feed-forward network.")
    normalize_top_k: bool = setting(
        False,
        scope="model",
        doc="Rescale a token's top-k routing weights to sum to 1 (else they sum to their softmax mass).",
    )
    impl: Literal["auto", "torch", "megablocks"] = setting(
        "auto",
        scope="local",
        doc='MoE backend: "megablocks" (CUDA, the megablocks package), "torch", or "auto": MegaBlocks on CUDA '
        "when it is installed, else torch (p2p_spes/moe/backend.py).",
    )
    torch_kernel: Literal["auto", "grouped_mm", "loop"] = setting(
        "auto",
        scope="local",
        doc="Kernel of the torch backend: grouped_mm is fast on CUDA, a per-expert loop is faster on CPU.",
    )
    lb_loss_weight: float = setting(0.01, doc="Weight of the router's load-balancing loss.")
    router_z_loss_weight: float = setting(0.001, doc="Weight of the router's z-loss (keeps router logits small).")


@dataclass
class ExpertsConfig:
    """Which experts this peer trains (the rest stay frozen: no gradient, no optimizer state)."""

    placement: Literal["auto", "spes", "explicit", "coverage"] = setting(
        "auto",
        doc='"spes": peer p of P owns [p*n, (p+1)*n) with n = E / P (in a swarm p is the data partition the '
        'peer claims, so no per-peer setting is needed); "explicit": the list in `local`; "coverage": in a '
        'swarm, take the experts with the fewest live holders; "auto": coverage in a swarm, the SPES rule '
        "otherwise. See p2p_spes/placement.py.",
    )
    local: list[int] | None = setting(  # noqa: RUF009 (a field specifier, as dataclasses.field)
        None, scope="local", doc='The expert ids this peer trains with placement "explicit" (null otherwise).'
    )
    decayed_lb: bool = setting(
        False,
        doc="SPES option: scale local experts' load-balance counts from decayed_lb_start to 1 over the first "
        "decayed_lb_fraction of training, letting routing lean toward local experts early.",
    )
    decayed_lb_start: float = setting(
        0.7, doc="With decayed_lb: the scale of local experts' load-balance counts at step 0, in (0, 1]."
    )
    decayed_lb_fraction: float = setting(
        0.2, doc="With decayed_lb: the share of max_steps over which the scale rises to 1, in (0, 1]."
    )


@dataclass
class PeerConfig:
    """The run's data partitions (and SPES blocks), and the one a peer training alone uses."""

    index: int = setting(
        0,
        scope="local",
        doc="Which partition a peer training alone uses (a swarm peer claims a free partition itself and "
        "ignores index).",
    )
    count: int = setting(1, doc="How many data partitions (and SPES blocks) the run has.")


@dataclass
class DataConfig:
    """The run's tokens: a published manifest, local token directories, or (neither) the embedded corpus."""

    manifest: str | None = setting(
        None,
        doc="URL (http://, https://, file://) or path of the run's token directory (its manifest.json), written "
        "by ``p2p-spes data tokenize``: published with the run, so every peer fetches its partition's shards, the "
        "validation shards and the tokenizer from it (or from peers holding them). Null: data.train, else the "
        "embedded corpus.",
    )
    cache_dir: str | None = setting(
        None,
        scope="local",
        doc="Where fetched run data is kept; null: $P2P_SPES_CACHE/data (default ~/.cache/p2p-spes/data).",
    )
    cache_gb: float | None = setting(
        None,
        scope="local",
        doc="Most GB the data cache may hold; shards this peer no longer reads are evicted first. Null: no limit.",
    )

    train: str | None = setting(
        None,
        scope="local",
        doc="Directory of training token shards (manifest.json and shards); null: the embedded corpus (then "
        "data.validation is null too).",
    )
    validation: str | None = setting(
        None,
        scope="local",
        doc="Directory of held-out token shards for the validation loss, set together with data.train.",
    )
    tokenizer: str | None = setting(
        None,
        scope="local",
        doc="Local tokenizer directory the shards were made with (checked against their manifest); null: the "
        "embedded one with the embedded corpus, no check otherwise.",
    )
    seed: int = setting(0, doc="Seed of each epoch's order of the training sequences.")
    partition: Literal["disjoint", "shared"] = setting(
        "disjoint",
        doc="disjoint: peer p of P reads its slice of each epoch's order; shared: all of it, in its own order.",
    )
    verify: bool = setting(
        True,
        scope="local",
        doc="Checksum every shard on open and scan it for its largest token id (reads all the data once).",
    )


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and checkpointing of one peer."""

    batch_size: int = setting(
        8, scope="batch", doc="Sequences per micro-batch; the run fixes batch_size x grad_accum, each peer its split."
    )
    grad_accum: int = setting(1, scope="batch", doc="Micro-batches accumulated into one optimizer step.")
    max_steps: int = setting(300, doc="Optimizer steps of the run.")
    lr: float = setting(3e-3, doc="Peak learning rate, reached after warmup_steps.")
    min_lr_ratio: float = setting(
        0.1, doc="The cosine schedule decays the learning rate to min_lr_ratio x lr at max_steps."
    )
    warmup_steps: int = setting(30, doc="Steps of linear warm-up to lr.")
    weight_decay: float = setting(0.1, doc="Decoupled weight decay of the matrices (norm weights and biases get none).")
    optimizer: Literal["adamw", "muon"] = setting(
        "muon", doc="Muon on attention/expert matrices, AdamW on the rest (p2p_spes/optim.py)."
    )
    muon_adamw_lr_scale: float = setting(4.0, doc="With muon: embeddings, head, router and norms (AdamW) at lr x this")
    muon_ns_steps: int = setting(
        3,
        doc="With muon: Newton-Schulz iterations per matrix and step (3: cheapest at equal loss; docs/benchmarks.md).",
    )
    betas: tuple[float, float] = setting((0.9, 0.95), doc="AdamW's betas, each in [0, 1).")
    eps: float = setting(1e-8, doc="AdamW's epsilon.")
    grad_clip: float = setting(1.0, doc="Clip the gradient's global norm to this (0: no clipping).")
    z_loss_weight: float = setting(1e-5, doc="Weight of the output logits' z-loss.")
    seed: int = setting(0, doc="Seed of the model's initial weights.")
    device: str = setting("auto", scope="local", doc="auto (cuda if torch sees a GPU, else cpu), cpu, cuda or cuda:N.")
    dtype: Literal["auto", "fp32", "bf16"] = setting(
        "auto",
        scope="local",
        doc="Compute precision: bf16 autocast, fp32, or auto (bf16 on CUDA, fp32 otherwise); weights stay fp32.",
    )
    log_interval: int = setting(10, scope="local", doc="Steps between lines of metrics.jsonl.")
    eval_interval: int = setting(100, scope="local", doc="Steps between validation losses.")
    eval_batches: int = setting(8, scope="local", doc="Validation batches per validation loss.")
    checkpoint_interval: int = setting(100, scope="local", doc="Steps between checkpoints.")
    keep_checkpoints: int = setting(2, scope="local", doc="Newest checkpoints kept in the run directory.")
    run_dir: str = setting("runs/default", scope="local", doc="Where metrics, checkpoints and summary go (--run-dir).")
    threads: int = setting(0, scope="local", doc="torch threads (0: torch's default).")
    tensorboard: bool = setting(False, scope="local", doc="Write metrics.jsonl as TensorBoard scalars too.")
    tensorboard_dir: str = setting(
        "", scope="local", doc='Where the TensorBoard scalars go ("": the run directory\'s tensorboard/).'
    )
    wandb_project: str = setting(
        "", scope="local", doc='Weights & Biases project this peer logs its metrics to ("": no W&B; the wandb extra).'
    )
    wandb_entity: str = setting("", scope="local", doc='W&B entity (user or team) of the project ("": your default).')
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = setting(
        "auto",
        scope="local",
        doc="W&B mode: offline writes the run to disk only (`wandb sync` uploads it later); auto: $WANDB_MODE, "
        "else online.",
    )
    wandb_dir: str = setting(
        "", scope="local", doc='Where W&B writes its files ("": $WANDB_DIR if set, else the run directory).'
    )
    wandb_group: str = setting("", scope="local", doc='W&B group of the run\'s peers ("": swarm.run_id).')
    wandb_name: str = setting(
        "",
        scope="local",
        doc="W&B run name, one run per peer (\"\": the run directory's name and, in a swarm, the peer id's end).",
    )
    init_from: str | None = setting(
        None, doc="Checkpoint (or run directory) whose weights start this run, e.g. from `p2p-spes upcycle`."
    )
