use super::*;
use crate::catalog;
use crate::config::{LoraTargets, Norms};

fn model(name: &str) -> TrainingConfig {
    TrainingConfig::new(catalog::lookup(name).expect("catalog"))
}

fn est(cfg: &TrainingConfig) -> Estimate {
    estimate(cfg).expect("valid config")
}

fn per_param(bytes: Bytes, params: f64) -> f64 {
    bytes.as_f64() / params
}

/// Weights + master + gradients + optimizer states, per parameter.
fn static_per_param(cfg: &TrainingConfig) -> f64 {
    let e = est(cfg);
    let p = params::total_params(&cfg.model) as f64;
    let parts = [
        Component::Weights,
        Component::MasterWeights,
        Component::Gradients,
        Component::OptimizerStates,
    ];
    parts.iter().map(|c| per_param(e.component(*c), p)).sum()
}

#[test]
fn components_sum_to_the_totals_and_tensor_peak_excludes_runtime() {
    let e = est(&model("llama-3-8b"));
    let sum: Bytes = e.components.iter().map(|(_, b)| *b).sum();
    assert_eq!(sum, e.total);
    let tensors: Bytes = e
        .components
        .iter()
        .filter(|(c, _)| c.is_tensor())
        .map(|(_, b)| *b)
        .sum();
    assert_eq!(tensors, e.tensor_peak);
    assert_eq!(e.component(Component::RuntimeOverhead), CUDA_CONTEXT);
}

#[test]
fn full_finetune_holds_16_bytes_per_parameter_under_fp32_and_mixed_precision() {
    for precision in [Precision::Fp32, Precision::Bf16Mixed, Precision::Fp16Mixed] {
        let mut cfg = model("llama-3-8b");
        cfg.precision = precision;
        let b = static_per_param(&cfg);
        assert!((b - 16.0).abs() < 1e-6, "{precision}: {b} B/param");
    }
}

#[test]
fn pure_bf16_halves_the_static_part_with_states_in_the_parameter_dtype() {
    let mut cfg = model("llama-3-8b");
    cfg.precision = Precision::Bf16;
    assert!((static_per_param(&cfg) - 8.0).abs() < 1e-6);
    let e = est(&cfg);
    let p = params::total_params(&cfg.model) as f64;
    assert!((per_param(e.component(Component::OptimizerStates), p) - 4.0).abs() < 1e-6);
}

#[test]
fn optimizer_states_depend_on_the_optimizer() {
    let states = |o: Optimizer| {
        let mut cfg = model("llama-3-8b");
        cfg.optimizer = o;
        let p = params::total_params(&cfg.model) as f64;
        per_param(est(&cfg).component(Component::OptimizerStates), p)
    };
    assert!((states(Optimizer::AdamW) - 8.0).abs() < 1e-6);
    assert!((states(Optimizer::Adam) - 8.0).abs() < 1e-6);
    assert_eq!(states(Optimizer::Sgd), 0.0);
    assert!((states(Optimizer::SgdMomentum) - 4.0).abs() < 1e-6);
    let eight_bit = states(Optimizer::AdamW8bit);
    assert!(eight_bit > 2.0 && eight_bit < 2.1, "{eight_bit}");
    // Factored: rows + columns per matrix, a tiny fraction of one state per parameter.
    assert!(states(Optimizer::Adafactor) < 0.01);
}

#[test]
fn qlora_stores_half_a_byte_per_quantized_weight_plus_block_scales() {
    let mut cfg = model("llama-2-7b");
    cfg.method = Method::Qlora;
    let e = est(&cfg);
    let m = &cfg.model;
    let counts = ParamCounts::of(m);
    let unq = counts.unquantized(m.num_layers) as f64;
    let quantized = params::total_params(m) as f64 - unq;
    let adapters = trainable_params(&cfg, 0.0) * 4.0;
    let expected = quantized * 0.5 + unq * 2.0 + adapters;
    assert!((e.component(Component::Weights).as_f64() - expected).abs() < 2.0);
    // An 8-bit base keeps embeddings, head and norms 16-bit too.
    cfg.model_bits = Some(8);
    let eight = est(&cfg).component(Component::Weights).as_f64();
    assert!((eight - (quantized + unq * 2.0 + adapters)).abs() < 2.0);
    cfg.model_bits = None;
    let scales = e.component(Component::QuantScales).as_f64();
    assert!((scales - quantized / 64.0 * 4.0).abs() < 2.0);

    cfg.double_quant = true;
    let dq = est(&cfg).component(Component::QuantScales).as_f64();
    // 8-bit scales plus one fp32 per 256 of them: ~0.127 instead of 0.5 bits per weight.
    assert!((dq / scales - (1.0 + 4.0 / 256.0) / 4.0).abs() < 1e-3);
}

#[test]
fn bitsandbytes_linears_keep_their_input_unless_checkpointing_drops_it() {
    let mut lora = model("llama-2-7b");
    lora.method = Method::Lora;
    lora.grad_checkpointing = false;
    let mut qlora = lora.clone();
    qlora.method = Method::Qlora;
    let acts = |c: &TrainingConfig| est(c).component(Component::Activations).as_f64();
    let m = &lora.model;
    let tokens = (lora.batch_size * lora.seq_length) as f64;
    // One bf16 copy of each distinct linear input: two norm outputs, attention output, product.
    let inputs = 2.0 * (2 * m.hidden_size + m.q_dim() + m.intermediate_size) as f64;
    let expected = tokens * m.num_layers as f64 * inputs;
    assert!((acts(&qlora) - acts(&lora) - expected).abs() < 2.0);
    // LLM.int8 keeps it too (`ctx.tensors = (CAt, subA, A)`).
    qlora.model_bits = Some(8);
    assert!((acts(&qlora) - acts(&lora) - expected).abs() < 2.0);
    // Reentrant checkpointing runs the forward without a graph: nothing kept.
    lora.grad_checkpointing = true;
    qlora.grad_checkpointing = true;
    assert_eq!(acts(&qlora), acts(&lora));
    // Full fine-tuning of a 16-bit model: no quantized linear.
    let mut full = model("llama-2-7b");
    full.grad_checkpointing = false;
    full.model_bits = Some(16);
    let mut plain = full.clone();
    plain.model_bits = None;
    assert_eq!(acts(&full), acts(&plain));
}

