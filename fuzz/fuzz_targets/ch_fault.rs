//! cargo-fuzz target: see `hugemem_fuzz::ch_fault`.
#![no_main]

/// Shorter inputs cannot hold a request header.
const MIN_LEN: usize = 16;

libfuzzer_sys::fuzz_target!(|data: &[u8]| -> libfuzzer_sys::Corpus {
    if data.len() < MIN_LEN {
        return libfuzzer_sys::Corpus::Reject;
    }
    hugemem_fuzz::ch_fault(data);
    libfuzzer_sys::Corpus::Keep
});
