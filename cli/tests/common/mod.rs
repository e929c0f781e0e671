//! What the CLI's test files share: the `rebound` binary of this build, run from the
//! repository root as CI runs it.
#![allow(dead_code)] // each test file uses its own part

use std::{
    io::Write,
    process::{Command, Output, Stdio},
};

/// The repository root: fixtures and examples are named relative to it.
pub const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// `rebound ARGS` from the root, stdin closed.
pub fn rebound(args: &[&str]) -> Output {
    run_with(env!("CARGO_BIN_EXE_rebound"), args, None)
}

/// `rebound ARGS` from the root with `input` on stdin.
pub fn rebound_stdin(args: &[&str], input: &[u8]) -> Output {
    run_with(env!("CARGO_BIN_EXE_rebound"), args, Some(input))
}

/// `bin ARGS` from the root, with `stdin` piped in when given.
pub fn run_with(bin: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(bin)
        .args(args)
        .current_dir(ROOT)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rebound runs");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin");
        // The binary may stop reading early (too large); a broken pipe is fine then.
        let _ = pipe.write_all(input);
    }
    child.wait_with_output().expect("rebound exits")
}

/// A file of the repository, by its path from the root.
pub fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{path}")).expect("a file of the repository")
}
