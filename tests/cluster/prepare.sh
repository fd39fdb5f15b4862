#!/usr/bin/env bash
# Prepares the cluster tier's assets and writes their paths to target/cluster-tier/assets.env:
#   - Kubernetes (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet) and containerd
#     (containerd, containerd-shim-runc-v2, ctr), built with Go from the Go module proxy by
#     tests/cluster/go/build.sh into target/go (once per version: a second run builds nothing):
#     K8S_VERSION (default v1.36.3) is the release the tier runs; K8S_NEWEST (default v1.37.2;
#     empty for none) is built too, and the DRA scenarios run again on it. K8S_ASSETS=DIR takes
#     binaries from DIR instead (official release binaries: Kubernetes' server/bin/ and
#     containerd's bin/ unpacked into one directory), and builds nothing;
#   - KubeVirt's own virt-launcher code as a program, one per KubeVirt version checked
#     (tests/kubevirt-check/build.sh, into target/go);
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
K8S_VERSION=${K8S_VERSION:-v1.36.3}
K8S_VERSION=v${K8S_VERSION#v}
K8S_NEWEST=${K8S_NEWEST-v1.37.2}
[ -z "$K8S_NEWEST" ] || K8S_NEWEST=v${K8S_NEWEST#v}
CONTAINERD_VERSION=v2.4.2
go_out="$repo/target/go"
# Builds Kubernetes $1 (and containerd) and sets k8s_dir to a directory holding the seven
# binaries the tier runs.
build_k8s() {
    local v=$1 d="$repo/target/k8s/$1"
    tests/cluster/go/build.sh "$go_out" "kubernetes-$v" "containerd-$CONTAINERD_VERSION" ||
        skip "building Kubernetes $v and containerd $CONTAINERD_VERSION from the Go module proxy failed"
    mkdir -p "$d"
    for b in "${BINS[@]}"; do
        for m in "kubernetes-$v" "containerd-$CONTAINERD_VERSION"; do
            if [ -x "$go_out/$m/$b" ]; then ln -sfn "$go_out/$m/$b" "$d/$b"; fi
        done
    done
    k8s_dir=$d
}
newest_bin=""
if [ -n "${K8S_ASSETS:-}" ]; then
    bin="$(cd "$K8S_ASSETS" 2>/dev/null && pwd)" || skip "K8S_ASSETS=$K8S_ASSETS is not a directory"
    K8S_VERSION=$("$bin/kube-apiserver" --version 2>/dev/null | sed -n 's/^Kubernetes //p')
    K8S_NEWEST=""
else
    command -v go >/dev/null || skip "go not found: the tier builds Kubernetes and containerd with Go 1.26 (or set K8S_ASSETS)"
    build_k8s "$K8S_VERSION"
    bin=$k8s_dir
    if [ -n "$K8S_NEWEST" ] && [ "$K8S_NEWEST" != "$K8S_VERSION" ]; then
        build_k8s "$K8S_NEWEST"
        newest_bin=$k8s_dir
    else
        K8S_NEWEST=""
    fi
fi
for d in "$bin" $newest_bin; do
    for b in "${BINS[@]}"; do
        [ -x "$d/$b" ] || skip "$d/$b is missing"
    done
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

# KubeVirt's virt-launcher code, one program per version checked.
command -v go >/dev/null || skip "go not found: the KubeVirt checker is built with Go 1.26"
tests/kubevirt-check/build.sh "$go_out" || skip "building the KubeVirt checker from the Go module proxy failed"
checkers=$(ls "$go_out"/kubevirt-check-v* 2>/dev/null | tr '\n' ' ')
[ -n "$checkers" ] || skip "no KubeVirt checker in $go_out"

cat >"$out/assets.env.tmp" <<EOT
K8S_BIN=$bin
K8S_VERSION=$K8S_VERSION
K8S_NEWEST_BIN=$newest_bin
K8S_NEWEST_VERSION=$K8S_NEWEST
KUBEVIRT_CHECKERS=$checkers
HELM=$tools/helm
KUBECTL=$tools/kubectl
IMAGE=$image
IMAGE_REF=gpu-vm-node:$version
PAUSE_IMAGE=$pause
EOT
mv "$out/assets.env.tmp" "$out/assets.env"
echo "cluster tier: assets ready ($out/assets.env)"
