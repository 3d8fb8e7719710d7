//! Real launch shapes (issue 27, item 5): every entry of `tests/corpus/launch/*.yaml` is a
//! public launch (a framework's own example or a vendor sample, with its repository, commit and
//! path) in a pod opted in with only the label. For each one:
//!
//! 1. **Read**: `TrainingPod::resolve` finds the entry's model, and the knobs it reads, with
//!    their sources, are exactly the entry's `expect`.
//! 2. **Decide and apply**: the webhook's own `mutate` (with the entry's ConfigMaps in the
//!    cluster view) and `patch::build`, applied as JSON patch.
//! 3. **Re-read**: the rewritten pod, read again by the same reader (without the estimate
//!    memguard wrote, so its own values are what is read), yields the plan's values; the
//!    effective batch (batch × accumulation × world size) is the one read first; the plan fits.
//!    A pod that fits as written keeps its `command` and `args` byte for byte.
//! 4. **Idempotent**: a second admission of the output patches nothing.
//! 5. **Valid**: every output passes `kubernetes-validate --strict`.
//!
//! Failures are collected per entry and reported together, each with the entry's file name.
//! `tests/corpus/launch/README.md` describes the format.

use k8s_openapi::api::core::v1::Pod;
use memguard_api::annotations as keys;
use memguard_api::cluster::ConfigMapList;
use memguard_api::{Knob, Policy, TrainingPod, wellknown};
use memguard_webhook::{ClusterView, Outcome, mutate, patch};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/corpus/launch")
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    source: Source,
    pod: Value,
    #[serde(default, rename = "configMaps")]
    config_maps: Vec<Value>,
    expect: Expect,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Source {
    repository: String,
    commit: String,
    path: String,
    what: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    /// The model id the launch names.
    model: String,
    /// `lora` or `full`, when the entry pins it.
    #[serde(default)]
    method: Option<String>,
    /// Knob → value, for every knob read from the trainer's own config.
    #[serde(default)]
    read: BTreeMap<String, String>,
    /// Knob (or `model`, `method`) → source, for everything read from the trainer's config.
    #[serde(default)]
    sources: BTreeMap<String, String>,
}

/// One entry, parsed, with its file name.
struct Case {
    name: String,
    entry: Entry,
}

fn load() -> Vec<Case> {
    let mut cases = Vec::new();
    let dir = corpus_dir();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    paths.sort();
    for path in paths {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a UTF-8 name")
            .to_string();
        let text = std::fs::read_to_string(&path).expect("readable");
        let entry: Entry = serde_saphyr::from_str(&text)
            .unwrap_or_else(|e| panic!("{name}: not a corpus entry: {e}"));
        cases.push(Case { name, entry });
    }
    cases
}

/// The entry's ConfigMaps, as the webhook's watch cache holds them (in the pod's namespace
/// unless they name one).
fn config_maps(entry: &Entry) -> Result<ConfigMapList, String> {
    let pod_namespace = entry.pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default");
    let mut maps = BTreeMap::new();
    for cm in &entry.config_maps {
        let meta = &cm["metadata"];
        let ns = meta["namespace"].as_str().unwrap_or(pod_namespace);
        let Some(name) = meta["name"].as_str() else {
            return Err("a ConfigMap without metadata.name".into());
        };
        let data: BTreeMap<String, String> = serde_json::from_value(cm["data"].clone())
            .map_err(|e| format!("ConfigMap {name}: data: {e}"))?;
        maps.insert((ns.to_string(), name.to_string()), data);
    }
    Ok(ConfigMapList(maps))
}

/// What the reader found: the knobs read from the trainer's config with their values, and the
/// source of each (knobs, `model`, `method`).
struct Reading {
    model: Option<String>,
    method: String,
    read: BTreeMap<String, String>,
    sources: BTreeMap<String, String>,
    effective_batch: u64,
    /// The runtime knobs as the trainer runs them (what was read, else the parser's
    /// defaults), when its parser is known to be `HfArgumentParser`.
    runtime: Option<BTreeMap<String, String>>,
}

