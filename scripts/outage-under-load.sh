#!/usr/bin/env bash
# The outage guarantee under CPU pressure: runs the API outage tests (api_outage's outages and
# dual_stack's IPv6 one) RUNS times in a row while a busy loop keeps every core loaded, and
# prints how many passed. Not part of CI (it takes RUNS x ~3 min). As root:
#
#     scripts/outage-under-load.sh [RUNS]      # default 10
set -euo pipefail
runs=${1:-10}
cd "$(dirname "$0")/.."
cargo build -p kube-router --bins >/dev/null 2>&1  # the agent the tests start
cargo test -p kube-router-tests --test api_outage --test dual_stack --no-run >/dev/null 2>&1
hogs=()
for _ in $(seq "$(nproc)"); do
  sh -c 'while :; do :; done' &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
passed=0 failed=0
run() {
  if scripts/isolated.sh cargo test -q -p kube-router-tests --test "$1" -- --test-threads=1 "$2" >"/tmp/outage-$1-$i.log" 2>&1; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "run $i: $1 $2 failed, see /tmp/outage-$1-$i.log"
  fi
}
for i in $(seq "$runs"); do
  run api_outage outage
  run dual_stack an_api_outage
done
echo "outage tests under load: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
