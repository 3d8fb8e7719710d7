//! Sizes as people write them, and Kubernetes' own quantities: the one place memguard reads a
//! number of bytes.
//!
//! A [`Size`] is what a user writes for memory: the policy's `defaultGpuMemory` and `gpuMemory`,
//! the `memguard.io/gpu-memory` annotation and the CLI's `--budget`/`--gpu-memory`. It needs a
//! unit: a bare `24` used to be 24 bytes, which no GPU is, so every pod planned against it was
//! "cannot fit". Kubernetes spellings (`24Gi`, `80G`, `23028Mi`) and the `GiB` ones (`24GiB`,
//! `80GB`) are both read, in any case. [`SIZE_PATTERN`] is the same grammar as a regular
//! expression, for the CRD schema and the chart's values schema, so that Helm and the API server
//! refuse what [`Size::parse`] refuses.
//!
//! [`parse_quantity`] reads Kubernetes' own resource quantities (`limits.memory`, device counts,
//! DRA capacities), where a bare number is bytes or devices by Kubernetes' definition and case
//! matters (`m` is milli).

use memguard_estimator::Bytes;
use std::fmt;

/// The grammar of [`Size::parse`] as a regular expression (Go `regexp` and ECMA 262 alike): a
/// positive decimal number (no sign, no exponent), optional blanks, then one of `B`, `k`, `M`,
/// `G`, `T`, each optionally followed by `i` and then `B`, in any case. Zero is refused here too
/// (a digit 1–9 must appear), as [`Size::parse`] refuses it.
pub const SIZE_PATTERN: &str = r"^\s*([0-9]*[1-9][0-9]*(\.[0-9]*)?|[0-9]*\.[0-9]*[1-9][0-9]*)\s*([kKmMgGtT][iI]?[bB]?|[bB])\s*$";

/// Examples every size message ends with.
const EXAMPLES: &str = "sizes are like 24Gi, 80G, 23028Mi or 24GiB";

/// A size as its user wrote it: the bytes, and the text (trimmed) so that messages say it back
/// in the user's own unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    bytes: Bytes,
    text: String,
    unit_len: usize,
}

/// Why a text is not a [`Size`]. Each message quotes the text and says what would be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Nothing but blanks.
    #[error("empty: {EXAMPLES}")]
    Empty,
    /// A number without a unit (it used to be bytes).
    #[error("`{number}` has no unit: did you mean `{suggestion}`? ({EXAMPLES})")]
    NoUnit {
        /// The number as written.
        number: String,
        /// The spelling it most likely meant.
        suggestion: String,
    },
    /// A number with a suffix that is not a unit.
    #[error("`{text}`: `{unit}` is not a unit ({EXAMPLES})")]
    UnknownUnit {
        /// The whole text.
        text: String,
        /// The suffix.
        unit: String,
    },
    /// No number where one is expected (a sign, an exponent, a word).
    #[error("`{0}` is not a size ({EXAMPLES})")]
    NotASize(String),
    /// Zero bytes: no budget.
    #[error("`{0}` is zero: a size must be more than 0")]
    Zero(String),
    /// More bytes than a `u64` holds.
    #[error("`{0}` is too large")]
    TooLarge(String),
}

