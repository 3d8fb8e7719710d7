//! The trainer container's own memory cgroup, as the trainer read it
//! ([`Report::container_memory`](crate::Report::container_memory)).
//!
//! The sidecar reads the trainer's cgroup through `/proc/<pid>/root`, which the kernel opens
//! only for a reader with the trainer's uid and gid. Where the two differ (a trainer image that
//! maps its uid to its own group, a pod with no `runAsGroup`) the client reads its own cgroup and
//! sends the figures; the sidecar uses them as its sample, and counts the OOM kills a surviving
//! process saw (docs/sidecar.md, "When the sidecar cannot read the trainer's cgroup").

use serde::{Deserialize, Serialize};

/// The word a cgroup writes for "no limit" (v2 `max`; the client writes it for the v1
/// page-counter maximum too).
pub const UNLIMITED: &str = "max";

/// A limit as read: bytes, or none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CgroupLimit {
    /// Limited to this many bytes.
    Bytes(u64),
    /// No limit ([`UNLIMITED`]).
    Unlimited(Unlimited),
}

/// The `"max"` of an unlimited [`CgroupLimit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unlimited {
    /// `"max"`.
    #[serde(rename = "max")]
    Max,
}

/// The figures of one memory cgroup. `None`: the file was not there or not read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerMemory {
    /// 1 (legacy memory controller) or 2 (unified hierarchy).
    pub cgroup_version: u8,
    /// The inode of the cgroup directory: a container restarted in place has a new cgroup, and
    /// with it a new inode and counters from 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_inode: Option<u64>,
    /// `memory.current` / `memory.usage_in_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_bytes: Option<u64>,
    /// `inactive_file` (v2) / `total_inactive_file` (v1) of `memory.stat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inactive_file_bytes: Option<u64>,
    /// `memory.max` / `memory.limit_in_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<CgroupLimit>,
    /// `memory.high` (v2 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high: Option<CgroupLimit>,
    /// `memory.peak` (v2) / `memory.max_usage_in_bytes` (v1): the all-time peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// `oom_kill` of `memory.events` (v2) / `memory.oom_control` (v1, kernel ≥ 4.13).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kill: Option<u64>,
    /// `oom_kill` when the client started: the kills after it are this trainer's, counted even
    /// when the first report the sidecar got came after one (never above `oom_kill`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kill_at_start: Option<u64>,
}

impl ContainerMemory {
    /// Refuses figures that cannot be: an unknown cgroup version, or usage below its own
    /// inactive file cache.
    pub fn check(&self) -> Result<(), String> {
        if !matches!(self.cgroup_version, 1 | 2) {
            return Err(format!(
                "container_memory: cgroup_version {} is neither 1 nor 2",
                self.cgroup_version
            ));
        }
        if let (Some(usage), Some(inactive)) = (self.usage_bytes, self.inactive_file_bytes)
            && inactive > usage
        {
            return Err(format!(
                "container_memory: inactive_file_bytes {inactive} exceeds usage_bytes {usage}"
            ));
        }
        if let (Some(at_start), Some(now)) = (self.oom_kill_at_start, self.oom_kill)
            && at_start > now
        {
            return Err(format!(
                "container_memory: oom_kill_at_start {at_start} exceeds oom_kill {now}"
            ));
        }
        if let Some(CgroupLimit::Bytes(0)) = self.max {
            return Err("container_memory: max is 0".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_bytes_or_max_and_nothing_else() {
        let v1: ContainerMemory = serde_json::from_str(
            r#"{"cgroup_version": 1, "usage_bytes": 10, "max": 1073741824, "oom_kill": 2}"#,
        )
        .expect("parses");
        assert_eq!(v1.max, Some(CgroupLimit::Bytes(1 << 30)));
        assert_eq!(v1.oom_kill, Some(2));
        assert_eq!(v1.high, None, "not sent: not known");
        let v2: ContainerMemory =
            serde_json::from_str(r#"{"cgroup_version": 2, "max": "max", "high": 5}"#)
                .expect("parses");
        assert_eq!(v2.max, Some(CgroupLimit::Unlimited(Unlimited::Max)));
        assert_eq!(
            serde_json::to_value(&v2).expect("ser")["max"],
            serde_json::json!(UNLIMITED)
        );
        for bad in [
            r#"{"cgroup_version": 1, "max": "none"}"#,
            r#"{"cgroup_version": 1, "max": -1}"#,
            r#"{"cgroup_version": 1, "swap": 1}"#,
            r#"{"usage_bytes": 1}"#,
        ] {
            assert!(
                serde_json::from_str::<ContainerMemory>(bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn figures_that_cannot_be_are_refused() {
        let ok = ContainerMemory {
            cgroup_version: 2,
            usage_bytes: Some(100),
            inactive_file_bytes: Some(40),
            ..Default::default()
        };
        assert_eq!(ok.check(), Ok(()));
        let version = ContainerMemory {
            cgroup_version: 3,
            ..ok.clone()
        };
        assert!(version.check().expect_err("v3").contains("neither 1 nor 2"));
        let inactive = ContainerMemory {
            inactive_file_bytes: Some(101),
            ..ok.clone()
        };
        assert!(inactive.check().is_err());
        let zero = ContainerMemory {
            max: Some(CgroupLimit::Bytes(0)),
            ..ok
        };
        assert!(zero.check().is_err());
        let kills = ContainerMemory {
            oom_kill: Some(1),
            oom_kill_at_start: Some(2),
            ..Default::default()
        };
        let kills = ContainerMemory {
            cgroup_version: 1,
            ..kills
        };
        assert!(
            kills
                .check()
                .expect_err("2 > 1")
                .contains("oom_kill_at_start")
        );
    }
}
