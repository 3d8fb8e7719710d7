//! The chart's alerting rules (`monitoring.prometheusRule`), driven through the real `helm` and
//! Prometheus' `promtool`: `promtool check rules` on the rendered rules, and `promtool test rules`
//! with `tests/alerts/memguard-rules.test.yaml`, which feeds series to every alert and checks that
//! it fires when it should and stays quiet when it should not.
//!
//! Tools are found through `HELM` / `PROMTOOL` / `PYTHON` / `MEMGUARD_TOOLS` / PATH; without them
//! the tests print a loud SKIP locally, and fail under `CI=true` or `MEMGUARD_REQUIRE_TOOLS=1`.

use memguard_api::Level;
use memguard_e2e::*;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Values that enable the rule with its default thresholds, which the unit tests assume.
const ENABLE: &[&str] = &[
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.serviceMonitor.enabled=true",
];

/// Every alert the chart ships, in the order it renders them (webhook group, then sidecar).
const ALERTS: &[&str] = &[
    "MemguardWebhookDown",
    "MemguardWebhookAdmissionErrors",
    "MemguardWebhookCertificateExpiring",
    "MemguardWebhookCertificateReloadFailed",
    "MemguardPolicyRejected",
    "MemguardProfileControllerNoLeader",
    "MemguardProfileControllerErrors",
    "MemguardTrainerCriticalPressure",
    "MemguardTrainerOOMKilled",
    "MemguardTrainerRepeatedDowngrades",
    "MemguardTrainerMemoryLeak",
    "MemguardSidecarSampleErrors",
    "MemguardSidecarSignalWriteErrors",
];

/// The rule file the unit tests name in `rule_files`, written next to their copy.
const RULES_FILE: &str = "memguard-rules.yaml";

fn unit_tests_file() -> PathBuf {
    workspace_root().join("tests/alerts/memguard-rules.test.yaml")
}

fn read_yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Renders the chart with [`ENABLE`] and `extra`; returns its one PrometheusRule.
fn render_rule(helm: &Path, extra: &[&str]) -> Value {
    let args: Vec<&str> = ENABLE.iter().chain(extra).copied().collect();
    let docs = parse_documents(&helm_template(helm, &args).unwrap_or_else(|e| panic!("{e}")));
    let rules = all_of_kind(&docs, "PrometheusRule");
    assert_eq!(rules.len(), 1, "{extra:?}: {} PrometheusRules", rules.len());
    rules[0].clone()
}

/// Every rule of every group.
fn rules_of(rule: &Value) -> Vec<&Value> {
    rule["spec"]["groups"]
        .as_array()
        .expect("spec.groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .collect()
}

/// The names of the alerting rules, in order.
fn alert_names(rule: &Value) -> Vec<&str> {
    rules_of(rule)
        .into_iter()
        .filter_map(|r| r["alert"].as_str())
        .collect()
}

fn alert<'a>(rule: &'a Value, name: &str) -> &'a Value {
    rules_of(rule)
        .into_iter()
        .find(|r| r["alert"] == name)
        .unwrap_or_else(|| panic!("no alert {name} in {:?}", alert_names(rule)))
}

fn expr<'a>(rule: &'a Value, name: &str) -> &'a str {
    alert(rule, name)["expr"].as_str().expect("expr")
}

/// Writes the rule's `spec` as the rule file (JSON is YAML) and a copy of the unit tests next to
/// it; returns the copy's path.
fn write_rule_files(dir: &Path, rule: &Value) -> PathBuf {
    let spec = serde_json::to_string_pretty(&rule["spec"]).expect("JSON");
    std::fs::write(dir.join(RULES_FILE), spec).expect("write rules");
    let tests = dir.join("memguard-rules.test.yaml");
    std::fs::copy(unit_tests_file(), &tests).expect("copy the unit tests");
    tests
}

