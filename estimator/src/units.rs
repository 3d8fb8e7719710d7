//! Units as types, and the human spellings users write counts in (`7B`, `125M`). Sizes in bytes
//! (`24Gi`, `24GiB`) are read by `memguard_api::quantity`, the one size parser.

use std::fmt;

/// A number of bytes. Arithmetic saturates: an estimate never wraps around.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct Bytes(pub u64);

impl Bytes {
    /// Zero bytes.
    pub const ZERO: Bytes = Bytes(0);

    /// `n` × 2³⁰ bytes.
    pub const fn gib(n: u64) -> Bytes {
        Bytes(n << 30)
    }

    /// `n` × 2²⁰ bytes.
    pub const fn mib(n: u64) -> Bytes {
        Bytes(n << 20)
    }

    /// Bytes from a float, rounded up, saturating at `u64::MAX` and at zero for negatives or NaN.
    pub fn from_f64(x: f64) -> Bytes {
        if x.is_nan() || x <= 0.0 {
            Bytes(0)
        } else if x >= u64::MAX as f64 {
            Bytes(u64::MAX)
        } else {
            Bytes(x.ceil() as u64)
        }
    }

    /// The value as `f64`.
    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }

    /// The value in GiB, for display.
    pub fn as_gib(self) -> f64 {
        self.0 as f64 / (1u64 << 30) as f64
    }

    /// Saturating sum.
    pub fn saturating_add(self, other: Bytes) -> Bytes {
        Bytes(self.0.saturating_add(other.0))
    }
}

impl std::ops::Add for Bytes {
    type Output = Bytes;
    fn add(self, rhs: Bytes) -> Bytes {
        self.saturating_add(rhs)
    }
}

impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        iter.fold(Bytes::ZERO, |a, b| a + b)
    }
}

impl fmt::Display for Bytes {
    /// Binary units with two decimals: `15.23 GiB`, `512.00 MiB`, `900 B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut value = self.0 as f64 / 1024.0;
        let mut unit = 0;
        while value >= 1024.0 && unit < UNITS.len() - 1 {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.2} {}", UNITS[unit])
    }
}

/// Why a size or count could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Nothing to parse.
    #[error("empty value")]
    Empty,
    /// Not a number with a known suffix.
    #[error("`{0}` is not a number with an optional unit (examples: {1})")]
    Invalid(String, &'static str),
    /// Negative or too large to represent.
    #[error("`{0}` is out of range")]
    OutOfRange(String),
}

/// Splits `"24GiB"` into `(24.0, "gib")`.
fn split_number(s: &str, examples: &'static str) -> Result<(f64, String), ParseError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(ParseError::Empty);
    }
    let cut = s
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(s.len());
    // `7e9` is a number; `7E` alone is not a suffix we know, so it stays with the number.
    let (num, suffix) = s.split_at(cut);
    let num = num.trim();
    let value: f64 = num
        .parse()
        .map_err(|_| ParseError::Invalid(s.to_string(), examples))?;
    if !value.is_finite() {
        return Err(ParseError::Invalid(s.to_string(), examples));
    }
    if value < 0.0 {
        return Err(ParseError::OutOfRange(s.to_string()));
    }
    Ok((value, suffix.trim().to_ascii_lowercase()))
}

/// Parses a count such as a parameter count: `7e9`, `7B`, `125M`, `1.5K`, `6738415616`.
pub fn parse_count(s: &str) -> Result<u64, ParseError> {
    const EXAMPLES: &str = "`7B`, `125M`, `7e9`, `6738415616`";
    let (value, suffix) = split_number(s, EXAMPLES)?;
    let multiplier = match suffix.as_str() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "b" | "g" => 1e9,
        "t" => 1e12,
        _ => return Err(ParseError::Invalid(s.trim().to_string(), EXAMPLES)),
    };
    let n = value * multiplier;
    if n >= u64::MAX as f64 {
        return Err(ParseError::OutOfRange(s.trim().to_string()));
    }
    Ok(n.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts() {
        assert_eq!(parse_count("7B"), Ok(7_000_000_000));
        assert_eq!(parse_count("125M"), Ok(125_000_000));
        assert_eq!(parse_count("7e9"), Ok(7_000_000_000));
        assert_eq!(parse_count("1.5k"), Ok(1500));
        assert!(parse_count("7X").is_err());
        assert!(parse_count("-7B").is_err());
    }

    #[test]
    fn displays_binary_units() {
        assert_eq!(Bytes(900).to_string(), "900 B");
        assert_eq!(Bytes::mib(512).to_string(), "512.00 MiB");
        assert_eq!(Bytes::gib(24).to_string(), "24.00 GiB");
    }
}