#[test]
fn lora_trains_only_the_adapters() {
    let mut cfg = model("llama-3-8b");
    cfg.method = Method::Lora;
    cfg.lora_targets = LoraTargets::ALL_LINEAR;
    let e = est(&cfg);
    let adapters = trainable_params(&cfg, 0.0);
    assert!(adapters > 1e7 && adapters < 1e8, "{adapters}");
    assert_eq!(
        e.component(Component::Gradients),
        Bytes::from_f64(adapters * 4.0)
    );
    // Frozen base in bf16: 2 bytes per parameter plus fp32 adapters.
    let p = params::total_params(&cfg.model) as f64;
    assert_eq!(
        e.component(Component::Weights),
        Bytes::from_f64(p * 2.0 + adapters * 4.0)
    );
}

#[test]
fn lora_rank_and_layers_scale_the_adapter() {
    let mut cfg = model("llama-3-8b");
    cfg.method = Method::Lora;
    let base = trainable_params(&cfg, 0.0);
    cfg.lora_rank *= 2;
    assert!((trainable_params(&cfg, 0.0) - 2.0 * base).abs() < 1.0);
    cfg.lora_rank /= 2;
    cfg.lora_layers = Some(16);
    assert!((trainable_params(&cfg, 0.0) - base / 2.0).abs() < 1.0);
}

#[test]
fn dora_adds_magnitudes_and_activations_over_lora() {
    let mut lora = model("llama-3-8b");
    lora.method = Method::Lora;
    let mut dora = lora.clone();
    dora.method = Method::Dora;
    let (l, d) = (est(&lora), est(&dora));
    let magnitudes = 32.0 * (4096.0 + 1024.0);
    assert!((trainable_params(&dora, 0.0) - trainable_params(&lora, 0.0) - magnitudes).abs() < 1.0);
    assert!(d.component(Component::Activations) > l.component(Component::Activations));
    assert!(d.total > l.total);
}

#[test]
fn moe_counts_every_expert_in_the_weights_and_only_routed_experts_in_activations() {
    let mixtral = model("mixtral-8x7b");
    let mut one_expert = mixtral.clone();
    one_expert.model.num_experts = 1;
    one_expert.model.experts_per_token = 1;
    one_expert.model.params = None;
    let moe = ParamCounts::of(&mixtral.model);
    let dense = ParamCounts::of(&one_expert.model);
    let ffn = (moe.ffn_per_expert * mixtral.model.num_layers) as f64;
    let extra = moe.total as f64 - dense.total as f64;
    // Seven more experts' FFNs (plus the tiny router), counted exactly once.
    assert!((extra / ffn - 7.0).abs() < 0.01, "{}", extra / ffn);

    let mut top1 = mixtral.clone();
    top1.model.experts_per_token = 1;
    let act = |c: &TrainingConfig| est(c).component(Component::Activations).as_f64();
    assert!(act(&mixtral) > act(&top1));
    let ffn_bytes = 4.0 * 2.0 * 14336.0 * 2048.0 * 32.0;
    assert!((act(&mixtral) - act(&top1) - ffn_bytes).abs() / ffn_bytes < 1e-9);
}

#[test]
fn gradient_checkpointing_keeps_one_input_per_layer_plus_one_layer() {
    let mut cfg = model("llama-3-8b");
    cfg.batch_size = 4;
    let full = est(&cfg).component(Component::Activations);
    cfg.grad_checkpointing = true;
    let ckpt = est(&cfg).component(Component::Activations);
    assert!(ckpt.as_f64() < full.as_f64() / 4.0);
    let tokens = 4.0 * 2048.0;
    let layer = layer_activation_bytes_per_token(&cfg, 2.0);
    let expected = tokens * (32.0 * 2.0 * 4096.0 + layer + 6.0 * 4096.0);
    assert!((ckpt.as_f64() - expected).abs() < 2.0);
}

#[test]
fn attention_without_flash_grows_with_the_square_of_the_sequence() {
    let act = |seq: u64, flash: bool| {
        let mut cfg = model("llama-2-7b");
        cfg.seq_length = seq;
        cfg.flash_attention = flash;
        est(&cfg).component(Component::Activations).as_f64()
    };
    // Linear with flash attention: doubling the sequence doubles the activations.
    assert!((act(4096, true) / act(2048, true) - 2.0).abs() < 1e-9);
    // Without it the scores add heads·S² per layer: more than double.
    assert!(act(4096, false) / act(2048, false) > 2.5);
    assert!(act(2048, false) > act(2048, true));
}

#[test]
fn logits_dominate_small_models_with_large_vocabularies() {
    let mut cfg = model("qwen2.5-0.5b");
    cfg.batch_size = 8;
    let e = est(&cfg);
    let logits = e.component(Component::Logits);
    let expected = 8.0 * 2048.0 * 151_936.0 * (2.0 + 12.0);
    assert_eq!(logits, Bytes::from_f64(expected));
    assert_eq!(e.components[0].0, Component::Logits);
}

#[test]
fn classifiers_without_an_lm_head_have_no_logits() {
    let cfg = model("bert-large-uncased");
    assert_eq!(est(&cfg).component(Component::Logits), Bytes::ZERO);
}

#[test]
fn full_finetuning_activations_use_every_layer_whatever_lora_layers_says() {
    let mut cfg = model("llama-3-8b");
    let all = est(&cfg).component(Component::Activations);
    cfg.lora_layers = Some(2);
    assert_eq!(est(&cfg).component(Component::Activations), all);
}