fn read(pod: &Pod, policy: &Policy, view: &ClusterView) -> Result<Reading, String> {
    let t = TrainingPod::resolve(pod, policy, view.cluster()).map_err(|e| e.to_string())?;
    let mut read = BTreeMap::new();
    let mut sources = BTreeMap::new();
    for (knob, source) in &t.sources {
        read.insert(knob.name().to_string(), knob.value(&t.config));
        sources.insert(knob.name().to_string(), source.clone());
    }
    for what in &t.read_from_args {
        sources.insert((*what).to_string(), "args".into());
    }
    for (what, source) in &t.read_from_file {
        sources.insert((*what).to_string(), source.clone());
    }
    let c = &t.config;
    let runtime = t.args.as_ref().filter(|a| a.hf_parser).map(|_| {
        [
            Knob::BatchSize,
            Knob::GradAccumulation,
            Knob::GradCheckpointing,
        ]
        .into_iter()
        .map(|k| (k.name().to_string(), k.value(c)))
        .collect()
    });
    Ok(Reading {
        runtime,
        model: c.model.name.clone(),
        method: format!("{:?}", c.method).to_ascii_lowercase(),
        read,
        sources,
        effective_batch: c.batch_size * c.grad_accumulation * c.world_size.max(1),
    })
}

/// The pod without the estimate memguard wrote: read so, the values are the ones in its args.
fn without_estimate(pod: &Value) -> Result<Pod, String> {
    let mut v = pod.clone();
    if let Some(a) = v["metadata"]["annotations"].as_object_mut() {
        a.remove(keys::ESTIMATE);
    }
    serde_json::from_value(v).map_err(|e| format!("not a Pod: {e}"))
}

fn command_line(pod: &Value) -> (Value, Value) {
    let c = &pod["spec"]["containers"][0];
    (c["command"].clone(), c["args"].clone())
}

/// How an entry went.
enum Verdict {
    /// Fits as written: nothing in its command line changed.
    AsWritten,
    /// Rewritten: what changed, in the trainer's words.
    Rewritten(Vec<String>),
}

