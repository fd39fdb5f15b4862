# Conformance: plain sysfs writes and reads, run in the VM guest (a real 6.1 kernel) and on
# node-sim, printing one observation per line ("<op>: <what was seen>"). The host test compares
# the two lists line by line; a difference is node-sim not behaving like the kernel.
# Needs lib.sh (try_write, try_read) and:
#   ROOT             "" in the guest, node-sim's mount directory on the host
#   PCI_DEV          a function bound to DEFAULT_DRIVER, with no other device in its group
#   DEFAULT_DRIVER   the driver it starts on and returns to after a reprobe
#   NODRV_DEV        a function no driver claims (no driver bound)
#   MDEV_PARENT      a name in class/mdev_bus with no mdevs yet
#   MDEV_TYPE        one of its types with >= 2 instances; MDEV_OTHER_TYPE another type
# Values that differ by nature (group numbers, UUIDs, parent and type names) are normalised.
set -u
sys="$ROOT/sys"
dev="$sys/bus/pci/devices/$PCI_DEV"
drv() { local l; l="$(readlink "$dev/driver" 2>/dev/null)" && basename "$l" || echo none; }
obs() { printf '%s: %s\n' "$1" "$2"; }

# --- PCI driver binding ---
group="$(basename "$(readlink "$dev/iommu_group")")"
node="$ROOT/dev/vfio/$group"
obs "start driver" "$(drv | sed "s/^$DEFAULT_DRIVER\$/<default>/")"
obs "read driver_override unset" "$(try_read "$dev/driver_override")"
obs "write unknown name to driver_override" "$(try_write "$dev/driver_override" no-such-driver)"
obs "driver_override reads back" "$(try_read "$dev/driver_override")"
obs "driver after unknown override" "$(drv | sed "s/^$DEFAULT_DRIVER\$/<default>/")"
obs "write newline to driver_override" "$(try_write "$dev/driver_override" $'\n')"
obs "driver_override after newline" "$(try_read "$dev/driver_override")"
obs "vfio-pci/bind while bound elsewhere" "$(try_write "$sys/bus/pci/drivers/vfio-pci/bind" "$PCI_DEV")"
obs "vfio-pci/unbind when not bound to it" "$(try_write "$sys/bus/pci/drivers/vfio-pci/unbind" "$PCI_DEV")"
obs "drivers_probe garbage" "$(try_write "$sys/bus/pci/drivers_probe" garbage)"
obs "drivers_probe unknown BDF" "$(try_write "$sys/bus/pci/drivers_probe" 0000:00:1e.7)"
obs "drivers_probe bound device" "$(try_write "$sys/bus/pci/drivers_probe" "$PCI_DEV")"
obs "driver after probing bound device" "$(drv | sed "s/^$DEFAULT_DRIVER\$/<default>/")"
obs "unbind from default driver" "$(try_write "$sys/bus/pci/drivers/$DEFAULT_DRIVER/unbind" "$PCI_DEV")"
obs "driver after unbind" "$(drv)"
obs "unbind again from default driver" "$(try_write "$sys/bus/pci/drivers/$DEFAULT_DRIVER/unbind" "$PCI_DEV")"
obs "default driver bind with override naming another driver" "$(try_write "$dev/driver_override" vfio-pci; try_write "$sys/bus/pci/drivers/$DEFAULT_DRIVER/bind" "$PCI_DEV"; try_write "$dev/driver_override" $'\n')"
obs "drivers_probe with override naming no driver" "$(try_write "$dev/driver_override" no-such-driver; try_write "$sys/bus/pci/drivers_probe" "$PCI_DEV")"
obs "driver after probe with override naming no driver" "$(drv)"
obs "default driver bind without override" "$(try_write "$dev/driver_override" $'\n'; try_write "$sys/bus/pci/drivers/$DEFAULT_DRIVER/bind" "$PCI_DEV")"
obs "driver after default driver bind" "$(drv | sed "s/^$DEFAULT_DRIVER\$/<default>/")"
obs "unbind once more from default driver" "$(try_write "$sys/bus/pci/drivers/$DEFAULT_DRIVER/unbind" "$PCI_DEV")"
obs "vfio-pci/bind without override" "$(try_write "$sys/bus/pci/drivers/vfio-pci/bind" "$PCI_DEV")"
obs "driver after vfio-pci/bind without override" "$(drv)"
obs "set driver_override vfio-pci with newline" "$(try_write "$dev/driver_override" $'vfio-pci\n')"
obs "driver_override reads" "$(try_read "$dev/driver_override")"
obs "drivers_probe with override" "$(try_write "$sys/bus/pci/drivers_probe" "$PCI_DEV")"
obs "driver after probe with override" "$(drv)"
obs "group node after vfio bind" "$([ -e "$node" ] && echo present || echo absent)"
obs "group node mode" "$(stat -c %a "$node" 2>&1)"
obs "container node" "$([ -e "$ROOT/dev/vfio/vfio" ] && echo present || echo absent)"
obs "container node mode" "$(stat -c %a "$ROOT/dev/vfio/vfio" 2>&1)"
obs "vfio-dev after vfio bind" "$(ls "$dev/vfio-dev" 2>/dev/null | sed 's/^vfio[0-9]*$/vfioN/' | tr '\n' ' ' | sed 's/ $//')"
obs "vfio-dev/vfioN/dev without iommufd" "$(ls "$dev"/vfio-dev/vfio*/dev >/dev/null 2>&1 && echo present || echo absent)"
obs "vfio-pci/bind while bound to vfio-pci" "$(try_write "$sys/bus/pci/drivers/vfio-pci/bind" "$PCI_DEV")"
obs "default driver bind while on vfio-pci" "$(try_write "$sys/bus/pci/drivers/$DEFAULT_DRIVER/bind" "$PCI_DEV")"

