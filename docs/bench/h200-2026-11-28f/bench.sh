# bash .gpurun/bench.sh BUDGET_S "MODEL:SYSTEMS:TIMEOUT" ... : bench rows into $BENCH_DIR (default /tmp/bench, kept across calls), copied to $OUT
source .gpurun/env.sh
budget=$1; shift
dir=${BENCH_DIR:-/tmp/bench}; tag=$(basename "$dir")
mkdir -p "$dir"
for spec in "$@"; do
  IFS=: read -r models systems tmo <<< "$spec"
  left=$(( budget - SECONDS - 5 ))
  (( left < 60 )) && { echo "== [$tag] no time for $spec"; continue; }
  echo "== [$tag] $spec (left ${left}s)"
  python3 scripts/bench.py --out "$dir" --profile --memory --models "$models" --systems "$systems" \
     --timeout "$tmo" --deadline "$left" >> "$OUT/$tag.log" 2>&1
  grep -E "ms/step|FAILED|not started" "$OUT/$tag.log" | tail -4 | sed "s/^/[$tag] /"
done
cp -r "$dir" "$OUT/" 2>/dev/null
