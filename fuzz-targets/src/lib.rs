//! The bodies of memguard's fuzz targets, one function per target.
//!
//! Each function takes arbitrary bytes, feeds them to the real parsers and decision code, and
//! panics only when an invariant is broken (beyond "no panic" itself, each target checks what
//! must hold for any input: round trips, bounds, the admission patch applying and being
//! idempotent). Two callers share them, so the logic exists once:
//! - the cargo-fuzz crate in `fuzz/` (libFuzzer, coverage-guided; `scripts/fuzz.sh`);
//! - `tests/replay.rs`, which runs every committed corpus file under `fuzz/corpus/<target>/`
//!   through the same function on the stable toolchain, in `cargo test`.
#![deny(missing_docs)]

use base64::Engine;
use json_patch::Patch;
use k8s_openapi::api::core::v1::Pod;
use memguard_api::{Report, Signal, TrainingAnnotations};
use memguard_sidecar::sample::cgroup::{self, Layout};
use memguard_sidecar::sample::{Limit, procfs, psi};
use memguard_webhook::review::{self, Disposition};
use memguard_webhook::{ClusterView, policy_sources};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

/// A target's body: arbitrary bytes in, a panic when an invariant breaks.
pub type Target = fn(&[u8]);

/// Every target, by the name its corpus directory and cargo-fuzz binary have.
pub const TARGETS: &[(&str, Target)] = &[
    ("annotations", annotations),
    ("admission_review", admission_review),
    ("quantities", quantities),
    ("policy", policy),
    ("cgroup_files", cgroup_files),
    ("signal_report", signal_report),
    ("launch", launch),
];

/// Annotation parsing. The input is a pod's annotations, one `key=value` per line (a key
/// without `memguard.io/` is prefixed, so the fuzzer reaches the parsers quickly); values may
/// hold anything but a newline.
pub fn annotations(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut map = BTreeMap::new();
    for line in text.lines() {
        let (key, value) = line.split_once('=').unwrap_or((line, ""));
        let key = if key.contains('/') {
            key.to_string()
        } else {
            format!("{}{key}", memguard_api::annotations::PREFIX)
        };
        map.insert(key, value.to_string());
    }
    // The models of a policy that adds two (one quantized), in front of the built-in catalog:
    // the lookup the webhook really does.
    match TrainingAnnotations::parse(&map, &fixture_models().models) {
        Ok(_) => {}
        Err(errors) => {
            assert!(!errors.is_empty(), "a refusal names at least one error");
            for e in &errors {
                assert!(!e.to_string().is_empty(), "an error says something");
            }
        }
    }
    let _ = memguard_api::annotations::has_training_input(&map);
}

/// A policy with models of its own (`webhook/tests/fixtures/policy-models.yaml`).
fn fixture_models() -> &'static memguard_api::Policy {
    static POLICY: OnceLock<memguard_api::Policy> = OnceLock::new();
    POLICY.get_or_init(|| {
        let text = include_str!("../../webhook/tests/fixtures/policy-models.yaml");
        policy_sources::policy_from_str(Some(text), &policy_sources::Overrides::default())
            .expect("the fixture policy is valid")
    })
}

/// The policy the webhook's golden fixtures run under (a table of GPU products, a sidecar with
/// resources, an env name), so that reviews reach every part of the decision.
fn fixture_policy() -> &'static memguard_api::Policy {
    static POLICY: OnceLock<memguard_api::Policy> = OnceLock::new();
    POLICY.get_or_init(|| {
        let text = include_str!("../../webhook/tests/fixtures/policy.yaml");
        policy_sources::policy_from_str(Some(text), &policy_sources::Overrides::default())
            .expect("the fixture policy is valid")
    })
}