fn check(case: &Case, policy: &Policy, out_dir: &Path) -> Result<(Verdict, PathBuf), String> {
    let e = &case.entry;
    let s = &e.source;
    let hex = s.commit.len() == 40 && s.commit.chars().all(|c| c.is_ascii_hexdigit());
    if !hex || s.repository.split('/').count() != 2 || s.path.is_empty() || s.what.is_empty() {
        return Err(format!("provenance incomplete: {s:?}"));
    }
    let labels = &e.pod["metadata"]["labels"];
    if labels.get(wellknown::ENABLED_LABEL).and_then(Value::as_str) != Some("true") {
        return Err("the pod is not opted in with the label".into());
    }
    if let Some(a) = e.pod["metadata"]["annotations"].as_object()
        && let Some(k) = a
            .keys()
            .find(|k| k.starts_with("memguard.io/") && k.as_str() != keys::GPU_MEMORY)
    {
        return Err(format!(
            "annotation {k}: an entry opts in with the label only"
        ));
    }
    let pod: Pod = serde_json::from_value(e.pod.clone()).map_err(|e| format!("pod: {e}"))?;
    let view = ClusterView::default().with_config_maps(Arc::new(config_maps(e)?));

    // 1. Read.
    let first = read(&pod, policy, &view).map_err(|why| format!("read: {why}"))?;
    let want_model = policy
        .models
        .lookup(&e.expect.model)
        .ok_or_else(|| format!("model {}: not in the catalog", e.expect.model))?
        .shape
        .name;
    if first.model != want_model {
        return Err(format!(
            "model: read {:?}, expected {} ({want_model:?})",
            first.model, e.expect.model
        ));
    }
    if let Some(m) = &e.expect.method
        && &first.method != m
    {
        return Err(format!("method: read {}, expected {m}", first.method));
    }
    if first.read != e.expect.read {
        return Err(format!(
            "knobs read {:?}, expected {:?}",
            first.read, e.expect.read
        ));
    }
    if first.sources != e.expect.sources {
        return Err(format!(
            "sources {:?}, expected {:?}",
            first.sources, e.expect.sources
        ));
    }

    // 2. Decide and apply.
    let outcome = mutate(&pod, policy, &view);
    let Outcome::Mutated(m) = &outcome else {
        return Err(format!("not mutated: {outcome:?}"));
    };
    if let Some(err) = &m.error {
        return Err(format!("memguard.io/error: {err}"));
    }
    // The estimate annotation names the source of every knob, as read.
    for key in m
        .estimate
        .config
        .keys()
        .filter(|k| Knob::parse(k).is_some())
    {
        let want = e.expect.sources.get(key).map_or("default", String::as_str);
        // A parser default is cited (`default:trl`): never `unknown`.
        let got = m.estimate.sources.get(key).map(String::as_str);
        let matches = match got {
            Some(got) if want == "default" => got == "default" || got.starts_with("default:"),
            got => got == Some(want),
        };
        if !matches {
            return Err(format!(
                "estimate sources {:?}: {key} should be {want}",
                m.estimate.sources
            ));
        }
    }
    if m.estimate.fits != Some(true) {
        return Err(format!("does not fit: {:?}", m.estimate));
    }
    let patch = patch::build(&pod, &outcome);
    let mut applied = e.pod.clone();
    json_patch::patch(&mut applied, &patch).map_err(|e| format!("patch: {e}"))?;

    // 3. Re-read.
    let again = read(&without_estimate(&applied)?, policy, &view)
        .map_err(|why| format!("re-read: {why}"))?;
    if again.effective_batch != first.effective_batch {
        return Err(format!(
            "effective batch {} → {}",
            first.effective_batch, again.effective_batch
        ));
    }
    for (knob, value) in &again.read {
        let planned = Knob::parse(knob)
            .map(|k| k.value(&m.plan.config))
            .ok_or_else(|| format!("unknown knob {knob}"))?;
        if &planned != value {
            return Err(format!("{knob}: re-read {value}, planned {planned}"));
        }
    }
    // Where the parser is known, every runtime knob the plan sets is in the args.
    if let Some(runtime) = &again.runtime {
        for (knob, value) in runtime {
            let planned = Knob::parse(knob).map(|k| k.value(&m.plan.config));
            if planned.as_deref() != Some(value.as_str()) {
                return Err(format!("{knob}: the args run {value}, planned {planned:?}"));
            }
        }
    }
    let verdict = if m.changed.is_empty() {
        if command_line(&applied) != command_line(&e.pod) {
            return Err("fits as written, but its command line changed".into());
        }
        Verdict::AsWritten
    } else {
        if again.read == first.read {
            return Err(format!("changed {:?}, but re-reads as before", m.changed));
        }
        Verdict::Rewritten(m.changed.clone())
    };

    // 4. Idempotent.
    let output: Pod = serde_json::from_value(applied.clone()).map_err(|e| e.to_string())?;
    let second = patch::build(&output, &mutate(&output, policy, &view));
    if !second.0.is_empty() {
        return Err(format!("second admission patches: {second:?}"));
    }

    let file = out_dir.join(&case.name);
    std::fs::write(&file, applied.to_string()).map_err(|e| e.to_string())?;
    Ok((verdict, file))
}

#[test]
fn every_real_launch_shape_is_read_planned_rewritten_and_reread() {
    let cases = load();
    assert!(cases.len() >= 24, "the corpus has {} entries", cases.len());
    let policy = Policy::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut failures = Vec::new();
    let mut files = Vec::new();
    let (mut as_written, mut rewritten) = (0, 0);
    for case in &cases {
        match check(case, &policy, dir.path()) {
            Ok((Verdict::AsWritten, file)) => {
                as_written += 1;
                eprintln!("ok   {}: fits as written", case.name);
                files.push(file);
            }
            Ok((Verdict::Rewritten(changed), file)) => {
                rewritten += 1;
                eprintln!("ok   {}: {}", case.name, changed.join(", "));
                files.push(file);
            }
            Err(why) => {
                eprintln!("FAIL {}: {why}", case.name);
                failures.push(format!("{}: {why}", case.name));
            }
        }
    }
    eprintln!(
        "corpus: {} entries, {as_written} fit as written, {rewritten} rewritten, {} failed",
        cases.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        as_written > 0 && rewritten > 0,
        "the corpus needs entries that fit as written and entries that need a rewrite"
    );
    if let Some(tool) = memguard_e2e::kubernetes_validate()
        && let Err(out) = memguard_e2e::validate_manifests(&tool, &files)
    {
        panic!("kubernetes-validate rejected a corpus output:\n{out}");
    }
}
