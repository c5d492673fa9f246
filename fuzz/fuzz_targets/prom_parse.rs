//! Fuzzes the Prometheus text reader, `load::samples`, with arbitrary bytes read as lossy UTF-8, and
//! checks what must hold for any input: no panic; every yielded sample has a well-formed name and labels
//! that iterate to the end, each found again by name; the malformed count is bounded by the lines; and
//! a name filter yields exactly the full parse's samples of the names it accepts.
#![no_main]

use libfuzzer_sys::fuzz_target;

use cachepick::load::samples;

fn is_metric_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_' || b == b':')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut all = samples(&text, |_| true);
    let mut names = Vec::new();
    for sample in all.by_ref() {
        assert!(is_metric_name(sample.name), "{:?}", sample.name);
        let mut seen = Vec::new();
        for (label, value) in sample.labels() {
            if !seen.contains(&label) {
                assert_eq!(sample.label(label), Some(value));
                seen.push(label);
            }
        }
        names.push(sample.name);
    }
    assert!(all.malformed() <= text.split('\n').count());

    // Filtering on the first byte splits the names of any input into both classes.
    let wanted = |name: &str| name.bytes().next().is_some_and(|b| b % 2 == 0);
    let filtered: Vec<&str> = samples(&text, wanted).map(|s| s.name).collect();
    let expected: Vec<&str> = names.into_iter().filter(|name| wanted(name)).collect();
    assert_eq!(filtered, expected);
});
