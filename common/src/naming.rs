//! Extended-resource names, compatible with NVIDIA's kubevirt-gpu-device-plugin so that VM
//! specs written for it keep working.
//!
//! - Passthrough: `nvidia.com/` + the `pci.ids` device name of the function (vendor-scoped),
//!   trimmed, upper-cased, each `/` and `.` and each whitespace run replaced by `_`, then every
//!   character outside `[A-Za-z0-9_]` removed: `GA102GL [A10]` → `nvidia.com/GA102GL_A10`. A
//!   device `pci.ids` does not name → its hex id: `nvidia.com/2236`.
//! - vGPU: `nvidia.com/` + the type name, whitespace → `_`: `NVIDIA A10-4Q` →
//!   `nvidia.com/NVIDIA_A10-4Q`.
//! - KubeVirt's env var: prefix + `_` + the resource name upper-cased with `/` and `.` → `_`:
//!   `PCI_RESOURCE_NVIDIA_COM_GA102GL_A10`.

mod pci_ids;

pub use pci_ids::{IdsSource, PciIds};

/// The resource-name prefix.
pub const RESOURCE_PREFIX: &str = "nvidia.com/";

/// The pinned NVIDIA block of `pci.ids`, the names used without `--pci-ids`.
const EMBEDDED: &str = include_str!("../data/nvidia-pci.ids");

/// `GA102GL [A10]` → `GA102GL_A10`.
pub fn sanitize_device_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_space = false;
    for c in name.trim().chars() {
        if c.is_whitespace() {
            if !in_space {
                out.push('_');
            }
            in_space = true;
            continue;
        }
        in_space = false;
        match c {
            '/' | '.' => out.push('_'),
            c if c.is_ascii_alphanumeric() || c == '_' => out.push(c.to_ascii_uppercase()),
            _ => {}
        }
    }
    out
}

/// The passthrough resource name of a device.
pub fn passthrough_resource_name(ids: &PciIds, vendor: u16, device: u16) -> String {
    let name = ids
        .device_name(vendor, device)
        .map(|n| sanitize_device_name(&n))
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| format!("{device:04x}"));
    format!("{RESOURCE_PREFIX}{name}")
}

/// The resource name of a vGPU type: `NVIDIA A10-4Q` → `nvidia.com/NVIDIA_A10-4Q`.
pub fn vgpu_resource_name(type_name: &str) -> String {
    let name: String = type_name
        .trim()
        .chars()
        .map(|c| if c.is_whitespace() { '_' } else { c })
        .collect();
    format!("{RESOURCE_PREFIX}{name}")
}

/// The env var KubeVirt's virt-launcher reads: `("PCI_RESOURCE", "nvidia.com/GA102GL_A10")` →
/// `PCI_RESOURCE_NVIDIA_COM_GA102GL_A10`.
pub fn env_var_name(prefix: &str, resource: &str) -> String {
    let r: String = resource
        .chars()
        .map(|c| match c {
            '/' | '.' => '_',
            c => c.to_ascii_uppercase(),
        })
        .collect();
    format!("{prefix}_{r}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_from_the_embedded_block() {
        let ids = PciIds::embedded();
        let name = |d| passthrough_resource_name(&ids, 0x10de, d);
        assert_eq!(name(0x2236), "nvidia.com/GA102GL_A10");
        assert_eq!(name(0x1eb8), "nvidia.com/TU104GL_TESLA_T4");
        assert_eq!(name(0x2331), "nvidia.com/GH100_H100_PCIE");
        assert_eq!(name(0x25b6), "nvidia.com/GA107GL_A2___A16");
        assert_eq!(name(0x20b2), "nvidia.com/GA100_A100_SXM4_80GB");
        assert_eq!(name(0x26b9), "nvidia.com/AD102GL_L40S");
        assert_eq!(name(0xfff0), "nvidia.com/fff0");
        // Vendor-scoped: 2331 of Intel is not an H100.
        assert_eq!(
            passthrough_resource_name(&ids, 0x8086, 0x2331),
            "nvidia.com/2331"
        );
    }

    #[test]
    fn rule_cases() {
        assert_eq!(sanitize_device_name("GA102GL [A10]"), "GA102GL_A10");
        assert_eq!(
            sanitize_device_name("TU104GL [Tesla T4]"),
            "TU104GL_TESLA_T4"
        );
        assert_eq!(sanitize_device_name("GH100 [H100 PCIe]"), "GH100_H100_PCIE");
        assert_eq!(sanitize_device_name("A2 / A16"), "A2___A16");
        assert_eq!(
            sanitize_device_name("  GV100  [Tesla V100.x]"),
            "GV100_TESLA_V100_X"
        );
    }

    #[test]
    fn vgpu_and_env_names() {
        assert_eq!(
            vgpu_resource_name("NVIDIA A10-4Q"),
            "nvidia.com/NVIDIA_A10-4Q"
        );
        assert_eq!(vgpu_resource_name("GRID T4-1Q"), "nvidia.com/GRID_T4-1Q");
        assert_eq!(
            env_var_name("PCI_RESOURCE", "nvidia.com/GA102GL_A10"),
            "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"
        );
        assert_eq!(
            env_var_name("MDEV_PCI_RESOURCE", "nvidia.com/NVIDIA_A10-4Q"),
            "MDEV_PCI_RESOURCE_NVIDIA_COM_NVIDIA_A10-4Q"
        );
    }

    #[test]
    fn a_file_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pci.ids");
        std::fs::write(
            &f,
            "# c\n10de  NVIDIA Corporation\n\t2236  Custom [Name]\n\t\t10de 1482  sub\n1234  QEMU\n\t1111  Virtual Video Controller\nC 00  Unclassified\n\t00  Non-VGA\n",
        )
        .unwrap();
        let ids = PciIds::from_file(&f).unwrap();
        assert_eq!(
            passthrough_resource_name(&ids, 0x10de, 0x2236),
            "nvidia.com/CUSTOM_NAME"
        );
        assert_eq!(
            passthrough_resource_name(&ids, 0x1234, 0x1111),
            "nvidia.com/VIRTUAL_VIDEO_CONTROLLER"
        );
        std::fs::write(&f, "garbage\n").unwrap();
        let e = PciIds::from_file(&f).unwrap_err();
        assert!(e.to_string().contains("not a pci.ids file"), "{e}");
        assert!(e.to_string().contains(&*f.to_string_lossy()), "{e}");
        let e = PciIds::from_file(&dir.path().join("missing")).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
    }

    proptest! {
        #[test]
        fn sanitized_names_only_hold_resource_characters(s in "\\PC{0,40}") {
            let n = sanitize_device_name(&s);
            prop_assert!(n.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'));
        }

        #[test]
        fn env_names_have_no_slash_or_dot(s in "[a-z./A-Z0-9_-]{0,30}") {
            let e = env_var_name("PCI_RESOURCE", &s);
            prop_assert!(!e.contains('/') && !e.contains('.'));
        }
    }
}
