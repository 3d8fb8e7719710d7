//! The sampled memory timeline as Chrome trace-event JSON (`GET /v1/trace`), openable in
//! Perfetto or chrome://tracing: counter events (`ph: "C"`) for memory, instant events
//! (`ph: "i"`) for level changes.

use memguard_api::Level;
use serde_json::{Value, json};
use std::collections::VecDeque;

/// Points kept: at one a second that is over an hour; at 100 ms, when memory moves, minutes.
pub const TRACE_POINTS: usize = 4096;

/// One point of the timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Microseconds since the sidecar started.
    pub ts_us: u64,
    /// Working set, bytes.
    pub working_set: Option<u64>,
    /// Effective limit, bytes.
    pub limit: Option<u64>,
    /// GPU memory used (most loaded device or trainer report), bytes.
    pub gpu_used: Option<u64>,
    /// Trainer-reported allocated bytes.
    pub allocated: Option<u64>,
    /// The level.
    pub level: Level,
}

/// A bounded timeline that keeps a point when something moved (≥ 0.5 % of the limit or any
/// level change) or a second passed.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    points: VecDeque<Point>,
    levels: VecDeque<(u64, Level, String)>,
}

impl Trace {
    /// Adds a point when it says something new.
    pub fn push(&mut self, p: Point) {
        if let Some(last) = self.points.back() {
            let moved = |a: Option<u64>, b: Option<u64>| match (a, b) {
                (Some(a), Some(b)) => {
                    let scale = p.limit.unwrap_or(1 << 30).max(1) as f64;
                    (a.abs_diff(b) as f64) / scale >= 0.005
                }
                (a, b) => a.is_some() != b.is_some(),
            };
            let quiet = !moved(last.working_set, p.working_set)
                && !moved(last.gpu_used, p.gpu_used)
                && !moved(last.allocated, p.allocated)
                && last.limit == p.limit
                && last.level == p.level
                && p.ts_us.saturating_sub(last.ts_us) < 1_000_000;
            if quiet {
                return;
            }
        }
        if self.points.len() == TRACE_POINTS {
            self.points.pop_front();
        }
        self.points.push_back(p);
    }

    /// Marks a level change.
    pub fn mark(&mut self, ts_us: u64, level: Level, reason: &str) {
        if self.levels.len() == 256 {
            self.levels.pop_front();
        }
        self.levels
            .push_back((ts_us, level, reason.chars().take(200).collect()));
    }

    /// Points kept.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether no point is kept.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The Chrome trace-event document.
    pub fn to_json(&self) -> Value {
        let mut events = vec![json!({
            "name": "process_name", "ph": "M", "pid": 1, "tid": 1,
            "args": {"name": "memguard-sidecar"}
        })];
        for p in &self.points {
            let mut mem = serde_json::Map::new();
            for (k, v) in [
                ("working_set_bytes", p.working_set),
                ("limit_bytes", p.limit),
            ] {
                if let Some(v) = v {
                    mem.insert(k.into(), v.into());
                }
            }
            if !mem.is_empty() {
                events.push(json!({"name": "memory", "ph": "C", "ts": p.ts_us, "pid": 1, "tid": 1, "args": mem}));
            }
            let mut gpu = serde_json::Map::new();
            for (k, v) in [
                ("gpu_used_bytes", p.gpu_used),
                ("allocated_bytes", p.allocated),
            ] {
                if let Some(v) = v {
                    gpu.insert(k.into(), v.into());
                }
            }
            if !gpu.is_empty() {
                events.push(json!({"name": "gpu", "ph": "C", "ts": p.ts_us, "pid": 1, "tid": 1, "args": gpu}));
            }
            events.push(
                json!({"name": "level", "ph": "C", "ts": p.ts_us, "pid": 1, "tid": 1,
                "args": {"level": p.level.as_gauge()}}),
            );
        }
        for (ts, level, reason) in &self.levels {
            events.push(
                json!({"name": format!("level {level}"), "ph": "i", "s": "g", "ts": ts,
                "pid": 1, "tid": 1, "args": {"reason": reason}}),
            );
        }
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(ts_us: u64, ws: u64, level: Level) -> Point {
        Point {
            ts_us,
            working_set: Some(ws),
            limit: Some(1000),
            gpu_used: None,
            allocated: None,
            level,
        }
    }

    #[test]
    fn keeps_points_that_move_and_drops_quiet_ones() {
        let mut t = Trace::default();
        t.push(p(0, 100, Level::Ok));
        t.push(p(100_000, 102, Level::Ok)); // 0.2 % of the limit: quiet
        t.push(p(200_000, 110, Level::Ok)); // 1 %: kept
        t.push(p(300_000, 110, Level::Warn)); // level change: kept
        t.push(p(1_400_000, 110, Level::Warn)); // a second later: kept
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn renders_chrome_trace_events() {
        let mut t = Trace::default();
        t.push(p(0, 100, Level::Ok));
        t.mark(5, Level::Downgrade, "working set 0.86");
        let doc = t.to_json();
        let events = doc["traceEvents"].as_array().expect("array");
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "C" && e["args"]["working_set_bytes"] == 100)
        );
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "i" && e["name"] == "level downgrade")
        );
        assert!(
            events
                .iter()
                .all(|e| e["pid"] == 1 && e.get("ph").is_some())
        );
        let bounded = (0..TRACE_POINTS as u64 + 10).fold(Trace::default(), |mut t, i| {
            t.push(p(i * 2_000_000, i, Level::Ok));
            t
        });
        assert_eq!(bounded.len(), TRACE_POINTS);
    }
}
