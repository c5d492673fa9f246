//! `cachepick.v1.Admin` (`proto/cachepick/v1/admin.proto`): cachepick's own gRPC admin API, served on
//! `listen` beside ext_proc, so an operator can ask a running picker with standard gRPC tools where a
//! body would go (`Explain`), what load it sees (`Snapshot`) and what configuration it runs (`Config`).
//!
//! The messages, server and client are generated at build time (`build.rs`: protox + tonic-prost-build,
//! no `protoc`). This module only translates: a request becomes a call on [`Service`], a domain
//! [`Explanation`] or [`PoolView`] becomes a message, a [`RequestError`] becomes a gRPC status.

use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use self::pb::admin_server::{Admin, AdminServer};
use crate::load::{PoolView, WorkerView};
use crate::policy::Outcome;
use crate::route::{AdmissionView, ExplainInput, Explanation, Refusal, Service};
use crate::worker::WorkerId;

/// The generated `cachepick.v1` package: messages, `admin_server` and `admin_client`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/cachepick.v1.rs"));
}

/// The encoded `FileDescriptorSet` of `cachepick.v1`, with its comments, for gRPC server reflection.
pub(crate) const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/cachepick_v1_descriptor.bin"));

/// The path an `ExplainRequest` without one is explained for.
pub(crate) const DEFAULT_PATH: &str = "/v1/chat/completions";

/// The admin service over `service`. Explain accepts a body as large as ext_proc does.
pub(super) fn server(service: Arc<Service>) -> AdminServer<AdminApi> {
    let max_message = service
        .max_body_bytes()
        .saturating_add(super::MESSAGE_OVERHEAD);
    AdminServer::new(AdminApi { service }).max_decoding_message_size(max_message)
}

/// gRPC server reflection describes the admin API and gRPC health, so `grpcurl list` and `describe`
/// work without the proto files. The builders below give `None` (logged) if a descriptor set cannot be
/// decoded, which would be a build defect: the picker then serves everything but reflection.
fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Reflection `grpc.reflection.v1` (grpcurl 1.8.8 and later).
pub(super) fn reflection_v1() -> Option<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
> {
    reflection_builder()
        .build_v1()
        .inspect_err(|error| tracing::warn!(%error, "gRPC reflection v1 not served"))
        .ok()
}

/// Reflection `grpc.reflection.v1alpha`, for older tools.
pub(super) fn reflection_v1alpha() -> Option<
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
> {
    reflection_builder()
        .build_v1alpha()
        .inspect_err(|error| tracing::warn!(%error, "gRPC reflection v1alpha not served"))
        .ok()
}

/// The `cachepick.v1.Admin` implementation.
pub struct AdminApi {
    service: Arc<Service>,
}

#[tonic::async_trait]
impl Admin for AdminApi {
    async fn explain(
        &self,
        request: Request<pb::ExplainRequest>,
    ) -> Result<Response<pb::ExplainResponse>, Status> {
        let request = request.into_inner();
        let path = match request.path.as_str() {
            "" => DEFAULT_PATH,
            path => path,
        };
        // Through admission (explain's own share of blocking threads, rate-limited), never on the
        // runtime: a multi-MB prompt would stall every ext_proc stream and the health service.
        let input = ExplainInput {
            path: path.to_owned(),
            body: request.body,
            content_encoding: Some(request.content_encoding).filter(|coding| !coding.is_empty()),
            tenant: request.tenant,
        };
        match self.service.explain_admitted(input).await {
            Ok(explanation) => Ok(Response::new(explain_response(&explanation))),
            Err(refusal) => Err(refused(&refusal)),
        }
    }

