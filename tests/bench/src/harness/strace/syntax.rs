//! strace's notation: a call's name, arguments and result, descriptors decorated with their
//! paths (`-y`), quoted C strings, and the flag words of `openat` and `access`.

use std::path::PathBuf;

use super::Fd;

/// `name(args) = ret` → the name, the top-level arguments and the text after `=`.
pub(super) fn split_call(text: &str) -> Option<(&str, Vec<String>, &str)> {
    let open = text.find('(')?;
    let name = &text[..open];
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    let body = &text[open + 1..];
    let mut args = Vec::new();
    let mut cur = String::new();
    let mut depth = 0usize;
    let mut chars = body.char_indices();
    let mut end = None;
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => {
                cur.push(c);
                while let Some((_, q)) = chars.next() {
                    cur.push(q);
                    if q == '\\' {
                        if let Some((_, e)) = chars.next() {
                            cur.push(e);
                        }
                    } else if q == '"' {
                        break;
                    }
                }
            }
            '(' | '{' | '[' | '<' => {
                depth += 1;
                cur.push(c);
            }
            ')' if depth == 0 => {
                end = Some(i);
                break;
            }
            ')' | '}' | ']' | '>' => {
                depth = depth.saturating_sub(1);
                cur.push(c);
            }
            ',' if depth == 0 => {
                args.push(cur.trim().to_string());
                cur.clear();
            }
            _ => cur.push(c),
        }
    }
    let end = end?;
    if !cur.trim().is_empty() {
        args.push(cur.trim().to_string());
    }
    let ret = body[end + 1..].trim_start().strip_prefix('=')?.trim();
    Some((name, args, ret))
}

/// `3</path>` → 3 and the path; `-1 ENOENT (…)` → -1.
pub(super) fn parse_ret(ret: &str) -> (Option<i64>, Option<PathBuf>) {
    let digits: String = ret
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '-')
        .collect();
    let num = digits.parse().ok();
    let path = decoration(&ret[digits.len()..]).map(PathBuf::from);
    (num, path)
}

/// `3</path>` (or `3<socket:[…]>`, with no path).
pub(super) fn parse_fd(arg: &str) -> Option<Fd> {
    let digits: String = arg.chars().take_while(char::is_ascii_digit).collect();
    let num = digits.parse().ok()?;
    Some(Fd {
        num,
        path: decoration(&arg[digits.len()..]).map(PathBuf::from),
    })
}

/// The path in `</path>`, unescaped; `None` for `<socket:[…]>` and the like.
pub(super) fn decoration(s: &str) -> Option<String> {
    let inner = s.strip_prefix('<')?.strip_suffix('>')?;
    let inner = inner.strip_suffix(" (deleted)").unwrap_or(inner);
    inner.starts_with('/').then(|| unescape(inner))
}

/// A quoted C string as strace prints it (`"a\nb"`, possibly followed by `...`).
pub(super) fn unquote(arg: &str) -> PathBuf {
    let s = arg.strip_prefix('"').unwrap_or(arg);
    let s = s.strip_suffix("...").unwrap_or(s);
    let s = s.strip_suffix('"').unwrap_or(s);
    PathBuf::from(unescape(s))
}

fn unescape(s: &str) -> String {
    use std::os::unix::ffi::OsStringExt;
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' || i + 1 >= b.len() {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let c = b[i + 1];
        i += 2;
        match c {
            b'n' => out.push(b'\n'),
            b't' => out.push(b'\t'),
            b'r' => out.push(b'\r'),
            b'v' => out.push(0x0b),
            b'f' => out.push(0x0c),
            b'x' => {
                let hex = s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'x'),
                }
            }
            b'0'..=b'7' => {
                let mut v = u32::from(c - b'0');
                let mut n = 1;
                while n < 3 && i < b.len() && (b'0'..=b'7').contains(&b[i]) {
                    v = v * 8 + u32::from(b[i] - b'0');
                    i += 1;
                    n += 1;
                }
                out.push(v as u8);
            }
            other => out.push(other),
        }
    }
    String::from_utf8(out.clone()).unwrap_or_else(|_| {
        std::ffi::OsString::from_vec(out)
            .to_string_lossy()
            .into_owned()
    })
}

/// `O_RDONLY|O_CLOEXEC|O_DIRECTORY` → the flags.
pub(super) fn open_flags(s: &str) -> i32 {
    s.split('|')
        .map(|f| match f.trim() {
            "O_RDONLY" => 0,
            "O_WRONLY" => libc::O_WRONLY,
            "O_RDWR" => libc::O_RDWR,
            "O_CREAT" => libc::O_CREAT,
            "O_TRUNC" => libc::O_TRUNC,
            "O_APPEND" => libc::O_APPEND,
            "O_EXCL" => libc::O_EXCL,
            "O_NONBLOCK" => libc::O_NONBLOCK,
            "O_CLOEXEC" => libc::O_CLOEXEC,
            "O_DIRECTORY" => libc::O_DIRECTORY,
            "O_NOFOLLOW" => libc::O_NOFOLLOW,
            "O_NOCTTY" => libc::O_NOCTTY,
            "O_PATH" => libc::O_PATH,
            "O_NOATIME" => libc::O_NOATIME,
            "O_LARGEFILE" => libc::O_LARGEFILE,
            other => other
                .strip_prefix("0x")
                .and_then(|h| i32::from_str_radix(h, 16).ok())
                .unwrap_or(0),
        })
        .fold(0, |acc, f| acc | f)
}

/// `R_OK|W_OK` → the mode.
pub(super) fn access_mode(s: &str) -> i32 {
    s.split('|')
        .map(|m| match m.trim() {
            "R_OK" => libc::R_OK,
            "W_OK" => libc::W_OK,
            "X_OK" => libc::X_OK,
            _ => libc::F_OK,
        })
        .fold(0, |acc, m| acc | m)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_and_arguments() {
        assert_eq!(
            unquote(r#""a\"b\\c\x41\101\n""#),
            PathBuf::from("a\"b\\cAA\n")
        );
        assert_eq!(unquote(r#"""..."#), PathBuf::from(""));
        let (name, args, ret) = split_call(
            r#"statx(3</a, b>, "x,y", AT_SYMLINK_NOFOLLOW, STATX_ALL, {stx_mask=STATX_TYPE, stx_mode=S_IFREG|0644}) = 0"#,
        )
        .unwrap();
        assert_eq!(name, "statx");
        assert_eq!(
            args,
            [
                "3</a, b>",
                "\"x,y\"",
                "AT_SYMLINK_NOFOLLOW",
                "STATX_ALL",
                "{stx_mask=STATX_TYPE, stx_mode=S_IFREG|0644}"
            ]
        );
        assert_eq!(ret, "0");
        assert_eq!(
            parse_ret("-1 ENOENT (No such file or directory)"),
            (Some(-1), None)
        );
        assert_eq!(parse_ret("4</x/y>"), (Some(4), Some(PathBuf::from("/x/y"))));
        assert_eq!(
            parse_fd("9<socket:[1234]>"),
            Some(Fd { num: 9, path: None })
        );
        assert_eq!(
            open_flags("O_RDONLY|O_CLOEXEC|0x100000"),
            libc::O_CLOEXEC | 0x100000
        );
    }
}
