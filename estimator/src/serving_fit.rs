//! Fitting an inference server (vLLM, SGLang) to the memory its pod really has. Pure: no I/O.
//!
//! Both engines size themselves as a fraction of the device the process *sees*
//! (`torch.cuda.mem_get_info`'s total): vLLM's `--gpu-memory-utilization`, SGLang's
//! `--mem-fraction-static`. On a soft-shared GPU (KAI `gpu-fraction`, time-slicing) that is the
//! whole card, not the pod's share. The rules, per engine (docs/serving.md, "Inference servers",
//! names the engines' source they were read from):
//!
//! - **vLLM** (v0.10, V1 engine, `gpu_worker.py` `determine_available_memory`): the engine's
//!   memory is `seen × utilization`; it holds the weights, the peak activations of one profile
//!   forward of `max_num_batched_tokens` tokens, the non-torch memory (CUDA context) and, in what
//!   is left, the KV cache. CUDA graphs are captured after the cache is allocated, outside the
//!   utilization ([`VLLM_CUDA_GRAPHS`]; none with `--enforce-eager`).
//! - **SGLang** (v0.4.9, `server_args.py` and `model_runner.py` `profile_max_num_token`): the
//!   static memory is `seen × mem_fraction_static` and holds the weights and the KV pool; the
//!   rest of the device is its reserve for activations and CUDA graphs, whose default size is
//!   the table [`sglang_reserve`] (the default fraction is `(seen − reserve) / seen`).
//!
//! The pod's peak is `seen × fraction + outside` (`outside`: vLLM's graphs, SGLang's reserve), and
//! must stay within the pod's share. [`fit`] lowers the fraction to the share, raises it when the
//! longest sequence does not fit and the share allows, and otherwise shortens the maximum length
//! (only when allowed) or says why the server cannot start.

use crate::config::ModelShape;
use crate::inference::{
    ServingConfig, forward_workspace, kv_cache, serving_scales, serving_weights,
};
use crate::units::Bytes;

/// vLLM's CUDA-graph memory, outside `--gpu-memory-utilization`: its log line "Graph capturing
/// finished in N secs, took X GiB" reports 0.3–1.5 GiB for 7–70B models on one device at the
/// default capture sizes (up to 512 sequences); memguard keeps the top of that range.
pub const VLLM_CUDA_GRAPHS: Bytes = Bytes(1536 * 1024 * 1024);

/// vLLM's `gpu_memory_utilization` default (`CacheConfig`).
pub const VLLM_DEFAULT_UTILIZATION: f64 = 0.9;

/// vLLM allocates the KV cache in blocks of this many tokens (`--block-size`, CUDA default).
pub const VLLM_BLOCK_TOKENS: u64 = 16;

/// vLLM's default `max_num_batched_tokens` for the OpenAI server: 8192 on devices of 70 GiB or
/// more, 2048 below (`EngineArgs.get_batch_defaults`).
pub fn vllm_default_batched_tokens(seen: Bytes) -> u64 {
    if seen >= Bytes::gib(70) { 8192 } else { 2048 }
}

/// vLLM's default `max_num_seqs` for the OpenAI server: 1024 on devices of 70 GiB or more, 256
/// below (`EngineArgs.get_batch_defaults`; vLLM also keeps A100s on the lower defaults, which
/// memguard, not knowing the product here, does not: a larger profile, never a smaller one).
pub fn vllm_default_max_seqs(seen: Bytes) -> u64 {
    if seen >= Bytes::gib(70) { 1024 } else { 256 }
}

/// SGLang's reserve for activations and CUDA graphs, by the memory the process sees and the
/// parallel size (`ServerArgs.__post_init__`, v0.4.9): 2.8 GiB + size/10 below 35 GiB,
/// 9.5 GiB + size/2 below 90 GiB, 12 GiB + size/2 below 160 GiB, 32 GiB above.
pub fn sglang_reserve(seen: Bytes, parallel: u64) -> Bytes {
    let p = parallel.max(1) as f64;
    let gib = if seen < Bytes::gib(35) {
        2.8 + p / 10.0
    } else if seen < Bytes::gib(90) {
        9.5 + p / 2.0
    } else if seen < Bytes::gib(160) {
        12.0 + p / 2.0
    } else {
        32.0
    };
    Bytes::from_f64(gib * (1u64 << 30) as f64)
}

/// SGLang's default chunked prefill: 2048 tokens below 35 GiB, 8192 below 160 GiB, 16384 above.
pub fn sglang_default_chunk(seen: Bytes) -> u64 {
    if seen < Bytes::gib(35) {
        2048
    } else if seen < Bytes::gib(160) {
        8192
    } else {
        16384
    }
}

