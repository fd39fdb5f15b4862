# Scenario 2: vgpu-device-manager --vendor any on the kernel's sample mdev drivers. With
# --vendor any the guest's devices are the non-PCI mdev parents by name: 0 mbochs, 1 mdpy,
# 2 mtty (every type of an entry must be offered by each device it selects). Apply creates exactly the profile's mdevs, assert agrees, a changed profile
# reconfigures with minimal change, a process holding an mdev's /dev/vfio/<g> blocks its
# removal while the rest still applies.
vdm="$VMTIER_BIN/vgpu-device-manager"
cfg=$VMTIER_SCRATCH/vgpu.yaml
cat >"$cfg" <<'YAML'
version: v1
vgpu-configs:
  samples:
    - devices: [2]
      vgpu-devices: {"mtty-2": 2}
    - devices: [0]
      vgpu-devices: {"mbochs-small": 3}
  changed:
    - devices: [2]
      vgpu-devices: {"mtty-1": 1}
    - devices: [0]
      vgpu-devices: {"mbochs-small": 1}
  unknown-type:
    - devices: all
      vgpu-devices: {"no-such-type": 1}
  empty:
    - devices: all
      vgpu-devices: {}
YAML
types=/sys/class/mdev_bus
count() { ls "$types/$1/mdev_supported_types/$2/devices" 2>/dev/null | wc -l; }
total() { ls /sys/bus/mdev/devices 2>/dev/null | wc -l; }
uuids() { ls /sys/bus/mdev/devices 2>/dev/null | sort | tr '\n' ' '; }
layout() { echo "mtty-1=$(count mtty mtty-1) mtty-2=$(count mtty mtty-2) mbochs-small=$(count mbochs mbochs-small) total=$(total)"; }
vdm_run() { # NAME ARGS...: runs vgpu-device-manager, log in NAME.log, prints the exit status
    local name="$1"
    shift
    "$vdm" --vendor any "$@" >"$VMTIER_RESULTS/$name.log" 2>&1
    echo $?
}

check binary-present test -x "$vdm"
expect_eq start-no-mdevs 0 "$(total)"

