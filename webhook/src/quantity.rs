//! Kubernetes resource quantities (`64Gi`, `500M`, `1e9`, `128974848`, `2`), as the API server
//! writes them. Case matters here, unlike the estimator's human spellings: `m` is milli, `M` mega.

/// Parses a quantity into a number of base units (bytes for memory, devices for GPUs), rounding
/// milli-units up. `None` for anything that is not a valid, non-negative quantity.
pub fn parse(s: &str) -> Option<u64> {
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
    use super::parse;

    #[test]
    fn parses_the_spellings_the_api_server_writes() {
        let table = [
            ("64Gi", Some(64 << 30)),
            ("500M", Some(500_000_000)),
            ("1e9", Some(1_000_000_000)),
            ("128974848", Some(128_974_848)),
            ("1.5Gi", Some(3 << 29)),
            ("2", Some(2)),
            ("1500m", Some(2)),
            ("0", Some(0)),
        ];
        for (input, expected) in table {
            assert_eq!(parse(input), expected, "{input}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_quantity() {
        for bad in ["", "Gi", "64GiB", "sixty", "1e", "-1Gi", "1e400"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
