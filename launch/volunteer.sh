#!/usr/bin/env bash
# Donate a GPU (or a CPU) to a p2p-spes run. All you need is one multiaddr of the run.
#
#   launch/volunteer.sh --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm... [--run-id ID] [options] [-- train args]
#
# It checks this machine, installs p2p-spes in a virtualenv (launch/setup.sh), fetches the run's
# config from the DHT (signature and hash checked), picks the batch size that fits the device's free
# memory, joins and trains. A crashed peer is restarted with exponential backoff (bounded); Ctrl-C
# or SIGTERM makes the peer checkpoint and leave the run cleanly.
#
# Options:
#   --initial-peers MADDR...  multiaddrs of the run's bootstrap or any live peer (required)
#   --run-id ID               the run (default: p2p-spes)
#   --config-hash HEX         accept only the run config with this hash (as the run's organisers publish it)
#   --device DEV              auto (default), cpu, cuda, cuda:N
#   --dir DIR                 where the config, identity and logs go (default: volunteer)
#   --max-restarts N          restarts after crashes before giving up (default: 5)
#   --no-install              use $PYTHON (default python3) as it is; also P2P_SPES_NO_INSTALL=1
#   -- ARGS                   passed to `p2p-spes train` (e.g. --host-maddrs, --announce-maddrs)
# Environment: PYTHON, VENV (default .venv), TORCH_INDEX_URL (see launch/setup.sh).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

say() { echo "[volunteer $(date +%H:%M:%S)] $*"; }
die() { say "error: $*" >&2; exit 2; }

PEERS=()
RUN_ID=p2p-spes
CONFIG_HASH=""
DEVICE=auto
DIR=volunteer
MAX_RESTARTS=5
INSTALL=1
[ "${P2P_SPES_NO_INSTALL:-0}" = 1 ] && INSTALL=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --initial-peers) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do PEERS+=("$1"); shift; done ;;
    --run-id) RUN_ID="${2:?--run-id needs a value}"; shift 2 ;;
    --config-hash) CONFIG_HASH="${2:?--config-hash needs a value}"; shift 2 ;;
    --device) DEVICE="${2:?--device needs a value}"; shift 2 ;;
    --dir) DIR="${2:?--dir needs a value}"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="${2:?--max-restarts needs a value}"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ ${#PEERS[@]} -gt 0 ] || die "give the run's address: --initial-peers /ip4/HOST/tcp/PORT/p2p/PEER_ID (ask the run's organisers)"
case "$MAX_RESTARTS" in ''|*[!0-9]*) die "--max-restarts takes a whole number, got $MAX_RESTARTS" ;; esac
mkdir -p "$DIR" || die "cannot create $DIR"
DIR="$(cd "$DIR" && pwd)"

# 1. the machine -------------------------------------------------------------------------------
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
  || die "p2p-spes needs Python >= 3.10; found: $("$PYTHON" --version 2>&1 || echo none). Set PYTHON=/path/to/python3.x"
say "Python: $("$PYTHON" --version 2>&1)"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  while IFS=, read -r name total free; do
    say "GPU:$name, $free free of$total"
  done < <(nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader)
else
  say "warning: no NVIDIA GPU found; training on the CPU. That works but is slow: fine to try the run out."
  [ "$DEVICE" = auto ] && DEVICE=cpu
fi

# 2. the software ------------------------------------------------------------------------------
if [ "$INSTALL" = 1 ]; then
  say "installing p2p-spes into ${VENV:-.venv} (reused if it is already there)"
  EXTRAS=${VOLUNTEER_EXTRAS:-dev} PYTHON="$PYTHON" bash "$ROOT/launch/setup.sh" || die "installation failed (see above)"
  PY="$ROOT/${VENV:-.venv}/bin/python"
else
  say "skipping installation; using $PYTHON"
  PY="$PYTHON"
fi
P2P=("$PY" -m p2p_spes)

# 3. the run's config and a batch size that fits -------------------------------------------------
say "fetching the config of run '$RUN_ID' through ${PEERS[0]}"
FETCH=("${P2P[@]}" fetch-config --initial-peers "${PEERS[@]}" --run-id "$RUN_ID" --fit-batch --device "$DEVICE"
       --out "$DIR/run-config.yaml")
[ -n "$CONFIG_HASH" ] && FETCH+=(--config-hash "$CONFIG_HASH")
"${FETCH[@]}" || die "could not get the run's config (see above)"

# 4. train, restart after crashes, leave cleanly on Ctrl-C ---------------------------------------
stopping=0
child=""
on_signal() {
  stopping=1
  if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
    say "stopping: the peer saves a checkpoint and tells the others it is leaving"
    kill -TERM "$child" 2>/dev/null
  fi
}
trap on_signal INT TERM

# the peer gets its own session, so a Ctrl-C reaches it once, through us
SETSID=()
command -v setsid >/dev/null 2>&1 && SETSID=(setsid)
attempt=0
delay=5
while :; do
  say "joining the run and training (log: $DIR/peer.log)"
  started=$(date +%s)
  "${SETSID[@]}" "${P2P[@]}" train --no-progress --config "$DIR/run-config.yaml" --run-id "$RUN_ID" \
    --initial-peers "${PEERS[@]}" --identity "$DIR/peer.key" --run-dir "$DIR/run" "${EXTRA[@]}" \
    >>"$DIR/peer.log" 2>&1 &
  child=$!
  echo "$child" >"$DIR/peer.pid"
  while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupted wait: keep waiting for the peer
  done
  child=""
  rm -f "$DIR/peer.pid"
  if [ "$stopping" = 1 ]; then
    say "left the run (peer exit code $rc); checkpoints and metrics are in $DIR/run"
    exit 0
  fi
  if [ "$rc" = 0 ]; then
    say "the run reached its step budget: done. Thank you! Results are in $DIR/run"
    exit 0
  fi
  if [ "$rc" = 2 ]; then
    tail -n 5 "$DIR/peer.log" >&2
    die "the peer refused to start (exit code 2; the reason is above): restarting would not help"
  fi
  [ $(( $(date +%s) - started )) -gt 600 ] && { attempt=0; delay=5; }  # it had been running fine
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$MAX_RESTARTS" ]; then
    tail -n 20 "$DIR/peer.log" >&2
    die "the peer crashed $MAX_RESTARTS times in a row (last exit code $rc); giving up. The log is $DIR/peer.log"
  fi
  say "the peer stopped with exit code $rc; restarting in ${delay}s (attempt $attempt of $MAX_RESTARTS)"
  sleep "$delay" &
  wait $! 2>/dev/null
  [ "$stopping" = 1 ] && { say "stopped before restarting"; exit 0; }
  delay=$(( delay * 2 > 300 ? 300 : delay * 2 ))
done
