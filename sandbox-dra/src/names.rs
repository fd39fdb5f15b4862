//! Names the driver gives things in the API: a device's name in its pool is derived from its
//! PCI address (DNS label: lowercase, digits and `-`, at most 63 characters), so that prepare
//! finds the function a claim's allocation names without asking anyone.

use common::PciAddress;

/// The device name of the GPU at `addr`: `gpu-0000-3b-00-0` for `0000:3b:00.0`.
pub fn gpu_device(addr: &PciAddress) -> String {
    format!(
        "gpu-{:04x}-{:02x}-{:02x}-{:x}",
        addr.domain, addr.bus, addr.device, addr.function
    )
}

/// The PCI address a [`gpu_device`] name stands for; `None` for any other name.
pub fn parse_gpu_device(name: &str) -> Option<PciAddress> {
    let rest = name.strip_prefix("gpu-")?;
    let mut parts = rest.split('-');
    let (Some(d), Some(b), Some(s), Some(f), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let addr: PciAddress = format!("{d}:{b}:{s}.{f}").parse().ok()?;
    // Only the canonical (lowercase, zero-padded) spelling names a device.
    (gpu_device(&addr) == name).then_some(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_are_dns_labels() {
        let addr: PciAddress = "0000:3B:00.0".parse().unwrap();
        let name = gpu_device(&addr);
        assert_eq!(name, "gpu-0000-3b-00-0");
        assert!(name.len() <= 63);
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        assert_eq!(parse_gpu_device(&name), Some(addr));
    }

    #[test]
    fn other_names_are_not_gpus() {
        for n in [
            "gpu-0000-3B-00-0",
            "gpu-0000-3b-00",
            "vgpu-0000-3b-00-0",
            "gpu-0000-3b-00-0-1",
            "gpu-0-3b-0-0",
        ] {
            assert_eq!(parse_gpu_device(n), None, "{n}");
        }
    }
}