/// Runs promtool; returns whether it succeeded and its whole output.
fn promtool_run(promtool: &Path, args: &[&str], file: &Path) -> (bool, String) {
    let out = run(Command::new(promtool).args(args).arg(file));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

// === What renders ===

#[test]
fn prometheus_rule_is_off_by_default_and_one_object_when_enabled() {
    let Some(helm) = helm() else { return };
    let defaults = parse_documents(&helm_template(&helm, &[]).expect("renders"));
    assert!(
        all_of_kind(&defaults, "PrometheusRule").is_empty(),
        "off by default: it needs the Prometheus Operator CRDs"
    );

    let rule = render_rule(
        &helm,
        &["--set", "monitoring.prometheusRule.labels.release=kps"],
    );
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["name"], format!("{RELEASE}-memguard"));
    assert_eq!(rule["metadata"]["namespace"], NAMESPACE);
    let labels = &rule["metadata"]["labels"];
    assert_eq!(labels["release"], "kps", "labels land on the object");
    assert_eq!(labels["app.kubernetes.io/part-of"], "memguard");
    assert_eq!(labels["app.kubernetes.io/instance"], RELEASE);

    let groups: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| g["name"].as_str().expect("name"))
        .collect();
    assert_eq!(groups, ["memguard-webhook", "memguard-sidecar"]);
    assert_eq!(alert_names(&rule), ALERTS);

    // The schema's list of alerts one may disable is this list: a typo fails the install.
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).expect("schema"),
    )
    .expect("JSON");
    let disable = &schema["properties"]["monitoring"]["properties"]["prometheusRule"]["properties"]
        ["disabledAlerts"]["items"]["enum"];
    assert_eq!(disable, &json!(ALERTS));
}

#[test]
fn every_alert_has_a_severity_summary_description_and_runbook_section() {
    let Some(helm) = helm() else { return };
    let rule = render_rule(&helm, &[]);
    let values = read_yaml(&chart_dir().join("values.yaml"));
    let base = values["monitoring"]["prometheusRule"]["runbookUrl"]
        .as_str()
        .expect("runbookUrl");
    // The default runbook is this repository's docs/alerts.md.
    let path = base
        .split_once("/blob/main/")
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("runbookUrl {base} is not a file of the repository"));
    assert_eq!(path, "docs/alerts.md");
    let runbook = std::fs::read_to_string(workspace_root().join(path)).expect("docs/alerts.md");
    let sections: BTreeSet<&str> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter(|h| h.starts_with("Memguard"))
        .collect();
    assert_eq!(
        sections,
        ALERTS.iter().copied().collect(),
        "docs/alerts.md needs one `## <alert>` section per alert, and no other"
    );

    for name in ALERTS {
        let a = alert(&rule, name);
        let severity = a["labels"]["severity"].as_str().expect("severity");
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity {severity}"
        );
        for key in ["summary", "description"] {
            let text = a["annotations"][key].as_str().unwrap_or_default();
            assert!(text.len() > 20, "{name}: {key} {text:?}");
        }
        // GitHub's anchor of `## MemguardX` is `#memguardx`.
        assert_eq!(
            a["annotations"]["runbook_url"],
            format!("{base}#{}", name.to_lowercase()),
            "{name}"
        );
    }
    // Level 2 (downgrade) is memguard at work: only critical pressure pages.
    let critical: Vec<&str> = ALERTS
        .iter()
        .copied()
        .filter(|n| alert(&rule, n)["labels"]["severity"] == "critical")
        .collect();
    assert_eq!(
        critical,
        ["MemguardWebhookDown", "MemguardTrainerCriticalPressure"]
    );
}

/// The level gauge's critical value is the contract's (`memguard_api::Level`). The leak gauge
/// has no "no leak" value to exclude: the sidecar leaves it out when it sees no steady growth
/// (the unit tests check that an absent gauge stays quiet).
#[test]
fn sidecar_alerts_read_the_contract_level_and_the_leak_gauge_as_exported() {
    let Some(helm) = helm() else { return };
    let rule = render_rule(&helm, &[]);
    assert_eq!(
        expr(&rule, "MemguardTrainerCriticalPressure"),
        format!("memguard_sidecar_level == {}", Level::Critical.as_gauge())
    );
    assert_eq!(
        expr(&rule, "MemguardTrainerMemoryLeak"),
        "memguard_sidecar_leak_seconds_to_limit < 600"
    );
}

