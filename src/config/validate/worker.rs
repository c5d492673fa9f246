//! A pool's workers (`workers:`, and the `template:` of discovered ones): each one's endpoint, its
//! scrape URLs and what its engine is, checked against the pool's engine and index.

use super::*;

pub(super) const WORKER_KEYS: &[&str] = &[
    "endpoint",
    "metrics_url",
    "load_source",
    "loads_url",
    "role",
    "dp_size",
    "max_running_requests",
    "max_total_tokens",
    "kv_events",
    "bootstrap_port",
];

impl Validator<'_> {
    /// `engine` is the pool's, `None` if it was rejected (the checks against it are then skipped).
    pub(super) fn workers(
        &mut self,
        pool: &Map,
        engine: Option<Engine>,
        index: &Res<IndexDraft>,
    ) -> Res<Vec<Res<WorkerDraft>>> {
        let (workers, at) = self.required_list(pool, "workers", "worker", |v, node, at| {
            v.worker(node, at, engine, index)
        })?;
        // Judged only when every worker's role is known: a rejected one may have been the prefill worker.
        let roles: Res<Vec<Role>> = workers
            .iter()
            .map(|worker| worker.as_ref().map_err(|r| *r)?.role)
            .collect();
        if roles.is_ok_and(|roles| !roles.iter().any(|role| role.serves_prefill())) {
            let message =
                "no worker has role prefill or both: every request to this pool would be refused";
            self.report(Phase::Structure, at.origin(), message);
        }
        Ok(workers)
    }

    fn worker(
        &mut self,
        node: &Node,
        at: &Place,
        engine: Option<Engine>,
        index: &Res<IndexDraft>,
    ) -> Res<WorkerDraft> {
        let map = self.mapping(node, at, WORKER_KEYS)?;
        let endpoint = self.required(&map, "endpoint", Self::address).and_then(|endpoint| {
            if endpoint.value.ip().is_unspecified() || endpoint.value.port() == 0 {
                let message = format!(
                    "{} is not an address Envoy can send a request to: give the worker's own IP and port",
                    endpoint.value
                );
                return Err(self.report(Phase::Value, endpoint.at, message));
            }
            Ok(endpoint)
        });
        let metrics_url = self.opt(&map, "metrics_url", |v, node, at| {
            v.http_url(node, at, "metrics")
        });
        let loads_url = self.opt(&map, "loads_url", |v, node, at| {
            v.http_url(node, at, "/v1/loads")
        });
        let keys = self.engine_keys(&map, loads_url, engine);
        let kv_events = self.worker_kv_events(&map);
        let kv_events = match (&endpoint, &keys.dp_size, index, kv_events) {
            (Ok(endpoint), Ok(dp_size), Ok(index), Ok(own)) => {
                self.resolve_kv_events(index, own, endpoint.value, dp_size.value.get())
            }
            (Err(reported), ..) | (_, Err(reported), ..) | (.., Err(reported), _) => Err(*reported),
            (.., Err(reported)) => Err(reported),
        };
        let bootstrap_port = self.opt(&map, "bootstrap_port", Self::port);
        Ok(WorkerDraft {
            kv_events,
            bootstrap_port,
            endpoint,
            metrics_url: metrics_url.map(|url| url.map(|url| url.value)),
            load_source: keys.load_source,
            loads_url: keys.loads_url,
            role: keys.role,
            dp_size: keys.dp_size.map(|size| size.value),
            max_running_requests: keys.max_running_requests,
            max_total_tokens: keys.max_total_tokens,
        })
    }

    /// The keys that say what a worker's engine is, beyond its address: a file worker's and a pool's
    /// `template` for discovered workers.
    /// `loads_url` is the worker's (none for a template), checked with the load source against
    /// `engine`.
    pub(super) fn engine_keys(
        &mut self,
        map: &Map,
        loads_url: Field<String>,
        engine: Option<Engine>,
    ) -> EngineKeys {
        let load_source = self.opt(map, "load_source", |v, node, at| {
            v.keyword(
                node,
                at,
                &[LoadSource::Metrics, LoadSource::Loads],
                LoadSource::as_str,
            )
        });
        let role = self.opt(map, "role", |v, node, at| {
            v.keyword(
                node,
                at,
                &[Role::Prefill, Role::Decode, Role::Both],
                Role::as_str,
            )
        });
        let dp_size = self.opt(map, "dp_size", Self::integer);
        let dp_size = self.check(
            with_default(dp_size, WorkerConfig::DEFAULT_DP_SIZE.into()),
            |n| {
                at_least_one_u32(n).and_then(|size| {
                    if size.get() > WorkerConfig::MAX_DP_SIZE {
                        Err(format!(
                            "must be at most {}: the scraper keeps a sample per rank",
                            WorkerConfig::MAX_DP_SIZE
                        ))
                    } else {
                        Ok(size)
                    }
                })
            },
        );
        let max_running_requests = self.opt(map, "max_running_requests", Self::integer);
        let max_running_requests = self.check_opt(max_running_requests, at_least_one);
        let max_total_tokens = self.opt(map, "max_total_tokens", Self::integer);
        let max_total_tokens = self.check_opt(max_total_tokens, at_least_one);
        let value = |field: Field<NonZeroU64>| field.map(|given| given.map(|given| given.value));
        let (load_source, loads_url) = self.load_source(
            with_default(load_source, LoadSource::default()),
            loads_url,
            engine,
        );
        EngineKeys {
            load_source,
            loads_url,
            role: with_default(role, WorkerConfig::DEFAULT_ROLE).map(|role| role.value),
            dp_size,
            max_running_requests: value(max_running_requests),
            max_total_tokens: value(max_total_tokens),
        }
    }

    /// A worker's load source against its pool's engine, and its `loads_url` against the source; each
    /// check is skipped when a value it reads was rejected.
    fn load_source(
        &mut self,
        source: Res<Val<LoadSource>>,
        url: Field<String>,
        engine: Option<Engine>,
    ) -> (Res<LoadSource>, Res<Option<String>>) {
        let source = source.and_then(|source| match (source.value, engine) {
            (LoadSource::Loads, Some(engine)) if engine != Engine::Sglang => {
                let message = format!(
                    "load_source: loads reads SGLang's /v1/loads; engine {} has no such endpoint",
                    engine.as_str()
                );
                Err(self.report(Phase::Cross, source.at, message))
            }
            _ => Ok(source.value),
        });
        let url = url.and_then(|url| match (url, source) {
            (Some(url), Ok(LoadSource::Metrics)) => Err(self.report(
                Phase::Cross,
                url.at,
                "loads_url is read only with load_source: loads",
            )),
            (url, _) => Ok(url.map(|url| url.value)),
        });
        (source, url)
    }
}
