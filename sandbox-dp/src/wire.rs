//! ListAndWatch's message written straight from a resource's state.
//!
//! The generated server sends a `ListAndWatchResponse`: each message would be built first (an
//! id, a health and a topology allocated per device), encoded, then dropped. On a node of 512
//! vGPUs that is most of what a health reaction costs. [`ListCodec`] writes the bytes prost
//! would write for [`list_response`](crate::plugin::list_response) of the same state, from the
//! [`ResourceState`] the resource's watch channel holds, without copying it.

use std::sync::Arc;

use prost::bytes::BufMut;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::Status;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

use crate::api::Empty;
use crate::discovery::{DeviceInfo, HEALTHY, UNHEALTHY};
use crate::plugin::ResourceState;

// Field numbers in the device-plugin API (`api.proto`).
/// `ListAndWatchResponse.devices`.
const LIST_DEVICES: u32 = 1;
/// `Device.ID`.
const DEVICE_ID: u32 = 1;
/// `Device.health`.
const DEVICE_HEALTH: u32 = 2;
/// `Device.topology`.
const DEVICE_TOPOLOGY: u32 = 3;
/// `TopologyInfo.nodes`.
const TOPOLOGY_NODES: u32 = 1;
/// `NUMANode.ID`.
const NUMA_ID: u32 = 1;

/// Lengths on the wire are varints of 64 bits.
fn wire(len: usize) -> u64 {
    u64::try_from(len).unwrap_or(u64::MAX)
}

/// The encoded length of a proto3 `string` field (absent when empty).
fn string_len(tag: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        key_len(tag) + encoded_len_varint(wire(s.len())) + s.len()
    }
}

fn put_string(tag: u32, s: &str, buf: &mut impl BufMut) {
    if !s.is_empty() {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(wire(s.len()), buf);
        buf.put_slice(s.as_bytes());
    }
}

/// The encoded length of a length-delimited field holding `len` bytes.
fn nested_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(wire(len)) + len
}

/// An `int64` on the wire: two's complement, as prost writes it.
fn int64(v: i64) -> u64 {
    v.cast_unsigned()
}

/// The body of `NUMANode { ID }` (empty for node 0, a proto3 default).
fn numa_len(id: i64) -> usize {
    if id == 0 {
        0
    } else {
        key_len(NUMA_ID) + encoded_len_varint(int64(id))
    }
}

/// The body of `TopologyInfo { nodes: [NUMANode { ID }] }`.
fn topology_len(id: i64) -> usize {
    nested_len(TOPOLOGY_NODES, numa_len(id))
}

fn health(d: &DeviceInfo) -> &'static str {
    if d.healthy { HEALTHY } else { UNHEALTHY }
}

/// The body of a device's `Device` message.
fn device_len(d: &DeviceInfo) -> usize {
    string_len(DEVICE_ID, &d.id)
        + string_len(DEVICE_HEALTH, health(d))
        + d.numa_node.map_or(0, |n| {
            nested_len(DEVICE_TOPOLOGY, topology_len(i64::from(n)))
        })
}

/// The encoded length of the state's `ListAndWatchResponse`.
pub fn list_len(state: &ResourceState) -> usize {
    state
        .resource
        .devices
        .values()
        .map(|d| nested_len(LIST_DEVICES, device_len(d)))
        .sum()
}

/// Writes the state's `ListAndWatchResponse`: its devices in id order, each with its id, its
/// health and, when known, its NUMA node.
pub fn encode_list(state: &ResourceState, buf: &mut impl BufMut) {
    for d in state.resource.devices.values() {
        encode_key(LIST_DEVICES, WireType::LengthDelimited, buf);
        encode_varint(wire(device_len(d)), buf);
        put_string(DEVICE_ID, &d.id, buf);
        put_string(DEVICE_HEALTH, health(d), buf);
        if let Some(n) = d.numa_node {
            let id = i64::from(n);
            encode_key(DEVICE_TOPOLOGY, WireType::LengthDelimited, buf);
            encode_varint(wire(topology_len(id)), buf);
            encode_key(TOPOLOGY_NODES, WireType::LengthDelimited, buf);
            encode_varint(wire(numa_len(id)), buf);
            if id != 0 {
                encode_key(NUMA_ID, WireType::Varint, buf);
                encode_varint(int64(id), buf);
            }
        }
    }
}

