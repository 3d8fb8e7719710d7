//! Parameter counts from a model's shape, split the way memory cares about: what can be
//! quantized (the blocks' linear layers), what stays 16-bit (embeddings, head, norms), and
//! what LoRA adds for a given rank and set of target projections.

use crate::config::{LoraTargets, ModelShape};

/// The parameters of a decoder (or encoder) stack, derived from its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCounts {
    /// Input embedding, `V·h`.
    pub embedding: u64,
    /// Untied output projection, `V·h` (0 when tied or when the model has no LM head).
    pub lm_head: u64,
    /// Attention projections of one layer: `h·q + 2·h·kv + q·h` (q = heads·head_dim,
    /// kv = kv_heads·head_dim); for MLA see [`mla_attention`].
    pub attention_per_layer: u64,
    /// FFN of one expert of one layer: `3·h·I_e` gated, `2·h·I_e` plain.
    pub ffn_per_expert: u64,
    /// Router of one MoE layer, `h·E` (0 for a dense model).
    pub router_per_layer: u64,
    /// Norm weights of one layer, `2·h`, plus the final norm counted once in [`Self::total`].
    pub norms_per_layer: u64,
    /// Parameters outside the language model (vision encoder), never quantized here.
    pub extra: u64,
    /// Every parameter, all experts counted once: `L·(attn + norms) + L_moe·((E + shared)·ffn
    /// + router) + L_dense·ffn_dense + emb + head + h + extra`.
    pub total: u64,
}

/// Parameters of one multi-head latent attention layer (DeepSeek-V2/V3): the query, plain
/// `h·a·(n + r)` or compressed `h·c_q + c_q + c_q·a·(n + r)`; the joint key/value
/// compression `h·(c_kv + r) + c_kv`; its expansion `c_kv·a·(n + v)`; the output `a·v·h`.
pub fn mla_attention(m: &ModelShape, mla: &crate::config::Mla) -> u64 {
    let (h, a) = (m.hidden_size, m.num_heads);
    let qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
    let query = match mla.q_lora_rank {
        Some(c) => h * c + c + c * a * qk,
        None => h * a * qk,
    };
    let kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        + mla.kv_lora_rank
        + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim);
    query + kv + a * mla.v_head_dim * h
}

impl ParamCounts {
    /// Counts the parameters of `m` from its shape alone (biases and position tables are
    /// ignored: they are under 1 % of every catalog model).
    pub fn of(m: &ModelShape) -> ParamCounts {
        let h = m.hidden_size;
        let q = m.q_dim();
        let kv = m.kv_dim();
        let embedding = m.vocab_size.saturating_mul(h);
        let lm_head = if m.lm_head && !m.tie_embeddings {
            embedding
        } else {
            0
        };
        let attention_per_layer = match &m.mla {
            Some(mla) => mla_attention(m, mla),
            None => h * q + 2 * h * kv + q * h,
        };
        let matrices = if m.ffn_gated { 3 } else { 2 };
        let ffn_per_expert = matrices * h * m.expert_ffn_size();
        let ffn_dense = matrices * h * m.intermediate_size;
        let router_per_layer = if m.is_moe() { h * m.num_experts } else { 0 };
        let norms_per_layer = 2 * h;
        let moe_layers = m.moe_layers();
        let dense_layers = m.num_layers - moe_layers;
        let moe_ffn = ffn_per_expert
            .saturating_mul(m.num_experts + m.shared_experts)
            .saturating_add(router_per_layer);
        let total = (attention_per_layer + norms_per_layer)
            .saturating_mul(m.num_layers)
            .saturating_add(moe_ffn.saturating_mul(moe_layers))
            .saturating_add(ffn_dense.saturating_mul(dense_layers))
            .saturating_add(embedding)
            .saturating_add(lm_head)
            .saturating_add(h)
            .saturating_add(m.extra_params);
        ParamCounts {
            embedding,
            lm_head,
            attention_per_layer,
            ffn_per_expert,
            router_per_layer,
            norms_per_layer,
            extra: m.extra_params,
            total,
        }
    }

    /// Parameters kept in 16 bits even when the base is quantized: embeddings, LM head, norms
    /// and anything outside the language model (a vision encoder).
    pub fn unquantized(&self, layers: u64) -> u64 {
        self.embedding
            .saturating_add(self.lm_head)
            .saturating_add(self.norms_per_layer.saturating_mul(layers))
            .saturating_add(self.extra)
    }
}

/// The total parameter count used for weight-sized terms: the published `params` when given,
/// the shape-derived count otherwise.
pub fn total_params(m: &ModelShape) -> u64 {
    m.params.unwrap_or_else(|| ParamCounts::of(m).total)
}

