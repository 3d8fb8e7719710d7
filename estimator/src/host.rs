//! Host memory of one pod of a training job: what its memory cgroup (`limits.memory`, the
//! "OOMKilled" of Kubernetes) must hold, as opposed to the GPU memory of one step.
//!
//! Per pod, not per rank: every rank of the pod, the launcher, the DataLoader workers and the
//! page cache of the files they read and write are charged to the one cgroup. The job passes
//! through three phases, and the peak is the largest of them, not their sum:
//!
//! * **load**: runtime + load (each rank materialises its copy of the weights; the checkpoint's
//!   pages are cached once);
//! * **step**: runtime + input pipeline + offload;
//! * **save**: runtime + input pipeline + offload + the save spike.
//!
//! Every constant is physics or measured here: `bench/host/results/host.jsonl`, one JSON line
//! per case, read in `docs/host-memory.md`; the case each one comes from is named beside it.

use crate::units::Bytes;

/// The constants physics does not give, each measured by `bench/host/measure.py` (transformers
/// 5.23, torch 2.15, CPU, cgroup v1; the case names are those of `host.jsonl`).
pub mod constants {
    use crate::units::Bytes;

    /// What a pod holds besides its ranks: `torchrun`'s agent (a Python process with torch)
    /// and the pages of the libraries the ranks read. A least-squares fit of the cold
    /// `runtime-r{1,2,4}` peaks and of every load case's usage before loading gives
    /// 0.53 GiB + 0.44 GiB a rank, with residuals from −0.18 to +0.11 GiB: library pages are
    /// charged to whichever cgroup reads them first, and this machine is shared. Set 0.2 GiB
    /// above the fit, the smallest round value that keeps every measured case above −15 %
    /// (`load-m150-fp32-default-r1`, at −13.9 %, is the one that sets it): an under-estimate is
    /// an OOM kill.
    pub const LAUNCHER: Bytes = Bytes::mib(748);
    /// One rank that imported torch and transformers' Llama code and joined a gloo group: the
    /// slope of the same fit. A CUDA rank holds its CUDA host context and NCCL buffers on top
    /// (not measured here, no GPU): a floor for a GPU rank.
    pub const RANK_RUNTIME: Bytes = Bytes::mib(451);
    /// One DataLoader worker: a process forked from its rank, whose pages it writes after the
    /// fork become its own (Python's reference counts write to every object it reads). The
    /// least-squares slope over all 18 `input-*` cases, their batches taken out.
    pub const DATALOADER_WORKER: Bytes = Bytes::mib(14);
    /// Batches in flight besides the prefetch queue: the one the trainer holds and the one
    /// being collated (physics).
    pub const BATCHES_IN_HAND: f64 = 2.0;
}

use constants::*;

/// What a pod gathers on one host when it saves a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum SaveMode {
    /// No checkpoint is saved while the job runs.
    None,
    /// The full model state dict gathered on one rank (FSDP `FULL_STATE_DICT`, ZeRO-3
    /// consolidation with `save_only_model`, a plain `save_pretrained`) and written.
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "full"))]
    ModelOnlyFull,
    /// The full model and optimizer state gathered on one rank and written.
    FullWithOptimizer,
    /// Each rank writes its own shard (FSDP `SHARDED_STATE_DICT`, `torch.distributed.checkpoint`).
    Sharded,
}

impl SaveMode {
    /// Every mode, in declaration order.
    pub const ALL: [SaveMode; 4] = [
        SaveMode::None,
        SaveMode::ModelOnlyFull,
        SaveMode::FullWithOptimizer,
        SaveMode::Sharded,
    ];

    /// The spelling of flags and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            SaveMode::None => "none",
            SaveMode::ModelOnlyFull => "full",
            SaveMode::FullWithOptimizer => "full-with-optimizer",
            SaveMode::Sharded => "sharded",
        }
    }

    /// The mode of a spelling of [`SaveMode::name`].
    pub fn parse(s: &str) -> Option<SaveMode> {
        let s = s.trim().to_ascii_lowercase();
        SaveMode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// What a pod keeps on the host by design (ZeRO-Offload, FSDP CPU offload, activation
/// offloading).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Offload {
    /// Nothing is offloaded.
    #[default]
    None,
    /// The optimizer step runs on the host: fp32 master weights, fp32 gradients and the
    /// optimizer states of the pod's shards (ZeRO-Offload, DeepSpeed `offload_optimizer`).
    Optimizer,
    /// The parameters as well, in the compute dtype (ZeRO-3 `offload_param`, FSDP
    /// `CPUOffload(offload_params=True)`).
    ParamsAndOptimizer,
    /// Saved activations of the pod's ranks, in bytes (activation offloading).
    Activations(Bytes),
}

