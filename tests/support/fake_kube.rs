//! A fake Kubernetes API server on loopback for the discovery tests: real HTTP/1.1 speaking the API's
//! own list and watch JSON for Pods (`/api/v1/namespaces/{ns}/pods`) and InferencePools
//! (`/apis/{group}/{version}/namespaces/{ns}/inferencepools`), so kube's client and watcher run
//! unchanged against it.
//!
//! Like the real server it keeps a resource version counter and a log of changes: a watch from version
//! `N` first replays every change after `N`, then streams new ones as newline-delimited
//! `{"type":…,"object":…}`; label selectors (equality only: `k=v,k2=v2`) and `metadata.name=` field
//! selectors are honoured. [`FakeKube::expire_watches`] compacts the log as etcd does: every open watch
//! receives a `410 Expired` ERROR event and ends, and a watch from an older version gets the same at
//! once, so the client has to list again. Lists are counted per resource.

#![allow(dead_code)] // not every test uses every helper

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

pub const POOL_V1: &str = "inference.networking.k8s.io/v1";
pub const POOL_V1ALPHA2: &str = "inference.networking.x-k8s.io/v1alpha2";

/// Which collection a request or an object belongs to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Collection {
    Pods,
    /// InferencePools of one group/version.
    Pools(String),
}

impl Collection {
    fn name(&self) -> &'static str {
        match self {
            Collection::Pods => "pods",
            Collection::Pools(_) => "inferencepools",
        }
    }
}

/// One change, as a watch reports it.
#[derive(Clone)]
struct Change {
    version: u64,
    collection: Collection,
    namespace: String,
    kind: &'static str,
    object: Value,
}

struct Watcher {
    collection: Collection,
    namespace: String,
    labels: Option<String>,
    name: Option<String>,
    events: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct State {
    version: u64,
    /// Watches from a version below this one are too old (their changes were compacted away).
    oldest: u64,
    objects: BTreeMap<(Collection, String, String), Value>,
    log: Vec<Change>,
    watchers: Vec<Watcher>,
    lists: BTreeMap<&'static str, usize>,
    watches: BTreeMap<&'static str, usize>,
    /// Every label selector a pod list or watch asked with.
    pod_selectors: Vec<String>,
    /// The InferencePool group/versions served; the others answer 404 as a cluster without the CRD.
    pool_versions: Vec<String>,
}

pub struct FakeKube {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    accept: JoinHandle<()>,
}

impl FakeKube {
    pub async fn start() -> FakeKube {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// Starts on `addr`: a test that starts its client first picks the port in advance.
    pub async fn start_on(addr: SocketAddr) -> FakeKube {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            pool_versions: vec![POOL_V1.to_owned(), POOL_V1ALPHA2.to_owned()],
            ..State::default()
        }));
        let served = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let state = served.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(&state, &request)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FakeKube {
            addr,
            state,
            accept,
        }
    }

    /// A client of this server, as `kube::Client::try_default` would build one for a cluster; its
    /// default namespace is `default`.
    pub fn client(&self) -> kube::Client {
        client_for(self.addr)
    }

    /// Serves only these InferencePool group/versions.
    pub fn serve_pool_versions(&self, versions: &[&str]) {
        self.state.lock().unwrap().pool_versions =
            versions.iter().map(|v| (*v).to_owned()).collect();
    }

    /// Creates or replaces a pod (ADDED or MODIFIED to the watches it matches).
    pub fn apply_pod(&self, namespace: &str, pod: Value) {
        self.apply(Collection::Pods, namespace, pod);
    }

    pub fn delete_pod(&self, namespace: &str, name: &str) {
        self.delete(Collection::Pods, namespace, name);
    }

    /// Creates or replaces an InferencePool of `version` (`group/version`).
    pub fn apply_pool(&self, version: &str, namespace: &str, pool: Value) {
        self.apply(Collection::Pools(version.to_owned()), namespace, pool);
    }

    pub fn delete_pool(&self, version: &str, namespace: &str, name: &str) {
        self.delete(Collection::Pools(version.to_owned()), namespace, name);
    }

    /// Compacts the change log: every open watch gets `410 Expired` and ends, and a watch from any
    /// version seen so far is refused the same way, so clients list again.
    pub fn expire_watches(&self) {
        let mut state = self.state.lock().unwrap();
        state.version += 1;
        state.oldest = state.version;
        state.log.clear();
        for watcher in state.watchers.drain(..) {
            let _ = watcher.events.send(line(&expired()));
        }
    }

    /// How many lists of `resource` (`pods` or `inferencepools`) were served.
    pub fn lists(&self, resource: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .lists
            .get(resource)
            .copied()
            .unwrap_or(0)
    }

    /// How many watches of `resource` were opened.
    pub fn watches(&self, resource: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .watches
            .get(resource)
            .copied()
            .unwrap_or(0)
    }

    pub fn pod_selectors(&self) -> Vec<String> {
        self.state.lock().unwrap().pod_selectors.clone()
    }

    fn apply(&self, collection: Collection, namespace: &str, mut object: Value) {
        let mut state = self.state.lock().unwrap();
        state.version += 1;
        let version = state.version;
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        object["metadata"]["namespace"] = json!(namespace);
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        let key = (collection.clone(), namespace.to_owned(), name);
        let kind = if state.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        state.objects.insert(key, object.clone());
        state.record(Change {
            version,
            collection,
            namespace: namespace.to_owned(),
            kind,
            object,
        });
    }

    fn delete(&self, collection: Collection, namespace: &str, name: &str) {
        let mut state = self.state.lock().unwrap();
        let key = (collection.clone(), namespace.to_owned(), name.to_owned());
        let Some(mut object) = state.objects.remove(&key) else {
            panic!("no {} {namespace}/{name} to delete", collection.name());
        };
        state.version += 1;
        let version = state.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        state.record(Change {
            version,
            collection,
            namespace: namespace.to_owned(),
            kind: "DELETED",
            object,
        });
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.accept.abort();
        // Ends the open watches, as a stopped server's connections end.
        self.state.lock().unwrap().watchers.clear();
    }
}

