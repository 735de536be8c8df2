//! The gRPC service of a worker daemon.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ddlf_proto::worker_server::Worker;
use ddlf_proto::{
    CallReply, CallRequest, HelloReply, HelloRequest, Op, PingReply, PingRequest, ShutdownReply,
    ShutdownRequest, StatusReply, StatusRequest, PROTOCOL_VERSION, VERSION,
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::jobs::{label, JobSender};
use crate::state::{rss_bytes, WorkerState};

/// Answers the network-side requests itself and queues interpreter work.
pub struct WorkerService {
    state: Arc<WorkerState>,
    jobs: JobSender,
    stop: watch::Sender<bool>,
}

impl WorkerService {
    pub fn new(state: Arc<WorkerState>, jobs: JobSender, stop: watch::Sender<bool>) -> Self {
        WorkerService { state, jobs, stop }
    }

    fn reject(&self, status: Status) -> Status {
        self.state.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(code = ?status.code(), message = status.message(), "request rejected");
        status
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
        }))
    }

    async fn ping(&self, request: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
        Ok(Response::new(PingReply {
            nonce: request.into_inner().nonce,
            uptime_ms: self.state.started.elapsed().as_millis() as u64,
        }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let (running, running_for) = self
            .state
            .running()
            .map(|(op, d)| (op, d.as_millis() as u64))
            .unwrap_or_default();
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
        }))
    }

    async fn call(&self, request: Request<CallRequest>) -> Result<Response<CallReply>, Status> {
        let start = Instant::now();
        let req = request.into_inner();
        if Op::try_from(req.op).unwrap_or(Op::Unspecified) == Op::Unspecified {
            return Err(self.reject(Status::invalid_argument(format!(
                "unknown operation code {}",
                req.op
            ))));
        }
        let what = label(&req);
        let Some(waiting) = self.jobs.submit(req) else {
            return Err(Status::unavailable("the worker is shutting down"));
        };
        let reply = waiting
            .await
            .map_err(|_| Status::unavailable("the worker stopped before answering"))?;
        tracing::debug!(
            request = %what,
            micros = start.elapsed().as_micros() as u64,
            compute_s = reply.compute_seconds,
            error = reply.error,
            "call served"
        );
        Ok(Response::new(reply))
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
