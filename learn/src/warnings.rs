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
