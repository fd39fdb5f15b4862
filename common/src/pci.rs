//! PCI addresses, 16-bit PCI ids and the `--vendor` selector every binary takes.

use std::fmt;
use std::str::FromStr;

/// A PCI function address, `DDDD:BB:DD.F` (domain, bus, device, function), as sysfs names it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI domain (segment), 16 bits.
    pub domain: u16,
    /// Bus number.
    pub bus: u8,
    /// Device number, 0..=31.
    pub device: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

/// A string that is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a PCI address (DDDD:BB:DD.F): {0:?}")]
pub struct ParsePciAddressError(pub String);

impl PciAddress {
    /// A new address; `None` when device > 31 or function > 7.
    pub fn new(domain: u16, bus: u8, device: u8, function: u8) -> Option<Self> {
        (device < 32 && function < 8).then_some(PciAddress {
            domain,
            bus,
            device,
            function,
        })
    }
}

fn hex_field(s: &str, len: usize) -> Option<u32> {
    if s.len() != len || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

impl FromStr for PciAddress {
    type Err = ParsePciAddressError;

    /// Strict: exactly `DDDD:BB:DD.F` in hex (either case), device ≤ 0x1f, function ≤ 7.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParsePciAddressError(s.to_string());
        let (dbd, function) = s.split_once('.').ok_or_else(err)?;
        let mut parts = dbd.split(':');
        let (Some(domain), Some(bus), Some(device), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(err());
        };
        let domain = hex_field(domain, 4).ok_or_else(err)?;
        let bus = hex_field(bus, 2).ok_or_else(err)?;
        let device = hex_field(device, 2).ok_or_else(err)?;
        let function = hex_field(function, 1).ok_or_else(err)?;
        PciAddress::new(
            u16::try_from(domain).map_err(|_| err())?,
            u8::try_from(bus).map_err(|_| err())?,
            u8::try_from(device).map_err(|_| err())?,
            u8::try_from(function).map_err(|_| err())?,
        )
        .ok_or_else(err)
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl fmt::Debug for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl serde::Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PciAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses a 16-bit hex id (a PCI vendor or device id), with or without `0x`, 1 to 4 digits.
pub fn parse_hex16(s: &str) -> Option<u16> {
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u16::from_str_radix(digits, 16).ok()
}

/// `--vendor`: a PCI vendor id in hex (`10de`, `0x10DE`), or `any`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VendorSelector {
    /// Devices of this PCI vendor.
    Pci(u16),
    /// Any vendor's devices (and, where a binary says so, mdev parents that are not PCI).
    Any,
}

impl VendorSelector {
    /// The vendor id; `None` for [`VendorSelector::Any`].
    pub fn pci(self) -> Option<u16> {
        match self {
            VendorSelector::Pci(v) => Some(v),
            VendorSelector::Any => None,
        }
    }
}

/// A string that is neither a hex PCI vendor id nor `any`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a PCI vendor id in hex (e.g. 10de) or \"any\"")]
pub struct ParseVendorError(pub String);

impl FromStr for VendorSelector {
    type Err = ParseVendorError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("any") {
            return Ok(VendorSelector::Any);
        }
        parse_hex16(s)
            .map(VendorSelector::Pci)
            .ok_or_else(|| ParseVendorError(s.to_string()))
    }
}

impl fmt::Display for VendorSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VendorSelector::Pci(v) => write!(f, "{v:04x}"),
            VendorSelector::Any => f.write_str("any"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_and_formats() {
        let a: PciAddress = "0000:65:00.0".parse().unwrap();
        assert_eq!(a, PciAddress::new(0, 0x65, 0, 0).unwrap());
        assert_eq!(a.to_string(), "0000:65:00.0");
        let b: PciAddress = "ABCD:EF:1F.7".parse().unwrap();
        assert_eq!(b.to_string(), "abcd:ef:1f.7");
    }

    #[test]
    fn rejects_what_sysfs_never_names() {
        for bad in [
            "",
            "65:00.0",
            "0000:65:00",
            "0000:65:20.0",
            "0000:65:00.8",
            "00000:65:00.0",
            "0000:065:00.0",
            "0000:65:0.0",
            "0000:65:00.00",
            "0000-65-00.0",
            "0000:65:00.0\n",
            " 0000:65:00.0",
            "0000:6g:00.0",
            "0000:65:00.0.1",
            "0000:+5:00.0",
            "0000:65:00:00.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn vendor_selectors_parse() {
        assert_eq!("10de".parse(), Ok(VendorSelector::Pci(0x10de)));
        assert_eq!("0x10DE".parse(), Ok(VendorSelector::Pci(0x10de)));
        assert_eq!("ANY".parse(), Ok(VendorSelector::Any));
        assert_eq!(VendorSelector::Pci(0x1af4).to_string(), "1af4");
        for bad in ["", "0x", "nvidia", "10de0", "+10de", "10de "] {
            let e = bad.parse::<VendorSelector>().unwrap_err();
            assert!(
                e.to_string().contains("not a PCI vendor id"),
                "{bad:?}: {e}"
            );
        }
        assert_eq!(parse_hex16("2236"), Some(0x2236));
        assert_eq!(parse_hex16("0X1f"), Some(0x1f));
        assert_eq!(parse_hex16("12345"), None);
    }

    proptest! {
        #[test]
        fn format_then_parse_roundtrips(d in any::<u16>(), b in any::<u8>(), dev in 0u8..32, f in 0u8..8) {
            let a = PciAddress::new(d, b, dev, f).unwrap();
            prop_assert_eq!(a.to_string().parse::<PciAddress>().unwrap(), a);
        }

        #[test]
        fn parse_never_panics_and_accepts_only_canonical_forms(s in "\\PC{0,16}") {
            if let Ok(a) = s.parse::<PciAddress>() {
                prop_assert_eq!(a.to_string(), s.to_lowercase());
            }
        }

        #[test]
        fn order_is_numeric(a in any::<(u16, u8, u8, u8)>(), b in any::<(u16, u8, u8, u8)>()) {
            let pa = PciAddress::new(a.0, a.1, a.2 % 32, a.3 % 8).unwrap();
            let pb = PciAddress::new(b.0, b.1, b.2 % 32, b.3 % 8).unwrap();
            prop_assert_eq!(pa.cmp(&pb), pa.to_string().cmp(&pb.to_string()));
        }
    }
}
