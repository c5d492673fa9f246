//! The request path: body → pool → tokens → block hashes → owners → decision → commit, and the answer.
//!
//! - [`picker`](Picker): per pool its configuration, load, tokenizer and owner index; `prepare` (body →
//!   owners) and, on one load snapshot taken per request ([`Pinned`]), the subset mapping, the decision,
//!   the commit and the endpoints.
//! - [`Service`]: one call per request between the wire and the picker — prepare, decide, commit, count,
//!   log — answering [`Answer::Route`] or [`Answer::Refuse`] in domain terms; every refusal carries a
//!   [`RefusalReason`].
//! - [`admission`]: decision slots, the bounded queue in front of them, the decision deadline and the
//!   [`CommitGate`] that keeps a late or cancelled decision from committing; explain's share and rate;
//!   the global body budget.
//! - [`credit`](Credit): a commit's credit kept until Envoy reports who served the request and with
//!   what status, then confirmed, moved to the worker that served, or retracted ([`Picker::settle`],
//!   in `settle`).
//! - [`Prepared`]: the request as the picker prepared it (pool, tokens, blocks, owners).
//! - [`Explanation`]: what `cachepick explain` and the debug endpoints report (its text form is in
//!   `crate::render`).
//!
//! Nothing here sees a protobuf type or a server: `extproc` translates answers to Envoy's, and `app`
//! adapts the service to the debug endpoints.
pub mod admission;
mod answer;
mod credit;
mod explain;
mod index;
mod log;
mod pd;
mod picker;
mod prepared;
mod service;
mod settle;
mod views;
mod warm;

pub use crate::protocol::RefusalReason;

/// The `tracing` target of the decision spans (`extproc`'s per-request span and the pipeline's steps
/// here): what an OpenTelemetry layer exports, whatever `RUST_LOG` says of the rest.
pub const TRACE_TARGET: &str = "cachepick::trace";
pub use admission::{Admission, AdmissionView, CommitGate};
pub use answer::{Answer, Commit, ExplainInput, Inbound, Moment, Refusal, Routed, Routing};
pub use credit::{Credit, ServedReport, Settled};
pub use explain::{Explanation, OwnerDepth};
pub use pd::{PdRoute, local_handoff};
pub use picker::{Allowance, Picker, PickerError, Pinned, RequestError};
pub use prepared::Prepared;
pub use service::Service;
pub use views::{PoolReport, SourceReport};
pub use warm::{Adopted, IndexSnapshot, PoolBlocks, SnapshotError};

#[cfg(test)]
mod tests;
