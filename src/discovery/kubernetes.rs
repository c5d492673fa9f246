//! The `kubernetes` source: ready Pods, watched. (Being built.)
