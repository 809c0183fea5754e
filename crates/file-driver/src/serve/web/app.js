// The loopd dashboard: plain DOM, no build step. Text from loops (titles, summaries, agent
// output) is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);

/** An element with attributes and children (strings become text nodes). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

/** A call of the API; a refusal throws its one-line error. */
async function api(method, path, body) {
  const headers = { "X-Loopd-Request": "1" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const value = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(value.error || `${response.status} ${response.statusText}`);
  return value;
}

const loopPath = (id, root, tail = "") =>
  `/v1/loops/${encodeURIComponent(id)}${tail}?root=${encodeURIComponent(root)}`;

function badge(status, standing) {
  return el("span", { class: `badge ${status}` }, standing || status);
}

function ago(ts) {
  const s = Math.max(0, Math.round((Date.now() - Date.parse(ts)) / 1000));
  if (Number.isNaN(s)) return "";
  if (s < 60) return `${s}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ago`;
  return `${Math.floor(s / 3600)}h ago`;
}

function usageText(usage) {
  if (!usage) return "–";
  const tokens = (usage.input_tokens || 0) + (usage.output_tokens || 0);
  return `${tokens.toLocaleString()} tok · $${(usage.cost_usd || 0).toFixed(2)}`;
}

// What a loop's view says it spent, and the sum of two.
const nothingSpent = { tokens: 0, cost_usd: 0, today_tokens: 0, today_cost_usd: 0 };
function addSpent(a, b) {
  const sum = {};
  for (const key of Object.keys(nothingSpent)) sum[key] = (a[key] || 0) + (b[key] || 0);
  return sum;
}

function spentText(s) {
  return `today ${s.today_tokens.toLocaleString()} tok · $${s.today_cost_usd.toFixed(2)}; ` +
    `overall ${s.tokens.toLocaleString()} tok · $${s.cost_usd.toFixed(2)}`;
}

// ---- Overview ---------------------------------------------------------------------------------

let service = null;

async function loadService() {
  service = await api("GET", "/v1/service");
  $("summary").textContent = `${service.summary} · ${service.roots.length} project(s)`;
  for (const select of [$("filter-project"), $("create-root")]) {
    const keep = select.value;
    const first = select.id === "filter-project" ? [el("option", { value: "" }, "any")] : [];
    select.replaceChildren(...first, ...service.roots.map((r) => el("option", { value: r }, r)));
    if (keep) select.value = keep;
  }
}

async function loadOverview() {
  await loadService();
  const loops = await api("GET", "/v1/loops");
  const status = $("filter-status").value;
  const project = $("filter-project").value;
  const rows = loops
    .filter((l) => (!status || l.status === status) && (!project || l.root === project))
    .map((l) => {
      const v = l.view || {};
      const link = el("a", { href: `#/loop/${encodeURIComponent(v.loop_id)}?root=${encodeURIComponent(l.root)}` },
        v.title || v.loop_id);
      const last = l.last_event ? `${l.last_event.event} ${ago(l.last_event.ts)}` : "";
      return el("tr", { "data-loop": v.loop_id },
        el("td", {}, l.root.split("/").pop()),
        el("td", { class: "title" }, link),
        el("td", {}, v.workflow || ""),
        el("td", {}, badge(l.status, v.standing)),
        el("td", {}, `${v.iteration ?? 0}/${v.max_iterations ?? "?"}`),
        el("td", {}, v.action || ""),
        el("td", {}, usageText(l.usage)),
        el("td", {}, `${l.errors ?? 0}/${l.max_errors ?? "?"}`),
        el("td", {}, last));
    });
  $("loops").tBodies[0].replaceChildren(...rows);
  $("empty").hidden = rows.length > 0;
  const byProject = new Map();
  for (const l of loops) {
    byProject.set(l.root, addSpent(byProject.get(l.root) || nothingSpent, (l.view || {}).spent || {}));
  }
  $("spent").replaceChildren(...[...byProject].map(([root, s]) =>
    el("li", { "data-root": root }, `${root.split("/").pop()}: ${spentText(s)}`)));
}

$("filters").addEventListener("change", () => loadOverview().catch(showError("create-error")));

$("create").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("create-error").textContent = "";
  const tasks = $("create-tasks").value.split("\n").map((t) => t.trim()).filter(Boolean);
  const body = {
    root: $("create-root").value,
    title: $("create-name").value,
    description: $("create-description").value,
    interactive: $("create-interactive").checked,
    tasks,
  };
  if ($("create-workflow").value) body.workflow = $("create-workflow").value;
  try {
    const created = await api("POST", "/v1/loops", body);
    if ($("create-start").checked) await api("POST", loopPath(created.loop_id, created.root, "/resume"));
    $("create").reset();
    location.hash = `#/loop/${encodeURIComponent(created.loop_id)}?root=${encodeURIComponent(created.root)}`;
  } catch (e) {
    $("create-error").textContent = e.message;
  }
});

