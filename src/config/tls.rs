//! TLS on the listener: rustls with the ring provider, ALPN `h2` and
//! `http/1.1`, an optional client CA for mutual TLS, and a certificate that
//! follows its files. cert-manager (or anything else) rotates the PEM files
//! in place: the next handshake uses the new pair, connections already open
//! keep theirs, and a pair that does not load (half written, mismatched)
//! leaves the old one serving, with an error logged.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use tracing::{error, info};

/// Why a TLS setting could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    #[error("client_ca: {0}")]
    ClientCa(String),
}

fn file_error(path: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

/// The largest PEM file read: a long chain is a few tens of KiB. A larger
/// "file" (`/dev/zero`, a log named by mistake) is refused before it fills
/// memory.
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// The whole of a PEM file, if it is a regular file no larger than
/// [`MAX_PEM_BYTES`].
fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    super::files::read_bounded(path, MAX_PEM_BYTES).map_err(|e| file_error(path, e))
}

/// The certificates of a PEM file.
pub(crate) fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_pem(path)?;
    CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(path, e))
}

/// The private key of a PEM file.
pub(crate) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(&read_pem(path)?).map_err(|e| file_error(path, e))
}

/// The certificate chain and key of `cert` and `key`, checked to match.
pub(crate) fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = read_certs(cert)?;
    if chain.is_empty() {
        return Err(file_error(cert, "holds no certificate"));
    }
    let key_der = read_key(key)?;
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| file_error(key, e))?;
    let pair = CertifiedKey::new(chain, signing);
    pair.keys_match()
        .map_err(|e| file_error(key, format!("does not match {}: {e}", cert.display())))?;
    Ok(pair)
}

/// The listener's certificate, swapped when its files change.
#[derive(Debug)]
struct Current {
    pair: ArcSwap<CertifiedKey>,
    cert: PathBuf,
    key: PathBuf,
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.pair.load_full())
    }
}

/// A TLS listener's acceptor and the task that reloads its certificate.
pub struct Tls {
    pub acceptor: TlsAcceptor,
    current: Arc<Current>,
}

impl Tls {
    /// Loads the certificate chain, key and (for mutual TLS) client CA
    /// from their PEM files: an error names the file.
    pub fn new(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, TlsError> {
        let pair = load_pair(cert, key)?;
        let current = Arc::new(Current {
            pair: ArcSwap::from_pointee(pair),
            cert: cert.to_owned(),
            key: key.to_owned(),
        });
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in read_certs(ca)? {
                    roots.add(cert).map_err(|e| file_error(ca, e))?;
                }
                if roots.is_empty() {
                    return Err(file_error(ca, "holds no certificate"));
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| TlsError::ClientCa(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut server = builder.with_cert_resolver(current.clone());
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            current,
        })
    }

    /// Checks the certificate files every `every` and, when their content
    /// changed and the new pair loads, serves it from the next handshake on.
    pub fn watch(&self, every: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
        let current = self.current.clone();
        tokio::spawn(async move {
            let read =
                |current: &Current| (read_pem(&current.cert).ok(), read_pem(&current.key).ok());
            let mut loaded = read(&current);
            // A pair that did not load is reported once, not every tick.
            let mut failed = None;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tick.tick() => {}
                }
                let now = read(&current);
                if now == loaded
                    || failed.as_ref() == Some(&now)
                    || now.0.is_none()
                    || now.1.is_none()
                {
                    continue;
                }
                match load_pair(&current.cert, &current.key) {
                    Ok(pair) => {
                        current.pair.store(Arc::new(pair));
                        info!(cert = %current.cert.display(), "TLS certificate reloaded");
                        loaded = now;
                        failed = None;
                    }
                    // Half written, or the key not yet replaced: tried again
                    // at the next tick, the old pair serving meanwhile.
                    Err(e) => {
                        error!(error = %e, "TLS certificate not reloaded; the running one stays");
                        failed = Some(now);
                    }
                }
            }
        });
    }
}
