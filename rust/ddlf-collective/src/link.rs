//! One end of a peer link, plaintext or TLS, for the ring's non-blocking, pipelined I/O.
//!
//! A plaintext [`Link`] is its socket. A TLS link drives a `rustls` connection by hand over the same
//! non-blocking socket: [`Link::write`] encrypts into the connection's bounded buffer and pushes what the socket
//! takes, [`Link::read`] decrypts whatever arrived. Encrypted bytes may wait in the connection after a write
//! returned ([`Link::pending`]): the ring flushes them ([`Link::flush`]) and polls for writability while any wait,
//! and a pass ends only once they are out (a neighbour would otherwise wait for bytes that never leave).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

/// Encrypted bytes a TLS link buffers before a write stops taking plaintext (rustls's default).
const TLS_BUFFER: usize = 1 << 20;

/// One end of a peer link (see the module docs).
pub struct Link {
    sock: TcpStream,
    tls: Option<Box<rustls::Connection>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("sock", &self.sock)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl From<TcpStream> for Link {
    fn from(sock: TcpStream) -> Self {
        Link { sock, tls: None }
    }
}

impl Link {
    /// A link whose handshake `tls` completed over `sock` (bytes it already read stay buffered in it).
    pub fn tls(sock: TcpStream, tls: rustls::Connection) -> Self {
        let mut tls = Box::new(tls);
        tls.set_buffer_limit(Some(TLS_BUFFER));
        Link {
            sock,
            tls: Some(tls),
        }
    }

    /// The socket (for options and `poll`).
    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Whether the link is encrypted.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Encrypted bytes that still wait to be written.
    pub fn pending(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.wants_write())
    }

    /// Write waiting encrypted bytes until the socket takes no more. Returns whether any moved.
    pub fn flush(&mut self) -> io::Result<bool> {
        let Some(tls) = self.tls.as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        while tls.wants_write() {
            match tls.write_tls(&mut self.sock) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => moved = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(moved)
    }

    /// Write some of `buf`: how many bytes were taken (`WouldBlock` when none could be).
    pub fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.tls.is_none() {
            return self.sock.write(buf);
        }
        self.flush()?;
        let taken = match self.tls.as_mut() {
            Some(tls) => tls.writer().write(buf)?,
            None => 0,
        };
        self.flush()?;
        if taken == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(taken)
    }

    /// Read some bytes into `buf`: `Ok(0)` at the end of the stream, `WouldBlock` when nothing has arrived.
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(tls) = self.tls.as_mut() else {
            return self.sock.read(buf);
        };
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            match tls.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // Nothing decrypted is waiting: take what the socket has (WouldBlock ends the call).
            match tls.read_tls(&mut self.sock) {
                // The peer closed without a TLS close: the reader says so on the next turn.
                Ok(0) => {
                    tls.process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    return match tls.reader().read(buf) {
                        Ok(n) => Ok(n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                        Err(e) => Err(e),
                    };
                }
                Ok(_) => {
                    tls.process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Set the socket non-blocking (the ring's mode) or blocking.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.sock.set_nonblocking(on)
    }
}

impl AsRawFd for Link {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}
