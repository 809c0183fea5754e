//! loopd's MCP server: the agent a person already uses (Claude Code, Codex, an IDE's) makes,
//! follows and changes loops through the Model Context Protocol, with the official SDK
//! ([`rmcp`]), over stdio (`loopd mcp`, [`run_stdio`]) or streamable HTTP (`/mcp` on `loopd
//! serve`, [`http`]).
//!
//! Theory of operation: a [`Server`] is one client's connection. It holds the drivers of the
//! front that made it, in order (the file store's first; on a service, the service's own), and
//! answers each tool with one of their methods ([`Driver`]), so the MCP server can do nothing a
//! front cannot: it passes no command anywhere, and a project's own files run only once trusted,
//! as for the command line. What the command line would refuse comes back as a tool error in its
//! one line. Every tool's schema is a handful of plain fields ([`tools`]).
//!
//! Resources: each loop's state (`loopd://loops/ID`) and its event log (`loopd://loops/ID/events`).
//! A subscription is a task that looks at the loop every [`LOOK`] and tells the client when its
//! state changed; it ends with the subscription or the connection.
//!
//! Which layer may use which: this crate uses the core's trait (and the executors' words for an
//! error, [`loopd_exec::result::without_dumps`]); the service and the binary give it their
//! drivers.

mod tools;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ListResourceTemplatesResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, Resource, ResourceContents, ResourceTemplate,
    ResourceUpdatedNotificationParam, ServerCapabilities, ServerConfig, SubscribeRequestParams,
    UnsubscribeRequestParams,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler, ServiceExt as _};
use tokio_util::sync::CancellationToken;

use loopd_core::driver::Driver;

/// How often a subscription looks at its loop.
pub const LOOK: Duration = Duration::from_millis(300);

/// The drivers a server asks, and where a loop is made when a call names no project.
#[derive(Clone)]
pub struct Front {
    pub drivers: Arc<[Arc<dyn Driver>]>,
    /// The project a new loop goes to when `create_loop` names none (the one `loopd mcp` was
    /// started in, or a service's only one).
    pub home: Option<PathBuf>,
}

/// One client's connection.
pub struct Server {
    front: Front,
    /// The subscriptions by resource URI, each ended by its token.
    subscriptions: Mutex<HashMap<String, CancellationToken>>,
}

impl Server {
    pub fn new(front: Front) -> Server {
        Server {
            front,
            subscriptions: Mutex::default(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let subscriptions = self.subscriptions.get_mut();
        for (_, token) in subscriptions.unwrap_or_else(|e| e.into_inner()).drain() {
            token.cancel();
        }
    }
}

/// Serves `front` over stdin and stdout until the client goes, on a runtime of its own.
///
/// This and [`http`] are the crate's only doors, and neither is generic nor async: the SDK's code
/// is compiled here once, not again in each crate that serves (a release build spent 24 s more
/// in each of the service and the binary when they instantiated it themselves).
pub fn run_stdio(front: Front) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let running = Server::new(front).serve(rmcp::transport::stdio()).await?;
        running.waiting().await?;
        Ok(())
    })
}

/// The streamable HTTP service of `front` (a server for each session), for any path it is
/// mounted at, which accepts only the `Host`s that name this machine's loopback (what a DNS
/// rebinding would not send); `stop` ends every session.
pub fn http(front: Front, stop: CancellationToken) -> axum::Router {
    let config = StreamableHttpServerConfig::default().with_cancellation_token(stop);
    let service: StreamableHttpService<Server, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(Server::new(front.clone())),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    axum::Router::new().fallback_service(service)
}

/// A loop's state as a resource, and its events.
fn state_uri(id: &str) -> String {
    format!("loopd://loops/{id}")
}

fn events_uri(id: &str) -> String {
    format!("loopd://loops/{id}/events")
}

