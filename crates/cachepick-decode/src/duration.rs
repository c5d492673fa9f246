//! Durations as the file writes them: `<number><unit>`, e.g. `1s`, `500ms`, `1.5m`.
//!
//! Parsing is exact (decimal arithmetic on nanoseconds, no floating point), so that formatting a parsed
//! duration and parsing it again gives the same value.

use std::time::Duration;

/// Largest first, so that formatting picks the largest unit that represents a duration exactly.
const UNITS: [(&str, u128); 4] = [
    ("h", 3_600_000_000_000),
    ("m", 60_000_000_000),
    ("s", 1_000_000_000),
    ("ms", 1_000_000),
];

const NANOS_PER_MILLI: u128 = 1_000_000;
const NANOS_PER_SEC: u128 = 1_000_000_000;

/// `None` for a negative number, a missing or unknown unit, anything finer than a nanosecond, or a
/// duration beyond `Duration`'s range.
pub fn parse(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at_checked(split)?;
    let (_, unit_nanos) = UNITS.into_iter().find(|(name, _)| *name == unit)?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(fraction) || number.ends_with('.') {
        return None;
    }
    let mantissa: u128 = format!("{whole}{fraction}").parse().ok()?;
    let scale = 10u128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
    let scaled = mantissa.checked_mul(unit_nanos)?;
    if !scaled.is_multiple_of(scale) {
        return None;
    }
    let nanos = scaled / scale;
    let secs = u64::try_from(nanos / NANOS_PER_SEC).ok()?;
    let subsec = u32::try_from(nanos % NANOS_PER_SEC).ok()?;
    Some(Duration::new(secs, subsec))
}

/// In the largest unit that represents `duration` exactly; below a millisecond, as decimal milliseconds.
pub fn format(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if let Some((name, size)) = UNITS
        .into_iter()
        .find(|(_, size)| nanos.is_multiple_of(*size))
    {
        return format!("{}{name}", nanos / size);
    }
    let fraction = format!("{:06}", nanos % NANOS_PER_MILLI);
    format!(
        "{}.{}ms",
        nanos / NANOS_PER_MILLI,
        fraction.trim_end_matches('0')
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn valid_durations_parse_exactly() {
        let cases = [
            ("1s", Duration::from_secs(1)),
            ("500ms", Duration::from_millis(500)),
            ("1.5s", Duration::from_millis(1500)),
            ("2m", Duration::from_secs(120)),
            ("0.25h", Duration::from_secs(900)),
            ("0.000001ms", Duration::from_nanos(1)),
            ("0s", Duration::ZERO),
        ];
        for (text, expected) in cases {
            assert_eq!(parse(text), Some(expected), "{text}");
        }
    }

    #[test]
    fn malformed_durations_are_rejected() {
        let cases = [
            "",
            "1",
            "s",
            "-1s",
            "+1s",
            "1 s",
            "1sec",
            "1.s",
            ".5s",
            "1..5s",
            "1.2.3s",
            "1e3ms",
            "0.0000001ms",
            "1S",
            "999999999999999999999999999999h",
        ];
        for text in cases {
            assert_eq!(parse(text), None, "{text}");
        }
    }

    #[test]
    fn durations_are_formatted_in_the_largest_exact_unit() {
        let cases = [
            (Duration::from_secs(1), "1s"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(7200), "2h"),
            (Duration::from_nanos(1_500_000), "1.5ms"),
            (Duration::from_nanos(1), "0.000001ms"),
        ];
        for (duration, expected) in cases {
            assert_eq!(format(duration), expected);
        }
    }

    proptest! {
        #[test]
        fn formatting_then_parsing_gives_the_same_duration(secs in 0u64..=u64::MAX, nanos in 0u32..1_000_000_000) {
            let duration = Duration::new(secs, nanos);
            prop_assert_eq!(parse(&format(duration)), Some(duration));
        }
    }
}
