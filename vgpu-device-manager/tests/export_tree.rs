//! `export` on a plain tree with the kernel's mtty sample driver as a virtual mdev parent.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use std::fs;
use std::os::unix::fs::symlink;
use std::process::Command;

const UUID: &str = "5c1e8a10-97a5-4d0e-9d3a-2b8a2f2b6a01";

fn mtty_tree() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path();
    fs::create_dir_all(r.join("sys/bus/pci/devices")).unwrap();
    fs::create_dir_all(r.join("sys/class/mdev_bus")).unwrap();
    fs::create_dir_all(r.join("sys/bus/mdev/devices")).unwrap();
    fs::create_dir_all(r.join("proc")).unwrap();
    let parent = r.join("sys/devices/virtual/mtty/mtty");
    for (id, name, avail) in [
        ("mtty-1", "Single port serial", "22"),
        ("mtty-2", "Dual port serial", "11"),
    ] {
        let t = parent.join("mdev_supported_types").join(id);
        fs::create_dir_all(t.join("devices")).unwrap();
        fs::write(t.join("name"), format!("{name}\n")).unwrap();
        fs::write(t.join("available_instances"), format!("{avail}\n")).unwrap();
        fs::write(t.join("device_api"), "vfio-pci\n").unwrap();
    }
    symlink(
        "../../devices/virtual/mtty/mtty",
        r.join("sys/class/mdev_bus/mtty"),
    )
    .unwrap();
    let m = parent.join(UUID);
    fs::create_dir_all(&m).unwrap();
    symlink("../mdev_supported_types/mtty-2", m.join("mdev_type")).unwrap();
    symlink(
        format!("../../../devices/virtual/mtty/mtty/{UUID}"),
        r.join("sys/bus/mdev/devices").join(UUID),
    )
    .unwrap();
    dir
}

#[test]
fn export_uses_the_type_id_when_names_share_their_last_word() {
    let dir = mtty_tree();
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-device-manager"))
        .args(["export", "--vendor", "any", "-c", "now", "--host-root"])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("mtty-2: 1"), "{text}");
    assert!(!text.contains("serial"), "{text}");

    // What export wrote is what assert accepts.
    let cfg = dir.path().join("exported.yaml");
    fs::write(&cfg, text.as_bytes()).unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_vgpu-device-manager"))
        .args(["assert", "--vendor", "any", "-c", "now", "-f"])
        .arg(&cfg)
        .arg("--host-root")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
}

#[test]
fn without_a_readable_proc_no_vgpu_is_removed() {
    let dir = mtty_tree();
    fs::remove_dir(dir.path().join("proc")).unwrap();
    let cfg = dir.path().join("config.yaml");
    fs::write(
        &cfg,
        "version: v1\nvgpu-configs:\n  none:\n    - devices: all\n      vgpu-devices: {}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-device-manager"))
        .args(["apply", "--vendor", "any", "-c", "none", "-f"])
        .arg(&cfg)
        .arg("--host-root")
        .arg(dir.path())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("cannot read the processes"), "{text}");
    assert!(
        dir.path()
            .join("sys/devices/virtual/mtty/mtty")
            .join(UUID)
            .exists(),
        "the vGPU is still there"
    );
}