/// The phase a pod's host peak falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Phase {
    /// The ranks load the weights.
    Load,
    /// Training steps.
    Step,
    /// A checkpoint is saved.
    Save,
}

impl Phase {
    /// The spelling of JSON and tables.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Load => "load",
            Phase::Step => "step",
            Phase::Save => "save",
        }
    }
}

/// One pod of a training job, as its host memory sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostConfig {
    /// Ranks (processes) in the pod: the GPUs of one pod under torchrun, accelerate, deepspeed.
    pub ranks_in_pod: u32,
    /// Ranks of the whole job: the offloaded and sharded state is split over them.
    pub world_size: u32,
    /// Parameters of the model.
    pub params: f64,
    /// Bytes per parameter of the checkpoint's files (their storage dtype).
    pub checkpoint_bytes_per_param: f64,
    /// Bytes per parameter the weights are loaded in (`dtype=`); `None` is the loader's default,
    /// which in transformers 5 is `"auto"`: the checkpoint's own dtype.
    pub load_bytes_per_param: Option<f64>,
    /// Only rank 0 materialises the weights and broadcasts them; the other ranks load on the
    /// meta device. A transformers 4 loader under FSDP `cpu_ram_efficient_loading`: under
    /// transformers 5.23 every rank still reads the files, so neither admission nor the CLI
    /// sets it (docs/host-memory.md, "RAM-efficient loading").
    pub ram_efficient_loading: bool,
    /// DataLoader workers per rank (`num_workers`).
    pub dataloader_workers: u32,
    /// Batches each worker prepares ahead (`prefetch_factor`, 2 by default).
    pub prefetch_factor: u32,
    /// The DataLoader copies each batch into page-locked memory (`pin_memory`).
    pub pin_memory: bool,
    /// One micro-batch's tensors on the host, as the DataLoader yields it.
    pub batch_bytes: Bytes,
    /// How checkpoints are saved.
    pub save: SaveMode,
    /// The state a save writes already sits in host memory, whole (a model trained on the CPU,
    /// or offloaded and unsharded): a full save writes it from where it is. Otherwise (GPU
    /// weights, or sharded ones) it is first copied into host memory: FSDP's full state dict on
    /// rank 0, safetensors' serialisation of GPU tensors.
    pub state_on_host: bool,
    /// Bytes per parameter of the full state dict as training holds it (4 for fp32 weights,
    /// as FSDP and mixed precision keep them).
    pub state_bytes_per_param: f64,
    /// Bytes per parameter of the optimizer's states (8 for Adam/AdamW in fp32).
    pub optimizer_bytes_per_param: f64,
    /// What is offloaded to the host.
    pub offload: Offload,
}

impl HostConfig {
    /// One rank of one pod loading a `params`-parameter checkpoint stored at
    /// `checkpoint_bytes_per_param`, in the checkpoint's dtype; no DataLoader workers
    /// (prefetch 2, no pinning, empty batches), a full model-only save of fp32 weights with
    /// AdamW states, nothing offloaded.
    pub fn new(params: f64, checkpoint_bytes_per_param: f64) -> HostConfig {
        HostConfig {
            ranks_in_pod: 1,
            world_size: 1,
            params,
            checkpoint_bytes_per_param,
            load_bytes_per_param: None,
            ram_efficient_loading: false,
            dataloader_workers: 0,
            prefetch_factor: 2,
            pin_memory: false,
            batch_bytes: Bytes::ZERO,
            save: SaveMode::ModelOnlyFull,
            state_on_host: false,
            state_bytes_per_param: 4.0,
            optimizer_bytes_per_param: 8.0,
            offload: Offload::None,
        }
    }
}

