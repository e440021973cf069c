//! Memory budgets: one byte count shared by many holders, with back-pressure instead of growth.
//!
//! A [`MemoryBudget`] is shared (`Arc`) by everything that holds memory on behalf of peers: the
//! receivers of one transport (frames being read, received large payloads still held, pooled
//! buffers), or the running handlers of one RPC server. A holder takes a [`Charge`] before it
//! allocates; the charge gives the bytes back when it drops. When the budget is spent, a holder
//! waits ([`MemoryBudget::charge`]) or stops reading, so a peer can make us hold at most the
//! budget, never what it merely announces.
//!
//! ```
//! use transport_core::budget::MemoryBudget;
//!
//! let budget = MemoryBudget::new(1000);
//! let a = budget.try_charge(600).expect("fits");
//! assert!(budget.try_charge(600).is_none(), "would pass the limit");
//! drop(a);
//! assert_eq!(budget.used(), 0);
//! ```

use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// A byte budget shared by many holders. See the [module docs](self).
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
    freed: Notify,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            limit,
            used: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// True while at least the limit is charged.
    pub fn is_spent(&self) -> bool {
        self.used() >= self.limit
    }

    /// Adds `n` bytes if the total stays within the limit, or if `own` (bytes the caller already
    /// holds) is everything charged: a lone holder can always make progress, so one message
    /// larger than the budget cannot wait forever for itself.
    fn add(&self, n: usize, own: usize) -> bool {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(n) else {
                return false;
            };
            if next > self.limit && cur != own {
                return false;
            }
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    fn release(&self, n: usize) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
            self.freed.notify_waiters();
        }
    }

    /// Charges `n` bytes if they fit (or if nothing else is charged).
    pub fn try_charge(self: &Arc<Self>, n: usize) -> Option<Charge> {
        self.add(n, 0).then(|| Charge {
            budget: Some(self.clone()),
            bytes: n,
        })
    }

    /// Charges `n` bytes whether or not they fit: for memory that already exists (bytes that
    /// arrived), so that the budget still counts it and stops further reading.
    pub fn charge_anyway(self: &Arc<Self>, n: usize) -> Charge {
        self.used.fetch_add(n, Ordering::AcqRel);
        Charge {
            budget: Some(self.clone()),
            bytes: n,
        }
    }

    /// Charges `n` bytes, waiting until they fit. Cancel safe (nothing is charged until it
    /// returns).
    pub async fn charge(self: &Arc<Self>, n: usize) -> Charge {
        loop {
            let mut freed = pin!(self.freed.notified());
            freed.as_mut().enable();
            if let Some(c) = self.try_charge(n) {
                return c;
            }
            freed.await;
        }
    }

    /// Returns once some bytes were given back (or at once if the budget is not spent).
    /// Cancel safe.
    pub async fn wait_for_room(&self) {
        let mut freed = pin!(self.freed.notified());
        freed.as_mut().enable();
        if !self.is_spent() {
            return;
        }
        freed.await;
    }
}

/// Bytes charged to a [`MemoryBudget`]; given back on drop.
#[derive(Debug, Default)]
pub struct Charge {
    budget: Option<Arc<MemoryBudget>>,
    bytes: usize,
}

impl Charge {
    /// A charge of nothing, to no budget.
    pub fn none() -> Charge {
        Charge::default()
    }

    /// Bytes held by this charge.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Adds `n` bytes to this charge if they fit (or if this charge is all the budget holds).
    /// A charge of no budget always grows.
    pub fn try_grow(&mut self, n: usize) -> bool {
        let ok = match &self.budget {
            Some(b) => b.add(n, self.bytes),
            None => true,
        };
        if ok {
            self.bytes += n;
        }
        ok
    }

    /// Adds `n` bytes, waiting until they fit. Cancel safe.
    pub async fn grow(&mut self, n: usize) {
        let Some(budget) = self.budget.clone() else {
            self.bytes += n;
            return;
        };
        loop {
            let mut freed = pin!(budget.freed.notified());
            freed.as_mut().enable();
            if self.try_grow(n) {
                return;
            }
            freed.await;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.release(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn charges_stay_within_the_limit_and_are_given_back_on_drop() {
        let b = MemoryBudget::new(100);
        let a = b.try_charge(60).expect("fits");
        assert!(b.try_charge(41).is_none());
        let c = b.try_charge(40).expect("fits exactly");
        assert_eq!(b.used(), 100);
        assert!(b.is_spent());
        drop(a);
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_lone_holder_may_pass_the_limit_but_not_two() {
        let b = MemoryBudget::new(100);
        let mut big = b.try_charge(150).expect("nothing else is charged");
        assert!(big.try_grow(50), "still the only holder");
        assert_eq!(b.used(), 200);
        let _small = b.charge_anyway(1);
        assert!(!big.try_grow(1), "someone else holds bytes now");
        assert!(b.try_charge(1).is_none());
        assert!(!b.add(usize::MAX, 0), "no overflow");
    }

    #[tokio::test]
    async fn a_waiting_charge_gets_the_bytes_given_back() {
        let b = MemoryBudget::new(100);
        let held = b.try_charge(90).expect("fits");
        let b2 = b.clone();
        let waiter = tokio::spawn(async move { b2.charge(50).await.bytes() });
        let mut grower = Charge::none();
        assert!(grower.try_grow(usize::MAX / 2), "no budget: always grows");
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "50 more do not fit yet");
        drop(held);
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken when bytes came back")
            .expect("task");
        assert_eq!(got, 50);
        assert_eq!(b.used(), 0, "the waiter's charge dropped with its task");
    }

    #[tokio::test]
    async fn wait_for_room_returns_once_the_budget_is_not_spent() {
        let b = MemoryBudget::new(10);
        b.wait_for_room().await;
        let full = b.try_charge(10).expect("fits");
        let b2 = b.clone();
        let waiter = tokio::spawn(async move { b2.wait_for_room().await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(full);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .expect("task");
    }
}
