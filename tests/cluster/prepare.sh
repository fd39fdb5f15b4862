#!/usr/bin/env bash
# Prepares the cluster tier's assets and writes their paths to target/cluster-tier/assets.env:
#   - the Kubernetes binaries: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
#     containerd, containerd-shim-runc-v2 and ctr, from K8S_ASSETS (a directory holding them, e.g.
#     official release binaries) or, by default, ../shared/k8s/bin/*.xz unpacked into target/k8s
#     (checked against ../shared/k8s/SHA256SUMS);
#   - etcd, runc and the CNI plugins from Debian's packages (tests/setup.sh installs them);
#   - helm and kubectl (tests/k8s-tools.sh);
#   - the project's image as shipped (tools/build-image.sh: the release build; IMAGE_BIN_DIR=DIR
#     takes the binaries built in DIR instead) and a pause image
#     for pod sandboxes (busybox, as an OCI archive: there is no registry to pull one from).
# Prints "skipped: ..." and exits 0 when an asset is missing, or exits 1 with CLUSTER_TIER=required.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
out="$repo/target/cluster-tier"
mkdir -p "$out"
rm -f "$out/assets.env"

skip() {
    if [ "${CLUSTER_TIER:-}" = required ]; then
        echo "cluster tier: CLUSTER_TIER=required but $*" >&2
        exit 1
    fi
    echo "skipped: cluster tier: $*"
    exit 0
}

BINS=(kube-apiserver kube-controller-manager kube-scheduler kubelet containerd containerd-shim-runc-v2 ctr)
if [ -n "${K8S_ASSETS:-}" ]; then
    bin="$(cd "$K8S_ASSETS" 2>/dev/null && pwd)" || skip "K8S_ASSETS=$K8S_ASSETS is not a directory"
else
    shared="$(cd "$repo/.." && pwd)/shared/k8s"
    [ -d "$shared/bin" ] || skip "no Kubernetes binaries: set K8S_ASSETS, or provide $shared/bin"
    bin="$repo/target/k8s"
    stamp="$(cat "$shared/SHA256SUMS")"
    if [ "$(cat "$bin/stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "cluster tier: unpacking $shared/bin into $bin" >&2
        rm -rf "$bin"
        mkdir -p "$bin"
        for f in "$shared"/bin/*.xz; do
            xz -dc "$f" >"$bin/$(basename "$f" .xz)"
        done
        (cd "$bin" && sha256sum -c --quiet "$shared/SHA256SUMS") || { rm -rf "$bin"; skip "unpacked binaries do not match $shared/SHA256SUMS"; }
        chmod +x "$bin"/*
        echo "$stamp" >"$bin/stamp"
    fi
fi
for b in "${BINS[@]}"; do
    [ -x "$bin/$b" ] || skip "$bin/$b is missing"
done
for t in etcd runc openssl ip; do
    command -v "$t" >/dev/null || skip "$t not found (tests/setup.sh installs it)"
done
for p in bridge host-local loopback; do
    [ -x "/usr/lib/cni/$p" ] || skip "/usr/lib/cni/$p not found (Debian: containernetworking-plugins)"
done
[ "$(id -u)" -eq 0 ] || skip "not root"
[ -e /dev/fuse ] || skip "no /dev/fuse (node-sim)"

tools="$(tests/k8s-tools.sh)"
# IMAGE_BIN_DIR: build the image from binaries already built there (target/debug, say: quicker
# while developing) instead of the release build.
if [ -n "${IMAGE_BIN_DIR:-}" ]; then
    BIN_DIR="$IMAGE_BIN_DIR" tools/build-image.sh --no-build
else
    tools/build-image.sh
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
image="$repo/target/image/gpu-vm-node-$version.oci.tar"

# The pod sandbox's image: a shell that waits until it is told to stop.
pause="$out/pause.oci.tar"
if [ ! -s "$pause" ] || [ /bin/busybox -nt "$pause" ]; then
    rootfs=$(mktemp -d)
    mkdir -p "$rootfs/bin"
    cp /bin/busybox "$rootfs/bin/busybox"
    tools/oci-archive.sh "$rootfs" "$pause" registry.k8s.io/pause:3.10 \
        '{"Cmd":["/bin/busybox","sh","-c","trap \"exit 0\" TERM INT; while :; do /bin/busybox sleep 3600 & wait; done"]}' >&2
    rm -rf "$rootfs"
fi

cat >"$out/assets.env.tmp" <<EOT
K8S_BIN=$bin
HELM=$tools/helm
KUBECTL=$tools/kubectl
IMAGE=$image
IMAGE_REF=gpu-vm-node:$version
PAUSE_IMAGE=$pause
EOT
mv "$out/assets.env.tmp" "$out/assets.env"
echo "cluster tier: assets ready ($out/assets.env)"
