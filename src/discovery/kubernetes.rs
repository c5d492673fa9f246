//! The `kubernetes` source: ready Pods, watched through the API server, each (pod, port) one worker.
//!
//! The pods are chosen by a label selector, or by an InferencePool (Gateway API Inference Extension,
//! `inference.networking.k8s.io/v1`, or the older `inference.networking.x-k8s.io/v1alpha2` where only
//! that one is served): its selector picks the pods and its target ports are the engines' ports unless
//! the pool's `ports` name them. kube's watcher lists, then watches from the list's resource version,
//! and lists again when the watch expires (410 Gone); each complete answer is published.
//!
//! A pod is a worker while its `Ready` condition is `True`, it is not terminating (no
//! `deletionTimestamp`) and it has an IP: a pod that flaps Ready↔NotReady leaves and rejoins, a pod
//! being deleted leaves before its endpoint goes away. A watch or list error is not an answer: the last
//! set stays, the error is counted, and the watcher retries with client-go's backoff.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::{StreamExt, future};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use serde_json::Value;
use tokio::sync::watch;

use super::{Members, SourceStatus, members, publish};
use crate::config::{KubernetesDiscovery, PodSelection, WorkerTemplate};

/// The longest wait between two tries, as the watcher's own backoff caps it.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The InferencePool API groups, in the order they are tried: the GA group first.
const POOL_VERSIONS: [(&str, &str); 2] = [
    ("inference.networking.k8s.io", "v1"),
    ("inference.networking.x-k8s.io", "v1alpha2"),
];

/// Why the source could not read the cluster, or an InferencePool could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    #[error("no Kubernetes client (neither in-cluster nor KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    #[error("watching pods in `{namespace}`: {source}")]
    Pods {
        namespace: String,
        source: watcher::Error,
    },
    #[error("watching InferencePool `{namespace}/{name}`: {source}")]
    PoolWatch {
        namespace: String,
        name: String,
        source: watcher::Error,
    },
    #[error("finding the InferencePool API for `{namespace}/{name}`: {source}")]
    PoolApi {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("no InferencePool API is served (neither inference.networking.k8s.io/v1 nor v1alpha2)")]
    NoPoolApi,
    #[error("InferencePool `{namespace}/{name}` cannot be used: {reason}")]
    Pool {
        namespace: String,
        name: String,
        reason: &'static str,
    },
}

/// A pool's Kubernetes source: build it with [`KubernetesSource::new`] (or
/// [`KubernetesSource::infer`]), then [`KubernetesSource::run`] it on its own task.
pub struct KubernetesSource {
    client: kube::Client,
    namespace: String,
    pods: PodSelection,
    ports: Vec<u16>,
    template: WorkerTemplate,
    status: Arc<SourceStatus>,
}

/// What an InferencePool says: the pods' selector (`k=v,…`) and their ports.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PoolTarget {
    selector: String,
    ports: Vec<u16>,
}

/// The pods seen, by name, with the IP of each that is a worker now.
#[derive(Default)]
struct PodSet {
    pods: HashMap<String, Option<IpAddr>>,
    /// During a (re)list: the pods listed so far, which replace `pods` when the list is complete.
    listing: Option<HashMap<String, Option<IpAddr>>>,
    /// Whether a complete list was read: until then nothing is published.
    listed: bool,
}

