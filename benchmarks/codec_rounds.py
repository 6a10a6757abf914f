"""Codecs over 150 rounds and more: the validation loss each reaches against uncompressed averaging.

    python -m benchmarks.codec_rounds                          # 5 codecs x 3 seeds x 4 and 8 peers
    python -m benchmarks.codec_rounds --peers 4 --seeds 0 --variant p4-s0   # one process per share of it
    python -m benchmarks.codec_rounds --merge p4-s0 p4-s1 --variant main    # one result from several

Compressed averaging is decided over many rounds: error feedback sends later what a round dropped,
so a codec's gap to uncompressed averaging shrinks as rounds pile up (the swarm convergence benchmark's
``topk`` went from +16.8% at 16 rounds to +7.3% at 48). Real runs have hundreds of rounds, which a
swarm of processes on two cores cannot reach in a session, so this benchmark runs the rounds in one
process: P full replicas of the quality benchmark's micro model (``benchmarks/local_steps.py``'s
``train``: d_model 64, 2 layers, 8 experts top-2, seq_len 64, Muon with AdamW at 4x on the rest, Muon
at 5 Newton-Schulz iterations as when the first runs were made), each reading its own data partition,
averaged every ``--sync`` steps through the project's codecs (``p2p_spes/averaging``: ``Codec.encode``, ``decode``, ``result_for``, ``bundle``),
with error feedback as the swarm keeps it: each replica's residual (decayed under ``sparse``), the
reducers' own residual when they re-encode a mean, the members' messages forwarded as one bundle
under ``sparse``. No network, no expert split: what is measured is the codec's effect on quality,
round after round.

Arms: ``none`` (uncompressed averaging, the baseline), ``int8``, ``topk`` (1/64 of each block of 256,
2 bits), ``topk-dense`` (the reducers' parts at 4/64), ``sparse`` (top-k per chunk of 4,096 at 1/64,
2-bit bins, forwarded, decayed error feedback). Every arm of a peer count sees the same data (the
replicas' partitions of the seed's permutation) from the same initialisation, and is scored on the
same 1,024 validation windows (``convergence.Validation``; ``--val-windows``) every ``--eval-rounds`` rounds, after that
round's average (the replicas are then identical). With 8 peers each replica's batch is half that of
4 peers, so both see the same tokens per step.

Bytes per peer per round are this project's protocol for the micro model's parameters as one flat
group (``benchmarks/comms.py``'s ``ours``: contributions, averaged parts or bundles, headers and
envelopes, every byte), and their ratio to the SPES reference sending each peer's whole model in fp32;
``spes_1b`` holds the same ratio at the spes-1b config with 4 and 16 peers (experts split, frozen
copies refreshed every round), where the targets are set.

Prints a table (per peer count and arm: the final loss, its gap to ``none`` per seed, min-max, and the
bytes) and writes ``benchmarks/results/codec_rounds/<variant>.json`` (default ``main``) with each run's
curve (loss at every scored round), plus ``<variant>.png`` with the gap to ``none`` against rounds
(needs matplotlib).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import comms, convergence, local_steps
from benchmarks.lab import results, shares
from p2p_spes.averaging.compression import Codec
from p2p_spes.config import load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import TokenDataset
from p2p_spes.model import MoETransformer
from p2p_spes.optim import trainable_parameters

ARMS = ("none", "int8", "topk", "topk-dense", "sparse")
TOKENS_BATCH = 32  # sequences per step over all replicas: 4 x 8 or 8 x 4
DENSE = 4 / 64  # topk-dense: swarm.topk_result_fraction
# Muon's Newton-Schulz iterations, pinned: the stored runs were made when the trainer's default was 5 (it
# is 3 since), and shares run later must train the same replicas to merge with them
MUON_ITERATIONS = "train.muon_ns_steps=5"


OPTIMIZERS = ("muon", "adamw")


def probe(arm: str, peers: int, sync: int, optimizer: str = "muon") -> local_steps.Probe:
    """The replicas of ``arm``: the trainer's default optimizer (Muon, AdamW at 4x on the rest), or AdamW
    on everything (``optimizer="adamw"``: whether the codecs' cost depends on the inner optimizer)."""
    codec = None if arm == "none" else arm.removesuffix("-dense")
    fraction = DENSE if arm == "topk-dense" else None
    muon = optimizer == "muon"
    return local_steps.Probe(
        peers, sync, codec=codec, result_fraction=fraction, muon=muon, muon_adamw_scale=4.0 if muon else 1.0
    )


def probes(runs: dict[str, dict[str, Any]], sync: int, optimizer: str) -> dict[str, Any]:
    """What each arm ran, by peer count (``runs[peers][arm]``)."""
    return {
        peers: {arm: asdict(probe(arm, int(peers), sync, optimizer)) for arm in by_arm}
        for peers, by_arm in runs.items()
    }


def codec_of(arm: str) -> Codec:
    name = arm.removesuffix("-dense")
    return Codec(name, result_fraction=DENSE if arm == "topk-dense" else None)


def parameter_count(common: list[str]) -> int:
    cfg = load_config(None, common)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)), device="meta")
    return sum(p.numel() for _, p in trainable_parameters(model))


