//! Starting and stopping a worker daemon on its own tokio runtime.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ddlf_core::auth::Token;
use ddlf_core::frame::FrameLimits;
use ddlf_net::server::is_loopback;
use ddlf_net::{ServerAuth, ServerConfig};
use ddlf_proto::worker_server::WorkerServer;
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;

use crate::jobs::{queue, JobReceiver, JobSender};
use crate::service::WorkerService;
use crate::state::WorkerState;

/// Why a daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error(
        "refusing to listen on non-loopback address {address} without a token: pushed code runs with this \
         daemon's privileges. Set DDLF_TOKEN or --token-file, or pass --insecure if you really mean it"
    )]
    InsecureRefused { address: SocketAddr },
    #[error("cannot start the network runtime: {0}")]
    Runtime(std::io::Error),
    #[error("invalid TLS certificate or key: {0}")]
    Tls(String),
}

/// How to run a daemon.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// `host:port`; port 0 picks a free one (see [`Daemon::local_addr`]).
    pub listen: String,
    pub token: Option<Token>,
    /// Allow a non-loopback address without a token.
    pub insecure: bool,
    pub server: ServerConfig,
    pub name: String,
    /// Threads of the network runtime.
    pub runtime_threads: usize,
    /// How long the interpreter thread spins for the next lane request before it sleeps.
    pub lane_spin: Duration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            listen: "127.0.0.1:7070".into(),
            token: None,
            insecure: false,
            server: ServerConfig::default(),
            name: String::new(),
            runtime_threads: 1,
            lane_spin: ddlf_net::lane::default_spin(),
        }
    }
}

/// A running daemon's network side. The interpreter side is the [`JobReceiver`] returned by [`Daemon::start`].
///
/// The network runtime is driven by its own thread (`ddlf-net`). With one network thread (the default) it is a
/// current-thread runtime: accepting, decoding, answering gRPC pings and handing jobs over all happen on that thread
/// with no cross-thread wake-ups, which measured faster on loopback than a multi-threaded runtime.
pub struct Daemon {
    local_addr: SocketAddr,
    state: Arc<WorkerState>,
    stop: watch::Sender<bool>,
    jobs: JobSender,
    done: Option<std::sync::mpsc::Receiver<()>>,
}

