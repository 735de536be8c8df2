//! The master's connection to one worker daemon.
//!
//! A [`WorkerConn`] is cheap to clone (it shares one HTTP/2 connection) and every call has a deadline, so a
//! daemon killed with `kill -9` or a link that goes down turns into [`NetError`] in bounded time, never a hang.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ddlf_core::auth::{Token, TOKEN_HEADER};
use ddlf_core::frame::FrameLimits;
use ddlf_core::shm;
use ddlf_proto::worker_client::WorkerClient;
use ddlf_proto::{
    CallReply, CallRequest, HelloReply, HelloRequest, LogsRequest, PingRequest, ShutdownRequest,
    StacksReply, StacksRequest, StatusReply, StatusRequest, PROTOCOL_VERSION, VERSION,
};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status};

use crate::error::{describe_error, NetError};
use crate::lane::{Lane, PingLane};
use crate::stream::{from_chunks, to_chunks, Expect, Header, StreamError};

/// Chunk size of streamed values. Every gRPC call streams: request and reply of any size travel in chunks with
/// bounded memory (measured on loopback, a streamed no-op call cost what a unary one did: 90 vs 92 us).
pub const CHUNK_BYTES: usize = 4 << 20;

/// How the master connects to its workers.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Bound on establishing the TCP connection and the version handshake.
    pub connect_timeout: Duration,
    /// HTTP/2 keepalive: a worker whose host vanished is detected within interval + timeout even while a long
    /// call is waiting.
    pub keepalive_interval: Duration,
    /// How long a keepalive ping (and a heartbeat while a call waits on a lane) may go unanswered.
    pub keepalive_timeout: Duration,
    /// The shared token, sent on every request.
    pub token: Option<Token>,
    /// The largest reply the master accepts.
    pub max_message_size: usize,
    /// Pass large buffers through shared memory with workers on this machine.
    pub shared_memory: bool,
    /// Talk TLS, trusting this certificate authority.
    pub tls: Option<ClientTls>,
    /// Also open a direct lane to each worker (plaintext daemons only) for calls (any size).
    pub direct_lane: bool,
    /// How long a lane call spins for its reply before it blocks (see `lane::default_spin`), and a wait on the
    /// pool's runtime polls before its thread parks.
    pub lane_spin: Duration,
}

/// How the master checks a TLS daemon's certificate.
#[derive(Clone, Debug)]
pub struct ClientTls {
    /// The certificate authority (PEM) that signed the daemons' certificates.
    pub ca_pem: Vec<u8>,
    /// The name to check the certificate against (default: the host part of each address).
    pub domain: Option<String>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            connect_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(5),
            keepalive_timeout: Duration::from_secs(10),
            token: None,
            max_message_size: usize::MAX,
            shared_memory: true,
            tls: None,
            direct_lane: true,
            lane_spin: crate::lane::default_spin(),
        }
    }
}

/// The host part of `host:port` (brackets of an IPv6 literal removed).
fn host_of(address: &str) -> String {
    let host = match address.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => address,
    };
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// Adds the token header to every outgoing request.
#[derive(Clone)]
pub struct ClientAuth {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for ClientAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert(TOKEN_HEADER, h.clone());
        }
        Ok(req)
    }
}

type Inner = WorkerClient<InterceptedService<Channel, ClientAuth>>;

/// A live, version-checked connection to one worker daemon.
#[derive(Clone)]
pub struct WorkerConn {
    address: String,
    client: Inner,
    hello: HelloReply,
    limits: FrameLimits,
    /// Large buffers may go through shared memory (the worker opened our probe file at connect).
    shared_memory: bool,
    /// The direct lane, when one could be opened.
    lane: Option<Arc<Lane>>,
    /// The ping lane, when one could be opened (opened and used as the direct lane is).
    ping_lane: Option<Arc<PingLane>>,
}

