//! Every case measured by `bench/host/measure.py` (`bench/host/results/host.jsonl`) replayed
//! through `host_estimate`: the runtime and load cases against the cgroup's peak, the input cases
//! against the peak of one rank feeding batches, the save cases against the spike over the
//! training baseline. Targets (issue #39): median |error| ≤ 10 %, no case more than 15 % under
//! its measurement (an under-estimate is an OOM kill).

use memguard_estimator::{Bytes, HostConfig, HostEstimate, SaveMode, host_estimate};
use serde_json::Value;

const MEASURED: &str = include_str!("../../bench/host/results/host.jsonl");
const MEDIAN_APE: f64 = 0.10;
const WORST_UNDER: f64 = -0.15;

/// One measured case: its name, the figure measured and the one estimated.
struct Replayed {
    name: String,
    measured: f64,
    estimated: f64,
}

impl Replayed {
    fn error(&self) -> f64 {
        (self.estimated - self.measured) / self.measured
    }
}

fn field<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| &v[*k])
}

fn num(v: &Value, path: &[&str]) -> f64 {
    field(v, path)
        .as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

fn dtype_bytes(name: &str) -> f64 {
    match name {
        "float32" => 4.0,
        "bfloat16" | "float16" => 2.0,
        other => panic!("unknown dtype {other}"),
    }
}

/// A pod of `ranks` ranks doing nothing but what the case does.
fn bare(ranks: u32) -> HostConfig {
    let mut cfg = HostConfig::new(0.0, 0.0);
    cfg.ranks_in_pod = ranks;
    cfg.world_size = ranks;
    cfg.save = SaveMode::None;
    cfg
}

fn replay(record: &Value) -> Replayed {
    let case = &record["case"];
    let name = case["name"]
        .as_str()
        .expect("a case has a name")
        .to_string();
    // Input cases run one torchrun rank and name no rank count.
    let ranks = case["ranks"].as_u64().map_or(1, |r| r as u32);
    let peak = num(record, &["peak_bytes"]);
    let (measured, estimated) = match case["kind"].as_str() {
        Some("runtime") => (peak, host_estimate(&bare(ranks)).peak),
        Some("load") => {
            let mut cfg = bare(ranks);
            cfg.params = num(record, &["checkpoint", "params"]);
            cfg.checkpoint_bytes_per_param = dtype_bytes(
                field(record, &["checkpoint", "storage_dtype"])
                    .as_str()
                    .expect("a checkpoint has a storage dtype"),
            );
            cfg.load_bytes_per_param = match case["dtype"].as_str() {
                Some("default") => None,
                Some(d) => Some(dtype_bytes(d)),
                None => panic!("{name}: no dtype"),
            };
            (peak, host_estimate(&cfg).peak)
        }
        Some("input") => {
            let mut cfg = bare(1);
            cfg.dataloader_workers = num(case, &["workers"]) as u32;
            cfg.prefetch_factor = num(case, &["prefetch"]) as u32;
            // pin_memory pins nothing without an accelerator: replay what happened.
            cfg.pin_memory = case["pin"].as_bool() == Some(true)
                && field(record, &["workload", "pin_effective"]).as_bool() == Some(true);
            cfg.batch_bytes = Bytes::from_f64(num(record, &["workload", "batch_bytes"]));
            (peak, host_estimate(&cfg).peak)
        }
        Some("save") => {
            let mut cfg = bare(ranks);
            cfg.params = num(record, &["workload", "params"]);
            // A plain `save_pretrained` of a model trained on the CPU writes its own weights.
            cfg.state_on_host = case["mode"].as_str().is_some_and(|m| m.starts_with("hf_"));
            cfg.save = match case["mode"].as_str() {
                Some("full_model" | "hf_safetensors" | "hf_torch") => SaveMode::ModelOnlyFull,
                Some("full_with_optimizer") => SaveMode::FullWithOptimizer,
                Some("sharded") => SaveMode::Sharded,
                other => panic!("{name}: unknown save mode {other:?}"),
            };
            let est: HostEstimate = host_estimate(&cfg);
            (num(record, &["workload", "spike"]), est.save)
        }
        other => panic!("{name}: unknown kind {other:?}"),
    };
    Replayed {
        name,
        measured,
        estimated: estimated.as_f64(),
    }
}

fn replayed() -> Vec<Replayed> {
    MEASURED
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<Value>(l).expect("every line is JSON"))
        .inspect(|r| assert_eq!(r["ok"], true, "a failed case is committed: {}", r["case"]))
        .map(|r| replay(&r))
        .collect()
}

fn report(rows: &[Replayed]) -> String {
    rows.iter()
        .map(|r| {
            format!(
                "{:<40} measured {:>9.3} GiB  estimated {:>9.3} GiB  {:+6.1} %\n",
                r.name,
                r.measured / 1073741824.0,
                r.estimated / 1073741824.0,
                100.0 * r.error()
            )
        })
        .collect()
}

#[test]
fn every_kind_of_case_is_measured() {
    let rows = replayed();
    for kind in ["runtime-", "load-", "input-", "save-"] {
        assert!(
            rows.iter().filter(|r| r.name.starts_with(kind)).count() >= 3,
            "too few {kind} cases"
        );
    }
}

#[test]
fn host_estimate_is_within_target_of_every_measured_case() {
    let rows = replayed();
    let mut abs: Vec<f64> = rows.iter().map(|r| r.error().abs()).collect();
    abs.sort_by(f64::total_cmp);
    let median = abs[abs.len() / 2];
    let worst_under = rows.iter().map(Replayed::error).fold(f64::MAX, f64::min);
    let worst_over = rows.iter().map(Replayed::error).fold(f64::MIN, f64::max);
    let table = report(&rows);
    println!(
        "{table}{} cases: median |error| {:.1} %, worst under {:+.1} %, worst over {:+.1} %",
        rows.len(),
        100.0 * median,
        100.0 * worst_under,
        100.0 * worst_over
    );
    assert!(median <= MEDIAN_APE, "median |error| {median:.3}\n{table}");
    assert!(
        worst_under >= WORST_UNDER,
        "a case is under-estimated by more than 15 %\n{table}"
    );
}
