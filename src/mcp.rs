//! `loopd mcp`: loopd's MCP server over stdio, for the agent a person already uses. It works on
//! the loops of the project it starts in and of every project `create` or `start` recorded, as
//! the command line does: a loop it starts is taken by the running service where one runs (as
//! `loopd start` hands it over), else by a daemon of its own. Its changes are recorded as made
//! by the MCP server ([`loopd_file_driver::control::BY_MCP`]).

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use loopd_core::driver::Driver;
use loopd_file_driver::front::Files;
use loopd_file_driver::project::{Project, resolve_root};
use loopd_file_driver::service::ServiceInfo;

/// Serves until the client closes stdin; `others` are asked after the file store.
pub fn stdio(
    root: Option<&Path>,
    config: Option<&Path>,
    others: Vec<Arc<dyn Driver>>,
) -> Result<i32> {
    let home = resolve_root(root)?;
    let files = Files::by(loopd_file_driver::control::BY_MCP);
    let mut roots = vec![home.clone()];
    match loopd_file_driver::registry::list() {
        Ok(records) => roots.extend(records.into_iter().map(|r| r.root)),
        Err(e) => tracing::warn!("warning: cannot read your projects: {e}"),
    }
    roots.sort();
    roots.dedup();
    let mut served = Vec::new();
    for root in roots {
        let flag = (root == home).then_some(config).flatten();
        match Project::open_for_inspection(Some(&root), flag) {
            Ok(p) => {
                files.serve(Arc::new(p));
                served.push(root);
            }
            Err(e) => tracing::warn!("warning: cannot serve {}: {e:#}", root.display()),
        }
    }
    files.publish(ServiceInfo {
        roots: served,
        ..ServiceInfo::default()
    });
    let first: Arc<dyn Driver> = Arc::new(files);
    let front = loopd_mcp::Front {
        drivers: std::iter::once(first).chain(others).collect(),
        home: Some(home),
    };
    loopd_mcp::run_stdio(front)?;
    Ok(0)
}
