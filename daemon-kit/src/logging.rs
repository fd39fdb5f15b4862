//! Logging on stderr, one set-up for every binary: `--log-format text|json` (or `LOG_FORMAT`),
//! the level from `RUST_LOG` (default `info`). Text is coloured only on a terminal: a
//! container's log, a journal or a file gets plain lines.

use std::io::IsTerminal as _;

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields.message`, `target`, and the
    /// event's other fields under `fields`.
    Json,
}

/// Installs the global subscriber on stderr: `RUST_LOG`'s filter (default `info`), plus every
/// debug event when `debug`; ANSI colours only when stderr is a terminal. Logging set up
/// before (a test calling twice) is kept.
pub fn init(format: LogFormat, debug: bool) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if debug {
        filter = filter.add_directive(tracing::level_filters::LevelFilter::DEBUG.into());
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // Err only when a subscriber is already installed: that one stays.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
