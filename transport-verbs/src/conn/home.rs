//! Wake-ups from other threads reach a connection's tasks through their own runtime thread,
//! one batch at a time, in the order they came.
//!
//! The device's pump thread (`cq_pump.rs`) moves sleeping connections on at their CQs'
//! events and wakes their tasks: the receiving half when a message is delivered, the driver
//! when it must act. A task woken from another thread goes into its runtime's injection
//! queue, and tokio's current-thread scheduler serves that queue once every 31 polls of its
//! local queue. With a thousand connections, the local queue is never empty (the callers, the
//! thread's poller, the receivers spinning on their own tasks), so the connections the pump
//! wakes wait there behind all of it, served one per 31 local polls: some get a call through
//! every few milliseconds, others wait for a second (docs/notes/2026-12-06-wakes-through-home.md).
//!
//! So the tasks of a connection on a current-thread runtime are polled with a waker that knows
//! their home, the runtime's inbox (one per runtime; a thread may drive several in turn):
//! woken on the thread that last used that inbox, it wakes the task as usual (a local
//! wake-up); woken from another, it queues the task in the inbox, and only the inbox's own
//! task is woken across threads. That task, once the runtime reaches it, wakes every queued
//! task locally: they join the local queue in arrival order, behind nothing they did not
//! arrive after. A multi-thread runtime spreads remote wake-ups over its workers itself;
//! there the tasks keep their own waker.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio::runtime::{Handle, Id, RuntimeFlavor};

/// The inbox of one current-thread runtime: the tasks woken from other threads since its task
/// last ran.
struct Inbox {
    queue: Mutex<Vec<Arc<Forward>>>,
    /// The inbox's task, woken when the queue stops being empty.
    task: AtomicWaker,
}

thread_local! {
    /// The inboxes of the runtimes made on this thread, while they live (a thread may hold
    /// several runtimes and drive them in turn: each has its own inbox, served by its own task).
    static INBOXES: RefCell<Vec<(Id, Weak<Inbox>)>> = const { RefCell::new(Vec::new()) };
    /// The address of the inbox last used on this thread (0 for none): a waker woken here
    /// with that inbox wakes its task directly.
    static HERE: Cell<usize> = const { Cell::new(0) };
}

/// The waker a homed task is polled with.
struct Forward {
    /// The task's own waker, registered at each poll.
    task: AtomicWaker,
    /// In its inbox's queue now (queued once however often it is woken meanwhile).
    queued: AtomicBool,
    inbox: Weak<Inbox>,
}

impl Wake for Forward {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let Some(inbox) = self.inbox.upgrade() else {
            // The home runtime is gone; so is the task, unless it moved: wake it directly.
            self.task.wake();
            return;
        };
        if HERE.with(Cell::get) == Arc::as_ptr(&inbox) as usize {
            self.task.wake();
            return;
        }
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let first = {
            let mut q = inbox.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.push(self.clone());
            q.len() == 1
        };
        if first {
            inbox.task.wake();
        }
    }
}

/// Wakes, on the inbox's thread, every task queued there; runs as long as its runtime.
async fn serve(inbox: Arc<Inbox>) {
    let mut batch = Vec::new();
    std::future::poll_fn(|cx| {
        inbox.task.register(cx.waker());
        std::mem::swap(
            &mut batch,
            &mut *inbox.queue.lock().unwrap_or_else(|p| p.into_inner()),
        );
        for f in batch.drain(..) {
            // Cleared first: a wake-up from now on queues the task again.
            f.queued.store(false, Ordering::Release);
            f.task.wake();
        }
        Poll::<()>::Pending
    })
    .await
}

/// The home of one task: the waker to poll it with, made on its runtime's thread.
#[derive(Clone)]
pub(super) struct Home {
    forward: Arc<Forward>,
    waker: Waker,
    runtime: Id,
}

impl Home {
    /// A home on this thread for one task, when the current runtime is a current-thread one
    /// (`None` otherwise, and outside a runtime: the task keeps its own waker).
    pub(super) fn here() -> Option<Home> {
        let handle = Handle::try_current().ok()?;
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return None;
        }
        let runtime = handle.id();
        let inbox = INBOXES.with(|list| {
            let mut list = list.borrow_mut();
            list.retain(|(_, i)| i.strong_count() > 0);
            if let Some(inbox) = list
                .iter()
                .find(|(id, _)| *id == runtime)
                .and_then(|(_, i)| i.upgrade())
            {
                return inbox;
            }
            let inbox = Arc::new(Inbox {
                queue: Mutex::new(Vec::new()),
                task: AtomicWaker::new(),
            });
            // Lives as long as the runtime: when the runtime drops it, the inbox goes with
            // it, and the wakers made for it wake their tasks directly.
            handle.spawn(serve(inbox.clone()));
            list.push((runtime, Arc::downgrade(&inbox)));
            inbox
        });
        HERE.with(|h| h.set(Arc::as_ptr(&inbox) as usize));
        let forward = Arc::new(Forward {
            task: AtomicWaker::new(),
            queued: AtomicBool::new(false),
            inbox: Arc::downgrade(&inbox),
        });
        Some(Home {
            waker: Waker::from(forward.clone()),
            forward,
            runtime,
        })
    }

    /// Whether this home belongs to the runtime running now, and its inbox lives.
    pub(super) fn is_here(&self) -> bool {
        self.forward.inbox.strong_count() > 0
            && Handle::try_current().is_ok_and(|h| h.id() == self.runtime)
    }
}

