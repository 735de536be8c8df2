//! A lane's frame reader against real sockets.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use ddlf_net::lane::FrameReader;

#[test]
fn a_reset_connection_is_news_to_a_non_blocking_fill() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    let mut reader = FrameReader::default();
    assert!(!reader.try_fill(&a)); // nothing yet
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `b` is an open socket and `linger` a valid struct of the size given; closing with a zero linger
    // sends a reset instead of the end of the stream.
    let rc = unsafe {
        libc::setsockopt(
            b.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    drop(b);
    let mut fd = libc::pollfd {
        fd: a.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let woke = unsafe { libc::poll(&mut fd, 1, 5000) };
    assert_eq!(woke, 1, "the reset never came");
    // The first look says so (it used to say "nothing", and a spin went on to its end).
    assert!(reader.try_fill(&a));
    assert!(!reader.has_buffered()); // no bytes: the read that follows reports the end
    let mut give_up = || -> io::Result<()> { Err(io::ErrorKind::TimedOut.into()) };
    assert!(reader.read_message(&mut &a, &mut give_up).is_err());
}
