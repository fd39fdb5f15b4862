# Scenario 1, plain sysfs writes: the rebind flow vfio-manager performs, done by hand, so the
# tier shows the kernel's side of the contract without any of our binaries.
vga=0000:00:02.0
dev=/sys/bus/pci/devices/$vga
group="$(basename "$(readlink "$dev/iommu_group")")"

expect_eq shell-start-on-bochs-drm bochs-drm "$(basename "$(readlink "$dev/driver")")"
expect_eq shell-override-unset "(null)" "$(cat "$dev/driver_override")"
expect_eq shell-set-override ok "$(try_write "$dev/driver_override" vfio-pci)"
expect_eq shell-unbind ok "$(try_write "$dev/driver/unbind" "$vga")"
expect_eq shell-probe ok "$(try_write /sys/bus/pci/drivers_probe "$vga")"
expect_eq shell-bound-to-vfio-pci vfio-pci "$(basename "$(readlink "$dev/driver")")"
check shell-group-node-exists test -c "/dev/vfio/$group"
check shell-group-node-opens bash -c "exec 3<>/dev/vfio/$group"
expect_eq shell-clear-override ok "$(try_write "$dev/driver_override" $'\n')"
expect_eq shell-unbind-vfio ok "$(try_write /sys/bus/pci/drivers/vfio-pci/unbind "$vga")"
expect_eq shell-reprobe ok "$(try_write /sys/bus/pci/drivers_probe "$vga")"
expect_eq shell-back-on-bochs-drm bochs-drm "$(basename "$(readlink "$dev/driver")")"
check shell-group-node-gone test ! -e "/dev/vfio/$group"
