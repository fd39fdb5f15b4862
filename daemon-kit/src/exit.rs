//! One error type for every command and daemon, carrying the exit status it ends with.
//!
//! Each binary documents its own table (in `--help` and its README); these are shared: `0` done,
//! `1` ran but did not get everything done (or failed at run time), `2` usage or configuration
//! error, nothing changed (clap's own usage errors exit 2 too).
//!
//! ```ignore
//! fn apply(cli: &Cli) -> daemon_kit::Result {
//!     let config = read_config(&cli.file).or_exit(exit::USAGE)?; // a bad file: exit 2
//!     let report = apply(&config)?;                               // an anyhow error: exit 1
//!     print!("{}", report.render());
//!     exit::status(report.exit_code())                            // 1 when a device failed
//! }
//! ```

use std::fmt;
use std::process::ExitCode;

/// Exit status: the command ran and did not get everything done, or failed at run time.
pub const FAILED: u8 = 1;
/// Exit status: usage or configuration error; nothing was changed.
pub const USAGE: u8 = 2;

/// What ends a command or a daemon with a non-zero exit status: the status, and the error to
/// report (none when the command has already said why, as in a table of devices).
#[derive(Debug)]
pub struct Failure {
    code: u8,
    error: Option<anyhow::Error>,
}

/// A command's or a daemon's result.
pub type Result<T = ()> = std::result::Result<T, Failure>;

impl Failure {
    /// Ends with `code` (`0` counts as [`FAILED`]: an error never exits 0), reporting `error`.
    pub fn new(code: u8, error: impl Into<anyhow::Error>) -> Self {
        Failure {
            code: code.max(FAILED),
            error: Some(error.into()),
        }
    }

    /// Ends with `code` (at least [`FAILED`]); the command has already reported why.
    pub fn reported(code: u8) -> Self {
        Failure {
            code: code.max(FAILED),
            error: None,
        }
    }

    /// The exit status.
    pub fn code(&self) -> u8 {
        self.code
    }

    /// The error to report, if the command has not reported it itself.
    pub fn error(&self) -> Option<&anyhow::Error> {
        self.error.as_ref()
    }
}

/// `?` on an `anyhow` result: exit [`FAILED`].
impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Failure::new(FAILED, error)
    }
}

impl fmt::Display for Failure {
    /// The error and its causes, joined by `: `; or the bare status when already reported.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.error {
            Some(e) => write!(f, "{e:#}"),
            None => write!(f, "exit status {}", self.code),
        }
    }
}

/// `result.or_exit(code)?`: an error of any kind ends the command with `code`.
pub trait OrExit<T> {
    /// The error, if any, as a [`Failure`] with exit status `code`.
    fn or_exit(self, code: u8) -> Result<T>;
}

impl<T, E: Into<anyhow::Error>> OrExit<T> for std::result::Result<T, E> {
    fn or_exit(self, code: u8) -> Result<T> {
        self.map_err(|e| Failure::new(code, e))
    }
}

/// A status a command computed (its report already printed): `Ok` for 0, else a reported
/// [`Failure`] (a status outside 1..=255 counts as [`FAILED`]).
pub fn status(code: i32) -> Result {
    match code {
        0 => Ok(()),
        c => Err(Failure::reported(u8::try_from(c).unwrap_or(FAILED))),
    }
}

/// Where a failure's error is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// A one-shot command: `error: …` on stderr, beside its printed output.
    Stderr,
    /// A daemon: an ERROR event in its log (text or JSON, as `--log-format` says).
    Log,
}

/// The process's exit status for `result`, its error reported as `report` says.
pub fn finish(result: Result, report: Report) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            if let Some(e) = failure.error() {
                match report {
                    Report::Stderr => eprintln!("error: {e:#}"),
                    Report::Log => tracing::error!("{e:#}"),
                }
            }
            ExitCode::from(failure.code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading /sys/bus/pci/devices/0000:41:00.0/driver")]
    struct Outer(#[source] std::io::Error);

    fn io() -> std::io::Error {
        std::io::Error::from(std::io::ErrorKind::PermissionDenied)
    }

    #[test]
    fn anyhow_errors_exit_1_and_show_their_causes() {
        fn f() -> Result {
            Err(anyhow::Error::new(Outer(io())).context("reading the node"))?;
            Ok(())
        }
        let e = f().unwrap_err();
        assert_eq!(e.code(), FAILED);
        assert_eq!(
            e.to_string(),
            "reading the node: reading /sys/bus/pci/devices/0000:41:00.0/driver: permission denied"
        );
    }

    #[test]
    fn or_exit_sets_the_status_of_any_error() {
        let r: std::result::Result<(), Outer> = Err(Outer(io()));
        let e = r.or_exit(USAGE).unwrap_err();
        assert_eq!(e.code(), USAGE);
        assert!(e.to_string().starts_with("reading /sys/bus/pci"), "{e}");
        assert_eq!(Ok::<u8, Outer>(7).or_exit(USAGE).unwrap(), 7);
    }

    #[test]
    fn an_error_never_exits_0() {
        assert_eq!(Failure::new(0, io()).code(), FAILED);
        assert_eq!(Failure::reported(0).code(), FAILED);
    }

    #[test]
    fn computed_statuses_map_to_results() {
        assert!(status(0).is_ok());
        let e = status(2).unwrap_err();
        assert_eq!((e.code(), e.error().is_none()), (2, true));
        assert_eq!(e.to_string(), "exit status 2");
        assert_eq!(status(-1).unwrap_err().code(), FAILED);
        assert_eq!(status(256).unwrap_err().code(), FAILED);
    }

    #[test]
    fn finish_turns_the_status_into_the_exit_code() {
        assert_eq!(finish(Ok(()), Report::Stderr), ExitCode::SUCCESS);
        assert_eq!(
            finish(Err(Failure::reported(2)), Report::Log),
            ExitCode::from(2)
        );
        assert_eq!(
            finish(Err(Failure::new(USAGE, io())), Report::Stderr),
            ExitCode::from(2)
        );
    }
}
