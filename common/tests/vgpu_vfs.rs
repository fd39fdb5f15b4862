//! Enabling a GPU's VFs for vGPUs (`lifecycle::enable_vfs`, what sandbox-dp's on-demand pool and
//! sandbox-dra's prepare both call) against a simulated node (node-sim), whose `sriov_numvfs`
//! makes the VFs and their vGPU types as the kernel and NVIDIA's driver do.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed setup step should panic

use common::vgpu::lifecycle::{Member, enable_vfs, offers};
use common::vgpu::{Mode, capacity};
use common::{HostPaths, PciAddress, ReadOptions, Sysfs, error_chain};

#[test]
fn a_gpus_vfs_are_enabled_and_waited_for_until_they_show_their_types() {
    let Some(sim) = testkit::sim::try_mount("2xA10") else {
        return;
    };
    let paths = HostPaths::new(sim.root());
    let sysfs = Sysfs::new(paths.clone());
    let gpu: PciAddress = "0000:41:00.0".parse().unwrap();
    let opts = ReadOptions::default();
    let mut inv = Member::Gpu(gpu).read(&paths, &opts).unwrap();
    let Mode::NeedsVfs { total } = capacity(&inv, &gpu).mode else {
        panic!("an A10 shows its vGPU types on its VFs only")
    };

    // Refused by the kernel: an error naming the GPU and the file, nothing changed.
    sim.control("fault sriov_numvfs 0000:41:00.0 EBUSY count=1")
        .unwrap();
    let e = enable_vfs(&sysfs, &paths, &mut inv, &gpu, total, &opts).unwrap_err();
    let msg = error_chain(&e);
    assert!(
        msg.contains("0000:41:00.0") && msg.contains("sriov_numvfs"),
        "{msg}"
    );
    assert!(matches!(capacity(&inv, &gpu).mode, Mode::NeedsVfs { .. }));

    // Enabled: the view it was given shows the VFs' types when it returns.
    assert!(enable_vfs(&sysfs, &paths, &mut inv, &gpu, total, &opts).unwrap());
    let cap = capacity(&inv, &gpu);
    assert!(!matches!(cap.mode, Mode::NeedsVfs { .. }), "{:?}", cap.mode);
    let o = offers(&inv, &Member::Gpu(gpu)).unwrap();
    assert_eq!(o.needs_vfs, None);
    assert!(
        o.find(|t| t.name == "NVIDIA A10-4Q").is_some(),
        "A10-4Q offered once the VFs show their types"
    );
    let vfs = std::fs::read_to_string(paths.pci_device(&gpu).join("sriov_numvfs")).unwrap();
    assert_eq!(vfs.trim(), total.to_string());
}
