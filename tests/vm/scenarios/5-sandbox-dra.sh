# Scenario 5: sandbox-dra prepares a claim for the emulated VGA device on a real kernel, driven
# by vm-dra-kubelet (testkit's fake API server and fake kubelet DRA client): the device moves to
# vfio-pci, the CDI spec names its real /dev/vfio/<group>, which opens, the device metadata
# carries its PCI address; unprepare (--unprepare restore) gives it back to bochs-drm.
dra="$VMTIER_BIN/sandbox-dra"
tool="$VMTIER_DRA_KUBELET"
vga=0000:00:02.0
driver_of() { basename "$(readlink "/sys/bus/pci/devices/$1/driver" 2>/dev/null)" 2>/dev/null; }

check binaries-present test -x "$dra" -a -x "$tool"
expect_eq start-on-bochs-drm bochs-drm "$(driver_of $vga)"
# The fake API server listens on 127.0.0.1; the guest's init leaves lo down.
ip link set lo up
"$tool" --driver "$dra" --scratch "$VMTIER_SCRATCH/dra" --device "$vga" \
    --log "$VMTIER_RESULTS/sandbox-dra.log" >"$VMTIER_RESULTS/vm-dra-kubelet.out" 2>"$VMTIER_RESULTS/vm-dra-kubelet.err"
rc=$?
while read -r line; do _record "$line"; done <"$VMTIER_RESULTS/vm-dra-kubelet.out"
expect_eq vm-dra-kubelet-exit-0 0 "$rc"
expect_eq ends-on-bochs-drm bochs-drm "$(driver_of $vga)"
expect_eq override-cleared "(null)" "$(cat /sys/bus/pci/devices/$vga/driver_override)"
