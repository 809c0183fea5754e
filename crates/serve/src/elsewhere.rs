//! Loops another driver holds (Temporal's), which the service lists, shows and changes beside
//! the file store's: what such a driver offers the front.

use std::path::PathBuf;

use anyhow::Result;

/// Loops that another driver holds (on Temporal, in a build with that feature): the service's
/// API and page list, show and change them beside the loops of its projects. The file driver
/// knows none of them; the binary gives the service one ([`crate::run`]).
#[async_trait::async_trait]
pub trait Elsewhere: Send + Sync {
    /// What the API says holds them (`temporal`).
    fn name(&self) -> &'static str;
    /// Every such loop: its project root and state.
    async fn loops(&self) -> Result<Vec<(PathBuf, loopd_core::state::LoopState)>>;
    /// Loop `id`'s project root and state; `None` when no such loop is there.
    async fn get(&self, id: &str) -> Result<Option<(PathBuf, loopd_core::state::LoopState)>>;
    /// Makes a change a person asks for; what the route answers (the file store's shape).
    async fn change(
        &self,
        id: &str,
        change: loopd_core::control::Change,
    ) -> Result<serde_json::Value>;
    /// Loop `id`'s events so far, oldest first, as the file store's event log holds them.
    async fn events(&self, id: &str) -> Result<Vec<serde_json::Value>>;
    /// The attempt loop `id` runs now and the last of its output, as the tail route answers
    /// (`{loop_id, in_flight, text}`).
    async fn tail(&self, id: &str) -> Result<serde_json::Value>;
}
