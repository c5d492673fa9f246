//! The `dns` discovery source against a real DNS server on loopback: a small authoritative responder in
//! this file (UDP and TCP on one port, answers built with hickory's wire codec) that answers A and AAAA
//! for one name from a record set the test changes, NXDOMAIN for every other name, and SERVFAIL or
//! nothing at all when told to.
//!
//! Covered, always by what the source publishes on its watch channel: the first resolution at once;
//! a record added (the worker joins) and removed (it leaves); NODATA and NXDOMAIN (the empty set);
//! SERVFAIL and a stopped server (the last set kept, each failure counted, and the server's return
//! picked up); A and AAAA records of one name (one worker each, with the template's settings and the
//! KV event sockets on each worker's own IP).

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use cachepick::config::{DnsDiscovery, KvEventsFrom, LoadSource, WorkerConfig, WorkerTemplate};
use cachepick::discovery::dns::DnsSource;
use cachepick::discovery::{Members, SourceState, SourceStatus, endpoints};
use cachepick::worker::Role;

mod support {
    pub mod engine;
}

const NAME: &str = "workers.cachepick.test";
const PORT: u16 = 8000;
/// Short, so a change is seen within a few rounds; each wait below is bounded far above it.
const INTERVAL: Duration = Duration::from_millis(100);
const DEADLINE: Duration = Duration::from_secs(10);

/// What the server answers for [`NAME`].
#[derive(Clone, Debug)]
enum Zone {
    Records(Vec<IpAddr>),
    NxDomain,
    ServFail,
}

/// The test's authoritative server: `zone` is read at every query.
struct DnsServer {
    addr: SocketAddr,
    zone: Arc<Mutex<Zone>>,
    queries: Arc<Mutex<u64>>,
    tasks: Vec<JoinHandle<()>>,
}

impl DnsServer {
    async fn start(zone: Zone) -> DnsServer {
        // UDP and TCP on the same port, as a real server listens: the resolver may retry over TCP.
        for _ in 0..20 {
            let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let addr = udp.local_addr().unwrap();
            if let Ok(tcp) = TcpListener::bind(addr).await {
                return Self::serve(udp, tcp, Arc::new(Mutex::new(zone)), Arc::default());
            }
        }
        panic!("no free port for both UDP and TCP");
    }

    /// Starts again on the same port with the same zone, as a restarted server would.
    async fn restart(&mut self) {
        let udp = UdpSocket::bind(self.addr).await.unwrap();
        let tcp = TcpListener::bind(self.addr).await.unwrap();
        let mut next = Self::serve(udp, tcp, self.zone.clone(), self.queries.clone());
        self.tasks = std::mem::take(&mut next.tasks);
    }

