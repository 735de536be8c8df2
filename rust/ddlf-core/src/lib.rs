//! ddlf's pure-Rust core: everything that needs neither Python nor a network, so that it is testable with
//! `cargo test` alone.
//!
//! * [`advice`]: paging advice for mapped datasets read at random (no read-around, the next batches read ahead).
//! * [`arrays`]: weight lists as typed arrays: the checks and dtype dispatch of the array kernels.
//! * [`auth`]: shared-token checks in constant time.
//! * [`frame`]: values split into chunks for streaming and assembled back, with limits checked first.
//! * [`shuffle`]: seeded permutations and per-worker index partitions.
//! * [`gather`]: rows of a dataset into a contiguous batch.
//! * [`shm`]: shared-memory files for large buffers between processes on one machine.
//! * [`shm_pool`]: shared-memory segments reused from transfer to transfer, released by their readers.
//! * [`kernels`]: weighted averages, in-place updates, deltas and half-precision conversion of weight lists.
//! * [`prefetch`]: batches of rows gathered ahead by a background thread (a small partition in memory: when asked).
//! * [`images`]: encoded JPEG/PNG images decoded, resized and flipped into fixed-size rows (image datasets).
//! * [`parallel`]: the merge kernels split across threads for large arrays.
//! * [`memory`]: the allocator policy that keeps large transfer buffers' pages mapped between transfers.

#![deny(missing_docs)]

pub mod advice;
pub mod arrays;
pub mod auth;
pub mod frame;
pub mod gather;
pub mod images;
pub mod kernels;
pub mod memory;
pub mod parallel;
pub mod prefetch;
pub mod shm;
pub mod shm_pool;
pub mod shuffle;
