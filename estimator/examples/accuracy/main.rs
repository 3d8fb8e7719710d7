//! Runs the estimator over every measured run in `bench/accuracy/data/` and prints a per-row
//! table and, per device kind, the median absolute percentage error, the worst under- and
//! over-estimate, and the OOM fit tests. Run it with `bench/accuracy/run.sh`.

mod harness;

use harness::{Compare, Scored};
use memguard_estimator::Device;
use std::process::ExitCode;

fn gb(b: memguard_estimator::Bytes) -> String {
    format!("{:.2}", b.as_f64() / 1e9)
}

fn print_row(s: &Scored) {
    let compare = match s.compare {
        Compare::TensorPeak => "tensor_peak",
        Compare::Reserved => "reserved",
        Compare::Total => "total",
    };
    let tag = match (s.unmodelled, s.split) {
        (true, _) => " UNMODELLED",
        (false, harness::Split::HeldOut) => " held-out",
        (false, harness::Split::Fit) => "",
    };
    let (measured, result) = match (s.measured, s.signed_error(), s.oom_predicted()) {
        (Some(m), Some(e), _) => (gb(m), format!("{:+7.1} %", e * 100.0)),
        (_, _, Some(oom)) => (
            format!("OOM>{}", s.device_memory.map(gb).unwrap_or_default()),
            if oom {
                "fit test ok".into()
            } else {
                "FIT TEST FAILED".into()
            },
        ),
        _ => ("?".into(), "?".into()),
    };
    let model: String = s.model.chars().take(28).collect();
    println!(
        "{:<40} {:<28} {:<5} {:<11} {:>10} {:>10} {:>16}{}",
        s.id,
        model,
        s.device,
        compare,
        measured,
        gb(s.estimated),
        result,
        tag
    );
}

/// One line per row, for `bench/accuracy/plot.py`: measured and estimated bytes (the device's
/// memory for OOM rows, which have no measurement).
fn print_csv(scored: &[Scored]) {
    println!(
        "id,source,split,collected,device,compare,measured_bytes,estimated_bytes,oom,device_memory_bytes,unmodelled"
    );
    for s in scored {
        let compare = match s.compare {
            Compare::TensorPeak => "tensor_peak",
            Compare::Reserved => "reserved",
            Compare::Total => "total",
        };
        println!(
            "{},{},{},{},{},{},{},{},{},{},{}",
            s.id,
            s.source,
            s.split.name(),
            s.collected,
            s.device,
            compare,
            s.measured.map(|b| b.0.to_string()).unwrap_or_default(),
            s.estimated.0,
            s.device_memory.is_some(),
            s.device_memory.map(|b| b.0.to_string()).unwrap_or_default(),
            s.unmodelled
        );
    }
}

/// One summary line: `label` names the part and source, the device comes from the summary.
fn print_summary(label: &str, s: &harness::Summary) {
    let fmt = |w: &Option<(f64, String)>| match w {
        Some((e, id)) => format!("{:+.1} % ({id})", e * 100.0),
        None => "none".into(),
    };
    println!(
        "  {:<5} {:<30} rows {:>3}  median APE {:>5.1} %  within ±10 % {:>3}  worst under {}  worst over {}  OOM fit tests {}/{}",
        s.device.name(),
        label,
        s.rows,
        s.median_ape * 100.0,
        s.within_ten,
        fmt(&s.worst_under),
        fmt(&s.worst_over),
        s.oom.0,
        s.oom.1
    );
}

fn main() -> ExitCode {
    let scored = match harness::score_all() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("accuracy: {e}");
            return ExitCode::FAILURE;
        }
    };
    if std::env::args().any(|a| a == "--csv") {
        print_csv(&scored);
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<40} {:<28} {:<5} {:<11} {:>10} {:>10} {:>16}",
        "row", "model", "dev", "compare", "meas. GB", "est. GB", "error"
    );
    let verbose = std::env::args().any(|a| a == "--components");
    for s in &scored {
        print_row(s);
        if verbose {
            let parts: Vec<String> = s
                .estimate
                .components
                .iter()
                .map(|(c, b)| format!("{c}={}", gb(*b)))
                .collect();
            println!("    {}", parts.join(" "));
        }
    }
    println!();
    println!("Per device kind (rows tagged UNMODELLED are printed above but not counted):");
    for device in [Device::Cuda, Device::Cpu] {
        print_summary("all", &harness::summarize(&scored, device));
    }
    println!();
    println!("Per part and source (fit: tuned on; held-out: never looked at while tuning):");
    for split in [harness::Split::Fit, harness::Split::HeldOut] {
        for device in [Device::Cuda, Device::Cpu] {
            let part = harness::summarize_where(&scored, device, |s| s.split == split);
            if part.rows + part.oom.1 == 0 {
                continue;
            }
            print_summary(&format!("{} all", split.name()), &part);
            let mut sources: Vec<&str> = scored
                .iter()
                .filter(|s| s.split == split && s.device == device)
                .map(|s| s.source.as_str())
                .collect();
            sources.sort_unstable();
            sources.dedup();
            for source in sources {
                let one = harness::summarize_where(&scored, device, |s| {
                    s.split == split && s.source == source
                });
                print_summary(&format!("{} {source}", split.name()), &one);
            }
        }
    }
    ExitCode::SUCCESS
}
