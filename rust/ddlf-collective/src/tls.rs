//! TLS for peer links, on a cluster that uses TLS: the daemon serves its own certificate (the one it serves gRPC
//! with), and a rank opening a link checks it against the authority the master trusts (sent with the ring's spec),
//! under the name the master uses (its `tls_domain`, else the neighbour's host). The cluster token then travels
//! inside the tunnel, as it does on gRPC.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// What a rank needs to open TLS peer links: the authority it trusts and the name certificates are checked for.
#[derive(Clone)]
pub struct PeerTls {
    config: Arc<rustls::ClientConfig>,
    /// Checked against every neighbour's certificate; `None`: the host of the neighbour's address.
    domain: Option<String>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl PeerTls {
    /// Trust the certificate authorities in `ca_pem`; check certificates for `domain` (or each neighbour's host).
    pub fn new(ca_pem: &[u8], domain: Option<String>) -> Result<PeerTls, String> {
        let mut roots = rustls::RootCertStore::empty();
        let mut any = false;
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| format!("cannot read the CA certificate: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("unusable CA certificate: {e}"))?;
            any = true;
        }
        if !any {
            return Err("the CA file holds no PEM certificate".into());
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(PeerTls {
            config: Arc::new(config),
            domain,
        })
    }

    /// A client connection to the daemon at `address` ("host:port").
    pub fn connect(&self, address: &str) -> Result<rustls::ClientConnection, String> {
        let host = match &self.domain {
            Some(d) => d.clone(),
            None => host_of(address).to_string(),
        };
        let name = ServerName::try_from(host.clone())
            .map_err(|_| format!("{host:?} is not a valid name for a TLS certificate"))?;
        rustls::ClientConnection::new(self.config.clone(), name).map_err(|e| e.to_string())
    }
}

/// The host part of "host:port" (brackets of an IPv6 address removed).
fn host_of(address: &str) -> &str {
    let host = match address.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => address,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// The daemon's side: serve `cert_pem` (chain) with `key_pem` on peer links.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<rustls::ServerConfig>, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot read the certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("cannot read the private key: {e}"))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("unusable certificate or key: {e}"))?;
    // A link carries data one way: no session tickets to leave unread on the other end.
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_addresses() {
        assert_eq!(host_of("10.0.0.1:7070"), "10.0.0.1");
        assert_eq!(host_of("[::1]:7070"), "::1");
        assert_eq!(host_of("node-3.example:1"), "node-3.example");
        assert_eq!(host_of("node-3"), "node-3");
    }

    #[test]
    fn garbage_authorities_are_refused_clearly() {
        assert!(PeerTls::new(b"not a pem", None)
            .unwrap_err()
            .contains("no PEM certificate"));
        assert!(server_config(b"", b"").is_err());
    }
}