impl Size {
    /// Reads a size: a positive number and a unit (see [`SIZE_PATTERN`]).
    pub fn parse(s: &str) -> Result<Size, SizeError> {
        let text = s.trim();
        if text.is_empty() {
            return Err(SizeError::Empty);
        }
        let cut = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, rest) = text.split_at(cut);
        let unit = rest.trim_start();
        let digits = number.chars().filter(char::is_ascii_digit).count();
        // One dot at most and a digit somewhere: what `SIZE_PATTERN`'s number allows.
        if digits == 0 || number.matches('.').count() > 1 {
            return Err(SizeError::NotASize(text.to_string()));
        }
        let value: f64 = number
            .parse()
            .map_err(|_| SizeError::NotASize(text.to_string()))?;
        if unit.is_empty() {
            return Err(SizeError::NoUnit {
                number: number.to_string(),
                suggestion: no_unit_suggestion(number, value),
            });
        }
        let multiplier = multiplier(unit).ok_or_else(|| {
            // `24e9`, `-1Gi` and `24 parsecs` all end here; say which it is.
            if unit.starts_with(['e', 'E']) && unit[1..].starts_with(|c: char| c.is_ascii_digit()) {
                SizeError::NotASize(text.to_string())
            } else {
                SizeError::UnknownUnit {
                    text: text.to_string(),
                    unit: unit.to_string(),
                }
            }
        })?;
        if value == 0.0 {
            return Err(SizeError::Zero(text.to_string()));
        }
        let bytes = (value * multiplier).ceil();
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(SizeError::TooLarge(text.to_string()));
        }
        Ok(Size {
            bytes: Bytes(bytes as u64),
            text: text.to_string(),
            unit_len: unit.len(),
        })
    }

    /// The size in bytes.
    pub fn bytes(&self) -> Bytes {
        self.bytes
    }

    /// The text as written (trimmed).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The unit as written (`Gi`, `GiB`, `G`, …).
    pub fn unit(&self) -> &str {
        &self.text[self.text.len() - self.unit_len..]
    }

    /// `bytes` written in this size's unit, e.g. a 0.9 share of `24Gi` as `21.6Gi`: a figure
    /// derived from what the user wrote reads in the unit they chose.
    pub fn in_unit(&self, bytes: Bytes) -> String {
        let per = multiplier(self.unit()).unwrap_or(1.0);
        let value = bytes.as_f64() / per;
        // Up to two decimals, without trailing zeros: `21.6Gi`, `24Gi`, `23028Mi`.
        let mut number = format!("{value:.2}");
        if number.contains('.') {
            number = number
                .trim_end_matches('0')
                .trim_end_matches('.')
                .to_string();
        }
        format!("{number}{}", self.unit())
    }
}

impl fmt::Display for Size {
    /// The size as written.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for Size {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Size, SizeError> {
        Size::parse(s)
    }
}

/// Bytes per unit, any case: `B`; SI `k`, `M`, `G`, `T` (with or without `B`); binary `Ki`,
/// `Mi`, `Gi`, `Ti` (with or without `B`). As in Kubernetes, `G` is 10⁹ and `Gi` 2³⁰.
fn multiplier(unit: &str) -> Option<f64> {
    let unit = unit.to_ascii_lowercase();
    let prefix = unit.chars().next()?;
    if unit == "b" {
        return Some(1.0);
    }
    // By the character's own length: a unit is any text a user wrote (`24øi`).
    let rest = &unit[prefix.len_utf8()..];
    let power = match prefix {
        'k' => 1,
        'm' => 2,
        'g' => 3,
        't' => 4,
        _ => return None,
    };
    let base: f64 = match rest {
        "" | "b" => 1000.0,
        "i" | "ib" => 1024.0,
        _ => return None,
    };
    Some(base.powi(power))
}

/// What a bare number most likely meant: GiB for a figure no GPU or container is measured in
/// bytes by (under 1 MiB), else bytes written out.
fn no_unit_suggestion(number: &str, value: f64) -> String {
    if value < 1_048_576.0 {
        format!("{number}Gi")
    } else {
        format!("{number}B")
    }
}

