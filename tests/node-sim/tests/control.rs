//! Fault injection, synthetic holders, hot-plug and the op log.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;
use support::*;

const GPU: &str = "0000:41:00.0";

#[test]
fn fault_errno_fails_the_write_and_changes_nothing() {
    let Some(m) = mount("2xA10") else { return };
    m.ctl("fault unbind 0000:41:00.0 EBUSY");
    assert_eq!(m.w("sys/bus/pci/drivers/nvidia/unbind", GPU), Err(EBUSY));
    assert_eq!(m.driver(GPU).as_deref(), Some("nvidia"));
    // Other devices are not affected.
    m.w("sys/bus/pci/drivers/nvidia/unbind", "0000:61:00.0")
        .unwrap();
    // Persistent until cleared.
    assert_eq!(m.w("sys/bus/pci/drivers/nvidia/unbind", GPU), Err(EBUSY));
    m.ctl("clear-faults");
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    assert_eq!(m.driver(GPU), None);
}

#[test]
fn fault_count_limits_how_many_writes_fail() {
    let Some(m) = mount("2xA10") else { return };
    m.ctl("fault driver_override * EIO count=2");
    let f = format!("sys/bus/pci/devices/{GPU}/driver_override");
    assert_eq!(m.w(&f, "vfio-pci"), Err(libc::EIO));
    assert_eq!(m.w(&f, "vfio-pci"), Err(libc::EIO));
    m.w(&f, "vfio-pci").unwrap();
    assert_eq!(m.r(&f), "vfio-pci");
}

#[test]
fn fault_on_mdev_create_and_sriov() {
    let Some(m) = mount("2xA10") else { return };
    m.ctl("fault sriov_numvfs 0000:41:00.0 ENOMEM count=1");
    let f = format!("sys/bus/pci/devices/{GPU}/sriov_numvfs");
    assert_eq!(m.w(&f, "2"), Err(libc::ENOMEM));
    m.w(&f, "2").unwrap();
    let uuid = "66666666-0000-4000-8000-000000000000";
    m.ctl(&format!("fault create {uuid} ENOSPC"));
    let create = "sys/class/mdev_bus/0000:41:00.4/mdev_supported_types/nvidia-593/create";
    assert_eq!(m.w(create, uuid), Err(ENOSPC));
    m.w(create, "66666666-0000-4000-8000-000000000001").unwrap();
    m.ctl("fault remove * EBUSY count=1");
    let remove = "sys/bus/mdev/devices/66666666-0000-4000-8000-000000000001/remove";
    assert_eq!(m.w(remove, "1"), Err(EBUSY));
    m.w(remove, "1").unwrap();
}

#[test]
fn fault_delay_holds_the_write_then_applies_it() {
    let Some(m) = mount("2xA10") else { return };
    m.ctl("fault unbind * delay=200 count=1");
    let start = std::time::Instant::now();
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    // A lower bound only: the write cannot finish before the delay.
    assert!(start.elapsed() >= std::time::Duration::from_millis(200));
    assert_eq!(m.driver(GPU), None);
}

#[test]
fn fault_after_applies_the_write_at_once_and_holds_the_answer() {
    let Some(m) = mount("2xA10") else { return };
    m.ctl("fault unbind * after=2000 count=1");
    std::thread::scope(|s| {
        let writer = s.spawn(|| m.w("sys/bus/pci/drivers/nvidia/unbind", GPU));
        // The kernel's side is done while the writer still waits for its answer.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while m.driver(GPU).is_some() {
            assert!(
                std::time::Instant::now() < end,
                "the unbind never took effect"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!writer.is_finished(), "answered before its after=2000");
        assert_eq!(writer.join().unwrap(), Ok(()));
    });
    assert_eq!(m.driver(GPU), None);
}

#[test]
fn bad_control_commands_fail_with_einval() {
    let Some(m) = mount("2xA10") else { return };
    for bad in [
        "frobnicate",
        "fault teleport * EBUSY",
        "fault unbind * ENOTANERRNO",
        "fault unbind *",
        "fault unbind * delay=10 after=10",
        "fault unbind * after=soon",
        "hold abc",
        "hotplug 0000:81:00.0 NOPE",
        "unplug 0000:99:00.0",
    ] {
        assert_eq!(
            m.w("sys/kernel/node-sim/control", bad),
            Err(EINVAL),
            "{bad}"
        );
        assert!(m.sim.control(bad).is_err(), "{bad}");
    }
    // Control writes are not kernel writes: not in the op log.
    assert!(m.sim.ops().is_empty());
}