impl KubernetesSource {
    /// A source watching `kubernetes`'s pods through `client`; the namespace is the configured one or
    /// the client's default (the service account's namespace in a cluster).
    pub fn new(
        kubernetes: &KubernetesDiscovery,
        template: &WorkerTemplate,
        status: Arc<SourceStatus>,
        client: kube::Client,
    ) -> Self {
        let namespace = kubernetes
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned());
        KubernetesSource {
            client,
            namespace,
            pods: kubernetes.pods.clone(),
            ports: kubernetes.ports.clone(),
            template: template.clone(),
            status,
        }
    }

    /// [`KubernetesSource::new`] with the client inferred as kubectl does: the in-cluster service
    /// account, else `KUBECONFIG` or `~/.kube/config`.
    pub async fn infer(
        kubernetes: &KubernetesDiscovery,
        template: &WorkerTemplate,
        status: Arc<SourceStatus>,
    ) -> Result<Self, KubernetesError> {
        let client = kube::Client::try_default()
            .await
            .map_err(KubernetesError::Client)?;
        Ok(Self::new(kubernetes, template, status, client))
    }

    /// Lists and watches the pods until `shutdown` completes, publishing on `publish` the workers of
    /// every complete answer (only when they changed). Nothing is published before the first list.
    pub async fn run(
        mut self,
        publish: watch::Sender<Members>,
        shutdown: impl Future<Output = ()>,
    ) {
        let shutdown = pin!(shutdown);
        match self.pods.clone() {
            PodSelection::Selector(selector) => {
                let ports = self.ports.clone();
                let watch = self.watch_selector(&selector, &ports, &publish);
                future::select(shutdown, pin!(watch)).await;
            }
            PodSelection::InferencePool(name) => {
                let watch = self.watch_pool(&name, &publish);
                future::select(shutdown, pin!(watch)).await;
            }
        }
    }

    fn pod_events(&self, selector: &str) -> BoxStream<'static, Result<Event<Pod>, watcher::Error>> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        watcher::watcher(api, watcher::Config::default().labels(selector))
            .default_backoff()
            .boxed()
    }

    async fn watch_selector(
        &mut self,
        selector: &str,
        ports: &[u16],
        sender: &watch::Sender<Members>,
    ) {
        let mut events = self.pod_events(selector);
        let mut pods = PodSet::default();
        while let Some(event) = events.next().await {
            self.pod_event(event, &mut pods, ports, sender);
        }
    }

    fn pod_event(
        &mut self,
        event: Result<Event<Pod>, watcher::Error>,
        pods: &mut PodSet,
        ports: &[u16],
        sender: &watch::Sender<Members>,
    ) {
        match event {
            Ok(event) => {
                if pods.apply(event) {
                    self.answered(pods, ports, sender);
                }
            }
            Err(source) => {
                let error = KubernetesError::Pods {
                    namespace: self.namespace.clone(),
                    source,
                };
                self.failed(&error);
            }
        }
    }

    /// Follows the InferencePool and, through its selector, its pods; a changed selector starts the
    /// pod watch again, changed ports only republish.
    async fn watch_pool(&mut self, name: &str, sender: &watch::Sender<Members>) {
        let resource = self.pool_api(name).await;
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.namespace, &resource);
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut pool_events = watcher::watcher(api, config).default_backoff().boxed();
        // The pool's target while listing it, replacing `target` once the list is complete.
        let mut listing: Option<Option<PoolTarget>> = None;
        let mut target: Option<PoolTarget> = None;
        let mut pod_events: Option<BoxStream<'static, Result<Event<Pod>, watcher::Error>>> = None;
        let mut pods = PodSet::default();
        loop {
            let next_pod = async {
                match pod_events.as_mut() {
                    Some(events) => events.next().await,
                    None => future::pending().await,
                }
            };
            tokio::select! {
                event = pool_events.next() => {
                    let Some(event) = event else { return };
                    let changed = match event {
                        Ok(Event::Init) => {
                            listing = Some(None);
                            None
                        }
                        // A pool that cannot be used is counted and leaves the last target in place.
                        Ok(Event::InitApply(pool)) => {
                            listing = Some(self.pool_target(name, &pool).or_else(|| target.clone()));
                            None
                        }
                        Ok(Event::InitDone) => Some(listing.take().flatten()),
                        Ok(Event::Apply(pool)) => self.pool_target(name, &pool).map(Some),
                        Ok(Event::Delete(_)) => Some(None),
                        Err(source) => {
                            let error = KubernetesError::PoolWatch {
                                namespace: self.namespace.clone(),
                                name: name.to_owned(),
                                source,
                            };
                            self.failed(&error);
                            None
                        }
                    };
                    let Some(next) = changed else { continue };
                    let selector_changed =
                        next.as_ref().map(|t| &t.selector) != target.as_ref().map(|t| &t.selector);
                    target = next;
                    match &target {
                        // The pool is gone: an answer, its pods are no longer this pool's workers.
                        None => {
                            pod_events = None;
                            pods = PodSet::default();
                            let count = publish_workers(sender, &self.template, &pods, &[]);
                            self.status.updated(count);
                        }
                        Some(target) if selector_changed => {
                            pod_events = Some(self.pod_events(&target.selector));
                            pods = PodSet::default();
                        }
                        Some(target) if pods.listed => {
                            let ports = self.pool_ports(target);
                            self.answered(&pods, &ports, sender);
                        }
                        Some(_) => {}
                    }
                }
                Some(event) = next_pod => {
                    let ports = target.as_ref().map(|t| self.pool_ports(t)).unwrap_or_default();
                    self.pod_event(event, &mut pods, &ports, sender);
                }
            }
        }
    }

    /// The configured ports, else the InferencePool's target ports.
    fn pool_ports(&self, target: &PoolTarget) -> Vec<u16> {
        if self.ports.is_empty() {
            target.ports.clone()
        } else {
            self.ports.clone()
        }
    }

    /// The InferencePool's selector and ports, or `None` (counted as a failure) when it has none.
    fn pool_target(&mut self, name: &str, pool: &DynamicObject) -> Option<PoolTarget> {
        match pool_target(&pool.data) {
            Ok(target) => Some(target),
            Err(reason) => {
                let error = KubernetesError::Pool {
                    namespace: self.namespace.clone(),
                    name: name.to_owned(),
                    reason,
                };
                self.failed(&error);
                None
            }
        }
    }

    /// The InferencePool API this cluster serves: the GA group if it answers, else v1alpha2. Retried
    /// with the watcher's backoff while the API server cannot say.
    async fn pool_api(&mut self, name: &str) -> ApiResource {
        let mut backoff = DefaultBackoff::default();
        loop {
            match self.find_pool_api(name).await {
                Ok(resource) => return resource,
                Err(error) => self.failed(&error),
            }
            tokio::time::sleep(backoff.next().unwrap_or(MAX_BACKOFF)).await;
        }
    }

    async fn find_pool_api(&self, name: &str) -> Result<ApiResource, KubernetesError> {
        for (group, version) in POOL_VERSIONS {
            let gvk = GroupVersionKind::gvk(group, version, "InferencePool");
            let resource = ApiResource::from_gvk_with_plural(&gvk, "inferencepools");
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &self.namespace, &resource);
            let probe = ListParams::default()
                .fields(&format!("metadata.name={name}"))
                .limit(1);
            match api.list(&probe).await {
                Ok(_) => return Ok(resource),
                Err(kube::Error::Api(status)) if status.is_not_found() => continue,
                Err(source) => {
                    return Err(KubernetesError::PoolApi {
                        namespace: self.namespace.clone(),
                        name: name.to_owned(),
                        source,
                    });
                }
            }
        }
        Err(KubernetesError::NoPoolApi)
    }

    fn answered(&mut self, pods: &PodSet, ports: &[u16], sender: &watch::Sender<Members>) {
        let count = publish_workers(sender, &self.template, pods, ports);
        if self.status.updated(count) {
            tracing::info!(namespace = %self.namespace, "kubernetes: the watch answers again");
        }
    }

    fn failed(&mut self, error: &KubernetesError) {
        // An expired watch (410 Gone) is the watcher's ordinary way back to a fresh list, not an
        // outage: it is neither counted nor logged above debug.
        if let KubernetesError::Pods {
            source: watcher::Error::WatchError(status),
            ..
        }
        | KubernetesError::PoolWatch {
            source: watcher::Error::WatchError(status),
            ..
        } = error
            && status.code == 410
        {
            tracing::debug!(%error, "kubernetes: the watch expired, listing again");
            return;
        }
        if self.status.failed(error) {
            tracing::warn!(%error, "kubernetes: keeping the last workers");
        }
    }
}

