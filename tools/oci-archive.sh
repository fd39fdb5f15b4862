#!/usr/bin/env bash
# Writes a directory as a one-layer OCI image archive (an OCI image layout in a tar file), without
# a container engine: what `ctr images import`, `podman load` and `docker load` take.
#
#   tools/oci-archive.sh ROOTFS OUT.tar NAME:TAG CONFIG_JSON
#
# CONFIG_JSON is the image config's `config` object (Env, Cmd, Labels, ...). NAME:TAG becomes the
# `io.containerd.image.name` annotation (a bare name is docker.io/library/NAME, as containerd
# normalises image references) and TAG the `org.opencontainers.image.ref.name`. Reproducible:
# file times 0, owner root, names sorted, gzip without a time stamp.
set -euo pipefail
[ $# -eq 4 ] || { sed -n '2,10p' "$0" >&2; exit 2; }
rootfs=$1 out=$2 ref=$3 config=$4
[ -d "$rootfs" ] || { echo "oci-archive.sh: $rootfs is not a directory" >&2; exit 1; }
name=${ref%:*} tag=${ref##*:}
case $name in
*/*/*) full=$name ;;
*.*/* | *:*/* | localhost/*) full=$name ;;
*/*) full=docker.io/$name ;;
*) full=docker.io/library/$name ;;
esac
case $(uname -m) in
x86_64) arch=amd64 ;;
aarch64) arch=arm64 ;;
*) arch=$(uname -m) ;;
esac

work=$(mktemp -d "${TMPDIR:-/tmp}/oci-archive.XXXXXX")
trap 'rm -rf "$work"' EXIT
blobs=$work/oci/blobs/sha256
mkdir -p "$blobs"
sha() { sha256sum "$1" | cut -d' ' -f1; }
# Moves a file into the blobs; prints "digest size".
blob() {
    local d s
    d=$(sha "$1")
    s=$(stat -c %s "$1")
    mv "$1" "$blobs/$d"
    echo "$d $s"
}

tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$rootfs" -cf "$work/layer.tar" .
diff_id=$(sha "$work/layer.tar")
gzip -n -6 -c "$work/layer.tar" >"$work/layer.tar.gz"
rm "$work/layer.tar"
read -r layer layer_size < <(blob "$work/layer.tar.gz")
printf '{"architecture":"%s","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created_by":"tools/oci-archive.sh"}]}' \
    "$arch" "$config" "$diff_id" >"$work/config.json"
read -r cfg cfg_size < <(blob "$work/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
    "$cfg" "$cfg_size" "$layer" "$layer_size" >"$work/manifest.json"
read -r manifest manifest_size < <(blob "$work/manifest.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s:%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest" "$manifest_size" "$arch" "$full" "$tag" "$tag" >"$work/oci/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$work/oci/oci-layout"
mkdir -p "$(dirname "$out")"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/oci" -cf "$out.tmp" .
mv "$out.tmp" "$out"
echo "oci-archive.sh: $out ($full:$tag, $(du -h "$out" | cut -f1), layer sha256:$diff_id)"
