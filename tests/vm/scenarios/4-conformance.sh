# Scenario 4, guest side: run the conformance script against the real kernel and keep its
# observations for the host test, which runs the same script on node-sim and compares.
ROOT="" PCI_DEV=0000:00:02.0 DEFAULT_DRIVER=bochs-drm NODRV_DEV=0000:00:04.0 MDEV_PARENT=mtty MDEV_TYPE=mtty-2 \
    MDEV_OTHER_TYPE=mtty-1 bash -c '. "$VMTIER_REPO/tests/vm/guest/lib.sh"; . "$VMTIER_REPO/tests/vm/scenarios/conformance.sh"' \
    >"$VMTIER_RESULTS/observations" 2>"$VMTIER_RESULTS/conformance.err"
expect_eq conformance-script-exit-0 0 "$?"
lines="$(wc -l <"$VMTIER_RESULTS/observations")"
[ "$lines" -gt 50 ] && pass conformance-observations-recorded || fail conformance-observations-recorded "$lines lines"