#[test]
fn zero_stages_shard_what_they_promise() {
    let shard = |par: Parallelism, n: u64| {
        let mut cfg = model("llama-3-8b");
        cfg.parallelism = par;
        cfg.world_size = n;
        est(&cfg)
    };
    let one = shard(Parallelism::Zero1, 1);
    let z1 = shard(Parallelism::Zero1, 8);
    let z2 = shard(Parallelism::Zero2, 8);
    let z3 = shard(Parallelism::Zero3, 8);
    let states = Component::OptimizerStates;
    assert_eq!(z1.component(states).0, one.component(states).0.div_ceil(8));
    assert_eq!(
        z1.component(Component::Weights),
        one.component(Component::Weights)
    );
    assert!(z2.component(Component::Gradients) < z1.component(Component::Gradients));
    assert!(z3.component(Component::Weights) < z2.component(Component::Weights));
    assert!(z3.tensor_peak < z2.tensor_peak && z2.tensor_peak < z1.tensor_peak);
}

#[test]
fn ddp_replicates_everything_and_adds_gradient_buckets() {
    let mut single = model("llama-3.2-1b");
    single.precision = Precision::Bf16;
    let mut ddp = single.clone();
    ddp.parallelism = Parallelism::Ddp;
    ddp.world_size = 4;
    let p = params::total_params(&single.model) as f64;
    let diff = est(&ddp).tensor_peak.as_f64() - est(&single).tensor_peak.as_f64();
    assert!((diff - p * 2.0).abs() < 4.0, "{diff}");
}

#[test]
fn device_kinds_carry_their_own_runtime_overhead() {
    let mut cfg = model("gpt2");
    cfg.device = Device::Cpu;
    let cpu = est(&cfg);
    assert_eq!(
        cpu.component(Component::RuntimeOverhead),
        CPU_PROCESS_BASELINE
    );
    cfg.device = Device::Metal;
    let metal = est(&cfg);
    assert_eq!(metal.component(Component::AllocatorCache), Bytes::ZERO);
    assert_eq!(metal.total, metal.tensor_peak + METAL_RUNTIME);
    cfg.device = Device::Cuda;
    let cuda = est(&cfg);
    cfg.device = Device::Rocm;
    let rocm = est(&cfg);
    assert_eq!(rocm.component(Component::RuntimeOverhead), ROCM_CONTEXT);
    assert_eq!(
        rocm.component(Component::AllocatorCache),
        cuda.component(Component::AllocatorCache),
        "same caching allocator"
    );
    assert_eq!(rocm.total + CUDA_CONTEXT, cuda.total + ROCM_CONTEXT);
}

#[test]
fn allocator_cache_scales_with_per_step_tensors_not_with_weights() {
    let mut small_batch = model("llama-3-8b");
    small_batch.method = Method::Lora;
    let mut big_batch = small_batch.clone();
    big_batch.batch_size = 8;
    let cache = |c: &TrainingConfig| est(c).component(Component::AllocatorCache).as_f64();
    let per_step = |c: &TrainingConfig| {
        let e = est(c);
        e.components
            .iter()
            .filter(|(k, _)| k.is_tensor() && !k.is_static())
            .map(|(_, b)| b.as_f64())
            .sum::<f64>()
    };
    for cfg in [&small_batch, &big_batch] {
        let expected = per_step(cfg) * CUDA_CACHE_FRACTION;
        assert!((cache(cfg) - expected).abs() < 2.0);
    }
}

#[test]
fn a_published_parameter_count_drives_the_weight_sized_terms() {
    let mut cfg = model("llama-3-8b");
    cfg.model.params = Some(10_000_000_000);
    let e = est(&cfg);
    assert_eq!(
        e.component(Component::OptimizerStates),
        Bytes(80_000_000_000)
    );
}

#[test]
fn absurd_input_is_an_error_not_an_overflow() {
    let mut cfg = model("llama-3-8b");
    cfg.batch_size = u64::MAX;
    cfg.model.hidden_size = u64::MAX;
    let errors = estimate(&cfg).expect_err("caps exceeded");
    let fields: Vec<&str> = errors.iter().map(|e| e.field()).collect();
    assert!(fields.contains(&"batch-size") && fields.contains(&"hidden-size"));

    // At the caps themselves the estimate saturates instead of wrapping around.
    let mut max = model("llama-3-8b");
    max.batch_size = crate::config::limits::BATCH_SIZE;
    max.seq_length = crate::config::limits::SEQ_LENGTH;
    max.flash_attention = false;
    assert!(est(&max).total > Bytes::gib(1 << 20));
}

#[test]
fn an_explicit_head_dim_lifts_the_heads_divide_hidden_check() {
    let mut odd = model("gemma-2-9b");
    odd.model.num_heads = 6;
    odd.model.num_kv_heads = 6;
    // 6 heads of 256 over a 3584-wide model: valid with an explicit head_dim…
    assert!(estimate(&odd).is_ok());
    assert_eq!(odd.model.q_dim(), 6 * 256);
    // …and an error without one, since 6 does not divide 3584.
    odd.model.head_dim = None;
    let errors = estimate(&odd).expect_err("heads do not divide hidden");
    assert!(errors.iter().any(|e| e.field() == "num-heads"));
}

#[test]
fn the_loss_implementation_decides_what_the_logits_cost() {
    let mut cfg = model("llama-3-8b");
    cfg.batch_size = 2;
    cfg.seq_length = 4096;
    let logits = |loss: Loss| {
        let mut c = cfg.clone();
        c.loss = loss;
        est(&c).component(Component::Logits).as_f64()
    };
    let elements = 2.0 * 4096.0 * 128_256.0;
    // bf16 logits plus the fp32 loss's three tensors; plus one saved log-softmax per chunk.
    assert_eq!(logits(Loss::Standard), elements * (2.0 + 12.0));
    assert_eq!(logits(Loss::Chunked), elements * (2.0 + 4.0));
    // Fused: no B·S·V tensor at all, a few bytes per hidden element.
    assert_eq!(logits(Loss::Fused), 2.0 * 4096.0 * 4096.0 * (2.0 + 8.0));
    assert!(logits(Loss::Fused) * 10.0 < logits(Loss::Chunked));
    // Compiled, each chunk's graph saves its 16-bit input only: no fp32 tensor outlives it.
    let compiled = |loss: Loss| {
        let mut c = cfg.clone();
        c.loss = loss;
        c.compile = true;
        est(&c).component(Component::Logits).as_f64()
    };
    assert_eq!(compiled(Loss::Chunked), elements * 2.0);
    assert_eq!(compiled(Loss::Standard), elements * (2.0 + 12.0));
}

