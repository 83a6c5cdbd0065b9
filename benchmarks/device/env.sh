#!/usr/bin/env bash
# Run a command on the lent GPU machine as if blockloop were installed there: the wheels of the kit that
# benchmarks/device/kit.py packs (carried as .device-kit) go to /tmp/site (once per machine), blockloop is read
# from src/, its cache from the kit, and .venv/bin/python and .venv/bin/blockloop point at the machine's own
# Python, so the repository's commands run unchanged:
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
SITE=${SITE:-/tmp/site}
# Installed once per machine: a later command (owed.sh runs several) finds the same wheels already in $SITE.
if compgen -G "$KIT/wheels/*.whl" >/dev/null && [ "$(cat "$SITE/.kit-wheels" 2>/dev/null)" != "$(ls "$KIT/wheels")" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/wheels/*.whl
  ls "$KIT/wheels" > "$SITE/.kit-wheels"
fi
# SmolLM2's GGUF, carried in two halves by two calls (kit.py): joined into the kit's cache once both are here.
HALF_A=${KIT}-smollm2-a HALF_B=${KIT}-smollm2-b
if [ -f "$HALF_A/part" ] && [ -f "$HALF_B/part" ]; then
  PACKAGE="$KIT/cache/packages/$(cat "$HALF_A/package-name")"
  GGUF="$PACKAGE/$(cat "$HALF_A/path")"
  if [ ! -f "$GGUF" ]; then
    mkdir -p "$(dirname "$GGUF")"
    cat "$HALF_A/part" "$HALF_B/part" > "$GGUF.tmp"
    if [ "$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)" != "$(cat "$HALF_A/sha256")" ]; then
      rm -f "$GGUF.tmp"
      echo "benchmarks/device/env.sh: the halves of SmolLM2's GGUF do not join into the file kit.py cut; carry both again" >&2
      exit 2
    fi
    cp "$HALF_A"/package/index-*.json "$PACKAGE/"
    mv "$GGUF.tmp" "$GGUF"
  fi
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export BLOCKLOOP_CACHE="$PWD/$KIT/cache"
export PYTHONUNBUFFERED=1
if [ ! -e .venv ]; then
  mkdir -p .venv/bin
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$PYTHON")" > .venv/bin/python
  printf '#!/bin/sh\nexec "%s" -m blockloop.cli "$@"\n' "$(command -v "$PYTHON")" > .venv/bin/blockloop
  chmod +x .venv/bin/python .venv/bin/blockloop
fi
exec "$@"
