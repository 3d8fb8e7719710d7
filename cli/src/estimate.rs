//! `memguard estimate`: the estimator and the downgrade plan on the command line.
//!
//! The flags are the pod annotations without the `memguard.io/` prefix and go through the very
//! same parser ([`TrainingAnnotations::parse_keys`]), so the CLI and the webhook cannot disagree.

use memguard_api::annotations::TrainingAnnotations;
use memguard_api::dra::DraCatalog;
use memguard_api::policy::DEFAULT_SAFETY_RATIO;
use memguard_api::{ModelCatalog, Policy, Size, TrainingPod};
use memguard_decide::decision;
use memguard_estimator::{
    Bound, Bytes, Calibration, DowngradePlan, Estimate, GradSync, ServingConfig, Suggestion,
    TrainingConfig, catalog, estimate_serving,
};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use crate::host::HostFigure;

/// Declares the pass-through flags once: each is an annotation key (without prefix) taking the
/// value exactly as an annotation would.
macro_rules! annotation_flags {
    ($($(#[$doc:meta])* $field:ident => $key:literal),+ $(,)?) => {
        /// Flags of `memguard estimate`.
        #[derive(clap::Args, Debug, Default)]
        pub struct Args {
            $(
                $(#[$doc])*
                #[arg(long = $key, value_name = "VALUE", allow_hyphen_values = true, help_heading = "Model and training (annotation keys)")]
                $field: Option<String>,
            )+
            /// Memory available for the step: a number and a unit, such as `24GiB`, `80G`,
            /// `23028Mi` (bytes as `1073741824B`; a bare number is refused). Default:
            /// the budget the webhook would give a pod asking for --gpu-resource (and pinned to
            /// --gpu-product), else gpu-memory × safety-ratio when gpu-memory is given.
            #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
            budget: Option<String>,
            /// A resource the trainer would request, `NAME` or `NAME=QUANTITY` (default 1):
            /// `nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`, `nvidia.com/gpumem=8000`,
            /// `amd.com/gpu`. Repeat for several. The budget then comes from the webhook's own
            /// budget stage, under --policy-file.
            #[arg(long, value_name = "NAME[=QTY]", help_heading = "The pod memguard would see")]
            gpu_resource: Vec<String>,
            /// The GPU product the pod would be pinned to (`nvidia.com/gpu.product`, or
            /// `amd.com/gpu.product-name` with `amd.com/gpu`): `NVIDIA-H100-80GB-HBM3`,
            /// `NVIDIA-A100-SXM4-40GB-MIG-1g.5gb`, `AMD_Instinct_MI300X_OAM`.
            #[arg(long, value_name = "PRODUCT", help_heading = "The pod memguard would see")]
            gpu_product: Option<String>,
            /// A pod annotation, `KEY=VALUE`, such as KAI's `gpu-fraction=0.5` or
            /// `gpu-memory=2000`. Repeat for several.
            #[arg(long, value_name = "KEY=VALUE", help_heading = "The pod memguard would see")]
            pod_annotation: Vec<String>,
            /// A DRA claim the trainer would use: `TEMPLATE` (a ResourceClaimTemplate's name)
            /// or `claim/NAME` (a ResourceClaim's), looked up in the --dra objects. The device
            /// and its memory then come from the claim, as at admission.
            #[arg(long, value_name = "TEMPLATE|claim/NAME", help_heading = "The pod memguard would see")]
            dra_claim: Option<String>,
            /// DRA objects (`resource.k8s.io/v1` ResourceClaimTemplate, ResourceClaim,
            /// DeviceClass, ResourceSlice), a multi-document YAML, for --dra-claim. Repeat for
            /// several files.
            #[arg(long, value_name = "FILE", help_heading = "The pod memguard would see")]
            dra: Vec<std::path::PathBuf>,
            /// Policy document (YAML or JSON `PolicySpec`, or a `MemguardPolicy` manifest): its
            /// models (`spec.models`) are known to --model and --list-models, and its GPU table
            /// and safety ratio apply with --gpu-resource; default: the built-in policy.
            #[arg(long, value_name = "FILE", help_heading = "The pod memguard would see")]
            policy_file: Option<std::path::PathBuf>,
            /// The trainer's own `PYTORCH_CUDA_ALLOC_CONF`. Unset (the default), the webhook sets
            /// `expandable_segments:True` on CUDA trainers, and the estimate assumes it: a
            /// --seq-length-spread then does not fragment the allocator.
            #[arg(long, value_name = "VALUE", help_heading = "The pod memguard would see")]
            pytorch_cuda_alloc_conf: Option<String>,
            /// Output format.
            #[arg(long, value_enum, default_value_t = Output::Table)]
            output: Output,
            /// List the model names --model accepts and exit: the --policy-file's models (marked
            /// `policy`), then the built-in catalog's.
            #[arg(long)]
            list_models: bool,
            /// A Hugging Face `config.json` describing the model, instead of --model: its shape,
            /// `quantization_config` (bitsandbytes 4/8-bit, GPTQ, AWQ, FP8, MXFP4) and attention
            /// dropout. Shape flags given as well override it.
            #[arg(long, value_name = "PATH", help_heading = "Model and training (annotation keys)")]
            model_config: Option<std::path::PathBuf>,
            /// Estimate inference serving instead of training: weights plus the KV-cache
            /// ceiling for --max-sequences sequences of --seq-length tokens.
            #[arg(long, help_heading = "Serving")]
            serve: bool,
            /// An inference server's launch line, as the container would run it (`vllm serve
            /// MODEL --max-model-len 8192`, `python -m sglang.launch_server --model-path M`):
            /// fitted to the pod the other flags describe exactly as admission fits it (the
            /// fraction, the maximum length, or why it cannot start). --model overrides the
            /// model the line names.
            #[arg(long, value_name = "COMMAND", help_heading = "Serving")]
            server_command: Option<String>,
            /// Sequences served at once (the engine's max_num_seqs); with --serve.
            #[arg(long, value_name = "N", default_value_t = 1, help_heading = "Serving")]
            max_sequences: u64,
            /// Bits of one cached key or value element (16, or 8 for an fp8 cache); with --serve.
            #[arg(long, value_name = "BITS", default_value_t = 16, help_heading = "Serving")]
            kv_cache_bits: u32,
            /// The host flags: what one pod's memory cgroup must hold beside its GPUs.
            #[command(flatten)]
            host: crate::host::HostArgs,
        }

        /// The flags that are annotation keys (without the `memguard.io/` prefix).
        #[cfg(test)]
        const ANNOTATION_FLAGS: &[&str] = &[$($key),+];

        impl Args {
            /// The annotation-style key → value map of the flags that were given.
            fn keys(&self) -> BTreeMap<String, String> {
                let mut keys = BTreeMap::new();
                $(
                    if let Some(v) = &self.$field {
                        keys.insert($key.to_string(), v.clone());
                    }
                )+
                keys
            }
        }
    };
}

annotation_flags! {
    /// Model name (see --list-models): a built-in one such as `llama-3-8b` or
    /// `meta-llama/Llama-3.1-8B`, or one of the --policy-file's models.
    model => "model",
    /// Total parameters: `7B`, `125M`, `7e9`.
    model_params => "model-params",
    /// Storage bits of the base weights: 4, 8, 16, 32.
    model_bits => "model-bits",
    /// Model width.
    hidden_size => "hidden-size",
    /// Transformer blocks.
    num_layers => "num-layers",
    /// Attention heads.
    num_heads => "num-heads",
    /// Key/value heads (GQA).
    num_kv_heads => "num-kv-heads",
    /// Width of one FFN branch.
    intermediate_size => "intermediate-size",
    /// Vocabulary size.
    vocab_size => "vocab-size",
    /// Gated FFN (SwiGLU): true|false.
    ffn_gated => "ffn-gated",
    /// Tied input/output embeddings: true|false.
    tie_embeddings => "tie-embeddings",
    /// MoE experts per layer.
    num_experts => "num-experts",
    /// MoE experts per token.
    experts_per_token => "experts-per-token",
    /// Per-device batch size.
    batch_size => "batch-size",
    /// Sequence length.
    seq_length => "seq-length",
    /// Gradient accumulation steps.
    grad_accumulation => "grad-accumulation",
    /// full|lora|qlora|dora.
    method => "method",
    /// LoRA rank.
    lora_rank => "lora-rank",
    /// Adapted layers (default: all).
    lora_layers => "lora-layers",
    /// Adapted projections: q,k,v,o,gate,up,down or all-linear.
    lora_targets => "lora-targets",
    /// QLoRA double quantization: true|false.
    double_quant => "double-quant",
    /// adamw|adam|sgd|sgd-momentum|adafactor|adamw-8bit.
    optimizer => "optimizer",
    /// true|false.
    grad_checkpointing => "grad-checkpointing",
    /// true|false.
    flash_attention => "flash-attention",
    /// standard|narrow|narrow-released|chunked|fused: how the loss over the vocabulary is
    /// computed (default standard: the whole logits upcast to fp32; narrow: not upcast,
    /// transformers before 4.46 for GPT-2 and GPT-BigCode; narrow-released: not upcast, and
    /// the model's output let go before backward, as transformers' Trainer does; chunked:
    /// torchtune's CEWithChunkedOutputLoss, LitGPT;
    /// fused: Liger's fused linear cross-entropy, Cut Cross-Entropy).
    loss => "loss",
    /// true|false: the model trains with attention dropout (default: the model's config).
    attention_dropout => "attention-dropout",
    /// true|false: activations offloaded to host memory (default false).
    activation_offload => "activation-offload",
    /// true|false: optimizer states and step on the host (default false).
    optimizer_offload => "optimizer-offload",
    /// true|false: the optimizer steps each parameter during backward (default false).
    optimizer_in_backward => "optimizer-in-backward",
    /// true|false: torch.compile (default false).
    compile => "compile",
    /// true|false: the LoRA adapters apply dropout to their input (default false).
    lora_dropout => "lora-dropout",
    /// accumulate|each-batch: how gradients are synchronised while micro-batches accumulate
    /// (default accumulate: no_sync until the last micro-batch, as Accelerate and LitGPT do;
    /// each-batch: Accelerate's sync_each_batch, which keeps FSDP's gradients sharded).
    grad_sync => "grad-sync",
    /// true|false: a 4- or 8-bit base quantizes the LM head too (Fabric/LitGPT; default false).
    quantized_head => "quantized-head",
    /// true|false: a 4-bit base was quantized from fp16 (Fabric, bitsandbytes <= 0.42; default false).
    quant_from_fp16 => "quant-from-fp16",
    /// true|false: the trainer keeps its own LM head when the checkpoint ties it (LitGPT; default false).
    untied_head => "untied-head",
    /// (longest − shortest) / longest of the batches' padded lengths, in [0, 1] (default 0):
    /// varying shapes fragment the CUDA caching allocator.
    seq_length_spread => "seq-length-spread",
    /// true|false: sequences packed into fixed-length batches (default false: padded).
    packing => "packing",
    /// fp32|bf16-mixed|fp16-mixed|bf16|fp16.
    precision => "precision",
    /// cuda|cpu|metal|rocm.
    device => "device",
    /// none|ddp|fsdp|zero1|zero2|zero3.
    parallelism => "parallelism",
    /// Devices in data parallelism.
    world_size => "world-size",
    /// Memory per GPU, a number and a unit, e.g. `80GiB` (budget = gpu-memory × safety-ratio).
    gpu_memory => "gpu-memory",
    /// Fraction of the memory the plan may use, in (0, 1] (default 0.9).
    safety_ratio => "safety-ratio",
    /// true|false: the plan may cut sequence length and LoRA rank/layers (quality knobs) where
    /// a cut saves at least 2 % of the budget (default: the policy's floors.allowQuality, false).
    allow_quality => "allow-quality",
}

/// Output format of `memguard estimate`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Output {
    /// A table for people.
    #[default]
    Table,
    /// One JSON object.
    Json,
}

/// Runs `memguard estimate`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    let policy = match read_policy(args.policy_file.as_deref()) {
        Ok(policy) => policy,
        Err(message) => return Ok(bad_input([message])),
    };
    // A policy model shadowing a built-in one is allowed; say so, as the webhook logs it.
    for note in policy.models.notes() {
        eprintln!("note: {note}");
    }
    if args.list_models {
        list_models(&mut out, &policy.models)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(command) = &args.server_command {
        return server_command(&args, command, &policy, &mut out);
    }
    let (parsed, world_size_given) = match parse_flags(&args, &policy) {
        Ok(parsed) => parsed,
        Err(messages) => return Ok(bad_input(messages)),
    };
    for note in world_notes(&args, &parsed.config) {
        eprintln!("note: {note}");
    }
    // The pod the flags describe goes through the webhook's own stages: resolved as at
    // admission, then the budget stage every caller shares (memguard_decide::decision).
    let flags_pod = match pod_of_flags(&args) {
        Ok(p) => p,
        Err(message) => return Ok(bad_input([message])),
    };
    let training = match &flags_pod {
        Some(p) => match TrainingPod::with_annotations(
            &p.pod,
            parsed.clone(),
            world_size_given,
            &policy,
            memguard_api::Cluster::with_dra(p.dra.as_deref().map(|c| c as &dyn DraCatalog)),
        ) {
            Ok(t) => Some(t),
            Err(e) => return Ok(bad_input([e.to_string()])),
        },
        None => None,
    };
    let budget = match budget(&args, &parsed, training.as_ref(), &policy) {
        Ok(budget) => budget,
        Err(message) => return Ok(bad_input([message])),
    };
    let mut cfg = training
        .as_ref()
        .map_or(&parsed.config, |t| &t.config)
        .clone();
    // The trainer's own allocator setting, as admission reads it from the trainer's env.
    cfg.expandable_segments = memguard_decide::decision::expandable_segments(
        cfg.device,
        args.pytorch_cuda_alloc_conf.as_deref().map(Some),
    );
    let cfg = &cfg;
    if args.serve {
        return serve(&args, cfg, budget, &mut out);
    }
    let estimate = match memguard_estimator::estimate(cfg) {
        Ok(e) => e,
        Err(errors) => return Ok(bad_input(errors.iter().map(|e| format!("--{e}")))),
    };
    let host =
        match crate::host::estimate(cfg, crate::host::pod_gpus(&args.gpu_resource), &args.host) {
            Ok(host) => host,
            Err(message) => return Ok(bad_input([message])),
        };
    // As the webhook plans: against the upper bound at the policy's level.
    let bound = Bound::at(policy.estimate_level, &[]);
    let upper = bound.upper(cfg, estimate.total, estimate.total);
    // The plan under the policy's floors: the decision's own for a pod, else the same planning
    // step into the given budget.
    let decided = match &training {
        Some(t) => match decision::decide(t, &policy, |_| None) {
            Ok(d) => Some(d),
            Err(message) => return Ok(bad_input([message])),
        },
        None => None,
    };
    let floors = decision::floors(parsed.allow_quality, &policy);
    let plan = match (&decided, budget) {
        (Some(d), _) => Some(d.plan.clone()),
        (None, Some(budget)) => {
            match decision::plan_into(cfg, Some(budget), &Calibration::none(), &floors, &bound) {
                Ok(plan) => Some(plan),
                Err(errors) => return Ok(bad_input(errors.iter().map(|e| format!("--{e}")))),
            }
        }
        (None, None) => None,
    };
    // When it cannot fit: what would, outside the knobs, each re-planned into the same budget.
    let suggestions = match (&decided, &plan) {
        (Some(d), _) => d.suggestions.clone(),
        (None, Some(p)) if !p.fits => {
            let mut out =
                memguard_estimator::suggest(cfg, p.budget, &Calibration::none(), &floors, &bound);
            // A larger GPU of the policy's table, when the budget is one GPU's memory.
            if let (Some(gpu), memguard_estimator::Device::Cuda) = (parsed.gpu_memory, cfg.device) {
                let ratio = parsed.safety_ratio.unwrap_or(DEFAULT_SAFETY_RATIO);
                let larger = memguard_decide::placement::larger_gpu(
                    cfg,
                    gpu,
                    ratio,
                    &Calibration::none(),
                    &floors,
                    &bound,
                    &policy,
                    &[],
                );
                out.splice(0..0, larger);
                out.sort_by_key(|s| !s.fits);
            }
            out
        }
        _ => Vec::new(),
    };
    // `--budget` as written (already checked): the table says it back in the user's unit.
    let written = args.budget.as_deref().and_then(|b| Size::parse(b).ok());
    write_output(
        &mut out,
        args.output,
        cfg,
        (&estimate, host.as_ref()),
        (plan.as_ref(), &suggestions, written.as_ref()),
        decided.as_ref(),
        (upper, policy.estimate_level),
    )?;
    // A plan that does not fit is a failure a script must see.
    if plan.as_ref().is_some_and(|p| !p.fits) {
        return Ok(ExitCode::from(super::EXIT_DOES_NOT_FIT));
    }
    Ok(ExitCode::SUCCESS)
}

/// The flags as annotations (`--model-config` read for the shape), and whether they name the
/// world size.
fn parse_flags(args: &Args, policy: &Policy) -> Result<(TrainingAnnotations, bool), Vec<String>> {
    let mut keys = args.keys();
    let given = match &args.model_config {
        Some(path) => Some(read_model_config(path, &mut keys)?),
        None => None,
    };
    let parsed = TrainingAnnotations::parse_keys_with_model(&keys, &policy.models, given)
        .map_err(|errors| errors.iter().map(|e| format!("--{e}")).collect::<Vec<_>>())?;
    Ok((parsed, keys.contains_key("world-size")))
}

/// What the flags leave to a default or ignore about data parallelism, said: a sharded
/// parallelism without `--world-size` (one device assumed, unless `--gpu-resource` gives the
/// count as a pod's GPUs would), and `--world-size` without a parallelism (ignored).
fn world_notes(args: &Args, cfg: &TrainingConfig) -> Vec<String> {
    use memguard_estimator::Parallelism;
    let mut notes = Vec::new();
    let parallel = cfg.parallelism != Parallelism::None;
    match (&args.world_size, parallel) {
        (None, true) if args.gpu_resource.is_empty() => notes.push(format!(
            "--parallelism {} without --world-size: world size 1 assumed (nothing is sharded \
             or replicated); give --world-size N",
            cfg.parallelism.name()
        )),
        (None, true) => notes.push(format!(
            "--parallelism {} without --world-size: the world is the GPUs --gpu-resource asks \
             for, as for a pod",
            cfg.parallelism.name()
        )),
        (Some(n), false) => notes.push(format!(
            "--world-size {n} ignored: without --parallelism (ddp|fsdp|zero1|zero2|zero3) every \
             device holds the whole job"
        )),
        _ => {}
    }
    notes
}

/// The budget: the budget stage's for the pod the flags describe (its warnings on stderr), else
/// `--budget`, else gpu-memory × safety-ratio, else none.
fn budget(
    args: &Args,
    parsed: &TrainingAnnotations,
    training: Option<&TrainingPod>,
    policy: &Policy,
) -> Result<Option<Bytes>, String> {
    let Some(training) = training else {
        return resolve_budget(args, parsed);
    };
    let (budget, warnings) = decision::budget(training, policy);
    let Some(budget) = budget else {
        return Err(format!(
            "no budget: the resources name no GPU memguard knows ({}); give --budget",
            warnings.join("; ")
        ));
    };
    if args.budget.is_some() {
        return Err("--budget and --gpu-resource/--gpu-product/--pod-annotation both give the budget; pick one".to_string());
    }
    warn(&warnings);
    Ok(Some(budget.bytes))
}

/// The estimate and the plan, as a table or JSON; with the pod's budget stage, where the budget
/// came from and the profile key.
fn write_output(
    out: &mut impl Write,
    output: Output,
    cfg: &TrainingConfig,
    (estimate, host): (&Estimate, Option<&HostFigure>),
    (plan, suggestions, written): (Option<&DowngradePlan>, &[Suggestion], Option<&Size>),
    decided: Option<&decision::Decision>,
    (upper, level): (Bytes, f64),
) -> anyhow::Result<()> {
    let pod_budget = decided.and_then(|d| d.budget.as_ref());
    match output {
        Output::Json => {
            let mut value = to_json(cfg, estimate, plan);
            if let Some(host) = host
                && let Some(value) = value.as_object_mut()
            {
                value.extend(host.json_fields());
            }
            value["total_upper_bytes"] = json!(upper.0);
            value["upper_level"] = json!(level);
            if let Some(b) = pod_budget {
                value["budget_source"] = json!(b.source);
                value["device_memory_bytes"] = json!(b.device_memory.0);
            }
            if let Some(d) = decided {
                value["profile"] = json!({"name": d.key.name, "spec": d.key.spec});
            }
            if plan.is_some_and(|p| !p.fits) {
                let list: Vec<Value> = suggestions
                    .iter()
                    .map(|s| {
                        json!({
                            "change": s.change,
                            "upper_bytes": s.upper.0,
                            // A larger GPU's suggestion is planned into that GPU's budget.
                            "budget_bytes": s.budget.0,
                            "fits": s.fits,
                            "world_size": s.config.world_size,
                            "config": config_json(&s.config),
                        })
                    })
                    .collect();
                value["suggestions"] = json!(list);
            }
            serde_json::to_writer_pretty(&mut *out, &value)?;
            writeln!(out)?;
        }
        Output::Table => {
            write_table(out, cfg, estimate, plan, written, host)?;
            if !suggestions.is_empty() {
                writeln!(
                    out,
                    "what would fit, outside the knobs (each re-planned into the same budget; its upper bound):"
                )?;
                for s in suggestions {
                    writeln!(out, "  - {s}")?;
                }
            }
            // The plan checks its final config's bound against the budget, not this one.
            let planned = plan
                .map(|p| format!("; {} after the plan (what the budget must hold)", p.upper()))
                .unwrap_or_default();
            writeln!(
                out,
                "upper bound at {level}: {upper} as configured{planned}"
            )?;
            if let Some(b) = pod_budget {
                let source = serde_json::to_value(&b.source)?;
                let detail = source["detail"].as_str().map(|d| format!(": {d}"));
                writeln!(
                    out,
                    "budget from {}{} (one device {} × {})",
                    source["kind"].as_str().unwrap_or_default(),
                    detail.unwrap_or_default(),
                    b.device_memory,
                    b.safety_ratio
                )?;
            }
        }
    }
    Ok(())
}

/// Each warning of the budget stage on stderr (the plan's own are in the output).
fn warn(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
}

/// The pod the `--gpu-resource`, `--gpu-product`, `--pod-annotation` and `--dra-claim` flags
/// describe, and the `--dra` objects.
struct FlagsPod {
    pod: k8s_openapi::api::core::v1::Pod,
    dra: Option<std::sync::Arc<memguard_webhook::dra::StaticCatalog>>,
}

/// A pod with one trainer asking for the `--gpu-resource`s, pinned to the `--gpu-product`,
/// carrying the `--pod-annotation`s and the `--dra-claim`: what admission would see. `None`
/// without those flags.
fn pod_of_flags(args: &Args) -> Result<Option<FlagsPod>, String> {
    use memguard_api::pod::{AMD_GPU_PRODUCT_LABEL, AMD_GPU_RESOURCE};
    if args.gpu_resource.is_empty()
        && args.gpu_product.is_none()
        && args.pod_annotation.is_empty()
        && args.dra_claim.is_none()
    {
        return Ok(None);
    }
    let dra = crate::mutate::read_dra(&args.dra).map_err(|e| format!("--dra: {e}"))?;
    if args.dra_claim.is_some() && dra.is_none() {
        return Err("--dra-claim needs --dra FILE (the DRA objects to read)".into());
    }
    let mut limits = serde_json::Map::new();
    for r in &args.gpu_resource {
        let (name, qty) = r.split_once('=').unwrap_or((r, "1"));
        let (name, qty) = (name.trim(), qty.trim());
        if !name.contains('/') {
            return Err(format!(
                "--gpu-resource: `{name}` is not an extended resource (e.g. nvidia.com/mig-1g.10gb)"
            ));
        }
        if memguard_api::pod::parse_quantity(qty).is_none() {
            return Err(format!("--gpu-resource: `{qty}` is not a quantity"));
        }
        limits.insert(name.to_string(), json!(qty));
    }
    let mut annotations = serde_json::Map::new();
    for a in &args.pod_annotation {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| format!("--pod-annotation: `{a}` is not KEY=VALUE"))?;
        annotations.insert(k.trim().to_string(), json!(v.trim()));
    }
    let mut spec = json!({"containers": [{"name": "trainer", "image": "trainer",
        "resources": {"limits": limits}}]});
    if let Some(product) = &args.gpu_product {
        let label = if limits.contains_key(AMD_GPU_RESOURCE) {
            AMD_GPU_PRODUCT_LABEL
        } else {
            memguard_api::wellknown::NVIDIA_GPU_PRODUCT_LABEL
        };
        spec["nodeSelector"] = json!({ label: product });
    }
    // The pod lives where the claim's object does: offline there is no other namespace.
    let mut namespace = "default".to_string();
    if let (Some(claim), Some(catalog)) = (&args.dra_claim, &dra) {
        let (field, name) = match claim.strip_prefix("claim/") {
            Some(n) => ("resourceClaimName", n),
            None => ("resourceClaimTemplateName", claim.as_str()),
        };
        let found = match field {
            "resourceClaimName" => catalog
                .claims
                .iter()
                .find(|c| c.metadata.name == name)
                .map(|c| c.metadata.namespace.clone()),
            _ => catalog
                .templates
                .iter()
                .find(|t| t.metadata.name == name)
                .map(|t| t.metadata.namespace.clone()),
        };
        if let Some(Some(ns)) = found {
            namespace = ns;
        }
        spec["resourceClaims"] = json!([{"name": "gpu", field: name}]);
    }
    let pod = serde_json::from_value(json!({
        "metadata": {"name": "estimate", "namespace": namespace, "annotations": annotations},
        "spec": spec,
    }))
    .map_err(|e| format!("the pod the flags describe: {e}"))?;
    Ok(Some(FlagsPod { pod, dra }))
}