#[test]
fn torchao_8bit_adamw_holds_bitsandbytes_states_and_fp32_moments_of_one_tensor() {
    let mut cfg = model("llama-3-8b");
    cfg.precision = Precision::Bf16;
    cfg.seq_length = 512;
    let with = |o: Optimizer, in_backward: bool| {
        let mut c = cfg.clone();
        c.optimizer = o;
        c.optimizer_in_backward = in_backward;
        est(&c)
    };
    let (bnb, torchao) = (
        with(Optimizer::AdamW8bit, false),
        with(Optimizer::AdamW8bitTorchao, false),
    );
    assert_eq!(
        bnb.component(Component::OptimizerStates),
        torchao.component(Component::OptimizerStates)
    );
    // Two fp32 moments of the largest tensor, the 128,256 × 4,096 head; with the optimizer
    // in backward they are part of the backward peak.
    let moments = 2.0 * 4.0 * 128_256.0 * 4096.0;
    let transient = |e: &Estimate| e.component(Component::Transient).as_f64();
    let (bnb, torchao) = (
        with(Optimizer::AdamW8bit, true),
        with(Optimizer::AdamW8bitTorchao, true),
    );
    assert_eq!(transient(&torchao) - transient(&bnb), moments);
}

#[test]
fn attention_dropout_keeps_a_mask_and_a_dropped_copy_only_when_the_model_uses_it() {
    let mut cfg = model("llama-3-8b");
    cfg.flash_attention = false;
    cfg.seq_length = 1024;
    let without = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.model.attention_dropout = true;
    let with = layer_activation_bytes_per_token(&cfg, 2.0);
    // 32 heads · 1024 keys · (1-byte mask + 4-byte dropped probabilities).
    assert_eq!(with - without, 32.0 * 1024.0 * 5.0);
    // Flash attention keeps no S² tensor either way.
    cfg.flash_attention = true;
    let flash = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.model.attention_dropout = false;
    assert_eq!(flash, layer_activation_bytes_per_token(&cfg, 2.0));
    // GPT-2 and BERT train with attention dropout; current models do not.
    assert!(catalog::lookup("gpt2").is_some_and(|m| m.attention_dropout));
    assert!(catalog::lookup("qwen3-8b").is_some_and(|m| !m.attention_dropout));
}

#[test]
fn compile_keeps_only_the_inputs_of_norms_and_of_the_ffn_activation() {
    let mut cfg = model("llama-3-8b");
    let eager = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.compile = true;
    let compiled = layer_activation_bytes_per_token(&cfg, 2.0);
    let (h, i) = (4096.0, 14336.0);
    // Norms: 2·(4h + 2h) → 2·2h; gated FFN: 4·2·I → 2·2·I.
    assert_eq!(
        eager - compiled,
        2.0 * (4.0 * h + 2.0 * h - 2.0 * h) + 2.0 * 2.0 * i
    );
}

#[test]
fn offloading_moves_activations_and_optimizer_states_off_the_device() {
    let mut cfg = model("llama-3-8b");
    cfg.precision = Precision::Bf16;
    cfg.seq_length = 4096;
    let base = est(&cfg);
    cfg.activation_offload = true;
    let offloaded = est(&cfg);
    let acts = |e: &Estimate| e.component(Component::Activations).as_f64();
    // Two layers stay on the device instead of 32.
    assert!(acts(&offloaded) < acts(&base) / 10.0);
    cfg.optimizer_offload = true;
    let opt = est(&cfg);
    assert_eq!(opt.component(Component::OptimizerStates), Bytes::ZERO);
    assert!(opt.total < offloaded.total);
}

#[test]
fn the_optimizer_in_backward_never_holds_every_gradient() {
    let mut cfg = model("llama-3.2-3b");
    cfg.precision = Precision::Bf16;
    let all = est(&cfg).component(Component::Gradients).as_f64();
    cfg.optimizer_in_backward = true;
    let one = est(&cfg).component(Component::Gradients).as_f64();
    // Only the largest tensor's gradient (the 128 256 × 3072 embedding) at once.
    assert_eq!(one, 128_256.0 * 3072.0 * 2.0);
    assert!(one * 5.0 < all);
}

#[test]
fn fsdp_keeps_the_root_unit_unsharded_with_its_gradient() {
    let mut cfg = model("llama-3-8b");
    cfg.precision = Precision::Bf16;
    cfg.parallelism = Parallelism::Fsdp;
    cfg.world_size = 4;
    let fsdp = est(&cfg).component(Component::Transient).as_f64();
    cfg.parallelism = Parallelism::Zero3;
    let zero3 = est(&cfg).component(Component::Transient).as_f64();
    // Embedding and untied head (2 · 128 256 · 4096) plus the final norm, bf16 parameters and
    // bf16 gradient; ZeRO-3 gathers embeddings on use instead. FSDP also holds one unit's
    // unsharded gradient until its reduce-scatter, where ZeRO-3 has its reduce bucket.
    let root_params = 2.0 * 128_256.0 * 4096.0 + 4096.0;
    let root = root_params * (2.0 + 2.0);
    let unit_grad = (8_030_261_248f64 - root_params) / 32.0 * 2.0;
    let bucket = (8_030_261_248f64).min(5e8) * 2.0;
    assert!((fsdp - (zero3 - bucket + root + unit_grad)).abs() < 2.0);
}

