# sourced by the run scripts: the deps part b installed, xdist, the kernel cache
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpurun/whl/*.whl 2>/dev/null || true
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
t() { # t NAME SECONDS WORKERS pytest-args...: one GPU-tier run, its log under $OUT/NAME.txt
  local name=$1 secs=$2 n=$3; shift 3
  timeout "$secs" python3 -m pytest -m gpu -n "$n" -v -rfE -p no:cacheprovider --durations=10 "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name rc=$?"; grep -E "passed|failed|error" "$OUT/$name.txt" | tail -2
}
