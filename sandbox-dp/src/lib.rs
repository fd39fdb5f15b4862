//! sandbox-dp: kubelet device plugin for passthrough GPUs and vGPUs.

/// The kubelet device-plugin API `v1beta1`.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod api {
    tonic::include_proto!("v1beta1");
}