def round_bytes(arm: str, numel: int, peers: int) -> dict[str, float]:
    """Bytes per peer per round for ``numel`` parameters averaged as one flat group, and their ratio to
    the SPES reference in fp32 (every peer uploads its model and downloads everyone's)."""
    ours = comms.ours(codec_of(arm), numel, 0, 0, peers)
    reference = comms.spes_reference(None, numel, 0, 0, peers)
    return {"per_peer": ours["total"], "reference_fp32": reference["total"], "less": reference["total"] / ours["total"]}


def projection(arms: list[str], peer_counts: tuple[int, ...] = (4, 16)) -> dict[str, Any]:
    """Each codec's bytes per peer per round at the spes-1b config (shared weights in one group, each
    expert's update to its frozen copies), over the SPES reference's at fp32: ``benchmarks/comms.py``'s
    computed counts, which its loopback swarms match to within 1%."""
    shared, expert, experts = comms.parameter_split(name="spes-1b")
    out: dict[str, Any] = {"shared_params": shared, "expert_params": expert, "experts": experts, "peers": {}}
    for peers in peer_counts:
        reference = comms.spes_reference(None, shared, expert, experts, peers)["total"]
        out["peers"][str(peers)] = {
            arm: {
                "per_peer": (ours := comms.ours(codec_of(arm), shared, expert, experts, peers)["total"]),
                "less": reference / ours,
                "bits_per_value": comms.bits_per_value(codec_of(arm)),
            }
            for arm in arms
        }
    return out


