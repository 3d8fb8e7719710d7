//! The trainer's cgroup as its client reported it: the sample where the sidecar cannot read that
//! cgroup itself (issue 37, item 6).
//!
//! The kernel opens `/proc/<pid>/root` only for a reader with the trainer's uid and gid. A
//! trainer image that maps the trainer's uid to its own group, in a pod with no `runAsGroup`,
//! leaves the sidecar with the summed RSS: no limit of the cgroup, no OOM kill counted. The
//! client reads its own container's cgroup and sends the figures with its reports
//! ([`memguard_api::container_memory::ContainerMemory`]); this source lays them over the live
//! RSS: the limit, the peak and the OOM-kill counter come from the report, the working set is
//! the larger of the live RSS and the last reported one while that report is fresh.

use super::{Limit, MemoryEvents, MemorySample, MemorySource, SampleError, SourceInfo};
use crate::state::Shared;
use memguard_api::container_memory::{CgroupLimit, ContainerMemory};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `view` of [`SourceInfo`] while the client's report is the sample.
pub const VIEW: &str = "client-report";

/// How long a reported working set counts: the client reports at most once a second, and a
/// trainer between two slow steps reports less often; past this only the live RSS counts.
pub const FRESH_FOR: Duration = Duration::from_secs(10);

/// The figures of the client's last report that had them, and when they came.
#[derive(Debug, Clone, PartialEq)]
pub struct Reported {
    /// The figures.
    pub memory: ContainerMemory,
    /// When the sidecar received them.
    pub received: Instant,
}

/// The sidecar's own source, and the client's report where that source has no cgroup.
pub struct WithClientReport {
    own: Box<dyn MemorySource>,
    shared: Arc<Shared>,
    /// Reports received before this instant belong to a trainer that left.
    forgotten_at: Option<Instant>,
    /// The report laid over the last sample, when one was.
    in_use: Option<ContainerMemory>,
}

impl WithClientReport {
    /// `own` (the sidecar's own sampler), with the reports published into `shared`.
    pub fn new(own: Box<dyn MemorySource>, shared: Arc<Shared>) -> Self {
        WithClientReport {
            own,
            shared,
            forgotten_at: None,
            in_use: None,
        }
    }

    fn own_reads_a_cgroup(&self) -> bool {
        self.own.info().kind.starts_with("cgroup")
    }

    /// The last report, unless it came from a trainer that has left since.
    fn report(&self) -> Option<Reported> {
        let r = self.shared.status().container_memory.clone()?;
        match self.forgotten_at {
            Some(t) if r.received <= t => None,
            _ => Some(r),
        }
    }
}

fn limit(l: CgroupLimit) -> Limit {
    match l {
        CgroupLimit::Bytes(b) => Limit::Bytes(b),
        CgroupLimit::Unlimited(_) => Limit::Unlimited,
    }
}

/// The sample from a report laid over the sidecar's own (`own`: the live RSS, when read).
/// Pure, so tests give the instant.
pub fn overlay(own: Option<MemorySample>, report: &Reported, now: Instant) -> MemorySample {
    let m = &report.memory;
    let fresh = now.saturating_duration_since(report.received) <= FRESH_FOR;
    let reported_ws = m
        .usage_bytes
        .filter(|_| fresh)
        .map(|u| u.saturating_sub(m.inactive_file_bytes.unwrap_or(0)));
    let live = own.as_ref().and_then(|s| s.working_set_bytes);
    let working_set = match (reported_ws, live) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let usage = match (
        m.usage_bytes.filter(|_| fresh),
        own.as_ref().and_then(|s| s.usage_bytes),
    ) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    MemorySample {
        usage_bytes: usage,
        working_set_bytes: working_set,
        high: m.high.map(limit),
        // The cgroup's limit as the trainer read it; the downward-API one when it sent none.
        max: m.max.map(limit).or(own.as_ref().and_then(|s| s.max)),
        peak_bytes: m.peak_bytes,
        interval_peak_working_set_bytes: None,
        events: MemoryEvents {
            oom_kill: m.oom_kill,
            ..MemoryEvents::default()
        },
        // The live view knows whether the trainer's processes are still there.
        populated: own.and_then(|s| s.populated),
    }
}

