//! How many devices a multi-pod job spans, read from what every pod of the job carries alike:
//! the launcher's own options (`torchrun --nnodes 2 --nproc_per_node 8`, `accelerate launch
//! --num_processes 16`, `deepspeed --num_nodes 2 --num_gpus 8`), else the variables the
//! Kubeflow training operator gives every pod of a PyTorchJob (`PET_NNODES`,
//! `PET_NPROC_PER_NODE`). Rank-specific values (`RANK`, `PET_NODE_RANK`,
//! `JOB_COMPLETION_INDEX`) are never read, so every pod of a job reads the same world size.
//!
//! The operator's `WORLD_SIZE` is not read: training-operator v1.9.0 sets it to replicas ×
//! `nprocPerNode`, counting 1 process per pod when `nprocPerNode` is unset or `auto`, and older
//! releases to the number of pods: neither is the number of devices.

use crate::launch::{Launch, Launcher};
use k8s_openapi::api::core::v1::Container;

/// ms-swift's and LLaMA-Factory's processes per node: set, they run under torchrun.
pub const NPROC_PER_NODE: &str = "NPROC_PER_NODE";
/// ms-swift's and LLaMA-Factory's node count, with [`NPROC_PER_NODE`].
pub const NNODES: &str = "NNODES";
/// The trainer commands that read [`NPROC_PER_NODE`].
const TORCHRUN_CLIS: &[&str] = &["swift", "llamafactory-cli", "lmf"];

/// Kubeflow training operator: the number of nodes (pods), `2` or `1:4` (elastic).
pub const PET_NNODES: &str = "PET_NNODES";
/// Kubeflow training operator: processes per node (`8`, `auto`, `gpu`).
pub const PET_NPROC_PER_NODE: &str = "PET_NPROC_PER_NODE";

/// The job's world size and where it was read (`args`, `env:PET_NNODES`), when the launch or
/// the operator's variables say more than the pod's own `gpus`.
pub fn read(launch: Option<&Launch>, trainer: &Container, gpus: u64) -> Option<(u64, String)> {
    let per_node = |v: Option<String>| match v.as_deref().map(str::trim) {
        Some(n) => n.parse::<u64>().ok().filter(|n| *n > 0).unwrap_or(gpus),
        None => gpus,
    };
    if let Some(launch) = launch {
        let option = |name: &str| launcher_option(launch, name);
        let from_args = match launch.launcher {
            Launcher::Torchrun => {
                nodes(option("nnodes")).map(|n| n * per_node(option("nproc_per_node")))
            }
            Launcher::Accelerate => option("num_processes")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|n| *n > 0),
            Launcher::Deepspeed => {
                nodes(option("num_nodes")).map(|n| n * per_node(option("num_gpus")))
            }
            Launcher::Python | Launcher::Direct => None,
        };
        if let Some(n) = from_args {
            return Some((n, "args".into()));
        }
    }
    let env = |name: &str| {
        trainer
            .env
            .iter()
            .flatten()
            .rev()
            .find(|e| e.name == name && e.value_from.is_none())
            .and_then(|e| e.value.clone())
    };
    // ms-swift and LLaMA-Factory start torchrun themselves when `NPROC_PER_NODE` is set
    // (`swift/cli/main.py`, `llamafactory/cli.py`), over `NNODES` nodes: from the command's own
    // `VAR=value` prefix, else the container's env.
    if let Some(launch) = launch.filter(|l| TORCHRUN_CLIS.contains(&l.program.name())) {
        let prefixed = |name: &str| {
            launch
                .env
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let var = |name: &str| match prefixed(name) {
            Some(v) => v.map(|v| (v, "args".to_string())),
            None => env(name).map(|v| (v, format!("env:{name}"))),
        };
        if let Some((nproc, source)) = var(NPROC_PER_NODE)
            && let Ok(nproc) = nproc.trim().parse::<u64>()
            && nproc > 0
        {
            let nodes = nodes(var(NNODES).map(|(v, _)| v)).unwrap_or(1);
            return Some((nproc * nodes, source));
        }
    }
    nodes(env(PET_NNODES)).map(|n| {
        (
            n * per_node(env(PET_NPROC_PER_NODE)),
            format!("env:{PET_NNODES}"),
        )
    })
}

