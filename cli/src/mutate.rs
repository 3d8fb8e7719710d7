//! `memguard mutate`: the webhook's mutation, applied to manifests on disk.
//!
//! Same code path as the server ([`memguard_webhook::manifest`] → `mutate` → `patch::build`).
//! Reads one or more YAML (or JSON) documents, from a file or stdin, and prints every document
//! back, in order, with its pods (Pods, and workloads' pod templates carrying the opt-in label)
//! mutated, or the JSON patch of each document. ConfigMaps, Nodes and every other object are
//! printed as they were read, so the output can go to `kubectl apply` or to `memguard mutate`
//! again, which then decides the same and changes nothing.

use crate::input::Input;
use anyhow::Context;
use memguard_webhook::Outcome;
use memguard_webhook::manifest::{Mutated, mutate_document};
use memguard_webhook::policy_sources::{Overrides, policy_from_str};
use serde_json::Value;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Flags of `memguard mutate`.
#[derive(clap::Args)]
pub struct Args {
    /// Manifest to mutate (`-` for stdin); may hold several YAML documents.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    pub file: PathBuf,

    /// `yaml` (every document, in order, the workloads mutated), `json` (the same as one value: the
    /// document, or a `kind: List` of them all), or `patch` (the RFC 6902 patch of each document).
    #[arg(short, long, value_enum, default_value_t = Output::Yaml)]
    pub output: Output,

    /// Policy document (YAML or JSON `PolicySpec`), as given to the webhook.
    #[arg(long, value_name = "FILE")]
    pub policy_file: Option<PathBuf>,

    /// Fraction of device memory a plan may use; overrides the policy file.
    #[arg(long)]
    pub safety_ratio: Option<f64>,

    /// GPU memory when no product is known, a number and a unit (e.g. `80Gi`); overrides the
    /// policy file.
    #[arg(long)]
    pub default_gpu_memory: Option<String>,

    /// Sidecar image; overrides the policy file.
    #[arg(long)]
    pub sidecar_image: Option<String>,

    /// `native` or `classic`; overrides the policy file.
    #[arg(long, value_parser = parse_mode)]
    pub sidecar_mode: Option<memguard_api::policy::SidecarMode>,

    /// A `MemoryProfile` (YAML or JSON, e.g. `kubectl get memoryprofile NAME -o yaml`) to apply
    /// as the webhook would from its watch cache: its correction factor and pending recovery
    /// apply to pods with the same key. Repeat for several; a file may hold several documents.
    #[arg(long = "profile", value_name = "FILE")]
    pub profiles: Vec<PathBuf>,

    /// DRA objects (`resource.k8s.io/v1` ResourceClaimTemplate, ResourceClaim, DeviceClass,
    /// ResourceSlice; e.g. `kubectl get resourceclaimtemplates,deviceclasses,resourceslices
    /// -A -o yaml` split into documents) read as the webhook reads its watch caches: a pod's
    /// claims get their device's memory. Repeat for several files.
    #[arg(long = "dra", value_name = "FILE")]
    pub dra: Vec<PathBuf>,
}

/// Every DRA object in `paths`; `None` without any (claims then get a warning, as in a
/// webhook without its DRA caches).
pub(crate) fn read_dra(
    paths: &[PathBuf],
) -> Result<Option<std::sync::Arc<memguard_webhook::dra::StaticCatalog>>, String> {
    if paths.is_empty() {
        return Ok(None);
    }
    let mut catalog = memguard_webhook::dra::StaticCatalog::default();
    for path in paths {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let more = memguard_webhook::dra::StaticCatalog::from_yaml(&text)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        catalog.claims.extend(more.claims);
        catalog.templates.extend(more.templates);
        catalog.classes.extend(more.classes);
        catalog.slices.extend(more.slices);
    }
    Ok(Some(std::sync::Arc::new(catalog)))
}

/// Reads every `MemoryProfile` in `paths`.
fn read_profiles(paths: &[PathBuf]) -> Result<memguard_webhook::ClusterView, String> {
    let mut profiles = memguard_webhook::ClusterView::default();
    for path in paths {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .map_err(|e| format!("{}: not valid YAML: {e}", path.display()))?;
        for doc in docs.into_iter().filter(|d| !d.is_null()) {
            let profile: memguard_api::crd::MemoryProfile = serde_json::from_value(doc)
                .map_err(|e| format!("{}: not a MemoryProfile: {e}", path.display()))?;
            profiles.insert(profile);
        }
    }
    Ok(profiles)
}

