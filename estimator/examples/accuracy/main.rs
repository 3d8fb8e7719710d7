//! Runs the estimator over every measured run in `bench/accuracy/data/` and prints a per-row
//! table and, per device kind, the median absolute percentage error, the worst under- and
//! over-estimate, and the OOM fit tests. Run it with `bench/accuracy/run.sh`.

#[allow(dead_code)] // The test uses the rest.
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

fn print_cv(label: &str, s: &harness::CvSummary) {
    println!(
        "  {:<34} rows {:>3}  median |error| {:>5.1} %  under -10 % {:>3} ({:>4.1} %)  OOM rows predicted {}/{}",
        label,
        s.rows,
        s.median_ape * 100.0,
        s.under_ten,
        if s.rows == 0 {
            0.0
        } else {
            s.under_ten as f64 * 100.0 / s.rows as f64
        },
        s.oom.0,
        s.oom.1
    );
}

fn print_fitted(label: &str, f: &memguard_estimator::Fitted) {
    println!(
        "  {:<34} CUDA_CONTEXT {:>5} MiB  CUDA_CACHE_FRACTION {:.2}  CPU_PROCESS_BASELINE {:>4} MB  CPU_HEAP_FRACTION {:.2}  CUDA_FRAGMENTATION_PER_SPREAD {:.2}",
        label,
        f.cuda_context.0 / (1 << 20),
        f.cuda_cache_fraction,
        f.cpu_process_baseline.0 / 1_000_000,
        f.cpu_heap_fraction,
        f.cuda_fragmentation_per_spread
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
    let cv = harness::cross_validate(&scored);
    if std::env::args().any(|a| a == "--write-residuals") {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bound/residuals.rs");
        let text = harness::residuals_source(&harness::residuals(&cv));
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("accuracy: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}", path.display());
        return ExitCode::SUCCESS;
    }
    if std::env::args().any(|a| a == "--csv") {
        print_csv(&cv);
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<40} {:<28} {:<5} {:<11} {:>10} {:>10} {:>16}",
        "row (cross-validated)", "model", "dev", "compare", "meas. GB", "est. GB", "error"
    );
    let verbose = std::env::args().any(|a| a == "--components");
    // `--in-sample` prints the rows as the shipped constants score them (the figures the
    // sets are committed at), not the cross-validated ones.
    let table = if std::env::args().any(|a| a == "--in-sample") {
        &scored
    } else {
        &cv
    };
    for s in table {
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
    println!(
        "Fitted constants (asymmetric fit: an under-estimate weighs {}x):",
        harness::UNDER_WEIGHT
    );
    print_fitted("shipped", &memguard_estimator::Fitted::SHIPPED);
    let all: Vec<&Scored> = scored.iter().collect();
    print_fitted("fitted on every source", &harness::fit(&all));
    print_fitted(
        "fragmentation, shipped steady constants",
        &harness::fit_fragmentation(
            &harness::varying(&scored),
            memguard_estimator::Fitted::SHIPPED,
        ),
    );
    for source in harness::sources(&scored) {
        print_fitted(
            &format!("without {source}"),
            &harness::fold(&scored, &source),
        );
    }
    println!();
    println!("Sources each fitted constant rests on:");
    for (constant, sources) in harness::support(&scored) {
        let only = if sources.len() == 1 {
            "  (ONLY ONE SOURCE)"
        } else {
            ""
        };
        println!("  {constant:<22} {}{only}", sources.join(", "));
    }
    println!();
    println!(
        "Cross-validated, leave one source out (each source scored with constants fitted without it):"
    );
    print_cv("overall", &harness::cv_summary(&cv, |_| true));
    print_cv(
        "before sets 1 and 2",
        &harness::cv_summary(&cv, |r| !harness::NEW_SETS.contains(&r.file.as_str())),
    );
    for file in harness::NEW_SETS {
        print_cv(file, &harness::cv_summary(&cv, |r| r.file == file));
    }
    for source in harness::sources(&cv) {
        print_cv(&source, &harness::cv_summary(&cv, |r| r.source == source));
    }
    println!();
    println!("In-sample (the shipped constants, for comparison):");
    print_cv("overall", &harness::cv_summary(&scored, |_| true));
    for file in harness::FILES.iter().chain(harness::COLLECTED.iter()) {
        print_cv(file, &harness::cv_summary(&scored, |r| r.file == *file));
    }
    println!();
    println!("Upper bound (factors from the other sources' cross-validated residuals):");
    for level in [0.8, 0.9, 0.95, 0.99] {
        let (covered, rows, width) = harness::bound_coverage(&cv, level);
        println!(
            "  level {level:.2}: covers {covered}/{rows} rows ({:.1} %), median bound/measured {width:.3}",
            covered as f64 * 100.0 / rows as f64
        );
    }
    println!("The same bound on sets 1 and 2 (not among its residuals: held out from it):");
    for level in [0.8, 0.9, 0.95, 0.99] {
        let (covered, rows, width) = harness::bound_coverage_where(&cv, level, |r| r.in_new_set());
        println!(
            "  level {level:.2}: covers {covered}/{rows} rows ({:.1} %), median bound/measured {width:.3}",
            covered as f64 * 100.0 / rows as f64
        );
    }
    let misses = harness::bound_misses(&cv, 0.95);
    let list: Vec<String> = misses
        .iter()
        .map(|(id, class, over)| {
            format!(
                "{id} ({class}, measured {:.1} % over)",
                (over - 1.0) * 100.0
            )
        })
        .collect();
    println!("  not covered at 0.95: {}", list.join("; "));
    println!();
    println!(
        "Per device kind, cross-validated (rows tagged UNMODELLED are printed above but not counted):"
    );
    for device in [Device::Cuda, Device::Cpu] {
        print_summary("all", &harness::summarize(&cv, device));
    }
    ExitCode::SUCCESS
}
