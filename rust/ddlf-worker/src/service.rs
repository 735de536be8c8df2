//! The gRPC service of a worker daemon.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ddlf_proto::worker_server::Worker;
use ddlf_proto::{
    CallReply, CallRequest, HelloReply, HelloRequest, LogsReply, LogsRequest, PingReply,
    PingRequest, ShutdownReply, ShutdownRequest, StacksReply, StacksRequest, StatusReply,
    StatusRequest, PROTOCOL_VERSION, VERSION,
};
use std::pin::Pin;

use ddlf_core::frame::{FrameError, FrameLimits};
use ddlf_net::refusal;
use ddlf_net::stream::{from_chunks, to_chunks, Expect, Header, StreamError};
use ddlf_proto::Chunk;
use ddlf_proto::Refusal;
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::jobs::JobSender;
use crate::requests::{label, log_reply, screen};
use crate::state::{rss_bytes, WorkerState};

/// Bytes per streamed chunk.
pub const CHUNK_BYTES: usize = 4 << 20;

type ChunkStream = Pin<Box<dyn Stream<Item = Result<Chunk, Status>> + Send>>;

/// Answers the network-side requests itself and queues interpreter work.
pub struct WorkerService {
    state: Arc<WorkerState>,
    jobs: JobSender,
    stop: watch::Sender<bool>,
    limits: FrameLimits,
}

impl WorkerService {
    pub fn new(
        state: Arc<WorkerState>,
        jobs: JobSender,
        stop: watch::Sender<bool>,
        limits: FrameLimits,
    ) -> Self {
        WorkerService {
            state,
            jobs,
            stop,
            limits,
        }
    }

    /// Queue a request for the interpreter and wait for its reply.
    async fn run(&self, req: CallRequest) -> Result<CallReply, Status> {
        let start = Instant::now();
        screen(&self.state, &req)?;
        let what = label(&req);
        // Every line logged about this request, here and on the interpreter thread, carries its id (the
        // master's, unique per master process) and what it runs.
        let span = tracing::info_span!("call", id = req.request_id, op = %what);
        let Some(waiting) = self.jobs.submit(req) else {
            return Err(refusal::status(
                Refusal::ShuttingDown,
                "the worker is shutting down",
            ));
        };
        let reply = waiting
            .instrument(span.clone())
            .await
            .map_err(|_| Status::unavailable("the worker stopped before answering"))?;
        let _entered = span.enter();
        log_reply(&reply, start.elapsed());
        Ok(reply)
    }

    /// Read a streamed request to the end, checking declared sizes before allocating.
    async fn receive(&self, stream: Streaming<Chunk>) -> Result<CallRequest, Status> {
        let (first, value) = from_chunks(stream, self.limits, Expect::Request)
            .await
            .map_err(|e| match e {
                StreamError::Status(s) => s,
                StreamError::Frame(f) => self.reject(frame_status(f)),
                StreamError::Malformed(m) => self.reject(refusal::status(Refusal::Malformed, m)),
            })?;
        let mut request = first.request.ok_or_else(|| {
            self.reject(refusal::status(
                Refusal::Malformed,
                "the first chunk carries no request",
            ))
        })?;
        request.value = Some(value);
        Ok(request)
    }

