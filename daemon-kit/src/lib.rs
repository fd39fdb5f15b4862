//! Async helpers shared by the daemons.
//!
//! - [`grpc`]: serve tonic on a Unix socket so that every client is answered, whatever
//!   `:authority` it sends (kubelet's device-plugin and plugin-registration clients, grpcio,
//!   diagnostic tools). Every gRPC socket of ours is served through it.
#![warn(missing_docs)]

pub mod grpc;
pub mod h2_rewrite;