/// A kube client for a server at `addr` (plain HTTP, namespace `default`).
pub fn client_for(addr: SocketAddr) -> kube::Client {
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

impl State {
    fn record(&mut self, change: Change) {
        let event = line(&json!({"type": change.kind, "object": change.object}));
        self.watchers.retain(|watcher| {
            !watcher.matches(&change) || watcher.events.send(event.clone()).is_ok()
        });
        self.log.push(change);
    }
}

impl Watcher {
    fn matches(&self, change: &Change) -> bool {
        change.collection == self.collection
            && change.namespace == self.namespace
            && selected(&change.object, self.labels.as_deref(), self.name.as_deref())
    }
}

/// Whether `object` matches an equality label selector and a `metadata.name` field selector.
fn selected(object: &Value, labels: Option<&str>, name: Option<&str>) -> bool {
    if let Some(name) = name
        && object["metadata"]["name"].as_str() != Some(name)
    {
        return false;
    }
    labels
        .into_iter()
        .flat_map(|selector| selector.split(','))
        .filter(|term| !term.is_empty())
        .all(|term| {
            let (key, value) = term
                .split_once("==")
                .or_else(|| term.split_once('='))
                .unwrap_or_else(|| {
                    panic!("the fake understands equality selectors only: `{term}`")
                });
            object["metadata"]["labels"][key.trim()].as_str() == Some(value.trim())
        })
}

fn handle(
    state: &Mutex<State>,
    request: &Request<Incoming>,
) -> Response<BoxBody<Bytes, Infallible>> {
    let path = request.uri().path();
    let query = parse_query(request.uri().query().unwrap_or(""));
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (collection, namespace) = match segments.as_slice() {
        ["api", "v1", "namespaces", namespace, "pods"] => (Collection::Pods, *namespace),
        [
            "apis",
            group,
            version,
            "namespaces",
            namespace,
            "inferencepools",
        ] => {
            let version = format!("{group}/{version}");
            if !state.lock().unwrap().pool_versions.contains(&version) {
                return status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    "the server could not find the requested resource",
                );
            }
            (Collection::Pools(version), *namespace)
        }
        _ => {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            );
        }
    };
    let labels = query.get("labelSelector").cloned();
    let name = query
        .get("fieldSelector")
        .map(|field| match field.strip_prefix("metadata.name=") {
            Some(name) => name.to_owned(),
            None => panic!("the fake understands metadata.name field selectors only: `{field}`"),
        });
    let mut state = state.lock().unwrap();
    if collection == Collection::Pods {
        state.pod_selectors.push(labels.clone().unwrap_or_default());
    }
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    if !watching {
        *state.lists.entry(collection.name()).or_default() += 1;
        let items: Vec<Value> = state
            .objects
            .iter()
            .filter(|((c, ns, _), object)| {
                *c == collection
                    && ns == namespace
                    && selected(object, labels.as_deref(), name.as_deref())
            })
            .map(|(_, object)| object.clone())
            .collect();
        let (kind, api_version) = match &collection {
            Collection::Pods => ("PodList", "v1".to_owned()),
            Collection::Pools(version) => ("InferencePoolList", version.clone()),
        };
        let list = json!({
            "kind": kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": state.version.to_string()},
            "items": items,
        });
        return json_response(StatusCode::OK, &list);
    }
    *state.watches.entry(collection.name()).or_default() += 1;
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|version| version.parse().ok())
        .unwrap_or(0);
    let (sender, receiver) = mpsc::unbounded_channel();
    if from < state.oldest {
        let _ = sender.send(line(&expired()));
    } else {
        let watcher = Watcher {
            collection,
            namespace: namespace.to_owned(),
            labels,
            name,
            events: sender,
        };
        for change in state.log.iter().filter(|change| change.version > from) {
            if watcher.matches(change) {
                let _ = watcher
                    .events
                    .send(line(&json!({"type": change.kind, "object": change.object})));
            }
        }
        state.watchers.push(watcher);
    }
    let body = StreamBody::new(
        UnboundedReceiverStream::new(receiver).map(|bytes| Ok::<_, Infallible>(Frame::data(bytes))),
    );
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(body))
        .unwrap()
}