// ---- One loop ---------------------------------------------------------------------------------

let current = null; // { id, root, events: EventSource, tail: timer }

function showError(id) {
  return (e) => { $(id).textContent = e.message; };
}

function fill(list, items, render) {
  list.replaceChildren(...items.map((x) => el("li", {}, ...[].concat(render(x)))));
  if (!items.length) list.replaceChildren(el("li", { class: "muted" }, "none"));
}

async function loadDetail() {
  const { id, root } = current;
  loadTail().catch(() => {});
  const loop = await api("GET", loopPath(id, root));
  const state = loop.state || {};
  const skill = state.skill_state || {};
  const view = loop.view || {};
  $("detail-title").textContent = view.title || id;
  $("detail-status").replaceChildren(badge(loop.status, view.standing),
    ` iteration ${view.iteration}/${view.max_iterations}`,
    view.action ? ` · ${view.action}` : "",
    ` · errors ${loop.errors}/${loop.max_errors}`);
  // Only the controls that make sense now: no Resume on a loop that has completed (a person
  // raises its limit first), no Pause or Stop on one that is not going.
  $("btn-pause").hidden = !["running", "created"].includes(loop.status);
  $("btn-resume").hidden = !["paused", "created", "failed", "user_exit"].includes(loop.status);
  $("btn-stop").hidden = !["running", "paused", "created"].includes(loop.status);
  // Only the loop's own workflow's panels.
  const ccw = (view.workflow || "ccw-loop") === "ccw-loop";
  for (const panel of ["tasks", "validation", "hypotheses"]) $(panel).closest("section").hidden = !ccw;
  $("issues").closest("section").hidden = view.workflow !== "skill-tuning";

  const waiting = skill.awaiting_choice;
  $("next-form").hidden = !(skill.mode === "interactive" && waiting);
  if (waiting) {
    const keep = $("next-action").value;
    $("next-action").replaceChildren(...waiting.choices.map((c) => el("option", { value: c }, c)));
    $("next-action").value = waiting.choices.includes(keep) ? keep : (waiting.suggested || waiting.choices[0]);
  }
  const question = skill.question;
  const asking = question && !question.answer;
  $("answer-form").hidden = !asking;
  if (asking) $("question").textContent = `${question.action} asks: ${question.text}`;

  const dl = $("rows");
  dl.replaceChildren(...(view.rows || []).flatMap((r) => [
    el("dt", {}, r.label), el("dd", {}, [r.value, ...(r.lines || [])].join("\n")),
  ]));
  fill($("tasks"), (skill.develop && skill.develop.tasks) || [], (t) =>
    [el("strong", {}, t.id || ""), ` ${t.status || ""} — ${t.description || ""}`]);
  const v = skill.validate;
  $("validation").replaceChildren(v && v.last_run_at
    ? el("p", {}, `${v.passed ? "passed" : "not passed"} · pass rate ${v.pass_rate}%`,
      (v.failed_tests || []).length ? el("br") : null,
      (v.failed_tests || []).length ? `failed: ${v.failed_tests.join(", ")}` : null)
    : el("p", { class: "muted" }, "not validated yet"));
  fill($("hypotheses"), (skill.debug && skill.debug.hypotheses) || [], (h) =>
    `${h.id || ""} ${h.status || ""} — ${h.description || h.text || ""}`);
  const issues = skill.issues || [];
  $("issues").replaceChildren(
    el("p", {}, skill.quality_gate ? `gate: ${skill.quality_gate} · score ${skill.quality_score ?? "?"}` : "no gate yet"),
    el("ul", {}, ...issues.map((i) => el("li", {}, `${i.id} ${i.severity} ${i.category} — ${i.description}`))));
  fill($("errors"), skill.errors || [], (e) => `${e.timestamp} ${e.action}: ${e.message}`);
  $("usage").textContent = view.spent ? spentText(view.spent) : usageText(skill.usage);
  // The loop's budget, unless a person is editing it.
  if (!$("budget-form").dataset.editing) {
    $("budget-usd").value = state.max_cost_usd ?? "";
    $("budget-tokens").value = state.max_tokens ?? "";
  }
  fill($("history"), (skill.action_history || []).slice().reverse(), (h) =>
    `#${h.iteration} ${h.action}${h.task_id ? " " + h.task_id : ""} — ${h.outcome}` +
    `${h.summary ? ": " + h.summary : ""}${h.error ? " (" + h.error + ")" : ""} · ${h.started_at}`);
}