/// An inference engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Engine {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
}

impl Engine {
    /// `vllm`, `sglang`.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    /// The flag of the engine's memory fraction.
    pub fn fraction_flag(self) -> &'static str {
        match self {
            Engine::Vllm => "--gpu-memory-utilization",
            Engine::Sglang => "--mem-fraction-static",
        }
    }

    /// The flag of the engine's maximum sequence length.
    pub fn length_flag(self) -> &'static str {
        match self {
            Engine::Vllm => "--max-model-len",
            Engine::Sglang => "--context-length",
        }
    }

    /// The precision memguard writes the fraction in: vLLM's documented two decimals, SGLang's
    /// default is computed to three.
    fn fraction_scale(self) -> f64 {
        match self {
            Engine::Vllm => 100.0,
            Engine::Sglang => 1000.0,
        }
    }

    /// The engine's default fraction on a device of `seen` bytes with `parallel` ranks.
    pub fn default_fraction(self, seen: Bytes, parallel: u64) -> f64 {
        match self {
            Engine::Vllm => VLLM_DEFAULT_UTILIZATION,
            Engine::Sglang => {
                // SGLang rounds its default to 3 decimals (`round(…, 3)`).
                let seen_f = seen.as_f64().max(1.0);
                let x = (seen_f - sglang_reserve(seen, parallel).as_f64()) / seen_f;
                (x * 1000.0).round() / 1000.0
            }
        }
    }
}

/// A server's memory settings, as its command line gives them (defaults filled in by [`fit`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// The engine.
    pub engine: Engine,
    /// Model, weight and cache storage; `max_seq_length` is the maximum length when
    /// [`max_length_given`](Self::max_length_given) (`max_sequences` is not read: see
    /// [`max_sequences`](Self::max_sequences)).
    pub serving: ServingConfig,
    /// The engine's running-request cap, if given (vLLM's `--max-num-seqs`).
    pub max_sequences: Option<u64>,
    /// Whether the maximum length was given (otherwise the engine takes the model's own, which
    /// memguard does not know, and does not check).
    pub max_length_given: bool,
    /// The memory fraction given, if any.
    pub fraction: Option<f64>,
    /// Tensor-parallel size (ranks that split weights and cache).
    pub tensor_parallel: u64,
    /// Tokens of one prefill forward: vLLM's `--max-num-batched-tokens`, SGLang's
    /// `--chunked-prefill-size`, if given.
    pub batched_tokens: Option<u64>,
    /// vLLM's `--kv-cache-memory-bytes`: a fixed cache size that replaces the utilization.
    pub kv_cache_memory: Option<Bytes>,
    /// vLLM's `--enforce-eager`: no CUDA graphs.
    pub enforce_eager: bool,
}

impl ServerSettings {
    /// `engine` serving `model` with its defaults.
    pub fn new(engine: Engine, model: ModelShape) -> ServerSettings {
        ServerSettings {
            engine,
            serving: ServingConfig::new(model),
            max_sequences: None,
            max_length_given: false,
            fraction: None,
            tensor_parallel: 1,
            batched_tokens: None,
            kv_cache_memory: None,
            enforce_eager: false,
        }
    }
}

/// One device as the server's process sees it, and the pod's share of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceShare {
    /// What the process sees: the whole card under KAI fractions and time-slicing, the capped
    /// size under HAMi or MPS, the slice under MIG.
    pub seen: Bytes,
    /// What the pod may use of it.
    pub share: Bytes,
}

/// What a fit may change beyond the fraction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitRules {
    /// Whether the maximum length may be lowered (a quality change).
    pub may_shorten: bool,
    /// The shortest maximum length a fit may set.
    pub shortest: u64,
}

/// One change to the server's command line.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// The memory fraction (`from`: as written, or the engine's default).
    Fraction {
        /// Before.
        from: f64,
        /// After.
        to: f64,
    },
    /// The maximum length.
    MaxLength {
        /// Before.
        from: u64,
        /// After.
        to: u64,
    },
}