/// ListAndWatch's codec: the request (`Empty`) decoded by prost, each state sent as its
/// `ListAndWatchResponse` by [`ListEncoder`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ListCodec;

impl Codec for ListCodec {
    type Encode = Arc<ResourceState>;
    type Decode = Empty;
    type Encoder = ListEncoder;
    type Decoder = ProstDecoder<Empty>;

    fn encoder(&mut self) -> ListEncoder {
        ListEncoder
    }

    fn decoder(&mut self) -> ProstDecoder<Empty> {
        ProstDecoder::default()
    }
}

/// Writes a state's `ListAndWatchResponse` ([`encode_list`]) into tonic's buffer.
#[derive(Clone, Copy, Debug, Default)]
pub struct ListEncoder;

impl Encoder for ListEncoder {
    type Item = Arc<ResourceState>;
    type Error = Status;

    fn encode(&mut self, state: Arc<ResourceState>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(list_len(&state));
        encode_list(&state, dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message as _;

    use super::*;
    use crate::alloc::DevNodes;
    use crate::discovery::{Kind, Resource};
    use crate::plugin::list_response;

    fn device(id: &str, healthy: bool, numa_node: Option<i32>) -> DeviceInfo {
        DeviceInfo {
            id: id.to_string(),
            healthy,
            numa_node,
            iommu_group: Some(7),
            vfio_cdev: None,
            gpu: None,
            switch: None,
            driver: Some("vfio-pci".to_string()),
        }
    }

    fn state(devices: Vec<DeviceInfo>) -> ResourceState {
        let mut resource = Resource::new("nvidia.com/NVIDIA_L40S-1Q".to_string(), Kind::SriovVgpu);
        resource.devices = devices
            .into_iter()
            .map(|d| (d.id.clone(), d))
            .collect::<BTreeMap<_, _>>();
        ResourceState {
            resource,
            nodes: DevNodes::default(),
        }
    }

    fn ours(st: &ResourceState) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_list(st, &mut buf);
        buf
    }

    #[test]
    fn the_list_is_the_bytes_prost_writes_for_the_same_state() {
        let cases = [
            vec![],
            vec![device("0000:41:00.4", true, Some(0))],
            vec![
                device("0000:41:00.4", false, Some(1)),
                device("0000:41:00.5", true, None),
                device("0000:c1:00.0", true, Some(-1)),
                device("0000:c1:00.1", false, Some(i32::MAX)),
                device("0000:c1:00.2", true, Some(i32::MIN)),
                device("3f2a5c1e-0b7d-4e8a-9c61-2d4b8e0f7a13", true, Some(3)),
            ],
            // Ids long enough for a two-byte length.
            vec![device(&"x".repeat(200), true, Some(2))],
        ];
        for devices in cases {
            let st = state(devices);
            let want = list_response(&st).encode_to_vec();
            assert_eq!(ours(&st), want, "devices {:?}", st.resource.devices.keys());
            assert_eq!(list_len(&st), want.len());
        }
    }

    #[test]
    fn a_big_list_decodes_as_the_devices_with_their_health() {
        let devices: Vec<DeviceInfo> = (0..512)
            .map(|i| {
                device(
                    &format!("0000:{:02x}:{:02x}.{}", 0x40 + i / 256, (i / 8) % 32, i % 8),
                    i != 77,
                    Some(i / 128),
                )
            })
            .collect();
        let st = state(devices);
        let got = crate::api::ListAndWatchResponse::decode(ours(&st).as_slice()).unwrap();
        assert_eq!(got.devices.len(), 512);
        let sick: Vec<&str> = got
            .devices
            .iter()
            .filter(|d| d.health == UNHEALTHY)
            .map(|d| d.id.as_str())
            .collect();
        assert_eq!(sick, ["0000:40:09.5"]);
        assert_eq!(got, list_response(&st));
    }
}