async function loadTail() {
  if (!current) return;
  const tail = await api("GET", loopPath(current.id, current.root, "/tail") + "&bytes=8192");
  $("tail").textContent = tail.in_flight
    ? `${tail.in_flight.action} (pid ${tail.in_flight.pid}) since ${tail.in_flight.started_at}\n\n${tail.text || ""}`
    : "nothing in flight";
}

function openDetail(id, root) {
  closeDetail();
  current = { id, root };
  $("detail-error").textContent = "";
  delete $("budget-form").dataset.editing;
  $("events").replaceChildren();
  const events = new EventSource(loopPath(id, root, "/events"));
  events.onmessage = (m) => {
    let e = {};
    try { e = JSON.parse(m.data); } catch { return; }
    const line = `${e.ts || ""} ${e.event || ""}${e.action ? " " + e.action : ""}` +
      `${e.summary ? " — " + e.summary : ""}${e.error ? " — " + e.error : ""}` +
      `${e.message ? " — " + e.message : ""}`;
    $("events").append(el("li", {}, line));
    $("events").scrollTop = $("events").scrollHeight;
  };
  current.events = events;
  current.tail = setInterval(() => loadTail().catch(() => {}), 1000);
  loadDetail().catch(showError("detail-error"));
  loadTail().catch(() => {});
}

function closeDetail() {
  if (!current) return;
  current.events.close();
  clearInterval(current.tail);
  current = null;
}

async function control(path, body) {
  $("detail-error").textContent = "";
  try {
    await api("POST", loopPath(current.id, current.root, path), body);
    await loadDetail();
  } catch (e) {
    $("detail-error").textContent = e.message;
  }
}

$("btn-pause").addEventListener("click", () => control("/pause"));
$("btn-resume").addEventListener("click", () => control("/resume"));
$("btn-stop").addEventListener("click", () => control("/stop"));
$("next-form").addEventListener("submit", (e) => {
  e.preventDefault();
  control("/next", { action: $("next-action").value });
});
$("answer-form").addEventListener("submit", (e) => {
  e.preventDefault();
  control("/answer", { text: $("answer-text").value }).then(() => { $("answer-text").value = ""; });
});
$("budget-form").addEventListener("input", () => { $("budget-form").dataset.editing = "1"; });
$("budget-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const body = {};
  if ($("budget-usd").value) body.max_cost_usd = Number($("budget-usd").value);
  if ($("budget-tokens").value) body.max_tokens = Number($("budget-tokens").value);
  delete $("budget-form").dataset.editing;
  control("/limits", body);
});
$("task-form").addEventListener("submit", (e) => {
  e.preventDefault();
  control("/tasks", { text: $("task-text").value }).then(() => { $("task-text").value = ""; });
});

// ---- Routing and live updates -----------------------------------------------------------------

function route() {
  const m = location.hash.match(/^#\/loop\/([^?]+)\?root=(.+)$/);
  $("overview").hidden = !!m;
  $("detail").hidden = !m;
  if (m) {
    const [id, root] = [decodeURIComponent(m[1]), decodeURIComponent(m[2])];
    if (!current || current.id !== id || current.root !== root) openDetail(id, root);
  } else {
    closeDetail();
    loadOverview().catch(showError("create-error"));
  }
}

// Every change of a served loop's state file comes on one stream; the page refreshes what it
// shows at most a few times a second.
let pending = null;
function changed() {
  if (pending) return;
  pending = setTimeout(() => {
    pending = null;
    const refresh = current ? loadDetail().then(loadService) : loadOverview();
    refresh.catch(() => {});
  }, 150);
}

const stream = new EventSource("/v1/stream");
stream.onmessage = changed;
window.addEventListener("hashchange", route);
route();
