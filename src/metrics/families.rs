//! A group of metric families registered as one collector: their descriptions and their samples, read
//! off the group's members in order.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;

/// The descriptions of every member of `group`, in order.
pub(super) fn descs<'a>(group: &[&'a dyn Collector]) -> Vec<&'a Desc> {
    group.iter().flat_map(|member| member.desc()).collect()
}

/// The samples of every member of `group`, in order.
pub(super) fn samples(group: &[&dyn Collector]) -> Vec<MetricFamily> {
    group.iter().flat_map(|member| member.collect()).collect()
}
