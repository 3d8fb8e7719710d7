//! A watch cache's setup, the same for the ConfigMaps, the nodes and the `MemoryProfile`s: a
//! reflector store kept by a watch, and the task that drives the watches and logs their errors.

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};

/// A cache's watch: each event applied to its store, `Err` where the watch failed (it retries
/// with the default backoff).
pub(crate) type Watch = BoxStream<'static, Result<(), watcher::Error>>;

/// A store of every `K` that `api` lists, kept by a watch of it, each object trimmed by `trim`
/// as it arrives (what admission does not read is never kept).
pub(crate) fn reflected<K>(
    api: kube::Api<K>,
    trim: impl FnMut(&mut K) + Send + 'static,
) -> (Store<K>, Watch)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let (reader, writer) = reflector::store::<K>();
    let watch = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default()).modify(trim),
    )
    .default_backoff()
    .touched_objects()
    .map(|r| r.map(|_| ()))
    .boxed();
    (reader, watch)
}

/// The task that drives `watches` for as long as they run, logging each error with what it
/// leaves unread (`unread`): a failing watch (no RBAC) keeps retrying, never fails admission.
pub(crate) fn drive(watches: Vec<Watch>, unread: &'static str) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut all = futures::stream::select_all(watches);
        while let Some(item) = all.next().await {
            if let Err(error) = item {
                tracing::warn!(%error, "{unread}");
            }
        }
    })
}
