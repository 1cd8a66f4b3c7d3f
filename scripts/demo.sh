#!/usr/bin/env bash
# Installs the toolchain and packages if missing, then runs the demo (as root).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec cargo xtask demo
