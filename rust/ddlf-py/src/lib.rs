//! `ddlf._ddlf`: the Python bindings. Only conversions, GIL handling and error mapping live here; the logic is
//! in the crates below (`ddlf-net`, `ddlf-worker`, `ddlf-core`).
//!
//! * [`client`]: `Client` over `ddlf_net::Pool`, and `Reply`, one worker's answer.
//! * [`collective`]: `Ring`, a worker's rank in a ring all-reduce among workers.
//! * [`wait`]: the one GIL-releasing, Ctrl-C-aware wait every blocking call goes through.
//! * [`worker`]: `serve_worker`, the daemon's interpreter loop.
//! * [`buffers`]: `RecvBuffer`, received bytes exposed to Python without a copy; reading Python buffers.
//! * [`arrays`]: `ddlf.ops` array kernels (merge, precision), dtype-checked.
//! * [`ops`]: `ddlf.ops` index kernels (shuffle, partitions, gather).
//! * [`pipeline`]: `BatchPipeline`, batches gathered and prefetched by a Rust thread (or inline, when small).
//! * [`errors`]: Rust errors to `ddlf.errors` exception classes.
//! * [`logging`]: `tracing` output, configured from `DDLF_LOG` / `RUST_LOG`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod arrays;
mod buffers;
mod client;
mod collective;
mod errors;
mod logging;
mod ops;
mod pipeline;
mod wait;
mod worker;

/// Apply the allocator policy for large transfers (`ddlf_core::memory`): called when a cluster, a worker or a
/// training run starts, never at import. `DDLF_MALLOC=system` keeps glibc's defaults. Returns whether this
/// process runs with the policy; idempotent.
#[pyfunction]
fn tune_allocator() -> bool {
    static TUNED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TUNED.get_or_init(|| {
        std::env::var("DDLF_MALLOC").map_or(true, |v| v != "system")
            && ddlf_core::memory::tune_for_transfers(ddlf_core::memory::TRANSFER_POLICY)
    })
}

/// Hand the allocator's free memory back to the kernel (`ddlf_core::memory::return_free_memory`), without the
/// interpreter lock: a worker daemon does when its last run ends and on a reset. Returns whether any was released.
#[pyfunction]
fn return_free_memory(py: Python<'_>) -> bool {
    py.detach(ddlf_core::memory::return_free_memory)
}

#[pymodule]
fn _ddlf(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", ddlf_proto::VERSION)?;
    m.add("PROTOCOL_VERSION", ddlf_proto::PROTOCOL_VERSION)?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::Reply>()?;
    m.add_class::<collective::Ring>()?;
    m.add_function(wrap_pyfunction!(collective::check_ring_spec, m)?)?;
    m.add_function(wrap_pyfunction!(collective::check_reduction, m)?)?;
    m.add_function(wrap_pyfunction!(collective::leave_rings, m)?)?;
    m.add_class::<errors::ErrorClass>()?;
    m.add_class::<buffers::RecvBuffer>()?;
    m.add_class::<pipeline::BatchPipeline>()?;
    m.add_class::<worker::ServingDaemon>()?;
    m.add_function(wrap_pyfunction!(arrays::weighted_average, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::axpy_, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::delta, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::to_half, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::from_half, m)?)?;
    m.add_function(wrap_pyfunction!(arrays::topk, m)?)?;
    m.add_function(wrap_pyfunction!(ops::permutation, m)?)?;
    m.add_function(wrap_pyfunction!(ops::partitions, m)?)?;
    m.add_function(wrap_pyfunction!(ops::partition_for, m)?)?;
    m.add_function(wrap_pyfunction!(ops::split_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gather, m)?)?;
    m.add_function(wrap_pyfunction!(pipeline::decode_images, m)?)?;
    m.add_function(wrap_pyfunction!(worker::serve_worker, m)?)?;
    m.add_function(wrap_pyfunction!(logging::init_logging, m)?)?;
    m.add_function(wrap_pyfunction!(logging::log_record, m)?)?;
    m.add_function(wrap_pyfunction!(buffers::release_shared_memory, m)?)?;
    m.add_function(wrap_pyfunction!(buffers::shared_memory_usage, m)?)?;
    m.add_function(wrap_pyfunction!(tune_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(return_free_memory, m)?)?;
    // Operation and error codes straight from the generated protocol, so Python never re-declares them.
    let ops = PyDict::new(m.py());
    for code in 0..64 {
        if let Ok(op) = ddlf_proto::Op::try_from(code) {
            ops.set_item(op.as_str_name().trim_start_matches("OP_"), code)?;
        }
    }
    m.add("OPS", ops)?;
    let kinds = PyDict::new(m.py());
    for code in 0..64 {
        if let Ok(kind) = ddlf_proto::ErrorKind::try_from(code) {
            kinds.set_item(kind.as_str_name().trim_start_matches("ERROR_KIND_"), code)?;
        }
    }
    m.add("ERROR_KINDS", kinds)?;
    Ok(())
}