#[test]
fn fsdp_accumulates_unsharded_gradients_and_zero_does_not() {
    let mut cfg = model("llama-3-8b");
    cfg.precision = Precision::Bf16;
    cfg.parallelism = Parallelism::Fsdp;
    cfg.world_size = 4;
    let grads = |c: &TrainingConfig| est(c).component(Component::Gradients).as_f64();
    let transient = |c: &TrainingConfig| est(c).component(Component::Transient).as_f64();
    let p = params::total_params(&cfg.model) as f64;
    assert!((grads(&cfg) - p * 2.0 / 4.0).abs() < 2.0);
    let synced = transient(&cfg);
    // no_sync: every unit keeps its full gradient until the last micro-batch.
    cfg.grad_accumulation = 4;
    assert!((grads(&cfg) - p * 2.0).abs() < 2.0);
    // The root's and the unit's unsharded gradients are then among them, not extras.
    let root = 2.0 * 128_256.0 * 4096.0 + 4096.0;
    let unit = (p - root) / 32.0;
    assert!((transient(&cfg) - (synced - root * 2.0 - unit * 2.0)).abs() < 2.0);
    // ZeRO-3 reduces into its partitions at every micro-batch.
    cfg.parallelism = Parallelism::Zero3;
    assert!((grads(&cfg) - p * 2.0 / 4.0).abs() < 2.0);
    // One device: nothing to shard.
    cfg.parallelism = Parallelism::Fsdp;
    cfg.world_size = 1;
    assert!((grads(&cfg) - p * 2.0).abs() < 2.0);
}

#[test]
fn lora_dropout_keeps_a_mask_and_a_dropped_input_per_adapted_projection() {
    let mut cfg = model("llama-2-7b");
    cfg.method = Method::Lora;
    cfg.precision = Precision::Bf16;
    let without = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.lora_dropout = true;
    // q and v read the hidden state: a bool mask and a bf16 copy of h each.
    let h = cfg.model.hidden_size as f64;
    assert_eq!(
        layer_activation_bytes_per_token(&cfg, 2.0) - without,
        2.0 * (1.0 + 2.0) * h
    );
    // Off CUDA the mask is a noise tensor in the input dtype.
    cfg.device = Device::Cpu;
    assert_eq!(
        layer_activation_bytes_per_token(&cfg, 2.0) - without,
        2.0 * (2.0 + 2.0) * h
    );
    // Full fine-tuning has no adapter to drop out.
    cfg.method = Method::Full;
    let full = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.lora_dropout = false;
    assert_eq!(layer_activation_bytes_per_token(&cfg, 2.0), full);
}

#[test]
fn a_quantized_head_is_a_separate_4bit_copy_dequantized_whole_at_its_backward() {
    // gemma-2-9b QLoRA as LitGPT runs it: tied in the checkpoint, a separate NF4 head.
    let mut cfg = model("gemma-2-9b");
    cfg.method = Method::Qlora;
    cfg.precision = Precision::Bf16;
    cfg.loss = Loss::Chunked;
    cfg.seq_length = 512;
    let before = est(&cfg);
    cfg.quantized_head = true;
    let after = est(&cfg);
    let (v, h) = (cfg.model.vocab_size as f64, cfg.model.hidden_size as f64);
    let delta = |c| after.component(c).as_f64() - before.component(c).as_f64();
    // Storage: V·h·4/8 beside the 16-bit embedding, plus one fp32 absmax per 64 weights.
    assert!((delta(Component::Weights) - v * h * 0.5).abs() < 1.0);
    assert!((delta(Component::QuantScales) - v * h / 64.0 * 4.0).abs() < 1.0);
    // At the head's backward: the dequantized head and the logits with their gradient,
    // instead of the loss's logits term and the blocks' largest dequantized matrix.
    let t = 512.0;
    let block = h * cfg.model.intermediate_size as f64 * 2.0;
    let expected = v * h * 2.0 + 2.0 * 2.0 * t * v - before.component(Component::Logits).as_f64();
    assert!((delta(Component::Transient) - (expected - block)).abs() < 16.0);
    // A 16-bit LoRA base has no quantized head whatever the flag says.
    cfg.method = Method::Lora;
    let lora = est(&cfg);
    cfg.quantized_head = false;
    assert_eq!(est(&cfg).tensor_peak, lora.tensor_peak);
}

#[test]
fn an_untied_quantized_head_leaves_the_16_bit_part() {
    let mut cfg = model("llama-3-8b");
    cfg.method = Method::Qlora;
    cfg.precision = Precision::Bf16;
    let before = est(&cfg).component(Component::Weights).as_f64();
    cfg.quantized_head = true;
    let after = est(&cfg).component(Component::Weights).as_f64();
    let vh = (cfg.model.vocab_size * cfg.model.hidden_size) as f64;
    assert!((before - after - vh * 1.5).abs() < 1.0);
}

#[test]
fn soft_capped_scores_keep_their_tanh_output_without_flash_attention() {
    let mut cfg = model("gemma-2-9b");
    cfg.precision = Precision::Bf16;
    cfg.flash_attention = false;
    assert!(cfg.model.attention_softcapping);
    let capped = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.model.attention_softcapping = false;
    let plain = layer_activation_bytes_per_token(&cfg, 2.0);
    let heads_s = cfg.model.num_heads as f64 * cfg.seq_length as f64;
    assert_eq!(capped - plain, heads_s * 2.0);
    // Flash attention keeps no scores at all.
    cfg.flash_attention = true;
    let flash = layer_activation_bytes_per_token(&cfg, 2.0);
    cfg.model.attention_softcapping = true;
    assert_eq!(layer_activation_bytes_per_token(&cfg, 2.0), flash);
}

