# Scenario 3: sandbox-dp on a real kernel with the test kubelet (vm-kubelet, built on testkit's
# fake kubelet). The VGA device is put on vfio-pci and mdevs are created by plain sysfs writes;
# sandbox-dp must advertise the VGA device (vendor 1234) and the mdevs by type name, Allocate
# must return the real group nodes, and removing an mdev must drop it from ListAndWatch (the
# uevent path, no udevd in the guest).
sdp="$VMTIER_BIN/sandbox-dp"
kubelet_tool="$VMTIER_KUBELET"
vga=0000:00:02.0
dev=/sys/bus/pci/devices/$vga
types=/sys/class/mdev_bus

check binaries-present test -x "$sdp" -a -x "$kubelet_tool"

# Setup by plain writes (scenario 1 and 4 cover these).
printf vfio-pci >"$dev/driver_override"
printf %s "$vga" >"$dev/driver/unbind"
printf %s "$vga" >/sys/bus/pci/drivers_probe
expect_eq setup-vga-on-vfio-pci vfio-pci "$(basename "$(readlink "$dev/driver")")"
m1=6f1c8a52-0000-4000-8000-000000000001
m2=6f1c8a52-0000-4000-8000-000000000002
m3=6f1c8a52-0000-4000-8000-000000000003
printf $m1 >"$types/mtty/mdev_supported_types/mtty-2/create"
printf $m2 >"$types/mtty/mdev_supported_types/mtty-2/create"
printf $m3 >"$types/mbochs/mdev_supported_types/mbochs-small/create"
expect_eq setup-mdevs 3 "$(ls /sys/bus/mdev/devices | wc -l)"

resource_of_type() { echo "nvidia.com/$(tr -s ' \t' '__' <"$1/name" | tr -d '\n')"; }
r_vga=nvidia.com/1111
r_mtty="$(resource_of_type "$types/mtty/mdev_supported_types/mtty-2")"
r_mbochs="$(resource_of_type "$types/mbochs/mdev_supported_types/mbochs-small")"
echo "resources: $r_vga $r_mtty $r_mbochs"

# list --json, vendor 1234: the VGA device (the mdevs are on non-PCI parents).
"$sdp" list --json --vendor 1234 --host-root / >"$VMTIER_RESULTS/list-1234.json" 2>"$VMTIER_RESULTS/list-1234.err"
expect_eq list-vendor-1234-exit-0 0 "$?"
resources_in() { jq -r '.resources[] | .name + "=" + ([.devices[] | .id + ":" + .health] | sort | join(","))' "$1" 2>&1 | sort | tr '\n' ' '; }
expect_eq list-vendor-1234-advertises-vga "$r_vga=$vga:Healthy " "$(resources_in "$VMTIER_RESULTS/list-1234.json")"
"$sdp" list --json --vendor any --host-root / >"$VMTIER_RESULTS/list-any.json" 2>"$VMTIER_RESULTS/list-any.err"
expect_eq list-vendor-any-exit-0 0 "$?"
want="$(printf '%s\n' "$r_vga=$vga:Healthy" "$r_mtty=$m1:Healthy,$m2:Healthy" "$r_mbochs=$m3:Healthy" | sort | tr '\n' ' ')"
expect_eq list-vendor-any-advertises-vga-and-mdevs-by-type-name "$want" "$(resources_in "$VMTIER_RESULTS/list-any.json")"

# Serve, with the test kubelet.
kdir=$VMTIER_SCRATCH/device-plugins
mkdir -p "$kdir"
"$kubelet_tool" --dir "$kdir" --timeout 30 \
    --resource "$r_vga=$vga" --resource "$r_mtty=$m1,$m2" --resource "$r_mbochs=$m3" \
    --remove-mdev $m2 >"$VMTIER_RESULTS/vm-kubelet.out" 2>"$VMTIER_RESULTS/vm-kubelet.err" &
kubelet_pid=$!
wait_for 10 test -S "$kdir/kubelet.sock"
RUST_LOG=info "$sdp" serve --vendor any --host-root / --kubelet-dir "$kdir" >"$VMTIER_RESULTS/sandbox-dp.log" 2>&1 &
sdp_pid=$!
wait "$kubelet_pid"
rc=$?
while read -r line; do _record "$line"; done <"$VMTIER_RESULTS/vm-kubelet.out"
expect_eq vm-kubelet-exit-0 0 "$rc"
check removed-mdev-gone-from-sysfs test ! -e "/sys/bus/mdev/devices/$m2"
kill -TERM "$sdp_pid"
wait "$sdp_pid"
expect_eq sandbox-dp-sigterm-exit-0 0 "$?"
check sandbox-dp-removes-its-sockets sh -c "! ls $kdir | grep -q sandbox-dp"
