//! Envoy's Endpoint Discovery Service (EDS), served next to ext_proc on `listen`, so the workers cluster
//! of the generated bootstrap (`type: EDS`) holds exactly the roster cachepick routes over: a reloaded
//! file, a DNS answer or a pod change reaches Envoy without an Envoy restart.
//!
//! State of the world (`StreamEndpoints`) only; Delta answers `Unimplemented` (Envoy is configured for
//! `GRPC`, not `DELTA_GRPC`). Each Envoy stream gets its own task: it answers the first request and every
//! change of subscription, pushes a new response (new `version_info`, new nonce) whenever the roster of
//! a subscribed cluster changes, logs a NACK with Envoy's error detail (and does not resend the same
//! thing), and ends when Envoy goes away or when the roster's source does (the picker shutting down). Nothing here runs on the decision path: the roster is read from
//! the published snapshots by a follower task ([`follow`]), off the request path.
//!
//! `version_info` is a fingerprint of the assignments sent, not a counter, so every picker replica
//! serving the same roster sends the same version: an Envoy whose EDS stream moves to another replica
//! sees no change where there is none.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress, address};
use envoy_types::pb::envoy::config::endpoint::v3::cluster_load_assignment::Policy;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_server::{
    EndpointDiscoveryService, EndpointDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::load::PoolLoad;

/// The name of the workers cluster in the generated bootstrap (`cachepick envoy-config`), which is the
/// EDS resource name Envoy subscribes to; `tests/envoy_config.rs` keeps the generator to it.
pub const WORKERS_CLUSTER: &str = "workers";

/// The EDS resource type.
pub const ASSIGNMENT_TYPE: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// Per cluster name, the endpoints Envoy's cluster must hold: sorted, without duplicates.
pub type Assignments = BTreeMap<String, Vec<SocketAddr>>;

/// The EDS gRPC service over `assignments`: every change of the watched value is pushed to the Envoy
/// streams subscribed to a cluster it changes, and every stream ends (cleanly) once the sender is gone,
/// which is how a shutting-down picker lets go of Envoy. The app passes [`follow`]'s receiver; a test
/// can drive its own.
pub fn server(assignments: watch::Receiver<Assignments>) -> EndpointDiscoveryServiceServer<Eds> {
    EndpointDiscoveryServiceServer::new(Eds { assignments })
}

/// Follows the pools' rosters: the returned receiver holds [`WORKERS_CLUSTER`] → every worker of every
/// pool that Envoy's workers cluster lists ([`Lifecycle::in_envoy`]) and that takes requests (role
/// prefill or both: cachepick never sends a request to a decode-only worker, so the fallback must not
/// either), and changes whenever a pool's roster does. The pools share one cluster because the route
/// cannot know a request's pool (the model is in the body). The tasks stop when the [`Follower`] is
/// dropped or when nobody holds a receiver any more.
///
/// [`Lifecycle::in_envoy`]: crate::load::Lifecycle::in_envoy
pub fn follow(pools: Vec<Arc<PoolLoad>>) -> (watch::Receiver<Assignments>, Follower) {
    let pools = Arc::new(pools);
    let (sender, receiver) = watch::channel(assignments_of(&pools));
    let sender = Arc::new(sender);
    let tasks = pools
        .iter()
        .map(|pool| {
            let mut changes = pool.roster_changes();
            let pools = Arc::clone(&pools);
            let sender = Arc::clone(&sender);
            tokio::spawn(async move {
                loop {
                    // Marked seen before the snapshot is read, so a change published meanwhile is not
                    // missed: it wakes the next `changed`.
                    changes.borrow_and_update();
                    let current = assignments_of(&pools);
                    sender.send_if_modified(|held| {
                        let modified = *held != current;
                        if modified {
                            *held = current;
                        }
                        modified
                    });
                    tokio::select! {
                        changed = changes.changed() => if changed.is_err() { return },
                        () = sender.closed() => return,
                    }
                }
            })
        })
        .collect();
    (receiver, Follower { tasks })
}

/// The tasks [`follow`] started; dropping it stops them.
#[derive(Debug)]
pub struct Follower {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn assignments_of(pools: &[Arc<PoolLoad>]) -> Assignments {
    let mut endpoints: Vec<SocketAddr> = pools
        .iter()
        .flat_map(|pool| {
            pool.snapshot()
                .workers()
                .iter()
                .filter(|worker| worker.lifecycle.in_envoy() && pool.takes_requests(worker.role))
                .map(|worker| worker.endpoint)
                .collect::<Vec<_>>()
        })
        .collect();
    endpoints.sort_unstable();
    endpoints.dedup();
    BTreeMap::from([(WORKERS_CLUSTER.to_owned(), endpoints)])
}

/// The service; one task per Envoy stream.
#[derive(Debug)]
pub struct Eds {
    assignments: watch::Receiver<Assignments>,
}

type DiscoveryStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
type DeltaStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl EndpointDiscoveryService for Eds {
    type StreamEndpointsStream = DiscoveryStream;

    async fn stream_endpoints(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        let peer = request
            .remote_addr()
            .map_or_else(|| "unknown".to_owned(), |addr| addr.to_string());
        let requests = request.into_inner();
        // A few responses at most are in flight: Envoy answers each with an ACK before it matters.
        let (sender, receiver) = mpsc::channel(4);
        let mut assignments = self.assignments.clone();
        assignments.mark_unchanged();
        tokio::spawn(async move {
            tracing::info!(%peer, "EDS stream opened");
            let end = EdsStream::new(sender, assignments, peer.clone())
                .run(requests)
                .await;
            tracing::info!(%peer, end, "EDS stream closed");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }

    type DeltaEndpointsStream = DeltaStream;

    async fn delta_endpoints(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Err(Status::unimplemented(
            "cachepick serves state-of-the-world EDS only: use api_type GRPC",
        ))
    }

    async fn fetch_endpoints(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let request = request.into_inner();
        check_type(&request.type_url)?;
        let names = subscription(&request.resource_names);
        let assignments = self.assignments.borrow().clone();
        let (version, resources) = response_body(&assignments, &names);
        Ok(Response::new(DiscoveryResponse {
            version_info: version,
            resources,
            type_url: ASSIGNMENT_TYPE.to_owned(),
            nonce: "fetch".to_owned(),
            ..DiscoveryResponse::default()
        }))
    }
}

/// Which clusters a stream subscribed to: `None` is the wildcard (an empty `resource_names`).
type Subscription = Option<BTreeSet<String>>;

fn subscription(names: &[String]) -> Subscription {
    (!names.is_empty()).then(|| names.iter().cloned().collect())
}

fn check_type(type_url: &str) -> Result<(), Status> {
    // An empty type URL is allowed on a stream whose method already says the type.
    if type_url.is_empty() || type_url == ASSIGNMENT_TYPE {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "this is EDS ({ASSIGNMENT_TYPE}); asked for {type_url}"
        )))
    }
}

/// The version and resources of a response to `names` on `assignments`.
fn response_body(assignments: &Assignments, names: &Subscription) -> (String, Vec<Any>) {
    let chosen: Vec<(&String, &Vec<SocketAddr>)> = assignments
        .iter()
        .filter(|(name, _)| names.as_ref().is_none_or(|names| names.contains(*name)))
        .collect();
    let resources = chosen
        .iter()
        .map(|(name, endpoints)| Any {
            type_url: ASSIGNMENT_TYPE.to_owned(),
            value: load_assignment(name, endpoints).encode_to_vec(),
        })
        .collect();
    (fingerprint(&chosen), resources)
}

/// FNV-1a over the names and endpoints: the same assignments give the same version in every replica
/// and every run.
fn fingerprint(chosen: &[(&String, &Vec<SocketAddr>)]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for byte in bytes {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, endpoints) in chosen {
        eat(name.as_bytes());
        eat(b"\0");
        for endpoint in endpoints.iter() {
            eat(endpoint.to_string().as_bytes());
            eat(b",");
        }
        eat(b";");
    }
    format!("{hash:016x}")
}

/// The roster's overprovisioning factor, in percent: so high that a roster with any healthy worker takes
/// all of the traffic of an aggregate cluster it leads. The generated bootstrap's fail-open route is
/// such an aggregate, with the bootstrap's own list of workers behind the roster; Envoy's default (140)
/// would spill requests to that list, which can be stale, as soon as outlier detection ejected more
/// than about 30 % of the roster. Within the workers cluster alone (one priority) the factor changes
/// nothing.
const OVERPROVISIONING_PERCENT: u32 = 100_000;

fn load_assignment(name: &str, endpoints: &[SocketAddr]) -> ClusterLoadAssignment {
    let lb_endpoints = endpoints
        .iter()
        .map(|endpoint| LbEndpoint {
            host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: endpoint.ip().to_string(),
                        port_specifier: Some(PortSpecifier::PortValue(u32::from(endpoint.port()))),
                        ..SocketAddress::default()
                    })),
                }),
                ..Endpoint::default()
            })),
            ..LbEndpoint::default()
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: name.to_owned(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..LocalityLbEndpoints::default()
        }],
        policy: Some(Policy {
            overprovisioning_factor: Some(UInt32Value {
                value: OVERPROVISIONING_PERCENT,
            }),
            ..Policy::default()
        }),
        ..ClusterLoadAssignment::default()
    }
}