impl MemorySource for WithClientReport {
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
        let own = self.own.sample()?;
        if self.own_reads_a_cgroup() {
            self.in_use = None;
            return Ok(own);
        }
        let Some(report) = self.report() else {
            self.in_use = None;
            return Ok(own);
        };
        let now = Instant::now();
        // Without a live view (no trainer process found) only a fresh report says anything.
        if own.is_none() && now.saturating_duration_since(report.received) > FRESH_FOR {
            self.in_use = None;
            return Ok(None);
        }
        let taking_up =
            self.in_use.as_ref().map(|m| m.cgroup_inode) != Some(report.memory.cgroup_inode);
        if self.in_use.is_none() {
            tracing::info!(
                cgroup_version = report.memory.cgroup_version,
                under = %self.own.describe(),
                "the sidecar cannot read the trainer's cgroup; using the cgroup figures the \
                 trainer's client reports (limit, peak, OOM kills) over the live RSS"
            );
        }
        self.in_use = Some(report.memory.clone());
        let mut sample = overlay(own, &report, now);
        // The first sample of a cgroup carries the counter at the client's start, which the
        // engine takes as its baseline: a kill between that start and this sample (a report
        // sent before the sidecar listened, the seconds it looks for the cgroup itself) is
        // counted on the next sample, not taken for one from before the run.
        if taking_up && let Some(at_start) = report.memory.oom_kill_at_start {
            sample.events.oom_kill = Some(at_start);
        }
        Ok(Some(sample))
    }

    fn describe(&self) -> String {
        match &self.in_use {
            Some(m) => format!(
                "cgroup-v{} of the trainer as its client reports it (inode {}), over {}",
                m.cgroup_version,
                m.cgroup_inode
                    .map_or_else(|| "unknown".into(), |i| i.to_string()),
                self.own.describe()
            ),
            None => self.own.describe(),
        }
    }

    fn info(&self) -> SourceInfo {
        match &self.in_use {
            Some(m) => SourceInfo {
                kind: if m.cgroup_version == 1 {
                    "cgroup-v1"
                } else {
                    "cgroup-v2"
                },
                view: VIEW,
                peak: if m.peak_bytes.is_some() {
                    "all-time"
                } else {
                    "none"
                },
            },
            None => self.own.info(),
        }
    }

    fn cgroup_dir(&self) -> Option<&Path> {
        self.own.cgroup_dir()
    }

    fn cgroup_identity(&self) -> Option<u64> {
        match &self.in_use {
            Some(m) => m.cgroup_inode,
            None => self.own.cgroup_identity(),
        }
    }

    fn forget(&mut self) {
        self.own.forget();
        self.in_use = None;
        self.forgotten_at = Some(Instant::now());
    }

    fn take_exit_watch(&mut self) -> Option<std::os::fd::OwnedFd> {
        self.own.take_exit_watch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_api::Signal;
    use memguard_api::container_memory::Unlimited;

    /// A sidecar source with a fixed answer, as the RSS fallback or a readable cgroup.
    struct Own {
        kind: &'static str,
        sample: Option<MemorySample>,
        forgotten: bool,
    }

    impl MemorySource for Own {
        fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
            Ok(self.sample.clone())
        }
        fn describe(&self) -> String {
            format!("own {}", self.kind)
        }
        fn info(&self) -> SourceInfo {
            SourceInfo {
                kind: self.kind,
                view: "test",
                peak: "none",
            }
        }
        fn forget(&mut self) {
            self.forgotten = true;
        }
    }

    fn rss(ws: u64, populated: bool) -> Option<MemorySample> {
        Some(MemorySample {
            usage_bytes: Some(ws),
            working_set_bytes: Some(ws),
            populated: Some(populated),
            ..Default::default()
        })
    }

    fn v1(usage: u64, oom_kill: u64, inode: u64) -> ContainerMemory {
        ContainerMemory {
            cgroup_version: 1,
            cgroup_inode: Some(inode),
            usage_bytes: Some(usage),
            inactive_file_bytes: Some(100),
            max: Some(CgroupLimit::Bytes(1 << 30)),
            high: None,
            peak_bytes: Some(usage + 500),
            oom_kill: Some(oom_kill),
            oom_kill_at_start: None,
        }
    }

    fn shared() -> Arc<Shared> {
        Arc::new(Shared::new(Signal::initial(8, 1, false)))
    }

    /// The client's report over a sampler that sees only the trainer's RSS (4000 bytes).
    fn over_rss(shared: &Arc<Shared>) -> WithClientReport {
        let own = Own {
            kind: "rss",
            sample: rss(4000, true),
            forgotten: false,
        };
        WithClientReport::new(Box::new(own), shared.clone())
    }

    fn report(shared: &Shared, memory: ContainerMemory) {
        shared.status().container_memory = Some(Reported {
            memory,
            received: Instant::now(),
        });
    }

    #[test]
    fn the_report_gives_the_limit_and_the_kills_the_rss_fallback_lacks() {
        let sh = shared();
        let mut src = over_rss(&sh);
        let before = src.sample().expect("ok").expect("rss");
        assert_eq!(before.effective_limit(), None, "the RSS alone has no limit");
        assert_eq!(src.info().kind, "rss");
        report(&sh, v1(10_100, 2, 77));
        let s = src.sample().expect("ok").expect("sample");
        assert_eq!(s.effective_limit(), Some(1 << 30));
        assert_eq!(s.working_set_bytes, Some(10_000), "usage - inactive file");
        assert_eq!(s.events.oom_kill, Some(2));
        assert_eq!(s.peak_bytes, Some(10_600));
        assert_eq!(s.populated, Some(true), "from the live view");
        let info = src.info();
        assert_eq!(
            (info.kind, info.view, info.peak),
            ("cgroup-v1", VIEW, "all-time")
        );
        assert_eq!(src.cgroup_identity(), Some(77));
        assert!(src.describe().contains("client reports it (inode 77)"));
    }

    #[test]
    fn a_kill_before_the_view_is_taken_up_is_counted_from_the_clients_start() {
        // The first report the sidecar got came after a worker's kill (the one before was sent
        // before it listened): the counter at the client's start is the baseline.
        let sh = shared();
        let mut src = over_rss(&sh);
        let after_kill = |kills, inode| ContainerMemory {
            oom_kill_at_start: Some(0),
            ..v1(10_100, kills, inode)
        };
        report(&sh, after_kill(1, 77));
        let mut counters = || -> Vec<Option<u64>> {
            (0..3)
                .map(|_| src.sample().expect("ok").expect("s").events.oom_kill)
                .collect()
        };
        assert_eq!(counters(), [Some(0), Some(1), Some(1)], "0 -> 1: one kill");
        // A restarted trainer's new cgroup: counted from its own client's start.
        report(&sh, after_kill(2, 78));
        assert_eq!(counters(), [Some(0), Some(2), Some(2)]);
        // No counter at start sent (an older client): the first counter is the baseline.
        report(&sh, v1(10_100, 3, 79));
        assert_eq!(counters(), [Some(3), Some(3), Some(3)]);
    }

    #[test]
    fn a_readable_cgroup_wins_over_any_report() {
        let sh = shared();
        let mut own_sample = rss(4000, true);
        if let Some(s) = own_sample.as_mut() {
            s.max = Some(Limit::Bytes(2 << 30));
        }
        let own = Own {
            kind: "cgroup-v2",
            sample: own_sample.clone(),
            forgotten: false,
        };
        let mut src = WithClientReport::new(Box::new(own), sh.clone());
        report(&sh, v1(10_100, 2, 77));
        assert_eq!(src.sample().expect("ok"), own_sample);
        assert_eq!(src.info().view, "test");
    }

    #[test]
    fn a_stale_report_keeps_its_limit_and_counter_but_not_its_working_set() {
        let received = Instant::now();
        let r = Reported {
            memory: v1(900_000, 1, 5),
            received,
        };
        let later = received + FRESH_FOR + Duration::from_secs(1);
        let s = overlay(rss(4000, true), &r, later);
        assert_eq!(s.working_set_bytes, Some(4000), "the live RSS only");
        assert_eq!(s.effective_limit(), Some(1 << 30));
        assert_eq!(s.events.oom_kill, Some(1));
        let fresh = overlay(rss(4000, true), &r, received);
        assert_eq!(fresh.working_set_bytes, Some(899_900));
        // The live RSS above the report (it moved since): the higher counts.
        let s = overlay(rss(1_000_000, true), &r, received);
        assert_eq!(s.working_set_bytes, Some(1_000_000));
    }

    #[test]
    fn unlimited_is_read_as_unlimited_and_unsent_stays_unknown() {
        let mut m = v1(1000, 0, 1);
        m.max = Some(CgroupLimit::Unlimited(Unlimited::Max));
        let r = Reported {
            memory: m.clone(),
            received: Instant::now(),
        };
        let s = overlay(None, &r, r.received);
        assert_eq!(s.max, Some(Limit::Unlimited));
        assert_eq!(s.effective_limit(), None);
        assert_eq!(s.populated, None, "no live view: not known");
        m.max = None;
        m.oom_kill = None;
        let s = overlay(None, &Reported { memory: m, ..r }, Instant::now());
        assert_eq!(s.max, None);
        assert_eq!(s.events.oom_kill, None, "not sent is not 0");
    }

    #[test]
    fn reports_of_a_trainer_that_left_are_not_the_next_ones() {
        let sh = shared();
        let mut src = over_rss(&sh);
        report(&sh, v1(10_100, 3, 77));
        assert_eq!(
            src.sample().expect("ok").expect("s").events.oom_kill,
            Some(3)
        );
        src.forget();
        let s = src.sample().expect("ok").expect("rss again");
        assert_eq!(
            s.events.oom_kill, None,
            "the old trainer's counter is not used"
        );
        assert_eq!(src.info().kind, "rss");
        std::thread::sleep(Duration::from_millis(2));
        report(&sh, v1(200, 0, 78));
        let s = src.sample().expect("ok").expect("s");
        assert_eq!(s.events.oom_kill, Some(0));
        assert_eq!(
            src.cgroup_identity(),
            Some(78),
            "the restarted trainer's new cgroup"
        );
    }

    #[test]
    fn no_trainer_process_and_a_stale_report_is_nothing() {
        let sh = shared();
        let own = Own {
            kind: "none",
            sample: None,
            forgotten: false,
        };
        let mut src = WithClientReport::new(Box::new(own), sh.clone());
        sh.status().container_memory = Some(Reported {
            memory: v1(1000, 0, 1),
            received: Instant::now() - FRESH_FOR - Duration::from_secs(1),
        });
        assert_eq!(src.sample().expect("ok"), None);
        report(&sh, v1(1000, 0, 1));
        assert!(src.sample().expect("ok").is_some(), "a fresh report alone");
    }
}