    async fn snapshot(
        &self,
        request: Request<pb::SnapshotRequest>,
    ) -> Result<Response<pb::SnapshotResponse>, Status> {
        let wanted = request.into_inner().pool;
        let pools = self.service.snapshot();
        let pools: Vec<PoolView> = match &wanted {
            None => pools,
            Some(wanted) => {
                let known: Vec<String> = pools.iter().map(|pool| pool.pool.clone()).collect();
                let found: Vec<PoolView> = pools
                    .into_iter()
                    .filter(|pool| &pool.pool == wanted)
                    .collect();
                if found.is_empty() {
                    return Err(Status::not_found(format!(
                        "no pool {wanted:?}; pools: {}",
                        known.join(", ")
                    )));
                }
                found
            }
        };
        Ok(Response::new(pb::SnapshotResponse {
            pools: pools.iter().map(pool_snapshot).collect(),
            admission: Some(admission(&self.service.admission_view())),
        }))
    }

    async fn config(
        &self,
        _request: Request<pb::ConfigRequest>,
    ) -> Result<Response<pb::ConfigResponse>, Status> {
        Ok(Response::new(pb::ConfigResponse {
            yaml: self.service.effective_config().as_str().to_owned(),
        }))
    }
}

/// A refusal as the admin API answers it: the gRPC code of its reason (`answer::grpc_code`, the one
/// mapping), its message, and its stable label in the `x-cachepick-refusal-reason` metadata.
fn refused(refusal: &Refusal) -> Status {
    let reason = refusal.reason;
    let mut status = Status::new(super::answer::grpc_code(reason), refusal.message.clone());
    status.metadata_mut().insert(
        super::REFUSAL_HEADER,
        MetadataValue::from_static(reason.as_str()),
    );
    status
}

fn endpoint(endpoints: &[String], id: WorkerId) -> String {
    endpoints
        .get(id.index())
        .cloned()
        .unwrap_or_else(|| id.to_string())
}

/// A domain explanation as the wire reports it.
pub(crate) fn explain_response(explanation: &Explanation) -> pb::ExplainResponse {
    let prepared = &explanation.prepared;
    let endpoints = &explanation.endpoints;
    let outcome = match &explanation.outcome {
        Outcome::Route(decision) => pb::explain_response::Outcome::Decision(pb::Decision {
            reason: decision.reason.as_str().to_owned(),
            selected: endpoint(endpoints, decision.selected),
            fallbacks: decision
                .fallbacks
                .iter()
                .map(|id| endpoint(endpoints, *id))
                .collect(),
            matched_tokens: decision.matched_tokens,
            diverted_tokens: decision.diverted_tokens(),
        }),
        Outcome::Refuse(refused) => pb::explain_response::Outcome::Refusal(pb::Refusal {
            reason: refused.reason.as_str().to_owned(),
        }),
    };
    pb::ExplainResponse {
        pool: prepared.pool_label.clone(),
        model: prepared.model.clone(),
        prompt_tokens: prepared.prompt_tokens,
        block_size: explanation.block_size,
        full_blocks: prepared.block_hashes.len() as u64,
        owners: prepared
            .owners
            .iter()
            .map(|owner| pb::Owner {
                endpoint: endpoint(endpoints, owner.worker),
                matched_tokens: owner.matched_tokens,
            })
            .collect(),
        outcome: Some(outcome),
        trace_json: serde_json::to_string(explanation.outcome.trace()).unwrap_or_default(),
        endpoints: endpoints.clone(),
        label: explanation.decision.to_owned(),
        passthrough: explanation.passthrough,
    }
}

/// Admission as the wire reports it.
fn admission(view: &AdmissionView) -> pb::Admission {
    let wide = |count: usize| u64::try_from(count).unwrap_or(u64::MAX);
    let counts = |counts: &[(&str, u64)]| {
        counts
            .iter()
            .map(|(reason, count)| ((*reason).to_owned(), *count))
            .collect()
    };
    pb::Admission {
        decision_slots: wide(view.decision_slots),
        in_flight: wide(view.in_flight),
        queued: wide(view.queued),
        max_queued: wide(view.max_queued),
        decision_deadline_ms: view.decision_deadline_ms,
        per_decision_us: view.per_decision_us,
        buffered_bytes: wide(view.buffered_bytes),
        max_buffered_bytes: wide(view.max_buffered_bytes),
        explain_slots: wide(view.explain_slots),
        shed: counts(&view.shed),
        commits_refused: counts(&view.commits_refused),
    }
}