impl Daemon {
    /// Bind, start serving, and return the daemon and the interpreter's end of its queue.
    pub fn start(config: DaemonConfig) -> Result<(Daemon, JobReceiver), DaemonError> {
        let std_listener =
            std::net::TcpListener::bind(&config.listen).map_err(|source| DaemonError::Bind {
                address: config.listen.clone(),
                source,
            })?;
        let local_addr = std_listener
            .local_addr()
            .map_err(|source| DaemonError::Bind {
                address: config.listen.clone(),
                source,
            })?;
        if config.token.is_none() && !config.insecure && !is_loopback(&local_addr) {
            return Err(DaemonError::InsecureRefused {
                address: local_addr,
            });
        }
        std_listener
            .set_nonblocking(true)
            .map_err(|source| DaemonError::Bind {
                address: config.listen.clone(),
                source,
            })?;
        let runtime = if config.runtime_threads <= 1 {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(config.runtime_threads)
                .thread_name("ddlf-net")
                .enable_all()
                .build()
        }
        .map_err(DaemonError::Runtime)?;

        let name = if config.name.is_empty() {
            local_addr.to_string()
        } else {
            config.name.clone()
        };
        let state = Arc::new(WorkerState::new(name));
        let limits = FrameLimits {
            max_total: config.server.max_message_size as u64,
            ..Default::default()
        };
        let (jobs, receiver) =
            queue(state.clone(), limits, config.lane_spin).map_err(DaemonError::Runtime)?;
        let (stop, mut stopped) = watch::channel(false);
        let service = WorkerService::new(state.clone(), jobs.clone(), stop.clone(), limits);
        // A streamed chunk is at most CHUNK_BYTES plus its header; unary requests up to the configured size.
        let server = WorkerServer::new(service)
            .max_decoding_message_size(
                config
                    .server
                    .max_message_size
                    .max(crate::service::CHUNK_BYTES + 4096),
            )
            .max_encoding_message_size(usize::MAX);
        let auth = ServerAuth::new(config.token.clone(), state.rejected.clone());
        let svc = InterceptedService::new(server, auth);
        let mut builder = config
            .server
            .builder()
            .map_err(|e| DaemonError::Tls(ddlf_net::error::describe_error(&e)))?;
        let mut guard = config.server.guard.clone();
        guard.tls = config.server.tls.is_some();
        let connections = state.connections.clone();
        // Direct lanes on a plaintext daemon (a TLS daemon's master speaks gRPC only), peer links on both (a TLS
        // daemon's inside a TLS handshake with its own certificate): their hellos are checked on this runtime;
        // then the interpreter thread serves a lane, and a peer link waits in the mailbox for this process's
        // ring.
        let plaintext = !guard.tls;
        let peer_tls = match &config.server.tls {
            Some(tls) => Some(
                ddlf_collective::tls::server_config(&tls.cert_pem, &tls.key_pem)
                    .map_err(DaemonError::Tls)?,
            ),
            None => None,
        };
        let token = config.token.clone().map(Arc::new);
        let handshake = guard.handshake_timeout;
        let lanes = plaintext.then(|| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (
                tx,
                rx,
                token.clone(),
                state.clone(),
                jobs.clone(),
                stop.subscribe(),
            )
        });
        let peers = {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            Some((tx, rx, token.clone(), peer_tls, state.rejected.clone()))
        };
        // The ring links this process opens present the daemon's own token (a cluster's workers share it).
        ddlf_collective::set_local_token(config.token.clone());
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("ddlf-net".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot register the listener");
                            return;
                        }
                    };
                    // Every connection passes the admission guard (limit, preface check, handshake deadline)
                    // with Nagle off: HTTP/2 writes small frames (headers, trailers, window updates) after large
                    // ones, and Nagle would hold them for the peer's delayed ACK.
                    let lanes = lanes.map(|(tx, mut rx, token, state, jobs, stopping)| {
                        tokio::spawn(async move {
                            while let Some(arrival) = rx.recv().await {
                                let (token, state, jobs) =
                                    (token.clone(), state.clone(), jobs.clone());
                                tokio::spawn(crate::lanes::welcome(
                                    arrival,
                                    token,
                                    handshake,
                                    state,
                                    move |lane| jobs.add_lane(lane),
                                    stopping.clone(),
                                ));
                            }
                        });
                        tx
                    });
                    let peers = peers.map(|(tx, mut rx, token, tls, rejected)| {
                        tokio::spawn(async move {
                            while let Some(arrival) = rx.recv().await {
                                tokio::spawn(ddlf_collective::peer::welcome(
                                    arrival,
                                    token.clone(),
                                    tls.clone(),
                                    handshake,
                                    rejected.clone(),
                                ));
                            }
                        });
                        tx
                    });
                    let handlers = ddlf_net::guard::Handlers { lanes, peers };
                    let incoming = ddlf_net::guard::guarded(listener, guard, connections, handlers);
                    let result = builder
                        .add_service(svc)
                        .serve_with_incoming_shutdown(incoming, async move {
                            let _ = stopped.wait_for(|s| *s).await;
                        })
                        .await;
                    if let Err(e) = result {
                        tracing::error!(error = %e, "server stopped with an error");
                    }
                });
                runtime.shutdown_timeout(Duration::from_millis(100));
                let _ = done_tx.send(());
            })
            .map_err(DaemonError::Runtime)?;
        tracing::info!(
            address = %local_addr,
            auth = config.token.is_some(),
            tls = config.server.tls.is_some(),
            version = ddlf_proto::VERSION,
            "worker listening"
        );
        Ok((
            Daemon {
                local_addr,
                state,
                stop,
                jobs,
                done: Some(done),
            },
            receiver,
        ))
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The shared state (counters, what is running).
    pub fn state(&self) -> &Arc<WorkerState> {
        &self.state
    }

    /// Stop serving: close the listener, let in-flight replies finish (up to `grace`), stop the runtime.
    pub fn stop(mut self, grace: Duration) {
        self.shutdown_now(grace);
    }

    fn shutdown_now(&mut self, grace: Duration) {
        let _ = self.stop.send(true);
        self.jobs.shutdown();
        if let Some(done) = self.done.take() {
            // Open connections are given `grace` to finish; past it the network thread is left to wind down.
            if done
                .recv_timeout(grace + Duration::from_millis(200))
                .is_err()
            {
                tracing::warn!("network thread still busy after the grace period");
            }
        }
        tracing::info!(address = %self.local_addr, "worker stopped");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.done.is_some() {
            self.shutdown_now(Duration::from_secs(1));
        }
    }
}
