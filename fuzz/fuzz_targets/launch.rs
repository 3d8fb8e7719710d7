#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| memguard_fuzz_targets::launch(data));
