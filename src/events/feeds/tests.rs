use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::{EventFeeds, RankSockets};
use crate::config::{self, KvEventEndpoints, KvEventsFrom, Overrides};
use crate::events::stream::StreamView;
use crate::load::HttpClient;
use crate::prefix::EventIndex;
use crate::worker::WorkerId;

/// One worker whose engine nobody can ask (port 9 refuses), so only the test's answers move it.
const POOL: &str = "pools:\n  - model: m\n    engine: vllm\n    index: {mode: events, replay_port: 5558}\n    workers:\n      - endpoint: 127.0.0.1:9\n";

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

fn view(feeds: &EventFeeds) -> StreamView {
    feeds.views(Instant::now())[0].1[0].clone()
}

fn named(live: &str, replay: Option<&str>) -> RankSockets {
    vec![Some(KvEventEndpoints {
        live: addr(live),
        replay: replay.map(addr),
    })]
}

/// What the engine names is where the rank's stream goes: the pool's own sockets confirmed keep the
/// stream and what it learned, a new socket is another publisher (its slot forgotten, guesses
/// included), the same answer again moves nothing, and an engine that stops naming them sends the
/// rank back to the pool's ports. An answer for a worker that joined again since is ignored.
#[tokio::test]
async fn a_rank_follows_what_its_engine_names_and_forgets_what_its_old_socket_said() {
    let config = config::parse(POOL, "t.yaml", &Overrides::default()).unwrap();
    let pool = &config.pools[0];
    let worker = &pool.workers[0];
    assert_eq!(worker.kv_events_from, KvEventsFrom::Engine);
    let index = Arc::new(EventIndex::for_pool(pool, &[1024]));
    let feeds = EventFeeds::new([(pool, Arc::clone(&index))]);
    let _subscribers = feeds.start(
        std::future::pending::<()>,
        HttpClient::new(&config.load, None),
    );
    let feed = Arc::clone(&feeds.pools[0]);
    let started = feeds.started().unwrap();
    let id = WorkerId(0);
    let at = |view: &StreamView| (view.live, view.replay, view.from);
    assert_eq!(
        at(&view(&feeds)),
        (
            addr("127.0.0.1:5557"),
            Some(addr("127.0.0.1:5558")),
            KvEventsFrom::Pool
        )
    );
    let chain = [11, 12, 13];
    let held = || !index.matches(&chain, Instant::now()).is_empty();
    index.speculate(id, &chain, Instant::now());
    assert!(held());

    let same = named("127.0.0.1:5557", Some("127.0.0.1:5558"));
    assert!(!feed.located(id, worker, &same, &started));
    assert_eq!(at(&view(&feeds)).2, KvEventsFrom::Engine);
    assert!(held(), "the confirmed stream keeps what it learned");

    let moved = named("127.0.0.1:41000", None);
    assert!(feed.located(id, worker, &moved, &started));
    assert_eq!(
        at(&view(&feeds)),
        (addr("127.0.0.1:41000"), None, KvEventsFrom::Engine)
    );
    assert!(!held(), "a moved rank's slot is forgotten");
    assert!(!feed.located(id, worker, &moved, &started));

    assert!(feed.located(id, worker, &Vec::new(), &started));
    assert_eq!(
        at(&view(&feeds)),
        (
            addr("127.0.0.1:5557"),
            Some(addr("127.0.0.1:5558")),
            KvEventsFrom::Pool
        )
    );

    let mut again = worker.clone();
    again.kv_events.live = addr("127.0.0.1:6000");
    again.kv_events_from = KvEventsFrom::Worker;
    feeds.join("m", id, &again);
    assert!(!feed.located(id, worker, &moved, &started));
    assert_eq!(
        at(&view(&feeds)),
        (
            addr("127.0.0.1:6000"),
            Some(addr("127.0.0.1:5558")),
            KvEventsFrom::Worker
        )
    );
}