#[test]
fn hold_shows_a_synthetic_vm_in_proc_and_blocks_opens() {
    let Some(m) = mount("2xA10") else { return };
    m.w(
        &format!("sys/bus/pci/devices/{GPU}/driver_override"),
        "vfio-pci",
    )
    .unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    m.w(
        "sys/kernel/node-sim/control",
        "hold 21 pid=4242 comm=virt-launcher",
    )
    .unwrap();
    assert_eq!(m.r("proc/4242/comm"), "virt-launcher");
    let fds = m.ls("proc/4242/fd");
    assert_eq!(fds.len(), 1);
    assert_eq!(m.link(&format!("proc/4242/fd/{}", fds[0])), "/dev/vfio/21");
    let e = std::fs::File::open(m.p("dev/vfio/21")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EBUSY));
    m.ctl("release 21");
    assert!(!m.exists("proc/4242"));
    std::fs::File::open(m.p("dev/vfio/21")).unwrap();
    // Default pid and comm.
    m.ctl("hold 21");
    assert_eq!(m.r("proc/900021/comm"), "qemu-kvm");
}

#[test]
fn nvidia_device_opens_are_recorded() {
    let Some(m) = mount("2xA10") else { return };
    let _f = std::fs::File::open(m.p("dev/nvidia0")).unwrap();
    let me = std::process::id();
    let fds = m.ls(&format!("proc/{me}/fd"));
    assert_eq!(m.link(&format!("proc/{me}/fd/{}", fds[0])), "/dev/nvidia0");
}

#[test]
fn hotplug_and_unplug() {
    let Some(m) = mount("2xA10") else { return };
    m.w(
        "sys/kernel/node-sim/control",
        "hotplug 0000:81:00.0 L40S group=90 numa=1",
    )
    .unwrap();
    let d = "sys/bus/pci/devices/0000:81:00.0";
    assert_eq!(m.r(&format!("{d}/device")), "0x26b9");
    assert_eq!(m.r(&format!("{d}/numa_node")), "1");
    assert_eq!(m.driver("0000:81:00.0").as_deref(), Some("nvidia"));
    assert!(
        m.link(&format!("{d}/iommu_group"))
            .ends_with("iommu_groups/90")
    );
    assert!(m.exists("dev/nvidia2"));

    // Unplug a GPU on vfio-pci with VFs: everything about it goes.
    m.w(&format!("sys/bus/pci/devices/{GPU}/sriov_numvfs"), "2")
        .unwrap();
    let driver_override = std::fs::OpenOptions::new()
        .write(true)
        .open(m.p(&format!("sys/bus/pci/devices/{GPU}/driver_override")))
        .unwrap();
    m.ctl("unplug 0000:41:00.0");
    assert!(!m.exists(&format!("sys/bus/pci/devices/{GPU}")));
    assert!(!m.exists("sys/bus/pci/devices/0000:41:00.4"));
    assert!(!m.exists("sys/kernel/iommu_groups/21"));
    assert!(!m.exists("sys/bus/pci/drivers/nvidia/0000:41:00.0"));
    assert!(!m.exists("dev/nvidia0"));
    // A write through a file opened before the unplug.
    use std::io::Write;
    let e = (&driver_override).write_all(b"vfio-pci\n").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(ENODEV));
    assert_eq!(m.w("sys/bus/pci/drivers_probe", GPU), Err(ENODEV));
}

#[test]
fn op_log_lists_every_write_in_order() {
    let Some(m) = mount("2xA10") else { return };
    m.w(
        &format!("sys/bus/pci/devices/{GPU}/driver_override"),
        "vfio-pci",
    )
    .unwrap();
    m.w("sys/bus/pci/drivers/nvidia/unbind", GPU).unwrap();
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    let _ = m.w("sys/bus/pci/drivers/vfio-pci/unbind", "0000:61:00.0");
    m.w(&format!("sys/bus/pci/devices/{GPU}/driver_override"), "")
        .unwrap();
    let text = m.r("sys/kernel/node-sim/ops");
    assert_eq!(
        text,
        "1 sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/driver_override vfio-pci ok\n\
         2 sys/bus/pci/drivers/nvidia/unbind 0000:41:00.0 ok\n\
         3 sys/bus/pci/drivers_probe 0000:41:00.0 ok\n\
         4 sys/bus/pci/drivers/vfio-pci/unbind 0000:61:00.0 ENODEV\n\
         5 sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/driver_override \"\" ok"
    );
    let ops = m.sim.ops();
    assert_eq!(ops.len(), 5);
    assert_eq!(
        ops.iter().filter(|o| o.path.ends_with("/unbind")).count(),
        2
    );
    assert!(!ops[3].is_ok());
    assert_eq!(ops[3].result, "ENODEV");
    m.ctl("clear-ops");
    assert_eq!(m.r("sys/kernel/node-sim/ops"), "");
    m.w("sys/bus/pci/drivers_probe", GPU).unwrap();
    assert_eq!(m.sim.ops().len(), 1);
    m.sim.clear_ops();
    assert!(m.sim.ops().is_empty());
}