/// The fit: the settings the server runs with, what its memory holds, what changed and, when
/// it cannot start, why.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerFit {
    /// The memory fraction the engine runs with.
    pub fraction: f64,
    /// The maximum length it runs with (when given or set).
    pub max_length: Option<u64>,
    /// Weights on one device.
    pub weights: Bytes,
    /// What the engine keeps besides weights and cache: vLLM's profiled activations and CUDA
    /// context inside the fraction plus its graphs outside; SGLang's reserve outside plus the
    /// CUDA context inside.
    pub reserve: Bytes,
    /// KV cache on one device.
    pub kv_cache: Bytes,
    /// Tokens the cache holds.
    pub tokens_fit: u64,
    /// Sequences of the maximum length the cache holds at once.
    pub concurrency: Option<f64>,
    /// The pod's peak on one device: `seen × fraction + outside`.
    pub peak: Bytes,
    /// The changes to the command line; empty when the server fits as written.
    pub changes: Vec<Change>,
    /// Why the server cannot start in its share, with the numbers.
    pub error: Option<String>,
}

impl ServerFit {
    /// Whether the command line stays as written.
    pub fn as_written(&self) -> bool {
        self.changes.is_empty()
    }
}

/// The parts of the engine's memory that do not depend on the fraction.
struct Layout {
    weights: Bytes,
    /// Inside the fraction, besides weights and cache.
    inside: Bytes,
    /// Outside the fraction.
    outside: Bytes,
    /// KV-cache bytes of one token on one device.
    per_token: f64,
    /// The cache's allocation unit, in tokens.
    block: u64,
}

fn layout(s: &ServerSettings, seen: Bytes, context: Bytes) -> Layout {
    let tp = s.tensor_parallel.max(1);
    let cfg = &s.serving;
    let weights =
        Bytes::from_f64((serving_weights(cfg).as_f64() + serving_scales(cfg).as_f64()) / tp as f64);
    let mut one = cfg.clone();
    one.max_sequences = 1;
    one.max_seq_length = 1;
    // Key/value heads split over the ranks (replicated when there are fewer heads than ranks);
    // a latent (MLA) cache is replicated on every rank.
    let split = match cfg.model.mla {
        Some(_) => 1,
        None => tp.min(cfg.model.num_kv_heads.max(1)),
    };
    let per_token = kv_cache(&one).as_f64() / split as f64;
    match s.engine {
        Engine::Vllm => {
            let tokens = s
                .batched_tokens
                .unwrap_or_else(|| vllm_default_batched_tokens(seen));
            // The profiling forward: `tokens` spread over up to `max_num_seqs` sequences, one
            // row of logits each.
            let sequences = s
                .max_sequences
                .unwrap_or_else(|| vllm_default_max_seqs(seen))
                .clamp(1, tokens.max(1));
            let (work, logits) = forward_workspace(&cfg.model, tokens, sequences);
            let activations = Bytes::from_f64((work.as_f64() + logits.as_f64()) / tp as f64);
            let graphs = if s.enforce_eager {
                Bytes::ZERO
            } else {
                VLLM_CUDA_GRAPHS
            };
            Layout {
                weights,
                inside: Bytes(activations.0 + context.0),
                outside: graphs,
                per_token,
                block: VLLM_BLOCK_TOKENS,
            }
        }
        Engine::Sglang => Layout {
            weights,
            inside: context,
            outside: sglang_reserve(seen, tp),
            per_token,
            block: 1,
        },
    }
}

impl Layout {
    /// The cache at `fraction` of `seen` (zero when weights and reserve take it all).
    fn cache(&self, seen: Bytes, fraction: f64) -> Bytes {
        let engine = seen.as_f64() * fraction;
        Bytes::from_f64((engine - self.weights.as_f64() - self.inside.as_f64()).max(0.0))
    }

    /// Tokens the cache holds, whole blocks only.
    fn tokens(&self, cache: Bytes) -> u64 {
        if self.per_token <= 0.0 {
            return 0;
        }
        let tokens = (cache.as_f64() / self.per_token).floor() as u64;
        tokens / self.block * self.block
    }
}