/// The loop a resource URI names, and whether it names its events.
fn parse_uri(uri: &str) -> Option<(&str, bool)> {
    let rest = uri.strip_prefix("loopd://loops/")?;
    match rest.split_once('/') {
        None => Some((rest, false)),
        Some((id, "events")) => Some((id, true)),
        Some(_) => None,
    }
}

impl ServerHandler for Server {
    fn get_info(&self) -> ServerConfig {
        let capabilities = ServerCapabilities::builder()
            .enable_tools()
            .enable_resources()
            .enable_resources_subscribe()
            .build();
        ServerConfig::new(capabilities)
            .with_server_info(rmcp::model::Implementation::new(
                "loopd",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(
                "loopd runs coding agents in loops. create_loop starts one; wait_for_loop follows \
                 it to its end or to the point where it needs a person; loop_diff shows what it \
                 changed.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> std::result::Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools::all()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> std::result::Result<CallToolResponse, ErrorData> {
        let arguments = request.arguments.unwrap_or_default();
        Ok(tools::call(&self.front, &request.name, arguments, &context)
            .await
            .into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> std::result::Result<ListResourcesResult, ErrorData> {
        let mut resources = Vec::new();
        for driver in self.front.drivers.iter() {
            let listed = driver.list().await.map_err(internal)?;
            for l in listed {
                let title = l.state.as_ref().map_or("", |s| s.title.as_str());
                resources.push(
                    Resource::new(state_uri(&l.id), format!("loop {}", l.id))
                        .with_description(format!("{title}: its state"))
                        .with_mime_type("application/json"),
                );
                resources.push(
                    Resource::new(events_uri(&l.id), format!("loop {} events", l.id))
                        .with_description(format!("{title}: its events, one JSON line each"))
                        .with_mime_type("application/jsonl"),
                );
            }
        }
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> std::result::Result<ListResourceTemplatesResult, ErrorData> {
        Ok(ListResourceTemplatesResult::with_all_items(vec![
            ResourceTemplate::new("loopd://loops/{id}", "loop state")
                .with_mime_type("application/json"),
            ResourceTemplate::new("loopd://loops/{id}/events", "loop events")
                .with_mime_type("application/jsonl"),
        ]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> std::result::Result<ReadResourceResponse, ErrorData> {
        let uri = request.uri;
        let Some((id, events)) = parse_uri(&uri) else {
            return Err(ErrorData::resource_not_found(
                format!("no resource {uri}"),
                None,
            ));
        };
        let text = match events {
            false => tools::state_text(&self.front, id).await,
            true => tools::events_text(&self.front, id).await,
        }
        .map_err(|e| ErrorData::resource_not_found(format!("{e:#}"), None))?;
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, uri)]).into())
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> std::result::Result<(), ErrorData> {
        let uri = request.uri;
        let Some((id, _)) = parse_uri(&uri) else {
            return Err(ErrorData::resource_not_found(
                format!("no resource {uri}"),
                None,
            ));
        };
        let first = tools::state_text(&self.front, id)
            .await
            .map_err(|e| ErrorData::resource_not_found(format!("{e:#}"), None))?;
        let token = CancellationToken::new();
        let old = self
            .subscriptions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uri.clone(), token.clone());
        if let Some(old) = old {
            old.cancel();
        }
        let (front, peer, id) = (self.front.clone(), context.peer, id.to_owned());
        tokio::spawn(async move {
            let mut last = first;
            loop {
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(LOOK) => {}
                }
                let Ok(now) = tools::state_text(&front, &id).await else {
                    continue;
                };
                if now != last {
                    last = now;
                    let told = ResourceUpdatedNotificationParam::new(uri.clone());
                    if peer.notify_resource_updated(told).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(())
    }

    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> std::result::Result<(), ErrorData> {
        let ended = self
            .subscriptions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&request.uri);
        if let Some(token) = ended {
            token.cancel();
        }
        Ok(())
    }
}

fn internal(e: anyhow::Error) -> ErrorData {
    ErrorData::internal_error(format!("{e:#}"), None)
}
