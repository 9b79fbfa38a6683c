#!/usr/bin/env bash
# usage: tier.sh NAME SECONDS FILES...   (GPU tier over FILES, log under $OUT/NAME.txt)
name=$1; secs=$2; shift 2
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpurun/whl/*.whl || true
# this call's tree (the project as part b installed it may be an older one)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 3
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
python3 -c "import xdist" 2>/dev/null || echo "no xdist"
set -o pipefail
timeout "$secs" python3 -m pytest -m gpu -n 4 -v -rfE -p no:cacheprovider --durations=15 "$@" 2>&1 | tee "$OUT/$name.txt" | tail -60