# Holders as the kernel keeps them: the group stays held until the last descriptor of its open
# file description closes; dup, fork and exec share the description.
link_of() { # PID FD: the target of ROOT/proc/PID/fd/FD, the group normalised, or "none"
    local l
    l="$(readlink "$ROOT/proc/$1/fd/$2" 2>/dev/null)" || { echo none; return; }
    printf '%s\n' "$l" | sed "s|^/dev/vfio/$group\( (deleted)\)\{0,1\}\$|/dev/vfio/<group>\1|"
}
open_again() { # a new open of the group node: ok or the errno
    local r
    r="$( (exec 4<>"$node") 2>&1 && echo ok)"
    [ "$r" = ok ] && echo ok || errno_name "$r"
}
ended() { ! grep -qs '^State:[[:space:]]*[^Z[:space:]]' "/proc/$1/status"; }
(
    me=$BASHPID
    exec 7<>"$node"
    obs "shell exec 7<>: holder fd link" "$(link_of "$me" 7)"
    obs "shell exec 7<>: second open" "$(open_again)"
    exec 8>&7 7>&-
    obs "dup to 8 and 7 closed: fd 7" "$(link_of "$me" 7)"
    obs "dup to 8 and 7 closed: fd 8 link" "$(link_of "$me" 8)"
    obs "held through a dup: second open" "$(open_again)"
    exec 8>&-
    obs "after the last close: fd 8" "$(link_of "$me" 8)"
    obs "after the last close: second open" "$(open_again)"
)
child="$(bash -c 'exec 7<>"$1"; sleep 600 >/dev/null 2>&1 </dev/null & echo $!' _ "$node")"
obs "forked child after its parent exited: fd 7 link" "$(link_of "$child" 7)"
obs "forked child after its parent exited: second open" "$(open_again)"
kill "$child"
for _ in $(seq 100); do ended "$child" && break; sleep 0.1; done
obs "forked child ended: second open" "$(open_again)"
bash -c 'exec 7<>"$1"; exec sleep 600' _ "$node" &
execd=$!
for _ in $(seq 100); do [ "$(cat "/proc/$execd/comm" 2>/dev/null)" = sleep ] && break; sleep 0.1; done
obs "exec'd program: comm" "$(cat "$ROOT/proc/$execd/comm" 2>/dev/null || echo none)"
obs "exec'd program: fd 7 link" "$(link_of "$execd" 7)"
obs "exec'd program: second open" "$(open_again)"
kill "$execd"
wait "$execd" 2>/dev/null
obs "exec'd program ended: second open" "$(open_again)"

