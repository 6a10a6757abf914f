"""The figures of README.md's Numbers and of benchmarks/README.md's table, rendered from the result files.

    python -m benchmarks.render            # rewrite the rendered regions
    python -m benchmarks.render --check    # exit 1 and print a diff when a file is not what it renders to

A rendered region is the text between a line ``<!-- rendered: NAME -->`` and the next line
``<!-- end rendered -->``; everything outside the regions stays as written. Every number inside one is
computed here from a result file read through :func:`benchmarks.lab.results.read` (the words around them
are templates), so a figure cannot drift from its JSON: a hand edit, or a result run again without
rendering, makes ``--check`` and ``tests/test_rendered.py`` fail. A result without provenance is cited as
legacy; a figure that rests on one seed says "one seed", one on several gives their count and spread, and
one from a run that recorded no seed says "one run". Byte figures measured before the wire meter
(``p2p_spes/averaging/wire_meter.py``) name the counters they come from.
"""

from __future__ import annotations

import argparse
import difflib
import re
import statistics
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.lab import results
from benchmarks.lab.results import Result
from benchmarks.lab.wan_report import SwarmReport
from p2p_spes.config import load_config

START = re.compile(r"<!-- rendered: ([a-z0-9_-]+) -->")
END = "<!-- end rendered -->"
FP32 = 4  # bytes per value: the memory benchmark counts fp32 weights
TARGET = 0.01  # the gap to uncompressed averaging that topk-dense aims to stay within
OLD_COUNTERS = "old counters: a peer's side of its groups and its downloads"
FAULTS = {"kill": "kills", "kill-in-sync": "kills inside a round", "freeze": "freezes", "restart": "restarts"}
FAULTS |= {"bootstrap-kill": "bootstrap kills", "disk-full": "full disks"}
# the quality benchmark's runs of today's defaults, 4 and 2 peers, as (variant, arm, what differs from them)
DEFAULTS = (
    ("muon-ns3", "muon-4x-ns3", ""),
    ("main", "muon-4x-2", "with five Newton-Schulz iterations instead of three"),
)
MUON_ITERATIONS = "muon-ns3"  # the quality benchmark's run of Muon with 5 and with 3 iterations, side by side
# topk-dense in the swarm: (how the experts' updates go, comms variant, convergence arm, its convergence
# variants at SWARM_PEERS, None where not run); the settings each row names are those the arm's overrides
# in those results set to other than topk-dense's values
SWARM_PEERS = (4, 8)
SWARM_SETTINGS = {
    "swarm.expert_sync_rounds": 1,
    "swarm.topk_result_fraction": 0.0625,
    "swarm.topk_lone_fraction": None,
}
SWARM_MODES = (
    ("every round, at the averaged parts' share", "main", "spes-topk-dense", ("every4-150r", "topk-dense-8peers-150r")),
    ("every K rounds", "every4", "spes-topk-dense-every4", ("every4-150r", "every4-8peers-150r")),
    ("every round, at a share of their own", "lone5", "spes-topk-dense-lone5", ("lone5-150r", "lone5-8peers-150r")),
    (
        "every round, at a share of their own",
        "dense8-lone8",
        "spes-topk-dense8-lone8",
        ("dense8-lone8-150r", "dense8-lone8-8peers-3seeds-150r"),
    ),
)


class RenderError(ValueError):
    """A file whose markers cannot be rendered, or a result without what a figure needs."""


def load(script: str, variant: str = "main") -> Result:
    return results.read(results.path(script, variant))


def _note(r: Result) -> str:
    if r.legacy:
        return "legacy: no provenance"
    p = r.provenance
    return f"commit {str(p.get('commit'))[:7]}" + (", uncommitted changes" if p.get("dirty") else "")


def cite(rs: Sequence[Result], readme: bool) -> str:
    """Links to result files, each with its provenance (said once when all agree)."""
    names = [f"{r.path.parent.name}/{r.path.name}" for r in rs]
    folders = {r.path.parent.name for r in rs}
    if readme and len(rs) > 1 and len(folders) == 1:  # one folder: linked once, each file named in it
        (folder,) = folders
        notes = [_note(r) for r in rs]
        files = [f"`{r.path.name}`" for r in rs]
        each = (
            ", ".join(files) + f" ({notes[0]})"
            if len(set(notes)) == 1
            else ", ".join(f"{name} ({note})" for name, note in zip(files, notes))
        )
        return f"[`benchmarks/results/{folder}/`](benchmarks/results/{folder}/): {each}"
    links = [
        f"[`benchmarks/results/{n}`](benchmarks/results/{n})" if readme else f"[{r.path.stem}](results/{n})"
        for r, n in zip(rs, names)
    ]
    notes = [_note(r) for r in rs]
    if len(set(notes)) == 1:
        return ", ".join(links) + f" ({notes[0]})"
    return ", ".join(f"{link} ({note})" for link, note in zip(links, notes))


def seeds(r: Result, measured: Sequence | None = None) -> str:
    """'one seed', 'N seeds', or 'one run' when neither the payload nor the provenance names a seed."""
    got = measured if measured is not None else (r.provenance or {}).get("seeds")
    if not got:
        return "one run"
    return "one seed" if len(got) == 1 else f"{len(got)} seeds"


