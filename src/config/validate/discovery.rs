//! Where a pool's workers come from: the file's `workers:` list, a DNS name (`dns:`) or Kubernetes
//! pods (`kubernetes:`), exactly one; and `template:`, what a discovered worker is beyond its address.
//!
//! A discovered worker gets the pool's template and its KV event sockets on its own IP at the pool's
//! `index` ports. `max_workers` bounds the slots a pool keeps for its workers (per-worker state is
//! allocated once, so a source that suddenly lists thousands of pods cannot grow the picker without
//! bound); the file's list must fit in it.

use std::num::NonZeroUsize;

use super::index::IndexDraft;
use super::{Validator, WorkerDraft};
use crate::config::{
    Discovery, DnsDiscovery, KubernetesDiscovery, PodSelection, PoolConfig, WorkerTemplate,
};
use crate::worker::Engine;
use cachepick_decode::{Decode, Map, Node, Phase, Place, Res};

const DNS_KEYS: &[&str] = &["name", "port", "interval", "server"];
const KUBERNETES_KEYS: &[&str] = &["namespace", "selector", "inference_pool", "ports"];
const TEMPLATE_KEYS: &[&str] = &[
    "load_source",
    "role",
    "dp_size",
    "max_running_requests",
    "max_total_tokens",
    "scrape_scheme",
];
const SOURCES: [&str; 3] = ["workers", "dns", "kubernetes"];

/// A pool's source of workers, decoded.
pub(super) struct SourceDraft {
    pub(super) discovery: Res<Discovery>,
    /// The file's workers; empty for a discovered pool.
    pub(super) workers: Res<Vec<Res<WorkerDraft>>>,
    pub(super) template: Res<WorkerTemplate>,
    pub(super) max_workers: Res<NonZeroUsize>,
}

impl Validator<'_> {
    pub(super) fn source(
        &mut self,
        pool: &Map,
        at: &Place,
        engine: Option<Engine>,
        index: &Res<IndexDraft>,
    ) -> SourceDraft {
        let given: Vec<&str> = SOURCES
            .into_iter()
            .filter(|key| pool.get(key).is_some())
            .collect();
        let template = self.template(pool, engine, index);
        let max_workers = self.positive_count(pool, "max_workers", PoolConfig::DEFAULT_MAX_WORKERS);
        let (discovery, workers) = match given.as_slice() {
            ["workers"] | [] => {
                let workers = self.workers(pool, engine, index);
                if let (Ok(workers), Ok(max)) = (&workers, &max_workers)
                    && workers.len() > max.get()
                {
                    let message = format!(
                        "{} workers listed, more than max_workers ({max})",
                        workers.len()
                    );
                    self.report(Phase::Structure, pool.place_of("workers").origin(), message);
                }
                if let Some((_, at)) = pool.get("template") {
                    self.report(
                        Phase::Cross,
                        at.origin(),
                        "template is read only for discovered workers (dns or kubernetes); give the file's \
                         workers their keys each",
                    );
                }
                (Ok(Discovery::Static), workers)
            }
            ["dns"] => (self.dns(pool).map(Discovery::Dns), Ok(Vec::new())),
            ["kubernetes"] => (
                self.kubernetes(pool).map(Discovery::Kubernetes),
                Ok(Vec::new()),
            ),
            several => {
                let message = format!(
                    "{} are given: a pool's workers come from exactly one of workers, dns or kubernetes",
                    several.join(" and ")
                );
                (
                    Err(self.report(Phase::Structure, at.origin(), message)),
                    Ok(Vec::new()),
                )
            }
        };
        if let (Ok(Discovery::Dns(_) | Discovery::Kubernetes(_)), Ok(template)) =
            (&discovery, &template)
            && !template.role.serves_prefill()
        {
            let message = "role decode for every discovered worker: every request to this pool would be refused";
            self.report(Phase::Cross, pool.place_of("template").origin(), message);
        }
        SourceDraft {
            discovery,
            workers,
            template,
            max_workers,
        }
    }

    fn dns(&mut self, pool: &Map) -> Res<DnsDiscovery> {
        let map = self.section(pool, "dns", DNS_KEYS)?;
        let name = self.required(&map, "name", Self::string);
        let port = self.required(&map, "port", Self::port);
        let interval = self.positive_duration(&map, "interval", DnsDiscovery::DEFAULT_INTERVAL);
        let server = self.opt(&map, "server", Self::address);
        Ok(DnsDiscovery {
            name: name?.value,
            port: port?.value,
            interval: interval?.value,
            server: server?.map(|server| server.value),
        })
    }

    fn kubernetes(&mut self, pool: &Map) -> Res<KubernetesDiscovery> {
        let map = self.section(pool, "kubernetes", KUBERNETES_KEYS)?;
        let namespace = self.opt(&map, "namespace", Self::string);
        let selector = self.opt(&map, "selector", Self::string);
        let inference_pool = self.opt(&map, "inference_pool", Self::string);
        let ports = match map.get("ports") {
            None => Ok(Vec::new()),
            Some((node, at)) => self.ports(node, &at),
        };
        let pods = match (selector?, inference_pool?) {
            (Some(selector), None) => Ok(PodSelection::Selector(selector.value)),
            (None, Some(pool)) => Ok(PodSelection::InferencePool(pool.value)),
            (Some(selector), Some(_)) => Err(self.report(
                Phase::Cross,
                selector.at,
                "selector and inference_pool are both given: the InferencePool's own selector chooses its pods",
            )),
            (None, None) => Err(self.report(
                Phase::Structure,
                map.place_of("selector").origin(),
                "missing: a label selector (selector) or an InferencePool's name (inference_pool)",
            )),
        };
        let ports = ports?;
        if matches!(pods, Ok(PodSelection::Selector(_))) && ports.is_empty() {
            return Err(self.report(
                Phase::Structure,
                map.place_of("ports").origin(),
                "missing: the engines' ports on each pod (an InferencePool names its targetPorts; a selector does not)",
            ));
        }
        Ok(KubernetesDiscovery {
            namespace: namespace?.map(|namespace| namespace.value),
            pods: pods?,
            ports,
        })
    }

    fn ports(&mut self, node: &Node, at: &Place) -> Res<Vec<u16>> {
        let items = self.list(node, at, "a list of ports")?;
        let ports: Vec<Res<u16>> = items
            .iter()
            .enumerate()
            .map(|(i, item)| self.port(item, &at.index(i, item.line)))
            .collect();
        ports.into_iter().collect()
    }

    fn template(
        &mut self,
        pool: &Map,
        engine: Option<Engine>,
        index: &Res<IndexDraft>,
    ) -> Res<WorkerTemplate> {
        let map = self.section(pool, "template", TEMPLATE_KEYS)?;
        let keys = self.engine_keys(&map, Ok(None), engine);
        let https = self.scrape_scheme(&map);
        let index = index.as_ref().map_err(|reported| *reported)?;
        Ok(WorkerTemplate {
            load_source: keys.load_source?,
            role: keys.role?,
            dp_size: keys.dp_size?.value,
            max_running_requests: keys.max_running_requests?,
            max_total_tokens: keys.max_total_tokens?,
            kv_events_port: index.port.value,
            kv_replay_port: index.replay_port.as_ref().map(|port| port.value),
            kv_events_from: index.config.kv_events_from(),
            scrape_https: https?,
        })
    }
}
