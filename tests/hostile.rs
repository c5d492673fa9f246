//! Hostile clients against the real binary: each module runs one attack and asserts its bound.

#[path = "hostile/served.rs"]
mod served;
