//! TLS on the listener, through the binary: a client that verifies the
//! certificate (a test CA from rcgen) negotiates h2 and http/1.1 by ALPN; a
//! rotated certificate is served from the next handshake while open
//! connections keep working; a broken file keeps the old one; mutual TLS
//! refuses a caller without a certificate the client CA signed.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::process::Binary;
use common::*;
use http::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

struct Pki {
    dir: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "herdguard listener test CA");
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A certificate for `localhost` named `cn`, written as cert.pem and
    /// key.pem; its DER, to tell which one a handshake presented.
    fn issue_server(&self, cn: &str) -> CertificateDer<'static> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.ca).unwrap();
        // The key first: a watcher between the two writes sees a pair that
        // does not match, and keeps the old one until the cert follows.
        std::fs::write(self.path("key.pem"), key.serialize_pem()).unwrap();
        std::fs::write(self.path("cert.pem"), cert.pem()).unwrap();
        cert.der().clone()
    }

    /// A client certificate and its key, signed by the CA.
    fn issue_client(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["client.test".to_owned()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "client.test");
        let cert = params.signed_by(&key, &self.ca).unwrap();
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.der().clone()).unwrap();
        roots
    }
}

fn listen_tls(pki: &Pki, client_ca: Option<&Path>) -> String {
    let ca = client_ca.map_or(String::new(), |p| {
        format!(", client_ca = {:?}", p.display().to_string())
    });
    format!(
        "tls = {{ cert = {:?}, key = {:?}{ca} }}",
        pki.path("cert.pem").display().to_string(),
        pki.path("key.pem").display().to_string()
    )
}

/// One upstream `u` at `url` and one route to it named `name`.
fn route_to(url: &str, name: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"{name}\"\nupstream = \"u\"\n"
    )
}

