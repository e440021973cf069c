//! The halves of a Unix-domain stream socket, registered for the events each one needs.
//!
//! tokio's `UnixStream` registers its socket for reading and writing at once. A Unix socket
//! reports write space every time its peer reads (Linux runs `unix_write_space` whenever a
//! sent buffer is freed, unlike TCP, which does so only after a write found no room), and with
//! write interest registered that wakes the writer's runtime. In a ping-pong on one CPU that
//! is a context switch to a thread that finds nothing to do, and an `epoll_wait` more, on each
//! side of every round trip: 4 `epoll_wait`s per round trip instead of 2, which leaves RPC
//! well behind the blocking-socket ping-pong (docs/notes/2026-12-02-bench-uds-write-interest.md).
//!
//! So the read half registers the socket for reading only, and the write half writes without
//! any registration until a write finds the socket full (fails with EAGAIN, or takes only part
//! of its bytes: the next write then waits for space instead of failing first, one system
//! call fewer per full socket, as tokio does for its own sockets). Only then does it register a
//! duplicate descriptor for write space, which it keeps while writes keep meeting a full
//! socket (a bulk stream) and drops after [`CLEAN_WRITES_TO_DEREGISTER`] writes in a row that
//! went through at once.

use std::io::{self, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// Writes in a row that went through without waiting after which the write half drops its
/// registration for write space.
pub const CLEAN_WRITES_TO_DEREGISTER: u32 = 32;

/// Splits a tokio `UnixStream` into halves registered for what each needs (module docs).
///
/// Needs no runtime context: each half registers with the runtime that first polls it. If the
/// socket cannot be taken from tokio (its runtime is gone), the halves fail every read and
/// write with that error.
pub(crate) fn split(stream: tokio::net::UnixStream) -> (UnixReadHalf, UnixWriteHalf) {
    // tokio's `into_std` deregisters the socket (through its own runtime's handle) and leaves
    // it non-blocking.
    let socket = stream
        .into_std()
        .map(Arc::new)
        .map_err(|e| Failed(e.kind(), e.to_string()));
    (
        UnixReadHalf {
            socket: socket.clone(),
            io: None,
        },
        UnixWriteHalf {
            shut: socket.is_err(),
            socket,
            writable: None,
            clean_writes: 0,
        },
    )
}

/// Registers `socket` with the runtime of the calling context for `interest`; an error (not
/// a panic) outside a runtime.
fn register<T: AsRawFd>(socket: T, interest: Interest) -> io::Result<AsyncFd<T>> {
    tokio::runtime::Handle::try_current()
        .map_err(|e| io::Error::other(format!("unix socket not registered: {e}")))?;
    // SAFETY: `socket` owns its descriptor (an `Arc<UnixStream>` or a `UnixStream`) and the
    // `AsyncFd` owns `socket`, so the descriptor stays open and names the same socket for as
    // long as it is registered; `as_raw_fd` of either type always returns that descriptor.
    unsafe { AsyncFd::register_with_interest(socket, interest) }.map_err(|e| e.into_parts().1)
}

/// Why a socket could not be taken from tokio: every use of its halves reports it.
#[derive(Debug, Clone)]
struct Failed(io::ErrorKind, String);

impl Failed {
    fn error(&self) -> io::Error {
        io::Error::new(self.0, format!("unix socket not registered: {}", self.1))
    }
}

/// The reading half of a Unix stream socket, registered for readability only (with the
/// runtime that first polls it).
#[derive(Debug)]
pub struct UnixReadHalf {
    socket: Result<Arc<StdUnixStream>, Failed>,
    io: Option<AsyncFd<Arc<StdUnixStream>>>,
}

impl UnixReadHalf {
    fn registered(&mut self) -> io::Result<&AsyncFd<Arc<StdUnixStream>>> {
        if self.io.is_none() {
            let socket = self.socket.as_ref().map_err(Failed::error)?;
            self.io = Some(register(socket.clone(), Interest::READABLE)?);
        }
        Ok(self.io.as_ref().expect("registered above"))
    }
}

impl AsyncRead for UnixReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let io = match self.get_mut().registered() {
            Ok(io) => io,
            Err(e) => return Poll::Ready(Err(e)),
        };
        loop {
            let mut guard = ready!(io.poll_read_ready(cx))?;
            let unfilled = buf.remaining();
            let fd = io.as_raw_fd();
            // SAFETY: `recv_uninit` only writes into the unfilled part (never de-initialises
            // it); exactly the `n` bytes it reports are then marked filled.
            let n = match crate::sock::recv_uninit(fd, unsafe { buf.unfilled_mut() }, 0) {
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    guard.clear_ready();
                    continue;
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Poll::Ready(Err(err)),
            };
            // SAFETY: `recv` initialised the first `n` bytes of the unfilled part.
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            // A stream socket that filled less than asked has nothing more queued: wait for
            // the next event instead of spending a `recv` on EAGAIN (tokio does the same).
            if n > 0 && n < unfilled {
                guard.clear_ready();
            }
            return Poll::Ready(Ok(()));
        }
    }
}

