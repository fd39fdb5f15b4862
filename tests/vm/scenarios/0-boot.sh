# Scenario 0: the guest is what the other scenarios assume.
expect_eq kernel-release "$VMTIER_KERNEL" "$(uname -r)"
expect_eq vga-device "0x1234 0x1111 0x030000" "$(cat /sys/bus/pci/devices/0000:00:02.0/{vendor,device,class} | tr '\n' ' ' | sed 's/ $//')"
expect_eq vga-driver bochs-drm "$(basename "$(readlink /sys/bus/pci/devices/0000:00:02.0/driver)")"
check iommu-group-of-vga test -e /sys/bus/pci/devices/0000:00:02.0/iommu_group
for parent in mtty mbochs mdpy; do
    check "mdev-parent-$parent" test -d "/sys/class/mdev_bus/$parent/mdev_supported_types"
done
expect_eq mtty-2-name "Dual port serial" "$(cat /sys/class/mdev_bus/mtty/mdev_supported_types/mtty-2/name)"
check vfio-container-node test -c /dev/vfio/vfio
check results-share-writable touch "$VMTIER_RESULTS/probe"
check host-root-read-only sh -c '! touch /usr/vmtier-probe 2>/dev/null'
check bin-dir-visible test -d "$VMTIER_BIN"
