//! A file the trainer's launch names (`axolotl train /config/train.yaml`, `--deepspeed
//! ds.json`), found where the pod mounts it from: the container's volume mount, then the
//! ConfigMap (or projected ConfigMap) behind it, then the key. Lookups go through
//! [`ConfigMaps`]; no I/O here.

use crate::cluster::ConfigMaps;
use k8s_openapi::api::core::v1::{Container, KeyToPath, Pod, Volume, VolumeMount};
use std::path::{Component, Path, PathBuf};

/// A file read from a ConfigMap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountedFile {
    /// Its text.
    pub text: String,
    /// Where it came from, `configmap:<name>/<key>`.
    pub source: String,
}

/// Why a file could not be read from the pod's ConfigMaps.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotMounted {
    /// A relative path and no `workingDir`: the image's working directory is not known.
    #[error("`{0}` is relative and the container sets no workingDir")]
    Relative(String),
    /// No volume mount holds the path: the file is in the image (or written at run time).
    #[error("`{0}` is not in a volume mount (baked into the image?)")]
    NotInAMount(String),
    /// The path is in a mount whose volume is not a ConfigMap.
    #[error("`{path}` is in volume `{volume}`, which is not a ConfigMap")]
    NotAConfigMap {
        /// The path.
        path: String,
        /// The volume's name.
        volume: String,
    },
    /// The ConfigMap volume does not project the path.
    #[error("ConfigMap `{config_map}` has no item for `{path}`")]
    NoItem {
        /// The path.
        path: String,
        /// The ConfigMap's name.
        config_map: String,
    },
    /// No ConfigMap lookup, or the ConfigMap is not known to it.
    #[error("ConfigMap `{namespace}/{name}` is not known{}", if *.no_lookup { " (no ConfigMaps are read)" } else { "" })]
    Unknown {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// There was no lookup at all.
        no_lookup: bool,
    },
    /// The ConfigMap has no such key.
    #[error("ConfigMap `{name}` has no key `{key}`")]
    NoKey {
        /// The ConfigMap's name.
        name: String,
        /// The key.
        key: String,
    },
}

/// Reads `path` as `container` of `pod` sees it, from the ConfigMaps in `maps`.
pub fn read(
    pod: &Pod,
    container: &Container,
    path: &str,
    maps: Option<&dyn ConfigMaps>,
) -> Result<MountedFile, NotMounted> {
    let full = absolute(container, path)?;
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    // The deepest mount that holds the path wins, as in the container's mount table.
    let (mount, rest) = mounts
        .iter()
        .filter_map(|m| {
            let at = normal(Path::new(&m.mount_path));
            full.strip_prefix(&at)
                .ok()
                .map(|rest| (m, rest.to_path_buf()))
        })
        .max_by_key(|(m, _)| normal(Path::new(&m.mount_path)).components().count())
        .ok_or_else(|| NotMounted::NotInAMount(path.to_string()))?;
    let volume = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .and_then(|vs| vs.iter().find(|v| v.name == mount.name))
        .ok_or_else(|| NotMounted::NotInAMount(path.to_string()))?;
    let (name, items) = config_map_of(volume, path)?;
    let key = key_for(mount, &rest, items).ok_or_else(|| NotMounted::NoItem {
        path: path.to_string(),
        config_map: name.clone(),
    })?;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let unknown = |no_lookup| NotMounted::Unknown {
        namespace: namespace.to_string(),
        name: name.clone(),
        no_lookup,
    };
    let data = maps
        .ok_or_else(|| unknown(true))?
        .data(namespace, &name)
        .ok_or_else(|| unknown(false))?;
    let text = data.get(&key).cloned().ok_or_else(|| NotMounted::NoKey {
        name: name.clone(),
        key: key.clone(),
    })?;
    Ok(MountedFile {
        text,
        source: format!("configmap:{name}/{key}"),
    })
}

/// `path` made absolute against the container's `workingDir`, `.` and `..` resolved.
fn absolute(container: &Container, path: &str) -> Result<PathBuf, NotMounted> {
    let p = Path::new(path);
    if p.is_absolute() {
        return Ok(normal(p));
    }
    match container.working_dir.as_deref() {
        Some(dir) if Path::new(dir).is_absolute() => Ok(normal(&Path::new(dir).join(p))),
        _ => Err(NotMounted::Relative(path.to_string())),
    }
}

/// `p` with `.` dropped and `..` applied (no file system: symlinks are not followed).
fn normal(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The ConfigMap behind `volume` and its items (a projected volume: its first ConfigMap source).
fn config_map_of<'v>(
    volume: &'v Volume,
    path: &str,
) -> Result<(String, Option<&'v [KeyToPath]>), NotMounted> {
    if let Some(cm) = &volume.config_map {
        return Ok((cm.name.clone(), cm.items.as_deref()));
    }
    let projected = volume
        .projected
        .as_ref()
        .and_then(|p| p.sources.as_ref())
        .and_then(|s| s.iter().find_map(|s| s.config_map.as_ref()));
    match projected {
        Some(cm) => Ok((cm.name.clone(), cm.items.as_deref())),
        None => Err(NotMounted::NotAConfigMap {
            path: path.to_string(),
            volume: volume.name.clone(),
        }),
    }
}

