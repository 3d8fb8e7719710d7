//! The one-line JSON summary written to the termination-message path at exit.

use crate::state::Status;
use memguard_api::Signal;
use memguard_api::summary::{MAX_SUMMARY_BYTES, Summary};
use std::io;
use std::path::Path;

/// The summary of a run.
pub fn build(st: &Status, sig: &Signal, estimate: Option<u64>, exit_reason: &str) -> Summary {
    let sample = st.sample.as_ref();
    let cgroup_peak = sample.and_then(|s| s.peak_bytes);
    Summary {
        version: 1,
        peak_bytes: match (st.peak_working_set, cgroup_peak) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        },
        gpu_peak_bytes: st.gpu_peak,
        limit_bytes: sample.and_then(|s| s.effective_limit()),
        estimate_bytes: estimate,
        downgrades: st.downgrades,
        growths: st.growths,
        oom_events: st.oom_events(),
        oom_kill_phase: st.oom_kill_phase,
        max_level: st.max_level.max(sig.level),
        batch_size: sig.batch_size,
        grad_accumulation: sig.grad_accumulation,
        oom_reports: st.oom_reports(),
        last_oom: st.last_oom.clone(),
        sticky_batch_size: st.sticky_batch_size,
        trainer_config: st.trainer_config.clone(),
        config_mismatch: st
            .config_mismatch()
            .into_iter()
            .filter(|(_, differs)| *differs)
            .map(|(k, _)| k.to_string())
            .collect(),
        train_start: st.train_start.clone(),
        memory_source: st
            .source_info
            .filter(|i| i.kind != "none")
            .map(|i| format!("{} via {}", i.kind, i.view)),
        exit_reason: exit_reason.chars().take(200).collect(),
    }
}

/// One JSON line, at most [`MAX_SUMMARY_BYTES`].
pub fn to_line(summary: &Summary) -> String {
    let mut line = serde_json::to_string(summary).unwrap_or_else(|_| "{}".into());
    if line.len() + 1 > MAX_SUMMARY_BYTES {
        // Drop the free text first: the figures are what the controller learns from.
        let mut s = summary.clone();
        s.exit_reason.clear();
        if let Some(oom) = s.last_oom.as_mut() {
            oom.message.clear();
        }
        line = serde_json::to_string(&s).unwrap_or_else(|_| "{}".into());
    }
    line.push('\n');
    line
}

/// Writes the summary line to `path` (the kubelet reads `/dev/termination-log`).
pub fn write(path: &Path, summary: &Summary) -> io::Result<()> {
    std::fs::write(path, to_line(summary))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{Limit, MemorySample};
    use memguard_api::Level;

    #[test]
    fn summary_is_one_short_json_line() {
        let st = Status {
            sample: Some(MemorySample {
                working_set_bytes: Some(10),
                peak_bytes: Some(120),
                max: Some(Limit::Bytes(200)),
                ..Default::default()
            }),
            peak_working_set: Some(100),
            oom_kills: 2,
            downgrades: 1,
            max_level: Level::Downgrade,
            ..Default::default()
        };
        let mut sig = Signal::initial(2, 4, false);
        sig.level = Level::Warn;
        let s = build(&st, &sig, Some(150), &"sigterm ".repeat(1000));
        assert_eq!(s.peak_bytes, Some(120));
        assert_eq!(s.limit_bytes, Some(200));
        assert_eq!(s.oom_events, 2);
        assert_eq!(s.max_level, Level::Downgrade);
        let line = to_line(&s);
        assert!(line.len() <= MAX_SUMMARY_BYTES);
        assert_eq!(line.matches('\n').count(), 1);
        let back: Summary = serde_json::from_str(line.trim()).expect("parses");
        assert_eq!(back.batch_size, 2);
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("termination-log");
        write(&p, &s).expect("writes");
        assert_eq!(std::fs::read_to_string(p).expect("read"), line);
    }
}
