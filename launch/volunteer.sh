#!/usr/bin/env bash
# Donate a GPU (or a CPU) to a p2p-spes run. All you need is one multiaddr of the run.
#
#   launch/volunteer.sh --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm... [--run-id ID] [options] [-- train args]
#
# Installs p2p-spes into a virtualenv (launch/setup.sh; with the `gpu` extra when an NVIDIA GPU is
# present), then runs `p2p-spes volunteer` with the same arguments: it checks this machine, fetches the
# run's config (signature and hash checked), picks the batch size that fits, joins and trains, restarts
# a crashed peer from its checkpoint with back-off, and leaves cleanly on Ctrl-C or SIGTERM.
#
# Options of this script (every other argument goes to `p2p-spes volunteer`; see its --help):
#   --no-install   use $PYTHON (default python3) as it is; also P2P_SPES_NO_INSTALL=1
# Environment: PYTHON, VENV (default .venv), VOLUNTEER_EXTRAS (default: gpu with a GPU, none without),
# TORCH_INDEX_URL (see launch/setup.sh).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

say() { echo "[volunteer $(date +%H:%M:%S)] $*"; }
die() { say "error: $*" >&2; exit 2; }

INSTALL=1
[ "${P2P_SPES_NO_INSTALL:-0}" = 1 ] && INSTALL=0
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --no-install) INSTALL=0 ;;
    *) ARGS+=("$arg") ;;
  esac
done

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
  || die "p2p-spes needs Python >= 3.10; found: $("$PYTHON" --version 2>&1 || echo none). Set PYTHON=/path/to/python3.x"

if [ "$INSTALL" = 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRAS=${VOLUNTEER_EXTRAS-gpu}
  else
    EXTRAS=${VOLUNTEER_EXTRAS-}
  fi
  say "installing p2p-spes${EXTRAS:+[$EXTRAS]} into ${VENV:-.venv} (reused if it is already there)"
  EXTRAS="$EXTRAS" PYTHON="$PYTHON" bash "$ROOT/launch/setup.sh" || die "installation failed (see above)"
  PY="$ROOT/${VENV:-.venv}/bin/python"
else
  PY="$PYTHON"
fi
exec "$PY" -m p2p_spes volunteer "${ARGS[@]}"
