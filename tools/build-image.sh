#!/usr/bin/env bash
# Builds the container image without a container engine or a registry: the release binaries, the
# shared libraries they load, Debian's busybox-static (the shell and the few applets the
# DaemonSets' init containers and the GPU Operator's operand commands run) and the CA
# certificates, as one layer on an empty base, written as an OCI image archive.
#
#   tools/build-image.sh                  cargo build --release, then target/image/gpu-vm-node-<version>.oci.tar
#   tools/build-image.sh --no-build       the same from binaries already in target/release
#   tools/build-image.sh --rootfs DIR     only lay out the image's files in DIR (the Containerfile's
#                                         builder stage runs this, so both images hold the same files)
#   tools/build-image.sh --print-config   the image config (Env, Cmd, Labels) as JSON
#
# Load the archive with `ctr -n k8s.io images import FILE` (containerd), `podman load -i FILE` or
# `docker load -i FILE`; it is tagged gpu-vm-node:<version> (docker.io/library/gpu-vm-node:<version>
# to containerd), the Helm chart's default image. Needs: cargo, ldd, busybox-static, the
# ca-certificates bundle, and what tools/oci-archive.sh needs (tar, gzip, sha256sum). The archive
# is reproducible: the same binaries give the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

DAEMONS=(vfio-manager vgpu-device-manager sandbox-dp sandbox-dra)
# busybox applets the manifests, probes and the operator's operand commands call by name.
APPLETS=(sh sleep cat test true echo ls rm)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
bin_dir=${BIN_DIR:-${CARGO_TARGET_DIR:-$repo/target}/release}
out_dir=${IMAGE_DIR:-${CARGO_TARGET_DIR:-$repo/target}/image}
busybox=${BUSYBOX:-/bin/busybox}
ca_bundle=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

die() { echo "build-image.sh: $*" >&2; exit 1; }

# The image config: what the Containerfile's ENV, CMD and LABEL say too (tests/check-manifests.sh
# compares them).
config_json() {
    cat <<EOF
{"Env":["PATH=/usr/local/bin:/usr/bin:/bin","HOST_ROOT=/host"],"Cmd":["/usr/local/bin/operand"],"Labels":{"org.opencontainers.image.description":"Node-side GPU preparation for KubeVirt VMs: vfio-manager, vgpu-device-manager, sandbox-dp, sandbox-dra","org.opencontainers.image.licenses":"Apache-2.0","org.opencontainers.image.title":"gpu-vm-node","org.opencontainers.image.version":"$version"}}
EOF
}

# Copies a file's content (following links) to the same path under the root.
put() {
    local src=$1 dst=$2 mode=${3:-0755}
    [ -e "$src" ] || die "$src does not exist"
    install -D -m "$mode" "$src" "$root$dst"
}

# Asks the image's own loader whether each daemon finds every library it needs in the image: it
# looks first in the image's library directories only (no ld.so.cache), so a library the image
# lacks resolves to the build machine's, outside the root, and is named.
resolves_in_image() {
    local libs=$1 loader dirs d out outside
    loader=$(for d in "${DAEMONS[@]}"; do ldd "$bin_dir/$d"; done |
        sed -n 's/^\s*\(\/\S\+\) (.*/\1/p' | sort -u)
    [ "$(wc -w <<<"$loader")" -eq 1 ] || die "the daemons do not name one loader: ${loader:-none}"
    dirs=$(for l in $libs; do dirname "$root$l"; done | sort -u | paste -sd:)
    for d in "${DAEMONS[@]}"; do
        out=$("$root$loader" --inhibit-cache --library-path "$dirs" --list "$root/usr/local/bin/$d") ||
            die "$d: the image's loader $loader cannot load it: $out"
        outside=$(sed -n -e 's/^\s*\(\S\+\) => not found.*/\1 (not found)/p' \
            -e 's/^\s*\(\S\+\) => \(\S\+\) (0x.*/\1 \2/p' <<<"$out" | grep -vF " $root/" || true)
        [ -z "$outside" ] || die "$d needs libraries the image does not hold: $(paste -sd, <<<"$outside")"
    done
}

layout() {
    root=$1
    [ -d "$root" ] && [ -n "$(ls -A "$root")" ] && die "$root is not empty"
    mkdir -p "$root/usr/local/bin" "$root/bin" "$root/etc/ssl/certs" "$root/tmp"
    chmod 1777 "$root/tmp"
    for d in "${DAEMONS[@]}"; do
        [ -x "$bin_dir/$d" ] || die "$bin_dir/$d is not built (cargo build --release --bins)"
        put "$bin_dir/$d" "/usr/local/bin/$d"
    done
    # vfio-manager under NVIDIA's name: the GPU Operator's vfio-manager runs `vfio-manage bind --all`.
    ln -s vfio-manager "$root/usr/local/bin/vfio-manage"
    put image/operand /usr/local/bin/operand
    file -L "$busybox" 2>/dev/null | grep -q 'statically linked' ||
        ldd "$busybox" 2>&1 | grep -q 'not a dynamic executable' ||
        die "$busybox is not statically linked (Debian: busybox-static)"
    put "$busybox" /usr/local/bin/busybox
    for a in "${APPLETS[@]}"; do ln -s busybox "$root/usr/local/bin/$a"; done
    ln -s /usr/local/bin/busybox "$root/bin/sh"
    # The shared libraries the daemons load, at the paths the loader looks them up by.
    local libs
    libs=$(for d in "${DAEMONS[@]}"; do ldd "$bin_dir/$d"; done |
        sed -n -e 's/^\s*\S\+ => \(\/\S\+\) .*/\1/p' -e 's/^\s*\(\/\S\+\) (.*/\1/p' | sort -u)
    for l in $libs; do put "$l" "$l" 0755; done
    resolves_in_image "$libs"
    put "$ca_bundle" /etc/ssl/certs/ca-certificates.crt 0644
    printf 'root:x:0:0:root:/:/bin/sh\n' >"$root/etc/passwd"
    printf 'root:x:0:\n' >"$root/etc/group"
    chmod 0644 "$root/etc/passwd" "$root/etc/group"
}

archive() {
    local work=$out_dir/work
    rm -rf "$work"
    mkdir -p "$work"
    layout "$work/rootfs"
    tools/oci-archive.sh "$work/rootfs" "$out_dir/gpu-vm-node-$version.oci.tar" "gpu-vm-node:$version" "$(config_json)"
    rm -rf "$work"
}

case "${1:-}" in
--print-config) config_json ;;
--rootfs)
    [ -n "${2:-}" ] || die "--rootfs needs a directory"
    layout "$2"
    ;;
--no-build) archive ;;
"")
    cargo build --release --bins $(printf -- '-p %s ' "${DAEMONS[@]}")
    archive
    ;;
*) die "unknown argument $1 (see the header of $0)" ;;
esac