#[test]
fn a_base_quantized_from_fp16_holds_each_dequantized_matrix_twice_under_bf16() {
    let mut cfg = model("llama-3-8b");
    cfg.method = Method::Qlora;
    cfg.precision = Precision::Bf16;
    cfg.loss = Loss::Chunked;
    let transient = |cfg: &TrainingConfig| est(cfg).component(Component::Transient).as_f64();
    let (h, i) = (
        cfg.model.hidden_size as f64,
        cfg.model.intermediate_size as f64,
    );
    let plain = transient(&cfg);
    cfg.quant_from_fp16 = true;
    // The blocks' largest matrix: fp16 from dequantize_4bit plus its bf16 copy.
    assert!((transient(&cfg) - plain - h * i * 2.0).abs() < 1.0);
    // A quantized head: the same for V·h.
    cfg.quantized_head = true;
    let both = transient(&cfg);
    cfg.quant_from_fp16 = false;
    let v = cfg.model.vocab_size as f64;
    assert!((both - transient(&cfg) - v * h * 2.0).abs() < 1.0);
    // Computing in fp16, `.to(fp16)` returns the dequantized tensor itself: no copy.
    cfg.precision = Precision::Fp16;
    let fp16 = transient(&cfg);
    cfg.quant_from_fp16 = true;
    assert_eq!(transient(&cfg), fp16);
}

#[test]
fn an_untied_head_on_a_tied_model_adds_its_own_parameters() {
    let mut cfg = model("gemma-2-2b");
    assert!(cfg.model.tie_embeddings);
    cfg.precision = Precision::Bf16;
    cfg.method = Method::Lora;
    let tied = est(&cfg).component(Component::Weights).as_f64();
    cfg.untied_head = true;
    let untied = est(&cfg).component(Component::Weights).as_f64();
    let vh = (cfg.model.vocab_size * cfg.model.hidden_size) as f64;
    // A 16-bit LoRA base holds the separate head in bf16.
    assert!((untied - tied - vh * 2.0).abs() < 1.0);
    // Full fine-tuning also trains it: weights, gradients and Adam states.
    cfg.method = Method::Full;
    let full = est(&cfg);
    cfg.untied_head = false;
    let full_tied = est(&cfg);
    let d = |c| full.component(c).as_f64() - full_tied.component(c).as_f64();
    assert!((d(Component::Gradients) - vh * 2.0).abs() < 1.0);
    assert!((d(Component::OptimizerStates) - vh * 4.0).abs() < 1.0);
    // An untied model is left as it is.
    let mut llama = model("llama-3-8b");
    let plain = est(&llama).tensor_peak;
    llama.untied_head = true;
    assert_eq!(est(&llama).tensor_peak, plain);
}

#[test]
fn varying_batch_shapes_fragment_the_caching_allocator_unless_packed_or_expandable() {
    let mut cfg = model("llama-3-8b");
    cfg.method = Method::Lora;
    cfg.seq_length = 4096;
    let even = est(&cfg);
    let cache = |e: &Estimate| e.component(Component::AllocatorCache).as_f64();
    let per_step = cache(&even) / CUDA_CACHE_FRACTION;
    cfg.seq_length_spread = 0.6;
    let spread = est(&cfg);
    let expected = per_step * (CUDA_CACHE_FRACTION + CUDA_FRAGMENTATION_PER_SPREAD * 0.6);
    assert!(
        (cache(&spread) - expected).abs() < 2.0,
        "{} vs {expected}",
        cache(&spread)
    );
    assert_eq!(
        spread.tensor_peak, even.tensor_peak,
        "the tensors are the same"
    );
    for fix in [
        |c: &mut TrainingConfig| c.packing = true,
        |c: &mut TrainingConfig| c.expandable_segments = true,
    ] {
        let mut fixed = cfg.clone();
        fix(&mut fixed);
        assert_eq!(est(&fixed).total, even.total);
    }
    // The CPU heap is another allocator: no term.
    let mut cpu = cfg.clone();
    cpu.device = Device::Cpu;
    let mut cpu_even = cpu.clone();
    cpu_even.seq_length_spread = 0.0;
    assert_eq!(est(&cpu).total, est(&cpu_even).total);
}

#[test]
fn a_spread_outside_zero_to_one_is_an_error_naming_it() {
    let mut cfg = model("llama-3-8b");
    for bad in [-0.1, 1.5, f64::NAN] {
        cfg.seq_length_spread = bad;
        let errors = estimate(&cfg).expect_err("invalid");
        assert!(
            errors.iter().any(|e| e.field() == "seq-length-spread"),
            "{errors:?}"
        );
    }
}

#[test]
fn zero_step_gradient_takes_its_own_segment_unless_segments_expand() {
    let reserve_gap = |parallelism: Parallelism, device: Device| {
        let mut cfg = model("llama-3-8b");
        cfg.precision = Precision::Bf16Mixed;
        cfg.parallelism = parallelism;
        cfg.world_size = 8;
        cfg.seq_length = 2048;
        cfg.device = device;
        let default = est(&cfg);
        cfg.expandable_segments = true;
        let expandable = est(&cfg);
        assert_eq!(default.tensor_peak, expandable.tensor_peak);
        default.component(Component::AllocatorCache).as_f64()
            - expandable.component(Component::AllocatorCache).as_f64()
    };
    // The fp32 gradient partition, one buffer of Pt·4/N, cannot reuse the backward's segments:
    // at most all of it, at least what the backward's own tensors leave uncovered.
    let buffer = params::total_params(&model("llama-3-8b").model) as f64 * 4.0 / 8.0;
    let gap = reserve_gap(Parallelism::Zero3, Device::Cuda);
    assert!(gap > 0.0 && gap <= buffer + 1.0, "{gap} of {buffer}");
    // Outside ZeRO there is no such buffer, and the CPU heap has no segments.
    assert_eq!(reserve_gap(Parallelism::Fsdp, Device::Cuda), 0.0);
    assert_eq!(reserve_gap(Parallelism::Zero3, Device::Cpu), 0.0);
}

