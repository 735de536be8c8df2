//! The process's allocator policy for large transfer buffers.
//!
//! Every transfer allocates buffers of megabytes (stream chunks, assembled arrays, reply copies). With glibc's
//! defaults, allocations that large are fresh `mmap`s, and freeing the top of the heap returns it to the kernel:
//! each transfer then page-faults every 4 KiB page of its buffers in again, which measured as the larger part of a
//! 100 MB round trip over loopback (160 ms against 55 ms with the policy below; raw socket 53 ms). Keeping
//! allocations up to 32 MiB in the heap and up to 256 MiB of freed heap for reuse makes later transfers reuse
//! pages that are already mapped. The cost: a process keeps up to that much freed memory instead of returning it,
//! until [`return_free_memory`] hands it back (a worker daemon does when its last run ends, and on a reset).

/// What [`tune_for_transfers`] sets (glibc `mallopt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MallocPolicy {
    /// Allocations below this come from the heap (reused) rather than a fresh `mmap`.
    pub mmap_threshold: i32,
    /// Freed memory at the top of the heap is returned to the kernel only beyond this.
    pub trim_threshold: i32,
    /// Extra bytes requested whenever the heap grows.
    pub top_pad: i32,
}

/// The policy ddlf processes run with unless `DDLF_MALLOC=system`.
pub const TRANSFER_POLICY: MallocPolicy = MallocPolicy {
    mmap_threshold: 32 << 20,
    trim_threshold: 256 << 20,
    top_pad: 64 << 20,
};

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use std::ffi::c_int;

    // From <malloc.h>.
    pub const M_TRIM_THRESHOLD: c_int = -1;
    pub const M_TOP_PAD: c_int = -2;
    pub const M_MMAP_THRESHOLD: c_int = -3;

    extern "C" {
        pub fn mallopt(param: c_int, value: c_int) -> c_int;
        pub fn malloc_trim(pad: usize) -> c_int;
    }
}

/// Hand the allocator's free memory back to the kernel (glibc's `malloc_trim(0)`: the free top of every arena
/// and the free pages inside them): what [`TRANSFER_POLICY`] keeps for the next transfer, returned when a process
/// goes idle. Returns whether any memory was released (false elsewhere than on glibc). Takes each arena's lock in
/// turn: milliseconds for a heap of hundreds of megabytes.
pub fn return_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: compiled for linux-gnu only, where the declaration above is glibc's `int malloc_trim(size_t)`;
        // it is MT-safe (it takes each arena's lock itself) and releases only memory the allocator holds free.
        unsafe { glibc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Apply `policy` to this process's allocator. Returns whether it took effect (only glibc has these knobs;
/// elsewhere the platform allocator's own policy stays).
pub fn tune_for_transfers(policy: MallocPolicy) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is thread-safe (it takes the arena locks).
        unsafe {
            glibc::mallopt(glibc::M_MMAP_THRESHOLD, policy.mmap_threshold) == 1
                && glibc::mallopt(glibc::M_TRIM_THRESHOLD, policy.trim_threshold) == 1
                && glibc::mallopt(glibc::M_TOP_PAD, policy.top_pad) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = policy;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_applies_on_glibc_and_large_buffers_still_work() {
        let applied = tune_for_transfers(TRANSFER_POLICY);
        assert_eq!(applied, cfg!(all(target_os = "linux", target_env = "gnu")));
        for _ in 0..3 {
            let v = vec![7u8; 24 << 20];
            assert!(v.iter().all(|&b| b == 7));
        }
    }

    #[test]
    fn free_memory_goes_back_and_the_heap_still_serves() {
        tune_for_transfers(TRANSFER_POLICY); // heap allocations up to 32 MiB, 256 MiB of free heap kept
        let held: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 1 << 20]).collect();
        drop(held);
        // The 64 MiB just freed are under the policy's trim threshold: kept, until returned here.
        let released = return_free_memory();
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(released);
        }
        let v = vec![3u8; 8 << 20];
        assert!(v.iter().all(|&b| b == 3));
    }
}