/// Runs `fut`, polled with `home`'s waker if it has one.
pub(super) async fn homed<F: Future>(home: Option<Home>, fut: F) -> F::Output {
    let Some(home) = home else {
        return fut.await;
    };
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| {
        home.forward.task.register(cx.waker());
        fut.as_mut().poll(&mut Context::from_waker(&home.waker))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A wake-up from another thread reaches the task through the inbox, and a task woken
    /// there several times is queued once.
    #[test]
    fn remote_wakes_go_through_the_inbox_once() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let home = Home::here().expect("a current-thread runtime homes its tasks");
            assert!(home.is_here());
            let polls = Arc::new(AtomicUsize::new(0));
            let (tx, rx) = tokio::sync::oneshot::channel::<Waker>();
            let mut tx = Some(tx);
            let seen = polls.clone();
            let task = tokio::spawn(homed(
                Some(home.clone()),
                std::future::poll_fn(move |cx| {
                    let n = seen.fetch_add(1, Ordering::SeqCst);
                    if let Some(tx) = tx.take() {
                        tx.send(cx.waker().clone()).expect("send the waker");
                        Poll::Pending
                    } else {
                        Poll::Ready(n)
                    }
                }),
            ));
            let waker = rx.await.expect("the task's waker");
            // This thread is blocked while the other wakes the task: nothing is served yet.
            std::thread::scope(|s| {
                s.spawn(|| {
                    waker.wake_by_ref();
                    waker.wake_by_ref();
                });
            });
            let inbox = home.forward.inbox.upgrade().expect("the inbox lives");
            assert_eq!(inbox.queue.lock().expect("queue").len(), 1);
            let done = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
            assert_eq!(done.expect("woken").expect("ran"), 1);
            assert_eq!(polls.load(Ordering::SeqCst), 2);
            assert!(inbox.queue.lock().expect("queue").is_empty());
        });
    }

    /// Two runtimes made on one thread and driven in turn each serve their own inbox: a task
    /// of the second, woken from another thread, is not queued where only the first (not
    /// running now) would serve it.
    #[test]
    fn each_runtime_of_a_thread_has_its_own_inbox() {
        let first = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let home_first = first.block_on(async { Home::here().expect("homed") });
        second.block_on(async {
            let home = Home::here().expect("homed");
            assert!(home.is_here());
            assert!(
                !home_first.is_here(),
                "the first runtime is not the one running"
            );
            assert_ne!(home.runtime, home_first.runtime);
            let (tx, rx) = tokio::sync::oneshot::channel::<Waker>();
            let mut tx = Some(tx);
            let task = tokio::spawn(homed(
                Some(home),
                std::future::poll_fn(move |cx| match tx.take() {
                    Some(tx) => {
                        tx.send(cx.waker().clone()).expect("send the waker");
                        Poll::Pending
                    }
                    None => Poll::Ready(()),
                }),
            ));
            let waker = rx.await.expect("the task's waker");
            std::thread::scope(|s| {
                s.spawn(|| waker.wake_by_ref());
            });
            let done = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
            done.expect("woken through the running runtime's inbox")
                .expect("ran");
        });
        drop(first);
    }

    /// A multi-thread runtime keeps the tasks' own wakers.
    #[test]
    fn multi_thread_runtimes_are_not_homed() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        rt.block_on(async { assert!(Home::here().is_none()) });
        assert!(Home::here().is_none(), "outside a runtime");
    }

    /// Once the runtime is gone, a waker made for it wakes its task directly.
    #[test]
    fn a_dropped_runtime_leaves_direct_wakes() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let home = rt.block_on(async { Home::here().expect("homed") });
        drop(rt);
        assert!(!home.is_here());
        let woken = Arc::new(AtomicUsize::new(0));
        struct Count(Arc<AtomicUsize>);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        home.forward
            .task
            .register(&Waker::from(Arc::new(Count(woken.clone()))));
        home.waker.wake_by_ref();
        assert_eq!(woken.load(Ordering::SeqCst), 1);
    }
}