/// A node count: `2`, or `min:max` (elastic) read as its minimum, the fewest devices the job
/// runs on (the most each holds when sharded).
fn nodes(value: Option<String>) -> Option<u64> {
    let value = value?;
    let min = value.split(':').next()?.trim();
    min.parse::<u64>().ok().filter(|n| *n > 0)
}

/// A launcher option's value (dash or underscore spelling, last wins).
pub(crate) fn launcher_option(launch: &Launch, name: &str) -> Option<String> {
    let canonical = |s: &str| s.trim_start_matches('-').replace('-', "_");
    launch
        .launcher_options
        .iter()
        .rev()
        .find(|(k, _)| canonical(k) == name)
        .and_then(|(_, v)| v.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::EnvVar;

    fn launch(words: &[&str]) -> Launch {
        let items: Vec<String> = words.iter().map(|s| s.to_string()).collect();
        crate::launch::find(&items).expect("a launch")
    }

    fn trainer(env: &[(&str, &str)]) -> Container {
        Container {
            name: "t".into(),
            env: Some(
                env.iter()
                    .map(|(k, v)| EnvVar {
                        name: k.to_string(),
                        value: Some(v.to_string()),
                        value_from: None,
                    })
                    .collect(),
            ),
            ..Container::default()
        }
    }

    #[test]
    fn launchers_say_the_jobs_devices() {
        let none = trainer(&[]);
        let cases: &[(&[&str], Option<u64>)] = &[
            (
                &["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "t.py"],
                Some(16),
            ),
            (
                &["torchrun", "--nnodes=2", "--nproc-per-node=gpu", "t.py"],
                Some(8),
            ),
            // Elastic: the fewest nodes it runs on.
            (
                &[
                    "torchrun",
                    "--nnodes",
                    "2:4",
                    "--nproc_per_node",
                    "8",
                    "t.py",
                ],
                Some(16),
            ),
            (
                &[
                    "accelerate",
                    "launch",
                    "--num_machines",
                    "2",
                    "--num_processes",
                    "16",
                    "t.py",
                ],
                Some(16),
            ),
            (
                &["deepspeed", "--num_nodes", "3", "--num_gpus", "8", "t.py"],
                Some(24),
            ),
            // A value the shell gives (`$NNODES`) says nothing.
            (&["torchrun", "--nnodes", "$NNODES", "t.py"], None),
            (&["python", "t.py"], None),
        ];
        for (words, want) in cases {
            assert_eq!(
                read(Some(&launch(words)), &none, 4).map(|(n, _)| n),
                *want,
                "{words:?}"
            );
        }
    }

    /// The training operator's variables, the same in every pod; `WORLD_SIZE` and ranks are
    /// not read.
    #[test]
    fn the_operators_variables_say_the_jobs_devices() {
        let pod =
            |env: &[(&str, &str)]| read(Some(&launch(&["torchrun", "t.py"])), &trainer(env), 8);
        assert_eq!(
            pod(&[
                ("PET_NNODES", "3"),
                ("PET_NPROC_PER_NODE", "8"),
                ("WORLD_SIZE", "24")
            ]),
            Some((24, "env:PET_NNODES".into()))
        );
        // `auto`: the pod's GPUs per node.
        assert_eq!(
            pod(&[("PET_NNODES", "3"), ("PET_NPROC_PER_NODE", "auto")]).map(|(n, _)| n),
            Some(24)
        );
        assert_eq!(pod(&[("WORLD_SIZE", "3"), ("RANK", "1")]), None);
        // The launcher's own options win over the variables.
        let both = read(
            Some(&launch(&[
                "torchrun",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "8",
                "t.py",
            ])),
            &trainer(&[("PET_NNODES", "3")]),
            8,
        );
        assert_eq!(both, Some((16, "args".into())));
    }
}