sleep 600 3<>"$node" &
holder=$!
for _ in $(seq 50); do [ -e "$ROOT/proc/$holder/fd/3" ] && break; sleep 0.1; done
second="$( (exec 4<>"$node") 2>&1 && echo ok)"
obs "second open of group node" "$([ "$second" = ok ] && echo ok || errno_name "$second")"
holder_link="$(readlink "$ROOT/proc/$holder/fd/3" 2>/dev/null)"
obs "holder fd link" "$(printf '%s' "${holder_link:-none}" | sed "s|^/dev/vfio/$group\$|/dev/vfio/<group>|")"
obs "unbind from vfio-pci while group open" "$(try_write "$sys/bus/pci/drivers/vfio-pci/unbind" "$PCI_DEV")"
obs "holder fd link after unbind while open" "$(link_of "$holder" 3)"
obs "group node after unbind while open" "$([ -e "$node" ] && echo present || echo absent)"
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
obs "driver_override after unbind" "$(try_read "$dev/driver_override")"
obs "clear driver_override" "$(try_write "$dev/driver_override" $'\n')"
obs "reprobe" "$(try_write "$sys/bus/pci/drivers_probe" "$PCI_DEV")"
obs "driver after reprobe" "$(drv | sed "s/^$DEFAULT_DRIVER\$/<default>/")"

# --- A function no driver claims (NODRV_DEV) ---
nd="$sys/bus/pci/devices/$NODRV_DEV"
ndrv() { local l; l="$(readlink "$nd/driver" 2>/dev/null)" && basename "$l" || echo none; }
obs "unclaimed: driver" "$(ndrv)"
obs "unclaimed: drivers_probe" "$(try_write "$sys/bus/pci/drivers_probe" "$NODRV_DEV")"
obs "unclaimed: driver after probe" "$(ndrv)"
obs "unclaimed: set override vfio-pci" "$(try_write "$nd/driver_override" vfio-pci)"
obs "unclaimed: vfio-pci/bind with override" "$(try_write "$sys/bus/pci/drivers/vfio-pci/bind" "$NODRV_DEV")"
obs "unclaimed: driver after bind" "$(ndrv)"
obs "unclaimed: vfio-pci/unbind" "$(try_write "$sys/bus/pci/drivers/vfio-pci/unbind" "$NODRV_DEV")"
obs "unclaimed: clear override" "$(try_write "$nd/driver_override" $'\n')"
obs "unclaimed: driver at the end" "$(ndrv)"

# --- Mediated devices ---
parent="$sys/class/mdev_bus/$MDEV_PARENT"
types="$parent/mdev_supported_types"
t="$types/$MDEV_TYPE"
for f in available_instances create device_api devices name; do
    obs "type entry $f" "$([ -e "$t/$f" ] && echo present || echo absent)"