/// `--policy-file`, checked as the webhook checks it; the built-in policy without one.
fn read_policy(path: Option<&std::path::Path>) -> Result<Policy, String> {
    let Some(path) = path else {
        return Ok(Policy::default());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--policy-file: reading {}: {e}", path.display()))?;
    memguard_webhook::policy_sources::policy_from_str(Some(&text), &Default::default())
        .map_err(|errors| format!("--policy-file {}: {}", path.display(), errors.join("; ")))
}

/// `--list-models`: the policy's models first (what a pod's name resolves to first), each marked
/// `policy` with its aliases and the built-in model it shadows; then the built-in names, one per
/// line, a shadowed one marked so.
fn list_models(out: &mut impl Write, models: &ModelCatalog) -> std::io::Result<()> {
    let policy = models.policy_models();
    for m in policy {
        let mut notes = vec!["policy".to_string()];
        if !m.aliases.is_empty() {
            notes.push(format!("aliases: {}", m.aliases.join(", ")));
        }
        if let Some(builtin) = &m.shadows {
            notes.push(format!("shadows the built-in {builtin}"));
        }
        writeln!(out, "{} ({})", m.name, notes.join("; "))?;
    }
    for name in catalog::names() {
        match policy.iter().find(|m| m.shadows.as_deref() == Some(name)) {
            Some(m) => writeln!(
                out,
                "{name} (built-in, shadowed by the policy's {})",
                m.name
            )?,
            None => writeln!(out, "{name}")?,
        }
    }
    Ok(())
}

/// Reads `--model-config`: the shape, and the storage bits and double quantization of its
/// `quantization_config` unless `--model-bits` / `--double-quant` say otherwise.
fn read_model_config(
    path: &std::path::Path,
    keys: &mut BTreeMap<String, String>,
) -> Result<memguard_estimator::ModelShape, Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| vec![format!("--model-config {}: {e}", path.display())])?;
    let model = memguard_api::hf_config::parse(&text).map_err(|errors| {
        errors
            .into_iter()
            .map(|e| format!("--model-config {}: {e}", path.display()))
            .collect::<Vec<_>>()
    })?;
    if let Some(bits) = model.model_bits {
        keys.entry("model-bits".into())
            .or_insert_with(|| bits.to_string());
    }
    if model.double_quant {
        keys.entry("double-quant".into())
            .or_insert_with(|| "true".into());
    }
    // The shape carries the config's attention dropout; an explicit flag still overrides it.
    Ok(model.shape)
}