/// Models × methods × precisions for the sharding sweeps: dense, GQA, MoE, MLA, a tied
/// small vocabulary-heavy model and one with a vision tower.
fn sharding_sweep() -> Vec<TrainingConfig> {
    let models = [
        "gpt2",
        "llama-3.2-1b",
        "llama-3-8b",
        "llama-3.1-70b",
        "mixtral-8x7b",
        "deepseek-v2-lite",
        "gemma-3-4b",
    ];
    let methods = [Method::Full, Method::Lora, Method::Qlora, Method::Dora];
    let precisions = [Precision::Bf16Mixed, Precision::Bf16, Precision::Fp32];
    let mut out = Vec::new();
    for name in models {
        for method in methods {
            for precision in precisions {
                let mut cfg = model(name);
                cfg.method = method;
                cfg.precision = precision;
                cfg.batch_size = 2;
                cfg.seq_length = 1024;
                cfg.grad_checkpointing = true;
                out.push(cfg);
            }
        }
    }
    out
}

const WORLD_SIZES: [u64; 13] = [1, 2, 3, 4, 8, 16, 24, 32, 64, 100, 128, 256, 512];

#[test]
fn every_sharded_component_falls_with_the_world_size_under_fsdp_and_zero3() {
    // Parameters, gradients, master weights, optimizer states and quantization scales are
    // divided by N: strictly smaller on every larger world. Everything else (gathered units,
    // FSDP's root unit, buckets, activations, the allocator's reserve) never grows with N once
    // sharding starts (N ≥ 2; FSDP's root unit exists only across ranks), and the total never
    // grows from N = 2 on. (issue 38: FSDP counted a whole-model transient on every rank.)
    let sharded = [
        Component::Weights,
        Component::QuantScales,
        Component::MasterWeights,
        Component::OptimizerStates,
        Component::Gradients,
    ];
    let mut checked = 0;
    for base in sharding_sweep() {
        for parallelism in [Parallelism::Fsdp, Parallelism::Zero3] {
            let at = |n: u64| {
                let mut cfg = base.clone();
                cfg.parallelism = parallelism;
                cfg.world_size = n;
                est(&cfg)
            };
            let runs: Vec<(u64, Estimate)> = WORLD_SIZES.iter().map(|&n| (n, at(n))).collect();
            for pair in runs.windows(2) {
                let ((n0, a), (n1, b)) = (&pair[0], &pair[1]);
                let what = format!(
                    "{:?} {} {} {parallelism:?} N {n0} → {n1}",
                    base.model.name, base.method, base.precision
                );
                for c in sharded {
                    if a.component(c) > Bytes::ZERO {
                        assert!(b.component(c) < a.component(c), "{what}: {c}");
                        checked += 1;
                    }
                }
                if *n0 >= 2 {
                    // The phase of the peak may move from the step to the backward as the
                    // step's sharded workspace shrinks, so the unsharded terms are compared
                    // by phase: the backward's workspace, then the peak as a whole.
                    let workspace = |n: u64| {
                        let mut cfg = base.clone();
                        cfg.parallelism = parallelism;
                        cfg.world_size = n;
                        forward_backward_workspace(&Ctx::new(&cfg))
                    };
                    assert!(workspace(*n1) <= workspace(*n0), "{what}: workspace grew");
                    let cache = Component::AllocatorCache;
                    assert!(
                        b.component(cache) <= a.component(cache),
                        "{what}: cache grew"
                    );
                    assert!(b.tensor_peak <= a.tensor_peak, "{what}: tensor peak grew");
                    assert!(b.total <= a.total, "{what}: total grew");
                }
            }
        }
    }
    assert!(
        checked > 1000,
        "the sweep checked {checked} sharded components"
    );
}

#[test]
fn fsdp_accumulating_under_no_sync_holds_whole_gradients_on_any_world() {
    // The exception to the sweep above, on purpose: with accumulation under `no_sync()` FSDP's
    // gradients do not fall with N; syncing each batch shards them again.
    let mut cfg = model("llama-3-8b");
    cfg.parallelism = Parallelism::Fsdp;
    cfg.grad_accumulation = 4;
    let grads = |c: &TrainingConfig, n: u64| {
        let mut c = c.clone();
        c.world_size = n;
        est(&c).component(Component::Gradients)
    };
    assert_eq!(grads(&cfg, 2), grads(&cfg, 256));
    cfg.grad_sync = crate::config::GradSync::EachBatch;
    assert!(grads(&cfg, 256) < grads(&cfg, 2));
}

#[test]
fn fsdp_and_zero3_agree_where_they_do_the_same_work() {
    // Pure bf16 or fp32 (no master copy, same dtypes) and no accumulation: both shard
    // parameters, gradients and states over N and gather the same two blocks in flight. They
    // differ by what each does alone: FSDP's root unit and one unit's unsharded gradient
    // before its reduce-scatter, against ZeRO's fixed reduce bucket (docs/estimator.md).
    let same = [
        Component::Weights,
        Component::QuantScales,
        Component::MasterWeights,
        Component::OptimizerStates,
        Component::Gradients,
        Component::Activations,
        Component::Logits,
    ];
    for base in sharding_sweep() {
        if base.precision == Precision::Bf16Mixed {
            continue;
        }
        for n in WORLD_SIZES {
            let with = |parallelism: Parallelism| {
                let mut cfg = base.clone();
                cfg.parallelism = parallelism;
                cfg.world_size = n;
                cfg
            };
            let (fsdp, zero3) = (with(Parallelism::Fsdp), with(Parallelism::Zero3));
            let (f, z) = (est(&fsdp), est(&zero3));
            let what = format!(
                "{:?} {} {} N {n}",
                base.model.name, base.method, base.precision
            );
            for c in same {
                assert_eq!(f.component(c), z.component(c), "{what}: {c}");
            }
            let (xf, xz) = (Ctx::new(&fsdp), Ctx::new(&zero3));
            let fsdp_alone = fsdp_root_unit(&xf) + fsdp_unit_gradient(&xf);
            let gap = forward_backward_workspace(&xf).as_f64()
                - forward_backward_workspace(&xz).as_f64()
                - fsdp_alone;
            assert!(gap.abs() <= 2.0, "{what}: workspace differs by {gap}");
            assert_eq!(fsdp_alone == 0.0, n == 1, "{what}");
        }
    }
}

