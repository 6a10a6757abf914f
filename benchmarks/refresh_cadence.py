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
  share fell just short waits a round more: ``tokens-K`` refreshes somewhat less than 1/K of the copies.

This is a simulation (no swarm code or network), and refreshes are exact, so what is measured
is staleness alone (no warm-up merge either). ``--shared topk-dense`` averages the shared weights through
the project's codec as the swarm does (each peer's error feedback, the reducer's re-encoding with its own
residual; ``SharedAverage``), where the swarm's probes found stale copies costly; ``--exact`` keeps kinds
of the shared weights (the token embeddings and output head, or the rest) out of the codec, to find
where that cost sits; ``--optimizer adamw`` trains as the convergence swarm does. Every policy
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
from benchmarks.lab import results, shares
from p2p_spes.averaging.compression import Codec
from p2p_spes.config import Config, load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import BatchLoader, TokenDataset
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer, lr_at, set_lr, trainable_parameters
from p2p_spes.swarm.outer import flatten, split_like

POLICIES = ("every", "every-2", "every-4", "every-8", "tokens-4")
CODECS = ("int8", "topk-dense", "sparse")  # the codecs whose rounds the projection shows
BASELINE = "every"
SHARED = ("none", "topk-dense")  # how the shared weights are averaged (--shared)
KINDS = ("embeddings", "rest")  # the shared weights' kinds --exact can keep out of the codec


@dataclasses.dataclass(frozen=True)
class Policy:
    """When a frozen copy is brought to its holder's weights: every ``rounds`` rounds, or (``tokens``)
    once its peer's router sent it ``rounds`` rounds' worth of an even share of its (token, slot) pairs."""

    rounds: int = 1
    tokens: bool = False

    @classmethod
    def parse(cls, name: str) -> Policy:
        if name == "every":
            return cls()
        kind, _, count = name.partition("-")
        if kind not in ("every", "tokens") or not count.isdigit() or int(count) < 1:
            raise ValueError(f"policy {name!r}: every, every-K or tokens-K with K >= 1")
        return cls(int(count), kind == "tokens")


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
def assemble(cfg: Config, models: list[MoETransformer]) -> MoETransformer:
    """The run's model: the (averaged) shared weights with each expert from its holder."""
    out = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
    out.write_shared([p.detach() for _, p in models[0].shared_parameters()])
    for e, h in enumerate(holders(cfg.moe.num_experts, len(models))):
        out.write_expert(e, models[h].expert_tensors(e))
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


class SharedAverage:
    """A round's shared group through a codec, as the swarm runs it: each peer sends its pseudo-gradient
    (anchor - weights) plus its error-feedback residual and keeps what its message dropped; the mean of
    the decoded messages is encoded again at the group's result codec with the reducer's own residual,
    and every peer takes the anchor minus that. The values of the ``exact`` kinds (:func:`kind_of`) skip
    the codec: their pseudo-gradients are averaged uncompressed. Blocks run over the shared weights
    flattened in order, where the swarm encodes the vector in P slices."""

    def __init__(self, codec: Codec, models: list[MoETransformer], exact: tuple[str, ...] = ()) -> None:
        self.codec, self.result = codec, codec.result_for(len(models))
        named = models[0].shared_parameters()
        self.anchor = flatten(p for _, p in named)
        self.kinds = {k: torch.cat([torch.full((p.numel(),), kind_of(n) == k) for n, p in named]) for k in KINDS}
        self.exact = torch.zeros_like(self.anchor, dtype=torch.bool)
        for k in exact:
            self.exact |= self.kinds[k]
        self.backlog: dict[str, dict[str, float]] = {}  # the last round's, by kind (:meth:`__call__`)
        self.residuals = [torch.zeros_like(self.anchor) for _ in models]
        self.reducer_residual = torch.zeros_like(self.anchor)

    def through(self, codec: Codec, x: torch.Tensor) -> torch.Tensor:
        return codec.decode(codec.encode(x), x.numel())

    @torch.no_grad()
    def __call__(self, models: list[MoETransformer]) -> None:
        pseudo = [self.anchor - flatten(p for _, p in m.shared_parameters()) for m in models]
        decoded = []
        for i, delta in enumerate(pseudo):
            sent = delta + self.residuals[i]
            decoded.append(self.through(self.codec, sent))
            self.residuals[i] = sent - decoded[-1]
        compensated = torch.stack(decoded).mean(0) + self.reducer_residual
        mean = self.through(self.result, compensated)
        self.reducer_residual = compensated - mean
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
            params = [p for _, p in m.shared_parameters()]
            for p, v in zip(params, split_like(self.anchor, params)):
                p.copy_(v)


