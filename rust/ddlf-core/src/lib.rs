//! ddlf's pure-Rust core: everything that needs neither Python nor a network, so that it is testable with
//! `cargo test` alone.
//!
//! * [`auth`]: shared-token checks in constant time.

pub mod auth;
