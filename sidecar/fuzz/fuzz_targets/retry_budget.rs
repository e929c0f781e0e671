//! See `targets/retry_budget.rs`.
#![no_main]

#[path = "../targets/retry_budget.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
