//! Durations as people write them (`100ms`, `2s`, `1m30s`; a bare number is seconds): one
//! parser for the sidecar's flags and the policy's sidecar settings, and one way to write a
//! duration back, so that whatever the policy accepts the sidecar accepts too.

use std::time::Duration;

/// What the CRD schema and the chart's values schema let through: one or more `<number><unit>`
/// groups with `ns`, `us`, `µs`, `ms`, `s`, `m` or `h`. Every such text that [`parse_duration`]
/// also accepts is valid; the policy is checked with [`parse_duration`] when it loads.
pub const PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// `100ms`, `2s`, `1m30s`, `1.5s`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s).map_err(|e| format!("{s:?} is not a duration: {e}"))
}

/// `d` in the largest unit that holds it exactly (`100ms`, `2s`, `90s`, `1m`, `1h`, `1500us`),
/// a spelling that both [`parse_duration`] and [`PATTERN`] accept.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    const UNITS: [(u128, &str); 6] = [
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    if nanos == 0 {
        return "0s".into();
    }
    UNITS
        .iter()
        .find(|(size, _)| nanos.is_multiple_of(*size))
        .map_or_else(
            || format!("{nanos}ns"),
            |(size, unit)| format!("{}{unit}", nanos / size),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_people_write_and_refuses_the_rest() {
        let table = [
            ("100ms", Some(Duration::from_millis(100))),
            ("2s", Some(Duration::from_secs(2))),
            ("30", Some(Duration::from_secs(30))),
            ("1m30s", Some(Duration::from_secs(90))),
            ("1.5s", Some(Duration::from_millis(1500))),
            (" 250ms ", Some(Duration::from_millis(250))),
            ("10 parsecs", None),
            ("fast", None),
            ("", None),
            ("-1s", None),
        ];
        for (text, want) in table {
            assert_eq!(parse_duration(text).ok(), want, "{text:?}");
        }
    }

    #[test]
    fn a_written_duration_parses_back_to_itself() {
        for ms in [
            1, 100, 250, 1000, 1500, 60_000, 90_000, 3_600_000, 5_400_000,
        ] {
            let d = Duration::from_millis(ms);
            let text = format_duration(d);
            assert_eq!(parse_duration(&text), Ok(d), "{text}");
            assert!(
                !text.contains(' '),
                "{text}: one word, as the schema's pattern wants"
            );
        }
        assert_eq!(format_duration(Duration::from_millis(100)), "100ms");
        assert_eq!(format_duration(Duration::from_secs(120)), "2m");
        assert_eq!(format_duration(Duration::from_micros(1500)), "1500us");
    }
}
