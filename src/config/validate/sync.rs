//! The `replica_sync:` section: where this replica hears its peers' dispatches, and who they are.

use std::net::SocketAddr;

use super::Validator;
use crate::config::{PeerAddress, ReplicaSyncConfig};
use cachepick_decode::{Decode, Map, Node, Phase, Place, Res, at_least_one_u32, with_default};

const SYNC_KEYS: &[&str] = &[
    "listen",
    "peers",
    "key_file",
    "max_datagrams_per_second",
    "resolve_interval",
];
const PEER: &str = "ip:port or name:port such as 10.0.0.7:9104 or cachepick-peers.llm.svc:9104";

impl Validator<'_> {
    /// `replica_sync:`; `None` when the section is absent.
    pub(super) fn replica_sync(&mut self, root: &Map) -> Res<Option<ReplicaSyncConfig>> {
        if root.get("replica_sync").is_none() {
            return Ok(None);
        }
        let map = self.section(root, "replica_sync", SYNC_KEYS)?;
        let listen = self.required(&map, "listen", Self::address);
        let peers = self.required_list(&map, "peers", "peer address", |v, node, at| {
            v.peer(node, at).map(|address| (address, at.clone()))
        });
        let peers = peers.and_then(|(peers, _)| {
            let mut seen: Vec<PeerAddress> = Vec::new();
            let mut failed = None;
            for peer in peers {
                match peer {
                    Ok((address, _)) if !seen.contains(&address) => seen.push(address),
                    Ok((address, at)) => {
                        let message = format!("{address} is listed twice");
                        failed = Some(self.report(Phase::Value, at.origin(), message));
                    }
                    Err(reported) => failed = Some(reported),
                }
            }
            failed.map_or(Ok(seen), Err)
        });
        let rate = self.opt(&map, "max_datagrams_per_second", Self::integer);
        let rate = self.check(
            with_default(
                rate,
                u64::from(ReplicaSyncConfig::DEFAULT_MAX_DATAGRAMS_PER_SECOND),
            ),
            at_least_one_u32,
        );
        let key_file = self.opt(&map, "key_file", Self::path);
        let resolve = self.positive_duration(
            &map,
            "resolve_interval",
            ReplicaSyncConfig::DEFAULT_RESOLVE_INTERVAL,
        );
        let (listen, peers, key_file) = (listen?.value, peers?, key_file?.map(|file| file.value));
        if key_file.is_none() {
            self.require_key(&map, listen, &peers)?;
        }
        Ok(Some(ReplicaSyncConfig {
            listen,
            peers,
            key_file,
            max_datagrams_per_second: rate?.value,
            resolve_interval: resolve?.value,
        }))
    }

    /// Without `key_file` nothing but the source address vouches for a datagram, which only the
    /// kernel's refusal of loopback sources from the network makes true: anything but loopback needs
    /// the key.
    fn require_key(&mut self, map: &Map, listen: SocketAddr, peers: &[PeerAddress]) -> Res<()> {
        // A name is not loopback, `localhost` included: what it resolves to is not checked.
        let loopback = |peer: &PeerAddress| match peer {
            PeerAddress::Socket(address) => address.ip().is_loopback(),
            PeerAddress::Name { .. } => false,
        };
        let outside = std::iter::once(listen.to_string())
            .filter(|_| !listen.ip().is_loopback())
            .chain(
                peers
                    .iter()
                    .filter(|peer| !loopback(peer))
                    .map(ToString::to_string),
            )
            .collect::<Vec<_>>();
        let Some(first) = outside.first() else {
            return Ok(());
        };
        let message = format!(
            "replica_sync.key_file is required: {first}{} is not a loopback address, and without a \
             key anyone who can send a datagram from a listed address could steer routing (make \
             one with `openssl rand -hex 32 > sync.key` and give every replica the same file)",
            if outside.len() > 1 { " (and more)" } else { "" }
        );
        Err(self.report(Phase::Value, map.at.origin(), message))
    }

    fn peer(&mut self, node: &Node, at: &Place) -> Res<PeerAddress> {
        let text = self.text(node, at, PEER)?;
        PeerAddress::parse(text).ok_or_else(|| self.type_error(node, at, PEER))
    }
}