/// The ConfigMap key the file at `rest` (below the mount) comes from: with `subPath` the mount is
/// the one file `subPath` names; with `items`, the item whose path it is; else the key is the
/// file name.
fn key_for(mount: &VolumeMount, rest: &Path, items: Option<&[KeyToPath]>) -> Option<String> {
    let within = match mount.sub_path.as_deref().filter(|s| !s.is_empty()) {
        Some(sub) if rest.as_os_str().is_empty() => normal(Path::new(sub)),
        Some(sub) => normal(&Path::new(sub).join(rest)),
        None => normal(rest),
    };
    let within = within.strip_prefix("/").ok()?.to_str()?.to_string();
    match items {
        Some(items) => items
            .iter()
            .find(|i| normal(Path::new(&i.path)).strip_prefix("/").ok() == Some(Path::new(&within)))
            .map(|i| i.key.clone()),
        None => (!within.is_empty() && !within.contains('/')).then_some(within),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ConfigMapList;
    use std::collections::BTreeMap;

    fn pod(
        mounts: serde_json::Value,
        volumes: serde_json::Value,
        working_dir: Option<&str>,
    ) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "t", "namespace": "ml"},
            "spec": {
                "containers": [{"name": "trainer", "image": "x", "workingDir": working_dir,
                                "volumeMounts": mounts}],
                "volumes": volumes,
            }
        }))
        .expect("a pod")
    }

    fn maps() -> ConfigMapList {
        let data = BTreeMap::from([
            (
                "train.yaml".to_string(),
                "micro_batch_size: 2\n".to_string(),
            ),
            ("ds.json".to_string(), "{}".to_string()),
        ]);
        ConfigMapList(BTreeMap::from([(("ml".into(), "axolotl".into()), data)]))
    }

    fn read_in(p: &Pod, path: &str, m: Option<&dyn ConfigMaps>) -> Result<MountedFile, NotMounted> {
        let c = &p.spec.as_ref().expect("spec").containers[0];
        read(p, c, path, m)
    }

    #[test]
    fn a_file_in_a_config_map_mount_is_read_with_its_source() {
        let p = pod(
            serde_json::json!([{"name": "cfg", "mountPath": "/config"}]),
            serde_json::json!([{"name": "cfg", "configMap": {"name": "axolotl"}}]),
            None,
        );
        let m = maps();
        let got = read_in(&p, "/config/./train.yaml", Some(&m)).expect("read");
        assert_eq!(got.text, "micro_batch_size: 2\n");
        assert_eq!(got.source, "configmap:axolotl/train.yaml");
        // Relative to the working directory, through `..`.
        let p = pod(
            serde_json::json!([{"name": "cfg", "mountPath": "/config"}]),
            serde_json::json!([{"name": "cfg", "configMap": {"name": "axolotl"}}]),
            Some("/workspace"),
        );
        let got = read_in(&p, "../config/ds.json", Some(&m)).expect("read");
        assert_eq!(got.source, "configmap:axolotl/ds.json");
    }

    #[test]
    fn items_and_sub_paths_map_paths_to_keys() {
        let items = serde_json::json!([{"name": "cfg", "configMap": {"name": "axolotl",
            "items": [{"key": "train.yaml", "path": "recipes/lora.yml"}]}}]);
        let p = pod(
            serde_json::json!([{"name": "cfg", "mountPath": "/etc/ax"}]),
            items,
            None,
        );
        let m = maps();
        assert_eq!(
            read_in(&p, "/etc/ax/recipes/lora.yml", Some(&m)).map(|f| f.source),
            Ok("configmap:axolotl/train.yaml".to_string())
        );
        assert!(matches!(
            read_in(&p, "/etc/ax/train.yaml", Some(&m)),
            Err(NotMounted::NoItem { .. })
        ));
        let sub = pod(
            serde_json::json!([{"name": "cfg", "mountPath": "/app/train.yaml", "subPath": "train.yaml"}]),
            serde_json::json!([{"name": "cfg", "projected": {"sources": [{"configMap": {"name": "axolotl"}}]}}]),
            None,
        );
        assert_eq!(
            read_in(&sub, "/app/train.yaml", Some(&m)).map(|f| f.text),
            Ok("micro_batch_size: 2\n".to_string())
        );
    }

    #[test]
    fn what_cannot_be_read_says_why() {
        let p = pod(
            serde_json::json!([{"name": "cfg", "mountPath": "/config"},
                               {"name": "scratch", "mountPath": "/scratch"}]),
            serde_json::json!([{"name": "cfg", "configMap": {"name": "axolotl"}},
                               {"name": "scratch", "emptyDir": {}}]),
            None,
        );
        let m = maps();
        let cases: [(&str, Option<&dyn ConfigMaps>, &str); 6] = [
            ("train.yaml", Some(&m), "relative"),
            ("/app/train.yaml", Some(&m), "not in a volume mount"),
            ("/scratch/train.yaml", Some(&m), "not a ConfigMap"),
            ("/config/other.yaml", Some(&m), "has no key `other.yaml`"),
            ("/config/train.yaml", None, "no ConfigMaps are read"),
            (
                "/config/train.yaml",
                Some(&ConfigMapList::default()),
                "`ml/axolotl` is not known",
            ),
        ];
        for (path, lookup, says) in cases {
            let why = read_in(&p, path, lookup).expect_err(path).to_string();
            assert!(why.contains(says), "{path}: {why}");
        }
    }
}