/// The whole webhook path on an AdmissionReview body: parse, decide, patch, answer (under the
/// webhook fixtures' policy, no profiles). Invariants: no panic (a panic caught by the webhook counts as
/// one); the answer is JSON that admits the pod; a patch applies to the pod and yields a Pod;
/// a second review of the patched pod returns no patch.
pub fn admission_review(data: &[u8]) {
    let policy = fixture_policy();
    let profiles = ClusterView::default();
    let Ok(reviewed) = review::review(data, policy, &profiles) else {
        return;
    };
    assert!(
        !reviewed
            .warnings
            .iter()
            .any(|w| w == review::INTERNAL_ERROR),
        "memguard panicked while deciding"
    );
    let answer = serde_json::to_vec(&reviewed.review).expect("the answer serializes");
    let answer: Value = serde_json::from_slice(&answer).expect("the answer is JSON");
    assert_eq!(answer["response"]["allowed"], Value::Bool(true));
    for w in &reviewed.warnings {
        assert!(
            w.chars().count() <= 120,
            "warning over 120 characters: {w:?}"
        );
    }
    let Some(patch_b64) = &reviewed.review.response.patch else {
        return;
    };
    assert!(
        matches!(
            reviewed.disposition,
            Disposition::Mutated | Disposition::Guarded | Disposition::Skipped
        ),
        "a patch comes with a mutation, a run-time guard or a skip, not {:?}",
        reviewed.disposition
    );
    let patch_json = base64::engine::general_purpose::STANDARD
        .decode(patch_b64)
        .expect("the patch is base64");
    let patch: Patch = serde_json::from_slice(&patch_json).expect("the patch is a JSON patch");

    // The pod as the API server holds it: the request's object, decoded and re-encoded. The
    // typed parse skips the fields it does not know without checking their strings, so a body
    // can review although it is not JSON a `Value` holds (invalid UTF-8 or a lone surrogate in
    // an unknown field; found by the fuzzer). The API server never sends such a body (its
    // encoder writes valid UTF-8), so there is no pod of its to patch: the checks above suffice.
    let Ok(mut body) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let object = body["request"]["object"].take();
    // A Pod is held decoded and re-encoded. An object k8s-openapi does not read as a Pod (a
    // wrong `apiVersion` next to a missing `kind`, which the webhook's untyped path drops; found
    // by the fuzzer) the API server would not send, but the patch must still apply to it as is.
    let (mut doc, is_pod) = match serde_json::from_value::<Pod>(object.clone()) {
        Ok(pod) => (serde_json::to_value(&pod).expect("a Pod serializes"), true),
        Err(_) => (object, false),
    };
    json_patch::patch(&mut doc, &patch).unwrap_or_else(|e| panic!("the patch applies: {e}"));
    if is_pod {
        let patched: Pod = serde_json::from_value(doc.clone())
            .unwrap_or_else(|e| panic!("the patched object is a Pod: {e}"));
        doc = serde_json::to_value(&patched).expect("a Pod serializes");
    }

    // A second pass (the API server re-invokes webhooks) changes nothing.
    body["request"]["object"] = doc;
    let again = serde_json::to_vec(&body).expect("the body serializes");
    let second = review::review(&again, policy, &profiles).expect("the patched review parses");
    assert!(
        second.review.response.patch.is_none(),
        "a second review patches again: {:?}",
        second
            .review
            .response
            .patch
            .as_deref()
            .map(|p| base64::engine::general_purpose::STANDARD
                .decode(p)
                .map(|b| String::from_utf8_lossy(&b).into_owned()))
    );
}