/// Publishes the workers of `pods` (each worker pod once per port); how many there are.
fn publish_workers(
    sender: &watch::Sender<Members>,
    template: &WorkerTemplate,
    pods: &PodSet,
    ports: &[u16],
) -> usize {
    let next = members(
        pods.pods
            .values()
            .flatten()
            .flat_map(|ip| {
                ports
                    .iter()
                    .map(|port| template.worker(SocketAddr::new(*ip, *port)))
            })
            .collect(),
    );
    let count = next.len();
    if publish(sender, next) {
        tracing::info!(workers = count, "kubernetes: the pool's workers changed");
    }
    count
}

impl PodSet {
    /// Takes one watcher event; whether the set is now a complete answer worth publishing.
    fn apply(&mut self, event: Event<Pod>) -> bool {
        match event {
            Event::Init => {
                self.listing = Some(HashMap::new());
                false
            }
            Event::InitApply(pod) => {
                if let (Some(listing), Some(name)) = (&mut self.listing, pod.metadata.name.clone())
                {
                    listing.insert(name, worker_ip(&pod));
                }
                false
            }
            Event::InitDone => {
                self.pods = self.listing.take().unwrap_or_default();
                self.listed = true;
                true
            }
            Event::Apply(pod) => {
                if let Some(name) = pod.metadata.name.clone() {
                    self.pods.insert(name, worker_ip(&pod));
                }
                self.listed
            }
            Event::Delete(pod) => {
                if let Some(name) = &pod.metadata.name {
                    self.pods.remove(name);
                }
                self.listed
            }
        }
    }
}

