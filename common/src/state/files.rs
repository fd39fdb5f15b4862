//! The one list of the files the daemons keep on the host; docs/architecture.md shows it as a
//! table, which a test keeps equal to [`markdown_table`].

/// One file (or family of files) the daemons keep on the host.
#[derive(Debug, PartialEq, Eq)]
pub struct StateFile {
    /// Where, under the host root.
    pub path: &'static str,
    /// The module of `common` that reads and writes it.
    pub owner: &'static str,
    /// Its format, and how it says its version.
    pub format: &'static str,
    /// Who writes it, and when.
    pub writer: &'static str,
    /// Who reads it.
    pub reader: &'static str,
    /// What a reboot does to it: `/run` is emptied at boot, as are the bindings and vGPUs the
    /// files there describe; kubelet's directory is kept.
    pub after_reboot: &'static str,
}

/// Every file the daemons keep on the host.
pub const FILES: &[StateFile] = &[
    StateFile {
        path: "run/nvidia/validations/vfio-pci-ready",
        owner: "state::readiness",
        format: "text, for its waiters (no version: its presence is the message)",
        writer: "vfio-manager `daemon` (one left from before removed at its start; written again when removed: `daemon_kit::readiness`); also the GPU Operator's validator",
        reader: "sandbox-dp `wait-ready` (the chart's init container) on `vm-passthrough` nodes; the operator's init containers",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/nvidia/validations/vgpu-devices-ready",
        owner: "state::readiness",
        format: "text, for its waiters (no version: its presence is the message)",
        writer: "vgpu-device-manager `daemon` (one left from before removed at its start; written again when removed: `daemon_kit::readiness`); also the GPU Operator's validator",
        reader: "sandbox-dp `wait-ready` (the chart's init container) on `vm-vgpu` nodes; the operator's init containers",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/gpu-vm-node/vgpu-type-names",
        owner: "state::vgpu_names",
        format: "`ID<TAB>NAME` lines after `# gpu-vm-node vgpu-type-names v1`",
        writer: "vgpu-device-manager `apply`, before it sets a vendor-path type",
        reader: "the `Inventory` (every daemon)",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/gpu-vm-node/on-demand-pool",
        owner: "state::pool",
        format: "a GPU address or mdev parent a line, after `# gpu-vm-node on-demand-pool v1`",
        writer: "sandbox-dp `--on-demand`, at start",
        reader: "vgpu-device-manager (leaves its members alone), sandbox-dra (refuses to share one)",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/gpu-vm-node/dra-pool",
        owner: "state::pool",
        format: "a GPU address or mdev parent a line, after `# gpu-vm-node dra-pool v1`",
        writer: "sandbox-dra `--vgpu`, at start",
        reader: "vgpu-device-manager (leaves its members alone)",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/gpu-vm-node/{on-demand-pool,dra-pool,pools}.lock",
        owner: "state::pool",
        format: "empty files, for `flock`",
        writer: "a pool's owner holds its `<pool>.lock` while it runs; either holds `pools.lock` from its read of the other pool to its own write",
        reader: "vgpu-device-manager and the other owner (whether an owner runs)",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/gpu-vm-node/on-demand-vgpus.json",
        owner: "state::write_atomic_until_reboot",
        format: "JSON, `\"version\": 1`",
        writer: "sandbox-dp `--on-demand`, before and after each vGPU it creates or removes",
        reader: "sandbox-dp, at start and after a crash",
        after_reboot: "gone",
    },
    StateFile {
        path: "run/vfio-manager/original-drivers",
        owner: "state::originals, state::write_atomic_until_reboot",
        format: "`BDF DRIVER` lines after `# gpu-vm-node original-drivers v1`",
        writer: "vfio-manager `bind` (before it binds), `unbind`; sandbox-dra's prepare (before it binds) and unprepare",
        reader: "vfio-manager `unbind`, sandbox-dra's prepare and unprepare",
        after_reboot: "gone",
    },
    StateFile {
        path: "`<kubelet-root>/plugins/<driver>/claims/<uid>.json`",
        owner: "state::write_atomic_until_reboot",
        format: "JSON, `\"version\": 1`",
        writer: "sandbox-dra's prepare, before its first change to the node; removed by its unprepare",
        reader: "sandbox-dra: prepare, unprepare, and at start; every daemon's in-use check (`usage`, every driver's `claims/`)",
        after_reboot: "kept (not flushed: after a crash of the machine it may be an older one; the start brings it in line, and kubelet prepares the claim again)",
    },
    StateFile {
        path: "`<kubelet-root>/plugins/<driver>/metadata/<namespace>_<claim>/<request>/metadata.json`",
        owner: "state::write_atomic_mode, state::Flush::No",
        format: "JSON, KEP-5304's device metadata (mode 0644)",
        writer: "sandbox-dra's prepare; removed by its unprepare",
        reader: "KubeVirt's virt-launcher (mounted by the CDI spec)",
        after_reboot: "kept (written again by the claim's next prepare)",
    },
    StateFile {
        path: "`<cdi-root>/<driver>_<uid>.json`",
        owner: "state::write_atomic_mode, state::Flush::No",
        format: "JSON, a CDI spec (`cdiVersion`; mode 0644)",
        writer: "sandbox-dra's prepare; removed by its unprepare",
        reader: "the container runtime",
        after_reboot: "gone where `/var/run` is `/run` (most hosts)",
    },
    StateFile {
        path: "`<kubelet-dir>/sandbox-dp-<resource>.sock`",
        owner: "state::remove_if_present, state::file_identity",
        format: "Unix sockets (bound by sandbox-dp's servers)",
        writer: "sandbox-dp; removed on the way out",
        reader: "kubelet",
        after_reboot: "removed by kubelet when it starts",
    },
];

/// [`FILES`] as the Markdown table docs/architecture.md shows.
pub fn markdown_table() -> String {
    let mut out = String::from(
        "| File (under `--host-root`) | Owner in `common` | Format | Written by | Read by | After a reboot |\n\
         |---|---|---|---|---|---|\n",
    );
    for f in FILES {
        let path = if f.path.starts_with('`') {
            f.path.to_string()
        } else {
            format!("`{}`", f.path)
        };
        let owner = f
            .owner
            .split(", ")
            .map(|o| format!("`{o}`"))
            .collect::<Vec<_>>()
            .join(", ");
        out.push_str(&format!(
            "| {path} | {owner} | {} | {} | {} | {} |\n",
            f.format, f.writer, f.reader, f.after_reboot
        ));
    }
    out
}
