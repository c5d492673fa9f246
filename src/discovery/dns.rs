//! The `dns` source: a name's A/AAAA records, re-resolved every `interval`. (Being built.)