class Refreshes:
    """Which frozen copies a policy brings up to date, and how many it did."""

    def __init__(self, policy: Policy, experts: int, peers: int, even_share: float) -> None:
        self.policy, self.owner = policy, holders(experts, peers)
        self.frozen = [[e for e, h in enumerate(self.owner) if h != i] for i in range(peers)]  # each peer's copies
        self.routed = torch.zeros(peers, experts)  # (token, slot) pairs sent to each expert since its refresh
        self.threshold = policy.rounds * even_share
        self.rounds = self.done = self.copies = 0

    def due(self, peer: int) -> list[int]:
        """The frozen copies of ``peer`` to refresh after this round."""
        if self.policy.tokens:
            return [e for e in self.frozen[peer] if self.routed[peer, e] >= self.threshold]
        return self.frozen[peer] if self.rounds % self.policy.rounds == 0 else []

    @torch.no_grad()
    def apply(self, models: list[MoETransformer]) -> None:
        self.rounds += 1
        for i, model in enumerate(models):
            self.copies += len(self.frozen[i])
            for e in self.due(i):
                model.write_expert(e, models[self.owner[e]].expert_tensors(e))
                self.routed[i, e] = 0
                self.done += 1

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
        shared = SharedAverage(codec_rounds.codec_of(args.shared), models, tuple(args.exact))
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
                if isinstance(shared, SharedAverage):
                    backlog[str(refreshes.rounds)] = shared.backlog
    return {
        "curve": curve,
        "final": curve[str(args.rounds)],
        "refreshed_share": refreshes.share,
        "seconds": round(time.monotonic() - t0, 1),
        **({"backlog": backlog} if backlog else {}),
    }


def common(steps: int) -> list[str]:
    return [*convergence.CONFIG, codec_rounds.MUON_ITERATIONS, *convergence.schedule(steps)]


def projection(shares: dict[str, float], peer_counts: tuple[int, ...] = (4, 16)) -> dict[str, Any]:
    """Each codec's bytes per peer per round at spes-1b under each policy's refreshed share, and their
    ratio to the SPES reference at fp32."""
    shared, expert, experts = comms.parameter_split(name="spes-1b")
    out: dict[str, Any] = {}
    for peers in peer_counts:
        reference = comms.spes_reference(None, shared, expert, experts, peers)["total"]
        out[str(peers)] = {
            policy: {
                arm: {
                    "per_peer": (
                        b := comms.ours(codec_rounds.codec_of(arm), shared, expert, experts, peers, share)["total"]
                    ),
                    "less": reference / b,
                }
                for arm in CODECS
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
        for arm in CODECS:
            table.add_column(f"{arm} at {peers} peers: less than SPES fp32", justify="right")
    for policy, row in summary.items():
        gap = row["gap"]
        table.add_row(
            policy,
            f"{row['refreshed_share']:.0%}",
            f"{row['mean']:.4f}",
            "-" if gap is None else f"{gap['mean']:+.2%} ({gap['min']:+.2%} .. {gap['max']:+.2%})",
            "-" if gap is None else " ".join(f"{row['gaps'][s]:+.2%}" for s in sorted(row["gaps"], key=int)),
            *[f"{bytes_at[p][policy][arm]['less']:.1f}x" for p in bytes_at for arm in CODECS],
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
    payload["spes_1b"] = projection({p: row["refreshed_share"] for p, row in summary.items()})
    print_table(Console(width=200), payload)
    out = writer.write(payload, merged=merged)
    print(f"wrote {out}" + (" and its plot" if plot(payload, writer) else ""))


def merge(variants: list[str], variant: str, argv: list[str] | None) -> None:
    """One result from shares run as separate processes with the same setup, each policy against the
    ``every`` run of its own share (``benchmarks/lab/shares.py``)."""
    parts = [results.own("refresh_cadence", v) for v in variants]
    keys = ("peers", "shared", "exact", "optimizer", "steps", "sync", "eval_rounds", "validation", "config")
    if differ := shares.differing([r.payload for r in parts], keys):
        raise SystemExit(f"--merge: the variants differ in {differ}; only the same setup merges")
    try:
        joined, again = shares.join([(v, r.payload["runs"]) for v, r in zip(variants, parts)], BASELINE)
    except shares.MergeError as exc:
        raise SystemExit(f"--merge: {exc}") from None
    runs = {p: joined[p] for p in [*POLICIES, *sorted(set(joined) - set(POLICIES))] if p in joined}
    payload = {**parts[0].payload, "runs": runs}
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
        "--exact", nargs="+", default=[], choices=KINDS, help="with --shared: these kinds averaged uncompressed"
    )
    parser.add_argument(
        "--optimizer",
        default="muon",
        choices=codec_rounds.OPTIMIZERS,
        help="muon: the trainer's default (AdamW at 4x on the rest); adamw: the convergence swarm's",
    )
    shares.add_arguments(parser, sync=5, eval_rounds=30)
    results.add_variant(parser)
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.variant, argv)
    for name in args.policies:
        try:
            Policy.parse(name)
        except ValueError as exc:
            parser.error(str(exc))
    if BASELINE not in args.policies:
        parser.error(f"the policies are measured against {BASELINE}: include it")
    if args.exact and args.shared == "none":
        parser.error("--exact keeps kinds of the shared weights out of a codec: give --shared too")
    args.steps = args.sync * args.rounds
    writer = results.start("refresh_cadence", args.variant, seeds=args.seeds, argv=argv)
    torch.set_num_threads(1)
    data = TokenDataset(prepare_embedded_data(), verify=True)
    validation = convergence.Validation(load_config(None, common(args.steps)).model.max_seq_len, args.val_windows)
    console = Console(width=200)
    payload: dict[str, Any] = {
        "peers": args.peers,
        "shared": args.shared,
        "exact": args.exact,
        "optimizer": args.optimizer,
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