/// Output format.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Every document, the workloads mutated, as YAML (`---` between documents).
    Yaml,
    /// Every document, the workloads mutated, as one JSON value: the document when the input
    /// holds one, else a `kind: List` of them all (a List's items in its place).
    Json,
    /// The JSON patch of each document, one per line (`[]` for one left as it is).
    Patch,
}

fn parse_mode(s: &str) -> Result<memguard_api::policy::SidecarMode, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "native" => Ok(memguard_api::policy::SidecarMode::Native),
        "classic" => Ok(memguard_api::policy::SidecarMode::Classic),
        other => Err(format!("`{other}` is not `native` or `classic`")),
    }
}

/// Bad input: reported, exit code 2.
fn bad_input(message: impl std::fmt::Display) -> anyhow::Result<ExitCode> {
    eprintln!("error: {message}");
    Ok(ExitCode::from(super::EXIT_BAD_INPUT))
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let policy_text = match &args.policy_file {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => Some(text),
            Err(e) => return bad_input(format!("reading {}: {e}", path.display())),
        },
        None => None,
    };
    let overrides = Overrides {
        safety_ratio: args.safety_ratio,
        default_gpu_memory: args.default_gpu_memory.clone(),
        sidecar_image: args.sidecar_image.clone(),
        sidecar_mode: args.sidecar_mode,
    };
    let policy = match policy_from_str(policy_text.as_deref(), &overrides) {
        Ok(p) => p,
        Err(errors) => return bad_input(format!("invalid policy: {}", errors.join("; "))),
    };
    for note in policy.models.notes() {
        eprintln!("note: {note}");
    }

    let input = match crate::input::read(&args.file) {
        Ok(input) => input,
        Err(e) => return bad_input(e),
    };
    let source = input.source.clone();
    if input.documents.is_empty() {
        return bad_input(format!("{source}: no documents to mutate"));
    }
    let profiles = match (read_profiles(&args.profiles), read_dra(&args.dra)) {
        (Ok(p), Ok(Some(dra))) => p.with_dra(dra),
        (Ok(p), Ok(None)) => p,
        (Err(e), _) | (_, Err(e)) => return bad_input(e),
    };
    let profiles = input.cluster_view(profiles);
    let mut results: Vec<Mutated> = Vec::with_capacity(input.documents.len());
    for doc in &input.documents {
        match mutate_document(&doc.value, &policy, &profiles) {
            Ok(m) => results.push(m),
            Err(e) => return bad_input(format!("{source}: {}: {e}", doc.place)),
        }
    }
    let places: Vec<&str> = input.documents.iter().map(|d| d.place.as_str()).collect();

    let skipped = report(&results, &places);
    let mut out = std::io::stdout().lock();
    write_output(&mut out, args.output, &input, &results)?;
    out.flush()?;
    // Like the webhook, a pod with bad annotations is still written out (with memguard.io/error);
    // the exit code tells scripts the input needs fixing.
    Ok(if skipped {
        ExitCode::from(super::EXIT_BAD_INPUT)
    } else {
        ExitCode::SUCCESS
    })
}

/// Each pod's warnings, and why a pod was skipped or left alone, on stderr; whether any was
/// skipped.
fn report(results: &[Mutated], places: &[&str]) -> bool {
    let mut skipped = false;
    for (m, place) in results.iter().zip(places) {
        if m.pods.is_empty() {
            eprintln!("{place}: not mutated: {}", not_opted_in(&m.document));
        }
        for pod in &m.pods {
            let at = if pod.path.is_empty() {
                place.to_string()
            } else {
                format!("{place} {}", pod.path)
            };
            match &pod.outcome {
                Outcome::Skipped { error, .. } => {
                    skipped = true;
                    eprintln!("{at}: skipped: {error}");
                }
                Outcome::Mutated(mutation) => {
                    for warning in &mutation.warnings {
                        eprintln!("{at}: warning: {warning}");
                    }
                }
                Outcome::Guarded(guarded) => {
                    for warning in &guarded.warnings {
                        eprintln!("{at}: warning: {warning}");
                    }
                }
                Outcome::Served(server) => {
                    for warning in &server.warnings {
                        eprintln!("{at}: warning: {warning}");
                    }
                    if let Some(error) = &server.error {
                        eprintln!("{at}: {error}");
                    }
                }
                Outcome::Unchanged => {
                    let labels = pod_labels(&m.document, &pod.path);
                    eprintln!("{at}: not mutated: {}", why_not_opted_in(labels.as_ref()));
                }
            }
        }
    }

    skipped
}