/// Quantities (`64Gi`, `1e9`), sizes (`24GiB`), the estimator's counts (`7B`) and the sidecar's
/// durations (`100ms`, `2s`). Invariants: a plain integer quantity parses to itself; a size is
/// more than 0 bytes, says itself back as written, and is never a bare number.
pub fn quantities(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let quantity = memguard_api::pod::parse_quantity(text);
    if let Ok(n) = text.trim().parse::<u64>()
        && n < (1u64 << 53)
    {
        assert_eq!(
            quantity,
            Some(n),
            "an exact integer quantity parses to itself"
        );
    }
    if let Ok(size) = memguard_api::quantity::Size::parse(text) {
        assert!(size.bytes().0 > 0, "a size is more than 0 bytes");
        assert_eq!(
            size.to_string(),
            text.trim(),
            "a size says itself back as written"
        );
        assert!(
            text.trim().parse::<f64>().is_err(),
            "a bare number is no size"
        );
    }
    let _ = memguard_estimator::units::parse_count(text);
    if let Ok(d) = memguard_sidecar::config::parse_duration(text)
        && let Ok(secs) = text.trim().parse::<u64>()
    {
        assert_eq!(d.as_secs(), secs, "a bare number is seconds");
    }
    let _ = memguard_sidecar::config::parse_bool(text);
}

/// The policy document: a `PolicySpec` or a `MemguardPolicy` manifest, YAML or JSON, through
/// the same function the webhook uses for its file and `memguard mutate` for `--policy`.
/// Invariants: a policy that validates passes its own validation again (the thresholds are
/// ordered and within range), and each model it adds (`spec.models`) answers to its own name.
pub fn policy(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match policy_sources::policy_from_str(Some(text), &policy_sources::Overrides::default()) {
        Ok(policy) => {
            policy
                .thresholds
                .validate()
                .unwrap_or_else(|e| panic!("an accepted policy has valid thresholds: {e}"));
            assert!(
                policy.safety_ratio > 0.0 && policy.safety_ratio <= 1.0,
                "safety ratio {} accepted",
                policy.safety_ratio
            );
            // Every accepted model answers to its own name (names are unique).
            for m in policy.models.policy_models() {
                let found = policy.models.lookup(&m.name).expect("resolves by its name");
                assert_eq!(found.shape.name.as_deref(), Some(m.name.as_str()));
            }
        }
        Err(errors) => assert!(!errors.is_empty(), "a refusal says why"),
    }
}

/// The files the sidecar reads under a cgroup and `/proc`: single numbers, v1/v2 limits, keyed
/// files (`memory.stat`, `memory.events`), PSI, `/proc/<pid>/status` and `/proc/<pid>/cgroup`.
/// Invariants: a limit round-trips through its number; PSI averages are finite; the memory
/// directory found from a `/proc/<pid>/cgroup` text never leaves the cgroup root.
pub fn cgroup_files(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(n) = cgroup::parse_u64(text) {
        assert_eq!(cgroup::parse_v2_limit(text), Some(Limit::Bytes(n)));
    }
    let _ = cgroup::parse_v1_limit(text);
    for key in [
        "inactive_file",
        "total_inactive_file",
        "oom_kill",
        "high",
        "max",
    ] {
        let _ = cgroup::keyed(text, key);
    }
    let p = psi::parse_psi(text);
    for line in [p.some, p.full].into_iter().flatten() {
        let _ = (line.avg10, line.avg60, line.avg300, line.total_us);
    }
    let _ = procfs::parse_status_rss(text);
    let root = Path::new("/sys/fs/cgroup");
    for layout in [Layout::Unified, Layout::Legacy, Layout::Hybrid] {
        if let Some(dir) = layout.memory_dir(root, text) {
            assert_inside(&dir, root);
        }
    }
    // The sidecar's discovery: the text as the trainer's `/proc/<pid>/cgroup` among typical
    // mounts, and as a `mountinfo` whose mounts must show a typical trainer cgroup.
    let typical = procfs::cgroup_mounts(TYPICAL_MOUNTINFO);
    for dir in procfs::locate_cgroup(text, &typical) {
        assert!(
            typical.iter().any(|m| inside(&dir, &m.mount_point)),
            "{dir:?} is outside every mount"
        );
    }
    let mounts = procfs::cgroup_mounts(text);
    for dir in procfs::locate_cgroup(TYPICAL_PROC_CGROUP, &mounts) {
        assert!(
            mounts.iter().any(|m| inside(&dir, &m.mount_point)),
            "{dir:?} is outside every mount of {mounts:?}"
        );
    }
}

