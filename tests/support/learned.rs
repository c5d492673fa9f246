//! Issue 45's bar for a learned prefill rate, shared by the real engine's test and the simulator's.

/// Each learned rate is within 2× of what its worker measured itself, and the first two workers,
/// identical and under the same traffic, learned rates within 25% of each other. `workers` names
/// them in the messages ("engines", "workers").
pub fn assert_learned_like_measured(learned: &[f64], measured: &[f64], workers: &str) {
    assert_eq!(learned.len(), measured.len(), "one learned rate per worker");
    for (learned, measured) in learned.iter().zip(measured) {
        assert!(
            (measured / 2.0..=measured * 2.0).contains(learned),
            "learned {learned:.0} tokens/s, not within 2x of the {measured:.0} the {workers} measured"
        );
    }
    let (low, high) = (learned[0].min(learned[1]), learned[0].max(learned[1]));
    assert!(
        high <= low * 1.25,
        "two identical {workers} learned {learned:.0?}: more than 25% apart"
    );
}