/// The host memory of one pod: each component, and the peak over the phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct HostEstimate {
    /// Loading the weights: each materialising rank's copy and the checkpoint's cached pages.
    pub load: Bytes,
    /// The input pipeline of every rank: DataLoader workers and the batches in flight.
    pub input: Bytes,
    /// The save spike over the training baseline.
    pub save: Bytes,
    /// What is offloaded to the host.
    pub offload: Bytes,
    /// The launcher and every rank's interpreter, torch and transformers.
    pub runtime: Bytes,
    /// The largest phase: what `limits.memory` must hold.
    pub peak: Bytes,
    /// The phase of the peak.
    pub peak_phase: Phase,
}

/// The host memory of one pod (see the module's documentation for the phases).
pub fn host_estimate(cfg: &HostConfig) -> HostEstimate {
    let ranks = f64::from(cfg.ranks_in_pod.max(1));
    let runtime = LAUNCHER.as_f64() + ranks * RANK_RUNTIME.as_f64();
    let load = load_bytes(cfg, ranks);
    let input = ranks * input_bytes_per_rank(cfg);
    let offload = offload_bytes(cfg, ranks);
    let save = save_bytes(cfg, ranks);
    let phases = [
        (Phase::Load, runtime + load),
        (Phase::Step, runtime + input + offload),
        (Phase::Save, runtime + input + offload + save),
    ];
    let (peak_phase, peak) =
        phases.into_iter().fold(
            (Phase::Load, f64::MIN),
            |best, p| if p.1 > best.1 { p } else { best },
        );
    HostEstimate {
        load: Bytes::from_f64(load),
        input: Bytes::from_f64(input),
        save: Bytes::from_f64(save),
        offload: Bytes::from_f64(offload),
        runtime: Bytes::from_f64(runtime),
        peak: Bytes::from_f64(peak),
        peak_phase,
    }
}

/// `P·c` for the checkpoint's pages, cached once whoever reads them, plus `r·P·l` when the
/// weights are loaded in another dtype than the files' (`l` its bytes, `r` the materialising
/// ranks: all of the pod's, 1 under `cpu_ram_efficient_loading`). Loaded in the files' own
/// dtype, transformers 5 keeps each tensor on the file's mapped pages: no copy, however many
/// ranks (`load-*-default-r{1,2,4}` grow by the file once, not once per rank).
fn load_bytes(cfg: &HostConfig, ranks: f64) -> f64 {
    let file = cfg.params * cfg.checkpoint_bytes_per_param;
    let copied = match cfg.load_bytes_per_param {
        Some(loaded) if loaded != cfg.checkpoint_bytes_per_param => loaded,
        _ => 0.0,
    };
    let materialising = if cfg.ram_efficient_loading {
        1.0
    } else {
        ranks
    };
    file + materialising * cfg.params * copied
}

/// One rank's pipeline: `w·worker + q·b`, with `q` the batches in flight (`w·prefetch` queued
/// plus those in hand), doubled when each is copied into pinned memory.
fn input_bytes_per_rank(cfg: &HostConfig) -> f64 {
    let workers = f64::from(cfg.dataloader_workers);
    let queued = workers * f64::from(cfg.prefetch_factor);
    let in_flight = (queued + BATCHES_IN_HAND) * cfg.batch_bytes.as_f64();
    let pinned = if cfg.pin_memory { in_flight } else { 0.0 };
    workers * DATALOADER_WORKER.as_f64() + in_flight + pinned
}

/// The pod's share (`ranks / world`) of the offloaded state; activations as given.
fn offload_bytes(cfg: &HostConfig, ranks: f64) -> f64 {
    // fp32 master weights and fp32 gradients beside the optimizer states.
    const MASTER_AND_GRAD: f64 = 8.0;
    let share = ranks / f64::from(cfg.world_size.max(cfg.ranks_in_pod).max(1));
    let optimizer = cfg.params * (MASTER_AND_GRAD + cfg.optimizer_bytes_per_param) * share;
    match cfg.offload {
        Offload::None => 0.0,
        Offload::Optimizer => optimizer,
        Offload::ParamsAndOptimizer => optimizer + cfg.params * cfg.state_bytes_per_param * share,
        Offload::Activations(bytes) => bytes.as_f64(),
    }
}