/// The `(in, out)` dimensions of each LoRA-targeted projection of one layer, with how many
/// copies of it the layer has (MoE FFN projections exist once per expert).
///
/// q: `h → heads·d`, k and v: `h → kv_heads·d` (GQA makes these narrow), o: `heads·d → h`,
/// gate and up: `h → I` (gate only in gated FFNs), down: `I → h`.
pub fn lora_matrices(m: &ModelShape, t: &LoraTargets) -> [(bool, u64, u64, u64); 7] {
    let h = m.hidden_size;
    let (q, kv, i) = (m.q_dim(), m.kv_dim(), m.expert_ffn_size());
    let e = m.num_experts + if m.is_moe() { m.shared_experts } else { 0 };
    [
        (t.q, h, q, 1),
        (t.k, h, kv, 1),
        (t.v, h, kv, 1),
        (t.o, q, h, 1),
        (t.gate && m.ffn_gated, h, i, e),
        (t.up, h, i, e),
        (t.down, i, h, e),
    ]
}

/// LoRA parameters of one adapted layer: `Σ r·(in + out)` over the targeted projections
/// (A is `in×r`, B is `r×out`).
pub fn lora_params_per_layer(m: &ModelShape, t: &LoraTargets, rank: u64) -> u64 {
    lora_matrices(m, t)
        .iter()
        .filter(|(on, ..)| *on)
        .map(|&(_, i, o, n)| n.saturating_mul(rank.saturating_mul(i + o)))
        .fold(0u64, u64::saturating_add)
}

/// DoRA's magnitude vectors of one adapted layer: one entry per output row, `Σ out`.
pub fn dora_magnitude_per_layer(m: &ModelShape, t: &LoraTargets) -> u64 {
    lora_matrices(m, t)
        .iter()
        .filter(|(on, ..)| *on)
        .map(|&(_, _, o, n)| n.saturating_mul(o))
        .fold(0u64, u64::saturating_add)
}

/// Summed output width of the adapted projections of one layer, counting only the experts
/// a token is routed to: what DoRA's per-token rescaling keeps for backward.
pub fn adapted_out_width_per_token(m: &ModelShape, t: &LoraTargets) -> u64 {
    lora_matrices(m, t)
        .iter()
        .filter(|(on, ..)| *on)
        .map(|&(_, _, o, n)| if n > 1 { o * m.experts_per_token } else { o })
        .sum()
}

/// The largest adapted matrix (`in·out`): DoRA materialises `W + B·A` one matrix at a time to
/// take its column norms.
pub fn largest_adapted_matrix(m: &ModelShape, t: &LoraTargets) -> u64 {
    lora_matrices(m, t)
        .iter()
        .filter(|(on, ..)| *on)
        .map(|&(_, i, o, _)| i.saturating_mul(o))
        .max()
        .unwrap_or(0)
}

/// The matrices of one layer as `(rows, cols, copies)`: what Adafactor factors.
pub fn layer_matrices(m: &ModelShape) -> [(u64, u64, u64); 7] {
    lora_matrices(m, &LoraTargets::ALL_LINEAR).map(|(on, i, o, n)| (i, o, if on { n } else { 0 }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;

    fn shape(name: &str) -> ModelShape {
        catalog::lookup(name).expect("catalog entry")
    }

    #[test]
    fn gqa_narrows_the_key_and_value_projections() {
        let m = shape("llama-3-8b");
        // q: 4096², k and v: 4096·1024 each, o: 4096².
        assert_eq!(
            ParamCounts::of(&m).attention_per_layer,
            2 * 4096 * 4096 + 2 * 4096 * 1024
        );
    }

    #[test]
    fn lora_counts_each_targets_own_dimensions() {
        let m = shape("llama-3-8b");
        let r = 16;
        let qv = lora_params_per_layer(&m, &LoraTargets::QV, r);
        assert_eq!(qv, r * (4096 + 4096) + r * (4096 + 1024));
        let all = lora_params_per_layer(&m, &LoraTargets::ALL_LINEAR, r);
        let expected = r * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336));
        assert_eq!(all, expected);
    }

    #[test]
    fn moe_counts_every_expert_once_in_the_total() {
        let m = shape("mixtral-8x7b");
        let c = ParamCounts::of(&m);
        let dense_like = c.attention_per_layer + c.ffn_per_expert + c.norms_per_layer;
        assert!(c.total > 8 * dense_like * m.num_layers / 2);
        assert!(c.total < 8 * (dense_like + c.router_per_layer) * m.num_layers + 2 * c.embedding);
    }

    #[test]
    fn gate_target_is_ignored_without_a_gated_ffn() {
        let m = shape("gpt2");
        let t: LoraTargets = "gate".parse().expect("valid");
        assert_eq!(lora_params_per_layer(&m, &t, 8), 0);
    }
}
