//! `tools/link-ordered.sh`, the linker `tools/build-release.sh` gives rustc: the functions the
//! start-up list names are placed first, in the list's order, also one whose hash changed since
//! the list was made when its name without hash is its own; how the list matched is logged beside
//! it; the output is stripped when the link asks for it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Functions with rustc's legacy mangling (valid C names), defined in the order bar, mid, baz
/// and two instances of a generic `dupe` (one name without hash, two hashes), each called so
/// that none is dropped.
const SOURCE: &str = "\
int _ZN3foo3bar17h0123456789abcdefE(int x) { return x + 1; }
int _ZN3foo3mid17h1111111111111111E(int x) { return x + 2; }
int _ZN3foo3baz17hfedcba9876543210E(int x) { return x * 3; }
int _ZN3foo4dupe17haaaaaaaaaaaaaaaaE(int x) { return x + 4; }
int _ZN3foo4dupe17hbbbbbbbbbbbbbbbbE(int x) { return x + 5; }
int main(int c, char **v) {
    (void)v;
    return _ZN3foo3bar17h0123456789abcdefE(c) + _ZN3foo3mid17h1111111111111111E(c)
        + _ZN3foo3baz17hfedcba9876543210E(c) + _ZN3foo4dupe17haaaaaaaaaaaaaaaaE(c)
        + _ZN3foo4dupe17hbbbbbbbbbbbbbbbbE(c) - 19;
}
";

const BAR: &str = "_ZN3foo3bar17h0123456789abcdefE";
const MID: &str = "_ZN3foo3mid17h1111111111111111E";
const BAZ: &str = "_ZN3foo3baz17hfedcba9876543210E";
const DUPE_A: &str = "_ZN3foo4dupe17haaaaaaaaaaaaaaaaE";
const DUPE_B: &str = "_ZN3foo4dupe17hbbbbbbbbbbbbbbbbE";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/link-ordered.sh")
}

/// rustc's own lld, as rustc links with it (`cc -fuse-ld=lld -B <gcc-ld>`).
fn lld_args() -> Vec<String> {
    let rustc = |args: &[&str]| {
        String::from_utf8(Command::new("rustc").args(args).output().unwrap().stdout).unwrap()
    };
    let sysroot = rustc(&["--print", "sysroot"]);
    let host = rustc(&["-vV"])
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .unwrap();
    let gcc_ld = Path::new(sysroot.trim()).join(format!("lib/rustlib/{host}/bin/gcc-ld"));
    vec![
        "-B".into(),
        gcc_ld.display().to_string(),
        "-fuse-ld=lld".into(),
    ]
}

/// Links SOURCE through the script with `extra` arguments; the output's path.
fn link(dir: &Path, name: &str, extra: &[String]) -> PathBuf {
    let src = dir.join("f.c");
    std::fs::write(&src, SOURCE).unwrap();
    let out = dir.join(name);
    let status = Command::new(script())
        .args(["-O1", "-ffunction-sections"])
        .args(lld_args())
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .args(extra)
        .status()
        .unwrap();
    assert!(status.success(), "{name}: {status}");
    out
}

/// The `foo` functions in address order.
fn layout(bin: &Path) -> Vec<String> {
    let out = Command::new("nm").arg("-n").arg(bin).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("_ZN3foo"))
        .map(str::to_string)
        .collect()
}