/// `--server-command`: the pod the flags describe, running the command in a shell, through the
/// webhook's serving decision.
fn server_command(
    args: &Args,
    command: &str,
    policy: &Policy,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    // A product alone asks for no GPU (the server would run on the CPU, which memguard does not
    // fit): name the flags that do.
    if args.gpu_resource.is_empty() && args.dra_claim.is_none() && args.pod_annotation.is_empty() {
        return Ok(bad_input([
            "--server-command: say the GPU the server's pod asks for: --gpu-resource \
             nvidia.com/gpu (a whole GPU, or a MIG/HAMi resource) with --gpu-product for its \
             memory, a KAI/HAMi --pod-annotation, or --dra-claim; memguard fits servers to GPU \
             memory only"
                .to_string(),
        ]));
    }
    let flags_pod = match pod_of_flags(args) {
        Ok(p) => p,
        Err(message) => return Ok(bad_input([message])),
    };
    let (mut pod, dra) = match flags_pod {
        Some(p) => (p.pod, p.dra),
        None => (
            serde_json::from_value(json!({
                "metadata": {"name": "estimate", "namespace": "default"},
                "spec": {"containers": [{"name": "server", "image": "server"}]},
            }))?,
            None,
        ),
    };
    if let Some(spec) = pod.spec.as_mut()
        && let Some(c) = spec.containers.first_mut()
    {
        c.command = Some(vec!["sh".into(), "-c".into(), command.to_string()]);
    }
    if let Some(model) = &args.model {
        pod.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(memguard_api::annotations::MODEL.to_string(), model.clone());
    }
    let mut profiles = memguard_webhook::ClusterView::default();
    if let Some(dra) = dra {
        profiles = profiles.with_dra(dra);
    }
    let json = args.output == Output::Json;
    match crate::serving::write(out, json, &pod, policy, &profiles) {
        None => Ok(bad_input([format!(
            "--server-command: `{command}` launches no server memguard knows (vllm serve, \
             python -m vllm.entrypoints.openai.api_server, python -m sglang.launch_server)"
        )])),
        Some(written) => match written? {
            Ok(true) => Ok(ExitCode::SUCCESS),
            Ok(false) => Ok(ExitCode::from(super::EXIT_DOES_NOT_FIT)),
            Err(e) => Ok(bad_input([e])),
        },
    }
}

