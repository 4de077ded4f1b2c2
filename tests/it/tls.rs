//! https upstreams through rustls: a test CA (rcgen), ALPN, server_name and
//! mutual TLS; verification is on unless the CA is trusted.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use http::{Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;

struct Pki {
    dir: tempfile::TempDir,
    ca_der: CertificateDer<'static>,
    server_chain: Vec<CertificateDer<'static>>,
    server_key: PrivateKeyDer<'static>,
}

impl Pki {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A CA, a server certificate for `localhost` only, and a client certificate; PEM files on disk.
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "herdguard test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

        let server_key = KeyPair::generate().unwrap();
        let server = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&server_key, &ca)
            .unwrap();
        let client_key = KeyPair::generate().unwrap();
        let mut client_params = CertificateParams::new(vec!["client.test".to_owned()]).unwrap();
        client_params
            .distinguished_name
            .push(DnType::CommonName, "client.test");
        let client = client_params.signed_by(&client_key, &ca).unwrap();

        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("client.pem"), client.pem()).unwrap();
        std::fs::write(dir.path().join("client.key"), client_key.serialize_pem()).unwrap();
        Pki {
            ca_der: ca.der().clone(),
            server_chain: vec![server.der().clone()],
            server_key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
            dir,
        }
    }
}

/// An https upstream answering 200 "tls ok"; with `require_client_cert`, only
/// callers presenting a certificate from the test CA get through.
async fn tls_upstream(
    pki: &Pki,
    require_client_cert: bool,
) -> (u16, Arc<std::sync::Mutex<Vec<Version>>>) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = if require_client_cert {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pki.ca_der.clone()).unwrap();
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(pki.server_chain.clone(), pki.server_key.clone_key())
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let versions = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = versions.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        seen.lock().unwrap().push(req.version());
                        async { Ok::<_, std::convert::Infallible>(Response::new(full("tls ok"))) }
                    });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (port, versions)
}

fn config(endpoint: &str, extra: &str) -> String {
    format!("[upstreams.u]\nendpoints = [\"{endpoint}\"]\n{extra}\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n")
}

#[tokio::test]
async fn https_upstream_with_test_ca_negotiates_h2() {
    let pki = Pki::new();
    let (port, versions) = tls_upstream(&pki, false).await;
    let ca = pki.path("ca.pem");
    let server = proxy(&config(
        &format!("https://localhost:{port}"),
        &format!("ca_file = {ca:?}"),
    ))
    .await;
    let (status, _, body) = get(&server, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"tls ok"[..]));
    assert_eq!(
        versions.lock().unwrap().as_slice(),
        [Version::HTTP_2],
        "ALPN chose h2"
    );

    let server = proxy(&config(
        &format!("https://localhost:{port}"),
        &format!("ca_file = {ca:?}\nhttp2 = false"),
    ))
    .await;
    let (status, _, _) = get(&server, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(versions.lock().unwrap().last(), Some(&Version::HTTP_11));
}

#[tokio::test]
async fn untrusted_certificate_is_refused() {
    let pki = Pki::new();
    let (port, versions) = tls_upstream(&pki, false).await;
    let server = proxy(&config(&format!("https://localhost:{port}"), "")).await;
    let (status, headers, body) = get(&server, "/").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-herdguard-error"], "connect-failure");
    assert!(
        String::from_utf8_lossy(&body).contains("certificate"),
        "{body:?}"
    );
    assert!(versions.lock().unwrap().is_empty());
}

#[tokio::test]
async fn server_name_overrides_the_verified_name() {
    let pki = Pki::new();
    let (port, _) = tls_upstream(&pki, false).await;
    let ca = pki.path("ca.pem");
    // The certificate names only "localhost", not 127.0.0.1.
    let server = proxy(&config(
        &format!("https://127.0.0.1:{port}"),
        &format!("ca_file = {ca:?}"),
    ))
    .await;
    let (status, _, _) = get(&server, "/").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let server = proxy(&config(
        &format!("https://127.0.0.1:{port}"),
        &format!("ca_file = {ca:?}\nserver_name = \"localhost\""),
    ))
    .await;
    let (status, _, body) = get(&server, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"tls ok"[..]));
}

#[tokio::test]
async fn mutual_tls_presents_the_client_certificate() {
    let pki = Pki::new();
    let (port, versions) = tls_upstream(&pki, true).await;
    let (ca, cert, key) = (
        pki.path("ca.pem"),
        pki.path("client.pem"),
        pki.path("client.key"),
    );
    let endpoint = format!("https://localhost:{port}");
    let server = proxy(&config(&endpoint, &format!("ca_file = {ca:?}"))).await;
    let (status, _, _) = get(&server, "/").await;
    assert_ne!(status, StatusCode::OK, "no client certificate, no entry");
    assert!(versions.lock().unwrap().is_empty());

    let server = proxy(&config(
        &endpoint,
        &format!("ca_file = {ca:?}\nclient_cert = {cert:?}\nclient_key = {key:?}"),
    ))
    .await;
    let (status, _, body) = get(&server, "/").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"tls ok"[..]));
}
