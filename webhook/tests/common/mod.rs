//! Helpers for the end-to-end tests: certificates made at test time, the real binary, and a
//! small TLS client that reports the certificate each connection was served.
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, ServerName};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A test CA that signs serving certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
    pub der: CertificateDer<'static>,
}

impl Ca {
    pub fn new() -> Ca {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "memguard test CA");
        let cert = params.self_signed(&key).expect("CA cert");
        Ca {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A serving pair for `localhost` and 127.0.0.1, with `cn` as its common name:
    /// (cert PEM, key PEM, cert DER).
    pub fn leaf(&self, cn: &str) -> (String, String, Vec<u8>) {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.issuer).expect("leaf");
        (cert.pem(), key.serialize_pem(), cert.der().to_vec())
    }

    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.der.clone()).expect("CA is a valid root");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(config)
    }
}

/// Writes `tls.crt`/`tls.key` the way the kubelet updates a Secret volume: a timestamped
/// directory, a `..data` symlink swapped atomically, and the files as links through `..data`.
pub fn write_secret(dir: &Path, generation: u32, cert: &str, key: &str) {
    let data = dir.join(format!("..gen_{generation}"));
    std::fs::create_dir_all(&data).expect("data dir");
    std::fs::write(data.join("tls.crt"), cert).expect("cert");
    std::fs::write(data.join("tls.key"), key).expect("key");
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("..gen_{generation}"), &tmp).expect("symlink");
    std::fs::rename(&tmp, dir.join("..data")).expect("atomic swap");
    for f in ["tls.crt", "tls.key"] {
        let link = dir.join(f);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{f}"), &link).expect("file link");
        }
    }
}

/// The real `memguard-webhook` binary, started on loopback ports chosen by the kernel.
pub struct Server {
    child: Child,
    pub https: SocketAddr,
    pub metrics: SocketAddr,
    /// The JSON log lines up to and including "memguard-webhook serving".
    pub log: Vec<serde_json::Value>,
}

impl Server {
    pub fn start(secret_dir: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_memguard-webhook"))
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--tls-cert-file")
            .arg(secret_dir.join("tls.crt"))
            .arg("--tls-key-file")
            .arg(secret_dir.join("tls.key"))
            .args([
                "--tls-reload-interval-ms",
                "100",
                "--shutdown-grace-seconds",
                "5",
            ])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the webhook binary starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut log = Vec::new();
        let (https, metrics) = loop {
            let line = lines
                .next()
                .expect("the webhook logs its addresses before anything else ends")
                .expect("utf-8 log line");
            let v: serde_json::Value = serde_json::from_str(&line).expect("JSON log line");
            if v["message"] == "memguard-webhook serving" {
                let addr = |k: &str| v[k].as_str().expect("address").parse().expect("addr");
                log.push(v.clone());
                break (addr("https"), addr("metrics"));
            }
            log.push(v);
        };
        // Keep draining the log so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            https,
            metrics,
            log,
        }
    }

    /// SIGTERM, then wait (bounded) for the graceful exit.
    pub fn terminate(mut self) -> ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the webhook did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTPS connection (keep-alive): send requests, and know which certificate served it.
pub struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    pub peer_cert: Vec<u8>,
}

impl Conn {
    pub async fn open(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<Conn> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let name = ServerName::try_from("localhost").expect("name");
        let tls = connector.connect(name, tcp).await?;
        let peer_cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .unwrap_or_default();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        Ok(Conn { sender, peer_cert })
    }

    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Vec<u8>,
    ) -> std::io::Result<(u16, Vec<u8>)> {
        self.sender.ready().await.map_err(std::io::Error::other)?;
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(std::io::Error::other)?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes()
            .to_vec();
        Ok((status, body))
    }
}

/// `GET /metrics` over plain HTTP.
pub async fn scrape(addr: SocketAddr) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let request = hyper::Request::get("/metrics")
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// Runs `promtool check metrics` on the webhook's OpenMetrics `text`. promtool reads the classic text format, where a counter's
/// family is named with its `_total` suffix (OpenMetrics names it without, as Prometheus does
/// on scraping); the family names are renamed to that form first, nothing else is touched.
pub fn promtool_check(text: &str) {
    let counters: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let classic: String = text
        .lines()
        .filter(|l| *l != "# EOF")
        .map(|line| {
            for kind in ["# HELP ", "# TYPE "] {
                if let Some(rest) = line.strip_prefix(kind) {
                    let name = rest.split(' ').next().unwrap_or_default();
                    if counters.contains(&name) {
                        return format!("{kind}{name}_total{}\n", &rest[name.len()..]);
                    }
                }
            }
            format!("{line}\n")
        })
        .collect();
    memguard_e2e::promtool_check_metrics(&classic);
}

/// An AdmissionReview v1 for `pod`.
pub fn admission_review(pod: &serde_json::Value, uid: &str) -> Vec<u8> {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:ml:trainer"},
            "object": pod,
            "dryRun": false
        }
    })
    .to_string()
    .into_bytes()
}

/// A fixture pod as JSON.
pub fn fixture_pod(name: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pods")
        .join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(path).expect("fixture");
    serde_saphyr::from_str(&text).expect("fixture YAML")
}
