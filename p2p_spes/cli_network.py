"""The commands that serve or read a run's DHT without training: ``bootstrap``, ``inspect``, ``dashboard``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from dht.auth import load_auth
from dht.bootstrap import Bootstrap, BootstrapOptions
from dht.dashboard import DashboardServer, RunWatch
from dht.inspector import collect, open_dht, render, watch
from p2p_spes.checkpoint import write_json
from p2p_spes.cli_config import load_from_args
from p2p_spes.corpus import default_cache_dir
from p2p_spes.errors import ConfigError, SwarmError
from p2p_spes.wandb_log import RunViewLog, dashboard_target


def cmd_bootstrap(args: argparse.Namespace) -> int:
    config = load_from_args(args) if args.config else None
    if args.overrides and not args.config:
        raise ConfigError("--set applies to the published config: give --config FILE too")
    boot = Bootstrap(
        BootstrapOptions(
            identity_path=args.identity,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs or [],
            initial_peers=args.initial_peers or [],
            use_relay=not args.no_relay,
            use_auto_relay=args.use_auto_relay,
            reachability=args.reachability,
            run_id=args.run_id,
            config=config,
        )
    )
    maddrs = boot.start()
    try:
        print(f"bootstrap peer id: {boot.identity.peer_id} (identity file {args.identity})", flush=True)
        print(boot.reachability.summary(), flush=True)
        print("peers join with: --initial-peers " + " ".join(maddrs), flush=True)
        if config is not None:
            print(
                f"publishing the config of run {args.run_id!r} (hash {boot.published['hash'][:16]}, model "
                f"{boot.published['fingerprint']}): volunteers join with --config-from-swarm",
                flush=True,
            )
        if args.write_maddrs:
            write_json(Path(args.write_maddrs), {"peer_id": boot.identity.peer_id, "maddrs": maddrs})
        print("serving; Ctrl-C or SIGTERM stops it", flush=True)
        boot.serve()
    finally:
        boot.shutdown()
    print("bootstrap stopped", flush=True)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    auth = load_auth(args.secret_file, [])
    run_id = auth.keyspace(args.run_id)
    try:
        dht = open_dht(args.initial_peers, run_id, args.bootstrap_timeout, auth=auth)
    except SwarmError:
        raise
    except Exception as exc:
        raise SwarmError(f"could not reach the run through {' '.join(args.initial_peers)}: {exc}") from None
    console = Console(width=140)
    try:
        if args.watch:
            watch(dht, run_id, args.watch, console, args.json)
        elif args.json:
            print(json.dumps(collect(dht, run_id), indent=1))
        else:
            render(collect(dht, run_id), console)
    except KeyboardInterrupt:
        pass
    finally:
        dht.shutdown()
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    auth = load_auth(args.secret_file, [])
    wandb_log = RunViewLog(dashboard_target(args.wandb_project, args.run_id)) if args.wandb_project else None
    watch = RunWatch(
        args.initial_peers,
        auth.keyspace(args.run_id),
        auth=auth,
        interval=args.interval,
        startup_timeout=args.bootstrap_timeout,
        label=args.run_id,
        state_dir=args.state_dir or default_cache_dir() / "dashboard",
        wandb_log=wandb_log,
    )
    try:
        server = DashboardServer(watch, args.host, args.port)
    except OSError as exc:
        watch.stop()
        raise ConfigError(
            f"cannot serve on {args.host}:{args.port} ({exc}): choose another --port (0: any free one)"
        ) from None
    server.run(f"dashboard of run {args.run_id!r}")
    return 0
