# Scenario 8: sandbox-dra --vgpu mtty on a real kernel, driven by vm-dra-kubelet (testkit's fake
# API server and fake kubelet DRA client): the sample driver's types are published with its
# ports as a counter, a claim allocated one of them is prepared as a real mtty mdev whose
# /dev/vfio/<group> is in the CDI spec and opens, the device metadata carries its UUID;
# unprepare removes the mdev.
dra="$VMTIER_BIN/sandbox-dra"
tool="$VMTIER_DRA_KUBELET"
mdevs() { ls /sys/bus/mdev/devices 2>/dev/null | wc -l; }

check binaries-present test -x "$dra" -a -x "$tool"
check mtty-is-an-mdev-parent test -d /sys/class/mdev_bus/mtty/mdev_supported_types/mtty-1
expect_eq no-mdevs-before 0 "$(mdevs)"
# The fake API server listens on 127.0.0.1; the guest's init leaves lo down.
ip link set lo up
"$tool" --driver "$dra" --scratch "$VMTIER_SCRATCH/dra" --mdev-parent mtty \
    --log "$VMTIER_RESULTS/sandbox-dra.log" >"$VMTIER_RESULTS/vm-dra-kubelet.out" 2>"$VMTIER_RESULTS/vm-dra-kubelet.err"
rc=$?
while read -r line; do _record "$line"; done <"$VMTIER_RESULTS/vm-dra-kubelet.out"
expect_eq vm-dra-kubelet-exit-0 0 "$rc"
expect_eq no-mdevs-after 0 "$(mdevs)"