/// The labels of the pod (or pod template) at `path` in `document`.
fn pod_labels(document: &Value, path: &str) -> Option<Value> {
    document.pointer(path)?.pointer("/metadata/labels").cloned()
}

/// Why a document holds no pod memguard would mutate.
fn not_opted_in(document: &Value) -> String {
    match document.get("kind").and_then(Value::as_str) {
        Some("Pod") => why_not_opted_in(document.pointer("/metadata/labels")),
        Some(kind) => format!(
            "a {kind} with no pod template labelled {}={:?}",
            memguard_api::wellknown::ENABLED_LABEL,
            memguard_api::wellknown::ENABLED_VALUE
        ),
        None => "not a Kubernetes object (no kind)".to_string(),
    }
}

/// Why a pod with these labels is not opted in: the label is missing, or its value is not
/// exactly `"true"` (the webhook's object selector matches that value only).
fn why_not_opted_in(labels: Option<&Value>) -> String {
    let label = memguard_api::wellknown::ENABLED_LABEL;
    let want = memguard_api::wellknown::ENABLED_VALUE;
    match labels.and_then(|l| l.get(label)) {
        None => format!("no label {label}={want:?} (memguard acts on opted-in pods only)"),
        Some(Value::String(v)) if v == want => {
            "opted in, but memguard had nothing to change".to_string()
        }
        Some(v) => format!(
            "label {label} is {v}, not {want:?}: the webhook's selector matches exactly {want:?}"
        ),
    }
}

/// Every document of the input, in order, with the mutated objects in place: a List stays one
/// document, its items mutated where they are.
fn output_documents(input: &Input, results: &[Mutated]) -> Vec<Value> {
    let mut documents = input.originals.clone();
    for (doc, m) in input.documents.iter().zip(results) {
        let target = match doc.item {
            None => documents.get_mut(doc.document),
            Some(item) => documents
                .get_mut(doc.document)
                .and_then(|list| list.get_mut("items"))
                .and_then(|items| items.get_mut(item)),
        };
        if let Some(target) = target {
            target.clone_from(&m.document);
        }
    }
    documents
}

/// The JSON patch of each document of the input, in order: `[]` for a document memguard does
/// not change (a ConfigMap, a Node, a Service), and for a List its items' patches with their
/// paths under `/items/N`.
fn output_patches(input: &Input, results: &[Mutated]) -> anyhow::Result<Vec<Value>> {
    let mut patches = vec![Vec::new(); input.originals.len()];
    for (doc, m) in input.documents.iter().zip(results) {
        let prefix = doc.item.map(|i| format!("/items/{i}")).unwrap_or_default();
        let Value::Array(ops) = serde_json::to_value(&m.patch)? else {
            anyhow::bail!("a JSON patch that is not a list");
        };
        for mut op in ops {
            if let Some(Value::String(path)) = op.get_mut("path") {
                path.insert_str(0, &prefix);
            }
            if let Some(Value::String(from)) = op.get_mut("from") {
                from.insert_str(0, &prefix);
            }
            if let Some(patch) = patches.get_mut(doc.document) {
                patch.push(op);
            }
        }
    }
    Ok(patches.into_iter().map(Value::Array).collect())
}

/// The documents, or their patches, on `out`. YAML: every document, `---` between them. JSON:
/// one value, the document when the input holds one, else a `v1` `List` of them all (a List in
/// the input gives its items: Lists do not nest), as `kubectl get -o json` prints several
/// objects. Patch: one line per document.
fn write_output(
    out: &mut impl Write,
    output: Output,
    input: &Input,
    results: &[Mutated],
) -> anyhow::Result<()> {
    match output {
        Output::Yaml => {
            let docs = output_documents(input, results);
            let yaml = if docs.len() == 1 {
                serde_saphyr::to_string(&docs[0])
            } else {
                serde_saphyr::to_string_multiple(&docs)
            }
            .context("writing YAML")?;
            out.write_all(yaml.as_bytes())?;
        }
        Output::Json => {
            let mut docs = output_documents(input, results);
            let value = if docs.len() == 1 {
                docs.remove(0)
            } else {
                let mut items = Vec::new();
                for doc in docs {
                    match doc {
                        Value::Object(mut list) if crate::input::is_list(&list) => {
                            if let Some(Value::Array(listed)) = list.remove("items") {
                                items.extend(listed);
                            }
                        }
                        doc => items.push(doc),
                    }
                }
                serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items})
            };
            writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        }
        Output::Patch => {
            for patch in output_patches(input, results)? {
                writeln!(out, "{}", serde_json::to_string(&patch)?)?;
            }
        }
    }
    Ok(())
}
