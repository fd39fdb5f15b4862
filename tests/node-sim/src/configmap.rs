//! The default vGPU ConfigMap (`deploy/helm/gpu-vm-node/files/vgpu-config.yaml`, which the
//! chart's ConfigMap holds), generated from the catalogue.
//!
//! The ConfigMap holds one file, `config.yaml`, in NVIDIA's vgpu-device-manager format
//! (`version: v1`, `vgpu-configs`), with:
//!
//! - `default`: one entry per GPU model that has vGPU types, selected by its `device-filter`
//!   (`0xDDDDVVVV`), making as many vGPUs as fit of the Q-series type with half the GPU's memory
//!   (the largest one not above half, when no type is exactly half). A model without Q-series
//!   types (A100, H100, H200) gets the C-series type chosen the same way.
//! - `all-disabled`: no vGPUs on any GPU (the name NVIDIA's configs use).
//! - one profile per vGPU type, named by its key (`A10-4Q`): every GPU of that model filled with
//!   that type (`max` instances). MIG-backed types are left out: they need MIG mode and GPU
//!   instances first, which the profile alone cannot give.
//!
//! `tests/node-sim/tests/configmap.rs` checks that the committed file equals this output, and
//! rewrites it with `UPDATE_CONFIGMAP=1`.

use std::fmt::Write as _;

use crate::catalogue::{Attach, Catalogue, GpuModel, VgpuTypeDef};

/// NVIDIA's PCI vendor id.
const NVIDIA_VENDOR: u16 = 0x10de;

/// The ConfigMap's name in the Helm chart's defaults (the GPU Operator's name for it).
pub const CONFIGMAP_NAME: &str = "default-vgpu-devices-config";

/// The key (file name) of the config inside the ConfigMap.
pub const CONFIG_KEY: &str = "config.yaml";

/// The `device-filter` value for a model: device id then vendor id, upper-case hex
/// (`0x223610DE`), as NVIDIA's vgpu-device-manager writes it.
pub fn device_filter(model: &GpuModel) -> String {
    format!("0x{:04X}{:04X}", model.device, NVIDIA_VENDOR)
}

/// The type `default` uses for a model: the Q-series type with the largest framebuffer not above
/// half the GPU's memory, or the C-series type chosen the same way when the model has no
/// Q-series type. `None` for a model without such a type (no vGPU).
pub fn default_type(model: &GpuModel) -> Option<&VgpuTypeDef> {
    let half = model.framebuffer_mb / 2;
    let pick = |series: &str| {
        model
            .offered_types()
            .filter(|t| t.series == series && t.framebuffer_mb <= half && t.max > 0)
            .max_by_key(|t| t.framebuffer_mb)
    };
    let has_q = model.offered_types().any(|t| t.series == "Q");
    if has_q { pick("Q") } else { pick("C") }
}

/// Models that can make vGPUs, in catalogue order.
fn vgpu_models(cat: &Catalogue) -> impl Iterator<Item = &GpuModel> {
    cat.gpus
        .iter()
        .filter(|g| g.attach != Attach::None && g.offered_types().next().is_some())
}

/// The `config.yaml` text: `default` first, then one profile per vGPU type in catalogue order.
/// A type key that two models share becomes one profile with one entry per model.
pub fn default_vgpu_config(cat: &Catalogue) -> String {
    let mut out = String::new();
    out.push_str("version: v1\nvgpu-configs:\n");

    out.push_str(
        "  # Every GPU: as many vGPUs as fit of the Q-series type with half its memory\n\
         \x20 # (C-series for models without Q-series types).\n",
    );
    out.push_str("  default:\n");
    for model in vgpu_models(cat) {
        if let Some(t) = default_type(model) {
            let _ = writeln!(out, "    # {} ({})", model.model, model.pci_name);
            push_entry(&mut out, model, t);
        }
    }

    // No vGPUs at all: what a node is set to before it leaves vGPU duty (as in NVIDIA's configs).
    out.push_str(
        "  # No vGPUs on any GPU.\n  all-disabled:\n    - devices: all\n      vgpu-devices: {}\n",
    );

    // Profiles keyed by type key, in first-seen order; each gathers every model offering it.
    let mut profiles: Vec<(&str, Vec<(&GpuModel, &VgpuTypeDef)>)> = Vec::new();
    for model in vgpu_models(cat) {
        for t in model.offered_types() {
            if t.max == 0 {
                continue;
            }
            match profiles.iter_mut().find(|(k, _)| *k == t.key) {
                Some((_, entries)) => entries.push((model, t)),
                None => profiles.push((t.key.as_str(), vec![(model, t)])),
            }
        }
    }
    for (key, entries) in profiles {
        let _ = writeln!(out, "  {}:", yaml_key(key));
        for (model, t) in entries {
            push_entry(&mut out, model, t);
        }
    }
    out
}

/// One `devices: all` entry for `model` filled with `max` vGPUs of type `t`.
fn push_entry(out: &mut String, model: &GpuModel, t: &VgpuTypeDef) {
    let _ = writeln!(out, "    - devices: all");
    let _ = writeln!(out, "      device-filter: \"{}\"", device_filter(model));
    let _ = writeln!(out, "      vgpu-devices:");
    let _ = writeln!(out, "        \"{}\": {}", t.key, t.max);
}