/// A full save: the written file's pages (`S`, the state: model, or model + optimizer) and,
/// unless the state already sits whole in host memory, its copy there: `2·S`
/// (`save-*-full_*`; `save-*-hf-*` write from the weights themselves: `S`). A sharded save: the
/// pod's share of the shards' pages, each rank writing its own one tensor at a time
/// (`save-*-sharded`).
fn save_bytes(cfg: &HostConfig, ranks: f64) -> f64 {
    let model = cfg.params * cfg.state_bytes_per_param;
    let optimizer = cfg.params * cfg.optimizer_bytes_per_param;
    let share = ranks / f64::from(cfg.world_size.max(cfg.ranks_in_pod).max(1));
    let copies = if cfg.state_on_host { 1.0 } else { 2.0 };
    match cfg.save {
        SaveMode::None => 0.0,
        SaveMode::ModelOnlyFull => copies * model,
        SaveMode::FullWithOptimizer => copies * (model + optimizer),
        SaveMode::Sharded => (model + optimizer) * share,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = 1073741824.0;

    fn pod(ranks: u32) -> HostConfig {
        let mut cfg = HostConfig::new(8e9, 2.0);
        cfg.ranks_in_pod = ranks;
        cfg.world_size = ranks;
        cfg
    }

    #[test]
    fn the_peak_is_the_largest_phase_not_the_sum() {
        let est = host_estimate(&pod(8));
        let load = est.runtime + est.load;
        let save = est.runtime + est.input + est.offload + est.save;
        assert_eq!(est.peak, load.max(save));
        assert!(est.peak < est.runtime + est.load + est.save);
    }

    #[test]
    fn loading_in_another_dtype_costs_a_copy_per_rank_and_ram_efficient_loading_one() {
        let same = host_estimate(&pod(8)).load;
        let mut cfg = pod(8);
        cfg.load_bytes_per_param = Some(4.0);
        let upcast = host_estimate(&cfg).load;
        assert!((upcast.as_f64() - same.as_f64() - 8.0 * 8e9 * 4.0).abs() < 1.0);
        cfg.ram_efficient_loading = true;
        let efficient = host_estimate(&cfg).load;
        assert!((efficient.as_f64() - same.as_f64() - 8e9 * 4.0).abs() < 1.0);
    }

    #[test]
    fn workers_and_prefetched_batches_fill_the_input_pipeline() {
        let mut cfg = pod(1);
        let none = host_estimate(&cfg).input;
        cfg.dataloader_workers = 8;
        cfg.batch_bytes = Bytes::mib(12);
        let eight = host_estimate(&cfg).input;
        cfg.prefetch_factor = 4;
        let deeper = host_estimate(&cfg).input;
        assert!(eight > none);
        // 8 workers × 2 more batches each.
        assert_eq!(deeper.0 - eight.0, 16 * Bytes::mib(12).0);
    }

    #[test]
    fn a_sharded_save_holds_the_pods_share_and_a_full_one_the_whole_state() {
        let mut cfg = pod(8);
        cfg.world_size = 16;
        cfg.save = SaveMode::Sharded;
        let sharded = host_estimate(&cfg).save.as_f64();
        cfg.save = SaveMode::FullWithOptimizer;
        let full = host_estimate(&cfg).save.as_f64();
        assert!(full > 2.0 * sharded);
        assert!(sharded > 0.0);
    }

    #[test]
    fn offloaded_optimizer_state_is_split_over_the_job() {
        let mut cfg = pod(8);
        cfg.offload = Offload::Optimizer;
        let one_pod = host_estimate(&cfg).offload.as_f64();
        cfg.world_size = 16;
        let half = host_estimate(&cfg).offload.as_f64();
        assert!((one_pod / half - 2.0).abs() < 1e-9);
        // fp32 master weights, gradients and AdamW's two moments: 16 bytes a parameter.
        assert!((one_pod - 8e9 * 16.0).abs() < 1.0, "{}", one_pod / GIB);
    }

    #[test]
    fn save_modes_round_trip_their_names() {
        for mode in SaveMode::ALL {
            assert_eq!(SaveMode::parse(mode.name()), Some(mode));
        }
        assert_eq!(SaveMode::parse("everything"), None);
    }
}