    fn reject(&self, status: Status) -> Status {
        self.state.reject(status)
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn hello(&self, request: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
        let req = request.into_inner();
        if req.protocol_version != PROTOCOL_VERSION {
            tracing::warn!(
                master_protocol = req.protocol_version,
                master_version = %req.client_version,
                "master speaks another protocol version"
            );
        }
        Ok(Response::new(HelloReply {
            protocol_version: PROTOCOL_VERSION,
            worker_version: VERSION.to_string(),
            worker_name: self.state.name.clone(),
            pid: std::process::id() as u64,
            hostname: self.state.hostname.clone(),
            shm_visible: !req.shm_probe.is_empty()
                && ddlf_core::shm::map(&req.shm_probe, &[], &[]).is_ok(),
            instance: self.state.instance,
        }))
    }

    async fn ping(&self, request: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
        Ok(Response::new(PingReply {
            nonce: request.into_inner().nonce,
            uptime_ms: self.state.started.elapsed().as_millis() as u64,
            instance: self.state.instance,
        }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let (running, running_for) = self.state.running_ms();
        Ok(Response::new(StatusReply {
            worker_version: VERSION.to_string(),
            uptime_ms: self.state.started.elapsed().as_millis() as u64,
            pid: std::process::id() as u64,
            rss_bytes: rss_bytes(),
            running,
            running_for_ms: running_for,
            requests_served: self.state.served.load(Ordering::Relaxed),
            requests_rejected: self.state.rejected.load(Ordering::Relaxed),
            queue_depth: self.state.queued.load(Ordering::Relaxed),
            hostname: self.state.hostname.clone(),
            instance: self.state.instance,
            connections_open: self.state.connections.open.load(Ordering::Relaxed),
            connections_refused: self.state.connections.refused.load(Ordering::Relaxed),
            runs: self.state.runs(),
            lane_pings: self.state.lane_pings.load(Ordering::Relaxed),
        }))
    }

    type CallStreamStream = ChunkStream;

    async fn call_stream(
        &self,
        request: Request<Streaming<Chunk>>,
    ) -> Result<Response<ChunkStream>, Status> {
        let req = self.receive(request.into_inner()).await?;
        tracing::trace!(request = %label(&req), "streamed request received");
        let reply = self.run(req).await?;
        Ok(Response::new(Box::pin(tokio_stream::iter(
            reply_chunks(reply, CHUNK_BYTES).into_iter().map(Ok),
        ))))
    }

    async fn logs(&self, request: Request<LogsRequest>) -> Result<Response<LogsReply>, Status> {
        let (lines, dropped) = crate::logs::ring().tail(request.into_inner().lines as usize);
        Ok(Response::new(LogsReply { lines, dropped }))
    }

    async fn stacks(&self, _: Request<StacksRequest>) -> Result<Response<StacksReply>, Status> {
        // The collectives first, then the frames: a collective listed was running before the stacks were taken,
        // so while it still runs its caller is in them (taken after the dump, one that began meanwhile was listed
        // beside stacks from before its call).
        let collectives = ddlf_collective::activity::snapshot();
        let state = self.state.clone();
        // Off the runtime's threads: the dump is file I/O and a signal handler walking every Python frame.
        let dumped = tokio::task::spawn_blocking(move || state.stacks.dump())
            .await
            .map_err(|e| Status::internal(format!("the stack dump failed: {e}")))?;
        let (python, error) = match dumped {
            Ok(text) => (text, String::new()),
            Err(e) => (String::new(), e.to_string()),
        };
        let (running, running_for) = self.state.running_ms();
        Ok(Response::new(StacksReply {
            python,
            error,
            hostname: self.state.hostname.clone(),
            pid: std::process::id() as u64,
            running,
            running_for_ms: running_for,
            queue_depth: self.state.queued.load(Ordering::Relaxed),
            runs: self.state.runs(),
            connections_open: self.state.connections.open.load(Ordering::Relaxed),
            name: self.state.name.clone(),
            collectives,
        }))
    }

    async fn shutdown(
        &self,
        _: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownReply>, Status> {
        tracing::info!("shutdown requested by the master");
        let stop = self.stop.clone();
        let jobs = self.jobs.clone();
        // Answer first, then stop: the reply must make it out before the server closes.
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let _ = stop.send(true);
            jobs.shutdown();
        });
        Ok(Response::new(ShutdownReply {}))
    }
}

/// A reply as a stream of chunks: the header (with the declared lengths), then the data, never copied.
pub fn reply_chunks(mut reply: CallReply, chunk_bytes: usize) -> Vec<Chunk> {
    let value = reply.value.take().unwrap_or_default();
    to_chunks(Header::Reply(reply), value, chunk_bytes)
}

fn frame_status(e: FrameError) -> Status {
    match e {
        FrameError::TooLarge { .. } | FrameError::TooManyParts(..) | FrameError::Overflow => {
            refusal::status(Refusal::TooLarge, e.to_string())
        }
        _ => refusal::status(Refusal::Malformed, e.to_string()),
    }
}
