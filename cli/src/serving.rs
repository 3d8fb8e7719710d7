//! The decision on an inference server, as `memguard estimate --serve --server-command` and
//! `memguard explain` show it: the webhook's own ([`memguard_webhook::serving::admit`]), so
//! the three always agree.

use memguard_api::launch::ArgvEdit;
use memguard_webhook::Outcome;
use memguard_webhook::serving::ServerAdmission;
use serde_json::{Value, json};
use std::io::Write;

/// The server's argv after the decision's edits (the pod's own when nothing changes).
pub fn rewritten_argv(command: &[String], args: &[String], s: &ServerAdmission) -> Vec<String> {
    let mut command = command.to_vec();
    let mut args = args.to_vec();
    for edit in &s.edits {
        match edit {
            ArgvEdit::Replace {
                field,
                index,
                value,
            } => {
                let list = match field.name() {
                    "command" => &mut command,
                    _ => &mut args,
                };
                if let Some(slot) = list.get_mut(*index) {
                    slot.clone_from(value);
                }
            }
            ArgvEdit::Append { field, value } => match field.name() {
                "command" => command.push(value.clone()),
                _ => args.push(value.clone()),
            },
        }
    }
    command.into_iter().chain(args).collect()
}

/// The decision as JSON: the estimate annotation's fields, the changes, the argv, the error.
pub fn to_json(s: &ServerAdmission, argv: &[String]) -> Value {
    let mut value: Value = serde_json::from_str(&s.estimate).unwrap_or_else(|_| json!({}));
    value["model"] = json!(s.model);
    value["asWritten"] = json!(s.edits.is_empty());
    value["command"] = json!(argv);
    value["error"] = json!(s.error);
    value["warnings"] = json!(s.warnings);
    value
}

/// The decision for people.
pub fn write_table(
    out: &mut impl Write,
    s: &ServerAdmission,
    argv: &[String],
) -> std::io::Result<()> {
    let f = &s.fit;
    writeln!(
        out,
        "{} serving {} in container {}",
        s.engine.name(),
        s.model,
        s.container
    )?;
    writeln!(
        out,
        "device: {} seen by the process, {} the pod's share ({})",
        s.seen,
        s.share,
        crate::explain::describe_source(&s.source)
    )?;
    writeln!(
        out,
        "{} {}  max length {}",
        s.engine.fraction_flag(),
        memguard_webhook::serving::fraction_text(s.engine, f.fraction.max(0.0)),
        f.max_length
            .map_or("(the model's own, not checked)".to_string(), |n| n
                .to_string())
    )?;
    writeln!(
        out,
        "{:<24} {:>12}",
        "weights per device",
        f.weights.to_string()
    )?;
    writeln!(
        out,
        "{:<24} {:>12}",
        "engine reserve",
        f.reserve.to_string()
    )?;
    writeln!(out, "{:<24} {:>12}", "KV cache", f.kv_cache.to_string())?;
    writeln!(out, "{:<24} {:>12}", "peak", f.peak.to_string())?;
    writeln!(out, "{:<24} {:>12}", "tokens that fit", f.tokens_fit)?;
    if let Some(c) = f.concurrency {
        writeln!(out, "{:<24} {:>12.2}", "sequences at max length", c)?;
    }
    writeln!(out)?;
    match (&s.error, s.edits.is_empty()) {
        (Some(error), _) => writeln!(out, "{error}")?,
        (None, true) => writeln!(out, "fits as written: the command line is left alone")?,
        (None, false) => writeln!(out, "fits after the rewrite")?,
    }
    if !s.edits.is_empty() {
        writeln!(out, "command: {}", shell_join(argv))?;
    }
    for w in &s.warnings {
        writeln!(out, "warning: {w}")?;
    }
    Ok(())
}

fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.=/:,".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The server decision for `pod` under `policy`, if its container launches one: `Ok` with the
/// admission, `Err` with the reason memguard could not read it.
pub fn decide(
    pod: &k8s_openapi::api::core::v1::Pod,
    policy: &memguard_api::Policy,
    profiles: &memguard_webhook::ClusterView,
) -> Option<Result<Box<ServerAdmission>, String>> {
    match memguard_webhook::serving::admit(pod, policy, profiles)? {
        Outcome::Served(s) => Some(Ok(s)),
        Outcome::Skipped { error, .. } => Some(Err(error)),
        other => Some(Err(format!("unexpected outcome {other:?}"))),
    }
}

/// Writes the decision on `pod`'s server as `json` or a table; `None` when it runs no server.
/// `Ok(Ok(fits))`: whether the server fits its share (as written or after the rewrite).
pub fn write(
    out: &mut impl Write,
    json: bool,
    pod: &k8s_openapi::api::core::v1::Pod,
    policy: &memguard_api::Policy,
    profiles: &memguard_webhook::ClusterView,
) -> Option<anyhow::Result<Result<bool, String>>> {
    let decided = decide(pod, policy, profiles)?;
    let s = match decided {
        Ok(s) => s,
        Err(e) => return Some(Ok(Err(e))),
    };
    let c = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.containers.get(s.container_index));
    let command = c.and_then(|c| c.command.clone()).unwrap_or_default();
    let args = c.and_then(|c| c.args.clone()).unwrap_or_default();
    let argv = rewritten_argv(&command, &args, &s);
    let written = if json {
        serde_json::to_writer_pretty(&mut *out, &to_json(&s, &argv))
            .map_err(anyhow::Error::from)
            .and_then(|()| writeln!(out).map_err(anyhow::Error::from))
    } else {
        write_table(out, &s, &argv).map_err(anyhow::Error::from)
    };
    let fits = s.error.is_none();
    Some(written.map(|()| Ok(fits)))
}
