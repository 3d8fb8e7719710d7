//! The estimate of one training step's peak memory, with a readable breakdown.
//!
//! SCAFFOLD: the physics below is a placeholder to be replaced by the estimator work (issue 2).

use crate::config::{ConfigError, TrainingConfig};
use crate::units::Bytes;
use std::fmt;

/// A named part of the peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Component {
    /// Model weights as stored on the device (frozen base and/or trainable).
    Weights,
    /// Quantization block scales (QLoRA NF4).
    QuantScales,
    /// fp32 master copy of trainable weights under mixed precision.
    MasterWeights,
    /// Gradients of the trainable parameters.
    Gradients,
    /// Optimizer states.
    OptimizerStates,
    /// Activations kept for the backward pass.
    Activations,
    /// Output logits and their loss intermediates (B·S·V).
    Logits,
    /// Transient buffers at the peak (backward workspace, communication buckets).
    Transient,
    /// Fixed runtime cost: CUDA context, CPU process baseline.
    RuntimeOverhead,
    /// Caching-allocator reserve above live tensors.
    AllocatorCache,
}

impl Component {
    /// snake_case name used in JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Component::Weights => "weights",
            Component::QuantScales => "quant_scales",
            Component::MasterWeights => "master_weights",
            Component::Gradients => "gradients",
            Component::OptimizerStates => "optimizer_states",
            Component::Activations => "activations",
            Component::Logits => "logits",
            Component::Transient => "transient",
            Component::RuntimeOverhead => "runtime_overhead",
            Component::AllocatorCache => "allocator_cache",
        }
    }

    /// Whether the component is a live tensor (counted in `tensor_peak`).
    pub const fn is_tensor(self) -> bool {
        !matches!(self, Component::RuntimeOverhead | Component::AllocatorCache)
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The peak of one training step on one device.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Estimate {
    /// What the device must hold: tensors plus runtime overhead and allocator cache.
    pub total: Bytes,
    /// The peak of live tensors alone (`torch.cuda.max_memory_allocated`).
    pub tensor_peak: Bytes,
    /// The parts, largest first.
    pub components: Vec<(Component, Bytes)>,
}

impl Estimate {
    /// Bytes of one component (zero when absent).
    pub fn component(&self, c: Component) -> Bytes {
        self.components
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, b)| *b)
            .unwrap_or(Bytes::ZERO)
    }
}

/// Estimates the peak memory of one training step of `cfg` on one device.
pub fn estimate(cfg: &TrainingConfig) -> Result<Estimate, Vec<ConfigError>> {
    cfg.validate()?;
    let m = &cfg.model;
    let params = m.params.unwrap_or(12 * m.hidden_size * m.hidden_size * m.num_layers) as f64;
    let weights = Bytes::from_f64(params * 2.0);
    let optimizer = Bytes::from_f64(params * 12.0);
    let act = Bytes::from_f64(
        (cfg.batch_size * cfg.seq_length * m.hidden_size * m.num_layers) as f64 * 16.0,
    );
    let logits = Bytes::from_f64((cfg.batch_size * cfg.seq_length * m.vocab_size) as f64 * 8.0);
    let overhead = Bytes::mib(1024);
    let mut components = vec![
        (Component::Weights, weights),
        (Component::OptimizerStates, optimizer),
        (Component::Activations, act),
        (Component::Logits, logits),
        (Component::RuntimeOverhead, overhead),
    ];
    components.sort_by(|a, b| b.1.cmp(&a.1));
    let tensor_peak = components
        .iter()
        .filter(|(c, _)| c.is_tensor())
        .map(|(_, b)| *b)
        .sum();
    let total = components.iter().map(|(_, b)| *b).sum();
    Ok(Estimate {
        total,
        tensor_peak,
        components,
    })
}
