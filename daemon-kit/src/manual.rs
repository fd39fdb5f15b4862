//! Shell completions and a man page, generated from a binary's clap definition:
//!
//! ```text
//! vfio-manager --generate completions bash > /usr/share/bash-completion/completions/vfio-manager
//! vfio-manager --generate completions zsh  > /usr/share/zsh/vendor-completions/_vfio-manager
//! vfio-manager --generate completions fish > /usr/share/fish/vendor_completions.d/vfio-manager.fish
//! vfio-manager --generate man              > /usr/share/man/man8/vfio-manager.8
//! ```
//!
//! `--generate` must be the first argument; it is not shown in `--help`.

use std::io::Write;
use std::process::ExitCode;

use clap_complete::Shell;

/// The first argument that asks for generation.
pub const FLAG: &str = "--generate";

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Completions for this shell.
    Completions(Shell),
    /// A roff man page (section 8).
    Man,
}

/// What `--generate` was asked that it cannot do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    /// A shell clap_complete does not know.
    #[error("unknown shell {0:?}; {USAGE}")]
    Shell(String),
    /// Neither `man` nor `completions SHELL`.
    #[error("{USAGE}")]
    Usage,
}

const USAGE: &str =
    "usage: --generate completions bash|zsh|fish|elvish|powershell, or --generate man";

/// Parses the words after `--generate`.
pub fn parse(words: &[String]) -> Result<Output, BadRequest> {
    match words {
        [what] if what == "man" => Ok(Output::Man),
        [what, shell] if what == "completions" => shell
            .parse::<Shell>()
            .map(Output::Completions)
            .map_err(|_| BadRequest::Shell(shell.clone())),
        _ => Err(BadRequest::Usage),
    }
}

/// Writes `output` for `cmd` to `out`.
pub fn write(mut cmd: clap::Command, output: Output, out: &mut dyn Write) -> std::io::Result<()> {
    match output {
        Output::Completions(shell) => {
            let name = cmd.get_name().to_string();
            clap_complete::generate(shell, &mut cmd, name, out);
            Ok(())
        }
        Output::Man => clap_mangen::Man::new(cmd).section("8").render(out),
    }
}

/// When the process's first argument is `--generate`, prints what it asks for about `C` and
/// returns the exit status (2 for a bad request); `None` otherwise. Call first in `main`.
pub fn generate_if_asked<C: clap::CommandFactory>() -> Option<ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some(FLAG) {
        return None;
    }
    let cmd = C::command();
    let name = cmd.get_name().to_string();
    let output = match parse(&args[1..]) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{name}: {e}");
            return Some(ExitCode::from(2));
        }
    };
    let mut stdout = std::io::stdout().lock();
    match write(cmd, output, &mut stdout).and_then(|()| stdout.flush()) {
        Ok(()) => Some(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("{name}: cannot write: {e}");
            Some(ExitCode::FAILURE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_the_requests() {
        assert_eq!(parse(&words("man")), Ok(Output::Man));
        assert_eq!(
            parse(&words("completions zsh")),
            Ok(Output::Completions(Shell::Zsh))
        );
        assert!(
            parse(&words("completions tcsh"))
                .unwrap_err()
                .to_string()
                .contains("tcsh")
        );
        assert!(parse(&words("")).is_err());
        assert!(parse(&words("man extra")).is_err());
    }
}
