//! Byte sizes as the file writes them: bare bytes (`200000`) or a whole number with a unit (`4MiB`).
//!
//! Units are `KiB`, `MiB`, `GiB` (powers of 1024) and `KB`, `MB`, `GB` (powers of 1000), spelled exactly
//! so: `mb` is rejected rather than guessed at, since lower case is how bits are often written, and the
//! durations next to these keys are case-sensitive too. Only whole numbers: `1.5MiB` is written `1536KiB`.

/// Largest first within each family; the binary ones double as the units sizes are formatted in.
const UNITS: [(&str, u128); 7] = [
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("", 1),
];

const BINARY_UNITS: [(&str, usize); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];

/// Why a size was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// Not a whole number with one of the units.
    Malformed,
    /// Well-formed, but more bytes than `usize` holds.
    TooLarge,
}

/// The size in bytes; zero is returned as is, for the caller's range check to name.
pub fn parse(text: &str) -> Result<usize, Invalid> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at_checked(split).ok_or(Invalid::Malformed)?;
    let (_, unit_bytes) = UNITS
        .into_iter()
        .find(|(name, _)| *name == unit)
        .ok_or(Invalid::Malformed)?;
    if number.is_empty() {
        return Err(Invalid::Malformed);
    }
    // Only digits are left, so the parse fails only by overflowing.
    let count: u128 = number.parse().map_err(|_| Invalid::TooLarge)?;
    count
        .checked_mul(unit_bytes)
        .and_then(|bytes| usize::try_from(bytes).ok())
        .ok_or(Invalid::TooLarge)
}

/// `bytes` as a count of the largest binary unit that holds it exactly; `None` if none does (or for 0).
pub fn in_binary_unit(bytes: usize) -> Option<(usize, &'static str)> {
    BINARY_UNITS
        .into_iter()
        .find(|(_, size)| bytes != 0 && bytes.is_multiple_of(*size))
        .map(|(name, size)| (bytes / size, name))
}

/// In the largest binary unit that represents `bytes` exactly (`4MiB`), else as bare bytes (`1000`).
pub fn format(bytes: usize) -> String {
    match in_binary_unit(bytes) {
        Some((count, unit)) => format!("{count}{unit}"),
        None => bytes.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn valid_sizes_parse_exactly() {
        let cases = [
            ("4MiB", 4 << 20),
            ("512KiB", 512 << 10),
            ("1GiB", 1 << 30),
            ("1KB", 1000),
            ("3MB", 3_000_000),
            ("2GB", 2_000_000_000),
            ("123", 123),
            ("0", 0),
            ("0MiB", 0),
            ("007KiB", 7 << 10),
        ];
        for (text, expected) in cases {
            assert_eq!(parse(text), Ok(expected), "{text}");
        }
    }

    #[test]
    fn malformed_sizes_are_rejected() {
        let cases = [
            "", "-1", "+1", "1.5MiB", "1.MiB", "4mb", "4mib", "4Mib", "4MIB", "4 MiB", "MiB", "4B",
            "4TiB", "4MiBs", "0x10", "1e6", "4KiBKiB", "١٢",
        ];
        for text in cases {
            assert_eq!(parse(text), Err(Invalid::Malformed), "{text}");
        }
    }

    #[test]
    fn sizes_beyond_usize_are_too_large() {
        let cases = [
            "99999999999999999999GiB",
            "18446744073709551616",
            "17179869184GiB",
            "999999999999999999999999999999999999999999999",
        ];
        for text in cases {
            assert_eq!(parse(text), Err(Invalid::TooLarge), "{text}");
        }
        assert_eq!(parse(&usize::MAX.to_string()), Ok(usize::MAX));
    }

    #[test]
    fn sizes_are_formatted_in_the_largest_exact_binary_unit() {
        let cases = [
            (4 << 20, "4MiB"),
            (512 << 10, "512KiB"),
            (1536 << 10, "1536KiB"),
            (3 << 30, "3GiB"),
            (1 << 40, "1024GiB"),
            (1000, "1000"),
            (123, "123"),
            (1, "1"),
        ];
        for (bytes, expected) in cases {
            assert_eq!(format(bytes), expected, "{bytes}");
        }
    }

    proptest! {
        #[test]
        fn formatting_then_parsing_gives_the_same_size(bytes in any::<usize>()) {
            prop_assert_eq!(parse(&format(bytes)), Ok(bytes));
        }

        #[test]
        fn binary_multiples_are_formatted_with_a_unit(count in 1usize..1 << 20, shift in 10u32..31) {
            prop_assert!(in_binary_unit(count << shift).is_some());
        }
    }
}