#[test]
fn thresholds_and_alert_labels_reach_the_rules() {
    let Some(helm) = helm() else { return };
    let rule = render_rule(
        &helm,
        &[
            "--set",
            "monitoring.prometheusRule.certificateExpiryDays=30",
            "--set",
            "monitoring.prometheusRule.leakSecondsToLimit=120",
            "--set",
            "monitoring.prometheusRule.downgradesPerHour=5",
            "--set-json",
            "monitoring.prometheusRule.admissionErrorRatio=0.05",
            "--set",
            "monitoring.prometheusRule.alertLabels.team=ml-platform",
            "--set",
            "monitoring.prometheusRule.alertLabels.severity=none",
            "--set",
            "monitoring.prometheusRule.runbookUrl=",
        ],
    );
    assert!(expr(&rule, "MemguardWebhookCertificateExpiring").ends_with("< 30 * 86400"));
    assert!(expr(&rule, "MemguardTrainerMemoryLeak").ends_with("< 120"));
    assert!(expr(&rule, "MemguardTrainerRepeatedDowngrades").ends_with(">= 5"));
    assert!(expr(&rule, "MemguardWebhookAdmissionErrors").ends_with("> 0.05"));
    for name in ALERTS {
        let a = alert(&rule, name);
        assert_eq!(a["labels"]["team"], "ml-platform", "{name}");
        assert_ne!(
            a["labels"]["severity"], "none",
            "{name}: its own severity wins"
        );
        assert!(a["annotations"].get("runbook_url").is_none(), "{name}");
    }
}

#[test]
fn disabled_alerts_are_left_out_and_extra_rules_added() {
    let Some(helm) = helm() else { return };
    let rule = render_rule(
        &helm,
        &[
            "--set",
            "monitoring.prometheusRule.disabledAlerts={MemguardTrainerRepeatedDowngrades}",
        ],
    );
    let expected: Vec<&str> = ALERTS
        .iter()
        .copied()
        .filter(|a| *a != "MemguardTrainerRepeatedDowngrades")
        .collect();
    assert_eq!(alert_names(&rule), expected);

    // A group whose alerts are all disabled is left out, not rendered empty.
    let defaults = render_rule(&helm, &[]);
    let sidecar: Vec<&str> = defaults["spec"]["groups"][1]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| r["alert"].as_str().expect("alert"))
        .collect();
    assert_eq!(defaults["spec"]["groups"][1]["name"], "memguard-sidecar");
    let set = format!(
        "monitoring.prometheusRule.disabledAlerts={{{}}}",
        sidecar.join(",")
    );
    let rule = render_rule(&helm, &["--set", &set]);
    let webhook: Vec<&str> = ALERTS
        .iter()
        .copied()
        .filter(|a| !sidecar.contains(a))
        .collect();
    assert_eq!(alert_names(&rule), webhook);
    assert_eq!(rule["spec"]["groups"].as_array().expect("groups").len(), 1);

    // A misspelt alert name fails the install instead of disabling nothing.
    let args: Vec<&str> = ENABLE
        .iter()
        .copied()
        .chain([
            "--set",
            "monitoring.prometheusRule.disabledAlerts={MemguardWebhookDwn}",
        ])
        .collect();
    let err = helm_template(&helm, &args).expect_err("a misspelt alert renders");
    assert!(err.contains("disabledAlerts"), "{err}");

    // ci/monitoring-values.yaml adds an alert and a recording rule of its own.
    let path = chart_dir().join("ci/monitoring-values.yaml");
    let docs = parse_documents(
        &helm_template(&helm, &["-f", path.to_str().expect("UTF-8")]).expect("renders"),
    );
    let rule = find_kind(&docs, "PrometheusRule");
    let extra = rule["spec"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .find(|g| g["name"] == "memguard-extra")
        .expect("group memguard-extra");
    let values = read_yaml(&path);
    assert_eq!(
        extra["rules"],
        values["monitoring"]["prometheusRule"]["extraRules"]
    );
}

