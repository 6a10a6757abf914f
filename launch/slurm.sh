#!/usr/bin/env bash
# One p2p-spes peer per node of a SLURM allocation, all joining one run.
#
#   sbatch --nodes=4 --gpus-per-node=8 launch/slurm.sh --initial-peers MADDR... [--run-id ID] [--config FILE]
#
# Each node runs one peer (srun, one task per node). A node with several GPUs runs the peer under
# torchrun (one process per GPU inside the node; only the peer's rank 0 talks to the swarm); a node
# with one GPU runs `p2p-spes train` directly. Without --config, the run's config is fetched from the
# DHT (--config-from-swarm). Every node keeps its identity in $RUN_ROOT/<node>/peer.key, so a
# requeued job comes back with the same peer ids. No node needs an index: each peer claims its own
# data partition, and with `experts.placement: spes` that partition's block of experts. Run launch/setup.sh once on the shared filesystem
# first (VENV points at it).
#
#SBATCH --job-name=p2p-spes
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=p2p-spes-%j.out
#SBATCH --requeue
set -euo pipefail
ROOT="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
VENV=${VENV:-$ROOT/.venv}
RUN_ROOT=${RUN_ROOT:-$ROOT/runs/slurm-${SLURM_JOB_ID:-local}}
PORT=${P2P_PORT:-31337}
HOST=${P2P_HOST:-0.0.0.0}  # the address peers listen on (an interface's IP to use only that one)

PEERS=()
RUN_ID=p2p-spes
CONFIG=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --initial-peers) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do PEERS+=("$1"); shift; done ;;
    --run-id) RUN_ID="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
if [ ${#PEERS[@]} -eq 0 ]; then
  echo "give the run's bootstrap: --initial-peers /ip4/HOST/tcp/PORT/p2p/PEER_ID (p2p-spes bootstrap prints it)" >&2
  exit 2
fi
[ -x "$VENV/bin/p2p-spes" ] || { echo "no p2p-spes in $VENV: run launch/setup.sh first (or set VENV)" >&2; exit 2; }
mkdir -p "$RUN_ROOT"

# What each node runs (exported to srun's tasks through the environment).
export P2P_BIN="$VENV/bin/p2p-spes" P2P_TORCHRUN="$VENV/bin/torchrun" RUN_ROOT PORT HOST RUN_ID CONFIG
export P2P_PEERS="${PEERS[*]}" P2P_EXTRA="${EXTRA[*]:-}"

srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c '
  set -euo pipefail
  node=$(hostname -s)
  dir="$RUN_ROOT/$node"; mkdir -p "$dir"
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
  ip=$(hostname -I 2>/dev/null | cut -d" " -f1)
  args=(train --no-progress --run-id "$RUN_ID" --initial-peers $P2P_PEERS --identity "$dir/peer.key"
        --run-dir "$dir/run" --host-maddrs "/ip4/$HOST/tcp/$PORT")
  [ -n "$ip" ] && args+=(--announce-maddrs "/ip4/$ip/tcp/$PORT")
  if [ -n "$CONFIG" ]; then args+=(--config "$CONFIG"); else args+=(--config-from-swarm); fi
  echo "[$node] $ngpu GPU(s); peer files in $dir"
  if [ "$ngpu" -gt 1 ]; then
    exec "$P2P_TORCHRUN" --standalone --nproc-per-node "$ngpu" -m p2p_spes "${args[@]}" $P2P_EXTRA
  else
    exec "$P2P_BIN" "${args[@]}" $P2P_EXTRA
  fi
'