#[test]
fn fsdp_mixed_precision_casts_per_unit_not_per_model() {
    // Llama 3.1 70B, batch 1 × 4096, checkpointing, bf16-mixed: the whole-model autocast copy
    // (140 GB on every rank) is gone; what is gathered is two blocks, whatever N.
    let mut cfg = model("llama-3.1-70b");
    cfg.batch_size = 1;
    cfg.seq_length = 4096;
    cfg.grad_checkpointing = true;
    cfg.parallelism = Parallelism::Fsdp;
    let at = |n: u64| {
        let mut c = cfg.clone();
        c.world_size = n;
        est(&c)
    };
    let gib = |b: Bytes| b.as_f64() / (1u64 << 30) as f64;
    let (eight, many) = (at(8), at(256));
    let p = params::total_params(&cfg.model) as f64;
    // Under the old whole-model copy the transient alone held `P·2` (131 GiB) on every rank.
    assert!(eight.component(Component::Transient).as_f64() < 0.2 * p * 2.0);
    assert!(gib(eight.total) < 180.0, "{}", gib(eight.total));
    assert!(gib(many.total) < 40.0, "{}", gib(many.total));
    assert!(many.total < eight.total);
}

#[test]
fn layer_norms_in_pure_16_bits_keep_their_16_bit_inputs_once_per_distinct_input() {
    // GPT-2's shape with each block layout: in bf16-true a LayerNorm keeps its 16-bit input
    // and output, no fp32 copy; parallel blocks normalise one input.
    let mut cfg = model("gpt2");
    cfg.precision = Precision::Bf16;
    let h = cfg.model.hidden_size as f64;
    let per_layer = |cfg: &TrainingConfig, norms: Norms| {
        let mut c = cfg.clone();
        c.model.norms = norms;
        layer_activation_bytes_per_token(&c, 2.0)
    };
    let rms = per_layer(&cfg, Norms::RmsNorm);
    // Two upcast norms, 2·(4h + 2h), against (inputs + norms)·2h.
    assert_eq!(rms - per_layer(&cfg, Norms::LayerNorm), 12.0 * h - 8.0 * h);
    assert_eq!(
        rms - per_layer(&cfg, Norms::ParallelLayerNorm),
        12.0 * h - 6.0 * h
    );
    assert_eq!(
        rms - per_layer(&cfg, Norms::SharedLayerNorm),
        12.0 * h - 4.0 * h
    );
    // Under autocast (and in fp32) `layer_norm` runs in fp32: as upcast as RMSNorm.
    cfg.precision = Precision::Bf16Mixed;
    assert_eq!(
        per_layer(&cfg, Norms::LayerNorm),
        per_layer(&cfg, Norms::RmsNorm)
    );
    // Compiled, a norm keeps only its 16-bit input, once per distinct input.
    cfg.precision = Precision::Bf16;
    cfg.compile = true;
    assert_eq!(
        per_layer(&cfg, Norms::LayerNorm) - per_layer(&cfg, Norms::SharedLayerNorm),
        2.0 * h
    );
    // The catalog says which layout a model has.
    assert_eq!(model("gpt2").model.norms, Norms::LayerNorm);
    assert_eq!(model("falcon-7b").model.norms, Norms::SharedLayerNorm);
    assert_eq!(model("llama-3-8b").model.norms, Norms::RmsNorm);
}

#[test]
fn a_loss_without_upcast_keeps_its_tensors_in_the_compute_dtype_in_pure_16_bits() {
    // GPT-BigCode's head before transformers 4.46: cross-entropy on the bf16 logits.
    let mut cfg = model("gpt2");
    cfg.batch_size = 4;
    cfg.seq_length = 1024;
    let logits = |cfg: &TrainingConfig, loss: Loss| {
        let mut c = cfg.clone();
        c.loss = loss;
        est(&c).component(Component::Logits).as_f64()
    };
    let elements = 4.0 * 1024.0 * 50257.0;
    cfg.precision = Precision::Bf16;
    assert_eq!(logits(&cfg, Loss::Narrow), elements * 4.0 * 2.0);
    assert_eq!(logits(&cfg, Loss::Standard), elements * (2.0 + 12.0));
    // Autocast runs log_softmax in fp32 whatever the head does: as the standard loss.
    cfg.precision = Precision::Bf16Mixed;
    assert_eq!(logits(&cfg, Loss::Narrow), logits(&cfg, Loss::Standard));
    assert_eq!("no-upcast".parse::<Loss>(), Ok(Loss::Narrow));
}

#[test]
fn a_trainer_that_lets_go_of_the_logits_before_backward_holds_three_logit_sized_tensors() {
    // universal-llm-trainer and transformers' Trainer drop the model output after the loss:
    // log-softmax output, its gradient and the logits' gradient remain, not the logits.
    let mut cfg = model("llama-3-8b");
    cfg.batch_size = 2;
    cfg.seq_length = 1024;
    let logits = |cfg: &TrainingConfig, loss: Loss| {
        let mut c = cfg.clone();
        c.loss = loss;
        est(&c).component(Component::Logits).as_f64()
    };
    let elements = 2.0 * 1024.0 * cfg.model.vocab_size as f64;
    for (precision, p) in [(Precision::Bf16, 2.0), (Precision::Fp32, 4.0)] {
        cfg.precision = precision;
        assert_eq!(logits(&cfg, Loss::NarrowReleased), elements * 3.0 * p);
        assert_eq!(logits(&cfg, Loss::Narrow), elements * 4.0 * p);
    }
    // In fp32 a loss held through backward is the standard one: nothing to upcast.
    assert_eq!(logits(&cfg, Loss::Narrow), logits(&cfg, Loss::Standard));
    // Under autocast log_softmax runs in fp32 whoever holds the output: the standard loss.
    cfg.precision = Precision::Bf16Mixed;
    assert_eq!(
        logits(&cfg, Loss::NarrowReleased),
        logits(&cfg, Loss::Standard)
    );
    assert_eq!("narrow-released".parse::<Loss>(), Ok(Loss::NarrowReleased));
}