/// One Envoy's EDS stream.
struct EdsStream {
    sender: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    assignments: watch::Receiver<Assignments>,
    peer: String,
    /// What Envoy subscribed to; `None` until its first request.
    subscribed: Option<Subscription>,
    /// The version and nonce of the last response sent.
    sent: Option<(String, String)>,
    nonces: u64,
    /// Subscribed names this server does not serve, already logged.
    unknown_logged: BTreeSet<String>,
}

impl EdsStream {
    fn new(
        sender: mpsc::Sender<Result<DiscoveryResponse, Status>>,
        assignments: watch::Receiver<Assignments>,
        peer: String,
    ) -> Self {
        EdsStream {
            sender,
            assignments,
            peer,
            subscribed: None,
            sent: None,
            nonces: 0,
            unknown_logged: BTreeSet::new(),
        }
    }

    /// Serves the stream until it ends; returns why, for the log.
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>) -> &'static str {
        loop {
            tokio::select! {
                message = requests.message() => match message {
                    Ok(Some(request)) => {
                        if let Err(status) = self.on_request(request).await {
                            let _ = self.sender.send(Err(status)).await;
                            return "bad request";
                        }
                    }
                    Ok(None) => return "closed by Envoy",
                    // Envoy resets the stream when it shuts down or moves to another replica.
                    Err(_) => return "reset by Envoy",
                },
                changed = self.assignments.changed() => match changed {
                    Ok(()) => {
                        if self.subscribed.is_some() && !self.push(false).await {
                            return "Envoy gone";
                        }
                    }
                    // The roster's source is gone: the picker is shutting down, and a stream left open
                    // would hold its graceful shutdown forever. Ending it cleanly sends Envoy to
                    // another replica, with the roster it has kept meanwhile.
                    Err(_) => return "picker shutting down",
                },
                () = self.sender.closed() => return "Envoy gone",
            }
        }
    }

    async fn on_request(&mut self, request: DiscoveryRequest) -> Result<(), Status> {
        check_type(&request.type_url)?;
        let latest_nonce = self.sent.as_ref().map(|(_, nonce)| nonce.as_str());
        if !request.response_nonce.is_empty()
            && Some(request.response_nonce.as_str()) != latest_nonce
        {
            // A reply to a response that has since been superseded: the protocol says to ignore it; the
            // newer response is on its way.
            return Ok(());
        }
        if let Some(error) = &request.error_detail {
            tracing::warn!(
                peer = %self.peer,
                nonce = %request.response_nonce,
                rejected_version = self.sent.as_ref().map_or("", |(version, _)| version.as_str()),
                kept_version = %request.version_info,
                code = error.code,
                detail = %error.message,
                "Envoy rejected the endpoints cachepick sent (EDS NACK); it keeps the version it had"
            );
        } else if !request.response_nonce.is_empty() {
            tracing::debug!(peer = %self.peer, version = %request.version_info, "EDS ACK");
        }
        let names = subscription(&request.resource_names);
        let first = self.subscribed.is_none();
        if first || self.subscribed.as_ref() != Some(&names) {
            self.log_unknown(&names);
            self.subscribed = Some(names);
            // The first request of a stream is always answered, even with the version Envoy says it
            // has: it may be a reconnection to a replica whose roster differs, and a response is how
            // Envoy's cluster finishes warming.
            if !self.push(true).await {
                return Err(Status::cancelled("Envoy gone"));
            }
        }
        Ok(())
    }

    fn log_unknown(&mut self, names: &Subscription) {
        let Some(names) = names else { return };
        let known = self.assignments.borrow();
        for name in names {
            if !known.contains_key(name) && self.unknown_logged.insert(name.clone()) {
                tracing::warn!(
                    peer = %self.peer,
                    cluster = %name,
                    served = ?known.keys().collect::<Vec<_>>(),
                    "Envoy asks EDS for a cluster cachepick does not serve; its bootstrap was not generated for this picker"
                );
            }
        }
    }

    /// Sends the current assignments of the subscribed clusters, unless they are what was last sent and
    /// `always` is false. False when Envoy is gone.
    async fn push(&mut self, always: bool) -> bool {
        let Some(names) = &self.subscribed else {
            return true;
        };
        let assignments = self.assignments.borrow_and_update().clone();
        let (version, resources) = response_body(&assignments, names);
        if !always && self.sent.as_ref().is_some_and(|(sent, _)| *sent == version) {
            return true;
        }
        self.nonces += 1;
        let nonce = self.nonces.to_string();
        let endpoints: usize = assignments
            .iter()
            .filter(|(name, _)| names.as_ref().is_none_or(|names| names.contains(*name)))
            .map(|(_, endpoints)| endpoints.len())
            .sum();
        tracing::info!(
            peer = %self.peer,
            %version,
            %nonce,
            clusters = resources.len(),
            endpoints,
            "EDS push"
        );
        let response = DiscoveryResponse {
            version_info: version.clone(),
            resources,
            type_url: ASSIGNMENT_TYPE.to_owned(),
            nonce: nonce.clone(),
            ..DiscoveryResponse::default()
        };
        self.sent = Some((version, nonce));
        self.sender.send(Ok(response)).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter()
            .map(|addr| addr.parse().expect("addr"))
            .collect()
    }

    #[test]
    fn the_version_follows_the_content_only() {
        let one = Assignments::from([(
            WORKERS_CLUSTER.to_owned(),
            addrs(&["127.0.0.1:1", "[::1]:2"]),
        )]);
        let same = one.clone();
        let other = Assignments::from([(WORKERS_CLUSTER.to_owned(), addrs(&["127.0.0.1:1"]))]);
        let all = None;
        assert_eq!(response_body(&one, &all).0, response_body(&same, &all).0);
        assert_ne!(response_body(&one, &all).0, response_body(&other, &all).0);
        let none = Some(BTreeSet::from(["elsewhere".to_owned()]));
        assert!(response_body(&one, &none).1.is_empty());
    }

    #[test]
    fn an_assignment_decodes_to_its_endpoints() {
        let any = response_body(
            &Assignments::from([(
                WORKERS_CLUSTER.to_owned(),
                addrs(&["127.0.0.1:8001", "[::1]:8002"]),
            )]),
            &None,
        )
        .1;
        assert_eq!(any.len(), 1);
        let decoded = any
            .first()
            .map(|any| ClusterLoadAssignment::decode(any.value.as_slice()).expect("decodes"))
            .expect("one");
        assert_eq!(decoded.cluster_name, WORKERS_CLUSTER);
        let ports: Vec<(String, Option<PortSpecifier>)> = decoded
            .endpoints
            .iter()
            .flat_map(|locality| &locality.lb_endpoints)
            .filter_map(|lb| match &lb.host_identifier {
                Some(HostIdentifier::Endpoint(endpoint)) => endpoint.address.clone(),
                _ => None,
            })
            .filter_map(|address| match address.address {
                Some(address::Address::SocketAddress(socket)) => {
                    Some((socket.address, socket.port_specifier))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            ports,
            [
                ("127.0.0.1".to_owned(), Some(PortSpecifier::PortValue(8001))),
                ("::1".to_owned(), Some(PortSpecifier::PortValue(8002)))
            ]
        );
    }

    #[test]
    fn only_endpoint_assignments_are_asked_for() {
        assert!(check_type("").is_ok());
        assert!(check_type(ASSIGNMENT_TYPE).is_ok());
        assert!(check_type("type.googleapis.com/envoy.config.cluster.v3.Cluster").is_err());
    }
}
