//! See `targets/manifests.rs`.
#![no_main]

#[path = "../targets/manifests.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
