# Scenario 7: sandbox-dp --on-demand on a real kernel's non-PCI mdev parent (mtty), with the test
# kubelet (vm-kubelet --on-demand) serving kubelet's PodResources API. mtty's types are offered
# with as many slots as sysfs's available_instances; Allocate creates a real mdev (its UUID in
# MDEV_PCI_RESOURCE_…); it stays while PodResources lists its pod and is removed once the pod is
# gone (--on-demand-poll 200ms). No periodic re-read (--resync-interval 10m): the other type's
# counts follow the mdev's uevents.
sdp="$VMTIER_BIN/sandbox-dp"
kubelet_tool="$VMTIER_KUBELET"
types=/sys/class/mdev_bus/mtty/mdev_supported_types

check binaries-present test -x "$sdp" -a -x "$kubelet_tool"
expect_eq no-mdevs-before 0 "$(ls /sys/bus/mdev/devices | wc -l)"

resource_of_type() { echo "nvidia.com/$(tr -s ' \t' '__' <"$1/name" | tr -d '\n')"; }
r_dual="$(resource_of_type "$types/mtty-2")"
r_single="$(resource_of_type "$types/mtty-1")"
n_dual="$(cat "$types/mtty-2/available_instances")"
n_single="$(cat "$types/mtty-1/available_instances")"
# An mtty-2 (dual port) takes two of the parent's ports: two single-port instances fewer.
n_single_after=$((n_single - 2))
echo "resources: $r_dual ($n_dual) $r_single ($n_single, $n_single_after with one $r_dual)"

# list: the slots, named by the parent and the type id.
"$sdp" list --json --on-demand mtty --host-root / >"$VMTIER_RESULTS/list.json" 2>"$VMTIER_RESULTS/list.err"
expect_eq list-exit-0 0 "$?"
expect_eq list-dual-slots "$n_dual mtty-mtty-2-0" \
    "$(jq -r --arg r "$r_dual" '.resources[] | select(.name == $r) | "\(.devices | length) \(.devices[0].id)"' "$VMTIER_RESULTS/list.json" 2>&1)"

kdir=$VMTIER_SCRATCH/device-plugins
pr=$VMTIER_SCRATCH/pod-resources/kubelet.sock
mkdir -p "$kdir"
"$kubelet_tool" --dir "$kdir" --timeout 30 --pod-resources "$pr" \
    --on-demand "$r_dual=$n_dual" --other "$r_single=$n_single,$n_single_after" \
    >"$VMTIER_RESULTS/vm-kubelet.out" 2>"$VMTIER_RESULTS/vm-kubelet.err" &
kubelet_pid=$!
wait_for 10 test -S "$kdir/kubelet.sock" -a -S "$pr"
RUST_LOG=info "$sdp" serve --on-demand mtty --on-demand-poll 200ms --resync-interval 10m --host-root / \
    --kubelet-dir "$kdir" --pod-resources-socket "$pr" >"$VMTIER_RESULTS/sandbox-dp.log" 2>&1 &
sdp_pid=$!
wait "$kubelet_pid"
rc=$?
while read -r line; do _record "$line"; done <"$VMTIER_RESULTS/vm-kubelet.out"
expect_eq vm-kubelet-exit-0 0 "$rc"
expect_eq no-mdevs-after 0 "$(ls /sys/bus/mdev/devices | wc -l)"
expect_eq mtty-2-available-again "$n_dual" "$(cat "$types/mtty-2/available_instances")"
check sandbox-dp-logged-the-creation grep -q "created an on-demand vGPU" "$VMTIER_RESULTS/sandbox-dp.log"
check sandbox-dp-logged-the-removal grep -q "removed an on-demand vGPU" "$VMTIER_RESULTS/sandbox-dp.log"
expect_eq records-empty 0 "$(jq '.vgpus | length' /run/gpu-vm-node/on-demand-vgpus.json 2>&1)"
kill -TERM "$sdp_pid"
wait "$sdp_pid"
expect_eq sandbox-dp-sigterm-exit-0 0 "$?"