/// A pool's view as the wire reports it.
pub(crate) fn pool_snapshot(pool: &PoolView) -> pb::PoolSnapshot {
    pb::PoolSnapshot {
        pool: pool.pool.clone(),
        version: pool.version,
        freshness_seconds: pool.freshness_seconds,
        workers: pool.workers.iter().map(worker_load).collect(),
    }
}

fn worker_load(worker: &WorkerView) -> pb::WorkerLoad {
    pb::WorkerLoad {
        endpoint: worker.endpoint.clone(),
        role: worker.role.to_owned(),
        fresh: worker.fresh,
        why_not_fresh: worker.why_not_fresh.clone(),
        waiting: worker.waiting,
        running: worker.running,
        waiting_uncached_tokens: worker.waiting_uncached_tokens,
        used_tokens: worker.used_tokens,
        max_total_tokens: worker.max_total_tokens,
        max_running: worker.max_running,
        kv_usage: worker.kv_usage,
        age_seconds: worker.age_seconds,
        scrapes: worker.scrapes,
        last_outcome: worker
            .last_outcome
            .map(|outcome| outcome.as_str().to_owned()),
        last_error: worker.last_error.clone(),
        state: worker.state.to_owned(),
        restarts: worker.restarts,
        id: worker.id,
        engine_block: worker.engine_block,
        prefill_tokens_per_second: worker.prefill.prefill_tokens_per_second,
        drain_tokens_per_second: worker.prefill.drain_tokens_per_second,
        engine_queue_wait_seconds: worker.prefill.queue_wait_us.map(|us| us as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;
    use crate::load::ScrapeOutcome;
    use crate::policy::{
        Admission, Decision, Gate, OwnerVerdict, Reason, RefuseReason, Refused, Rung, Trace,
    };
    use crate::prefix::OwnerMatch;
    use crate::route::Prepared;

    fn prepared() -> Prepared {
        Prepared {
            pool: 0,
            pool_label: "m".to_owned(),
            model: Some("m".to_owned()),
            prompt_tokens: 70,
            max_output_tokens: None,
            block_hashes: vec![1, 2, 3, 4],
            owners: vec![
                OwnerMatch {
                    worker: WorkerId(1),
                    matched_tokens: 64,
                },
                OwnerMatch {
                    worker: WorkerId(0),
                    matched_tokens: 32,
                },
            ],
        }
    }

    fn endpoints() -> Vec<String> {
        vec![
            "10.0.0.1:8000".to_owned(),
            "10.0.0.2:8000".to_owned(),
            "10.0.0.3:8000".to_owned(),
        ]
    }

    #[test]
    fn a_decision_names_workers_by_endpoint_and_keeps_the_trace_as_json() {
        let trace = Trace {
            snapshot_version: 7,
            fleet: 3,
            owners: vec![OwnerVerdict {
                worker: WorkerId(1),
                matched_tokens: 64,
                gate: Gate::Queued { waiting: 9 },
                admission: Admission::Admitted,
            }],
            rung: Rung::OffOwnerGateAndAdmission,
            ..Trace::default()
        };
        let explanation = Explanation {
            decision: "cache_worker_queued",
            passthrough: false,
            depth_sources: None,
            decode: None,
            local_prefill: None,
            owner_depth: None,
            workers: Vec::new(),
            tiers: Vec::new(),
            prepared: prepared(),
            block_size: 16,
            outcome: Outcome::Route(Decision {
                selected: WorkerId(2),
                fallbacks: vec![WorkerId(0), WorkerId(1)],
                reason: Reason::CacheWorkerQueued,
                matched_tokens: 0,
                trace,
            }),
            endpoints: endpoints(),
        };
        let response = explain_response(&explanation);
        assert_eq!(response.pool, "m");
        assert_eq!(response.model.as_deref(), Some("m"));
        assert_eq!(response.prompt_tokens, 70);
        assert_eq!(response.block_size, 16);
        assert_eq!(response.full_blocks, 4);
        assert_eq!(
            response.owners,
            vec![
                pb::Owner {
                    endpoint: "10.0.0.2:8000".to_owned(),
                    matched_tokens: 64,
                },
                pb::Owner {
                    endpoint: "10.0.0.1:8000".to_owned(),
                    matched_tokens: 32,
                },
            ]
        );
        assert_eq!(
            response.outcome,
            Some(pb::explain_response::Outcome::Decision(pb::Decision {
                reason: "cache_worker_queued".to_owned(),
                selected: "10.0.0.3:8000".to_owned(),
                fallbacks: vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()],
                matched_tokens: 0,
                diverted_tokens: Some(64),
            }))
        );
        assert_eq!(response.endpoints, endpoints());
        let trace: serde_json::Value =
            serde_json::from_str(&response.trace_json).expect("the trace is JSON");
        assert_eq!(trace["snapshot_version"], 7);
        assert_eq!(trace["rung"], "off_owner_gate_and_admission");
        assert_eq!(trace["owners"][0]["gate"]["verdict"], "queued");
        // The message survives the wire.
        let decoded =
            pb::ExplainResponse::decode(response.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded, response);
    }

    #[test]
    fn a_refusal_carries_its_reason_and_an_unknown_id_its_name() {
        let mut prepared = prepared();
        prepared.owners = vec![OwnerMatch {
            worker: WorkerId(9),
            matched_tokens: 16,
        }];
        let explanation = Explanation {
            decision: "no_workers",
            passthrough: false,
            depth_sources: None,
            decode: None,
            local_prefill: None,
            owner_depth: None,
            workers: Vec::new(),
            tiers: Vec::new(),
            prepared,
            block_size: 16,
            outcome: Outcome::Refuse(Refused {
                reason: RefuseReason::NoWorkers,
                trace: Trace::default(),
            }),
            endpoints: endpoints(),
        };
        let response = explain_response(&explanation);
        assert_eq!(
            response.outcome,
            Some(pb::explain_response::Outcome::Refusal(pb::Refusal {
                reason: "no_workers".to_owned(),
            }))
        );
        assert_eq!(response.owners[0].endpoint, "w9");
        let trace: serde_json::Value =
            serde_json::from_str(&response.trace_json).expect("the trace is JSON");
        assert_eq!(trace["rung"], "none");
    }

    /// A loaded worker's fields that cross to the wire unchanged, written once: the view is built with
    /// them and the message must carry them; the caller adds the fields whose types differ.
    macro_rules! loaded_worker {
        ($($kind:ident)::+ { $($differs:tt)* }) => {
            $($kind)::+ {
                endpoint: "10.0.0.1:8000".to_owned(),
                id: 0,
                restarts: 1,
                fresh: true,
                why_not_fresh: None,
                waiting: Some(2),
                running: Some(5),
                waiting_uncached_tokens: None,
                used_tokens: Some(500),
                max_total_tokens: Some(1000),
                max_running: Some(64),
                kv_usage: Some(0.5),
                age_seconds: Some(0.25),
                scrapes: 40,
                last_error: None,
                engine_block: Some(16),
                $($differs)*
            }
        };
    }

    #[test]
    fn a_pool_view_keeps_unknown_numbers_unset() {
        let pool = PoolView {
            pool: "m".to_owned(),
            version: 12,
            freshness_seconds: 3.0,
            workers: vec![
                loaded_worker!(WorkerView {
                    role: "both",
                    state: "healthy",
                    last_outcome: Some(ScrapeOutcome::Ok),
                    prefill: crate::load::PrefillEstimate {
                        prefill_tokens_per_second: Some(5_000),
                        drain_tokens_per_second: Some(900),
                        queue_wait_us: Some(250_000),
                        ..Default::default()
                    },
                }),
                WorkerView {
                    endpoint: "10.0.0.2:8000".to_owned(),
                    id: 1,
                    role: "decode",
                    state: "unreachable",
                    restarts: 0,
                    fresh: false,
                    why_not_fresh: Some("no reading yet: connection refused".to_owned()),
                    waiting: None,
                    running: None,
                    waiting_uncached_tokens: None,
                    used_tokens: None,
                    max_total_tokens: None,
                    max_running: None,
                    kv_usage: None,
                    age_seconds: None,
                    scrapes: 3,
                    last_outcome: Some(ScrapeOutcome::ConnectError),
                    last_error: Some("connection refused".to_owned()),
                    engine_block: None,
                    prefill: Default::default(),
                },
            ],
        };
        let snapshot = pool_snapshot(&pool);
        assert_eq!(snapshot.pool, "m");
        assert_eq!(snapshot.version, 12);
        assert_eq!(snapshot.freshness_seconds, 3.0);
        assert_eq!(
            snapshot.workers[0],
            loaded_worker!(pb::WorkerLoad {
                role: "both".to_owned(),
                state: "healthy".to_owned(),
                last_outcome: Some("ok".to_owned()),
                prefill_tokens_per_second: Some(5_000),
                drain_tokens_per_second: Some(900),
                engine_queue_wait_seconds: Some(0.25),
            })
        );
        let unread = &snapshot.workers[1];
        assert_eq!(unread.role, "decode");
        assert!(!unread.fresh);
        assert_eq!(
            unread.why_not_fresh.as_deref(),
            Some("no reading yet: connection refused")
        );
        assert_eq!((unread.waiting, unread.running), (None, None));
        assert_eq!(unread.last_outcome.as_deref(), Some("connect_error"));
        // Unset optionals stay unset on the wire (proto3 `optional`), not zero.
        let decoded = pb::WorkerLoad::decode(unread.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded.waiting, None);
        assert_eq!(decoded.kv_usage, None);
    }

    #[test]
    fn refused_bodies_map_to_grpc_codes() {
        use super::super::answer::grpc_code;
        use crate::protocol::RefusalReason;
        use tonic::Code;
        assert_eq!(grpc_code(RefusalReason::InvalidJson), Code::InvalidArgument);
        assert_eq!(grpc_code(RefusalReason::UnknownModel), Code::NotFound);
        assert_eq!(grpc_code(RefusalReason::TooLarge), Code::ResourceExhausted);
        assert_eq!(
            grpc_code(RefusalReason::ExplainRefused),
            Code::ResourceExhausted
        );
        assert_eq!(grpc_code(RefusalReason::TokenizerFailed), Code::Internal);
        assert_eq!(grpc_code(RefusalReason::NoWorkers), Code::Internal);
        assert_eq!(grpc_code(RefusalReason::QueueFull), Code::ResourceExhausted);
        assert_eq!(
            grpc_code(RefusalReason::StreamDeadline),
            Code::DeadlineExceeded
        );
        assert_eq!(grpc_code(RefusalReason::Cancelled), Code::Cancelled);
    }

    #[test]
    fn reflection_decodes_the_descriptor_sets() {
        assert!(reflection_v1().is_some());
        assert!(reflection_v1alpha().is_some());
        let text = String::from_utf8_lossy(FILE_DESCRIPTOR_SET);
        assert!(text.contains("cachepick.v1") && text.contains("ExplainRequest"));
        // Comments are kept, for `grpcurl describe`.
        assert!(text.contains("The picker's admin service."));
    }
}
