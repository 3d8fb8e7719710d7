//! memguard-sidecar (to be built by the sidecar work, issue 4).
