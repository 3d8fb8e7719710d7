//! The host figure of `memguard estimate`: what one pod's memory cgroup (`limits.memory`) must
//! hold beside its GPUs, from the training flags and a few host flags.

use memguard_decide::host::training_host_config;
use memguard_estimator::{
    Device, HostConfig, HostEstimate, Method, SaveMode, TrainingConfig, host_estimate,
};
use serde_json::{Value, json};

/// The host flags of `memguard estimate`. Each one left out that matters is a default, said
/// under the host figure (`host_defaults` in JSON).
#[derive(clap::Args, Debug, Default)]
pub struct HostArgs {
    /// Ranks (GPUs) in one pod: they load, feed and save on the pod's one host. Default: the
    /// GPUs --gpu-resource asks for, else the world size (the whole job in one pod).
    #[arg(long, value_name = "N", help_heading = "Host memory (per pod)")]
    gpus_per_pod: Option<u32>,
    /// Storage dtype of the checkpoint's files: fp32|bf16|fp16. Default bf16 (as published
    /// checkpoints are).
    #[arg(long, value_name = "DTYPE", help_heading = "Host memory (per pod)")]
    checkpoint_dtype: Option<String>,
    /// The dtype `from_pretrained` loads in: auto|fp32|bf16|fp16. Default auto (transformers
    /// 5: the checkpoint's own dtype).
    #[arg(long, value_name = "DTYPE", help_heading = "Host memory (per pod)")]
    load_dtype: Option<String>,
    /// FSDP's `cpu_ram_efficient_loading`: true|false. Counted as admission counts it: under
    /// transformers 5.23 every rank still loads the weights whatever it says (measured), so
    /// `true` changes nothing and is said inert (`inert:transformers-5`). Default false.
    #[arg(long, value_name = "BOOL", help_heading = "Host memory (per pod)")]
    ram_efficient_loading: Option<bool>,
    /// DataLoader workers per rank (`num_workers`). Default 0.
    #[arg(long, value_name = "N", help_heading = "Host memory (per pod)")]
    dataloader_workers: Option<u32>,
    /// Batches each DataLoader worker prepares ahead (`prefetch_factor`). Default 2.
    #[arg(long, value_name = "N", help_heading = "Host memory (per pod)")]
    prefetch_factor: Option<u32>,
    /// The DataLoader pins its batches (`pin_memory`): true|false. Default false.
    #[arg(long, value_name = "BOOL", help_heading = "Host memory (per pod)")]
    pin_memory: Option<bool>,
    /// How checkpoints are saved: none|full|full-with-optimizer|sharded. Default full (the
    /// model's state dict gathered on one rank), none for adapters (LoRA checkpoints are small).
    #[arg(long, value_name = "MODE", help_heading = "Host memory (per pod)")]
    save: Option<String>,
}

/// Bytes per parameter of a dtype's spelling.
fn dtype_bytes(flag: &str, value: &str) -> Result<f64, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "fp32" | "float32" => Ok(4.0),
        "bf16" | "bfloat16" | "fp16" | "float16" => Ok(2.0),
        other => Err(format!(
            "--{flag}: unknown dtype `{other}` (expected one of: fp32 bf16 fp16)"
        )),
    }
}

/// Whether the job trains on GPUs: only then is there a host figure beside a GPU figure (on a
/// CPU or unified-memory device the estimate itself is the host's).
pub fn applies(cfg: &TrainingConfig) -> bool {
    matches!(cfg.device, Device::Cuda | Device::Rocm)
}

/// The GPUs one pod asks for, from `--gpu-resource NAME=QTY` flags whose resource is a whole
/// GPU (`nvidia.com/gpu`, `amd.com/gpu`): each is a rank under torchrun.
pub fn pod_gpus(gpu_resources: &[String]) -> Option<u32> {
    gpu_resources
        .iter()
        .filter_map(|r| {
            let (name, qty) = r.split_once('=').unwrap_or((r, "1"));
            name.trim()
                .ends_with("/gpu")
                .then(|| qty.trim().parse::<u32>().ok())
                .flatten()
        })
        .max()
}

