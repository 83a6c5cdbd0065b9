#!/usr/bin/env bash
# Run a command on the lent GPU machine as if blockloop were installed there: the wheels of the kit that
# benchmarks/device/kit.py packs (carried as .device-kit) go to /tmp/site, blockloop is read from src/, its
# cache from the kit, and .venv/bin/python and .venv/bin/blockloop point at the machine's own Python, so the
# repository's commands run unchanged:
#   bash benchmarks/device/env.sh .venv/bin/python benchmarks/gpu_suite.py --out-dir "$OUT"
#   bash benchmarks/device/env.sh .venv/bin/python -m pytest -m gpu -q
# An existing .venv (a machine where blockloop is installed the usual way) is left as it is.
set -euo pipefail
KIT=${KIT:-.device-kit}
PYTHON=${PYTHON:-python3}
if [ ! -d "$KIT/cache" ]; then
  echo "benchmarks/device/env.sh: no $KIT/cache here; pack it with benchmarks/device/kit.py and carry $KIT" >&2
  exit 2
fi
if compgen -G "$KIT/wheels/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KIT"/wheels/*.whl
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export BLOCKLOOP_CACHE="$PWD/$KIT/cache"
export PYTHONUNBUFFERED=1
if [ ! -e .venv ]; then
  mkdir -p .venv/bin
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$PYTHON")" > .venv/bin/python
  printf '#!/bin/sh\nexec "%s" -m blockloop.cli "$@"\n' "$(command -v "$PYTHON")" > .venv/bin/blockloop
  chmod +x .venv/bin/python .venv/bin/blockloop
fi
exec "$@"
