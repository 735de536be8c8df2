//! The ddlf wire protocol, generated from `proto/ddlf.proto`.
//!
//! This crate holds the messages, the gRPC client and server traits, and the protocol version constant.
//! Nothing else: no networking policy, no Python.

#![allow(clippy::all)]

/// Generated protobuf messages and gRPC service (package `ddlf.v1`).
pub mod v1 {
    tonic::include_proto!("ddlf.v1");
}

pub use v1::*;

/// Bumped whenever a message changes incompatibly, or what the master asks of the worker's Python does (5: a
/// training run's set-up says whether it all-reduces worker to worker). Master and worker compare it at connect time.
pub const PROTOCOL_VERSION: u32 = 5;

/// The package version, shared by the master and the worker daemon.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
