//! See `targets/request_handling.rs`.
#![no_main]

#[path = "../targets/request_handling.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