/// A profile name as a YAML mapping key: plain when it is safe, quoted otherwise.
fn yaml_key(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && key.starts_with(|c: char| c.is_ascii_alphabetic());
    if plain {
        key.to_string()
    } else {
        format!("\"{key}\"")
    }
}

/// The whole ConfigMap manifest (`deploy/helm/gpu-vm-node/files/vgpu-config.yaml`) holding
/// [`default_vgpu_config`] under the key `config.yaml`.
pub fn default_vgpu_configmap(cat: &Catalogue) -> String {
    let mut out = String::new();
    out.push_str(
        "# GENERATED from tests/node-sim/catalogue.toml by tests/node-sim/src/configmap.rs: do not\n\
         # edit by hand. Regenerate with deploy/generate.sh (which runs\n\
         #   UPDATE_CONFIGMAP=1 cargo test -p node-sim --test configmap).\n\
         #\n\
         # The vGPU profiles vgpu-device-manager reads (NVIDIA vgpu-device-manager format). A node\n\
         # picks one with the label nvidia.com/vgpu.config=<profile>; without it, \"default\".\n\
         # To use your own profiles, replace this ConfigMap (same name, key config.yaml).\n",
    );
    out.push_str("apiVersion: v1\nkind: ConfigMap\nmetadata:\n");
    let _ = writeln!(out, "  name: {CONFIGMAP_NAME}");
    out.push_str(
        "  labels:\n    app.kubernetes.io/name: vgpu-device-manager\n    app.kubernetes.io/part-of: gpu-vm-node\n",
    );
    out.push_str("data:\n");
    let _ = writeln!(out, "  {CONFIG_KEY}: |");
    for line in default_vgpu_config(cat).lines() {
        if line.is_empty() {
            out.push('\n');
        } else {
            let _ = writeln!(out, "    {line}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::catalogue;

    fn default_key(model: &str) -> String {
        let m = catalogue().model(model).unwrap();
        default_type(m).unwrap().key.clone()
    }

    #[test]
    fn default_is_half_memory_q_or_c() {
        assert_eq!(default_key("A10"), "A10-12Q");
        assert_eq!(default_key("T4"), "T4-8Q");
        assert_eq!(default_key("L40S"), "L40S-24Q");
        // No Q-series: C-series with half the memory.
        assert_eq!(default_key("A100-PCIE-80GB"), "A100D-40C");
        assert_eq!(default_key("H100-SXM5"), "H100XM-40C");
        // No type of exactly half (72192 MB): the largest below.
        assert_eq!(default_key("H200"), "H200X-70C");
        // No vGPU at all.
        assert!(default_type(catalogue().model("RTX4090").unwrap()).is_none());
    }

    #[test]
    fn config_lists_default_entries_and_one_profile_per_type() {
        let cfg = default_vgpu_config(catalogue());
        assert!(cfg.starts_with("version: v1\nvgpu-configs:\n"));
        assert!(cfg.contains(
            "    - devices: all\n      device-filter: \"0x223610DE\"\n      vgpu-devices:\n        \"A10-12Q\": 2\n"
        ));
        assert!(cfg.contains(
            "  A10-4Q:\n    - devices: all\n      device-filter: \"0x223610DE\"\n      vgpu-devices:\n        \"A10-4Q\": 6\n"
        ));
        // Every offered type has its profile; MIG-backed types and GPUs without vGPU have none.
        for g in &catalogue().gpus {
            for t in &g.types {
                let header = format!("\n  {}:\n", t.key);
                assert_eq!(cfg.contains(&header), !t.mig, "{}", t.key);
            }
        }
        assert!(cfg.contains("\n  all-disabled:\n    - devices: all\n      vgpu-devices: {}\n"));
        assert!(!cfg.contains("RTX4090"));
        assert!(!cfg.contains("0x268410DE"));
    }

    #[test]
    fn models_with_vgpu_have_distinct_device_filters() {
        let mut filters: Vec<String> = vgpu_models(catalogue()).map(device_filter).collect();
        let n = filters.len();
        filters.sort();
        filters.dedup();
        assert_eq!(
            filters.len(),
            n,
            "two models share a device id: {filters:?}"
        );
    }

    #[test]
    fn configmap_embeds_the_config_indented() {
        let cm = default_vgpu_configmap(catalogue());
        assert!(cm.contains("kind: ConfigMap\n"));
        assert!(cm.contains("\n  name: default-vgpu-devices-config\n"));
        assert!(cm.contains("\n  config.yaml: |\n    version: v1\n    vgpu-configs:\n"));
        for line in cm
            .lines()
            .skip_while(|l| !l.starts_with("  config.yaml: |"))
            .skip(1)
        {
            assert!(line.starts_with("    "), "not indented: {line:?}");
        }
    }

    #[test]
    fn yaml_keys_are_quoted_only_when_needed() {
        assert_eq!(yaml_key("A10-4Q"), "A10-4Q");
        assert_eq!(yaml_key("A100D-1-10C"), "A100D-1-10C");
        assert_eq!(yaml_key("1Q"), "\"1Q\"");
        assert_eq!(yaml_key("a b"), "\"a b\"");
    }
}
