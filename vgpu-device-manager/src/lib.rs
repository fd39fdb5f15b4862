//! vgpu-device-manager: make the node's vGPUs match a named profile.
pub mod config;
