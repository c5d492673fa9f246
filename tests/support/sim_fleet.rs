//! The simulated fleet the tests stand the picker in front of: workers that are quick and the same on
//! every run, started within the exchange deadline.

use cachepick_sim::config::TokenizerConfig;
use cachepick_sim::fleet::Fleet;
use cachepick_sim::{Engine, SimConfig};

use super::sim_client::{DEADLINE, bounded};

/// `workers` simulated `engine` workers that tokenize bytes in blocks of 16, without jitter and at a
/// hundredth of their modelled time; a test changes what else it needs before starting them.
pub fn config(engine: Engine, workers: u32) -> SimConfig {
    let mut sim = SimConfig::new(engine, cachepick_rig::nz(workers));
    sim.tokenizer = TokenizerConfig::Bytes;
    sim.block_size = cachepick_rig::nz(16);
    sim.params.jitter = 0.0;
    sim.params.time_scale = 0.01;
    sim
}

/// The fleet of `sim`, up within [`DEADLINE`].
#[allow(dead_code)] // a test that starts a whole stage has the stage start its fleet
pub async fn start(sim: &SimConfig) -> Fleet {
    bounded("the fleet starts", DEADLINE, Fleet::start(sim))
        .await
        .expect("the fleet starts")
}