/// A host-wide v2 mount, a v1 memory mount, and a container's own cgroup mounted elsewhere.
const TYPICAL_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw
35 23 0:32 / /sys/fs/cgroup-v1/memory rw,relatime - cgroup cgroup rw,memory
41 23 0:38 /kubepods/pod1 /mnt/pod rw,relatime - cgroup2 cgroup2 rw
";
const TYPICAL_PROC_CGROUP: &str = "4:memory:/kubepods/pod1/abc\n0::/kubepods/pod1/abc\n";

/// `dir` is `base` or below it, with no `..` climbing back out.
fn inside(dir: &Path, base: &Path) -> bool {
    dir.strip_prefix(base).is_ok_and(|rest| {
        !rest
            .components()
            .any(|c| c == std::path::Component::ParentDir)
    })
}

fn assert_inside(dir: &Path, base: &Path) {
    assert!(inside(dir, base), "{dir:?} escapes {base:?}");
}

/// The signal file and the trainer's report, as the sidecar reads them: the signal kept from a
/// previous run (`starting_signal`) and the `POST /v1/report` body. Invariants: a restarted
/// sidecar's signal is newer and keeps batch × accumulation ≥ 1; what parses re-serializes and
/// parses to the same value.
pub fn signal_report(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let old = serde_json::from_str::<Signal>(text).ok();
    let s = memguard_sidecar::engine::starting_signal(Some(text), 4, 2, false);
    assert!(s.batch_size >= 1 && s.grad_accumulation >= 1);
    if let Some(old) = &old
        && old.version == s.version
    {
        assert!(
            s.seq > old.seq || old.seq == u64::MAX,
            "the new signal is newer"
        );
    }
    if let Some(old) = old {
        let again = serde_json::to_string(&old).expect("a signal serializes");
        let back: Signal = serde_json::from_str(&again).expect("a serialized signal parses");
        assert_eq!(
            serde_json::to_value(&back).expect("serializes"),
            serde_json::to_value(&old).expect("serializes")
        );
    }
    if let Ok(report) = serde_json::from_slice::<Report>(data) {
        let again = serde_json::to_vec(&report).expect("a report serializes");
        let back: Report = serde_json::from_slice(&again).expect("a serialized report parses");
        assert_eq!(back, report);
    }
}

/// A config-file trainer's launch (axolotl, LLaMA-Factory, TRL or LitGPT `--config`) over an
/// empty file: a batch change rewritten as its overrides re-reads as written, the accumulation
/// with it, and the launch stays the same program.
fn config_file_rewrite(found: &memguard_api::launch::Launch, items: &[String]) {
    use memguard_api::Knob;
    use memguard_api::launch::{self, config_file};
    let Some(config) = config_file::find(found) else {
        return;
    };
    let doc = serde_json::json!({});
    let _ = config.read(&doc);
    let mut before =
        memguard_estimator::TrainingConfig::new(memguard_estimator::ModelShape::default());
    before.batch_size = 4;
    before.grad_accumulation = 2;
    let mut planned = before.clone();
    planned.batch_size = 2;
    planned.grad_accumulation = 4;
    let Ok((edits, _)) = config.rewrite(&doc, &before, &planned, &config.knobs()) else {
        return;
    };
    let out = found.apply(items, &edits);
    let again = launch::find(&out).expect("a rewritten launch is found again");
    assert_eq!(again.program, found.program, "the program stays");
    let reread = config_file::find(&again).expect("still a config-file launch");
    let r = reread.read(&doc);
    let batch = r.knobs.iter().find(|(k, _)| *k == Knob::BatchSize);
    assert_eq!(
        batch.map(|(_, r)| r.value.as_str()),
        Some("2"),
        "the batch re-reads as written: {out:?}"
    );
}

