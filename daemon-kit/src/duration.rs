//! One syntax for every duration flag: `500ms`, `30s`, `2m`, `1h30m` (humantime's units), or a
//! bare number of seconds (`1.5`), which the flags took before units were accepted.
//!
//! ```ignore
//! #[arg(long, default_value = "30s", value_parser = daemon_kit::duration::parse)]
//! timeout: Duration,
//! ```

use std::time::Duration;

/// The longest duration a flag takes (30 days): longer ones are mistakes, and would overflow
/// the timers they set.
pub const MAX: Duration = Duration::from_secs(30 * 24 * 3600);

/// A duration flag's value that is not one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadDuration {
    /// Not a duration at all.
    #[error("not a duration ({reason}): {value:?}; write it like 500ms, 30s, 2m or 1h30m")]
    Syntax {
        /// The value given.
        value: String,
        /// What humantime says of it.
        reason: String,
    },
    /// Zero, negative, or longer than [`MAX`].
    #[error("must be more than 0 and at most 30 days: {0:?}")]
    OutOfRange(String),
    /// Not a whole number of milliseconds (the deprecated `--…-ms` flags).
    #[error("not a whole number of milliseconds: {0:?}")]
    NotMillis(String),
}

/// Parses a duration flag: humantime's syntax (`500ms`, `30s`, `2m`, `1h 30m`) or a bare number
/// of seconds (`30`, `1.5`). It must be more than zero and at most [`MAX`].
pub fn parse(s: &str) -> Result<Duration, BadDuration> {
    let t = s.trim();
    let d = match t.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= MAX.as_secs_f64() => {
            Duration::from_secs_f64(secs)
        }
        Ok(_) => return Err(BadDuration::OutOfRange(s.to_string())),
        Err(_) => humantime::parse_duration(t).map_err(|e| BadDuration::Syntax {
            value: s.to_string(),
            reason: e.to_string(),
        })?,
    };
    in_range(d, s)
}

/// Parses a whole number of milliseconds: the value of the deprecated `--…-ms` flags.
pub fn parse_millis(s: &str) -> Result<Duration, BadDuration> {
    let ms: u64 = s
        .trim()
        .parse()
        .map_err(|_| BadDuration::NotMillis(s.to_string()))?;
    in_range(Duration::from_millis(ms), s)
}

/// A duration as [`parse`] reads it back (`2s`, `5m`, `1h 30m`, `500ms`).
pub fn format(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

fn in_range(d: Duration, s: &str) -> Result<Duration, BadDuration> {
    if d.is_zero() || d > MAX {
        return Err(BadDuration::OutOfRange(s.to_string()));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn units_parse() {
        assert_eq!(parse("500ms"), Ok(MS(500)));
        assert_eq!(parse("30s"), Ok(MS(30_000)));
        assert_eq!(parse("2m"), Ok(MS(120_000)));
        assert_eq!(parse("1h30m"), Ok(MS(5_400_000)));
        assert_eq!(parse("1h 30m"), Ok(MS(5_400_000)));
        assert_eq!(parse(" 5m "), Ok(MS(300_000)));
    }

    #[test]
    fn bare_numbers_are_seconds_as_before() {
        assert_eq!(parse("30"), Ok(MS(30_000)));
        assert_eq!(parse("1.5"), Ok(MS(1_500)));
        assert_eq!(parse("0.5"), Ok(MS(500)));
        assert_eq!(parse("3600"), Ok(MS(3_600_000)));
    }

    #[test]
    fn zero_negative_huge_and_nonsense_are_refused_by_name() {
        for bad in [
            "0", "0s", "0ms", "-1", "-1s", "nan", "inf", "31days", "3000000",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad:?}: {e}");
        }
        for bad in ["", "abc", "30 parsecs", "1.5.2", "s"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("write it like 500ms, 30s, 2m"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn deprecated_millisecond_values_parse() {
        assert_eq!(parse_millis("2000"), Ok(MS(2000)));
        assert_eq!(parse_millis("300000"), Ok(MS(300_000)));
        assert!(parse_millis("0").is_err());
        assert!(
            parse_millis("2s")
                .unwrap_err()
                .to_string()
                .contains("milliseconds")
        );
        assert!(parse_millis("1.5").is_err());
    }

    #[test]
    fn formatted_durations_parse_back() {
        for d in [MS(500), MS(2000), MS(300_000), MS(5_400_000)] {
            assert_eq!(parse(&format(d)), Ok(d), "{}", format(d));
        }
        assert_eq!(format(MS(300_000)), "5m");
    }
}
