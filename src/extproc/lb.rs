//! The `envoy.lb` dynamic metadata of the Endpoint Picker Protocol, both ways: the destination cachepick
//! writes beside its header, and the proxy's subset hint it reads.

use std::collections::HashMap;
use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use envoy_types::pb::google::protobuf::{Struct, Value, value};

use crate::protocol::{DESTINATION, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};
use crate::route::Routed;

/// Adds `envoy.lb/x-gateway-destination-endpoint`, the same value as the header, to a routed answer.
pub(super) fn with_metadata(
    routed: &Routed,
    mut response: ProcessingResponse,
) -> ProcessingResponse {
    let destination = Value {
        kind: Some(value::Kind::StringValue(routed.destination())),
    };
    let namespace = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), destination)]),
    };
    response.dynamic_metadata = Some(Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(value::Kind::StructValue(namespace)),
            },
        )]),
    });
    response
}

/// The proxy's subset hint: a comma-separated string or a list of strings of `ip:port`. Entries that
/// do not parse are skipped; a hint with none that parse allows nothing (so the request is a 503,
/// never routed outside what the proxy allowed).
pub(super) fn subset_hint(metadata: &Metadata) -> Option<Vec<SocketAddr>> {
    let hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_KEY)?;
    let mut endpoints = Vec::new();
    let mut push = |text: &str| {
        endpoints.extend(
            text.split(',')
                .filter_map(|entry| entry.trim().parse::<SocketAddr>().ok()),
        );
    };
    match &value.kind {
        Some(value::Kind::StringValue(text)) => push(text),
        Some(value::Kind::ListValue(list)) => {
            for item in &list.values {
                if let Some(value::Kind::StringValue(text)) = &item.kind {
                    push(text);
                }
            }
        }
        _ => {}
    }
    Some(endpoints)
}