    fn serve(
        udp: UdpSocket,
        tcp: TcpListener,
        zone: Arc<Mutex<Zone>>,
        queries: Arc<Mutex<u64>>,
    ) -> DnsServer {
        let addr = udp.local_addr().unwrap();
        let udp_task = {
            let zone = zone.clone();
            let queries = queries.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    let Ok((len, peer)) = udp.recv_from(&mut buf).await else {
                        return;
                    };
                    if let Some(reply) = answer(&buf[..len], &zone, &queries) {
                        let _ = udp.send_to(&reply, peer).await;
                    }
                }
            })
        };
        let tcp_task = {
            let zone = zone.clone();
            let queries = queries.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((mut stream, _)) = tcp.accept().await else {
                        return;
                    };
                    let zone = zone.clone();
                    let queries = queries.clone();
                    tokio::spawn(async move {
                        loop {
                            let Ok(len) = stream.read_u16().await else {
                                return;
                            };
                            let mut query = vec![0u8; usize::from(len)];
                            if stream.read_exact(&mut query).await.is_err() {
                                return;
                            }
                            let Some(reply) = answer(&query, &zone, &queries) else {
                                return;
                            };
                            let len = u16::try_from(reply.len()).unwrap();
                            if stream.write_u16(len).await.is_err()
                                || stream.write_all(&reply).await.is_err()
                            {
                                return;
                            }
                        }
                    });
                }
            })
        };
        DnsServer {
            addr,
            zone,
            queries,
            tasks: vec![udp_task, tcp_task],
        }
    }

    fn set(&self, zone: Zone) {
        *self.zone.lock().unwrap() = zone;
    }

    fn queries(&self) -> u64 {
        *self.queries.lock().unwrap()
    }

    /// Closes both sockets: queries are refused (ICMP port unreachable, TCP RST) until `restart`.
    async fn stop(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The reply to one query: the zone's records of the asked type for [`NAME`], NXDOMAIN for any
/// other name.
fn answer(query: &[u8], zone: &Mutex<Zone>, queries: &Mutex<u64>) -> Option<Vec<u8>> {
    let request = Message::from_vec(query).ok()?;
    *queries.lock().unwrap() += 1;
    let question = request.queries.first()?.clone();
    let mut reply = Message::response(request.metadata.id, OpCode::Query);
    reply.metadata.message_type = MessageType::Response;
    reply.metadata.authoritative = true;
    reply.metadata.recursion_desired = request.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.add_query(question.clone());
    let asked = question.name().to_ascii();
    let ours = asked.trim_end_matches('.').eq_ignore_ascii_case(NAME);
    let zone = zone.lock().unwrap().clone();
    match (ours, zone) {
        (false, _) | (true, Zone::NxDomain) => {
            reply.metadata.response_code = ResponseCode::NXDomain
        }
        (true, Zone::ServFail) => reply.metadata.response_code = ResponseCode::ServFail,
        (true, Zone::Records(addresses)) => {
            for ip in addresses {
                let rdata = match (ip, question.query_type()) {
                    (IpAddr::V4(v4), RecordType::A) => RData::A(A(v4)),
                    (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(v6)),
                    _ => continue,
                };
                reply.add_answer(Record::from_rdata(question.name().clone(), 30, rdata));
            }
        }
    }
    reply.to_vec().ok()
}

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

fn endpoint(ip: IpAddr) -> SocketAddr {
    SocketAddr::new(ip, PORT)
}

/// A running source: its channel and status, stopped when dropped.
struct Running {
    members: watch::Receiver<Members>,
    status: Arc<SourceStatus>,
    _stop: oneshot::Sender<()>,
}

fn start_source(server: SocketAddr, template: &WorkerTemplate) -> Running {
    let dns = DnsDiscovery {
        name: NAME.to_owned(),
        port: PORT,
        interval: INTERVAL,
        server: Some(server),
    };
    let status = SourceStatus::new("dns");
    let source = DnsSource::new(&dns, template, status.clone());
    let (sender, members) = watch::channel(Members::from(Vec::new()));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(source.run(sender, async {
        let _ = stopped.await;
    }));
    Running {
        members,
        status,
        _stop: stop,
    }
}

impl Running {
    /// Waits until the published set's endpoints are `expected` (in any order).
    async fn published(&mut self, expected: &[IpAddr]) -> Members {
        let mut want: Vec<SocketAddr> = expected.iter().copied().map(endpoint).collect();
        want.sort();
        let seen = tokio::time::timeout(
            DEADLINE,
            self.members.wait_for(|members| endpoints(members) == want),
        )
        .await;
        let seen = seen
            .ok()
            .and_then(Result::ok)
            .map(|members| members.clone());
        match seen {
            Some(members) => members,
            None => panic!(
                "expected {want:?} to be published; the set is {:?}, the source {:?}",
                endpoints(&self.members.borrow()),
                self.status.state()
            ),
        }
    }

    /// Waits until the status satisfies `done`.
    async fn status_until(&self, what: &str, done: impl Fn(&SourceState) -> bool) -> SourceState {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let state = self.status.state();
            if done(&state) {
                return state;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: the source's status stayed {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn records_join_and_leave_and_an_empty_answer_drains_the_pool() {
    let server = DnsServer::start(Zone::Records(vec![v4(11)])).await;
    let mut source = start_source(server.addr, &WorkerTemplate::default());

    source.published(&[v4(11)]).await;
    let state = source.status.state();
    assert!(state.updates >= 1 && state.errors == 0, "{state:?}");
    assert_eq!(state.members, 1);

    server.set(Zone::Records(vec![v4(11), v4(12)]));
    source.published(&[v4(11), v4(12)]).await;

    server.set(Zone::Records(vec![v4(12)]));
    source.published(&[v4(12)]).await;

    // NODATA: the name exists with no address records.
    server.set(Zone::Records(Vec::new()));
    source.published(&[]).await;
    let state = source
        .status_until("NODATA counted as an answer", |s| s.members == 0)
        .await;
    assert_eq!(
        state.errors, 0,
        "an empty answer is not a failure: {state:?}"
    );

    server.set(Zone::Records(vec![v4(13)]));
    source.published(&[v4(13)]).await;

    // NXDOMAIN: the name is gone, so are its workers.
    server.set(Zone::NxDomain);
    source.published(&[]).await;
    let state = source.status.state();
    assert_eq!(state.errors, 0, "NXDOMAIN is an answer: {state:?}");
    assert!(server.queries() > 0);
}

#[tokio::test]
async fn failures_keep_the_last_set_and_are_counted() {
    let mut server = DnsServer::start(Zone::Records(vec![v4(21), v4(22)])).await;
    let mut source = start_source(server.addr, &WorkerTemplate::default());
    let first = source.published(&[v4(21), v4(22)]).await;
    source.members.mark_unchanged();

    // SERVFAIL: the server cannot answer, which says nothing of the workers.
    server.set(Zone::ServFail);
    let before = source.status.state().errors;
    let state = source
        .status_until("SERVFAIL counted", |s| s.errors >= before + 3)
        .await;
    assert!(
        state
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(NAME)),
        "{state:?}"
    );
    assert!(
        !source.members.has_changed().unwrap(),
        "SERVFAIL changed the set"
    );
    assert_eq!(*source.members.borrow(), first);

    // The server goes away altogether: refused queries are failures too.
    server.set(Zone::Records(vec![v4(23)]));
    server.stop().await;
    let before = source.status.state().errors;
    source
        .status_until("a stopped server counted", |s| s.errors >= before + 3)
        .await;
    assert!(
        !source.members.has_changed().unwrap(),
        "a stopped server changed the set"
    );
    assert_eq!(*source.members.borrow(), first);

    // Back, with a changed record set: the next round answers and clears the error.
    server.restart().await;
    source.published(&[v4(23)]).await;
    let state = source
        .status_until("the error cleared", |s| s.last_error.is_none())
        .await;
    assert_eq!(state.members, 1);
}

#[tokio::test]
async fn every_address_of_the_name_is_a_worker_with_the_template() {
    let v6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
    let server = DnsServer::start(Zone::Records(vec![v4(31), v4(32), v6])).await;
    let template = WorkerTemplate {
        load_source: LoadSource::Loads,
        role: Role::Prefill,
        dp_size: NonZeroU32::new(2).unwrap(),
        max_running_requests: NonZeroU64::new(64),
        max_total_tokens: NonZeroU64::new(100_000),
        kv_events_port: 5557,
        kv_replay_port: Some(5558),
        kv_events_from: KvEventsFrom::Pool,
        scrape_https: false,
    };
    let mut source = start_source(server.addr, &template);

    let members = source.published(&[v4(31), v4(32), v6]).await;
    assert_eq!(members.len(), 3);
    for worker in members.iter() {
        let expected: WorkerConfig = template.worker(worker.endpoint);
        assert_eq!(*worker, expected);
        assert_eq!(worker.role, Role::Prefill);
        assert_eq!(worker.dp_size.get(), 2);
        assert_eq!(worker.load_source, LoadSource::Loads);
        assert_eq!(
            worker.kv_events.live,
            SocketAddr::new(worker.endpoint.ip(), 5557)
        );
        assert_eq!(
            worker.kv_events.replay,
            Some(SocketAddr::new(worker.endpoint.ip(), 5558))
        );
        assert_eq!(
            worker.metrics_url,
            format!("http://{}/metrics", worker.endpoint)
        );
    }
}

/// The whole picker on a `dns` pool: `serve` starts the source, scrapes what the name resolves to, and
/// routes there; the snapshot names the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_pool_serves_the_engines_its_name_resolves_to() {
    // Two engines on one port of two loopback IPs, as two pods behind a headless Service.
    let port = std::net::TcpListener::bind("127.0.0.2:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = || {
        support::engine::Mode::Body(
            "text/plain",
            support::engine::vllm_metrics(&[(0, 0, 0, 0.1)]),
        )
    };
    let first =
        support::engine::FakeEngine::start_at(SocketAddr::new(v4(2), port), metrics()).await;
    let second =
        support::engine::FakeEngine::start_at(SocketAddr::new(v4(3), port), metrics()).await;
    let server = DnsServer::start(Zone::Records(vec![v4(2), v4(3)])).await;
    let yaml = format!(
        "load: {{scrape_interval: 200ms, scrape_timeout: 150ms, freshness: 1s}}\n\
         pools:\n  - model: m\n    engine: vllm\n    tokenizer: {{kind: bytes}}\n\
         \x20   dns: {{name: {NAME}, port: {port}, interval: 200ms, server: \"{}\"}}\n",
        server.addr
    );
    let config =
        cachepick_rig::stage::on_free_ports(&yaml, "dns.yaml", Default::default()).unwrap();
    let mut picker = cachepick_rig::stage::Picker::spawn(config);
    picker
        .ready(cachepick_rig::stage::READY_WITHIN)
        .await
        .expect("ready once the name resolved and the engines were scraped");
    let deadline = std::time::Instant::now() + DEADLINE;
    let snapshot = loop {
        let (status, body) = cachepick_rig::http_exchange(
            http::Method::GET,
            picker.metrics_listen(),
            "/debug/snapshot",
            "",
            DEADLINE,
        )
        .await
        .unwrap();
        assert_eq!(status, 200);
        let snapshot: serde_json::Value = serde_json::from_str(&body).unwrap();
        let healthy = snapshot["pools"][0]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|worker| worker["state"] == "healthy")
            .count();
        if healthy == 2 {
            break snapshot;
        }
        assert!(std::time::Instant::now() < deadline, "{snapshot:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        snapshot["pools"][0]["source"]["kind"], "dns",
        "{snapshot:#}"
    );
    assert_eq!(snapshot["pools"][0]["source"]["members"], 2, "{snapshot:#}");
    let client = cachepick_rig::client::Client::connect(picker.listen())
        .await
        .unwrap();
    let body =
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": "hello ".repeat(100)}))
            .unwrap();
    match client.decide("/v1/completions", &body).await.unwrap() {
        cachepick_rig::client::Verdict::Route { endpoints, .. } => {
            assert!(
                [first.addr, second.addr].contains(&endpoints[0]),
                "{endpoints:?}"
            );
        }
        refused => panic!("refused: {refused:?}"),
    }
    picker.stop().await.unwrap();
}