/// MemguardWebhookDown reads `up` of the job the Prometheus Operator gives the webhook's target:
/// the name of the Service the ServiceMonitor selects (it sets no `jobLabel`).
#[test]
fn webhook_down_watches_the_job_the_service_monitor_gives_the_webhook() {
    let Some(helm) = helm() else { return };
    let path = chart_dir().join("ci/monitoring-values.yaml");
    let docs = parse_documents(
        &helm_template(&helm, &["-f", path.to_str().expect("UTF-8")]).expect("renders"),
    );
    let sm = find_kind(&docs, "ServiceMonitor");
    assert!(
        sm["spec"].get("jobLabel").is_none(),
        "job = the Service name"
    );
    let selector = sm["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels");
    let services: Vec<&Value> = all_of_kind(&docs, "Service")
        .into_iter()
        .filter(|s| {
            selector
                .iter()
                .all(|(k, v)| &s["metadata"]["labels"][k] == v)
        })
        .collect();
    assert_eq!(services.len(), 1, "the ServiceMonitor selects one Service");
    let job = services[0]["metadata"]["name"].as_str().expect("name");
    let rule = find_kind(&docs, "PrometheusRule");
    assert_eq!(
        expr(rule, "MemguardWebhookDown"),
        format!("absent(up{{job=\"{job}\", namespace=\"{NAMESPACE}\"}} == 1)")
    );

    // Scraped some other way: the job is given.
    let custom = parse_documents(
        &helm_template(
            &helm,
            &[
                "--set",
                "monitoring.prometheusRule.enabled=true",
                "--set",
                "monitoring.prometheusRule.webhookJob=memguard-webhook",
            ],
        )
        .expect("renders with webhookJob and no ServiceMonitor"),
    );
    let rule = find_kind(&custom, "PrometheusRule");
    assert!(expr(rule, "MemguardWebhookDown").contains("job=\"memguard-webhook\""));

    // Not scraped at all: the alert would fire forever, so the install fails and says why.
    let err = helm_template(&helm, &["--set", "monitoring.prometheusRule.enabled=true"])
        .expect_err("rendered an alert that can only fire");
    assert!(
        err.contains("enable monitoring.serviceMonitor")
            && err.contains("monitoring.prometheusRule.webhookJob")
            && err.contains("disabledAlerts"),
        "{err}"
    );
    let off = parse_documents(
        &helm_template(
            &helm,
            &[
                "--set",
                "monitoring.prometheusRule.enabled=true",
                "--set",
                "monitoring.prometheusRule.disabledAlerts={MemguardWebhookDown}",
            ],
        )
        .expect("renders without MemguardWebhookDown"),
    );
    assert!(!alert_names(find_kind(&off, "PrometheusRule")).contains(&"MemguardWebhookDown"));
}

// === The names the rules read ===

