//! A Rust executable that only exits, built with the daemons' release profile: what any
//! program of this workspace pays to start (the loader's relocations, glibc's and Rust's set-up),
//! measured beside the daemons' `--version` in the plain tree's start-up table.

fn main() {}
