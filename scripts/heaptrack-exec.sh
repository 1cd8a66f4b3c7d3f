#!/bin/sh
# Runs "$@" (the agent) under heaptrack's malloc hooks as the same process, for the test
# harness's KRT_AGENT_WRAPPER: `heaptrack CMD` forks, so the harness's pid, RSS and kill would
# be the script's. The agent must be built with `--features system-alloc` (DEVELOPERS.md).
# Output: $KRT_HEAPTRACK_DIR (default /tmp)/heaptrack.kube-router.PID.zst, one per start;
# read it with `heaptrack_print -f FILE` (or heaptrack --analyze).
set -e
lib=/usr/lib/heaptrack
dir=${KRT_HEAPTRACK_DIR:-/tmp}
fifo=$dir/heaptrack.fifo.$$
mkfifo "$fifo"
# The interpreter reads until the agent's end closes the pipe (a SIGKILL included).
"$lib/libexec/heaptrack_interpret" <"$fifo" | zstd -q -c >"$dir/heaptrack.kube-router.$$.zst" &
# Unlinked once both ends are open (the interpreter's open returns then).
(sleep 5; rm -f "$fifo") &
LD_PRELOAD="$lib/libheaptrack_preload.so${LD_PRELOAD:+:$LD_PRELOAD}" DUMP_HEAPTRACK_OUTPUT="$fifo" exec "$@"
