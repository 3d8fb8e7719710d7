//! Fault injection on the real webhook binary over real TLS on loopback: slowloris connections,
//! oversized and truncated bodies, TLS garbage, and a certificate whose key does not match
//! during a rotation. Each time: no panic, no exit, real requests keep being answered, and the
//! degraded state shows in the metrics. See docs/reliability.md.

mod common;

use common::{Ca, Conn, Server, admission_review, fixture_pod, scrape, write_secret};
use rustls::pki_types::ServerName;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn allowed(reply: std::io::Result<(u16, Vec<u8>)>) -> bool {
    match reply {
        Ok((200, body)) => serde_json::from_slice::<serde_json::Value>(&body)
            .is_ok_and(|r| r["response"]["allowed"] == true),
        _ => false,
    }
}

/// Reads until the peer closes (or errors): whether that happened before `deadline`.
async fn closed_by(stream: &mut (impl AsyncReadExt + Unpin), deadline: Instant) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_connections_are_cut_and_never_starve_real_requests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert, key, _) = ca.leaf("webhook");
    write_secret(dir.path(), 1, &cert, &key);
    let server = Server::start(dir.path(), &[]);
    let config = ca.client_config();

    // 40 connections that never finish the TLS handshake (they send half a ClientHello), and
    // 40 that finish it and then trickle request headers that never end.
    let mut stalled_handshakes = Vec::new();
    for _ in 0..40 {
        let mut tcp = TcpStream::connect(server.https).await.expect("connect");
        tcp.write_all(&[0x16, 0x03, 0x01, 0x01, 0x00, 0x01])
            .await
            .expect("partial hello");
        stalled_handshakes.push(tcp);
    }
    let mut trickling = Vec::new();
    for _ in 0..40 {
        let tcp = TcpStream::connect(server.https).await.expect("connect");
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let name = ServerName::try_from("localhost").expect("name");
        let mut tls = connector.connect(name, tcp).await.expect("handshake");
        tls.write_all(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\n")
            .await
            .expect("headers start");
        trickling.push(tls);
    }
    let started = Instant::now();
    // Real requests are answered meanwhile, promptly, while the trickle goes on.
    let pod = fixture_pod("single-gpu-lora");
    for n in 0..10 {
        for tls in &mut trickling {
            let _ = tls.write_all(b"X-Slow: 1\r\n").await;
        }
        let mut conn = Conn::open(server.https, config.clone())
            .await
            .expect("a real client connects");
        let t = Instant::now();
        let reply = conn
            .request(
                "POST",
                "/mutate",
                admission_review(&pod, &format!("uid-{n}")),
            )
            .await;
        assert!(allowed(reply), "request {n} during the slowloris");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }
    // Then the server cuts them: handshakes after 10 s, unfinished headers after 10 s of
    // trickling (the header read timeout), not held forever.
    let deadline = Instant::now() + Duration::from_secs(25);
    for s in &mut stalled_handshakes {
        assert!(
            closed_by(s, deadline).await,
            "a stalled handshake still open"
        );
    }
    for s in &mut trickling {
        assert!(
            closed_by(s, deadline).await,
            "a trickling connection still open"
        );
    }
    eprintln!("80 slow connections cut within {:?}", started.elapsed());
    let mut conn = Conn::open(server.https, config).await.expect("connects");
    assert!(allowed(
        conn.request("POST", "/mutate", admission_review(&pod, "after"))
            .await
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_truncated_and_garbage_bodies_and_tls_garbage_are_survived() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert, key, _) = ca.leaf("webhook");
    write_secret(dir.path(), 1, &cert, &key);
    let server = Server::start(dir.path(), &[]);
    let config = ca.client_config();
    let pod = fixture_pod("single-gpu-lora");
    let review = admission_review(&pod, "uid");

    let mut conn = Conn::open(server.https, config.clone())
        .await
        .expect("connect");
    // Oversized: 4 MiB against a 3 MiB cap. The server answers 413 once the length is over the
    // cap and closes without reading the rest, so a client still writing its body may see the
    // close (a broken pipe or a reset) before the answer: refused either way, never read whole.
    match conn.request("POST", "/mutate", vec![b' '; 4 << 20]).await {
        Ok((code, _)) => assert_eq!(code, 413),
        Err(e) => assert!(closed_while_writing(&e), "neither 413 nor a close: {e:?}"),
    }
    // Truncated JSON (a whole HTTP body that is half a review), garbage, empty.
    for body in [
        review[..review.len() / 2].to_vec(),
        b"\x00\xff garbage".to_vec(),
        Vec::new(),
    ] {
        let mut conn = Conn::open(server.https, config.clone())
            .await
            .expect("connect");
        let (code, _) = conn
            .request("POST", "/mutate", body)
            .await
            .expect("answered");
        assert_eq!(code, 400);
    }
    // A body cut short: Content-Length promises more than is sent, then the client goes away.
    for _ in 0..20 {
        let tcp = TcpStream::connect(server.https).await.expect("connect");
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let name = ServerName::try_from("localhost").expect("name");
        let mut tls = connector.connect(name, tcp).await.expect("handshake");
        let head = format!(
            "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            review.len()
        );
        tls.write_all(head.as_bytes()).await.expect("head");
        tls.write_all(&review[..review.len() / 3])
            .await
            .expect("part");
        drop(tls);
    }
    // TLS garbage: random bytes, plain HTTP on the TLS port, a ClientHello header with a
    // nonsense body, a valid record header announcing 16 MiB.
    let garbage: [&[u8]; 4] = [
        &[0x5a; 4096],
        b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
        &[
            0x16, 0x03, 0x01, 0x00, 0x10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
        ],
        &[0x16, 0x03, 0x03, 0xff, 0xff, 0x01, 0xff, 0xff, 0xff],
    ];
    for bytes in garbage {
        for _ in 0..10 {
            let mut tcp = TcpStream::connect(server.https).await.expect("connect");
            let _ = tcp.write_all(bytes).await;
            assert!(
                closed_by(&mut tcp, Instant::now() + Duration::from_secs(15)).await,
                "the server closes a garbage connection"
            );
        }
    }
    // Still serving, and still right.
    let mut conn = Conn::open(server.https, config).await.expect("connect");
    for n in 0..5 {
        assert!(allowed(
            conn.request("POST", "/mutate", admission_review(&pod, &format!("u{n}")))
                .await
        ));
    }
    let metrics = scrape(server.metrics).await;
    assert!(
        metrics.contains("memguard_webhook_admission_requests_total{outcome=\"mutated\"} 5"),
        "{metrics}"
    );
    let status = server.terminate();
    assert!(
        status.success(),
        "graceful exit after the abuse: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_whose_certificate_and_key_do_not_match_keeps_the_old_pair() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert1, key1, der1) = ca.leaf("generation-1");
    write_secret(dir.path(), 1, &cert1, &key1);
    let server = Server::start(dir.path(), &[]);
    let config = ca.client_config();
    let pod = fixture_pod("single-gpu-lora");

    // The new certificate arrives with the old key (a half-done rotation), then the reverse.
    let (cert2, key2, der2) = ca.leaf("generation-2");
    let mismatches = [
        (cert2.as_str(), key1.as_str()),
        (cert1.as_str(), key2.as_str()),
    ];
    for (i, (cert, key)) in mismatches.iter().enumerate() {
        write_secret(dir.path(), 2 + i as u32, cert, key);
        let want = format!(
            "memguard_webhook_certificate_reloads_total{{result=\"error\"}} {}",
            i + 1
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !scrape(server.metrics).await.contains(&want) {
            assert!(Instant::now() < deadline, "the mismatch was never noticed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for n in 0..5 {
            let mut conn = Conn::open(server.https, config.clone())
                .await
                .expect("the old pair still serves");
            assert_eq!(conn.peer_cert, der1);
            assert!(allowed(
                conn.request(
                    "POST",
                    "/mutate",
                    admission_review(&pod, &format!("{i}-{n}"))
                )
                .await
            ));
        }
    }
    // The rotation completes: the matching pair goes into service.
    write_secret(dir.path(), 9, &cert2, &key2);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let conn = Conn::open(server.https, config.clone())
            .await
            .expect("connect");
        if conn.peer_cert == der2 {
            break;
        }
        assert!(Instant::now() < deadline, "the good pair was never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        scrape(server.metrics)
            .await
            .contains("memguard_webhook_certificate_reloads_total{result=\"ok\"}")
    );
}

/// Whether `e` is the peer closing the connection under a request still being written: a
/// broken pipe or a reset anywhere in its chain of causes.
fn closed_while_writing(e: &std::io::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cause {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            )
        {
            return true;
        }
        cause = err.source();
    }
    false
}