/// Fits the server `s` into `device`: the fraction within the pod's share, the longest sequence
/// within the cache. `context` is the device's runtime overhead (CUDA context).
pub fn fit(s: &ServerSettings, device: DeviceShare, context: Bytes, rules: FitRules) -> ServerFit {
    let seen = device.seen;
    let l = layout(s, seen, context);
    let as_written = s
        .fraction
        .unwrap_or_else(|| s.engine.default_fraction(seen, s.tensor_parallel));
    let max_length = s.max_length_given.then_some(s.serving.max_seq_length);
    if let Some(kv) = s.kv_cache_memory.filter(|_| s.engine == Engine::Vllm) {
        return fixed_cache(device, &l, kv, as_written, max_length);
    }
    // The largest fraction whose peak stays within the share, in the engine's precision.
    let limit = round_down(
        (device.share.as_f64() - l.outside.as_f64()) / seen.as_f64().max(1.0),
        s.engine.fraction_scale(),
    )
    .min(0.99);
    let mut changes = Vec::new();
    let mut fraction = as_written;
    if fraction > limit {
        fraction = limit;
    }
    let needed = |f: f64| max_length.is_some_and(|n| l.tokens(l.cache(seen, f)) < n);
    if needed(fraction) && fraction < limit {
        // The share allows more: raise the fraction before touching the length.
        fraction = limit;
    }
    if fraction != as_written {
        changes.push(Change::Fraction {
            from: as_written,
            to: fraction,
        });
    }
    let cache = l.cache(seen, fraction);
    let tokens = l.tokens(cache);
    let mut result = ServerFit {
        fraction,
        max_length,
        weights: l.weights,
        reserve: Bytes(l.inside.0 + l.outside.0),
        kv_cache: cache,
        tokens_fit: tokens,
        concurrency: None,
        peak: Bytes::from_f64(seen.as_f64() * fraction.max(0.0) + l.outside.as_f64()),
        changes,
        error: None,
    };
    if limit <= 0.0 || tokens == 0 {
        result.error = Some(format!(
            "cannot fit: {} needs {} of weights and {} of its own reserve on each device; the \
             pod's share is {} of the {} its process sees, which leaves no KV cache at {} {:.2}",
            s.engine.name(),
            l.weights,
            result.reserve,
            device.share,
            seen,
            s.engine.fraction_flag(),
            fraction.max(0.0),
        ));
        return result;
    }
    if let Some(n) = max_length
        && tokens < n
    {
        let shortened = tokens.max(1);
        if rules.may_shorten && shortened >= rules.shortest {
            result.changes.push(Change::MaxLength {
                from: n,
                to: shortened,
            });
            result.max_length = Some(shortened);
        } else {
            let why = if rules.may_shorten {
                format!("below the policy's shortest, {}", rules.shortest)
            } else {
                "the policy does not allow shorter sequences".to_string()
            };
            result.error = Some(format!(
                "cannot fit: {} {} {n} needs {} of KV cache per device; the pod's share ({} of \
                 the {} its process sees) leaves {} at {} {:.2} after {} of weights and {} of \
                 reserve: {tokens} tokens fit ({why})",
                s.engine.name(),
                s.engine.length_flag(),
                Bytes::from_f64(l.per_token * n as f64),
                device.share,
                seen,
                cache,
                s.engine.fraction_flag(),
                fraction,
                l.weights,
                result.reserve,
            ));
        }
    }
    result.concurrency = result
        .max_length
        .filter(|&n| n > 0)
        .map(|n| tokens as f64 / n as f64);
    result
}

/// vLLM with `--kv-cache-memory-bytes`: the utilization is not used, the cache is what it says;
/// the server fits when weights, reserve and cache fit the share. Nothing is rewritten: the
/// user chose the cache's size.
fn fixed_cache(
    device: DeviceShare,
    l: &Layout,
    kv: Bytes,
    fraction: f64,
    max_length: Option<u64>,
) -> ServerFit {
    let tokens = l.tokens(kv);
    let peak = Bytes(l.weights.0 + l.inside.0 + l.outside.0 + kv.0);
    let mut error = None;
    if peak > device.share {
        error = Some(format!(
            "cannot fit: vllm --kv-cache-memory-bytes {} with {} of weights and {} of reserve \
             needs {} per device; the pod's share is {}",
            kv.0,
            l.weights,
            Bytes(l.inside.0 + l.outside.0),
            peak,
            device.share
        ));
    } else if let Some(n) = max_length
        && tokens < n
    {
        error = Some(format!(
            "cannot fit: vllm --max-model-len {n} needs {} of KV cache; \
             --kv-cache-memory-bytes {} holds {tokens} tokens",
            Bytes::from_f64(l.per_token * n as f64),
            kv.0
        ));
    }
    ServerFit {
        fraction,
        max_length,
        weights: l.weights,
        reserve: Bytes(l.inside.0 + l.outside.0),
        kv_cache: kv,
        tokens_fit: tokens,
        concurrency: max_length
            .filter(|&n| n > 0)
            .map(|n| tokens as f64 / n as f64),
        peak,
        changes: Vec::new(),
        error,
    }
}

/// `x` rounded down to `1/scale`.
fn round_down(x: f64, scale: f64) -> f64 {
    (x * scale).floor() / scale
}

#[cfg(test)]
mod tests;
