//! The loops on Temporal as a front asks for them ([`Driver`]): `loopd serve --temporal` lists,
//! shows, changes and follows them beside the file store's.

use std::path::Path;

use anyhow::Result;
use serde_json::{Value, json};

use loopd_core::control::Change;
use loopd_core::driver::{Driver, Events, Listed, Refused, Shown};
use loopd_core::state::LoopState;

use crate::{TemporalConfig, client};

/// The loops of one Temporal namespace.
pub struct Fleet {
    config: TemporalConfig,
    /// Connected at the first request, then kept for the others.
    client: tokio::sync::OnceCell<client::Client>,
}

impl Fleet {
    /// The loops at `config`'s address; nothing is connected before the first request.
    pub fn new(config: TemporalConfig) -> Fleet {
        Fleet {
            config,
            client: tokio::sync::OnceCell::new(),
        }
    }

    async fn client(&self) -> Result<&client::Client> {
        self.client
            .get_or_try_init(|| client::connect(&self.config))
            .await
    }

    /// Loop `id`'s state, where it is held here (in the project at `root`, when one is named).
    async fn held(
        &self,
        id: &str,
        root: Option<&Path>,
    ) -> Result<Option<(std::path::PathBuf, LoopState)>> {
        let held = client::held(self.client().await?, id).await?;
        Ok(held.filter(|(r, _)| root.is_none_or(|root| root == r)))
    }
}

#[async_trait::async_trait]
impl Driver for Fleet {
    fn name(&self) -> &'static str {
        "temporal"
    }

    async fn list(&self) -> Result<Vec<Listed>> {
        let seen =
            client::seen_all(self.client().await?, &self.config, None, client::LIST_WAIT).await?;
        Ok(seen
            .into_iter()
            .map(|(listed, state, still)| Listed {
                root: listed.project.into(),
                id: listed.loop_id,
                state: Ok(state),
                still,
            })
            .collect())
    }

    async fn show(&self, id: &str, root: Option<&Path>) -> Result<Option<Shown>> {
        let seen = client::seen(self.client().await?, &self.config, id).await?;
        let Some((root, state, still)) = seen.filter(|(r, ..)| root.is_none_or(|root| root == r))
        else {
            return Ok(None);
        };
        let Value::Object(raw) = serde_json::to_value(&state)? else {
            anyhow::bail!("loop {id}: its state is not an object");
        };
        Ok(Some(Shown {
            root,
            state,
            raw,
            still,
        }))
    }

    async fn change(&self, id: &str, root: Option<&Path>, change: Change) -> Result<Option<Value>> {
        if self.held(id, root).await?.is_none() {
            return Ok(None);
        }
        let at = loopd_core::state::format_ts(chrono::Utc::now());
        // What the workflow refuses, or why it cannot be asked, is the caller's to read.
        client::change(self.client().await?, &self.config, id, &change, &at)
            .await
            .map(Some)
            .map_err(|e| Refused(format!("{e:#}")).into())
    }

    /// The events so far: the follower asks again for those that come after.
    async fn events(&self, id: &str, root: Option<&Path>, after: u64) -> Result<Option<Events>> {
        if self.held(id, root).await?.is_none() {
            return Ok(None);
        }
        let all = client::events(self.client().await?, id).await?;
        let numbered = (1..)
            .zip(all)
            .skip(usize::try_from(after).unwrap_or(usize::MAX));
        Ok(Some(Events::SoFar(
            numbered.map(|(n, event)| (n, event.to_string())).collect(),
        )))
    }

    /// A batch's first attempt: a page follows one.
    async fn tail(&self, id: &str, root: Option<&Path>, _bytes: u64) -> Result<Option<Value>> {
        if self.held(id, root).await?.is_none() {
            return Ok(None);
        }
        let progress = client::progress(self.client().await?, id).await?;
        Ok(Some(match progress.into_iter().next() {
            Some(p) => json!({
                "loop_id": id,
                "in_flight": {
                    "action": p.action, "iteration": p.iteration, "attempt": p.attempt,
                    "tokens": p.tokens, "cost_usd": p.cost_usd,
                },
                "text": p.output,
            }),
            None => json!({ "loop_id": id, "in_flight": null, "text": null }),
        }))
    }
}
