//! Admission warnings: cut to the size Kubernetes advises, a "cannot fit" verdict worded so that
//! the cut loses the figures, not the config. Every stage of the decision writes through these.

/// Kubernetes advises keeping admission warnings under 120 characters.
pub const MAX_WARNING_CHARS: usize = 120;

/// The admission warning for a "cannot fit: <why>; smallest config tried: <config>" verdict:
/// the config first, so that cutting it to [`MAX_WARNING_CHARS`] loses the figures, not the
/// config (the full text is in `memguard.io/error`).
pub fn cannot_fit_warning(verdict: &str) -> String {
    const TRIED: &str = "; smallest config tried: ";
    let body = verdict.strip_prefix("cannot fit: ").unwrap_or(verdict);
    match body.split_once(TRIED) {
        Some((why, config)) => truncate(&format!(
            "memguard: cannot fit; smallest config tried: {config} ({why})"
        )),
        None => truncate(&format!("memguard: cannot fit: {body}")),
    }
}

/// Cuts `s` to [`MAX_WARNING_CHARS`] characters, marking the cut with `…`.
pub fn truncate(s: &str) -> String {
    if s.chars().count() <= MAX_WARNING_CHARS {
        return s.to_string();
    }
    let mut out: String = s.chars().take(MAX_WARNING_CHARS - 1).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_keeps_short_text_and_marks_the_cut() {
        assert_eq!(truncate("short"), "short");
        let long = "x".repeat(500);
        let cut = truncate(&long);
        assert_eq!(cut.chars().count(), MAX_WARNING_CHARS);
        assert!(cut.ends_with('…'));
    }

    #[test]
    fn a_cut_verdict_keeps_the_config_and_loses_the_figures() {
        let verdict = format!(
            "cannot fit: {}; smallest config tried: batch 1 × 1, checkpointing, seq 512",
            "estimated 93.1 GiB over the 80.0 GiB budget ".repeat(4)
        );
        let warning = cannot_fit_warning(&verdict);
        assert!(
            warning.starts_with(
                "memguard: cannot fit; smallest config tried: batch 1 × 1, checkpointing, seq 512 ("
            ),
            "{warning}"
        );
        assert_eq!(warning.chars().count(), MAX_WARNING_CHARS);
        assert!(warning.ends_with('…'));
    }

    #[test]
    fn a_verdict_without_a_config_is_said_as_it_is() {
        assert_eq!(
            cannot_fit_warning("cannot fit: the model alone is over the budget"),
            "memguard: cannot fit: the model alone is over the budget"
        );
    }

    #[test]
    fn a_warning_at_the_limit_is_kept_whole_and_one_over_is_cut() {
        let at_limit = "é".repeat(MAX_WARNING_CHARS);
        assert_eq!(truncate(&at_limit), at_limit);
        let over = format!("{at_limit}x");
        let cut = truncate(&over);
        assert_eq!(cut.chars().count(), MAX_WARNING_CHARS);
        assert_eq!(cut, format!("{}…", "é".repeat(MAX_WARNING_CHARS - 1)));
    }
}