/// The ERROR event an API server sends when a watch's version was compacted away.
fn expired() -> Value {
    json!({
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        },
    })
}

fn line(value: &Value) -> Bytes {
    let mut text = serde_json::to_vec(value).unwrap();
    text.push(b'\n');
    Bytes::from(text)
}

fn json_response(code: StatusCode, value: &Value) -> Response<BoxBody<Bytes, Infallible>> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(value).unwrap())).boxed())
        .unwrap()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<BoxBody<Bytes, Infallible>> {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(key), decode(value))
        })
        .collect()
}

/// `application/x-www-form-urlencoded` decoding, as the client encodes its query.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 2;
            }
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

/// A pod as the API server reports it: `ip` once scheduled and started, the `Ready` condition.
pub fn pod(name: &str, labels: &[(&str, &str)], ip: Option<&str>, ready: bool) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(key, value)| ((*key).to_owned(), json!(value)))
        .collect();
    let mut status = json!({
        "phase": if ip.is_some() { "Running" } else { "Pending" },
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": if ready { "True" } else { "False" }},
        ],
    });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "labels": labels, "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
        "status": status,
    })
}

/// `pod` being deleted: the API server sets `deletionTimestamp` and the pod stays until it stops.
pub fn terminating(mut pod: Value) -> Value {
    pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    pod
}

/// An `inference.networking.k8s.io/v1` InferencePool.
pub fn inference_pool_v1(name: &str, labels: &[(&str, &str)], ports: &[u16]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(key, value)| ((*key).to_owned(), json!(value)))
        .collect();
    let ports: Vec<Value> = ports.iter().map(|port| json!({"number": port})).collect();
    json!({
        "kind": "InferencePool",
        "apiVersion": POOL_V1,
        "metadata": {"name": name, "uid": format!("uid-{name}")},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports,
            "endpointPickerRef": {"name": "cachepick", "port": {"number": 9002}},
        },
    })
}

/// An `inference.networking.x-k8s.io/v1alpha2` InferencePool: a plain selector map, one port.
pub fn inference_pool_v1alpha2(name: &str, labels: &[(&str, &str)], port: u16) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(key, value)| ((*key).to_owned(), json!(value)))
        .collect();
    json!({
        "kind": "InferencePool",
        "apiVersion": POOL_V1ALPHA2,
        "metadata": {"name": name, "uid": format!("uid-{name}")},
        "spec": {
            "selector": labels,
            "targetPortNumber": port,
            "extensionRef": {"name": "cachepick"},
        },
    })
}
