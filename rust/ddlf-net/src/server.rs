//! Server plumbing shared by every daemon: a tonic server builder with ddlf's limits and keepalives, and the
//! token check that runs on the request headers before anything in the body is decoded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ddlf_core::auth::{Token, TOKEN_HEADER};
use tonic::{Request, Status};

/// Limits and timers of a daemon's server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The largest request the daemon accepts (streamed requests declare their size up front and are refused
    /// before anything is allocated); larger ones are refused with `RESOURCE_EXHAUSTED`.
    pub max_message_size: usize,
    /// Requests in flight per connection.
    pub max_concurrent_streams: u32,
    /// HTTP/2 keepalive pings to the master; a master that stops answering is disconnected.
    pub keepalive_interval: Duration,
    /// How long an unanswered keepalive ping is tolerated.
    pub keepalive_timeout: Duration,
    /// Serve TLS with this certificate chain and key (PEM).
    pub tls: Option<ServerTls>,
    /// Connections open at once, and how long a new one may take to open with a valid preface.
    pub guard: crate::guard::GuardConfig,
}

/// The daemon's TLS identity.
#[derive(Clone)]
pub struct ServerTls {
    /// The certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// The private key, PEM.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").finish_non_exhaustive() // never print the key
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_message_size: 64 << 30,
            max_concurrent_streams: 256,
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
            tls: None,
            guard: Default::default(),
        }
    }
}

impl ServerConfig {
    /// A tonic server builder with these limits (and TLS, if configured) applied.
    pub fn builder(&self) -> Result<tonic::transport::Server, tonic::transport::Error> {
        let builder = tonic::transport::Server::builder();
        let builder = match &self.tls {
            Some(tls) => builder.tls_config(tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem),
            ))?,
            None => builder,
        };
        Ok(builder
            .tcp_nodelay(true)
            .max_concurrent_streams(self.max_concurrent_streams)
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .initial_stream_window_size(crate::STREAM_WINDOW)
            .initial_connection_window_size(crate::CONNECTION_WINDOW)
            .max_frame_size(crate::MAX_FRAME))
    }
}

/// Checks the token of every request. Runs on the headers only: a request without the right token is refused
/// before its body is read or deserialized.
#[derive(Clone)]
pub struct ServerAuth {
    token: Option<Arc<Token>>,
    rejected: Arc<AtomicU64>,
}

impl ServerAuth {
    /// `token: None` accepts every request (only allowed on loopback; the daemon enforces that).
    pub fn new(token: Option<Token>, rejected: Arc<AtomicU64>) -> Self {
        ServerAuth {
            token: token.map(Arc::new),
            rejected,
        }
    }

    fn refuse(&self, req: &Request<()>, why: &'static str) -> Status {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let peer = req
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "unknown peer".into());
        tracing::warn!(%peer, reason = why, "request refused: authentication failed");
        crate::refusal::status(ddlf_proto::Refusal::Unauthenticated, why)
    }
}

impl tonic::service::Interceptor for ServerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return Ok(req);
        };
        match req.metadata().get(TOKEN_HEADER) {
            None => Err(self.refuse(&req, "this worker requires a token and none was sent")),
            Some(value) if token.verify_header(value.as_bytes()) => Ok(req),
            Some(_) => Err(self.refuse(&req, "wrong token")),
        }
    }
}

/// Whether an address is loopback-only, where running without a token is acceptable.
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    fn request_with(header: Option<&str>) -> Request<()> {
        let mut req = Request::new(());
        if let Some(h) = header {
            req.metadata_mut().insert(TOKEN_HEADER, h.parse().unwrap());
        }
        req
    }

    #[test]
    fn no_token_configured_accepts_everything() {
        let mut auth = ServerAuth::new(None, Arc::default());
        assert!(auth.call(request_with(None)).is_ok());
    }

    #[test]
    fn token_is_required_and_checked() {
        let rejected = Arc::new(AtomicU64::new(0));
        let mut auth = ServerAuth::new(Token::new("k"), rejected.clone());
        assert_eq!(
            auth.call(request_with(None)).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(auth.call(request_with(Some("Bearer nope"))).is_err());
        assert!(auth.call(request_with(Some("Bearer k"))).is_ok());
        assert_eq!(rejected.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn loopback_detection() {
        assert!(is_loopback(&"127.0.0.1:1".parse().unwrap()));
        assert!(is_loopback(&"[::1]:1".parse().unwrap()));
        assert!(!is_loopback(&"0.0.0.0:1".parse().unwrap()));
        assert!(!is_loopback(&"10.1.2.3:1".parse().unwrap()));
    }
}