/// The pod's host configuration from the training config, the GPUs the pod asks for and the
/// host flags, with a note for each flag left to its default.
pub fn host_config(
    cfg: &TrainingConfig,
    pod_gpus: Option<u32>,
    args: &HostArgs,
) -> Result<(HostConfig, Vec<String>), String> {
    let mut notes = Vec::new();
    let mut note = |flag: &str, default: String| {
        notes.push(format!("--{flag} not given: {default} assumed"));
    };
    let world = u32::try_from(cfg.world_size.max(1)).unwrap_or(u32::MAX);
    let ranks = match (args.gpus_per_pod, pod_gpus) {
        (Some(0), _) => return Err("--gpus-per-pod: must be at least 1".into()),
        (Some(n), _) => n,
        (None, Some(n)) if n > 0 => {
            note(
                "gpus-per-pod",
                format!("{n} rank(s), the GPUs --gpu-resource asks for"),
            );
            n
        }
        _ => {
            note("gpus-per-pod", format!("{world} rank(s) in one pod"));
            world
        }
    };
    let checkpoint = match &args.checkpoint_dtype {
        Some(d) => dtype_bytes("checkpoint-dtype", d)?,
        None => {
            note("checkpoint-dtype", "bf16 checkpoint files".into());
            2.0
        }
    };
    let load = match args.load_dtype.as_deref().map(str::trim) {
        Some(d) if d.eq_ignore_ascii_case("auto") => None,
        Some(d) => Some(dtype_bytes("load-dtype", d)?),
        None => {
            note("load-dtype", "auto (the checkpoint's dtype)".into());
            None
        }
    };
    let adapter = cfg.method != Method::Full;
    let save = match &args.save {
        Some(s) => SaveMode::parse(s).ok_or_else(|| {
            format!(
                "--save: unknown mode `{s}` (expected one of: {})",
                SaveMode::ALL.map(SaveMode::name).join(" ")
            )
        })?,
        None if adapter => {
            note("save", "none (an adapter's checkpoint is small)".into());
            SaveMode::None
        }
        None => {
            note("save", "full (the model's state dict on one rank)".into());
            SaveMode::ModelOnlyFull
        }
    };
    let workers = args.dataloader_workers.unwrap_or_else(|| {
        note("dataloader-workers", "0 workers".into());
        0
    });
    let prefetch = match args.prefetch_factor {
        Some(0) => return Err("--prefetch-factor: must be at least 1".into()),
        Some(n) => n,
        None => 2,
    };
    // The model, its state, one micro-batch and the offload, as the webhook reads them.
    let mut host = training_host_config(cfg, ranks);
    host.world_size = world.max(ranks);
    host.checkpoint_bytes_per_param = checkpoint;
    host.load_bytes_per_param = load;
    let ram_efficient = memguard_api::coupled::ram_efficient_loading(
        args.ram_efficient_loading.unwrap_or(false),
        "--ram-efficient-loading",
    );
    if ram_efficient.source == memguard_api::coupled::INERT_AT_LOAD {
        notes.push(format!(
            "--ram-efficient-loading true: every rank loads all the same under transformers \
             5.23 ({})",
            ram_efficient.source
        ));
    }
    host.ram_efficient_loading = ram_efficient.value;
    host.dataloader_workers = workers;
    host.prefetch_factor = prefetch;
    host.pin_memory = args.pin_memory.unwrap_or(false);
    host.save = save;
    Ok((host, notes))
}

/// The host figure of one pod: its configuration, the estimate and a note per defaulted flag.
pub struct HostFigure {
    /// The pod as the host sees it.
    pub config: HostConfig,
    /// Its host memory.
    pub estimate: HostEstimate,
    /// Each host flag left to its default, said.
    pub notes: Vec<String>,
}

impl HostFigure {
    /// The host fields of `--output json`, per pod.
    pub fn json_fields(&self) -> serde_json::Map<String, Value> {
        let est = &self.estimate;
        let value = json!({
            "host_bytes": est.peak.0,
            "host_peak_phase": est.peak_phase.name(),
            "host_ranks_in_pod": self.config.ranks_in_pod,
            "host_components": {
                "load": est.load.0,
                "input": est.input.0,
                "save": est.save.0,
                "offload": est.offload.0,
                "runtime": est.runtime.0,
            },
            "host_defaults": self.notes,
        });
        match value {
            Value::Object(fields) => fields,
            _ => serde_json::Map::new(),
        }
    }

    /// The host lines of the table, beside the GPU figure: the figure, then each default.
    pub fn table_lines(&self) -> String {
        let est = &self.estimate;
        let mut lines = format!(
            "host memory per pod ({} rank(s)): {} at {} (load {}, input {}, save {}, offload {}, runtime {})\n",
            self.config.ranks_in_pod,
            est.peak,
            est.peak_phase.name(),
            est.load,
            est.input,
            est.save,
            est.offload,
            est.runtime,
        );
        for note in &self.notes {
            lines.push_str(&format!("  host: {note}\n"));
        }
        lines
    }
}

/// The host figure of a GPU job; `None` for a job on another device.
pub fn estimate(
    cfg: &TrainingConfig,
    pod_gpus: Option<u32>,
    args: &HostArgs,
) -> Result<Option<HostFigure>, String> {
    if !applies(cfg) {
        return Ok(None);
    }
    let (config, notes) = host_config(cfg, pod_gpus, args)?;
    let estimate = host_estimate(&config);
    Ok(Some(HostFigure {
        config,
        estimate,
        notes,
    }))
}
