//! Running a daemon: a tokio runtime, SIGTERM and SIGINT turned into one cancellation token,
//! and the daemon's `run(config, paths, shutdown)` awaited on it.
//!
//! ```ignore
//! Command::Daemon(a) => daemon_kit::daemon::run(Threads::Workers(2), |shutdown| {
//!     vfio_manager::daemon::run(a.config(), paths, shutdown)
//! }),
//! ```

use std::future::Future;
use std::io;
use std::time::Duration;

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::exit;

/// How many threads the runtime runs tasks on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// The calling thread only: each further worker thread costs memory (its stack, an
    /// allocator arena), and a daemon answering a few calls a minute does not need one.
    Current,
    /// This many worker threads.
    Workers(usize),
}

/// Blocking-pool threads (node reads, sysfs writes) exit after this long idle.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// A token cancelled at the first SIGTERM or SIGINT. Call it inside a tokio runtime. Fails
/// when a handler cannot be installed: a daemon that could not be stopped must not start.
pub fn shutdown_on_signals() -> io::Result<CancellationToken> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        cancel.cancel();
    });
    Ok(token)
}

/// Builds the runtime, installs the signal handlers, and runs `daemon` with their token until
/// it returns. Failing to build the runtime or install a handler is an error before the daemon
/// starts (exit 1).
pub fn run<F, Fut>(threads: Threads, daemon: F) -> exit::Result
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = exit::Result>,
{
    let mut builder = match threads {
        Threads::Current => tokio::runtime::Builder::new_current_thread(),
        Threads::Workers(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n.max(1));
            b
        }
    };
    let rt = builder
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let shutdown =
            shutdown_on_signals().context("cannot install the SIGTERM/SIGINT handlers")?;
        daemon(shutdown).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemons_result_is_the_result() {
        for threads in [Threads::Current, Threads::Workers(2)] {
            assert!(run(threads, |_| async { Ok(()) }).is_ok());
            let e = run(threads, |_| async { exit::status(2) }).unwrap_err();
            assert_eq!(e.code(), 2);
        }
    }

    #[test]
    fn a_signal_cancels_the_token() {
        let r = run(Threads::Current, |shutdown| async move {
            assert!(!shutdown.is_cancelled());
            // The handler is installed: SIGINT does not end the test process.
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGINT).context("raise")?;
            tokio::time::timeout(Duration::from_secs(30), shutdown.cancelled())
                .await
                .context("SIGINT did not cancel the token")?;
            Ok(())
        });
        assert!(r.is_ok(), "{r:?}");
    }
}
