"""Frozen experts refreshed less often: what a stale copy costs in quality, and what it would save in bytes.

    python -m benchmarks.refresh_cadence                      # 5 policies x 3 seeds, 4 peers: ~2 h on 2 cores
    python -m benchmarks.refresh_cadence --policies every every-4 --seeds 0 --rounds 30 --variant quick
    python -m benchmarks.refresh_cadence --merge s0 s12 --variant main   # one result from several shares
    python -m benchmarks.refresh_cadence --peers 8 --optimizer adamw --shared topk-dense --policies every every-16

A SPES peer trains its own experts and holds a frozen copy of every other one: its router sends tokens
to the copies, and its shared weights learn against them. The swarm brings every copy to its holder's
version every round, and those downloads are a large share of a round's bytes under the sparse codecs
(at spes-1b with 4 peers, 41% of what ``sparse`` moves). The swarm runs ``every-K`` as
``swarm.expert_sync_rounds`` (its swarm runs: ``benchmarks/convergence.py``'s ``-every4`` arms); this
benchmark simulates it and ``tokens-K``, which the swarm does not run.

One process, P peers of the quality benchmark's micro model (``benchmarks/codec_rounds.py``'s: d_model 64,
2 layers, 8 experts top-2, seq_len 64, Muon at 5 iterations with AdamW at 4x on the rest), peer i
training experts i, i + P, ... (one holder each, as ``benchmarks/comms.py``'s projection assumes) and
reading its own data partition, 32 / P sequences a step. Every ``--sync`` steps the shared weights are
averaged over the peers (uncompressed, as codec_rounds' ``none``); then each frozen copy is set to its
holder's weights when the policy says so:

* ``every``: every round (the swarm today; the baseline);
* ``every-K``: every K rounds, every copy at once (a run-wide cadence: each holder would send one
  encoded update covering K rounds);
* ``tokens-K``: a peer's copy of an expert once its router has sent that expert, since the copy was
  last refreshed, K rounds' worth of an even share of its (token, slot) pairs: copies a peer's tokens
  use more are refreshed sooner. The count starts again from zero at each refresh, so a copy whose
  share fell just short waits a round more: ``tokens-K`` refreshes somewhat less than 1/K of the copies;
* ``topk-K``: every round, every copy moved by a top-k update of K values a block of what its holder's
  weights lead it by, the holder training on from its own weights (the swarm's lone holder under a
  lossy codec, ``OuterOptimizer.keeps_own``, at ``swarm.topk_lone_fraction`` K/256);
* ``lone-K``: the same update, but the holder too is set to the value its copies take and keeps what
  the update dropped in its error feedback (as a group's member takes the group's result): what
  keeping its own weights is worth.

This is a simulation (no swarm code or network), and refreshes are exact, so what is measured
is staleness alone (no warm-up merge either). ``--shared topk-dense`` averages the shared weights through
the project's codec as the swarm does (each peer's error feedback, the reducer's re-encoding with its own
residual; ``SharedAverage``), where the swarm's probes found stale copies costly; ``--exact`` keeps kinds
of the shared weights (the token embeddings and output head, or the rest) out of the codec, to find
where that cost sits; ``--result K`` keeps K values a block in a group's averaged parts (the swarm's
``swarm.topk_result_fraction`` K/256, in the runs and the bytes); ``--score-copies`` also scores the
model with every expert as its copies hold it; ``--optimizer adamw`` trains as the convergence swarm does. Every policy
starts from the same initialisation, reads the same data and is scored on the same validation windows
(``convergence.Validation``, ``--val-windows``) every ``--eval-rounds`` rounds: the run's model as export
assembles it, the shared weights with each expert from its holder. The gap is per seed, to ``every``.

Bytes, per peer per round at spes-1b (4 and 16 peers, every byte as ``benchmarks/comms.py`` counts
it): each codec's round with the copies' downloads scaled by the share of copies the policy refreshed
per round in these runs, over the SPES reference at fp32; a projection (``benchmarks/comms.py
--expert-sync-rounds K`` measures every-K's bytes on loopback swarms), which assumes each refresh is one encoded update of the codec's size covering the rounds since the
last (a holder under ``tokens-K`` would encode one per downloader, each copy being at its own version),
and applies the share measured with 4 peers and 8 experts at 16 peers too. Prints a table and writes ``benchmarks/results/refresh_cadence/<variant>.json`` with each run's
curve, and ``<variant>.png`` (the gap against rounds; needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import codec_rounds, comms, convergence
from benchmarks.lab import feedback, results, shares
from p2p_spes.averaging.compression import BLOCK, Codec
from p2p_spes.config import Config, load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import BatchLoader, TokenDataset
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer, lr_at, set_lr, trainable_parameters
from p2p_spes.swarm.outer import flatten, split_like

POLICIES = ("every", "every-2", "every-4", "every-8", "tokens-4")
CODECS = ("int8", "topk-dense", "sparse")  # the codecs whose rounds the projection shows
BASELINE = "every"
SHARED = ("none", "topk-dense", "structured")  # how the shared weights are averaged (--shared)
# --shared structured: the token embeddings by whole rows, these shares of them (members, a group's result)
ROWS_MEMBER, ROWS_RESULT = 1 / 8, 1 / 4
LEVELS = (-1.0, -1 / 3, 1 / 3, 1.0)  # a kept row's values at 2 bits, times the row's largest magnitude
KINDS = ("embeddings", "rest")  # the shared weights' kinds --exact can keep out of the codec
RESULT = round(codec_rounds.DENSE * BLOCK)  # topk-dense's values a block in a group's averaged parts


@dataclasses.dataclass(frozen=True)
class Policy:
    """When a frozen copy is brought to its holder's weights: every ``rounds`` rounds, or (``tokens``)
    once its peer's router sent it ``rounds`` rounds' worth of an even share of its (token, slot) pairs.
    With ``lone`` K (``topk-K``) a copy is not set to its holder's weights but moved every round by a top-k
    update of K values a block of what they lead it by, the holder keeping the rest for later rounds
    (the swarm's ``swarm.topk_lone_fraction`` K/256); ``synced`` (``lone-K``) sets the holder to that
    value too, what the update dropped kept in its error feedback."""

    rounds: int = 1
    tokens: bool = False
    lone: int = 0
    synced: bool = False

    @classmethod
    def parse(cls, name: str) -> Policy:
        if name == "every":
            return cls()
        kind, _, count = name.partition("-")
        if kind in ("topk", "lone") and count.isdigit() and 1 <= int(count) <= BLOCK:
            return cls(lone=int(count), synced=kind == "lone")
        if kind not in ("every", "tokens") or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"policy {name!r}: every, every-K or tokens-K with K >= 1, or topk-K or lone-K with 1 <= K <= {BLOCK}"
            )
        return cls(int(count), kind == "tokens")

    @property
    def codec(self) -> Codec | None:
        """The copies' update codec under ``topk-K``."""
        return Codec("topk", self.lone / BLOCK) if self.lone else None


def holders(experts: int, peers: int) -> list[int]:
    """The peer that trains each expert: expert e on peer e mod P."""
    return [e % peers for e in range(experts)]


def build_peers(cfg: Config, peers: int, seed: int) -> list[MoETransformer]:
    """P models from one initialisation, peer i training the experts :func:`holders` gives it."""
    owner = holders(cfg.moe.num_experts, peers)
    full = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
    full.init_weights(seed)
    models = []
    for i in range(peers):
        model = MoETransformer(cfg.model, cfg.moe, local_experts=[e for e, h in enumerate(owner) if h == i])
        model.write_shared([p.detach() for _, p in full.shared_parameters()])
        for e in range(cfg.moe.num_experts):
            model.write_expert(e, full.expert_tensors(e))
        models.append(model)
    return models


@torch.no_grad()
def assemble(cfg: Config, models: list[MoETransformer], copies: bool = False) -> MoETransformer:
    """The run's model: the (averaged) shared weights with each expert from its holder, or (``copies``)
    as the next peer's frozen copy holds it."""
    out = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
    out.write_shared([p.detach() for _, p in models[0].shared_parameters()])
    for e, h in enumerate(holders(cfg.moe.num_experts, len(models))):
        out.write_expert(e, models[(h + 1) % len(models) if copies else h].expert_tensors(e))
    return out


@torch.no_grad()
def average_shared(models: list[MoETransformer]) -> None:
    """Every peer's shared weights set to their mean (a round's uncompressed shared group)."""
    columns = zip(*[[p for _, p in m.shared_parameters()] for m in models])
    for column in columns:
        mean = torch.stack([p.detach() for p in column]).mean(0)
        for p in column:
            p.copy_(mean)


def kind_of(name: str) -> str:
    """``embeddings`` for the token embeddings and the output head, ``rest`` for attention, norms and routers."""
    return "embeddings" if name.startswith(("embed_tokens.", "lm_head.")) else "rest"


def by_rows(x: torch.Tensor, width: int, share: float) -> torch.Tensor:
    """``x`` as rows of ``width`` values, the ``share`` of them with the largest norms kept, each value at
    2 bits (:data:`LEVELS` times its row's largest magnitude), every other row zero: an embedding's
    update moves the rows of the tokens it saw, each in every coordinate, where top-k would keep a few
    values of many rows."""
    rows = x.reshape(-1, width)
    keep = rows.norm(dim=1).topk(max(1, round(share * rows.shape[0]))).indices
    scale = rows[keep].abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    levels = torch.tensor(LEVELS)
    nearest = ((rows[keep] / scale).unsqueeze(-1) - levels).abs().argmin(-1)
    out = torch.zeros_like(rows)
    out[keep] = levels[nearest] * scale
    return out.reshape(-1)


def rank_one(x: torch.Tensor, width: int) -> torch.Tensor:
    """The best rank-one approximation of ``x`` as a matrix of rows of ``width`` values: an output head's
    update is nearly rank one (every token's logit pushed along the same hidden direction), which top-k
    values cannot carry."""
    u, s, vh = torch.linalg.svd(x.reshape(-1, width), full_matrices=False)
    return (s[0] * torch.outer(u[:, 0], vh[0])).reshape(-1)


class SharedAverage:
    """A round's shared group through a codec, as the swarm runs it: each peer sends its pseudo-gradient
    (anchor - weights) plus its error-feedback residual and keeps what its message dropped; the mean of
    the decoded messages is encoded again at the group's result codec with the reducer's own residual,
    and every peer takes the anchor minus that. The values of the ``exact`` kinds (:func:`kind_of`) skip
    the codec: their pseudo-gradients are averaged uncompressed. Blocks run over the shared weights
    flattened in order, where the swarm encodes the vector in P slices."""

    def __init__(
        self, codec: Codec, models: list[MoETransformer], exact: tuple[str, ...] = (), structured: bool = False
    ) -> None:
        self.codec, self.result = codec, codec.result_for(len(models))
        named = models[0].shared_parameters()
        self.anchor = flatten(p for _, p in named)
        self.width = models[0].cfg.d_model
        offsets = torch.tensor([0, *[p.numel() for _, p in named]]).cumsum(0).tolist()
        where = {n: (offsets[i], offsets[i + 1]) for i, (n, _) in enumerate(named)}
        # --shared structured: the token embeddings by rows, the output head as rank one plus top-k of the rest
        self.rows = where["embed_tokens.weight"] if structured else None
        self.head = where["lm_head.weight"] if structured else None
        self.kinds = {k: torch.cat([torch.full((p.numel(),), kind_of(n) == k) for n, p in named]) for k in KINDS}
        self.exact = torch.zeros_like(self.anchor, dtype=torch.bool)
        for k in exact:
            self.exact |= self.kinds[k]
        self.backlog: dict[str, dict[str, float]] = {}  # the last round's, by kind (:meth:`__call__`)
        self.residuals = [torch.zeros_like(self.anchor) for _ in models]
        self.reducer_residual = torch.zeros_like(self.anchor)

    def through(self, codec: Codec, x: torch.Tensor, share: float = ROWS_MEMBER) -> torch.Tensor:
        """``x`` as its message decodes: through ``codec``, or by rows at ``share`` and rank one plus
        ``codec`` for the embeddings and head when structured."""
        out = codec.decode(codec.encode(x), x.numel())
        if self.rows is not None:
            a, b = self.rows
            out[a:b] = by_rows(x[a:b], self.width, share)
            a, b = self.head
            low = rank_one(x[a:b], self.width)
            out[a:b] = low + codec.decode(codec.encode(x[a:b] - low), b - a)
        return out

    @torch.no_grad()
    def __call__(self, models: list[MoETransformer]) -> None:
        pseudo = [self.anchor - flatten(p for _, p in m.shared_parameters()) for m in models]
        decoded = feedback.send(pseudo, self.residuals, lambda x: self.through(self.codec, x))
        mean, self.reducer_residual = feedback.restage(
            torch.stack(decoded).mean(0), self.reducer_residual, lambda x: self.through(self.result, x, ROWS_RESULT)
        )
        exact = torch.stack(pseudo).mean(0)
        mean = torch.where(self.exact, exact, mean)
        for kept in (*self.residuals, self.reducer_residual):
            kept.masked_fill_(self.exact, 0.0)
        # what the peers' messages still hold back against what the round's uncompressed mean would move
        self.backlog = {
            k: {
                "member_residual": statistics.fmean(float(r[mask].norm()) for r in self.residuals),
                "reducer_residual": float(self.reducer_residual[mask].norm()),
                "round_mean": float(exact[mask].norm()),
            }
            for k, mask in self.kinds.items()
        }
        self.anchor = self.anchor - mean
        for m in models:
            feedback.write(self.anchor, [p for _, p in m.shared_parameters()])


class Refreshes:
    """Which frozen copies a policy brings up to date, and how many it did."""

    def __init__(self, policy: Policy, experts: int, peers: int, even_share: float) -> None:
        self.policy, self.owner = policy, holders(experts, peers)
        self.frozen = [[e for e, h in enumerate(self.owner) if h != i] for i in range(peers)]  # each peer's copies
        self.routed = torch.zeros(peers, experts)  # (token, slot) pairs sent to each expert since its refresh
        self.threshold = policy.rounds * even_share
        self.public: dict[int, torch.Tensor] = {}  # under topk-K / lone-K: each expert as its copies hold it
        self.residual: dict[int, torch.Tensor] = {}  # under lone-K: what each holder's updates dropped
        self.rounds = self.done = self.copies = 0

    def due(self, peer: int) -> list[int]:
        """The frozen copies of ``peer`` to refresh after this round."""
        if self.policy.tokens:
            return [e for e in self.frozen[peer] if self.routed[peer, e] >= self.threshold]
        return self.frozen[peer] if self.rounds % self.policy.rounds == 0 else []

    @torch.no_grad()
    def apply(self, models: list[MoETransformer]) -> None:
        self.rounds += 1
        if self.policy.lone:
            return self.follow(models)
        for i, model in enumerate(models):
            self.copies += len(self.frozen[i])
            for e in self.due(i):
                model.write_expert(e, models[self.owner[e]].expert_tensors(e))
                self.routed[i, e] = 0
                self.done += 1

    def follow(self, models: list[MoETransformer]) -> None:
        """``topk-K``: every copy of expert e moved to ``public[e]`` plus the update of its holder's lead.
        ``lone-K``: the holder's update since the last round plus its residual, the holder moved too."""
        codec, synced = self.policy.codec, self.policy.synced
        for e, holder in enumerate(self.owner):
            others = [i for i in range(len(models)) if i != holder]
            if e not in self.public:  # the copies were never written: the value every peer started from
                self.public[e] = flatten(models[others[0]].expert_tensors(e))
                self.residual[e] = torch.zeros_like(self.public[e])
            lead = flatten(models[holder].expert_tensors(e)) - self.public[e]
            if synced:
                lead += self.residual[e]
            update = codec.decode(codec.encode(lead), lead.numel())
            self.public[e] += update
            if synced:
                self.residual[e] = lead - update
            for i in [*others, holder] if synced else others:
                targets = models[i].expert_tensors(e)
                models[i].write_expert(e, split_like(self.public[e], targets))
            self.copies += len(others)
            self.done += len(others)

    @property
    def share(self) -> float:
        """The share of copies refreshed per round (1 for ``every``)."""
        return self.done / self.copies if self.copies else 1.0


def run(policy_name: str, peers: int, seed: int, args: argparse.Namespace, data, validation) -> dict[str, Any]:
    """One policy at one seed: the assembled model's loss every ``--eval-rounds`` rounds."""
    cfg = load_config(None, [*common(args.steps), f"train.seed={seed}"])
    models = build_peers(cfg, peers, seed)
    tr = cfg.train  # the convergence benchmark's (AdamW), or the trainer's default:
    if args.optimizer == "muon":
        tr = dataclasses.replace(cfg.train, optimizer="muon", muon_adamw_lr_scale=4.0)
    shared = average_shared
    if args.shared != "none":
        codec = dense_codec(args.result)
        shared = SharedAverage(codec, models, tuple(args.exact), structured=args.shared == "structured")
    optimizers = [build_optimizer(m, tr) for m in models]
    batch = codec_rounds.TOKENS_BATCH // peers
    loaders = [
        BatchLoader(data, cfg.model.max_seq_len, batch, seed=seed, peer_index=i, num_peers=peers) for i in range(peers)
    ]
    pairs_per_round = args.sync * batch * cfg.model.max_seq_len * cfg.moe.top_k * cfg.model.num_layers
    refreshes = Refreshes(Policy.parse(policy_name), cfg.moe.num_experts, peers, pairs_per_round / cfg.moe.num_experts)
    routed: list[torch.Tensor] = []
    for model in models:  # each forward's (token, slot) pairs per expert, summed over layers
        model.register_forward_hook(lambda _m, _in, out: routed.append(sum(s.tokens_per_expert for s in out[1])))
    curve: dict[str, float] = {}
    copies_curve: dict[str, float] = {}  # with --score-copies: the model with every expert as its copies hold it
    backlog: dict[str, dict[str, dict[str, float]]] = {}  # under a codec, at each scored round
    t0 = time.monotonic()
    for step in range(args.steps):
        for i, (model, loader, opt) in enumerate(zip(models, loaders, optimizers)):
            model.train()
            x, y = loader.next_batch()
            model.loss(x, y, z_loss_weight=tr.z_loss_weight).loss.backward()
            refreshes.routed[i] += routed.pop().detach().float()
            set_lr(opt, lr_at(step, tr))
            torch.nn.utils.clip_grad_norm_([p for _, p in trainable_parameters(model)], tr.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % args.sync == 0:
            shared(models)
            refreshes.apply(models)
            if refreshes.rounds % args.eval_rounds == 0 or step + 1 == args.steps:
                curve[str(refreshes.rounds)] = validation.loss(assemble(cfg, models))
                if args.score_copies:
                    copies_curve[str(refreshes.rounds)] = validation.loss(assemble(cfg, models, copies=True))
                if isinstance(shared, SharedAverage):
                    backlog[str(refreshes.rounds)] = shared.backlog
    return {
        "curve": curve,
        "final": curve[str(args.rounds)],
        "refreshed_share": refreshes.share,
        "seconds": round(time.monotonic() - t0, 1),
        **({"backlog": backlog} if backlog else {}),
        **({"copies_curve": copies_curve} if copies_curve else {}),
    }


def common(steps: int) -> list[str]:
    return [*convergence.CONFIG, codec_rounds.MUON_ITERATIONS, *convergence.schedule(steps)]


def dense_codec(result: int = RESULT, lone: int | None = None) -> Codec:
    """topk-dense with ``result`` values a block in a group's averaged parts (``--result``; the swarm's
    ``swarm.topk_result_fraction`` result/256) and, given, ``lone`` in a lone holder's update."""
    return Codec("topk", result_fraction=result / BLOCK, lone_fraction=None if lone is None else lone / BLOCK)


def policy_codec(arm: str, policy: str, result: int = RESULT) -> Codec | None:
    """``arm``'s codec with ``policy``'s copies: under ``topk-K`` and ``lone-K`` topk-dense's (at ``result``)
    with the lone share K/256 (None for the other codecs, which have no such setting)."""
    lone = Policy.parse(policy).lone
    if arm not in ("topk-dense", "structured"):
        return None if lone else codec_rounds.codec_of(arm)
    return dense_codec(result, lone or None)


def structured_extra(codec: Codec, peers: int, rows: int, width: int) -> float:
    """What ``--shared structured`` moves for a token embedding and an output head of ``rows`` x
    ``width`` per peer per round: a ring's (P - 1) / P of the members' messages and of the groups'
    results, both ways. Embedding rows at 2 bits a value with an fp16 scale and a 32-bit index each; the
    head's rank one in fp16 (its rows' factor, and the other factor once per part) plus top-k of the rest
    in the codec's member and result shares. Message headers are left out."""

    def row_bytes(share: float) -> float:
        return share * rows * (2 * width + 16 + 32) / 8

    rank_one_bytes = 2 * (rows + peers * width)
    member = row_bytes(ROWS_MEMBER) + rank_one_bytes + codec.wire_bytes(rows * width)
    result = row_bytes(ROWS_RESULT) + rank_one_bytes + codec.result_for(peers).wire_bytes(rows * width)
    return 2 * (peers - 1) / peers * (member + result)


def projection(
    shares: dict[str, float], peer_counts: tuple[int, ...] = (4, 16), result: int = RESULT
) -> dict[str, Any]:
    """Each codec's bytes per peer per round at spes-1b under each policy's refreshed share, and their
    ratio to the SPES reference at fp32 (None where the policy does not apply to the codec). The
    ``structured`` column is topk-dense with ``--shared structured``'s embeddings and head; both keep
    ``result`` values a block in a group's averaged parts."""
    shared, expert, experts = comms.parameter_split(name="spes-1b")
    cfg = load_config("spes-1b", [])
    vocab, width = cfg.model.vocab_size, cfg.model.d_model

    def per_peer(arm: str, policy: str, share: float, peers: int) -> float | None:
        codec = policy_codec(arm, policy, result)
        if codec is None:
            return None
        if arm != "structured":
            return comms.ours(codec, shared, expert, experts, peers, share)["total"]
        rest = comms.ours(codec, shared - 2 * vocab * width, expert, experts, peers, share)["total"]
        return rest + structured_extra(codec, peers, vocab, width)

    out: dict[str, Any] = {}
    for peers in peer_counts:
        reference = comms.spes_reference(None, shared, expert, experts, peers)["total"]
        out[str(peers)] = {
            policy: {
                arm: None
                if (b := per_peer(arm, policy, share, peers)) is None
                else {"per_peer": b, "less": reference / b}
                for arm in (*CODECS, "structured")
            }
            for policy, share in shares.items()
        }
    return out


def summarise(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per policy: finals, the gap to ``every`` per seed (and min-max), its curve and the refreshed share."""
    out: dict[str, Any] = {}
    for policy, by_seed in runs.items():
        out[policy] = shares.compare(by_seed, runs.get(BASELINE, {}), policy == BASELINE)
        out[policy]["refreshed_share"] = statistics.fmean(r["refreshed_share"] for r in by_seed.values())
    return out


def less(cell: dict[str, float] | None) -> str:
    return "-" if cell is None else f"{cell['less']:.1f}x"


def print_table(console: Console, payload: dict[str, Any]) -> None:
    summary, bytes_at = payload["summary"], payload["spes_1b"]
    seeds = ", ".join(str(s) for s in payload["seeds"])
    shared = payload.get("shared", "none") + "".join(f", {k} exact" for k in payload.get("exact", []))
    table = Table(
        title=f"{payload['peers']} peers, {payload['rounds']} rounds of {payload['sync']} steps, seeds {seeds}; "
        f"shared weights {shared}, {payload.get('optimizer', 'muon')}"
    )
    for col in (
        "policy",
        "copies refreshed / round",
        "final loss (mean of its seeds)",
        "vs every, mean (min .. max)",
        "per seed",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for peers in bytes_at:
        for arm in (*CODECS, "structured"):
            table.add_column(f"{arm} at {peers} peers: less than SPES fp32", justify="right")
    for policy, row in summary.items():
        gap = row["gap"]
        table.add_row(
            policy,
            f"{row['refreshed_share']:.0%}",
            f"{row['mean']:.4f}",
            "-" if gap is None else f"{gap['mean']:+.2%} ({gap['min']:+.2%} .. {gap['max']:+.2%})",
            "-" if gap is None else " ".join(f"{row['gaps'][s]:+.2%}" for s in sorted(row["gaps"], key=int)),
            *[less(bytes_at[p][policy][arm]) for p in bytes_at for arm in (*CODECS, "structured")],
        )
    console.print(table)


def plot(payload: dict[str, Any], writer: results.Run) -> bool:
    plt = convergence.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, row in payload["summary"].items():
        if policy != BASELINE and row["gap_curve"]:
            xs = sorted(int(k) for k in row["gap_curve"])
            ax.plot(xs, [100 * row["gap_curve"][str(k)] for k in xs], label=policy)
    ax.axhline(0.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("rounds")
    ax.set_ylabel("validation loss vs every round, %")
    ax.legend()
    fig.tight_layout()
    fig.savefig(writer.sibling(".png"), dpi=110)
    plt.close(fig)
    return True


def finish(writer: results.Run, payload: dict[str, Any], merged: list[results.Result] = ()) -> None:
    runs = payload["runs"]
    payload["seeds"] = sorted({int(s) for by_seed in runs.values() for s in by_seed})
    payload["summary"] = summary = summarise(runs)
    shares_by_policy = {p: row["refreshed_share"] for p, row in summary.items()}
    payload["spes_1b"] = projection(shares_by_policy, result=payload.get("result", RESULT))
    print_table(Console(width=200), payload)
    out = writer.write(payload, merged=merged)
    print(f"wrote {out}" + (" and its plot" if plot(payload, writer) else ""))


def merge(variants: list[str], variant: str, argv: list[str] | None) -> None:
    """One result from shares run as separate processes with the same setup, each policy against the
    ``every`` run of its own share (``benchmarks/lab/shares.py``)."""
    parts = [results.own("refresh_cadence", v) for v in variants]
    keys = ("peers", "shared", "result", "exact", "optimizer", "steps", "sync", "eval_rounds", "validation", "config")
    if differ := shares.differing([r.payload for r in parts], keys):
        raise SystemExit(f"--merge: the variants differ in {differ}; only the same setup merges")
    try:
        joined, again = shares.join([(v, r.payload["runs"]) for v, r in zip(variants, parts)], BASELINE)
    except shares.MergeError as exc:
        raise SystemExit(f"--merge: {exc}") from None
    runs = {p: joined[p] for p in [*POLICIES, *sorted(set(joined) - set(POLICIES))] if p in joined}
    payload = {**parts[0].payload, "runs": runs}
    if not all(r.payload.get("score_copies") for r in parts):  # some runs have no copies_curve
        payload.pop("score_copies", None)
    payload["repeats"] = [r for part in parts for r in part.payload.get("repeats", [])] + again
    seeds = sorted({int(s) for by_seed in runs.values() for s in by_seed})
    finish(results.start("refresh_cadence", variant, seeds=seeds, argv=argv), payload, parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--peers", type=int, default=4, choices=[2, 4, 8])
    parser.add_argument(
        "--shared", default="none", choices=SHARED, help="the shared weights' codec, with error feedback (default none)"
    )
    parser.add_argument(
        "--result",
        type=int,
        default=RESULT,
        help=f"with --shared: values a block of {BLOCK} a group's averaged parts keep (default {RESULT})",
    )
    parser.add_argument(
        "--exact", nargs="+", default=[], choices=KINDS, help="with --shared: these kinds averaged uncompressed"
    )
    parser.add_argument(
        "--optimizer",
        default="muon",
        choices=codec_rounds.OPTIMIZERS,
        help="muon: the trainer's default (AdamW at 4x on the rest); adamw: the convergence swarm's",
    )
    parser.add_argument(
        "--score-copies",
        action="store_true",
        help="also score the model with every expert as its frozen copies hold it (copies_curve)",
    )
    shares.add_arguments(parser, sync=5, eval_rounds=30)
    results.add_variant(parser)
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.variant, argv)
    members = round(dense_codec().topk_fraction * BLOCK)
    if not members <= args.result <= BLOCK:
        parser.error(f"--result {args.result}: between the members' {members} and {BLOCK} values a block")
    for name in args.policies:
        try:
            lone = Policy.parse(name).lone
        except ValueError as exc:
            parser.error(str(exc))
        if lone and not members <= lone <= args.result:
            parser.error(f"policy {name}: K between the members' {members} and --result's {args.result}")
    if BASELINE not in args.policies:
        parser.error(f"the policies are measured against {BASELINE}: include it")
    if args.exact and args.shared == "none":
        parser.error("--exact keeps kinds of the shared weights out of a codec: give --shared too")
    if args.result != RESULT and args.shared == "none":
        parser.error("--result sets the shared weights' codec: give --shared too")
    args.steps = args.sync * args.rounds
    writer = results.start("refresh_cadence", args.variant, seeds=args.seeds, argv=argv)
    torch.set_num_threads(1)
    data = TokenDataset(prepare_embedded_data(), verify=True)
    validation = convergence.Validation(load_config(None, common(args.steps)).model.max_seq_len, args.val_windows)
    console = Console(width=200)
    payload: dict[str, Any] = {
        "peers": args.peers,
        "shared": args.shared,
        **({"result": args.result} if args.result != RESULT else {}),
        "exact": args.exact,
        "optimizer": args.optimizer,
        **({"score_copies": True} if args.score_copies else {}),
        "steps": args.steps,
        "sync": args.sync,
        "rounds": args.rounds,
        "eval_rounds": args.eval_rounds,
        "config": common(args.steps),
        "validation": validation.describe,
        "runs": {},
    }
    t0 = time.monotonic()
    for seed in args.seeds:
        for name in args.policies:
            result = run(name, args.peers, seed, args, data, validation)
            payload["runs"].setdefault(name, {})[str(seed)] = result
            console.print(
                f"{name} seed {seed}: {result['final']:.4f}, {result['refreshed_share']:.0%} of copies a round "
                f"({result['seconds'] / 60:.1f} min; {(time.monotonic() - t0) / 60:.1f} min so far)"
            )
        finish(writer, payload)  # after every seed: a cut-short run keeps the seeds it finished


if __name__ == "__main__":
    main()
