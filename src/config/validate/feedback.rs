//! The `feedback:` section: whether a routed request's credit waits for Envoy's report of what was
//! served, and how long.

use super::Validator;
use crate::config::FeedbackConfig;
use cachepick_decode::{Decode, Map, Res, with_default};

const FEEDBACK_KEYS: &[&str] = &["enabled", "wait"];

impl Validator<'_> {
    /// `feedback:` (all defaults when absent).
    pub(super) fn feedback(&mut self, root: &Map) -> Res<FeedbackConfig> {
        let map = self.section(root, "feedback", FEEDBACK_KEYS)?;
        let defaults = FeedbackConfig::default();
        let enabled = self.opt(&map, "enabled", Self::boolean);
        let enabled = with_default(enabled, defaults.enabled);
        let wait = self.positive_duration(&map, "wait", defaults.wait);
        Ok(FeedbackConfig {
            enabled: enabled?.value,
            wait: wait?.value,
        })
    }
}