/// The pod's IP when it is a worker: Ready, not terminating, with an IP.
fn worker_ip(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|condition| condition.type_ == "Ready" && condition.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// An InferencePool's selector and target ports: `spec.selector.matchLabels` and
/// `spec.targetPorts[].number` in v1; `spec.selector` (a plain map) and `spec.targetPortNumber` in
/// v1alpha2.
fn pool_target(pool: &Value) -> Result<PoolTarget, &'static str> {
    let spec = pool.get("spec").ok_or("it has no spec")?;
    let selector = spec.get("selector").ok_or("it has no spec.selector")?;
    let labels = selector
        .get("matchLabels")
        .unwrap_or(selector)
        .as_object()
        .ok_or("its selector is not a map of labels")?;
    let labels: BTreeMap<&str, &str> = labels
        .iter()
        .map(|(key, value)| value.as_str().map(|value| (key.as_str(), value)))
        .collect::<Option<_>>()
        .ok_or("a selector label's value is not a string")?;
    if labels.is_empty() {
        // An empty selector matches every pod of the namespace: never what a pool means.
        return Err("its selector is empty");
    }
    let selector = labels
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",");
    let port = |value: &Value| value.as_u64().and_then(|port| u16::try_from(port).ok());
    let ports: Vec<u16> = match (spec.get("targetPorts"), spec.get("targetPortNumber")) {
        (Some(ports), _) => ports
            .as_array()
            .ok_or("spec.targetPorts is not a list")?
            .iter()
            .map(|item| item.get("number").and_then(port))
            .collect::<Option<_>>()
            .ok_or("a spec.targetPorts number is not a port")?,
        (None, Some(number)) => vec![port(number).ok_or("spec.targetPortNumber is not a port")?],
        (None, None) => Vec::new(),
    };
    if ports.is_empty() {
        return Err("it has no target ports");
    }
    Ok(PoolTarget { selector, ports })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_both_inference_pool_versions() {
        let v1 = json!({"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}},
                                  "targetPorts": [{"number": 8000}, {"number": 8001}]}});
        assert_eq!(
            pool_target(&v1),
            Ok(PoolTarget {
                selector: "a=1,b=2".to_owned(),
                ports: vec![8000, 8001]
            })
        );
        let v1alpha2 = json!({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}});
        assert_eq!(
            pool_target(&v1alpha2),
            Ok(PoolTarget {
                selector: "app=vllm".to_owned(),
                ports: vec![8000]
            })
        );
        let empty =
            json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}});
        assert_eq!(pool_target(&empty), Err("its selector is empty"));
        let bad_port =
            json!({"spec": {"selector": {"app": "x"}, "targetPorts": [{"number": 70000}]}});
        assert!(pool_target(&bad_port).is_err());
    }
}