/// Every `memguard_*` metric in an expression or an annotation is registered by the binary that
/// exports it, and every label matcher on one names a label (and value) that binary writes.
#[test]
fn alert_rules_read_only_metrics_and_labels_the_binaries_export() {
    let Some(helm) = helm() else { return };
    let rule = render_rule(&helm, &[]);
    let mut used = BTreeSet::new();
    for name in ALERTS {
        let a = alert(&rule, name);
        used.extend(metric_names_in(a["expr"].as_str().expect("expr")));
        // Annotations also name `memguard_client` (the Python package): only metric prefixes.
        for text in a["annotations"]
            .as_object()
            .expect("annotations")
            .values()
            .filter_map(Value::as_str)
        {
            used.extend(
                metric_names_in(text)
                    .into_iter()
                    .filter(|m| METRIC_SOURCES.iter().any(|(p, ..)| m.starts_with(p))),
            );
        }
    }
    assert!(used.len() >= 12, "{used:?}");
    assert_metrics_registered(used.iter().map(String::as_str), "the alerting rules");

    // `metric{label="value", …}`: the label is the metric's, the value one its crate writes.
    for name in ALERTS {
        let e = expr(&rule, name);
        let mut rest = e;
        while let Some(start) = rest.find("memguard_") {
            rest = &rest[start..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let (metric, after) = rest.split_at(end);
            rest = after;
            let Some(matchers) = after
                .strip_prefix('{')
                .and_then(|m| m.split_once('}'))
                .map(|(m, _)| m)
            else {
                continue;
            };
            let (_, file, ..) = METRIC_SOURCES
                .iter()
                .find(|(p, ..)| metric.starts_with(p))
                .unwrap_or_else(|| panic!("{name}: {metric}"));
            let source = std::fs::read_to_string(workspace_root().join(file)).expect("source");
            let crate_src = crate_sources(
                workspace_root()
                    .join(file)
                    .parent()
                    .expect("a file in src/"),
            );
            for m in matchers.split(',') {
                let (label, value) = m.split_once('=').expect("label=\"value\"");
                let (label, value) = (label.trim(), value.trim());
                // A field of an `EncodeLabelSet` struct, or a label name written as a string.
                assert!(
                    source.contains(&format!("{label}: "))
                        || source.contains(&format!("\"{label}\"")),
                    "{name}: {file} writes no label {label} on {metric}"
                );
                assert!(
                    crate_src.contains(value),
                    "{name}: no {value} in {} for {metric}{{{label}}}",
                    file.rsplit_once('/').map_or(*file, |(d, _)| d)
                );
            }
        }
    }
}

/// All of a crate's `src/` Rust files, concatenated.
fn crate_sources(dir: &Path) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(dir).expect("src dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            out.push_str(&crate_sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).expect("read"));
        }
    }
    out
}

/// The source check has teeth: a name nothing registers fails it.
#[test]
#[should_panic(expected = "memguard_sidecar_oom_kill_total (not registered")]
fn a_metric_no_binary_registers_fails_the_source_check() {
    // `"oom_kill"` is in the source, as a label value of another family: not a registration.
    assert_metrics_registered(["memguard_sidecar_oom_kill_total"], "a typo");
}

// === promtool ===

/// Every rendering with the rule (the defaults with it enabled, and each `ci/*.yaml` that enables
/// it) passes `promtool check rules`.
#[test]
fn rendered_rules_pass_promtool_check_rules() {
    let Some(helm) = helm() else { return };
    let Some(promtool) = promtool() else { return };
    let mut rendered = vec![("defaults, enabled".to_string(), render_rule(&helm, &[]))];
    for file in ci_values_files() {
        let path = file.to_str().expect("UTF-8");
        let docs = parse_documents(&helm_template(&helm, &["-f", path]).expect("renders"));
        if let Some(rule) = all_of_kind(&docs, "PrometheusRule").first() {
            rendered.push((path.to_string(), (*rule).clone()));
        }
    }
    assert!(
        rendered.len() >= 2,
        "no ci/*.yaml enables the PrometheusRule"
    );
    for (label, rule) in rendered {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join(RULES_FILE);
        std::fs::write(&file, rule["spec"].to_string()).expect("write");
        let (ok, out) = promtool_run(&promtool, &["check", "rules"], &file);
        assert!(ok, "{label}: promtool check rules failed:\n{out}");
        let count = rules_of(&rule).len();
        assert!(
            out.contains(&format!("SUCCESS: {count} rules found")),
            "{label}: {out}"
        );
    }
}