/// The command-line reader: shell words, the launch, the flags, and a rewrite. The input is a
/// container's command, one item per line; a first line `sh -c` makes the rest one shell string.
/// Invariants: every word's span is inside the string and splits back to the word; a rewrite
/// of each flag's value re-reads as that value, and the rest of the string is kept.
pub fn launch(data: &[u8]) {
    use memguard_api::launch::{self, FlagRules, Flags, HfRules, Place, words};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let items: Vec<String> = match text.split_once('\n') {
        Some(("sh -c", script)) => vec!["sh".into(), "-c".into(), script.into()],
        _ => text.lines().map(str::to_string).collect(),
    };
    if let Some(script) = items.get(2).filter(|_| items[0] == "sh")
        && let Ok(tokens) = words::split(script)
    {
        for token in &tokens {
            if let words::Token::Word(w) = token {
                let bytes = script
                    .get(w.span.clone())
                    .expect("a span is on char boundaries");
                let again = words::split(bytes).expect("a word's bytes split alone");
                assert!(
                    matches!(again.as_slice(), [words::Token::Word(x)] if x.text == w.text)
                        || w.expands,
                    "word {:?} re-splits as {again:?}",
                    w.text
                );
            }
        }
    }
    launch_server(&items);
    let Ok(found) = launch::find(&items) else {
        return;
    };
    // With no edit, the command is the same, byte for byte.
    assert_eq!(found.apply(&items, &[]), items, "no edit changes nothing");
    config_file_rewrite(&found, &items);
    let texts = found.texts();
    let flags = Flags::parse(&texts, &HfRules);
    let Some(flag) = flags.flags.last() else {
        return;
    };
    if found.args.iter().any(|a| a.expands) {
        return;
    }
    let key = flag.key.clone();
    // A value the parser takes for the key: memguard writes a bool flag only as true/false.
    let value = if HfRules.is_bool(&key) { "false" } else { "7" };
    let Ok(edit) = flags.set(&key, value, &HfRules) else {
        return;
    };
    let out = found.apply(&items, &[edit]);
    let again = launch::find(&out).expect("a rewritten launch is found again");
    assert_eq!(again.program, found.program, "the program stays");
    let reread = Flags::parse(&again.texts(), &HfRules);
    if !flag.negated && flag.value.is_some() {
        assert_eq!(
            reread.value(&key),
            Some(value),
            "{key} re-reads as set: {out:?}"
        );
    }
    // Outside the edited word, a shell string keeps its bytes.
    if let Some(Place::Shell { item, span }) = found.args.get(flag.at).map(|a| a.place.clone())
        && flag.value_at == memguard_api::launch::flags::ValueAt::Inline
    {
        assert!(
            out[item].starts_with(&items[item][..span.start]),
            "prefix kept"
        );
        assert!(out[item].ends_with(&items[item][span.end..]), "suffix kept");
    }
}

/// The server rules on the same input: a server's memory flags set and read back as set, the
/// launch still found, the model unchanged.
fn launch_server(items: &[String]) {
    use memguard_api::launch::{ArgvEdit, ServerLaunch};
    let Some(found) = ServerLaunch::find(items, &[], false) else {
        return;
    };
    let flags = found.flags();
    let set = [
        (flags.max_length, "1234".to_string()),
        (flags.fraction, "0.5".to_string()),
    ];
    let mut out = items.to_vec();
    let Ok(edits) = found.rewrite(&set) else {
        return;
    };
    for edit in edits {
        match edit {
            ArgvEdit::Replace { index, value, .. } => out[index] = value,
            ArgvEdit::Append { value, .. } => out.push(value),
        }
    }
    let again = ServerLaunch::find(&out, &[], false).expect("a rewritten server is found again");
    assert_eq!((again.engine, &again.model), (found.engine, &found.model));
    // A value the shell expands is not known, so it is not checked.
    if !out.iter().any(|w| w.contains('$') || w.contains('`')) {
        assert_eq!(again.flag(flags.max_length), Some("1234"), "{out:?}");
        assert_eq!(again.flag(flags.fraction), Some("0.5"), "{out:?}");
    }
}