/// `--serve`: weights plus the KV-cache ceiling; with a budget, whether it fits and how many
/// sequences would.
fn serve(
    args: &Args,
    cfg: &TrainingConfig,
    budget: Option<Bytes>,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    // Serving has no batch, accumulation or training method: say which flags it ignored.
    let ignored: Vec<&str> = [
        ("--method", args.method.is_some()),
        ("--batch-size", args.batch_size.is_some()),
        ("--grad-accumulation", args.grad_accumulation.is_some()),
        ("--grad-checkpointing", args.grad_checkpointing.is_some()),
        ("--optimizer", args.optimizer.is_some()),
        ("--lora-rank", args.lora_rank.is_some()),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .collect();
    if !ignored.is_empty() {
        eprintln!(
            "note: --serve ignores {} (training flags; the KV cache is sized by --max-sequences \
             and --seq-length)",
            ignored.join(", ")
        );
    }
    let mut serving = ServingConfig::new(cfg.model.clone());
    serving.model_bits = cfg.model_bits.unwrap_or(16);
    serving.max_seq_length = cfg.seq_length;
    serving.max_sequences = args.max_sequences;
    serving.kv_cache_bits = args.kv_cache_bits;
    serving.device = cfg.device;
    let estimate = match estimate_serving(&serving) {
        Ok(e) => e,
        Err(errors) => return Ok(bad_input(errors.iter().map(|e| format!("--{e}")))),
    };
    let max_fitting = budget.map(|b| max_sequences_within(&serving, b));
    match args.output {
        Output::Json => {
            let mut value = json!({
                "model": cfg.model.name,
                "mode": "serve",
                "max_sequences": serving.max_sequences,
                "max_seq_length": serving.max_seq_length,
                "total_bytes": estimate.total.0,
                "tensor_peak_bytes": estimate.tensor_peak.0,
                "components": components_json(&estimate),
            });
            if let (Some(budget), Some(max)) = (budget, max_fitting) {
                value["budget_bytes"] = json!(budget.0);
                value["fits"] = json!(estimate.total <= budget);
                value["max_sequences_within_budget"] = json!(max);
            }
            serde_json::to_writer_pretty(&mut *out, &value)?;
            writeln!(out)?;
        }
        Output::Table => {
            let name = cfg.model.name.as_deref().unwrap_or("custom shape");
            writeln!(
                out,
                "{name}: serving {} sequences × {} tokens, {}-bit weights, {}-bit KV cache on {}",
                serving.max_sequences,
                serving.max_seq_length,
                serving.model_bits,
                serving.kv_cache_bits,
                serving.device
            )?;
            writeln!(out)?;
            write_components(out, &estimate)?;
            if let (Some(budget), Some(max)) = (budget, max_fitting) {
                let verdict = if estimate.total <= budget {
                    "fits"
                } else {
                    "DOES NOT FIT"
                };
                writeln!(out)?;
                writeln!(
                    out,
                    "budget {budget}: {verdict}; at most {max} sequences fit"
                )?;
            }
        }
    }
    // As for training: a ceiling over the budget exits 3.
    if budget.is_some_and(|b| estimate.total > b) {
        return Ok(ExitCode::from(super::EXIT_DOES_NOT_FIT));
    }
    Ok(ExitCode::SUCCESS)
}

/// The most sequences whose KV-cache ceiling fits `budget` (0 when not even one does).
fn max_sequences_within(serving: &ServingConfig, budget: Bytes) -> u64 {
    let fits = |n: u64| {
        let mut c = serving.clone();
        c.max_sequences = n;
        estimate_serving(&c).is_ok_and(|e| e.total <= budget)
    };
    if !fits(1) {
        return 0;
    }
    // Doubling, then bisection: the total grows monotonically with the sequence count.
    let (mut lo, mut hi) = (1u64, 2u64);
    while fits(hi) {
        lo = hi;
        if hi >= 1 << 20 {
            return lo;
        }
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Each component with its share, then the tensor peak and the total.
fn write_components(out: &mut impl Write, estimate: &Estimate) -> std::io::Result<()> {
    writeln!(out, "{:<20} {:>12} {:>7}", "component", "memory", "share")?;
    let total = estimate.total.as_f64().max(1.0);
    for (component, bytes) in &estimate.components {
        writeln!(
            out,
            "{:<20} {:>12} {:>6.1}%",
            component.name(),
            bytes.to_string(),
            100.0 * bytes.as_f64() / total
        )?;
    }
    writeln!(
        out,
        "{:<20} {:>12}",
        "tensor peak",
        estimate.tensor_peak.to_string()
    )?;
    writeln!(out, "{:<20} {:>12}", "total", estimate.total.to_string())
}

/// Prints each problem on its own line and returns the bad-input exit code.
fn bad_input(messages: impl IntoIterator<Item = String>) -> ExitCode {
    for m in messages {
        eprintln!("error: {m}");
    }
    ExitCode::from(super::EXIT_BAD_INPUT)
}

/// `--budget`, else gpu-memory × safety-ratio, else none.
fn resolve_budget(args: &Args, parsed: &TrainingAnnotations) -> Result<Option<Bytes>, String> {
    if let Some(b) = &args.budget {
        // Two figures for one budget: refused, rather than one of them silently ignored.
        let other: Vec<&str> = [
            ("--gpu-memory", args.gpu_memory.is_some()),
            ("--safety-ratio", args.safety_ratio.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect();
        if !other.is_empty() {
            return Err(format!(
                "--budget is the memory the plan aims at, and {} gives another (gpu-memory × \
                 safety-ratio); pick one",
                other.join(" and ")
            ));
        }
        // The one size parser: `--budget 40` is refused with "did you mean `40Gi`?".
        let size = Size::parse(b).map_err(|e| format!("--budget: {e}"))?;
        return Ok(Some(size.bytes()));
    }
    Ok(parsed.gpu_memory.map(|gpu| {
        Bytes::from_f64(gpu.as_f64() * parsed.safety_ratio.unwrap_or(DEFAULT_SAFETY_RATIO)).min(gpu)
    }))
}

fn config_json(cfg: &TrainingConfig) -> Value {
    json!({
        "batch_size": cfg.batch_size,
        "grad_accumulation": cfg.grad_accumulation,
        "grad_checkpointing": cfg.grad_checkpointing,
        "seq_length": cfg.seq_length,
        "lora_rank": if cfg.is_adapter() { Some(cfg.lora_rank) } else { None },
        "lora_layers": if cfg.is_adapter() { Some(cfg.adapted_layers()) } else { None },
        "grad_sync": cfg.grad_sync.name(),
    })
}

/// The components as a JSON object, name → bytes.
fn components_json(estimate: &Estimate) -> serde_json::Map<String, Value> {
    estimate
        .components
        .iter()
        .map(|(c, b)| (c.name().to_string(), json!(b.0)))
        .collect()
}

fn to_json(cfg: &TrainingConfig, estimate: &Estimate, plan: Option<&DowngradePlan>) -> Value {
    let mut value = json!({
        "model": cfg.model.name,
        "method": cfg.method.name(),
        "precision": cfg.precision.name(),
        "device": cfg.device.name(),
        "total_bytes": estimate.total.0,
        "tensor_peak_bytes": estimate.tensor_peak.0,
        "components": components_json(estimate),
    });
    if let Some(plan) = plan {
        let steps: Vec<Value> = plan
            .steps
            .iter()
            .map(|s| {
                json!({
                    "rung": s.rung.name(),
                    "explanation": s.explanation,
                    "total_after_bytes": s.total_after.0,
                })
            })
            .collect();
        value["budget_bytes"] = json!(plan.budget.0);
        value["fits"] = json!(plan.fits);
        value["steps"] = json!(steps);
        value["config"] = config_json(&plan.config);
        value["planned_total_bytes"] = json!(plan.total().0);
        value["planned_upper_bytes"] = json!(plan.upper().0);
        value["planned_tensor_peak_bytes"] = json!(plan.estimate.tensor_peak.0);
    }
    value
}

fn write_table(
    out: &mut impl Write,
    cfg: &TrainingConfig,
    estimate: &Estimate,
    plan: Option<&DowngradePlan>,
    written: Option<&Size>,
    host: Option<&HostFigure>,
) -> std::io::Result<()> {
    let name = cfg.model.name.as_deref().unwrap_or("custom shape");
    writeln!(
        out,
        "{name}: {} training, {}, {} on {}, parallelism {} × {}; batch {} × seq {}, \
         accumulation {}, checkpointing {}",
        cfg.method,
        cfg.precision,
        cfg.optimizer,
        cfg.device,
        cfg.parallelism.name(),
        cfg.world_size,
        cfg.batch_size,
        cfg.seq_length,
        cfg.grad_accumulation,
        if cfg.grad_checkpointing { "on" } else { "off" },
    )?;
    writeln!(out)?;
    write_components(out, estimate)?;
    if let Some(host) = host {
        write!(out, "{}", host.table_lines())?;
    }
    let Some(plan) = plan else {
        return Ok(());
    };
    writeln!(out)?;
    match written.filter(|w| w.bytes() == plan.budget) {
        Some(w) => writeln!(out, "budget {w} ({})", plan.budget)?,
        None => writeln!(out, "budget {}", plan.budget)?,
    }
    if plan.steps.is_empty() && plan.fits {
        writeln!(out, "fits as configured: no downgrade needed")?;
        return Ok(());
    }
    for (i, step) in plan.steps.iter().enumerate() {
        writeln!(
            out,
            "  {}. {:<20} {}  → {}",
            i + 1,
            step.rung.name(),
            step.explanation,
            step.total_after
        )?;
    }
    let c = &plan.config;
    if plan.fits {
        writeln!(
            out,
            "fits after {} step(s): batch {}, accumulation {}, checkpointing {}, seq {}{}{}",
            plan.steps.len(),
            c.batch_size,
            c.grad_accumulation,
            if c.grad_checkpointing { "on" } else { "off" },
            c.seq_length,
            if c.is_adapter() {
                format!(", LoRA rank {}, layers {}", c.lora_rank, c.adapted_layers())
            } else {
                String::new()
            },
            if c.grad_sync == GradSync::EachBatch {
                ", gradients synced each batch"
            } else {
                ""
            }
        )?;
    } else {
        // The verdict is taken against the upper bound: say it, and the shortfall from it.
        let upper = match plan.bound.level {
            Some(level) => format!(" (upper bound {} at {level})", plan.upper()),
            None => String::new(),
        };
        writeln!(
            out,
            "DOES NOT FIT: even fully downgraded it needs {}{upper} of {} ({} short)",
            plan.total(),
            plan.budget,
            Bytes(plan.upper().0.saturating_sub(plan.budget.0))
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_api::Knob;
    use memguard_api::annotations::{CONTAINER, ENV_MAP, INPUT_KEYS, PREFIX};
    use std::collections::BTreeSet;

    /// Every annotation a pod may carry is a flag, and every such flag an annotation, except
    /// what only a pod has (which container trains, its own variables); so every knob is one.
    #[test]
    fn the_annotation_flags_are_the_apis_annotation_keys() {
        let flags: BTreeSet<&str> = ANNOTATION_FLAGS.iter().copied().collect();
        let keys: BTreeSet<&str> = INPUT_KEYS
            .iter()
            .filter(|k| ![CONTAINER, ENV_MAP].contains(k))
            .filter_map(|k| k.strip_prefix(PREFIX))
            .collect();
        assert_eq!(flags, keys);
        assert!(Knob::ALL.iter().all(|k| flags.contains(k.name())));
        // And clap serves each under that very name.
        let command = <Args as clap::Args>::augment_args(clap::Command::new("estimate"));
        let longs: BTreeSet<&str> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .collect();
        assert!(flags.is_subset(&longs), "{:?}", flags.difference(&longs));
    }
}