/// The writing half of a Unix stream socket: registered for write space only while writes
/// find the socket full. Dropping it shuts the socket down for writing, as tokio's
/// `OwnedWriteHalf` does.
#[derive(Debug)]
pub struct UnixWriteHalf {
    socket: Result<Arc<StdUnixStream>, Failed>,
    /// A duplicate of the socket registered for write space, while writes need it.
    writable: Option<AsyncFd<StdUnixStream>>,
    /// Writes in a row that went through at once since `writable` was last needed.
    clean_writes: u32,
    /// Shut down for writing already.
    shut: bool,
}

impl UnixWriteHalf {
    /// Whether the half is registered for write space now (tests and diagnostics).
    pub fn waits_for_write_space(&self) -> bool {
        self.writable.is_some()
    }

    /// Writes with `write`, which was asked to write `wanted` bytes.
    ///
    /// A write that takes fewer bytes than it was given has filled the socket (a Unix stream
    /// socket takes all it has room for), so the half then waits for write space before it
    /// writes again instead of spending a write on EAGAIN first: the readiness is cleared
    /// (registered) or the registration made (not yet registered).
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        wanted: usize,
        mut write: impl FnMut(&StdUnixStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        let socket = match &self.socket {
            Ok(socket) => socket,
            Err(failed) => return Poll::Ready(Err(failed.error())),
        };
        loop {
            if let Some(registration) = &self.writable {
                // Registered: write only when the runtime says there is room (no EAGAIN
                // write per wake-up while a bulk stream keeps the socket full).
                let mut guard = ready!(registration.poll_write_ready(cx))?;
                match write(socket) {
                    Ok(n) if n < wanted => {
                        guard.clear_ready();
                        self.clean_writes = 0;
                        return Poll::Ready(Ok(n));
                    }
                    Ok(n) => {
                        drop(guard);
                        self.clean_writes += 1;
                        if self.clean_writes >= CLEAN_WRITES_TO_DEREGISTER {
                            self.writable = None;
                        }
                        return Poll::Ready(Ok(n));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        guard.clear_ready();
                        self.clean_writes = 0;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Poll::Ready(Err(e)),
                }
                continue;
            }
            match write(socket) {
                Ok(n) if n < wanted && n > 0 => {
                    // Full now: registering reports the current state, so space freed since
                    // the write is not missed.
                    let dup = socket.try_clone()?;
                    self.writable = Some(register(dup, Interest::WRITABLE)?);
                    self.clean_writes = 0;
                    return Poll::Ready(Ok(n));
                }
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Registering reports the current state, so space freed since the failed
                    // write is not missed.
                    let dup = socket.try_clone()?;
                    self.writable = Some(register(dup, Interest::WRITABLE)?);
                    self.clean_writes = 0;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn shutdown_write(&mut self) -> io::Result<()> {
        match &self.socket {
            Ok(socket) if !self.shut => {
                self.shut = true;
                socket.shutdown(std::net::Shutdown::Write)
            }
            Ok(_) => Ok(()),
            Err(failed) => Err(failed.error()),
        }
    }
}

impl AsyncWrite for UnixWriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, buf.len(), |mut s: &StdUnixStream| s.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let wanted = bufs.iter().map(|b| b.len()).sum();
        self.get_mut()
            .poll_write_with(cx, wanted, |mut s: &StdUnixStream| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().shutdown_write())
    }
}

impl Drop for UnixWriteHalf {
    fn drop(&mut self) {
        // The peer may already be gone: nothing to report then.
        let _ = self.shutdown_write();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A reader that waits does not get woken by its peer reading what it wrote: a ping-pong
    /// over the halves never registers the writer for write space.
    #[tokio::test]
    async fn a_ping_pong_never_registers_for_write_space() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (mut ar, mut aw) = split(a);
        let (mut br, mut bw) = split(b);
        for i in 0..100u8 {
            aw.write_all(&[i]).await.unwrap();
            let mut got = [0u8; 1];
            br.read_exact(&mut got).await.unwrap();
            assert_eq!(got[0], i);
            bw.write_all(&got).await.unwrap();
            ar.read_exact(&mut got).await.unwrap();
            assert_eq!(got[0], i);
        }
        assert!(!aw.waits_for_write_space());
        assert!(!bw.waits_for_write_space());
    }

    /// A writer that fills the socket registers for write space, is woken when the reader
    /// drains it, loses no byte, and drops the registration once writes go through again.
    #[tokio::test]
    async fn a_full_socket_waits_for_space_then_deregisters() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (_ar, mut aw) = split(a);
        let (mut br, _bw) = split(b);
        let total = 8 << 20;
        let writer = tokio::spawn(async move {
            let chunk: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
            let mut sent = 0;
            let mut waited = false;
            while sent < total {
                aw.write_all(&chunk).await.unwrap();
                sent += chunk.len();
                waited |= aw.waits_for_write_space();
            }
            (aw, waited)
        });
        let mut got = vec![0u8; total];
        br.read_exact(&mut got).await.unwrap();
        for (i, b) in got.iter().enumerate() {
            assert_eq!(*b, ((i % (64 << 10)) % 251) as u8, "byte {i}");
        }
        let (mut aw, waited) = writer.await.unwrap();
        assert!(waited, "8 MiB into a socket nobody reads must fill it");
        // Small writes that go through at once drop the registration.
        for _ in 0..CLEAN_WRITES_TO_DEREGISTER {
            aw.write_all(b"x").await.unwrap();
        }
        assert!(!aw.waits_for_write_space());
        let mut small = vec![0u8; CLEAN_WRITES_TO_DEREGISTER as usize];
        br.read_exact(&mut small).await.unwrap();
        assert!(small.iter().all(|&b| b == b'x'));
    }

    /// A write that only part of the buffer fits into leaves the half waiting for write
    /// space: the next write does not try the full socket first (no EAGAIN write), and once
    /// the reader drains the socket every byte arrives.
    #[tokio::test]
    async fn a_short_write_waits_for_space_without_a_failed_write() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (_ar, mut aw) = split(a);
        let (mut br, _bw) = split(b);
        let big: Vec<u8> = (0..8 << 20).map(|i| (i % 253) as u8).collect();
        let n = aw.write(&big).await.unwrap();
        assert!(
            n > 0 && n < big.len(),
            "8 MiB does not fit a socket buffer: wrote {n}"
        );
        assert!(
            aw.waits_for_write_space(),
            "a short write registers for write space"
        );
        // Nobody read: the registered half is not ready, so the write waits (it would have
        // returned at once had it tried the socket).
        let pending = futures_util::FutureExt::now_or_never(aw.write(&big[n..]));
        assert!(
            pending.is_none(),
            "a write after a short one waits for space"
        );
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; 8 << 20];
            br.read_exact(&mut got).await.unwrap();
            got
        });
        aw.write_all(&big[n..]).await.unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), reader)
            .await
            .expect("the reader gets every byte")
            .unwrap();
        assert!(got == big, "bytes arrive in order and whole");
    }

    /// Dropping the write half ends the peer's stream, as tokio's halves do.
    #[tokio::test]
    async fn dropping_the_write_half_ends_the_peers_stream() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (_ar, aw) = split(a);
        let (mut br, _bw) = split(b);
        drop(aw);
        let mut rest = Vec::new();
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), br.read_to_end(&mut rest))
            .await
            .expect("EOF arrives")
            .unwrap();
        assert_eq!(n, 0);
    }

    /// Split outside any runtime (as tokio's halves allow): the halves register with the
    /// runtime that polls them; polled outside one, they fail with an error, not a panic.
    #[test]
    fn halves_split_outside_a_runtime_register_when_first_polled() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (a, b) = rt.block_on(async { tokio::net::UnixStream::pair().unwrap() });
        let (mut ar, mut aw) = split(a);
        let (mut br, mut bw) = split(b);
        // A write that finds room needs no registration: it goes through anywhere.
        let wrote = futures_util::FutureExt::now_or_never(aw.write_all(b"x")).expect("ready");
        assert!(wrote.is_ok(), "{wrote:?}");
        let mut one = [0u8; 1];
        let e = futures_util::FutureExt::now_or_never(ar.read(&mut one))
            .expect("ready")
            .unwrap_err();
        assert!(e.to_string().contains("not registered"), "{e}");
        rt.block_on(async {
            br.read_exact(&mut one).await.unwrap();
            assert_eq!(&one, b"x");
            bw.write_all(b"y").await.unwrap();
            ar.read_exact(&mut one).await.unwrap();
            assert_eq!(&one, b"y");
        });
    }
}