#[test]
fn promtool_unit_tests_pass() {
    let Some(helm) = helm() else { return };
    let Some(promtool) = promtool() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let tests = write_rule_files(dir.path(), &render_rule(&helm, &[]));
    let (ok, out) = promtool_run(&promtool, &["test", "rules"], &tests);
    assert!(ok, "promtool test rules failed:\n{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

/// `(alert, firing cases, quiet cases)` of the unit tests: an `alert_rule_test` with
/// `exp_alerts` expects it to fire, one without expects silence.
fn unit_test_cases() -> BTreeMap<String, (usize, usize)> {
    let file = read_yaml(&unit_tests_file());
    assert_eq!(file["rule_files"], json!([RULES_FILE]));
    let mut cases: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for test in file["tests"].as_array().expect("tests") {
        for case in test["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname").to_string();
            let firing = case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty());
            let entry = cases.entry(name).or_default();
            if firing {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    cases
}

/// Each alert is shown to fire, and shown to stay quiet (level 2 does not page, a certificate 60
/// days out does not warn, no leak gauge is no leak…). An alert name the rules lack would make
/// a quiet case pass vacuously: none may appear.
#[test]
fn every_alert_has_a_firing_and_a_quiet_unit_test() {
    let cases = unit_test_cases();
    let named: BTreeSet<&str> = cases.keys().map(String::as_str).collect();
    assert_eq!(
        named,
        ALERTS.iter().copied().collect(),
        "the unit tests name exactly the chart's alerts"
    );
    for (name, (firing, quiet)) in &cases {
        assert!(*firing > 0, "{name}: no case where it fires");
        assert!(*quiet > 0, "{name}: no case where it stays quiet");
    }
}

/// Mutation check: replacing any one alert's expression by one that never fires must fail the
/// unit tests, naming that alert. Without this, a unit test that asserts too little would pass.
#[test]
fn breaking_any_alert_fails_the_unit_tests() {
    let Some(helm) = helm() else { return };
    let Some(promtool) = promtool() else { return };
    let rule = render_rule(&helm, &[]);
    for name in ALERTS {
        let mut broken = rule.clone();
        for group in broken["spec"]["groups"].as_array_mut().expect("groups") {
            for r in group["rules"].as_array_mut().expect("rules") {
                if r["alert"] == *name {
                    r["expr"] = json!("vector(0) > 1");
                }
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let tests = write_rule_files(dir.path(), &broken);
        let (ok, out) = promtool_run(&promtool, &["test", "rules"], &tests);
        assert!(!ok, "{name} never fires, yet the unit tests pass:\n{out}");
        assert!(
            out.contains(&format!("alertname: {name},")),
            "{name}: the failure does not name it:\n{out}"
        );
    }
}

// === The manifest ===

/// The schema check of `every_rendered_manifest_is_valid_for_kubernetes_1_33` has teeth.
#[test]
fn prometheus_rule_schema_check_rejects_unknown_fields_and_bad_durations() {
    let Some(helm) = helm() else { return };
    let Some(python) = python_with_jsonschema() else {
        return;
    };
    let rule = render_rule(&helm, &[]);
    validate_prometheus_rule(&python, &rule).unwrap_or_else(|e| panic!("{e}"));
    type Mutation = fn(&mut Value);
    let broken: [(&str, Mutation); 5] = [
        ("unknown rule field", |r| {
            r["spec"]["groups"][0]["rules"][0]["severity"] = json!("critical");
        }),
        ("bad duration", |r| {
            r["spec"]["groups"][0]["rules"][0]["for"] = json!("5 minutes");
        }),
        ("both alert and record", |r| {
            r["spec"]["groups"][0]["rules"][0]["record"] = json!("memguard:x");
        }),
        ("numeric label", |r| {
            r["spec"]["groups"][1]["rules"][0]["labels"]["tier"] = json!(1);
        }),
        ("duplicate group", |r| {
            let first = r["spec"]["groups"][0].clone();
            r["spec"]["groups"]
                .as_array_mut()
                .expect("groups")
                .push(first);
        }),
    ];
    for (what, mutate) in broken {
        let mut doc = rule.clone();
        mutate(&mut doc);
        assert!(
            validate_prometheus_rule(&python, &doc).is_err(),
            "{what}: accepted"
        );
    }
}
