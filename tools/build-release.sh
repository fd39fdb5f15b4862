#!/usr/bin/env bash
# Builds the binaries as they ship: the release profile with glibc linked in (a static PIE), so
# that they need no shared library at run time, run on any glibc-based or other Linux of the same
# architecture, and start without the dynamic loader's work; ASLR is kept (position-independent).
#
#   tools/build-release.sh -p vfio-manager -p vgpu-device-manager -p sandbox-dp -p sandbox-dra
#   tools/build-release.sh --workspace --bins        # also node-sim and gpu-vm-bench
#
# Arguments go to `cargo build`. The binaries land in target/<host triple>/release/ (the explicit
# --target keeps build scripts and proc macros, which run inside the compiler, dynamically
# linked), and target/shipped links to that directory.
#
# Host names are resolved by glibc's built-in `files` and `dns` sources (/etc/hosts,
# /etc/resolv.conf). Other NSS modules a host's /etc/nsswitch.conf may name (`resolve`, `mdns`,
# `sss`) would be loaded from the host, which glibc supports only for the glibc version linked
# in. In a cluster the API server is reached by the address in KUBERNETES_SERVICE_HOST; only a
# kubeconfig naming its server by host name is resolved at all.
set -euo pipefail
cd "$(dirname "$0")/.."
triple=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --release --locked --target "$triple" "$@"
target_dir=${CARGO_TARGET_DIR:-target}
ln -sfn "$triple/release" "$target_dir/shipped"
echo "built into $target_dir/shipped/ ($target_dir/$triple/release)"