expect_eq apply-unknown-type-exit-2 2 "$(vdm_run apply-unknown apply -f "$cfg" -c unknown-type)"
expect_eq apply-unknown-type-changes-nothing 0 "$(total)"
expect_eq apply-samples-exit-0 0 "$(vdm_run apply-samples apply -f "$cfg" -c samples)"
expect_eq apply-samples-layout "mtty-1=0 mtty-2=2 mbochs-small=3 total=5" "$(layout)"
for u in /sys/bus/mdev/devices/*; do
    g="$(basename "$(readlink "$u/iommu_group")")"
    [ -c "/dev/vfio/$g" ] || { fail apply-samples-group-nodes "no /dev/vfio/$g for $(basename "$u")"; break; }
done
[ -c "/dev/vfio/$g" ] && pass apply-samples-group-nodes
expect_eq assert-samples-exit-0 0 "$(vdm_run assert-samples assert -f "$cfg" -c samples)"
expect_eq assert-changed-exit-1 1 "$(vdm_run assert-changed assert -f "$cfg" -c changed)"

before="$(uuids)"
expect_eq reapply-samples-exit-0 0 "$(vdm_run reapply-samples apply -f "$cfg" -c samples)"
expect_eq reapply-samples-keeps-every-mdev "$before" "$(uuids)"

expect_eq plan-changed-exit-0 0 "$(vdm_run plan-changed plan -f "$cfg" -c changed)"
expect_eq plan-changes-nothing "$before" "$(uuids)"

mbochs_before="$(ls "$types/mbochs/mdev_supported_types/mbochs-small/devices" | sort)"
expect_eq apply-changed-exit-0 0 "$(vdm_run apply-changed apply -f "$cfg" -c changed)"
expect_eq apply-changed-layout "mtty-1=1 mtty-2=0 mbochs-small=1 total=2" "$(layout)"
kept="$(ls "$types/mbochs/mdev_supported_types/mbochs-small/devices")"
if [ -n "$kept" ] && printf '%s\n' "$mbochs_before" | grep -qx "$kept"; then
    pass apply-changed-keeps-a-matching-mbochs-mdev
else
    fail apply-changed-keeps-a-matching-mbochs-mdev "kept '$kept', before: $mbochs_before"
fi
expect_eq assert-changed-after-apply-exit-0 0 "$(vdm_run assert-changed-2 assert -f "$cfg" -c changed)"

# A process holds the mtty-1 mdev's group: mtty is left as it is, mbochs still changes.
held="$(ls "$types/mtty/mdev_supported_types/mtty-1/devices" | head -1)"
hg="$(basename "$(readlink "/sys/bus/mdev/devices/$held/iommu_group")")"
sleep 600 3<>"/dev/vfio/$hg" &
holder=$!
wait_for 5 test -e "/proc/$holder/fd/3"
expect_eq apply-samples-while-held-exit-1 1 "$(vdm_run apply-held apply -f "$cfg" -c samples)"
check apply-held-keeps-held-mdev test -e "/sys/bus/mdev/devices/$held"
expect_eq apply-held-layout "mtty-1=1 mtty-2=0 mbochs-small=3 total=4" "$(layout)"
check apply-held-names-the-holder grep -q "$holder" "$VMTIER_RESULTS/apply-held.log"
kill "$holder"
wait "$holder" 2>/dev/null
expect_eq apply-samples-after-release-exit-0 0 "$(vdm_run apply-released apply -f "$cfg" -c samples)"
expect_eq apply-after-release-layout "mtty-1=0 mtty-2=2 mbochs-small=3 total=5" "$(layout)"

"$vdm" --vendor any export -c exported >"$VMTIER_RESULTS/export.yaml" 2>"$VMTIER_RESULTS/export.log"
expect_eq export-exit-0 0 "$?"
expect_eq assert-exported-exit-0 0 "$(vdm_run assert-exported assert -f "$VMTIER_RESULTS/export.yaml" -c exported)"

expect_eq apply-empty-exit-0 0 "$(vdm_run apply-empty apply -f "$cfg" -c empty)"
expect_eq apply-empty-removes-all 0 "$(total)"

# Daemon without Kubernetes (-c): applies at start, re-applies when the config file changes,
# exits 0 on SIGTERM.
dcfg=$VMTIER_SCRATCH/vgpu-daemon/config.yaml
mkdir -p $VMTIER_SCRATCH/vgpu-daemon
cp "$cfg" "$dcfg"
"$vdm" --vendor any daemon -f "$dcfg" -c samples >"$VMTIER_RESULTS/daemon.log" 2>&1 &
daemon=$!
layout_is() { [ "$(layout)" = "$1" ]; }
if wait_for 30 layout_is "mtty-1=0 mtty-2=2 mbochs-small=3 total=5"; then
    pass daemon-applies-at-start
else
    fail daemon-applies-at-start "layout after 30 s: $(layout)"
fi
sed -e 's/{"mtty-2": 2}/{"mtty-2": 1}/' -e 's/{"mbochs-small": 3}/{"mbochs-small": 1}/' "$cfg" >$VMTIER_SCRATCH/vgpu-daemon/new.yaml
mv $VMTIER_SCRATCH/vgpu-daemon/new.yaml "$dcfg"
if wait_for 30 layout_is "mtty-1=0 mtty-2=1 mbochs-small=1 total=2"; then
    pass daemon-reapplies-on-config-change
else
    fail daemon-reapplies-on-config-change "layout 30 s after the change: $(layout)"
fi
kill -TERM "$daemon"
wait "$daemon"
expect_eq daemon-sigterm-exit-0 0 "$?"
"$vdm" --vendor any apply -f "$cfg" -c empty >>"$VMTIER_RESULTS/apply-empty.log" 2>&1
