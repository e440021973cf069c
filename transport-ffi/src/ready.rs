//! Readiness for the caller's event loop: items made in the background (received messages,
//! accepted connections) wait in a bounded queue, each counted in an eventfd in semaphore
//! mode, so the descriptor is readable exactly while an item waits.
//!
//! The producer queues an item and then adds its token; the consumer takes a token and then
//! its item, so a token always has its item behind it. A final item (the end of a
//! connection, its error) stays: taking it puts its token back, and the descriptor stays
//! readable, as a closed socket does.

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Items queued before the producer waits for the caller to take some.
pub(crate) const QUEUED: usize = 64;

/// One item, or the last one.
pub(crate) enum Item<T> {
    /// An item among others.
    More(T),
    /// The last item; it stays for every later take.
    Last(T),
}

/// The consumer's side.
pub(crate) struct Feed<T> {
    fd: Arc<EventFd>,
    rx: Mutex<mpsc::Receiver<Item<T>>>,
    last: Mutex<Option<T>>,
}

/// The producer's side (moved into the background task).
pub(crate) struct Feeder<T> {
    fd: Arc<EventFd>,
    tx: mpsc::Sender<Item<T>>,
}

/// A new feed and its feeder.
pub(crate) fn feed<T>() -> std::io::Result<(Feeder<T>, Feed<T>)> {
    let flags = EfdFlags::EFD_SEMAPHORE | EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC;
    let fd = Arc::new(EventFd::from_flags(flags)?);
    let (tx, rx) = mpsc::channel(QUEUED);
    let feeder = Feeder { fd: fd.clone(), tx };
    let feed = Feed {
        fd,
        rx: Mutex::new(rx),
        last: Mutex::new(None),
    };
    Ok((feeder, feed))
}

impl<T> Feeder<T> {
    /// Queues `item`; whether to go on producing (the feed is there and `item` was not the
    /// last).
    pub(crate) async fn offer(&self, item: Item<T>) -> bool {
        let last = matches!(item, Item::Last(_));
        self.put(item).await && !last
    }

    /// Queues `item` (waiting while the queue is full); `false` when the feed is gone.
    pub(crate) async fn put(&self, item: Item<T>) -> bool {
        if self.tx.send(item).await.is_err() {
            return false;
        }
        // Cannot fail short of 2^64 - 2 tokens: the queue holds at most QUEUED items.
        let _ = self.fd.write(1);
        true
    }
}

impl<T: Clone> Feed<T> {
    /// The descriptor to poll for reading.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The next item if one waits (`None`: none does).
    pub(crate) fn try_take(&self) -> Option<T> {
        match self.fd.read() {
            Ok(_) => {}
            Err(Errno::EAGAIN) => return None,
            Err(_) => return None,
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(item) = last.as_ref() {
            let _ = self.fd.write(1);
            return Some(item.clone());
        }
        let taken = self
            .rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .try_recv()
            .ok()?;
        match taken {
            Item::More(item) => Some(item),
            Item::Last(item) => {
                *last = Some(item.clone());
                let _ = self.fd.write(1);
                Some(item)
            }
        }
    }

    /// The next item, waiting up to `timeout` (`None`: no limit); `None` when the time passed.
    pub(crate) fn take(&self, timeout: Option<Duration>) -> std::io::Result<Option<T>> {
        let until = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(item) = self.try_take() {
                return Ok(Some(item));
            }
            let wait = match until {
                None => PollTimeout::NONE,
                Some(u) => {
                    let left = u.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    // Whole milliseconds, at least one: a shorter wait would spin.
                    let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
                    PollTimeout::try_from(ms).unwrap_or(PollTimeout::NONE)
                }
            };
            let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
            match nix::poll::poll(&mut fds, wait) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(f: &Feed<u32>) -> bool {
        let mut fds = [PollFd::new(f.fd.as_fd(), PollFlags::POLLIN)];
        nix::poll::poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
    }

    #[test]
    fn the_descriptor_is_readable_while_an_item_waits_and_the_last_stays() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (feeder, feed) = feed::<u32>().unwrap();
        assert!(!readable(&feed));
        assert_eq!(feed.try_take(), None);
        rt.block_on(async {
            assert!(feeder.put(Item::More(1)).await);
            assert!(feeder.put(Item::More(2)).await);
        });
        assert!(readable(&feed));
        assert_eq!(feed.try_take(), Some(1));
        assert!(readable(&feed), "one more waits");
        assert_eq!(feed.try_take(), Some(2));
        assert!(!readable(&feed));
        assert_eq!(feed.take(Some(Duration::from_millis(20))).unwrap(), None);
        rt.block_on(feeder.put(Item::Last(9)));
        for _ in 0..3 {
            assert!(readable(&feed), "the end stays readable");
            assert_eq!(feed.try_take(), Some(9));
        }
        assert_eq!(feed.take(None).unwrap(), Some(9));
    }
}
