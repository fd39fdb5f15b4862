//! `export` on a plain tree with the kernel's mtty sample driver as a virtual mdev parent.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

use std::fs;
use std::process::Command;

use testkit::sysfs::SysfsTree;

const UUID: &str = "5c1e8a10-97a5-4d0e-9d3a-2b8a2f2b6a01";

/// The kernel's mtty sample driver as a virtual mdev parent with one `mtty-2` instance.
fn mtty_tree() -> SysfsTree {
    let t = SysfsTree::new();
    fs::create_dir_all(t.root().join("proc")).unwrap();
    let parent = t.root().join("sys/devices/virtual/mtty/mtty");
    for (id, name, avail) in [
        ("mtty-1", "Single port serial", 22),
        ("mtty-2", "Dual port serial", 11),
    ] {
        let ty = t.mdev_type(&parent, id, name, avail);
        fs::write(ty.join("device_api"), "vfio-pci\n").unwrap();
    }
    t.mdev_parent("virtual/mtty/mtty", "mtty");
    t.mdev("virtual/mtty/mtty", UUID, "mtty-2", None);
    t
}

#[test]
fn export_uses_the_type_id_when_names_share_their_last_word() {
    let dir = mtty_tree();
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-device-manager"))
        .args(["export", "--vendor", "any", "-c", "now", "--host-root"])
        .arg(dir.root())
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
    let cfg = dir.root().join("exported.yaml");
    fs::write(&cfg, text.as_bytes()).unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_vgpu-device-manager"))
        .args(["assert", "--vendor", "any", "-c", "now", "-f"])
        .arg(&cfg)
        .arg("--host-root")
        .arg(dir.root())
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
    fs::remove_dir(dir.root().join("proc")).unwrap();
    let (code, text) = run_none(&dir, "apply");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("cannot read the processes"), "{text}");
    assert!(
        dir.root()
            .join("sys/devices/virtual/mtty/mtty")
            .join(UUID)
            .exists(),
        "the vGPU is still there"
    );
}

/// `plan` and `apply` of a profile that empties every parent, on the mtty tree.
fn run_none(dir: &SysfsTree, sub: &str) -> (Option<i32>, String) {
    let cfg = dir.root().join("none.yaml");
    fs::write(
        &cfg,
        "version: v1\nvgpu-configs:\n  none:\n    - devices: all\n      vgpu-devices: {}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-device-manager"))
        .args([sub, "--vendor", "any", "-c", "none", "-f"])
        .arg(&cfg)
        .arg("--host-root")
        .arg(dir.root())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn an_mdev_parent_a_pool_holds_is_left_alone() {
    let dir = mtty_tree();
    // Unpooled, the profile would remove the parent's vGPU.
    let (code, text) = run_none(&dir, "plan");
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(UUID) && !text.contains("left alone"),
        "{text}"
    );

    // sandbox-dp pooled the parent (`--on-demand mtty`), then sandbox-dra's pool holds it.
    fs::create_dir_all(dir.root().join("run/gpu-vm-node")).unwrap();
    for (file, owner) in [
        ("on-demand-pool", "sandbox-dp's on-demand pool"),
        ("dra-pool", "sandbox-dra's vGPU pool"),
    ] {
        let pool = dir.root().join("run/gpu-vm-node").join(file);
        fs::write(&pool, "mtty\n").unwrap();
        let (code, text) = run_none(&dir, "plan");
        assert_eq!(code, Some(0), "{text}");
        assert!(
            text.contains(&format!("GPU 0 (mtty): in {owner}; left alone")) && !text.contains(UUID),
            "{text}"
        );
        let (code, text) = run_none(&dir, "apply");
        assert_eq!(code, Some(0), "{text}");
        let remove = dir
            .root()
            .join("sys/devices/virtual/mtty/mtty")
            .join(UUID)
            .join("remove");
        assert!(
            fs::read_to_string(&remove).unwrap_or_default().is_empty(),
            "the vGPU was not removed: {text}"
        );
        fs::remove_file(&pool).unwrap();
    }
}