def run(arm: str, peers: int, seed: int, args: argparse.Namespace, data: TokenDataset, validation) -> dict[str, Any]:
    """One arm at one seed: the loss after every ``--eval-rounds``-th round, and at the end."""
    common = [*convergence.CONFIG, MUON_ITERATIONS, *convergence.schedule(args.steps)]
    cfg = load_config(None, [*common, f"train.seed={seed}"])
    curve: dict[str, float] = {}  # by rounds done (str: as JSON keeps it)
    every = args.eval_rounds * args.sync

    def score(steps: int, model: MoETransformer) -> None:
        if steps % every == 0 or steps == args.steps:
            curve[str(steps // args.sync)] = validation.loss(model)

    t0 = time.monotonic()
    replicas = probe(arm, peers, args.sync, args.optimizer)
    local_steps.train(cfg, replicas, TOKENS_BATCH // peers, seed, data, after_step=score)
    return {"curve": curve, "final": curve[str(args.rounds)], "seconds": round(time.monotonic() - t0, 1)}


def summarise(runs: dict[str, dict[str, dict[str, Any]]], numel: int) -> dict[str, Any]:
    """Per peer count and arm: final losses, the gap to ``none`` per seed (and min-max), the gap's curve
    (mean over seeds at each scored round) and the bytes. ``runs[peers][arm][seed]``; a run's own
    ``baseline`` (a merged share's ``none``) is its ``none`` where it has one."""
    out: dict[str, Any] = {}
    for peers, by_arm in runs.items():
        out[peers] = {}
        for arm, by_seed in by_arm.items():
            out[peers][arm] = shares.compare(by_seed, by_arm.get("none", {}), arm == "none")
            out[peers][arm]["bytes"] = round_bytes(arm, numel, int(peers))
    return out


def print_table(console: Console, summary: dict[str, Any], rounds: int, sync: int, optimizer: str) -> None:
    for peers, by_arm in summary.items():
        seeds = sorted({s for row in by_arm.values() for s in row["finals"]}, key=int)
        title = f"{peers} peers, {rounds} rounds of {sync} steps, {optimizer}, seeds {', '.join(seeds)}"
        table = Table(title=title)
        for col in (
            "codec",
            "final loss (mean)",
            "vs none, mean (min .. max)",
            "per seed",
            "KB / peer / round",
            "less than SPES fp32",
        ):
            table.add_column(col, justify="left" if col == "codec" else "right")
        for arm, row in by_arm.items():
            gap = row["gap"]
            table.add_row(
                arm,
                f"{row['mean']:.4f}",
                "-" if gap is None else f"{gap['mean']:+.2%} ({gap['min']:+.2%} .. {gap['max']:+.2%})",
                "-" if gap is None else " ".join(f"{row['gaps'][s]:+.2%}" for s in sorted(row["gaps"])),
                f"{row['bytes']['per_peer'] / 1e3:,.1f}",
                f"{row['bytes']['less']:.1f}x",
            )
        console.print(table)


def plot(summary: dict[str, Any], out: Path) -> bool:
    plt = convergence.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
    for ax, (peers, by_arm) in zip(axes[0], summary.items()):
        for arm, row in by_arm.items():
            if arm == "none" or not row["gap_curve"]:
                continue
            xs = sorted(int(k) for k in row["gap_curve"])
            ax.plot(xs, [100 * row["gap_curve"][str(k)] for k in xs], label=arm)
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{peers} peers")
        ax.set_xlabel("rounds")
        ax.set_ylabel("validation loss vs uncompressed, %")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def write(writer: results.Run, payload: dict[str, Any], merged: list[results.Result]) -> None:
    out = writer.write(payload, merged=merged)
    plotted = plot(payload["summary"], writer.sibling(".png"))
    print(f"wrote {out}" + (" and its plot" if plotted else ""))


def merge(variants: list[str], variant: str, argv: list[str] | None) -> None:
    """One result from several runs of this script with the same setup (shares run as separate processes),
    each codec against the uncompressed run of its own share (``benchmarks/lab/shares.py``)."""
    parts = [results.own("codec_rounds", v) for v in variants]
    for part in parts:
        part.payload.setdefault("optimizer", "muon")  # files written before --optimizer ran Muon
    first = parts[0].payload
    if differ := shares.differing(
        [r.payload for r in parts], ("steps", "sync", "eval_rounds", "parameters", "validation", "optimizer")
    ):
        raise SystemExit(f"--merge: the variants differ in {differ}; only the same setup merges")
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    repeats = [r for part in parts for r in part.payload.get("repeats", [])]
    for peers in sorted({n for part in parts for n in part.payload["runs"]}, key=int):
        held = [(v, part.payload["runs"][peers]) for v, part in zip(variants, parts) if peers in part.payload["runs"]]
        try:
            joined, again = shares.join(held, "none")
        except shares.MergeError as exc:
            raise SystemExit(f"--merge: {peers} peers: {exc}") from None
        runs[peers] = {arm: joined[arm] for arm in ARMS if arm in joined}  # ARMS order
        repeats += [{"peers": peers, **r} for r in again]
    seeds = sorted({int(s) for by_arm in runs.values() for by_seed in by_arm.values() for s in by_seed})
    summary = summarise(runs, first["parameters"])
    print_table(Console(width=160), summary, first["steps"] // first["sync"], first["sync"], first["optimizer"])
    for r in repeats:
        print(f"{r['peers']} peers none seed {r['seed']} again in {r['variant']}: {r['apart']:+.3%} from the one kept")
    arms = [arm for arm in ARMS if any(arm in by_arm for by_arm in runs.values())]
    payload = {**first, "seeds": seeds, "runs": runs, "summary": summary, "spes_1b": projection(arms)}
    payload["probes"], payload["repeats"] = probes(runs, first["sync"], first["optimizer"]), repeats
    write(results.start("codec_rounds", variant, seeds=seeds, argv=argv), payload, parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--peers", nargs="+", type=int, default=[4, 8], choices=[2, 4, 8, 16, 32])
    shares.add_arguments(parser, sync=10, eval_rounds=15)
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="muon", help="the replicas' (default muon: the trainer's default)"
    )
    results.add_variant(parser)
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.variant, argv)
    if "none" not in args.arms:
        parser.error("the codecs are measured against uncompressed averaging: include none")
    args.steps = args.sync * args.rounds
    writer = results.start("codec_rounds", args.variant, seeds=args.seeds, argv=argv)
    torch.set_num_threads(1)
    common = [*convergence.CONFIG, MUON_ITERATIONS, *convergence.schedule(args.steps)]
    numel = parameter_count(common)
    data = TokenDataset(prepare_embedded_data(), verify=True)
    validation = convergence.Validation(load_config(None, common).model.max_seq_len, args.val_windows)
    console = Console(width=160)
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    t0 = time.monotonic()
    for seed in args.seeds:
        for peers in args.peers:
            for arm in args.arms:
                result = run(arm, peers, seed, args, data, validation)
                runs.setdefault(str(peers), {}).setdefault(arm, {})[str(seed)] = result
                console.print(
                    f"{peers} peers {arm} seed {seed}: {result['final']:.4f} "
                    f"({result['seconds'] / 60:.1f} min; {(time.monotonic() - t0) / 60:.1f} min so far)"
                )
        summary = summarise(runs, numel)
        print_table(console, summary, args.rounds, args.sync, args.optimizer)
        payload = {
            "steps": args.steps,
            "sync": args.sync,
            "optimizer": args.optimizer,
            "eval_rounds": args.eval_rounds,
            "tokens_per_step": TOKENS_BATCH * load_config(None, common).model.max_seq_len,
            "parameters": numel,
            "config": common,
            "probes": probes(runs, args.sync, args.optimizer),
            "validation": validation.describe,
            "seeds": sorted({int(s) for by_arm in runs.values() for a in by_arm.values() for s in a}),
            "runs": runs,
            "summary": summary,
            "spes_1b": projection(args.arms),
        }
        write(writer, payload, [])  # after every seed: a cut-short run keeps the seeds it finished


if __name__ == "__main__":
    main()
