//! Prometheus text exposition (format 0.0.4), written by hand: a dozen families do not need a
//! registry crate in a binary that runs in every pod. A family whose value is not known is left
//! out rather than reported as 0.

use crate::state::Status;
use memguard_api::{OomKind, OomOutcome, Signal, TrainerPhase};
use std::fmt::Write;

/// Every metric prefix.
pub const PREFIX: &str = "memguard_sidecar";
/// Content type of the exposition.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
        if samples.is_empty() {
            return;
        }
        let _ = writeln!(self.0, "# HELP {PREFIX}_{name} {help}");
        let _ = writeln!(self.0, "# TYPE {PREFIX}_{name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(self.0, "{PREFIX}_{name}{labels} {v}");
        }
    }

    fn gauge(&mut self, name: &str, help: &str, v: Option<f64>) {
        let s: Vec<(String, f64)> = v.into_iter().map(|v| (String::new(), v)).collect();
        self.family(name, "gauge", help, &s);
    }

    fn counter(&mut self, name: &str, help: &str, v: f64) {
        self.family(name, "counter", help, &[(String::new(), v)]);
    }
}

fn label(name: &str, value: &str) -> String {
    let escaped = value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    format!("{{{name}=\"{escaped}\"}}")
}

/// Renders the metrics.
pub fn render(st: &Status, sig: &Signal) -> String {
    let mut o = Out(String::with_capacity(4096));
    let f = |v: Option<u64>| v.map(|v| v as f64);
    let sample = st.sample.as_ref();
    if let Some(info) = st.source_info {
        let labels = format!(
            "{{kind=\"{}\",view=\"{}\",peak=\"{}\"}}",
            info.kind, info.view, info.peak
        );
        o.family(
            "source_info",
            "gauge",
            "Where the trainer's memory figures come from: kind cgroup-v1, cgroup-v2, rss (summed \
             RSS: no OOM events, PSI, page cache or memory.high) or none; view flag, trainer-mount, \
             own-mount, procfs; peak between samples reset (exact), all-time (new highs) or none.",
            &[(labels, 1.0)],
        );
    }
    let reported: Vec<(String, f64)> = st
        .trainer_config
        .iter()
        .map(|(k, v)| (label("knob", k), *v))
        .collect();
    o.family(
        "trainer_config",
        "gauge",
        "The trainer's config as it runs, reported by the client at train start (a bool as 0/1).",
        &reported,
    );
    let mismatch: Vec<(String, f64)> = st
        .config_mismatch()
        .into_iter()
        .map(|(k, differs)| (label("knob", k), if differs { 1.0 } else { 0.0 }))
        .collect();
    o.family(
        "config_mismatch",
        "gauge",
        "1 where admission planned a knob at another value than the trainer reports, else 0.",
        &mismatch,
    );
    let planned: Vec<(String, f64)> = st
        .train_start
        .iter()
        .flat_map(|p| {
            [
                ("batch-size", p.batch_size.map(|v| v as f64)),
                ("grad-accumulation", p.grad_accumulation.map(|v| v as f64)),
                (
                    "grad-checkpointing",
                    p.grad_checkpointing.map(|v| f64::from(u8::from(v))),
                ),
                ("upper-bytes", p.upper_bytes.map(|v| v as f64)),
                ("budget-bytes", p.budget_bytes.map(|v| v as f64)),
            ]
        })
        .filter_map(|(k, v)| Some((label("knob", k), v?)))
        .collect();
    o.family(
        "train_start_plan",
        "gauge",
        "The plan made at train start on the trainer's reported config: the micro-batch, \
         accumulation and checkpointing it runs from the first step, the plan's upper bound and \
         the budget (bytes); absent before the decision or when none was made.",
        &planned,
    );
    o.gauge(
        "train_start_planned",
        "1 when a plan was made at train start, 0 when none could be (the summary says why); \
         absent before the trainer reported its config.",
        st.train_start
            .as_ref()
            .map(|p| f64::from(u8::from(p.planned))),
    );
    let phases: Vec<(String, f64)> = st
        .phase
        .map(|now| {
            TrainerPhase::ALL
                .iter()
                .map(|p| (label("phase", p.name()), if *p == now { 1.0 } else { 0.0 }))
                .collect()
        })
        .unwrap_or_default();
    o.family(
        "trainer_phase",
        "gauge",
        "1 for the phase the trainer last reported (load, step, save), else 0; absent until it \
         reports one.",
        &phases,
    );
    o.gauge(
        "trainer_saves_deferred",
        "Checkpoint saves the trainer put off under host-memory pressure, as it last reported.",
        f(st.saves_deferred),
    );
    o.gauge(
        "working_set_bytes",
        "Working set of the trainer's cgroup (usage minus inactive file).",
        f(sample.and_then(|s| s.working_set_bytes)),
    );
    o.gauge(
        "usage_bytes",
        "Memory usage of the trainer's cgroup, page cache included.",
        f(sample.and_then(|s| s.usage_bytes)),
    );
    o.gauge(
        "limit_bytes",
        "Effective memory limit (memory.high when set, else memory.max or limit_in_bytes).",
        f(sample.and_then(|s| s.effective_limit())),
    );
    o.gauge(
        "cgroup_peak_bytes",
        "Peak usage the kernel recorded (memory.peak or max_usage_in_bytes).",
        f(sample.and_then(|s| s.peak_bytes)),
    );
    o.gauge(
        "interval_peak_working_set_bytes",
        "Peak usage since the previous sample minus inactive file, when known.",
        f(sample.and_then(|s| s.interval_peak_working_set_bytes)),
    );
    o.gauge(
        "memory_pressure_ratio",
        "Working set divided by the effective limit.",
        sample.and_then(|s| s.ratio()),
    );
    let mut stall = Vec::new();
    for (scope, psi) in [("cgroup", &st.psi_cgroup), ("host", &st.psi_host)] {
        if let Some(some) = psi.as_ref().and_then(|p| p.some) {
            stall.push((label("scope", scope), some.avg10 / 100.0));
        }
    }
    o.family(
        "memory_stall_some_avg10_ratio",
        "gauge",
        "PSI memory 'some' avg10 as a ratio (0-1) of wall time.",
        &stall,
    );
    if let Some(s) = sample {
        let ev: Vec<(String, f64)> = [
            ("high", s.events.high),
            ("max", s.events.max),
            ("oom", s.events.oom),
            ("oom_kill", s.events.oom_kill),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (label("event", k), v as f64)))
        .collect();
        o.family(
            "cgroup_memory_events_total",
            "counter",
            "Kernel memory event counters of the cgroup (memory.events, failcnt, oom_control).",
            &ev,
        );
    }
    let used: Vec<(String, f64)> = st
        .gpus
        .iter()
        .map(|g| (label("gpu", &g.uuid), g.used_bytes as f64))
        .collect();
    let total: Vec<(String, f64)> = st
        .gpus
        .iter()
        .map(|g| (label("gpu", &g.uuid), g.total_bytes as f64))
        .collect();
    o.family(
        "gpu_memory_used_bytes",
        "gauge",
        "GPU memory used (NVML).",
        &used,
    );
    o.family(
        "gpu_memory_total_bytes",
        "gauge",
        "GPU memory capacity (NVML).",
        &total,
    );
    let rep = st.report.as_ref();
    o.gauge(
        "trainer_allocated_bytes",
        "Bytes held by live tensors, as the trainer reports.",
        f(rep.and_then(|r| r.allocated_bytes)),
    );
    o.gauge(
        "trainer_reserved_bytes",
        "Bytes reserved by the trainer's allocator, as it reports.",
        f(rep.and_then(|r| r.reserved_bytes)),
    );
    o.gauge(
        "trainer_peak_bytes",
        "Peak of live tensors, as the trainer reports.",
        f(rep.and_then(|r| r.peak_bytes)),
    );
    o.gauge(
        "trainer_step",
        "Training step of the last report.",
        f(rep.and_then(|r| r.step)),
    );
    o.gauge(
        "leak_seconds_to_limit",
        "Seconds until the limit at the current steady growth, when one is seen.",
        st.seconds_to_limit,
    );
    o.gauge(
        "level",
        "Signal level: 0 ok, 1 warn, 2 downgrade, 3 critical.",
        Some(sig.level.as_gauge() as f64),
    );
    o.gauge(
        "batch_size",
        "Recommended per-device batch size.",
        Some(sig.batch_size as f64),
    );
    o.gauge(
        "grad_accumulation",
        "Recommended gradient accumulation steps.",
        Some(sig.grad_accumulation as f64),
    );
    o.gauge(
        "signal_seq",
        "Sequence number of the current signal.",
        Some(sig.seq as f64),
    );
    o.counter(
        "downgrades_total",
        "Downgrades signalled.",
        st.downgrades as f64,
    );
    o.counter(
        "growths_total",
        "Micro-batch growths back toward the configured one, on measured peaks.",
        st.growths as f64,
    );
    o.gauge(
        "growth_ceiling",
        "Highest micro-batch a growth may recommend again, once a shrink lowered it.",
        st.growth_ceiling.map(|c| c as f64),
    );
    o.counter(
        "oom_kills_total",
        "OOM kills in the trainer's cgroup since the sidecar started.",
        st.oom_events() as f64,
    );
    let mut ooms = Vec::new();
    for kind in [OomKind::CudaOom, OomKind::CpuOom] {
        for outcome in [OomOutcome::Recovered, OomOutcome::Fatal] {
            let n = st.oom_records.get(&(kind, outcome)).copied().unwrap_or(0);
            let labels = format!("{{kind=\"{kind}\",outcome=\"{outcome}\"}}");
            ooms.push((labels, n as f64));
        }
    }
    o.family(
        "oom_records_total",
        "counter",
        "Out-of-memory errors the trainer reported, by kind (cuda_oom, cpu_oom) and outcome (recovered, fatal).",
        &ooms,
    );
    // Every phase once any fatal record came in one, so a rate over the family is defined.
    let fatal_phases: Vec<(String, f64)> = if st.fatal_oom_phases.is_empty() {
        Vec::new()
    } else {
        TrainerPhase::ALL
            .iter()
            .map(|p| {
                let n = st.fatal_oom_phases.get(p).copied().unwrap_or(0);
                (label("phase", p.name()), n as f64)
            })
            .collect()
    };
    o.family(
        "oom_records_fatal_by_phase_total",
        "counter",
        "Fatal out-of-memory errors the trainer reported, by the phase they came in (load, step, save: the record's own, else the phase last reported); absent until one came in a known phase.",
        &fatal_phases,
    );
    o.counter("samples_total", "Samples taken.", st.samples_total as f64);
    o.gauge(
        "waiting_for_trainer",
        "1 while a downgrade is due but waits for the trainer to report the batch of the last one (bounded by four cooldowns).",
        Some(if st.waiting_for_trainer { 1.0 } else { 0.0 }),
    );
    o.gauge(
        "source_up",
        "1 when the last sample read the trainer's memory; 0 while the source is missing or failing (the memory figures are then the last good ones).",
        Some(if st.source_up { 1.0 } else { 0.0 }),
    );
    o.counter(
        "wakeups_total",
        "Kernel events (thresholds, PSI triggers, inotify) that woke the sampler.",
        st.wakeups_total as f64,
    );
    o.counter(
        "reports_total",
        "Reports received from the trainer.",
        st.reports_total as f64,
    );
    o.counter(
        "reports_rejected_total",
        "Reports refused: not JSON, unknown fields, impossible figures.",
        st.reports_rejected as f64,
    );
    o.counter(
        "oom_records_refused_total",
        "OOM records whose batch x accumulation breaks the effective batch in force: config ignored.",
        st.oom_records_refused as f64,
    );
    let errors: Vec<(String, f64)> = ["read", "parse", "gpu", "psi"]
        .iter()
        .map(|k| {
            (
                label("kind", k),
                *st.sample_errors.get(k).unwrap_or(&0) as f64,
            )
        })
        .collect();
    o.family(
        "sample_errors_total",
        "counter",
        "Sampler failures by kind.",
        &errors,
    );
    o.counter(
        "signal_write_errors_total",
        "Failures to write the signal file.",
        st.signal_write_errors as f64,
    );
    o.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::gpu::GpuMemory;
    use crate::sample::psi::parse_psi;
    use crate::sample::{Limit, MemorySample};
    use memguard_api::Report;

    pub(crate) fn busy_status() -> Status {
        Status {
            sample: Some(MemorySample {
                usage_bytes: Some(900),
                working_set_bytes: Some(850),
                max: Some(Limit::Bytes(1000)),
                ..Default::default()
            }),
            psi_host: Some(parse_psi(
                "some avg10=12.50 avg60=1.00 avg300=0.00 total=5\n",
            )),
            gpus: vec![GpuMemory {
                uuid: "GPU-8f2e\"x".into(),
                used_bytes: 5,
                total_bytes: 10,
            }],
            report: Some(Report {
                allocated_bytes: Some(7),
                ..Default::default()
            }),
            downgrades: 2,
            ..Default::default()
        }
    }

    #[test]
    fn renders_known_figures_and_leaves_unknown_out() {
        let text = render(&busy_status(), &Signal::initial(4, 2, false));
        assert!(
            text.contains("memguard_sidecar_working_set_bytes 850\n"),
            "{text}"
        );
        assert!(text.contains("memguard_sidecar_memory_pressure_ratio 0.85\n"));
        assert!(
            !text.contains("source_info"),
            "no source yet: nothing said rather than a guess"
        );
        let mut st = busy_status();
        st.source_info = Some(crate::sample::SourceInfo {
            kind: "cgroup-v1",
            view: "trainer-mount",
            peak: "reset",
        });
        st.sample
            .as_mut()
            .expect("sample")
            .interval_peak_working_set_bytes = Some(990);
        let text = render(&st, &Signal::initial(4, 2, false));
        assert!(text.contains(
            "memguard_sidecar_source_info{kind=\"cgroup-v1\",view=\"trainer-mount\",peak=\"reset\"} 1\n"
        ));
        assert!(
            text.contains("memguard_sidecar_memory_pressure_ratio 0.99\n"),
            "the spike between samples counts"
        );
        assert!(
            text.contains("memguard_sidecar_memory_stall_some_avg10_ratio{scope=\"host\"} 0.125")
        );
        assert!(text.contains("memguard_sidecar_gpu_memory_used_bytes{gpu=\"GPU-8f2e\\\"x\"} 5"));
        assert!(text.contains("memguard_sidecar_trainer_allocated_bytes 7\n"));
        assert!(text.contains("# TYPE memguard_sidecar_downgrades_total counter\n"));
        assert!(text.contains("memguard_sidecar_downgrades_total 2\n"));
        assert!(
            !text.contains("trainer_reserved_bytes"),
            "unknown: left out"
        );
        assert!(!text.contains("scope=\"cgroup\""));
        let empty = render(&Status::default(), &Signal::initial(1, 1, false));
        assert!(!empty.contains("working_set_bytes"));
        assert!(empty.contains("memguard_sidecar_level 0\n"));
        assert!(
            !empty.contains("trainer_phase"),
            "no phase reported: none said"
        );
    }

    #[test]
    fn the_trainer_phase_is_one_for_the_phase_last_reported() {
        let st = Status {
            phase: Some(TrainerPhase::Save),
            ..Default::default()
        };
        let text = render(&st, &Signal::initial(1, 1, false));
        assert!(
            text.contains("memguard_sidecar_trainer_phase{phase=\"save\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("memguard_sidecar_trainer_phase{phase=\"load\"} 0\n"));
        assert!(text.contains("memguard_sidecar_trainer_phase{phase=\"step\"} 0\n"));
    }
}
