//! Inference serving: weights plus the KV-cache ceiling for a maximum number of sequences.
//!
//! SCAFFOLD: to be completed by the estimator work (issue 2).