/// Parses a Kubernetes quantity (`64Gi`, `500M`, `1e9`, `128974848`, `2`) into base units
/// (bytes for memory, devices for GPUs), rounding milli-units up. Case matters, unlike a
/// [`Size`]: `m` is milli, `M` mega; and a bare number is a count of base units, as Kubernetes
/// defines it. `None` for anything that is not a valid, non-negative quantity.
pub fn parse_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    if number.is_empty() {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let multiplier: f64 = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        exp if exp.starts_with(['e', 'E']) => {
            let e: i32 = exp[1..].parse().ok()?;
            10f64.powi(e)
        }
        _ => return None,
    };
    let n = value * multiplier;
    if !n.is_finite() || n < 0.0 || n >= u64::MAX as f64 {
        return None;
    }
    Some(n.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(s: &str) -> Result<Bytes, SizeError> {
        Size::parse(s).map(|s| s.bytes())
    }

    /// Kubernetes spellings and the `GiB` ones, any case, with blanks around or between.
    #[test]
    fn reads_kubernetes_and_gib_spellings() {
        let table = [
            ("24Gi", Bytes::gib(24)),
            ("24GiB", Bytes::gib(24)),
            ("24gib", Bytes::gib(24)),
            (" 24 Gi ", Bytes::gib(24)),
            ("80G", Bytes(80_000_000_000)),
            ("80GB", Bytes(80_000_000_000)),
            ("23028Mi", Bytes::mib(23028)),
            ("512MiB", Bytes::mib(512)),
            ("500M", Bytes(500_000_000)),
            ("1.5Ti", Bytes(3 << 39)),
            ("0.5Gi", Bytes::mib(512)),
            (".5Gi", Bytes::mib(512)),
            ("2k", Bytes(2000)),
            ("2Ki", Bytes(2048)),
            ("1024B", Bytes(1024)),
            ("1073741824b", Bytes::gib(1)),
        ];
        for (text, want) in table {
            assert_eq!(bytes(text), Ok(want), "{text}");
        }
    }

    /// Issue 38: `defaultGpuMemory: 24` was 24 bytes. A bare number is refused with the
    /// spelling it most likely meant.
    #[test]
    fn a_bare_number_is_refused_with_the_unit_it_most_likely_meant() {
        let e = Size::parse("24").expect_err("no unit");
        assert_eq!(
            e.to_string(),
            "`24` has no unit: did you mean `24Gi`? (sizes are like 24Gi, 80G, 23028Mi or 24GiB)"
        );
        assert!(
            Size::parse("22.5")
                .expect_err("no unit")
                .to_string()
                .starts_with("`22.5` has no unit: did you mean `22.5Gi`?")
        );
        // A figure that only makes sense as bytes: said as bytes.
        assert!(
            Size::parse("1073741824")
                .expect_err("no unit")
                .to_string()
                .starts_with("`1073741824` has no unit: did you mean `1073741824B`?")
        );
    }

    #[test]
    fn refuses_what_is_not_a_positive_size_and_says_why() {
        let cases = [
            ("", "empty: sizes are like"),
            ("  ", "empty: sizes are like"),
            ("lots", "`lots` is not a size"),
            ("-1Gi", "`-1Gi` is not a size"),
            ("+1Gi", "`+1Gi` is not a size"),
            ("1e9", "`1e9` is not a size"),
            ("1.2.3Gi", "`1.2.3Gi` is not a size"),
            ("Gi", "`Gi` is not a size"),
            ("24 parsecs", "`24 parsecs`: `parsecs` is not a unit"),
            ("24Gib2", "`24Gib2`: `Gib2` is not a unit"),
            ("24P", "`24P`: `P` is not a unit"),
            ("24øi", "`24øi`: `øi` is not a unit"),
            ("1é", "`1é`: `é` is not a unit"),
            ("0Gi", "`0Gi` is zero"),
            ("0.0Mi", "`0.0Mi` is zero"),
            (
                "99999999999999999999Ti",
                "`99999999999999999999Ti` is too large",
            ),
        ];
        for (text, want) in cases {
            let e = Size::parse(text).expect_err(text).to_string();
            assert!(e.starts_with(want), "{text:?}: {e}");
        }
    }

    /// A size says itself back as written, and figures derived from it in its unit.
    #[test]
    fn prints_back_in_the_unit_it_was_read_in() {
        let s = Size::parse(" 24GiB ").expect("valid");
        assert_eq!(s.to_string(), "24GiB");
        assert_eq!(s.unit(), "GiB");
        assert_eq!(
            s.in_unit(Bytes::from_f64(s.bytes().as_f64() * 0.9)),
            "21.6GiB"
        );
        let s = Size::parse("23028Mi").expect("valid");
        assert_eq!(s.in_unit(s.bytes()), "23028Mi");
        let s = Size::parse("80G").expect("valid");
        assert_eq!(s.in_unit(Bytes(72_000_000_000)), "72G");
        let s = Size::parse("1024B").expect("valid");
        assert_eq!(s.in_unit(Bytes(10)), "10B");
    }

    #[test]
    fn kubernetes_quantities_read_bare_numbers_as_base_units() {
        assert_eq!(parse_quantity("128974848"), Some(128_974_848));
        assert_eq!(parse_quantity("64Gi"), Some(64 << 30));
        assert_eq!(parse_quantity("500m"), Some(1));
        assert_eq!(parse_quantity("1e9"), Some(1_000_000_000));
        assert_eq!(parse_quantity("24GiB"), None, "not a Kubernetes quantity");
    }
}
