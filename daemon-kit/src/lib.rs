//! The daemons' shared skeleton. Every binary's `main.rs` is a thin shell over it:
//!
//! - [`cli`]: the flags every binary takes (`--host-root`, `--kubelet-dir`, `--log-format`), as
//!   clap groups to flatten;
//! - [`logging`]: one subscriber on stderr, text or JSON, level from `RUST_LOG`;
//! - [`duration`]: one syntax for every duration flag (`500ms`, `30s`, `2m`, or bare seconds);
//! - [`exit`]: one error type, [`exit::Failure`], carrying the exit status it ends with;
//! - [`daemon`]: the runtime, SIGTERM/SIGINT turned into one `CancellationToken`, and the
//!   daemon's `run(config, paths, shutdown)` awaited on it;
//! - [`grpc`]: serve tonic on a Unix socket so that every client is answered, whatever
//!   `:authority` it sends (kubelet's device-plugin and plugin-registration clients, grpcio,
//!   diagnostic tools). Every gRPC socket of ours is served through it;
//! - [`kube`]: a Kubernetes client from `--kubeconfig` or the pod's service account;
//! - [`readiness`]: a readiness file kept in place while the daemon vouches, whoever removes it.
//! - [`ops`]: metrics (`/metrics`), probes (`/healthz`, `/readyz`) and systemd notification;
//! - [`events`]: Kubernetes Events on the Node for every change and refusal;
//! - [`reconcile`]: when a daemon's loop makes a pass: changes, a resync, backoff after a
//!   failure;
//! - [`manual`]: shell completions and a man page, generated from the clap definition.
#![warn(missing_docs)]

pub mod cli;
pub mod daemon;
pub mod duration;
pub mod events;
pub mod exit;
pub mod grpc;
pub mod h2_rewrite;
pub mod kube;
pub mod logging;
pub mod manual;
pub mod ops;
pub mod readiness;
pub mod reconcile;

pub use exit::{Failure, OrExit, Result};
