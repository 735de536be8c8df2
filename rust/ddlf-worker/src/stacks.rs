//! Every Python thread's stack, taken without the interpreter's lock, for the `Stacks` RPC (`ddlf stacks`).
//!
//! The interpreter side registers Python's `faulthandler` on a signal, writing to a file opened for appending, and
//! tells the daemon the signal and the file ([`StackDumper`]). The daemon opens the file once, when it is installed,
//! so that the interpreter side can remove its name at once: a daemon that is killed leaves no file behind. To take
//! the stacks, a network thread empties the file and raises the signal on itself: the signal is delivered to the
//! raising thread before `pthread_kill` returns, and faulthandler's handler walks every thread's frames without the GIL (it is written for crashed and
//! deadlocked interpreters), so a worker whose interpreter is stuck in a long computation, or deadlocked, still
//! answers. One dump at a time: a lock serialises them.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Mutex;

/// Why the stacks could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("this daemon has no stack dumper (it was not started by ddlf-worker)")]
    NotInstalled,
    #[error("signal {0} has no handler installed: the stacks would not be written (and the signal could kill the daemon)")]
    NoHandler(i32),
    #[error("signal {0} is not a signal number")]
    BadSignal(i32),
    #[error("the stack file {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The signal faulthandler listens on and the file it appends to.
#[derive(Debug, Clone)]
pub struct StackDumper {
    pub signal: i32,
    pub path: PathBuf,
}

/// Where the dumper lives: set once by the interpreter side, used by any network thread.
#[derive(Debug, Default)]
pub struct Stacks {
    dumper: Mutex<Option<(StackDumper, File)>>,
}

impl Stacks {
    /// Install (or replace) the dumper: the signal must already have faulthandler's handler; the file is opened
    /// here and kept open, so its name may be removed once this returns.
    pub fn install(&self, dumper: StackDumper) -> Result<(), StackError> {
        check_handler(dumper.signal)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&dumper.path)
            .map_err(|source| StackError::File {
                path: dumper.path.clone(),
                source,
            })?;
        *self.dumper.lock().unwrap_or_else(|e| e.into_inner()) = Some((dumper, file));
        Ok(())
    }

    /// Every Python thread's stack, most recent call first (faulthandler's text).
    pub fn dump(&self) -> Result<String, StackError> {
        let mut guard = self.dumper.lock().unwrap_or_else(|e| e.into_inner());
        let (dumper, file) = guard.as_mut().ok_or(StackError::NotInstalled)?;
        let file_error = |source| StackError::File {
            path: dumper.path.clone(),
            source,
        };
        // faulthandler's descriptor appends, so after emptying the file its text starts at offset 0.
        file.set_len(0).map_err(file_error)?;
        file.seek(SeekFrom::Start(0)).map_err(file_error)?;
        check_handler(dumper.signal)?;
        // SAFETY: `pthread_self()` is this live thread, and `check_handler` just confirmed the signal is a valid
        // number with a handler installed (not the default action, which could end the process, nor ignored).
        // A signal sent to the calling thread is handled before `pthread_kill` returns, so the text is complete
        // once it returns; the lock above keeps a second dump from emptying the file meanwhile.
        let rc = unsafe { libc::pthread_kill(libc::pthread_self(), dumper.signal) };
        if rc != 0 {
            return Err(StackError::BadSignal(dumper.signal));
        }
        let mut text = String::new();
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(file_error)?;
        text.push_str(&String::from_utf8_lossy(&bytes));
        Ok(text)
    }
}

/// Whether `signal` is a signal number with a handler (not the default action, not ignored).
fn check_handler(signal: i32) -> Result<(), StackError> {
    if !(1..=libc::SIGRTMAX()).contains(&signal) {
        return Err(StackError::BadSignal(signal));
    }
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: `signal` is in the range of signal numbers (checked above); a null new action only reads the
    // current one into `old`, which is zeroed memory of the right type and size.
    let rc = unsafe { libc::sigaction(signal, std::ptr::null(), old.as_mut_ptr()) };
    if rc != 0 {
        return Err(StackError::BadSignal(signal));
    }
    // SAFETY: sigaction returned 0, so it wrote the whole struct.
    let handler = unsafe { old.assume_init() }.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        return Err(StackError::NoHandler(signal));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_without_a_handler_is_refused_before_it_is_raised() {
        let stacks = Stacks::default();
        assert!(matches!(stacks.dump(), Err(StackError::NotInstalled)));
        let sig = libc::SIGRTMIN() + 9; // nothing in this test process handles it
        let err = stacks
            .install(StackDumper {
                signal: sig,
                path: std::env::temp_dir().join("ddlf-no-such-dump"),
            })
            .unwrap_err();
        assert!(matches!(err, StackError::NoHandler(s) if s == sig), "{err}");
        assert!(matches!(check_handler(0), Err(StackError::BadSignal(0))));
        assert!(matches!(
            check_handler(10_000),
            Err(StackError::BadSignal(10_000))
        ));
    }

    /// The descriptor the test's handler appends to (as faulthandler's does).
    static MARKER_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

    extern "C" fn write_marker(_: libc::c_int) {
        let fd = MARKER_FD.load(std::sync::atomic::Ordering::SeqCst);
        if fd < 0 {
            return;
        }
        // SAFETY: `fd` is the test's open descriptor (checked set above); `write` is async-signal-safe; the buffer
        // is static and its length is given.
        unsafe {
            libc::write(
                fd,
                b"Thread 0x1 (most recent call first):\n".as_ptr().cast(),
                37,
            );
        }
    }

    #[test]
    fn the_handler_runs_before_the_dump_reads_the_file() {
        let sig = libc::SIGRTMIN() + 8;
        let path =
            std::env::temp_dir().join(format!("ddlf-stacks-unit-test-{}", std::process::id()));
        std::fs::write(&path, b"an earlier dump\n").unwrap();
        let appending = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        MARKER_FD.store(
            std::os::fd::AsRawFd::as_raw_fd(&appending),
            std::sync::atomic::Ordering::SeqCst,
        );
        let mut action = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
        // SAFETY: zeroed sigaction with a valid handler address; installing a handler for a real-time signal
        // that nothing else in the test binary uses.
        unsafe {
            let a = action.as_mut_ptr();
            (*a).sa_sigaction = write_marker as extern "C" fn(libc::c_int) as usize;
            assert_eq!(libc::sigaction(sig, a, std::ptr::null_mut()), 0);
        }
        let stacks = Stacks::default();
        stacks
            .install(StackDumper {
                signal: sig,
                path: path.clone(),
            })
            .unwrap();
        // The name may go once installed (a killed daemon leaves no file); a second dump reads only its own text.
        std::fs::remove_file(&path).unwrap();
        let text = stacks.dump().unwrap();
        assert_eq!(text, "Thread 0x1 (most recent call first):\n");
        let text = stacks.dump().unwrap();
        assert_eq!(text, "Thread 0x1 (most recent call first):\n");
        drop(appending);
    }
}
