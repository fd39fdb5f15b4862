//! The vGPU type catalogue (`catalogue.toml`, embedded): GPU models, their PCI identity, SR-IOV
//! layout, how vGPUs attach, and their vGPU types.

use std::sync::OnceLock;

use serde::Deserialize;

const CATALOGUE_TOML: &str = include_str!("../catalogue.toml");

/// How a GPU model exposes vGPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Attach {
    /// mdev types on the GPU (PF) itself (Turing).
    PfMdev,
    /// mdev types on each SR-IOV VF, one vGPU per VF (Ampere).
    VfMdev,
    /// NVIDIA's vendor-specific path: `<vf>/nvidia/current_vgpu_type` (Ada, Hopper).
    VfVendor,
    /// No vGPU (consumer GPUs).
    None,
}

/// One vGPU type of a GPU model.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VgpuTypeDef {
    /// Numeric id: `nvidia-<id>` in sysfs, the NVML vGPU type id.
    pub id: u32,
    /// The short name after the model (`4Q`).
    pub name: String,
    /// Maximum instances on one GPU (equal-size mode).
    pub max: u32,
    /// Framebuffer of one instance, MB.
    pub framebuffer_mb: u32,
    /// Series letter: Q, B, A or C.
    pub series: String,
    /// MIG-backed (listed, never offered by node-sim: it has no MIG mode).
    #[serde(default)]
    pub mig: bool,
    /// `A10-4Q`: the key NVIDIA's vgpu-device-manager configs use. Filled in at load.
    #[serde(skip)]
    pub key: String,
    /// `NVIDIA A10-4Q`: the type's sysfs `name`. Filled in at load.
    #[serde(skip)]
    pub full_name: String,
}

impl VgpuTypeDef {
    /// The mdev type directory name (`nvidia-593`).
    pub fn sysfs_id(&self) -> String {
        format!("nvidia-{}", self.id)
    }

    /// The `description` file's contents (without newline), as NVIDIA's driver writes it.
    pub fn description(&self) -> String {
        let (heads, frl, res) = match self.series.as_str() {
            "Q" if self.framebuffer_mb <= 1024 => (4, 60, "5120x2880"),
            "Q" => (4, 60, "7680x4320"),
            "B" => (4, 45, "5120x2880"),
            "A" => (1, 60, "1280x1024"),
            _ => (1, 60, "4096x2160"),
        };
        format!(
            "num_heads={heads}, frl_config={frl}, framebuffer={}M, max_resolution={res}, max_instance={}",
            self.framebuffer_mb, self.max
        )
    }
}

/// One GPU model.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuModel {
    /// Key used by topologies (`A10`, `A100-SXM4-80GB`).
    pub model: String,
    /// PF device id (vendor is 0x10de).
    pub device: u16,
    /// Subsystem vendor id.
    pub subsystem_vendor: u16,
    /// Subsystem device id.
    pub subsystem_device: u16,
    /// The pci.ids device name (`GA102GL [A10]`).
    pub pci_name: String,
    /// PCI class, 24 bits (`0x030200`).
    pub class: u32,
    /// Memory of one GPU, MB.
    pub framebuffer_mb: u32,
    /// `sriov_totalvfs`; 0 when the model has no SR-IOV.
    pub sriov_totalvfs: u32,
    /// Device id of the VFs.
    #[serde(default)]
    pub vf_device: Option<u16>,
    /// How vGPUs attach.
    pub attach: Attach,
    /// `GRID` or `NVIDIA`.
    pub name_prefix: String,
    /// `A10` in `NVIDIA A10-4Q`.
    pub type_prefix: String,
    /// vGPU types.
    pub types: Vec<VgpuTypeDef>,
}

impl GpuModel {
    /// The type with numeric id `id`.
    pub fn vgpu_type(&self, id: u32) -> Option<&VgpuTypeDef> {
        self.types.iter().find(|t| t.id == id)
    }

    /// Types node-sim offers (MIG-backed ones excluded).
    pub fn offered_types(&self) -> impl Iterator<Item = &VgpuTypeDef> {
        self.types.iter().filter(|t| !t.mig)
    }
}

/// The whole catalogue.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalogue {
    /// GPU models, in file order.
    #[serde(rename = "gpu")]
    pub gpus: Vec<GpuModel>,
}

impl Catalogue {
    /// Parses a catalogue file's text and fills in each type's key and full name.
    pub fn parse(text: &str) -> Result<Catalogue, toml::de::Error> {
        let mut cat: Catalogue = toml::from_str(text)?;
        for g in &mut cat.gpus {
            for t in &mut g.types {
                t.key = format!("{}-{}", g.type_prefix, t.name);
                t.full_name = format!("{} {}", g.name_prefix, t.key);
            }
        }
        Ok(cat)
    }

    /// The model named `model` (`A10`).
    pub fn model(&self, model: &str) -> Option<&GpuModel> {
        self.gpus.iter().find(|g| g.model == model)
    }

    /// The model whose PF device id is `device`.
    pub fn by_device(&self, device: u16) -> Option<&GpuModel> {
        self.gpus.iter().find(|g| g.device == device)
    }
}

/// The embedded catalogue (`tests/node-sim/catalogue.toml`).
pub fn catalogue() -> &'static Catalogue {
    static CAT: OnceLock<Catalogue> = OnceLock::new();
    CAT.get_or_init(|| {
        // The file is embedded at build time and parsed by this crate's tests, so a parse
        // failure cannot reach a caller of a tested build.
        #[allow(clippy::expect_used)]
        Catalogue::parse(CATALOGUE_TOML).expect("embedded catalogue.toml parses")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_catalogue_parses_and_is_consistent() {
        let cat = Catalogue::parse(CATALOGUE_TOML).unwrap();
        for m in [
            "T4",
            "A10",
            "A16",
            "A40",
            "A100-SXM4-80GB",
            "A100-PCIE-80GB",
            "H100-SXM5",
            "H100-PCIE",
            "H200",
            "L40S",
        ] {
            let g = cat.model(m).unwrap_or_else(|| panic!("{m} missing"));
            assert!(!g.types.is_empty(), "{m} has no types");
            for t in &g.types {
                assert!(
                    t.framebuffer_mb * t.max <= g.framebuffer_mb,
                    "{} too big",
                    t.key
                );
                assert!(["Q", "B", "A", "C"].contains(&t.series.as_str()));
            }
            let mut ids: Vec<u32> = g.types.iter().map(|t| t.id).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), g.types.len(), "{m} has duplicate type ids");
            if g.attach != Attach::PfMdev {
                assert!(
                    g.sriov_totalvfs > 0 && g.vf_device.is_some(),
                    "{m} needs VFs"
                );
            }
        }
        let a10 = cat.model("A10").unwrap();
        let t = a10.vgpu_type(593).unwrap();
        assert_eq!(t.full_name, "NVIDIA A10-4Q");
        assert_eq!(t.key, "A10-4Q");
        assert_eq!(t.max, 6);
        assert_eq!(
            cat.model("T4").unwrap().vgpu_type(230).unwrap().full_name,
            "GRID T4-1Q"
        );
        assert_eq!(
            t.description(),
            "num_heads=4, frl_config=60, framebuffer=4096M, max_resolution=7680x4320, max_instance=6"
        );
    }
}
