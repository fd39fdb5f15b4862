# Scenario 1: vfio-manager moves the emulated VGA device (1234:1111, class 0x0300) from
# bochs-drm to vfio-pci -- and bochs-display, which has the same id (class 0x0380): --device
# selects by id whatever the class -- leaves edu (1234:11e8) alone, does nothing on a
# second bind, refuses to unbind a group a process holds, gives the device back on unbind, and
# as a daemon binds a device that reappears (real uevents).
vga=0000:00:02.0
other=0000:00:03.0
dev=/sys/bus/pci/devices/$vga
group="$(basename "$(readlink "$dev/iommu_group")")"
vm="$VMTIER_BIN/vfio-manager"
sel=(--vendor 1234 --device 1234:1111 --host-root /)
driver_of() { basename "$(readlink "/sys/bus/pci/devices/$1/driver" 2>/dev/null)" 2>/dev/null; }
bound_to_vfio() { [ "$(driver_of "$1")" = vfio-pci ]; }

check binary-present test -x "$vm"
expect_eq start-on-bochs-drm bochs-drm "$(driver_of $vga)"

out="$("$vm" bind "${sel[@]}" 2>&1)"; rc=$?
printf '%s\n' "$out" >"$VMTIER_RESULTS/bind.log"
expect_eq bind-exit-0 0 "$rc"
expect_eq bind-vga-on-vfio-pci vfio-pci "$(driver_of $vga)"
expect_eq bind-override-vfio-pci vfio-pci "$(cat "$dev/driver_override")"
expect_eq bind-same-id-bochs-display-on-vfio-pci vfio-pci "$(driver_of $other)"
expect_eq bind-leaves-edu-alone "(null)" "$(cat /sys/bus/pci/devices/0000:00:04.0/driver_override)"
check bind-group-node-exists test -c "/dev/vfio/$group"
check bind-group-node-opens bash -c "exec 3<>/dev/vfio/$group"
check status-exit-0 "$vm" status "${sel[@]}"

# Second bind while a process holds the group: no sysfs write, the node stays.
sleep 600 3<>"/dev/vfio/$group" &
holder=$!
wait_for 5 test -e "/proc/$holder/fd/3"
inode_before="$(stat -c %i "/dev/vfio/$group")"
strace -f -y -qq -e trace=write,pwrite64,writev -o "$VMTIER_RESULTS/strace-second-bind.txt" \
    "$vm" bind "${sel[@]}" >"$VMTIER_RESULTS/second-bind.log" 2>&1
expect_eq second-bind-exit-0 0 "$?"
sysfs_writes="$(grep -c '</sys/' "$VMTIER_RESULTS/strace-second-bind.txt")"
expect_eq second-bind-writes-nothing-to-sysfs 0 "$sysfs_writes"
expect_eq second-bind-group-node-unchanged "$inode_before" "$(stat -c %i "/dev/vfio/$group" 2>&1)"

# Unbind while held: refused, nothing changes.
"$vm" unbind "${sel[@]}" >"$VMTIER_RESULTS/unbind-held.log" 2>&1
rc=$?
[ "$rc" -ne 0 ] && pass unbind-held-group-refused || fail unbind-held-group-refused "exit 0"
expect_eq unbind-held-group-stays-on-vfio vfio-pci "$(driver_of $vga)"
kill "$holder"
wait "$holder" 2>/dev/null

out="$("$vm" unbind "${sel[@]}" 2>&1)"; rc=$?
printf '%s\n' "$out" >"$VMTIER_RESULTS/unbind.log"
expect_eq unbind-exit-0 0 "$rc"
expect_eq unbind-back-on-bochs-drm bochs-drm "$(driver_of $vga)"
expect_eq unbind-bochs-display-back bochs-drm "$(driver_of $other)"
expect_eq unbind-override-cleared "(null)" "$(cat "$dev/driver_override")"
check unbind-group-node-gone test ! -e "/dev/vfio/$group"

# Daemon: binds, reports ready, rebinds a device that is removed and rescanned, leaves the
# devices bound on SIGTERM.
ready=/run/nvidia/validations/vfio-pci-ready
"$vm" daemon "${sel[@]}" >"$VMTIER_RESULTS/daemon.log" 2>&1 &
daemon=$!
if wait_for 20 test -e "$ready"; then pass daemon-ready-file; else fail daemon-ready-file "$ready not written in 20 s"; fi
expect_eq daemon-bound vfio-pci "$(driver_of $vga)"
printf 1 >"$dev/remove"
wait_for 5 test ! -e "$dev"
printf 1 >/sys/bus/pci/rescan
if wait_for 20 bound_to_vfio $vga; then
    pass daemon-rebinds-rescanned-device
    check daemon-ready-after-rescan wait_for 10 test -e "$ready"
else
    fail daemon-rebinds-rescanned-device "driver is '$(driver_of $vga)' 20 s after rescan (uevent not acted on)"
fi
kill -TERM "$daemon"
wait "$daemon"
expect_eq daemon-sigterm-exit-0 0 "$?"
expect_eq daemon-exit-leaves-bound vfio-pci "$(driver_of $other)"
"$vm" unbind "${sel[@]}" >>"$VMTIER_RESULTS/unbind.log" 2>&1
expect_eq final-unbind-back-on-bochs-drm bochs-drm "$(driver_of $vga)"
