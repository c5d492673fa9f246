//! Issue 45's bar for a learned prefill rate, shared by the real engine's test and the simulator's.

/// Each learned rate is within 2× of what its worker measured itself, and the first two workers'
/// learned rates stand to each other as their own measurements do, within 25%: the picker tells two
/// workers apart exactly as far as they differed. (Identical engines need not measure alike: two CPU
/// vLLMs sharing two cores under the same traffic have measured 27% apart, and the picker learned each
/// within 0.2% of its own.) `workers` names them in the messages ("engines", "workers").
pub fn assert_learned_like_measured(learned: &[f64], measured: &[f64], workers: &str) {
    assert_eq!(learned.len(), measured.len(), "one learned rate per worker");
    for (learned, measured) in learned.iter().zip(measured) {
        assert!(
            (measured / 2.0..=measured * 2.0).contains(learned),
            "learned {learned:.0} tokens/s, not within 2x of the {measured:.0} the {workers} measured"
        );
    }
    let learned_ratio = learned[0] / learned[1];
    let measured_ratio = measured[0] / measured[1];
    assert!(
        (0.8..=1.25).contains(&(learned_ratio / measured_ratio)),
        "the {workers} measured {measured:.0?} and the picker learned {learned:.0?}: their ratios \
         ({measured_ratio:.2}, {learned_ratio:.2}) are more than 25% apart"
    );
}
