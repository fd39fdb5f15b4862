//! node-sim's uevents reach a libudev monitor: on udevd's group (`udev::MonitorBuilder::new()`)
//! in node-sim's own network namespace, on the kernel's group (`new_kernel()`) in any other.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use support::*;

use std::time::{Duration, Instant};

/// Waits for an event matching `f` (other sims may broadcast in parallel).
fn wait_event(sock: &udev::MonitorSocket, mut f: impl FnMut(&udev::Event) -> bool) -> udev::Event {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for ev in sock.iter() {
            if f(&ev) {
                return ev;
            }
        }
        assert!(Instant::now() < deadline, "no matching uevent");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Moves `gpu` from nvidia to vfio-pci as vfio-manager does: override, unbind, probe.
fn to_vfio(m: &Mounted, gpu: &str) {
    m.w(
        &format!("sys/bus/pci/devices/{gpu}/driver_override"),
        "vfio-pci",
    )
    .unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", gpu).unwrap();
    m.w("sys/bus/pci/drivers_probe", gpu).unwrap();
}

fn prop(ev: &udev::Event, k: &str) -> Option<String> {
    ev.property_value(k)
        .map(|v| v.to_string_lossy().into_owned())
}

#[test]
fn bind_unbind_and_mdev_events_reach_a_udev_monitor() {
    let Some(m) = mount("2xA10") else { return };
    let pci = udev::MonitorBuilder::new()
        .unwrap()
        .match_subsystem("pci")
        .unwrap()
        .listen()
        .unwrap();
    let mdev = udev::MonitorBuilder::new()
        .unwrap()
        .match_subsystem("mdev")
        .unwrap()
        .listen()
        .unwrap();
    let gpu = "0000:41:00.0";
    to_vfio(&m, gpu);
    let mine = |ev: &udev::Event| {
        prop(ev, "PCI_SLOT_NAME").as_deref() == Some(gpu)
            && ev.devpath().to_string_lossy() == "/devices/pci0000:40/0000:40:01.1/0000:41:00.0"
    };
    let ev = wait_event(&pci, |e| mine(e));
    assert_eq!(ev.event_type(), udev::EventType::Unbind);
    let ev = wait_event(&pci, |e| mine(e));
    assert_eq!(ev.event_type(), udev::EventType::Bind);
    assert_eq!(prop(&ev, "DRIVER").as_deref(), Some("vfio-pci"));
    assert_eq!(
        ev.subsystem()
            .map(|s| s.to_string_lossy().into_owned())
            .as_deref(),
        Some("pci")
    );

    // VFs appear with add events, an mdev with add + MDEV_TYPE.
    m.w("sys/bus/pci/devices/0000:61:00.0/sriov_numvfs", "1")
        .unwrap();
    let ev = wait_event(&pci, |e| {
        prop(e, "PCI_SLOT_NAME").as_deref() == Some("0000:61:00.4")
    });
    assert_eq!(ev.event_type(), udev::EventType::Add);
    let uuid = "77777777-0000-4000-8000-000000000000";
    m.w(
        "sys/class/mdev_bus/0000:61:00.4/mdev_supported_types/nvidia-593/create",
        uuid,
    )
    .unwrap();
    let ev = wait_event(&mdev, |e| e.devpath().to_string_lossy().ends_with(uuid));
    assert_eq!(ev.event_type(), udev::EventType::Add);
    assert_eq!(prop(&ev, "MDEV_TYPE").as_deref(), Some("nvidia-593"));
}

/// A process in a network namespace of its own (`unshare -n`, as a pod without `hostNetwork`
/// has one), killed when dropped.
struct OtherNetns(std::process::Child);

impl Drop for OtherNetns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn in_another_network_namespace_the_kernels_group_hears_the_sim() {
    let Some(m) = mount("2xA10") else { return };
    let netns = match std::process::Command::new("unshare")
        .args(["-n", "sleep", "600"])
        .spawn()
    {
        Ok(c) => OtherNetns(c),
        Err(e) => {
            eprintln!("skipped: cannot run unshare -n: {e}");
            return;
        }
    };
    let ns = format!("/proc/{}/ns/net", netns.0.id());
    // unshare(1) enters the namespace before it runs sleep: wait for it.
    let host = std::fs::metadata("/proc/self/ns/net").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    use std::os::unix::fs::MetadataExt as _;
    while std::fs::metadata(&ns).map(|n| n.ino()).ok() == Some(host.ino()) {
        assert!(
            Instant::now() < deadline,
            "unshare -n never entered a namespace"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The kernel's group, joined from inside that namespace (the socket stays in it).
    let ns_file = std::fs::File::open(&ns).unwrap();
    let kernel = std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&ns_file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            udev::MonitorBuilder::new_kernel()
                .unwrap()
                .match_subsystem("pci")
                .unwrap()
                .listen()
                .unwrap()
        })
        .join()
        .unwrap()
    });
    // Not the GPU the test above rebinds: both run at once, and its monitor hears this sim too.
    let gpu = "0000:61:00.0";
    to_vfio(&m, gpu);
    // libudev takes a message on the kernel's group only from the kernel (port 0): the kernel
    // broadcast it, with a SEQNUM of its own.
    let ev = wait_event(&kernel, |e| {
        prop(e, "PCI_SLOT_NAME").as_deref() == Some(gpu) && e.event_type() == udev::EventType::Bind
    });
    assert_eq!(
        ev.devpath().to_string_lossy(),
        "/devices/pci0000:60/0000:60:01.1/0000:61:00.0"
    );
    assert_eq!(prop(&ev, "DRIVER").as_deref(), Some("vfio-pci"));
    assert_eq!(prop(&ev, "SUBSYSTEM").as_deref(), Some("pci"));
    assert!(ev.sequence_number() > 0);
}
