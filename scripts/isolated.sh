#!/usr/bin/env bash
# Runs a command in a private mount namespace with its own /run/netns, bpffs and /tmp, so that
# two test runs on one machine (two developers, two worktrees) never see each other's network
# namespaces, pinned maps, temp files or agent state (the default --state-dir, /var/lib/kube-router:
# its status socket and checkpoint). Network namespaces themselves are anonymous kernel
# objects; only their names live in /run/netns. As root:
#
#     scripts/isolated.sh cargo test -p kube-router-tests --test service_lb
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
mkdir -p /run/netns /var/lib/kube-router
# A checkout (or the command) under /tmp keeps the shared /tmp: a tmpfs over it would hide them.
# The suites' own /tmp names differ from suite to suite, so two of them still do not collide.
private_tmp=1
case "$PWD/ $1" in /tmp/*|*" /tmp/"*) private_tmp=0 ;; esac
exec unshare --mount --propagation private bash -c '
  mount -t tmpfs krt-netns /run/netns
  mount -t bpf bpf /sys/fs/bpf
  [ "$0" = 1 ] && mount -t tmpfs krt-tmp /tmp
  mount -t tmpfs krt-state /var/lib/kube-router
  exec "$@"' "$private_tmp" "$@"
