//! See `targets/compiled_document.rs`.
#![no_main]

#[path = "../targets/compiled_document.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
