# Scenario 6: the kernel's uevents reach a listener in a network namespace of its own. A pod
# without hostNetwork has one; the kernel sends uevents of devices without a namespace tag (PCI
# devices, their drivers) to every network namespace owned by the initial user namespace, so
# vfio-manager and sandbox-dp hear a GPU's add, bind and unbind without the host's network.
dev=0000:00:04.0
out="$VMTIER_RESULTS/netns-uevents"
host_ns="$(readlink /proc/self/ns/net)"
own_ns="$(unshare -n readlink /proc/self/ns/net)"
check netns-is-another sh -c "[ '$host_ns' != '$own_ns' ] && [ -n '$own_ns' ]"

# A NETLINK_KOBJECT_UEVENT socket on the kernel's group (1), in a new network namespace; it
# writes each uevent's first line and stops at the edu device's bind.
unshare -n python3 - "$out" "$dev" <<'PY' &
import socket, sys
out, dev = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)
s.bind((0, 1))
open(out + ".ready", "w").close()
s.settimeout(60)
with open(out, "w") as f:
    while True:
        head = s.recv(65536).split(b"\0")[0].decode()
        f.write(head + "\n")
        f.flush()
        if head.startswith("bind@") and head.endswith(dev):
            break
PY
listener=$!
check netns-listener-ready wait_for 30 test -e "$out.ready"

# Bind edu (no driver) to vfio-pci, as vfio-manager would.
modprobe vfio-pci 2>/dev/null || true
echo vfio-pci >"/sys/bus/pci/devices/$dev/driver_override"
echo "$dev" >/sys/bus/pci/drivers_probe
expect_eq edu-on-vfio-pci vfio-pci "$(basename "$(readlink "/sys/bus/pci/devices/$dev/driver")")"

wait "$listener"
expect_eq netns-listener-exit 0 "$?"
check netns-heard-bind grep -q "^bind@.*$dev\$" "$out"
check netns-heard-vfio-add grep -q "^add@.*vfio" "$out"
