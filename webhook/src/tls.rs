//! The serving certificate: read from the mounted Secret's files, and reloaded when they change.
//!
//! A Secret volume updates by swapping its `..data` symlink, so both files change at once; the
//! watcher compares the files' bytes every interval (cheap, and immune to the mtime quirks of
//! symlink swaps). A certificate that does not load, or a key that does not match it, keeps
//! the previous certificate in service and is logged and counted.

use crate::metrics::Metrics;
use axum_server::tls_rustls::RustlsConfig;
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Why a certificate or key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    // The cause is in the message and not a `#[source]`: a caller printing the chain would
    // print it twice.
    #[error("reading {path}: {error}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// No certificate in the PEM.
    #[error("no PEM certificate found")]
    NoCertificate,
    /// No private key in the PEM.
    #[error("no PEM private key found")]
    NoKey,
    /// The PEM is malformed.
    #[error("malformed PEM: {0}")]
    Pem(std::io::Error),
    /// rustls refused the pair (e.g. the key does not match the certificate).
    #[error("unusable certificate or key: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A loaded certificate.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The rustls config serving it.
    pub config: Arc<ServerConfig>,
    /// `notAfter` of the leaf, Unix seconds (`None` when it cannot be parsed).
    pub not_after: Option<i64>,
}

/// The certificate and key files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// `tls.crt`.
    pub cert: PathBuf,
    /// `tls.key`.
    pub key: PathBuf,
}

impl CertFiles {
    /// Reads both files.
    pub async fn read(&self) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
        Ok((read(&self.cert).await?, read(&self.key).await?))
    }
}

async fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    tokio::fs::read(path).await.map_err(|error| TlsError::Read {
        path: path.to_path_buf(),
        error,
    })
}

/// Builds a rustls server config (ring provider, HTTP/1.1) from PEM bytes.
pub fn load(cert_pem: &[u8], key_pem: &[u8]) -> Result<Loaded, TlsError> {
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut &cert_pem[..])
        .collect::<Result<_, _>>()
        .map_err(TlsError::Pem)?;
    let leaf = certs.first().ok_or(TlsError::NoCertificate)?;
    let not_after = x509_parser::parse_x509_certificate(leaf)
        .ok()
        .map(|(_, c)| c.validity().not_after.timestamp());
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(TlsError::Pem)?
        .ok_or(TlsError::NoKey)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Loaded {
        config: Arc::new(config),
        not_after,
    })
}

/// Polls `files` every `interval` and swaps the serving config when their content changes.
/// Runs until the task is dropped.
pub async fn watch(
    files: CertFiles,
    served: RustlsConfig,
    metrics: Arc<Metrics>,
    interval: Duration,
    mut last: (Vec<u8>, Vec<u8>),
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let current = match files.read().await {
            Ok(c) => c,
            // Mid-swap, a file can be briefly missing: try again next tick.
            Err(error) => {
                tracing::debug!(%error, "certificate files not readable");
                continue;
            }
        };
        if current == last {
            continue;
        }
        match load(&current.0, &current.1) {
            Ok(loaded) => {
                served.reload_from_config(loaded.config);
                if let Some(t) = loaded.not_after {
                    metrics.set_cert_expiry(t);
                }
                metrics.cert_reload(true);
                tracing::info!(not_after = ?loaded.not_after, "serving certificate reloaded");
            }
            Err(error) => {
                metrics.cert_reload(false);
                tracing::error!(%error, "new certificate rejected; keeping the previous one");
            }
        }
        last = current;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
        let cert = params.self_signed(&key).expect("cert");
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn loads_a_pair_and_reads_its_expiry() {
        let (cert, key) = self_signed("memguard.test");
        let loaded = load(cert.as_bytes(), key.as_bytes()).expect("valid pair");
        assert!(loaded.not_after.is_some_and(|t| t > 1_700_000_000));
        assert_eq!(loaded.config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }

    #[test]
    fn refuses_garbage_and_mismatched_keys() {
        let (cert, _) = self_signed("a.test");
        let (_, other_key) = self_signed("b.test");
        assert!(matches!(
            load(b"not pem", other_key.as_bytes()),
            Err(TlsError::NoCertificate)
        ));
        assert!(matches!(load(cert.as_bytes(), b""), Err(TlsError::NoKey)));
        assert!(matches!(
            load(cert.as_bytes(), other_key.as_bytes()),
            Err(TlsError::Rustls(_))
        ));
    }
}
