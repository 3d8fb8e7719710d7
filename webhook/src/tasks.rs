//! The background tasks of the webhook's link to the cluster (the watches, the lease holder, the
//! profile controller), and how they stop at shutdown: the lease released first, the rest
//! aborted.

use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long shutdown waits for the lease release (one GET and one PUT).
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(2);

/// The background tasks of the cluster link; empty without a cluster.
#[derive(Debug, Default)]
pub struct KubeTasks {
    /// Tells the lease holder to step down and release the lease.
    pub(crate) stop: Option<oneshot::Sender<()>>,
    pub(crate) lease: Option<JoinHandle<()>>,
    /// The watches and the controller: nothing to hand over, aborted.
    pub(crate) others: Vec<JoinHandle<()>>,
}

impl KubeTasks {
    /// Adds a task with nothing to hand over (a watch): aborted at shutdown.
    pub fn with(mut self, task: JoinHandle<()>) -> Self {
        self.others.push(task);
        self
    }

    /// Stops the lease holder and waits up to `deadline` for it to release the lease, so the
    /// other replica takes over at its next attempt rather than after the lease expires; then
    /// aborts the rest.
    pub async fn shutdown(self, deadline: Duration) {
        if let Some(stop) = self.stop {
            // An error means the holder already returned; awaiting it below is then immediate.
            let _ = stop.send(());
        }
        if let Some(lease) = self.lease {
            let abort = lease.abort_handle();
            match tokio::time::timeout(deadline, lease).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "lease task failed"),
                Err(_) => {
                    tracing::warn!(
                        deadline_ms = deadline.as_millis(),
                        "lease not released in time; it will expire"
                    );
                    abort.abort();
                }
            }
        }
        self.others.iter().for_each(JoinHandle::abort);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that never ends; the receiver errs once it is aborted (its sender dropped).
    fn endless() -> (JoinHandle<()>, oneshot::Receiver<()>) {
        let (alive, gone) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _alive = alive;
            std::future::pending::<()>().await;
        });
        (task, gone)
    }

    async fn aborted(gone: oneshot::Receiver<()>) -> bool {
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .is_ok_and(|r| r.is_err())
    }

    #[tokio::test]
    async fn no_tasks_shut_down_at_once() {
        KubeTasks::default().shutdown(RELEASE_DEADLINE).await;
    }

    #[tokio::test]
    async fn shutdown_stops_the_lease_task_waits_for_it_then_aborts_the_rest() {
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (released_tx, mut released_rx) = oneshot::channel();
        let lease = tokio::spawn(async move {
            let _ = stop_rx.await;
            tokio::task::yield_now().await;
            let _ = released_tx.send(());
        });
        let (other, other_gone) = endless();
        let tasks = KubeTasks {
            stop: Some(stop_tx),
            lease: Some(lease),
            others: vec![other],
        };
        tasks.shutdown(Duration::from_secs(10)).await;
        assert_eq!(released_rx.try_recv(), Ok(()), "waited for the release");
        assert!(aborted(other_gone).await, "the others are aborted");
    }

    #[tokio::test]
    async fn a_stuck_lease_task_is_aborted_at_the_deadline() {
        let (stop_tx, _stop_rx) = oneshot::channel::<()>();
        let (lease, lease_gone) = endless();
        let tasks = KubeTasks {
            stop: Some(stop_tx),
            lease: Some(lease),
            others: Vec::new(),
        };
        tasks.shutdown(Duration::from_millis(50)).await;
        assert!(aborted(lease_gone).await, "aborted");
    }
}