def span(values: Sequence[float], fmt: str, each: str = "seed") -> str:
    """'a to b', or 'a on every <each>' when they print alike."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo} on every {each}" if lo == hi else f"{lo} to {hi}"


def paired(finals: dict, base: dict) -> list[float]:
    """Per-seed gaps of ``finals`` to ``base`` (both {seed: loss}) over the seeds both have."""
    common = [s for s in finals if s in base]
    if not common:
        raise RenderError("an arm and its baseline have no seed in common")
    return [finals[s] / base[s] - 1 for s in common]


def wrap(text: str) -> str:
    return textwrap.fill(
        text, 100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )


# -- the five results README.md's Numbers shows: each gives its bullet and its line's headline --------


def memory() -> tuple[str, str]:
    r = load("memory")
    row = {(x["config"], x["optimizer"], x["setup"].replace(",", " ").split()[0]): x for x in r.payload["rows"]}
    peer, central = row["spes-1b", "muon", "spes"], row["spes-1b", "muon", "centralized"]
    held, total = re.search(r"(\d+)/(\d+)", peer["setup"]).groups()
    gib, ratio = f"{peer['total_bytes'] / 2**30:.2f} GiB", f"{peer['ratio_to_centralized']:.2f}x"
    bullet = (
        f"**Memory.** A SPES peer of the spes-1b config ({peer['weights_bytes'] / FP32 / 1e9:.2f}B parameters, "
        f"{held} of {total} experts, Muon) needs {gib} for weights, gradients and optimizer state, {ratio} of "
        f"centralized training ({central['total_bytes'] / 2**30:.2f} GiB), before activations. Computed from the "
        f"shapes: {cite([r], True)}."
    )
    return bullet, f"a SPES peer of spes-1b with Muon needs {gib}, {ratio} of centralized (computed)"


def comms() -> tuple[str, str]:
    r = load("comms")
    p = r.payload
    projected = p["projections"]["spes-1b"]["peers"]
    n = min(projected, key=int)
    at = projected[n]["codecs"]["int8"]
    less, ceiling = p["loopback_times_less_than"]["int8"]["spes_reference_fp32"], at["ceiling_vs_spes_reference_fp32"]
    counted = (
        "counted per component (client, reducer, served, downloaded) before the wire meter"
        if r.legacy
        else "every message on the swarm's streams counted by the wire meter"
    )
    short = "counted per component before the wire meter" if r.legacy else "counted on the wire"
    bullet = (
        f"**Bytes.** With int8 ({p['bits_per_value']['int8']:.2f} bits per value), a peer sends plus receives "
        f"{p['measured']['int8']['bytes']['total'] / 1e6:.2f} MB per round on a {p['peers']}-peer loopback swarm, "
        f"{less:.2f}x less than the SPES reference at fp32 "
        f"({p['loopback_baselines']['spes_reference_fp32']['total'] / 1e6:.1f} MB, computed). Projected to the "
        f"spes-1b config with {n} peers, int8 moves {at['times_less_than_spes_reference_fp32']:.2f}x less; the "
        f"most any round without a server can save at its bits per value is {ceiling:.2f}x. "
        f"{seeds(r).capitalize()}, {counted}: {cite([r], True)}."
    )
    return bullet, (
        f"int8 {less:.2f}x less than the SPES reference at fp32; at spes-1b, "
        f"{at['times_less_than_spes_reference_fp32']:.2f}x, where a serverless round can save at most "
        f"{ceiling:.2f}x ({seeds(r)}; {short})"
    )


def topk() -> tuple[str, str]:
    dense, base = load("convergence", "topk-dense-sync10"), load("convergence", "topk-sync10")
    d, b = dense.payload, base.payload
    gaps = paired(d["summary"]["spes-topk-dense"]["finals"], b["summary"]["spes"]["finals"])
    peers = {
        arm: [x for run in p["runs"][arm] for x in run["swarm"]["peers"]]
        for p, arm in ((d, "spes-topk-dense"), (b, "spes"))
    }
    mb = {
        arm: statistics.fmean((x["bytes_sent"] + x["bytes_received"]) / x["rounds_joined"] / 1e6 for x in xs)
        for arm, xs in peers.items()
    }  # a peer's sent plus received per round it averaged
    fraction = next(o.split("=")[1] for o in d["arms"]["spes-topk-dense"] if o.startswith("swarm.topk_result"))
    within = f", within {TARGET:.0%} at every seed" if max(map(abs, gaps)) < TARGET else ""
    gap, rounds = f"{statistics.fmean(gaps):+.2%}", d["steps"] // d["sync_steps"]
    bullet = (
        f"**Top-k.** Top-k with denser averaged parts (`swarm.topk_result_fraction: {fraction}`) ends {gap} "
        f"in validation loss against uncompressed averaging after {rounds} rounds ({seeds(dense, d['seeds'])}, "
        f"{span(gaps, '+.2%')}{within}), for {mb['spes-topk-dense']:.3f} MB per peer per round against "
        f"{mb['spes']:.2f} MB ({OLD_COUNTERS}): {cite([dense, base], True)}."
    )
    return bullet, f"topk-dense {gap} vs uncompressed at {rounds} rounds ({span(gaps, '+.2%')})"


def quality() -> tuple[str, str]:
    got = []
    for variant, arm, differs in DEFAULTS:
        r = load("quality", variant)
        s = r.payload["summary"][arm]
        got.append(
            (r, r.payload["arms"][arm]["peers"], s["gap"], seeds(r, s["seeds"]), f", {differs}" if differs else "")
        )
    (r4, n4, g4, s4, d4), (r2, n2, g2, s2, d2) = got
    bullet = (
        f"**Quality.** At equal tokens on a small model, the default {n4}-peer swarm ends {g4['mean']:.1%} above "
        f"centralized training with the same optimizer ({s4}, {span([g4['min'], g4['max']], '.1%')}{d4}), {n2} peers "
        f"{g2['mean']:.1%} ({s2}, {span([g2['min'], g2['max']], '.1%')}{d2}): {cite([r4, r2], True)}, explained in "
        "[docs/quality.md](docs/quality.md)."
    )
    return bullet, (
        f"today's defaults {g4['mean']:+.1%} vs centralized with the same optimizer ({n4} peers, {s4}, "
        f"{span([g4['min'], g4['max']], '+.1%')}), {g2['mean']:+.1%} ({n2} peers, {s2}, "
        f"{span([g2['min'], g2['max']], '+.1%')})"
    )


def muon_iterations_table() -> str:
    """Muon with 5 and with 3 Newton-Schulz iterations in one run of the quality benchmark: each loss, and 3
    against 5 paired per seed."""
    r = load("quality", MUON_ITERATIONS)
    runs, arms = r.payload["runs"], r.payload["arms"]
    finals = {arm: {x["seed"]: x["final"] for x in rs} for arm, rs in runs.items()}
    lines = [
        "| run | 5 iterations | 3 iterations | 3 against 5, paired per seed | seeds |",
        "|---|---:|---:|---:|---:|",
    ]
    for five in ("centralized-muon-4x", "muon-4x", "centralized-2-muon-4x", "muon-4x-2"):
        three = f"{five}-ns3"
        if five not in finals or three not in finals:
            continue
        gaps = paired(finals[three], finals[five])
        peers = arms[five]["peers"]
        what = f"one process, batch {8 * peers}" if five.startswith("centralized") else f"{peers}-peer swarm"
        loss = [f"{statistics.fmean(finals[a].values()):.3f}" for a in (five, three)]
        lines.append(
            f"| {what} | {loss[0]} | {loss[1]} | {statistics.fmean(gaps):+.2%} ({span(gaps, '+.2%')}) | {len(gaps)} |"
        )
    note = (
        f"Validation loss after {r.payload['steps']} steps, the quality benchmark's model and scorer, "
        f"today's Muon defaults otherwise, every arm on the same data and validation tokens: {cite([r], False)}."
    )
    return "\n".join([*lines, "", textwrap.fill(note, 100, break_on_hyphens=False, break_long_words=False)])


def chaos() -> tuple[str, str]:
    r = load("chaos")
    p = r.payload
    faults, passed = sum(p["faults"].values()), p["consistency_checks"] - len(p["consistency_failures"])
    kinds = ", ".join(f"{n} {FAULTS.get(k, k)}" for k, n in p["faults"].items())
    bullet = (
        f"**Faults.** A {p['minutes']:.0f}-minute run of {p['peers']} peers under {faults} faults ({kinds}) "
        f"passed {passed} of {p['consistency_checks']} consistency checks, {seeds(r, [p['seed']])}: "
        f"{cite([r], True)}."
    )
    return bullet, (
        f"{faults} faults, {passed}/{p['consistency_checks']} consistency checks passed ({seeds(r, [p['seed']])})"
    )


def default_muon() -> tuple[str, int]:
    """The step and equal-time benchmarks' arm that is the embedded config's optimizer, and its iterations."""
    steps = load_config(None).train.muon_ns_steps
    return ("muon" if steps == 5 else f"muon-{steps}"), steps


def speed() -> tuple[str, str]:
    """One peer's step against the hardware's limit (step_time) and what the default optimizer buys at equal
    time (equal_time; an arm its main run left out comes from its cheaper-muon run)."""
    (arm, steps), st, et = default_muon(), load("step_time"), load("equal_time")
    if arm not in et.payload["summary"]:
        et = load("equal_time", EQUAL_TIME_MORE)
    tiny = st.payload["shapes"]["tiny"]["arms"]
    muon, adamw, s = tiny[arm], tiny["adamw"], et.payload["summary"][arm]
    gap = s["gap_equal_time"]
    bullet = (
        f"**Speed.** On one peer of the main job (CPU, one thread), a step of the default optimizer (Muon, {steps} "
        f"Newton-Schulz iterations) takes {muon['step_ratio_to_adamw']['median']:.2f}x an AdamW step: "
        f"{muon['mfu']:.0%} MFU against {adamw['mfu']:.0%}, of the fp32 matmul rate measured in the same run. At "
        f"equal wall time it still ends {-gap['mean']:.1%} below AdamW in validation loss "
        f"({seeds(et, et.payload['seeds'])}, {span([-gap['max'], -gap['min']], '.1%')}), so Muon stays the "
        f"default: {cite([st, et], True)}, the table in "
        "[benchmarks/README.md](benchmarks/README.md#performance-loss-per-second-not-only-per-token)."
    )
    return bullet, head_step_time()


def numbers() -> str:
    return "\n".join(wrap(bullet()[0]) for bullet in (memory, comms, speed, quality, chaos))


# -- the other lines of benchmarks/README.md's table --------------------------------------------------


def head_wan() -> str:
    r = load("wan", "4x20")
    p = r.payload
    peers, n = p["peers"], p["num_peers"]
    rounds = sorted({x["round"] for q in peers for x in q["rounds"]})
    held = [{(x["round"], x["members"], x["outcome"]) for x in q["rounds"]} for q in peers]
    every = [k for k in rounds if all((k, n, "averaged") in h for h in held)]
    computed, share = [q["steps_computed"] for q in peers], [q["compute_share"] for q in peers]
    codec = p["config"]["swarm"]["compression"]
    return (
        f"{n} peers at {p['network']['peers'][0]['up_mbit']:.0f} Mbit/s, "
        f"{'uncompressed' if codec == 'none' else codec} rounds: {len(every)} of {len(rounds)} averaged with every "
        f"peer; {min(computed)}-{max(computed)} of {p['config']['train']['max_steps']} steps computed, "
        f"{sum(q['steps_skipped'] for q in peers)} skipped, the rest jumped; {min(share):.0%}-{max(share):.0%} of "
        f"wall time computing ({seeds(r, [p['seed']])}, commit {p['code']['commit'][:7]})"
    )


SPARSE_LAB = "sparse"  # wan_codecs' run of sparse beside topk, after the main table's


def head_wan_codecs() -> str:
    r = load("wan_codecs")
    row = {(x["codec"], x["arm"]): x for x in r.payload["results"]}
    shorter = {c: row[c, "blocking"]["seconds_per_round_times_less_than_none"] for c in ("int8", "topk")}
    blocking, overlap = row["none", "blocking"]["final_val_loss"], row["none", "overlap"]["final_val_loss"]
    text = (
        f"int8 rounds {shorter['int8']:.1f}x shorter than uncompressed, topk {shorter['topk']:.0f}x "
        f"({seeds(r, [r.payload['seed']])}); uncompressed, the withdrawn overlapped rounds ended at "
        f"{span(overlap, '.3f', 'peer')} in validation loss, blocking ones at {span(blocking, '.3f', 'peer')}"
    )
    extra = _optional("wan_codecs", SPARSE_LAB)
    if extra is None:
        return text
    later = []
    for x in extra.payload["results"]:
        shares = f"{x['compute_share_mean']:.0%} ({x['compute_share_min']:.0%}-{x['compute_share_max']:.0%})"
        ended = "bit-identical" if x["identical"] else "not identical"
        later.append(
            f"{x['codec']} {shares} of wall time computing, every peer in {x['rounds_with_everyone']} of "
            f"{x['rounds']} rounds, {ended} at the end"
        )
    return f"{text}; a later run ({seeds(extra, [extra.payload['seed']])}): {'; '.join(later)}"


def head_sync_overhead() -> str:
    r = load("sync_overhead")
    res = r.payload["results"]
    every = sorted({int(k.split("-")[0]) for k in res}, reverse=True)
    blocking = " / ".join(f"{res[f'{i}-blocking']['overhead_fraction']:.1%}" for i in every)
    text = f"{blocking} of wall time not computing at every {' / '.join(map(str, every))} steps ({seeds(r)})"
    if all(f"{i}-overlap" in res for i in every):
        pairs = [(res[f"{i}-overlap"], res[f"{i}-blocking"]) for i in every]
        shares = " / ".join(f"{o['overhead_fraction']:.1%}" for o, _ in pairs)
        ratios = " / ".join(f"{o['wall_s_per_step'] / b['wall_s_per_step']:.2f}x" for o, b in pairs)
        text += f"; the withdrawn overlapped rounds: {shares}, {ratios} the wall time per step"
    return text


def head_residency() -> str:
    r = load("residency")
    p = r.payload
    mem = {(m["config"], m["residency"]): m["total_bytes"] for m in p["memory"]}
    loss = {
        k: statistics.fmean(s["assembled_val_loss"] for s in p["swarm"] if s["residency"] == k)
        for k in ("full", "partial")
    }
    return (
        f"partial: {mem['spes-1b', 'partial'] / mem['spes-1b', 'full']:.2f}x memory at spes-1b, "
        f"{loss['partial'] / loss['full'] - 1:+.1%} validation loss with {p['args']['run_peers']} peers ({seeds(r)})"
    )


def head_convergence() -> str:
    main, lone = load("convergence"), load("convergence", "lone-holder")
    m, o = main.payload["summary"], lone.payload["summary"]
    spes = paired(m["spes"]["finals"], m["centralized"]["finals"])
    int8 = paired(o["spes-int8"]["finals"], o["spes"]["finals"])
    return (
        f"spes {statistics.fmean(spes):+.1%} vs centralized ({span(spes, '+.1%')}); int8 "
        f"{statistics.fmean(int8):+.1%} vs spes ({span(int8, '+.1%')}); {topk()[1]}; "
        f"{seeds(main, main.payload['seeds'])} each"
    )


def head_local_steps() -> str:
    r = load("local_steps")
    h1, dp = (r.payload["arms"][a] for a in ("h1-muon-moments", "dp-muon"))
    return (
        f"averaged after every step with every optimizer state: still {h1['gap']['mean']:+.1%} (Muon, "
        f"{seeds(r, h1['finals'])}); data parallel {dp['gap']['mean']:+.2%} ({seeds(r, dp['finals'])})"
    )


def head_grad_norms() -> str:
    r = load("grad_norms")
    last, whole = r.payload["spans"][-1], r.payload["batch"] * r.payload["peers"]
    return (
        f"{last['ratio']:.2f}x the norm past step {last['steps'][0]}, above the clip threshold at "
        f"{last['part_clipped']} of {last['count']} steps, the batch of {whole} at {last['whole_clipped']} "
        f"({seeds(r, [r.payload['seed']])})"
    )


def head_scale() -> str:
    r = load("scale")
    x = max(r.payload["results"], key=lambda row: row["peers"])
    killed = sum(f["kind"] == "kill" for f in x["fault_log"])
    return (
        f"{x['peers']} peers, {killed} killed: of {x['peer_rounds']} peer-rounds {x['peer_rounds_averaged']} "
        f"averaged, {x['peer_rounds_applied'] - x['peer_rounds_averaged']} adopted, "
        f"{x['peer_rounds'] - x['peer_rounds_applied']} neither; {x['mb_per_peer_round']:.2f} MB per peer per "
        f"round ({OLD_COUNTERS}; {seeds(r, [x['seed']])})"
    )


def head_simulate() -> str:
    r = load("simulate")
    res = r.payload["results"]
    peers, retries = max(x["peers"] for x in res), max(x["group_retries"] for x in res)
    at = [x for x in res if x["peers"] == peers and x["group_retries"] == retries]
    grid, flat = next(x for x in at if x["group_size"]), next(x for x in at if not x["group_size"])
    grid_runs, flat_runs = ([run["rounds_applied"] for run in x["runs"]] for x in (grid, flat))
    return (
        f"at {peers:,} peers with {retries} retries, the grid (groups of {grid['group_size']}) applies "
        f"{grid['rounds_applied']:.0%} of rounds ({span(grid_runs, '.0%')}), one flat group "
        f"{flat['rounds_applied']:.0%} ({span(flat_runs, '.0%')}); {seeds(r, r.payload['seeds'])}"
    )


def head_tokenize_throughput() -> str:
    r = load("tokenize_throughput")
    p, memory = r.payload, r.payload["memory"]
    return (
        f"{p['input_bytes'] / 2**20:,.0f} MiB of JSONL at {p['mb_per_s']:.2f} MiB/s ({p['tokens_per_s']:,.0f} "
        f"tokens/s) with {p['workers']} workers; the whole process tree peaked at "
        f"{memory['peak_rss_tree_mib']:,.0f} MiB resident, the target being under {p['target']['rss_limit_gib']} GiB "
        f"for {p['target']['input_gb']} GB ({seeds(r)})"
    )


def head_gpu_throughput() -> str:
    if any((results.root() / "gpu_throughput").glob("*.json")):
        raise RenderError("gpu_throughput has results now: give its line in benchmarks/render.py a headline")
    return "not measured: no GPU has been available"


# -- the optimizers' cost per step and loss per second (step_time, equal_time) ------------------------

OPTIMIZERS = {
    "adamw": "AdamW",
    "muon": "Muon, 5 Newton-Schulz steps, experts too",
    "muon-4": "Muon, 4 steps",
    "muon-3": "Muon, 3 steps",
    "muon-attn": "Muon on attention only, experts on AdamW",
}


def _ratio(arm: dict) -> str:
    r = arm.get("step_ratio_to_adamw")
    return "" if not r else f" ({r['median']:.2f}x; {span([r['min'], r['max']], '.2f', 'repeat')})"


def _loss(s: dict, at: str) -> str:
    gap = s[f"gap_{at}"]
    return f"{s[f'val_{at}']['mean']:.3f} ({gap['mean']:+.1%}; {span([gap['min'], gap['max']], '+.1%')})"


EQUAL_TIME_MORE = "cheaper-muon"  # equal_time's run of the arms main left out, each beside its own AdamW


def _optional(script: str, variant: str = "main") -> Result | None:
    try:
        return load(script, variant)
    except OSError:  # not run yet
        return None


def _more(extra: Result | None, added: dict) -> str:
    """Where the rows the main equal-time run left out come from."""
    if extra is None or not added:
        return ""
    names = ", ".join(OPTIMIZERS.get(a, a) for a in added)
    return f"; {names}: {seeds(extra, extra.payload['seeds'])}, against the AdamW of that run, {cite([extra], False)}"


def performance_table() -> str:
    """Per optimizer: seconds per step and MFU against the matmul rate measured in the same run, for one
    peer of the main job and a spes-1b-shaped stack; validation loss at equal tokens and at equal time."""
    st = load("step_time")
    et, extra = _optional("equal_time"), _optional("equal_time", EQUAL_TIME_MORE)
    tiny, stack = st.payload["shapes"]["tiny"], st.payload["shapes"]["spes-1b-stack"]
    summary, rate = et.payload["summary"] if et else {}, st.payload["matmul"]["median"]
    # arms the main run left out, each against the AdamW of its own run (same seeds and data)
    added = {a: v for a, v in (extra.payload["summary"] if extra else {}).items() if a not in summary}
    header = (
        f"| optimizer | s/step, tiny peer (x AdamW) | MFU | optimizer share | s/step, spes-1b stack (x AdamW) | MFU "
        f"| optimizer share at {stack['real_tokens_per_step']:,} tokens (projected) | val loss at equal tokens "
        f"({et.payload['steps'] if et else '-'} steps; vs AdamW) | steps at equal time | val loss at equal time "
        "(vs AdamW) |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    default = default_muon()[0]
    for arm, t in tiny["arms"].items():
        b, e = stack["arms"].get(arm), summary.get(arm) or added.get(arm)
        cells = [
            OPTIMIZERS.get(arm, arm) + (" (**the default**)" if arm == default else ""),
            f"{t['step_s']:.2f}{_ratio(t)}",
            f"{t['mfu']:.0%}",
            f"{t['parts_s']['optimizer'] / t['step_s']:.0%}",
            f"{b['step_s']:.1f}{_ratio(b)}" if b else "not run",
            f"{b['mfu']:.0%}" if b else "",
            f"{b['projected']['optimizer_share']:.1%}" if b else "",
            _loss(e, "equal_tokens") if e else "not run",
            span([e["steps_equal_time"]["min"], e["steps_equal_time"]["max"]], ".0f") if e else "",
            _loss(e, "equal_time") if e else "not run",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    t, s = tiny["config"], stack["config"]
    clock = (
        "CPU seconds of one thread (the process's CPU time, which a crowded machine's descheduling does not inflate)"
        if st.payload.get("clock") == "cpu"
        else "wall seconds"
    )
    note = (
        f"Seconds per step are {clock}, medians over {st.payload['steps']['tiny']['repeats']} interleaved repeats "
        f"(tiny) and {st.payload['steps']['spes-1b-stack']['repeats']} (stack), the ratios paired per repeat (min "
        f"to max); MFU is the model's matmul FLOP/s (6 x active parameters x tokens, plus attention) over the fp32 "
        f"rate of a {st.payload['matmul']['n']}-square matmul timed the same way in the same run ({rate / 1e9:.0f} "
        f"GFLOP/s, {st.payload['device_name']}, {st.payload['threads']} thread(s); {cite([st], False)}). Tiny peer: "
        f"one peer of the main job, {t['experts_trained']} of {t['experts']} experts, {tiny['tokens_per_step']:,} "
        f"tokens a step. Stack: {s['layers']} layers of spes-1b's shapes (d_model {s['d_model']}, "
        f"{s['experts_trained']} of {s['experts']} experts of FFN {s['ffn_dim']}, vocabulary {s['vocab_size']:,}), "
        f"{stack['tokens_per_step']:,} tokens a step; its last column puts the measured optimizer time against "
        "spes-1b's own batch."
    )
    if et is None:
        verdict = f"Losses not measured yet (benchmarks/equal_time.py). {note}"
    else:
        every = {**summary, **added}  # gaps, not losses, compare across the two runs
        best = min(every, key=lambda a: every[a]["gap_equal_time"]["mean"])
        wins = [a for a in every if a != "adamw" and every[a]["gap_equal_time"]["max"] <= 0]
        verdict = (
            f"{note} Losses: the tiny config as one peer alone (all experts), {seeds(et, et.payload['seeds'])} "
            "(mean; min to max of the per-seed gaps); at equal time an arm slower than AdamW runs the steps "
            f"AdamW's time buys it by the ratio measured interleaved in that run, with its schedule finished "
            f"({cite([et], False)}{_more(extra, added)}). Furthest below AdamW at equal time: "
            f"{OPTIMIZERS.get(best, best)} ({every[best]['gap_equal_time']['mean']:+.1%}); below AdamW at equal "
            "time on every seed: "
            f"{', '.join(OPTIMIZERS.get(a, a) for a in wins) or 'none'}."
        )
    wrapped = textwrap.fill(verdict, 100, break_on_hyphens=False, break_long_words=False)
    return "\n".join([*lines, "", wrapped])


def head_step_time() -> str:
    r = load("step_time")
    tiny = r.payload["shapes"]["tiny"]["arms"]
    arm = default_muon()[0]
    muon, adamw = tiny[arm], tiny["adamw"]
    return (
        f"one peer of the main job: the default Muon's ({arm}) step {muon['step_ratio_to_adamw']['median']:.2f}x "
        "AdamW's, "
        f"{muon['parts_s']['orthogonalize'] / muon['step_s']:.0%} of it Newton-Schulz; MFU {adamw['mfu']:.0%} "
        f"(AdamW) and {muon['mfu']:.0%} (Muon) of the fp32 matmul rate measured in the run ({seeds(r)})"
    )


def head_equal_time() -> str:
    r = load("equal_time")
    s = r.payload["summary"]
    parts = [
        f"{name} {s[name]['gap_equal_tokens']['mean']:+.1%} at equal tokens, {s[name]['gap_equal_time']['mean']:+.1%} "
        "at equal time"
        for name in s
        if name != "adamw"
    ]
    return f"vs AdamW: {'; '.join(parts)} ({seeds(r, r.payload['seeds'])})"


# -- README's lab table of peers behind NATs ------------------------------------------------------------

NAT_RUNS = ("nat-1-2", "nat-1-2-rtt100", "nat-1-3", "nat-1-3-rtt100")  # benchmarks/results/wan/


def _median_round(report: SwarmReport) -> float:
    return statistics.median(x.seconds for rows in report.rounds_after_join().values() for x in rows)


def nat_table() -> str:
    """Per lab run: the rounds after the joiners' catch-up that every peer averaged in, round seconds and
    bytes per round by role (medians over those rounds of the role's peers), and the end state; then
    each swarm's round time at 100 ms over its time at 0 ms."""
    lines = [
        "| swarm | round trip | rounds averaged by every peer | round s, public / NATed | MB per round sent / recv,"
        + " public | the same, NATed | steps computed / jumped / skipped, all peers | identical at the end |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    runs = {v: load("wan", v) for v in NAT_RUNS}
    reports = {v: SwarmReport.from_dict(r.payload) for v, r in runs.items()}
    for v, r in runs.items():
        report, after = reports[v], reports[v].rounds_after_join()
        n, links = len(report.peers), r.payload["network"]["peers"]
        rounds = sorted({x.round for rows in after.values() for x in rows})
        every = [
            k
            for k in rounds
            if all(any((x.round, x.members, x.outcome) == (k, n, "averaged") for x in rows) for rows in after.values())
        ]
        natted = sum(link["nat"] for link in links)
        cells = []
        for role in ("public", "private"):
            rows = [x for p in report.peers if p.role == role for x in after[p.peer]]
            if not rows:
                raise RenderError(f"{r.path}: no {role} peer's round after the join")
            sent = statistics.median(x.bytes_sent for x in rows) / 1e6
            received = statistics.median(x.bytes_received for x in rows) / 1e6
            cells.append((statistics.median(x.seconds for x in rows), f"{sent:.1f} / {received:.1f}"))
        lines.append(
            f"| {n - natted} public + {natted} NATed, replicas {r.payload['config']['swarm']['replicas']} "
            f"| {links[0]['rtt_ms']:.0f} ms | {len(every)} of {len(rounds)} | {cells[0][0]:.0f} / {cells[1][0]:.0f} "
            f"| {cells[0][1]} | {cells[1][1]} | {sum(p.steps_computed for p in report.peers)} / "
            f"{sum(p.steps_jumped for p in report.peers)} / {sum(p.steps_skipped for p in report.peers)} "
            f"| {'yes' if report.identical else 'no'} |"
        )
    ratios = [
        f"{_median_round(reports[v + '-rtt100']) / _median_round(reports[v]):.2f}x ({v[4:].replace('-', ' + ')})"
        for v in NAT_RUNS
        if v + "-rtt100" in reports
    ]
    return (
        "\n".join(lines)
        + "\n\n"
        + textwrap.fill(
            f"At 100 ms a round took {' and '.join(ratios)} as long as at 0 ms (median over every peer's rounds after "
            "the join). Tiny config, 20 Mbit/s each way for every peer, 150 steps, a round every 50, one seed each: "
            f"{cite(list(runs.values()), True)}.",
            100,
            break_on_hyphens=False,
            break_long_words=False,
        )
    )


def _gaps(gaps: list[float]) -> str:
    """Per-seed gaps as their mean, with their span and seed count (or 'one seed')."""
    if len(gaps) == 1:
        return f"{gaps[0]:+.2%} (one seed)"
    return f"{statistics.fmean(gaps):+.2%} ({span(gaps, '+.2%')}, {len(gaps)} seeds)"


def _codec_gap(row: dict | None, absent: str = "not run") -> str:
    """A row's gap to its baseline over seeds (its own seed count said); ``absent`` where it has none."""
    if row is None or row["gap"] is None:
        return absent
    return _gaps(list(row["gaps"].values()))


def codecs_table() -> str:
    """The codecs side by side: bits per value and bytes against the SPES reference at spes-1b (computed
    from the protocol), and each codec's validation loss against uncompressed averaging at the end of
    ``codec_rounds``' many rounds, per peer count."""
    r = load("codec_rounds")
    p = r.payload
    counts = sorted(p["summary"], key=int)
    projected = p["spes_1b"]["peers"]
    sizes = sorted(projected, key=int)
    lines = [
        f"| codec | bits per value | less than SPES at fp32, spes-1b, {' / '.join(sizes)} peers | "
        + " | ".join(f"loss vs uncompressed, {n} peers" for n in counts)
        + " |",
        "|---|---:|---:|" + "---:|" * len(counts),
    ]
    for arm in projected[sizes[0]]:
        cells = [_codec_gap(p["summary"][n].get(arm)) if arm != "none" else "-" for n in counts]
        lines.append(
            f"| {arm} | {projected[sizes[0]][arm]['bits_per_value']:.2f} | "
            + " / ".join(f"{projected[n][arm]['less']:.1f}x" for n in sizes)
            + " | "
            + " | ".join(cells)
            + " |"
        )
    rounds, params = p["steps"] // p["sync"], p["parameters"] / 1e6
    return (
        "\n".join(lines)
        + "\n\n"
        + textwrap.fill(
            f"Losses after {rounds} rounds of {p['sync']} steps: full replicas of a {params:.1f}M-parameter model "
            "averaged in one process through the swarm's codecs and error feedback (Muon, the same data and "
            f"validation tokens for every codec): {cite([r], True)}.",
            100,
            break_on_hyphens=False,
            break_long_words=False,
        )
    )


def swarm_codec() -> str:
    """topk-dense in the swarm itself (experts split, each expert's update sent to its frozen copies), one
    row per way of sending the experts (:data:`SWARM_MODES`): its bytes at spes-1b (``comms``' loopback
    swarms, projected) and its loss against uncompressed SPES averaging over the convergence benchmark's
    long runs at each peer count, per seed. A run stopped before its last seed shows the seeds it has."""
    lines = [
        "| topk-dense, experts' updates | less than SPES at fp32, spes-1b, 4 / 16 peers | "
        + " | ".join(f"loss vs uncompressed, {p} peers" for p in SWARM_PEERS)
        + " |",
        "|---|---:|" + "---:|" * len(SWARM_PEERS),
    ]
    convs: list[Result] = []
    wires: list[Result] = []
    lengths = set()
    for label, comms_variant, arm, runs in SWARM_MODES:
        wire = load("comms", comms_variant)
        settings = _swarm_mode_settings(load("convergence", next(v for v in runs if v)), arm)
        measured = {
            "swarm.expert_sync_rounds": wire.payload.get("expert_sync_rounds") or 1,
            "swarm.topk_result_fraction": wire.payload.get("topk_result_fraction"),
            "swarm.topk_lone_fraction": wire.payload.get("topk_lone_fraction"),
        }
        for key, value in measured.items():
            if settings[key] != value:
                raise RenderError(f"{wire.path} measured {key}={value}, the arm {arm} runs {settings[key]}")
        changed = [f"`{k}: {v:.10g}`" for k, v in settings.items() if v != SWARM_SETTINGS[k]]
        label += f" ({', '.join(changed)})" if changed else ""
        projected = wire.payload["projections"]["spes-1b"]["peers"]
        less = " / ".join(
            f"{projected[n]['codecs']['topk-dense']['times_less_than_spes_reference_fp32']:.1f}x"
            for n in sorted(projected, key=int)
        )
        cells = []
        for peers, variant in zip(SWARM_PEERS, runs):
            if variant is None:
                cells.append("not run")
                continue
            conv = load("convergence", variant)
            c = conv.payload
            if c["peers"] != peers or arm not in c["summary"]:
                raise RenderError(f"{conv.path}: no {arm} arm with {peers} peers")
            gaps = paired(c["summary"][arm]["finals"], c["summary"]["spes"]["finals"])
            if not c.get("complete", True):  # stopped: the seeds it has, and of how many
                count = f"seed {', '.join(map(str, c['seeds']))} of {len(conv.provenance['seeds'])}, stopped"
                cells.append(f"{statistics.fmean(gaps):+.2%} ({count})")
            elif len(gaps) == 1:
                cells.append(f"{gaps[0]:+.2%} (seed {c['seeds'][0]} only)")
            else:
                cells.append(f"{statistics.fmean(gaps):+.2%} ({span(gaps, '+.2%')}, {len(gaps)} seeds)")
            lengths.add(f"{c['steps'] // c['sync_steps']} rounds of {c['sync_steps']} steps")
            convs += [conv] if conv not in convs else []
        wires.append(wire)
        lines.append(f"| {label} | {less} | " + " | ".join(cells) + " |")
    if len(lengths) != 1:
        raise RenderError(f"the swarm modes' convergence runs are not equally long: {sorted(lengths)}")
    note = (
        f"One holder per expert; losses after {lengths.pop()} against uncompressed averaging (same seeds and "
        f"validation tokens); bytes projected from {SWARM_PEERS[0]} loopback peers: {cite(convs, True)}; "
        f"{cite(wires, True)}."
    )
    return "\n".join([*lines, "", textwrap.fill(note, 100, break_on_hyphens=False, break_long_words=False)])


def _swarm_mode_settings(conv: Result, arm: str) -> dict[str, float | None]:
    """How ``arm`` of a convergence result sends the experts' updates: each of :data:`SWARM_SETTINGS`
    (``swarm.key``: number), as its overrides set it or else its default."""
    pairs = (o.split("=", 1) for o in conv.payload["arms"][arm])
    return SWARM_SETTINGS | {k: float(v) for k, v in pairs if k in SWARM_SETTINGS}


def head_codec_rounds() -> str:
    r = load("codec_rounds")
    p = r.payload
    n = min(p["summary"], key=int)
    rounds = p["steps"] // p["sync"]
    parts = [f"{arm} {_codec_gap(row)}" for arm, row in p["summary"][n].items() if arm != "none"]
    return f"vs uncompressed after {rounds} rounds, {n} peers: " + "; ".join(parts)


def refresh_policies_table() -> str:
    """Each frozen-copy refresh policy: the share of copies it refreshed per round, its loss against
    refreshing every round, and each codec's bytes at spes-1b with that share (a projection)."""
    r = load("refresh_cadence")
    p = r.payload
    sizes = sorted(p["spes_1b"], key=int)
    codecs = list(p["spes_1b"][sizes[0]][next(iter(p["summary"]))])
    lines = [
        "| policy | copies refreshed per round | loss vs every round | "
        + " | ".join(f"{c}, less than SPES fp32 at {' / '.join(sizes)} peers" for c in codecs)
        + " |",
        "|---|---:|---:|" + "---:|" * len(codecs),
    ]
    for policy, row in p["summary"].items():
        bytes_at = [" / ".join(f"{p['spes_1b'][n][policy][c]['less']:.1f}x" for n in sizes) for c in codecs]
        lines.append(
            f"| {policy} | {row['refreshed_share']:.0%} | {_codec_gap(row, '-')} | " + " | ".join(bytes_at) + " |"
        )
    note = (
        f"Validation loss after {p['rounds']} rounds of {p['sync']} steps: {p['peers']} peers of the micro model "
        "in one process, each training its own experts, shared weights averaged uncompressed every round, "
        "copies set to their holder's weights when the policy says, the run's model scored as export assembles "
        "it, every policy on the same data and validation tokens. Bytes: each codec's round at spes-1b with "
        "that share of the copies' downloads, over the SPES reference at fp32, projected (the swarm runs every-K "
        f"as swarm.expert_sync_rounds): {cite([r], False)}."
    )
    return "\n".join([*lines, "", textwrap.fill(note, 100, break_on_hyphens=False, break_long_words=False)])


STALE_VARIANTS = ("p8-none", "p8-topk", "p8-topk-xemb", "p8-topk-xrest", "p8-struct")  # refresh_cadence's
STALE_COPIES = {"every": "exact, every round", "every-16": "exact, every 16 rounds"}


def stale_copies_table() -> str:
    """The copies' cadence under each way of averaging the shared weights, every run against the run
    with uncompressed shared weights and exact copies every round (same seed, data and validation)."""
    rs = [load("refresh_cadence", v) for v in STALE_VARIANTS]
    base = rs[0].payload["runs"]["every"]
    header = (
        "| shared weights | frozen copies | loss, mean of its seeds | vs uncompressed, exact copies every round, seed by seed "
        "| topk-dense / structured at spes-1b, 4 / 16 peers: less than SPES fp32 |"
    )
    lines = [header, "|---|---|---:|---:|---:|"]
    for r in rs:
        p = r.payload
        shared = p["shared"].replace("none", "uncompressed") + "".join(f", {k} uncompressed" for k in p["exact"])
        column = "structured" if p["shared"] == "structured" else "topk-dense"
        for policy, row in p["summary"].items():
            copies = STALE_COPIES.get(policy, f"top-k {policy.removeprefix('topk-')} of 256 every round")
            finals = {s: run["final"] for s, run in p["runs"][policy].items()}
            gaps = paired(finals, {s: b["final"] for s, b in base.items()})
            gap = "-" if r is rs[0] and policy == "every" else _gaps(gaps)
            cells = [p["spes_1b"][n][policy].get(column) for n in sorted(p["spes_1b"], key=int)]
            ratio = (
                "-"
                if p["shared"] == "none" or p["exact"] or None in cells
                else " / ".join(f"{c['less']:.1f}x" for c in cells)
            )
            lines.append(f"| {shared} | {copies} | {row['mean']:.4f} | {gap} | {ratio} |")
    p = rs[0].payload
    note = (
        f"Validation loss after {p['rounds']} rounds of {p['sync']} steps: {p['peers']} peers of the micro model "
        f"in one process trained with {p['optimizer']} as the convergence swarm is, each training its own "
        "expert; the shared weights averaged uncompressed, through the swarm's topk-dense codec with its error "
        "feedback (embeddings: the token embeddings and output head; rest: attention, norms, routers), or "
        "structured (the token embeddings by whole rows at 2 bits, 1/8 of them per member and 1/4 per result; "
        "the output head as rank one plus topk-dense; emulated here, not in the swarm); copies set to their "
        "holder's weights or moved by a top-k update of what their holder leads them by; the run's model "
        "scored as export assembles it, every run on the same data and validation tokens. Bytes: "
        f"the round at spes-1b with those copies, projected: {cite(rs, False)}."
    )
    return "\n".join([*lines, "", textwrap.fill(note, 100, break_on_hyphens=False, break_long_words=False)])


LONE_VARIANTS = ("p8-none-lone", "p8-r16-topk", "p8-r8-topk", "p8-r16-lone", "p8-r8-lone")  # refresh_cadence's
DENSE_RESULT = 16  # refresh_cadence.RESULT: topk-dense's values a block in a result where a file names none


def _lone_copies(policy: str) -> str:
    if policy == "every":
        return "exact, every round"
    kind, _, k = policy.partition("-")
    return f"top-k {k} of 256, the holder " + ("keeps its weights" if kind == "topk" else "takes it too")


def lone_copies_table() -> str:
    """Copies moved every round by a top-k update of their holder's lead, against exact copies under the
    same shared codec (same run) and against uncompressed shared weights with exact copies (the first
    variant's, run on the same machine)."""
    rs = [load("refresh_cadence", v) for v in LONE_VARIANTS]
    if len({r.platform for r in rs}) > 1:
        raise RenderError(f"lone copies: {', '.join(LONE_VARIANTS)} ran on different machines; run them on one")
    uncompressed = {s: run["final"] for s, run in rs[0].payload["runs"]["every"].items()}
    header = (
        "| shared weights | frozen copies, every round | loss, mean of its seeds | vs exact copies, same shared "
        "weights | vs uncompressed, exact copies | topk-dense at spes-1b, 4 / 16 peers: less than SPES fp32 |"
    )
    lines, shown = [header, "|---|---|---:|---:|---:|---:|"], {}
    for r in rs:
        p = r.payload
        result = p.get("result", DENSE_RESULT)
        shared = "uncompressed" if p["shared"] == "none" else f"topk-dense, {result} of 256 a result"
        exact = {s: run["final"] for s, run in p["runs"]["every"].items()}
        for policy, row in p["summary"].items():
            earlier = shown.setdefault(shared, exact)
            if policy == "every" and earlier is not exact and exact.items() <= earlier.items():
                continue  # exact copies under these shared weights with the same finals: a row already shown
            finals = {s: run["final"] for s, run in p["runs"][policy].items()}
            own = "-" if policy == "every" else _gaps(paired(finals, exact))
            vs = "-" if r is rs[0] and policy == "every" else _gaps(paired(finals, uncompressed))
            cells = [p["spes_1b"][n][policy]["topk-dense"] for n in sorted(p["spes_1b"], key=int)]
            ratio = (
                "-" if p["shared"] == "none" or policy == "every" else " / ".join(f"{c['less']:.1f}x" for c in cells)
            )
            lines.append(f"| {shared} | {_lone_copies(policy)} | {row['mean']:.4f} | {own} | {vs} | {ratio} |")
    p = rs[0].payload
    note = (
        f"Validation loss after {p['rounds']} rounds of {p['sync']} steps, {p['peers']} peers trained with "
        f"{p['optimizer']}, one expert each, as in the table above, all runs on one machine. Copies moved every "
        "round by a top-k update of what their holder's weights lead them by: the holder keeps training its own "
        "weights (the swarm's lone holder under a lossy codec) or takes the update too and keeps what it dropped "
        "in its error feedback (as a group's member takes the group's result). Exact copies are the "
        "simulation's reference, not a swarm mode: the swarm's round under topk-dense sends copies top-k at the "
        "result's share. Bytes: the round at spes-1b with those copies, projected: "
        f"{cite(rs, False)}."
    )
    return "\n".join([*lines, "", textwrap.fill(note, 100, break_on_hyphens=False, break_long_words=False)])


def head_refresh_cadence() -> str:
    p = load("refresh_cadence").payload
    parts = [
        f"{policy} (refreshes {row['refreshed_share']:.0%} of copies) {_codec_gap(row, '-')}"
        for policy, row in p["summary"].items()
        if row["gap"] is not None
    ]
    return f"vs refreshing every copy every round, {p['rounds']} rounds, {p['peers']} peers: " + "; ".join(parts)


def head_round_anchor() -> str:
    r = load("round_anchor")
    arms = r.payload["arms"]
    hive, ours = arms["hivemind"], arms["ours-none"]
    coded = [
        f"{arm[5:]} {row['seconds_vs_hivemind']:.2f}x its time, {row['hivemind_bytes_over_ours']:.1f}x fewer bytes"
        for arm, row in arms.items()
        if arm.startswith("ours-") and arm != "ours-none" and "hivemind_bytes_over_ours" in row
    ]
    if "seconds_vs_hivemind" not in ours or "over_limit" not in hive:
        raise RenderError(f"{r.path}: hivemind's and our fp32 arm need an averaged round each")
    return (
        f"at fp32 ours takes {ours['seconds_vs_hivemind']:.2f}x hivemind's time ({ours['over_limit']:.2f}x the link's "
        f"limit against {hive['over_limit']:.2f}x); {'; '.join(coded)}; peers bit-identical in {ours['identical']} of "
        f"{ours['rounds']} rounds (hivemind: {hive['identical']} of {hive['rounds']}); one run"
    )


# each line's headline: a README result's second text, else head_<script>()
TOPICS: dict[str, Callable[[], tuple[str, str]]] = {
    "memory": memory,
    "comms": comms,
    "quality": quality,
    "chaos": chaos,
}


def headline(script: str) -> str:
    return TOPICS[script]()[1] if script in TOPICS else globals()[f"head_{script}"]()


# script | what it measures | command | minutes | the result files its line links ("others": its folder too)
ROWS = """
memory | per-peer memory of weights, gradients and optimizer state, SPES peer vs centralized, tiny / 1B / 7B | .venv/bin/python -m benchmarks.memory | < 1 | main
comms | bytes per peer per round for every codec on a 4-peer loopback swarm, projected to 1B / 7B | .venv/bin/python -m benchmarks.comms | 5-6 | main topk-dense every4
wan | a swarm in network namespaces behind capped links, optionally with a CPU-capped peer (root) | sudo .venv/bin/python -m benchmarks.wan --peers 4 --mbit 20 --steps 150 --variant 4x20 | 3-5 | 4x20 others
wan_codecs | `wan` once per codec with blocking rounds, 4 peers at 20 Mbit/s (root) | sudo .venv/bin/python -m benchmarks.wan_codecs | 30 | main sparse others
round_anchor | our group round beside hivemind's DecentralizedAverager, same tensors, 4 peers at 20 Mbit/s, each round over its link's limit (root) | sudo .venv/bin/python -m benchmarks.round_anchor --codecs none int8 sparse --rounds 3 | 21 | main
sync_overhead | wall time not computing with blocking rounds, 2 loopback peers | .venv/bin/python -m benchmarks.sync_overhead | 3-4 | main
residency | partial vs full expert residency: memory, bytes, skipped tokens, loss | .venv/bin/python -m benchmarks.residency | 4 | main
convergence | validation loss at equal tokens, 3 seeds: centralized vs SPES, DiLoCo and each codec | .venv/bin/python -m benchmarks.convergence | 75 | main lone-holder topk-sync10 topk-dense-sync10 every4-150r others
quality | each swarm knob against centralized training at equal tokens, 3 seeds | .venv/bin/python -m benchmarks.quality | 3 per arm and seed | main
codec_rounds | each codec against uncompressed averaging over 150 rounds, full replicas in one process, 4 and 8 peers | OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.codec_rounds --sync 5 --eval-rounds 30 | 8-14 per arm and seed | main others
refresh_cadence | frozen expert copies refreshed every round, every K rounds or by their router's tokens: loss and the bytes it would save | OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.refresh_cadence | 8-14 per policy and seed | main others
local_steps | full replicas averaged every H steps in one process: where the gap comes from | .venv/bin/python -m benchmarks.local_steps | 3 per arm and seed | main others
grad_norms | gradient norm of a peer's batch of 8 vs the batch of 32, at the same weights | .venv/bin/python -m benchmarks.grad_norms | 3 | main
scale | 8 / 16 / 24 loopback peers with a kill, or 24 under churn | .venv/bin/python -m benchmarks.scale --peers 8 16 24 --steps 150 | 16 | main others
simulate | the round protocol at 100 and 1,000 peers, simulated with the project's own code | .venv/bin/python -m benchmarks.simulate | 3.5 | main
chaos | a loopback swarm under kills, freezes, restarts, bootstrap kills and full disks (root for disks) | sudo .venv/bin/python -m benchmarks.chaos --minutes 30 --interval 5 15 --disk-full | 33 | main
tokenize_throughput | `p2p-spes data tokenize` of a synthetic JSONL corpus cut from the embedded documents, 2 workers: speed and the resident memory of every process | .venv/bin/python -m benchmarks.tokenize_throughput | 6 | main
step_time | a step split into data, forward, backward, optimizer (Newton-Schulz within it) and logging per optimizer, and MFU against a matmul rate measured in the same run; tiny and a spes-1b-shaped stack | OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.step_time --clock cpu --steps 2 --repeats 3 --stack-steps 1 --stack-repeats 1 | 15 | main
equal_time | validation loss at equal tokens and at equal wall time per optimizer, tiny config, 3 seeds | OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.equal_time --arms adamw muon muon-attn --steps 60 | 40 | main
gpu_throughput | one peer's tokens/s, MFU and peak memory on a CUDA GPU, per MoE backend | .venv/bin/python -m benchmarks.gpu_throughput | 5 (GPU) |
"""


def scripts_table() -> str:
    lines = ["| script | what it measures | command | minutes | headline | result |", "|---|---|---|---:|---|---|"]
    for row in ROWS.strip().splitlines():
        script, what, command, minutes, files = (cell.strip() for cell in row.split("|"))
        cited = [load(script, v) for v in files.split() if v != "others"]
        cell = cite(cited, False) if cited else "none yet"
        cell += f", [others](results/{script}/)" if "others" in files.split() else ""
        lines.append(f"| `{script}` | {what} | `{command}` | {minutes} | {headline(script)} | {cell} |")
    return "\n".join(lines)


# -- the files and their markers -----------------------------------------------------------------------

TARGETS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {"numbers": numbers, "nat": nat_table, "codecs": codecs_table, "swarm_codec": swarm_codec},
    "benchmarks/README.md": {
        "scripts": scripts_table,
        "performance": performance_table,
        "muon_iterations": muon_iterations_table,
        "refresh_policies": refresh_policies_table,
        "stale_copies": stale_copies_table,
        "lone_copies": lone_copies_table,
    },
}


def render_text(text: str, regions: dict[str, Callable[[], str]], name: str) -> str:
    """``text`` with each region's body replaced by its rendering. A region's marker missing, duplicated,
    unknown, unclosed or malformed is a :class:`RenderError` naming the file ``name`` (and the line)."""
    out: list[str] = []
    seen: set[str] = set()
    inside: str | None = None
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        start, where = START.fullmatch(line.strip()), f"{name}, line {number}"
        if start:
            region = start.group(1)
            if inside or region in seen or region not in regions:
                why = f"inside {inside!r}" if inside else "twice" if region in seen else f"(known: {sorted(regions)})"
                raise RenderError(f"{where}: region {region!r} marked {why}")
            seen.add(region)
            inside = region
            out.append(line)
        elif line.strip() == END:
            if not inside:
                raise RenderError(f"{where}: {END} without an opening <!-- rendered: NAME -->")
            out += [regions[inside]().rstrip("\n") + "\n", line]
            inside = None
        elif "<!-- rendered" in line or "<!-- end rendered" in line:
            raise RenderError(f"{where}: a malformed marker: {line.strip()!r}")
        elif not inside:
            out.append(line)
    if inside:
        raise RenderError(f"{name}: region {inside!r} is never closed by {END}")
    for region in regions:
        if region not in seen:
            raise RenderError(f"{name}: no marker <!-- rendered: {region} --> (it should hold that region)")
    return "".join(out)


def render(repo: Path = results.REPO, write: bool = True) -> dict[str, str]:
    """Render every target file under ``repo``, write those that changed (``write``), and return a unified
    diff for each file that differed from its rendering."""
    diffs = {}
    for rel, regions in TARGETS.items():
        file = repo / rel
        old = file.read_text(encoding="utf-8")
        new = render_text(old, regions, rel)
        if new != old:
            lines = difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), f"{rel} (as written)", f"{rel} (rendered)"
            )
            diffs[rel] = "".join(lines)
            if write:
                file.write_text(new, encoding="utf-8")
    return diffs


def main(argv: list[str] | None = None, repo: Path = results.REPO) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff when a file differs")
    args = ap.parse_args(argv)
    try:
        diffs = render(repo, write=not args.check)
    except (RenderError, results.ResultError, KeyError, StopIteration, OSError) as exc:
        print(f"cannot render: {exc!r}", file=sys.stderr)
        return 2
    if args.check and diffs:
        print("".join(diffs.values()))
        print(f"{', '.join(diffs)}: not what the results render to; run python -m benchmarks.render", file=sys.stderr)
        return 1
    print("\n".join(f"rendered {rel}" for rel in diffs) or "nothing to change")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