/// A verifying TLS connection to `addr` offering `alpn`.
async fn connect(
    pki: &Pki,
    addr: &str,
    alpn: &[u8],
    client: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> std::io::Result<TlsStream<tokio::net::TcpStream>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(pki.roots());
    let mut config = match client {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

fn presented(stream: &TlsStream<tokio::net::TcpStream>) -> CertificateDer<'static> {
    stream.get_ref().1.peer_certificates().unwrap()[0]
        .clone()
        .into_owned()
}

/// An HTTP/2 request (its authority in the URI).
fn get(path: &str) -> Request<Body> {
    Request::get(format!("https://localhost{path}"))
        .body(empty())
        .unwrap()
}

/// An HTTP/1.1 request: origin form, with Host.
fn get1(path: &str) -> Request<Body> {
    Request::get(path)
        .header("host", "localhost")
        .body(empty())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_negotiates_h2_and_http11_and_follows_a_rotation() {
    let pki = Pki::new();
    let first = pki.issue_server("first");
    let up = ok_upstream("fine").await;
    let hg = Binary::start_with(&listen_tls(&pki, None), &route_to(&up.url(), "r")).await;

    // h2 by ALPN.
    let tls = connect(&pki, &hg.listen, b"h2", None)
        .await
        .expect("verified");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    assert_eq!(presented(&tls), first);
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let resp = h2.send_request(get("/a")).await.unwrap();
    assert_eq!(resp.status(), http::StatusCode::OK);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(up.last().headers["x-forwarded-proto"], "https");

    // http/1.1 by ALPN, kept open across the rotation.
    let tls = connect(&pki, &hg.listen, b"http/1.1", None).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (mut h1, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    assert_eq!(
        h1.send_request(get1("/b")).await.unwrap().status(),
        http::StatusCode::OK
    );

    // cert-manager writes a new pair: the next handshakes present it.
    let second = pki.issue_server("second");
    let (pki_ref, listen, want) = (&pki, &hg.listen, &second);
    eventually(
        Duration::from_secs(10),
        "the new certificate is served",
        || async move {
            let tls = connect(pki_ref, listen, b"h2", None).await.unwrap();
            presented(&tls) == *want
        },
    )
    .await;
    // The connections made before go on.
    assert_eq!(
        h1.send_request(get1("/c")).await.unwrap().status(),
        http::StatusCode::OK
    );
    assert_eq!(
        h2.send_request(get("/d")).await.unwrap().status(),
        http::StatusCode::OK
    );

    // A broken file (half written) changes nothing: the last good pair serves.
    std::fs::write(
        pki.path("cert.pem"),
        "-----BEGIN CERTIFICATE-----\nnot base64\n",
    )
    .unwrap();
    for _ in 0..3 {
        let tls = connect(&pki, &hg.listen, b"h2", None).await.unwrap();
        assert_eq!(presented(&tls), second);
    }
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_a_caller_without_a_certificate() {
    let pki = Pki::new();
    pki.issue_server("server");
    let up = ok_upstream("fine").await;
    let hg = Binary::start_with(
        &listen_tls(&pki, Some(&pki.path("ca.pem"))),
        &route_to(&up.url(), "r"),
    )
    .await;
    // TLS 1.3 reports a refused client certificate on the first read.
    let refused = match connect(&pki, &hg.listen, b"http/1.1", None).await {
        Err(_) => true,
        Ok(tls) => {
            let sent = async {
                let (mut h1, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
                tokio::spawn(conn);
                h1.send_request(get1("/x")).await
            };
            sent.await.is_err()
        }
    };
    assert!(refused, "no client certificate, no service");
    assert_eq!(up.hits(), 0);

    let tls = connect(&pki, &hg.listen, b"http/1.1", Some(pki.issue_client()))
        .await
        .unwrap();
    let (mut h1, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    assert_eq!(
        h1.send_request(get1("/x")).await.unwrap().status(),
        http::StatusCode::OK
    );
    hg.terminate().await;
}

/// Files that do not load are config errors naming `listen.tls`.
#[test]
fn bad_tls_files_are_config_errors() {
    let pki = Pki::new();
    pki.issue_server("server");
    let body = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n";
    let other = Pki::new();
    other.issue_server("other");
    for (tls, says) in [
        (
            "tls = { cert = \"/nonexistent/cert.pem\", key = \"/nonexistent/key.pem\" }".to_owned(),
            "/nonexistent/cert.pem",
        ),
        (
            // A key that is not the certificate's.
            format!(
                "tls = {{ cert = {:?}, key = {:?} }}",
                pki.path("cert.pem").display().to_string(),
                other.path("key.pem").display().to_string()
            ),
            "does not match",
        ),
        (
            format!(
                "tls = {{ cert = {:?}, key = {:?}, client_ca = {:?} }}",
                pki.path("cert.pem").display().to_string(),
                pki.path("key.pem").display().to_string(),
                pki.path("key.pem").display().to_string()
            ),
            "holds no certificate",
        ),
        (
            // Not a file to read whole: refused, not read into memory.
            "tls = { cert = \"/dev/zero\", key = \"/dev/zero\" }".to_owned(),
            "not a regular file",
        ),
    ] {
        let src = format!("[listen]\n{tls}\n{body}");
        let err = herdguard::config::Config::parse(&src)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("listen.tls (line 2)") && err.contains(says),
            "{tls}: {err}"
        );
    }
}

/// A caller that completes the handshake and then says nothing holds its
/// connection slot no longer than `header_read_timeout`, as a caller that
/// says nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_silent_after_its_handshake_is_closed() {
    use tokio::io::AsyncReadExt as _;
    let pki = Pki::new();
    pki.issue_server("localhost");
    let up = ok_upstream("ok").await;
    let hg = Binary::start_with(
        &format!("{}\nheader_read_timeout = \"1s\"", listen_tls(&pki, None)),
        &route_to(&up.url(), "r"),
    )
    .await;
    let mut stream = connect(&pki, &hg.listen, b"http/1.1", None)
        .await
        .expect("a handshake");
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("closed by the proxy, not left open");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    // A caller that speaks is served as before.
    let mut stream = connect(&pki, &hg.listen, b"http/1.1", None).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut stream,
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out).await;
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    hg.terminate().await;
}

/// A reload in the middle of a certificate rotation (the new certificate
/// written, its key not yet) applies the rest of the config: the files are
/// the watcher's to follow, not the reload's to refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_mid_rotation_is_applied() {
    let pki = Pki::new();
    pki.issue_server("localhost");
    let up = ok_upstream("ok").await;
    let route = |name: &str| route_to(&up.url(), name);
    let tls = listen_tls(&pki, None);
    let hg = Binary::start_with(&tls, &route("before")).await;
    // Half a rotation: another pair's key beside the running certificate.
    let other = Pki::new();
    other.issue_server("localhost");
    std::fs::copy(other.path("key.pem"), pki.path("key.pem")).unwrap();
    hg.reload_with(&tls, &route("after"));
    let reloaded = r#"herdguard_config_reloads_total{result="ok"}"#;
    eventually(Duration::from_secs(10), "the reload applied", || async {
        hg.metric(reloaded).await == 1.0
    })
    .await;
    let metrics = hg.metrics().await;
    assert!(metrics.contains(r#"route="after""#));
    assert_eq!(
        metric(
            &metrics,
            r#"herdguard_config_reloads_total{result="error"}"#
        )
        .unwrap_or(0.0),
        0.0
    );
    // The running certificate still serves.
    assert!(connect(&pki, &hg.listen, b"http/1.1", None).await.is_ok());
    hg.terminate().await;
}

/// The protocol the handshake agreed is the one spoken: a caller that
/// agreed `http/1.1` and then sends the HTTP/2 preface is not served HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_http11_then_an_h2_preface_is_not_served_h2() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let pki = Pki::new();
    pki.issue_server("localhost");
    let up = ok_upstream("ok").await;
    let hg = Binary::start_with(&listen_tls(&pki, None), &route_to(&up.url(), "r")).await;
    let mut stream = connect(&pki, &hg.listen, b"http/1.1", None).await.unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    // An HTTP/2 server's first frame is SETTINGS (type 4 at byte 3).
    assert!(
        out.is_empty() || out.starts_with(b"HTTP/1.1 4"),
        "{:?}",
        String::from_utf8_lossy(&out)
    );
    hg.terminate().await;
}

/// At max_connections, a new caller takes the slot of the oldest connection
/// that has asked for nothing: one stalled in its handshake, then one silent
/// after it; and a drain does not wait for one that has asked for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_that_ask_for_nothing_give_up_their_slot() {
    use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
    async fn is_closed(stream: &mut (impl AsyncRead + Unpin)) -> bool {
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await;
        matches!(read, Ok(Ok(0)) | Ok(Err(_)))
    }
    let pki = Pki::new();
    pki.issue_server("localhost");
    let up = ok_upstream("ok").await;
    // Header and drain times far longer than the test: only eviction and
    // the drain close them.
    let hg = Binary::start_with(
        &format!(
            "{}\nheader_read_timeout = \"60s\"\ndrain_timeout = \"60s\"\nmax_connections = 2",
            listen_tls(&pki, None)
        ),
        &route_to(&up.url(), "r"),
    )
    .await;
    let served = || async {
        let handshake = connect(&pki, &hg.listen, b"http/1.1", None);
        let mut caller = tokio::time::timeout(Duration::from_secs(10), handshake)
            .await
            .expect("a slot taken over, not waited for")
            .expect("a handshake");
        let request = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
        let answer = answered(&mut caller, request, b"ok").await;
        assert!(answer.starts_with(b"HTTP/1.1 200"));
        caller
    };
    // The start of a ClientHello, and no more; then a handshake, and no more.
    let mut stalled = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    stalled
        .write_all(b"\x16\x03\x01\x00\xc8\x01")
        .await
        .unwrap();
    let mut quiet = connect(&pki, &hg.listen, b"http/1.1", None)
        .await
        .expect("a handshake");
    // Full: each new caller is served in the slot of the oldest of them.
    let first = served().await;
    assert!(
        is_closed(&mut stalled).await,
        "the stalled handshake is closed"
    );
    let second = served().await;
    assert!(is_closed(&mut quiet).await, "the quiet one is closed next");
    // A drain closes the idle caller and one silent after its handshake
    // at once: it ends long before its 60 s.
    drop(second);
    let _quiet = connect(&pki, &hg.listen, b"http/1.1", None)
        .await
        .expect("a handshake");
    tokio::time::timeout(Duration::from_secs(20), hg.terminate())
        .await
        .expect("the drain waited for connections that asked for nothing");
    drop(first);
}
