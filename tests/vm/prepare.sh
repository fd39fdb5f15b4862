#!/usr/bin/env bash
# Builds the VM tier's kernel assets into a cache directory (default: target/vm-assets):
#   - the kernel image that linux-image-amd64 depends on (apt-get download + dpkg -x, not installed);
#   - the kernel's sample mdev drivers mtty, mbochs, mdpy, built out of tree against the
#     matching linux-headers from linux-source;
#   - a busybox initramfs holding tests/vm/guest/init and the modules it loads, in dependency order.
# Idempotent: a second run with nothing changed finishes in about a second.
# Output: CACHE_DIR/vmlinuz, CACHE_DIR/initramfs.cpio.gz, CACHE_DIR/assets.env.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${1:-${VM_ASSETS:-$repo/target/vm-assets}}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"

log() { echo "vm-tier prepare: $*" >&2; }
die() { echo "vm-tier prepare: error: $*" >&2; exit 1; }

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

installed() { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | grep -qx "install ok installed ${2:-.*}"; }

apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then
        $sudo apt-get update -qq
        apt_updated=1
    fi
    log "installing $*"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Tools of the tier itself; strace and jq are run by the scenarios (from the host root).
missing=()
for p in qemu-system-x86 busybox-static cpio make gcc strace jq; do
    installed "$p" || missing+=("$p")
done
((${#missing[@]} == 0)) || apt_install "${missing[@]}"

# The kernel: whatever linux-image-amd64 depends on, at its candidate version.
image_pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
if [ -z "$image_pkg" ]; then
    $sudo apt-get update -qq
    apt_updated=1
    image_pkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
fi
[ -n "$image_pkg" ] || die "cannot tell which kernel linux-image-amd64 depends on"
release="${image_pkg#linux-image-}"
version="$(apt-cache policy "$image_pkg" | awk '/Candidate:/ {print $2}')"
[ -n "$version" ] && [ "$version" != "(none)" ] || die "no candidate version for $image_pkg"
series="$(echo "$release" | sed -E 's/^([0-9]+\.[0-9]+).*/\1/')"

# The stamp names every input; a match means the cache is complete and current.
stamp_text="$(printf 'release=%s\nversion=%s\nprepare=%s\ninit=%s\n' "$release" "$version" \
    "$(sha256sum "$here/prepare.sh" | cut -d' ' -f1)" "$(sha256sum "$here/guest/init" | cut -d' ' -f1)")"
if [ -f "$cache/stamp" ] && [ "$(cat "$cache/stamp")" = "$stamp_text" ] \
    && [ -f "$cache/vmlinuz" ] && [ -f "$cache/initramfs.cpio.gz" ] && [ -f "$cache/assets.env" ]; then
    log "cache hit: $cache ($release $version)"
    exit 0
fi
rm -f "$cache/stamp"
log "building assets for $release ($version) in $cache"

headers_pkg="linux-headers-$release"
source_pkg="linux-source-$series"
missing=()
installed "$headers_pkg" "$version" || missing+=("$headers_pkg=$version")
installed "$source_pkg" "$version" || missing+=("$source_pkg=$version")
((${#missing[@]} == 0)) || apt_install "${missing[@]}"

work="$cache/work"
rm -rf "$work"
mkdir -p "$work"

# Kernel image and modules, unpacked, not installed.
(cd "$work" && apt-get download "$image_pkg=$version" >/dev/null 2>&1) \
    || die "apt-get download $image_pkg=$version failed"
dpkg -x "$work"/"$image_pkg"_*.deb "$work/image"
moddir="$work/image/lib/modules/$release"
[ -d "$moddir" ] || die "no modules in $image_pkg"
cp "$work/image/boot/vmlinuz-$release" "$cache/vmlinuz.new"

# Sample mdev drivers, out of tree.
tarball="/usr/src/linux-source-$series.tar.xz"
[ -f "$tarball" ] || die "$tarball missing ($source_pkg)"
mkdir -p "$work/src"
tar -xJf "$tarball" -C "$work/src" "linux-source-$series/samples/vfio-mdev"
samples="$work/src/linux-source-$series/samples/vfio-mdev"
printf 'obj-m := mtty.o mdpy.o mbochs.o\n' > "$samples/Makefile"
make -s -C "/usr/src/linux-headers-$release" M="$samples" modules >"$work/samples-build.log" 2>&1 \
    || { tail -30 "$work/samples-build.log" >&2; die "building the sample mdev drivers failed"; }

# Modules to load, with their dependencies first. depends= comes from each module's .modinfo.
declare -A path_of=()
while IFS= read -r f; do
    n="$(basename "$f" .ko)"
    path_of["${n//-/_}"]="$f"
done < <(find "$moddir" -name '*.ko')
for n in mtty mbochs mdpy; do path_of[$n]="$samples/$n.ko"; done

ko_depends() { tr '\0' '\n' <"$1" | sed -n 's/^depends=//p' | head -1 | tr ',' ' '; }

order=()
declare -A seen=()
add_module() {
    local name="${1//-/_}"
    [ -n "${seen[$name]:-}" ] && return 0
    seen[$name]=1
    local f="${path_of[$name]:-}"
    [ -n "$f" ] || die "module $1 not found in $image_pkg or the samples"
    local d
    for d in $(ko_depends "$f"); do add_module "$d"; done
    order+=("$name")
}
for m in virtio_pci bochs irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci mdev \
    9pnet_virtio 9p mtty mbochs mdpy; do
    add_module "$m"
done

# Initramfs: busybox, init, modules.
root="$work/initramfs"
mkdir -p "$root"/{bin,dev,proc,sys,mnt,results,modules,host}
cp /bin/busybox "$root/bin/busybox"
ln -s busybox "$root/bin/sh"
install -m 0755 "$here/guest/init" "$root/init"
: >"$root/modules/order"
for name in "${order[@]}"; do
    cp "${path_of[$name]}" "$root/modules/$name.ko"
    echo "$name" >>"$root/modules/order"
done
(cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc --owner=0:0 --quiet | gzip -6) >"$cache/initramfs.cpio.gz.new"

mv "$cache/vmlinuz.new" "$cache/vmlinuz"
mv "$cache/initramfs.cpio.gz.new" "$cache/initramfs.cpio.gz"
cp "$root/modules/order" "$cache/modules.order"
cat >"$cache/assets.env" <<ENV
KERNEL_RELEASE=$release
KERNEL_VERSION=$version
KERNEL=$cache/vmlinuz
INITRD=$cache/initramfs.cpio.gz
ENV
rm -rf "$work"
printf '%s\n' "$stamp_text" >"$cache/stamp"
log "done: $cache (modules: ${order[*]})"