done
obs "read create" "$(try_read "$t/create")"
avail0="$(cat "$t/available_instances")"
obs "available_instances >= 2" "$([ "$avail0" -ge 2 ] && echo yes || echo "no ($avail0)")"
u1=8d7e3e5a-0000-4000-8000-000000000001
u2=8d7e3e5a-0000-4000-8000-00000000000A
u2l=8d7e3e5a-0000-4000-8000-00000000000a
obs "create non-UUID" "$(try_write "$t/create" not-a-uuid)"
obs "create" "$(try_write "$t/create" $u1)"
obs "mdev in bus/mdev/devices" "$([ -e "$sys/bus/mdev/devices/$u1" ] && echo present || echo absent)"
obs "available_instances after create" "$(($(cat "$t/available_instances") - avail0))"
obs "create same UUID again" "$(try_write "$t/create" $u1)"
obs "create same UUID on another type" "$(try_write "$types/$MDEV_OTHER_TYPE/create" $u1)"
obs "create upper-case UUID" "$(try_write "$t/create" $u2)"
obs "device_api" "$(try_read "$t/device_api")"
obs "create with trailing newline" "$(try_write "$t/create" $'8d7e3e5a-0000-4000-8000-0000000000bb\n')"
obs "UUID created with newline listed" "$([ -e "$sys/bus/mdev/devices/8d7e3e5a-0000-4000-8000-0000000000bb" ] && echo yes || echo no)"
obs "upper-case UUID listed as" "$(ls "$sys/bus/mdev/devices" | grep -ix "$u2" | sed "s/$u2l/lower-case/;s/$u2/upper-case/")"
m="$sys/bus/mdev/devices/$u1"
for f in driver iommu_group mdev_type remove subsystem uevent; do
    obs "mdev entry $f" "$([ -e "$m/$f" ] || [ -L "$m/$f" ] && echo present || echo absent)"
done
obs "mdev_type link" "$(readlink "$m/mdev_type" | sed "s|$MDEV_TYPE\$|<type>|")"
obs "mdev_type resolves to the type" "$([ "$(readlink -f "$m/mdev_type")" = "$(readlink -f "$t")" ] && echo yes || echo no)"
obs "mdev device sits under its parent" "$([ "$(dirname "$(readlink -f "$m")")" = "$(readlink -f "$parent")" ] && echo yes || echo no)"
obs "type devices/ lists it" "$([ -e "$t/devices/$u1" ] && echo yes || echo no)"
g1="$(basename "$(readlink "$m/iommu_group")")"
g2="$(basename "$(readlink "$sys/bus/mdev/devices/$u2l/iommu_group")")"
obs "mdevs have distinct groups" "$([ -n "$g1" ] && [ "$g1" != "$g2" ] && echo yes || echo no)"
obs "mdev group node" "$([ -e "$ROOT/dev/vfio/$g1" ] && echo present || echo absent)"
obs "read remove" "$(try_read "$m/remove")"
obs "remove 0" "$(try_write "$m/remove" 0)"
obs "mdev after remove 0" "$([ -e "$m" ] && echo present || echo absent)"
obs "remove garbage" "$(try_write "$m/remove" garbage)"
# Fill the type.
n=0
while [ "$(cat "$t/available_instances")" -gt 0 ] && [ $n -lt 64 ]; do
    n=$((n + 1))
    try_write "$t/create" "$(printf '8d7e3e5a-0000-4000-8000-1%011x' $n)" >/dev/null
done
obs "available_instances when full" "$(cat "$t/available_instances")"
obs "create when full" "$(try_write "$t/create" 8d7e3e5a-0000-4000-8000-0000000000ff)"
obs "other type available when full" "$(cat "$types/$MDEV_OTHER_TYPE/available_instances")"
obs "remove 1" "$(try_write "$m/remove" 1)"
obs "mdev after remove 1" "$([ -e "$m" ] && echo present || echo absent)"
obs "group node after remove" "$([ -e "$ROOT/dev/vfio/$g1" ] && echo present || echo absent)"
obs "available_instances after remove" "$(cat "$t/available_instances")"
# Clean up.
for d in "$sys"/bus/mdev/devices/*; do
    [ -e "$d/remove" ] && printf 1 >"$d/remove"
done
obs "available_instances after removing all" "$(($(cat "$t/available_instances") - avail0))"