impl WorkerConn {
    /// Connect to `address` (`host:port`), and check that the worker speaks our protocol version.
    pub async fn connect(address: &str, config: &ClientConfig) -> Result<Self, NetError> {
        let scheme = if config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let uri = format!("{scheme}://{address}");
        let invalid = |reason: String| NetError::InvalidAddress {
            address: address.to_string(),
            reason,
        };
        let mut endpoint = Endpoint::from_shared(uri).map_err(|e| invalid(describe_error(&e)))?;
        if let Some(tls) = &config.tls {
            let domain = tls.domain.clone().unwrap_or_else(|| host_of(address));
            endpoint = endpoint
                .tls_config(
                    ClientTlsConfig::new()
                        .ca_certificate(Certificate::from_pem(&tls.ca_pem))
                        .domain_name(domain),
                )
                .map_err(|e| invalid(describe_error(&e)))?;
        }
        let endpoint = endpoint
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(config.keepalive_interval)
            .keep_alive_timeout(config.keepalive_timeout)
            .keep_alive_while_idle(true)
            .initial_stream_window_size(crate::STREAM_WINDOW)
            .initial_connection_window_size(crate::CONNECTION_WINDOW)
            .max_frame_size(crate::MAX_FRAME);
        let connect = tokio::time::timeout(config.connect_timeout, endpoint.connect());
        let channel = match connect.await {
            Err(_) => {
                return Err(NetError::DeadlineExceeded {
                    address: address.to_string(),
                    after: config.connect_timeout,
                })
            }
            Ok(Err(e)) => {
                return Err(NetError::Unavailable {
                    address: address.to_string(),
                    reason: describe_error(&e),
                })
            }
            Ok(Ok(ch)) => ch,
        };
        let header = match &config.token {
            Some(t) => Some(t.header_value().parse().map_err(|_| {
                invalid("the token contains characters that cannot travel in a header".into())
            })?),
            None => None,
        };
        let client = WorkerClient::with_interceptor(channel, ClientAuth { header })
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        let mut conn = WorkerConn {
            address: address.to_string(),
            client,
            hello: HelloReply::default(),
            limits: FrameLimits {
                max_total: config.max_message_size as u64,
                ..Default::default()
            },
            shared_memory: false,
            lane: None,
            ping_lane: None,
        };
        // Shared memory is used only if the worker can open a file we wrote (same machine *and* same /dev/shm:
        // a container on this kernel has its own).
        let probe = if config.shared_memory && shm::available() {
            shm::write(&[b"ddlf"]).ok().map(|l| l.name)
        } else {
            None
        };
        let shm_probe = probe.clone().unwrap_or_default();
        let hello = conn
            .unary(Some(config.connect_timeout), |mut c| async move {
                c.hello(HelloRequest {
                    protocol_version: PROTOCOL_VERSION,
                    client_version: VERSION.to_string(),
                    shm_probe,
                })
                .await
            })
            .await;
        if let Some(name) = &probe {
            shm::unlink(name);
        }
        let hello = hello?;
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(NetError::ProtocolMismatch {
                address: address.to_string(),
                ours: PROTOCOL_VERSION,
                our_version: VERSION.to_string(),
                theirs: hello.protocol_version,
                their_version: hello.worker_version,
            });
        }
        tracing::debug!(address, worker_version = %hello.worker_version, pid = hello.pid, "connected");
        conn.shared_memory = probe.is_some() && hello.shm_visible;
        if config.direct_lane && config.tls.is_none() {
            // Without a lane every call still works over gRPC, only slower: a failure here is no reason to fail
            // the connection.
            match Lane::open(
                address,
                config.token.as_ref(),
                config.connect_timeout,
                conn.limits,
                config.lane_spin,
            )
            .await
            {
                Ok(lane) if lane.instance() == hello.instance => conn.lane = Some(Arc::new(lane)),
                Ok(_) => tracing::warn!(
                    address,
                    "direct lane reached another daemon instance: not used"
                ),
                Err(e) => {
                    tracing::warn!(address, error = %e, "no direct lane: every call goes over gRPC")
                }
            }
            // Likewise pings: without a ping lane they go over gRPC.
            match PingLane::open(
                address,
                config.token.as_ref(),
                config.connect_timeout,
                config.lane_spin,
            )
            .await
            {
                Ok(lane) if lane.instance() == hello.instance => {
                    conn.ping_lane = Some(Arc::new(lane))
                }
                Ok(_) => tracing::warn!(
                    address,
                    "ping lane reached another daemon instance: not used"
                ),
                Err(e) => {
                    tracing::debug!(address, error = %e, "no ping lane: pings go over gRPC")
                }
            }
        }
        conn.hello = hello;
        Ok(conn)
    }

    /// The direct lane for one small call, unless there is none or another thread is using it.
    pub fn lane(&self) -> Option<crate::lane::LaneCall<'_>> {
        self.lane.as_ref()?.begin()
    }

    /// Whether this connection has a direct lane open (free or busy; not broken).
    pub fn has_lane(&self) -> bool {
        self.lane.as_ref().is_some_and(|l| l.is_open())
    }

    /// The ping lane for one ping, unless there is none or another thread is using it.
    pub fn ping_lane(&self) -> Option<crate::lane::PingCall<'_>> {
        self.ping_lane.as_ref()?.begin()
    }

    /// Whether this connection has a ping lane open (free or busy; not broken).
    pub fn has_ping_lane(&self) -> bool {
        self.ping_lane.as_ref().is_some_and(|l| l.is_open())
    }

    /// Reopen a broken direct lane and ping lane; call it once the worker has answered over gRPC (so it is
    /// alive). A failure leaves calls (or pings) on gRPC.
    pub async fn revive_lane(&self) {
        if let Some(lane) = &self.lane {
            if let Err(e) = lane.reopen().await {
                tracing::debug!(address = %self.address, error = %e, "direct lane not reopened");
            }
        }
        if let Some(lane) = &self.ping_lane {
            if let Err(e) = lane.reopen().await {
                tracing::debug!(address = %self.address, error = %e, "ping lane not reopened");
            }
        }
    }

    /// The address this connection was made to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Whether large buffers to and from this worker go through shared memory.
    pub fn shared_memory(&self) -> bool {
        self.shared_memory
    }

    /// What the worker said about itself at connect time.
    pub fn hello(&self) -> &HelloReply {
        &self.hello
    }

    /// Run one unary call with an optional deadline, mapping every failure to a [`NetError`].
    async fn unary<T, F, Fut>(&self, timeout: Option<Duration>, f: F) -> Result<T, NetError>
    where
        F: FnOnce(Inner) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let fut = f(self.client.clone());
        self.with_deadline(timeout, async move { Ok(fut.await?.into_inner()) })
            .await
    }

    /// Await `fut` within `timeout`, mapping every failure to a [`NetError`] naming this worker.
    async fn with_deadline<T>(
        &self,
        timeout: Option<Duration>,
        fut: impl std::future::Future<Output = Result<T, StreamError>>,
    ) -> Result<T, NetError> {
        let start = Instant::now();
        let deadline = |address: String| NetError::DeadlineExceeded {
            address,
            after: timeout.unwrap_or_default(),
        };
        let result = match timeout {
            Some(t) => match tokio::time::timeout(t, fut).await {
                Ok(r) => r,
                Err(_) => return Err(deadline(self.address.clone())),
            },
            None => fut.await,
        };
        result.map_err(|e| match e {
            StreamError::Status(s) => {
                // The channel's own deadline layer reports an expired `grpc-timeout` as a cancelled transport
                // error; the clock tells the two apart.
                let expired = timeout.is_some_and(|t| start.elapsed() >= t);
                match NetError::from_status(&self.address, &s) {
                    NetError::DeadlineExceeded { address, .. } => deadline(address),
                    NetError::Unavailable { address, .. } if expired => deadline(address),
                    e => e,
                }
            }
            invalid => NetError::InvalidReply {
                address: self.address.clone(),
                reason: invalid.to_string(),
            },
        })
    }

    /// Run an operation on the worker's interpreter thread (streamed in chunks of [`CHUNK_BYTES`]).
    pub async fn call(
        &self,
        request: CallRequest,
        timeout: Option<Duration>,
    ) -> Result<CallReply, NetError> {
        self.call_stream(request, timeout, CHUNK_BYTES).await
    }

    /// Run an operation whose value travels as a stream of chunks (large values): no size limit, and the
    /// reply is assembled into buffers allocated once at their declared (and checked) size.
    pub async fn call_stream(
        &self,
        mut request: CallRequest,
        timeout: Option<Duration>,
        chunk_bytes: usize,
    ) -> Result<CallReply, NetError> {
        request.instance = self.hello.instance;
        let value = request.value.take().unwrap_or_default();
        let chunks = to_chunks(Header::Request(request), value, chunk_bytes);
        let mut client = self.client.clone();
        let limits = self.limits;
        let exchange = async move {
            let mut req = Request::new(tokio_stream::iter(chunks));
            if let Some(t) = timeout {
                req.set_timeout(t);
            }
            let stream = client.call_stream(req).await?.into_inner();
            let (first, value) = from_chunks(stream, limits, Expect::Reply).await?;
            let mut reply = first
                .reply
                .ok_or(StreamError::Malformed("the first chunk carries no reply"))?;
            reply.value = Some(value);
            Ok(reply)
        };
        self.with_deadline(timeout, exchange).await
    }

    /// Round-trip time of a ping over gRPC, answered by the worker's network runtime (never by its Python
    /// thread). `Pool::heartbeat` uses the ping lane where there is one.
    pub async fn ping(&self, timeout: Option<Duration>) -> Result<Duration, NetError> {
        self.heartbeat(timeout).await.map(|(rtt, _)| rtt)
    }

    /// A ping that also returns the daemon's instance id: a different id than at connect time means the
    /// daemon at this address restarted (and lost what was pushed to it).
    pub async fn heartbeat(&self, timeout: Option<Duration>) -> Result<(Duration, u64), NetError> {
        let start = Instant::now();
        let reply = self
            .unary(timeout, |mut c| async move {
                c.ping(PingRequest { nonce: 1 }).await
            })
            .await?;
        Ok((start.elapsed(), reply.instance))
    }

    /// The worker's status (answered without its Python thread).
    pub async fn status(&self, timeout: Option<Duration>) -> Result<StatusReply, NetError> {
        self.unary(
            timeout,
            |mut c| async move { c.status(StatusRequest {}).await },
        )
        .await
    }

    /// The daemon's last `lines` log lines (0: all it keeps) and how many fell out of its buffer.
    pub async fn logs(
        &self,
        lines: u32,
        timeout: Option<Duration>,
    ) -> Result<(Vec<String>, u64), NetError> {
        self.unary(timeout, |mut c| async move {
            c.logs(LogsRequest { lines }).await
        })
        .await
        .map(|r| (r.lines, r.dropped))
    }

    /// Every Python thread's stack and what the interpreter thread serves (answered without the interpreter).
    pub async fn stacks(&self, timeout: Option<Duration>) -> Result<StacksReply, NetError> {
        self.unary(
            timeout,
            |mut c| async move { c.stacks(StacksRequest {}).await },
        )
        .await
    }

    /// Ask the daemon to exit.
    pub async fn shutdown(&self, timeout: Option<Duration>) -> Result<(), NetError> {
        self.unary(timeout, |mut c| async move {
            c.shutdown(ShutdownRequest {}).await
        })
        .await
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn host_of_strips_port_and_brackets() {
        assert_eq!(host_of("127.0.0.1:7070"), "127.0.0.1");
        assert_eq!(
            host_of("worker-0.ddlf.default.svc:7070"),
            "worker-0.ddlf.default.svc"
        );
        assert_eq!(host_of("[::1]:7070"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
    }
}
