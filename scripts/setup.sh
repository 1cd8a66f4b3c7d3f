#!/usr/bin/env bash
# Installs everything the build, demo and tests need on a fresh Debian machine.
# Idempotent: re-running skips what is already present.
set -euo pipefail

APT_PACKAGES=(bpftool iproute2 iputils-ping gobgpd bird2 frr tcpdump iperf3 netcat-openbsd ipset iptables nftables conntrack jq procps psmisc containernetworking-plugins
  # The container image (cargo xtask image, tests/tests/image_smoke.rs): static musl build, built
  # without a daemon, run with runc; skopeo pushes it to a registry.
  musl-tools ca-certificates buildah podman runc skopeo)
# kubectl checks the manifests offline; Debian's package is kubernetes-client, but any kubectl
# already installed (another vendor's package owns /usr/bin/kubectl then) will do.
command -v kubectl >/dev/null || APT_PACKAGES+=(kubernetes-client)
BPF_LINKER_VERSION=0.13.0

log() { printf '[setup] %s\n' "$*"; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# frr and bird install services that would grab port 179 on the host; tests run their own instances in netns.
for svc in frr bird gobgpd; do
  systemctl disable --now "$svc" >/dev/null 2>&1 || true
  pkill -x "$svc" >/dev/null 2>&1 || true
done

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
rustup component add rust-src --toolchain nightly >/dev/null
# The image's agent is a static binary.
rustup target list --installed | grep -qx x86_64-unknown-linux-musl || rustup target add x86_64-unknown-linux-musl

# bpf-linker links against the nightly toolchain's libLLVM; rustup puts that on the library path
# when rustc runs it, so check it the same way.
sysroot=$(rustc +nightly --print sysroot)
linker_version() { LD_LIBRARY_PATH="$sysroot/lib" bpf-linker --version 2>/dev/null; }
if ! linker_version | grep -q "$BPF_LINKER_VERSION"; then
  log "building bpf-linker $BPF_LINKER_VERSION against the nightly toolchain's LLVM"
  llvm_so=$(ls "$sysroot"/lib/libLLVM.so.*-rust-* | head -n1)
  prefix=$(mktemp -d)
  mkdir -p "$prefix/lib"
  ln -sf "$llvm_so" "$prefix/lib/libLLVM.so"
  LLVM_PREFIX="$prefix" cargo +nightly install bpf-linker --version "$BPF_LINKER_VERSION" \
    --no-default-features --features llvm-22 --locked 2>&1 | tail -n 3
fi

mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
log "ready: $(linker_version), $(bpftool version | head -n1)"