#[test]
fn listed_functions_come_first_also_when_their_hash_changed() {
    if cfg!(not(all(target_arch = "x86_64", target_os = "linux"))) {
        eprintln!("skipped: tools/build-release.sh orders functions on x86_64 Linux only");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("order.txt");
    // As callgrind named them in another build: baz and dupe with other hashes, a function
    // this binary does not have, and bar as is, with callgrind's recursion mark.
    std::fs::write(
        &list,
        "_ZN3foo3baz17h0000000000000000E\n\
         _ZN3gone4here17h2222222222222222E\n\
         _ZN3foo3bar17h0123456789abcdefE'2\n\
         _ZN3foo4dupe17hccccccccccccccccE\n",
    )
    .unwrap();
    let ordering = format!("-Wl,--symbol-ordering-file={}", list.display());

    let plain = link(dir.path(), "plain", &[]);
    assert_eq!(layout(&plain), [BAR, MID, BAZ, DUPE_A, DUPE_B]);

    // baz found by its name without hash, bar as is; dupe's is ambiguous and left in place.
    let ordered = link(dir.path(), "ordered", std::slice::from_ref(&ordering));
    assert_eq!(layout(&ordered), [BAZ, BAR, MID, DUPE_A, DUPE_B]);
    assert!(Command::new(&ordered).status().unwrap().success());
    // How the list matched, beside it: bar by its full name, baz without hash, dupe ambiguous;
    // none of them is of the binary's own crate (`ordered`).
    let log = dir.path().join("order.txt.log");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "ordered\t1\t1\t1\t0\t0\n"
    );

    // Stripped as asked (the first link kept the symbols to read them), and no file left over.
    let stripped = link(
        dir.path(),
        "stripped",
        &[ordering.clone(), "-Wl,--strip-all".to_string()],
    );
    assert!(layout(&stripped).is_empty());
    assert!(Command::new(&stripped).status().unwrap().success());
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            "f.c",
            "order.txt",
            "order.txt.log",
            "ordered",
            "plain",
            "stripped"
        ]
    );
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "ordered\t1\t1\t1\t0\t0\nstripped\t1\t1\t1\t0\t0\n"
    );

    // A binary of crate `foo` (named as cargo names it): the same functions are its own, and
    // counted again as such.
    link(
        dir.path(),
        "foo-0123456789abcdef",
        std::slice::from_ref(&ordering),
    );
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .ends_with("\nfoo-0123456789abcdef\t1\t1\t1\t1\t1\n")
    );
}

/// `tools/order-report.sh` on a log of `link-ordered.sh`'s form; its stderr.
fn order_report(log: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("order.txt.log");
    std::fs::write(&path, log).unwrap();
    let out = Command::new(script().with_file_name("order-report.sh"))
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", out);
    String::from_utf8(out.stdout.clone()).unwrap() + &String::from_utf8(out.stderr).unwrap()
}

#[test]
fn a_list_whose_own_functions_are_found_only_without_hash_is_reported_stale() {
    // A fresh workspace list: sandbox-dp's own functions all by their full name; vfio-manager
    // finds 65 of other daemons' generic instances by name (no sign), and a tiny binary with 2
    // of its own by name (under the floor of 3): nothing said.
    assert_eq!(
        order_report(
            "sandbox_dp-9c23ffe7a9d4ec03\t1610\t7\t134\t402\t0\n\
             vfio_manager-e5103ced2ff56245\t1180\t65\t302\t231\t0\n\
             gpu_vm_noop-1\t1\t2\t0\t0\t2\n"
        ),
        ""
    );
    // Exactly one in twenty of its own: still matched.
    assert_eq!(order_report("vfio_manager-bb66\t400\t20\t3\t57\t3\n"), "");
    // Just over one in twenty, and a daemon built alone (its crate's hash changed): each
    // named, with its counts.
    let said = order_report(
        "vfio_manager-bb66\t400\t20\t3\t56\t3\n\
         sandbox_dp-9c23ffe7a9d4ec03\t603\t539\t623\t0\t402\n\
         gpu_vm_noop-1\t46\t1\t0\t1\t0\n",
    );
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.len(), 2, "{said}");
    assert!(
        lines[0].contains(
            "does not match vfio_manager as built: 3 of its own crate's listed functions found \
             only by their name without hash, 56 by their full name (all crates: 400 by full \
             name, 20 by name, 3 generic ones not found)"
        ),
        "{said}"
    );
    assert!(
        lines[1].contains("does not match sandbox_dp as built: 402 of its own"),
        "{said}"
    );
    assert!(lines[1].contains("tools/startup-order.sh"), "{said}");
    // A log that cannot be read is an error, not silence.
    let status = Command::new(script().with_file_name("order-report.sh"))
        .arg("/nonexistent/order.txt.log")
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2));
}
