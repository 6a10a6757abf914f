"""The ``p2p-spes`` command line: the parser (``cli_parser.py``) picks a command, ``main`` runs it.

The commands live by what they do: ``cli_config.py`` (the config a command runs with; ``config``,
``fetch-config``), ``cli_train.py`` (``train``, ``swarm``, ``volunteer``), ``cli_network.py`` (``bootstrap``,
``inspect``, ``dashboard``) and ``cli_files.py`` (``data``, ``plot``, ``export``, ``eval``, ``upcycle``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from p2p_spes.cli_config import cmd_config, cmd_fetch_config
from p2p_spes.cli_files import cmd_eval, cmd_export, cmd_plot, cmd_prepare, cmd_tokenize, cmd_upcycle
from p2p_spes.cli_network import cmd_bootstrap, cmd_dashboard, cmd_inspect
from p2p_spes.cli_parser import build_parser
from p2p_spes.cli_train import cmd_swarm, cmd_train, cmd_volunteer
from p2p_spes.errors import BackendError, CheckpointError, ConfigError, DataError, ResidencyError, SwarmError

USER_ERRORS = (ConfigError, DataError, CheckpointError, BackendError, SwarmError, ResidencyError)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": cmd_train,
    "swarm": cmd_swarm,
    "inspect": cmd_inspect,
    "dashboard": cmd_dashboard,
    "plot": cmd_plot,
    "bootstrap": cmd_bootstrap,
    "fetch_config": cmd_fetch_config,
    "volunteer": cmd_volunteer,
    "tokenize": cmd_tokenize,
    "prepare": cmd_prepare,
    "config": cmd_config,
    "export": cmd_export,
    "eval": cmd_eval,
    "upcycle": cmd_upcycle,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
