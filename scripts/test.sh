#!/usr/bin/env bash
# Installs the toolchain and packages if missing, then runs every check and test (as root).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec cargo xtask test
