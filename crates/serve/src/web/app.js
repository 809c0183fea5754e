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

// The loop shown: { id, root, status, events, output, attempts, passRates, ... }.
let current = null;

function showError(id) {
  return (e) => { $(id).textContent = e.message; };
}

function fill(list, items, render, empty = "none") {
  list.replaceChildren(...items.map((x) => el("li", {}, ...[].concat(render(x)))));
  if (!items.length) list.replaceChildren(el("li", { class: "muted" }, empty));
}

// What a person can do next, in the page's own words.
const NEXT_STEP = {
  created: "This loop has not started yet: Resume starts it.",
  paused: "Paused: Resume goes on where it stopped.",
  user_exit: "Stopped: Resume goes on where it stopped; Retry also sets its error count to 0 " +
    "and makes its failed tasks pending again.",
  failed: "It failed: Retry sets its error count to 0, makes its failed tasks pending again and goes on.",
  completed: "Completed: nothing more to do here.",
};

async function loadDetail() {
  const shown = current;
  const loop = await api("GET", loopPath(shown.id, shown.root));
  // A reply for a loop no longer shown (the page moved on while it came) is dropped, or it
  // would paint the other loop over the one now open.
  if (current !== shown) return;
  const state = loop.state || {};
  const skill = state.skill_state || {};
  const view = loop.view || {};
  current.status = loop.status;
  current.driver = loop.driver;
  $("detail-title").textContent = view.title || shown.id;
  $("detail-status").replaceChildren(badge(loop.status, view.standing),
    ` iteration ${view.iteration}/${view.max_iterations}`,
    view.action ? ` · ${view.action}` : "",
    ` · errors ${loop.errors}/${loop.max_errors}`,
    // A loop that stands still says why, and what moves it on.
    view.status_reason ? el("div", { class: "still" }, `${view.status_reason} — next: ${view.next_step}`) : "");
  // Only the controls that make sense now: no Resume on a loop that has completed (a person
  // raises its limit first), Retry on one that failed, no Pause or Stop on one that is not going.
  // A loop that failed on its errors would fail again at once on a Resume: Retry resets them.
  const failed = loop.status === "failed" && skill.outcome === "failed";
  const ended = ["failed", "user_exit"].includes(loop.status);
  $("btn-pause").hidden = !["running", "created"].includes(loop.status);
  $("btn-resume").hidden = failed || !["paused", "created", "failed", "user_exit"].includes(loop.status);
  $("btn-retry").hidden = !ended || !!loop.driver;
  $("btn-stop").hidden = !["running", "paused", "created"].includes(loop.status);
  // A loop that met its goal runs no new task (`loopd task add` refuses it too).
  const passed = loop.status === "completed" && !["iteration_limit", "incomplete"].includes(skill.outcome);
  $("task-form").hidden = passed;
  showRunning();
  $("next-step").textContent = failed ? NEXT_STEP.failed
    : ended ? NEXT_STEP.user_exit : (NEXT_STEP[loop.status] || "");
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
    [el("strong", {}, t.id || ""), ` ${t.status || ""} — ${t.description || ""}`],
  "No tasks yet: add one with the form above.");
  const v = skill.validate;
  $("validation").replaceChildren(v && v.last_run_at
    ? el("p", {}, `${v.passed ? "passed" : "not passed"} · pass rate ${v.pass_rate}%`,
      (v.failed_tests || []).length ? el("br") : null,
      (v.failed_tests || []).length ? `failed: ${v.failed_tests.join(", ")}` : null)
    : el("p", { class: "muted" }, "Not validated yet: validate runs once the tasks are developed."));
  fill($("hypotheses"), (skill.debug && skill.debug.hypotheses) || [], (h) =>
    `${h.id || ""} ${h.status || ""} — ${h.description || h.text || ""}`, "No hypothesis: nothing was debugged.");
  const issues = skill.issues || [];
  $("issues").replaceChildren(
    el("p", {}, skill.quality_gate ? `gate: ${skill.quality_gate} · score ${skill.quality_score ?? "?"}` : "No gate yet: the first verification sets it."),
    el("ul", {}, ...issues.map((i) => el("li", {}, `${i.id} ${i.severity} ${i.category} — ${i.description}`))));
  fill($("errors"), skill.errors || [], (e) => `${e.timestamp} ${e.action}: ${e.message}`, "No errors.");
  $("usage").textContent = view.spent ? spentText(view.spent) : usageText(skill.usage);
  // The loop's budget, unless a person is editing it.
  if (!$("budget-form").dataset.editing) {
    $("budget-usd").value = state.max_cost_usd ?? "";
    $("budget-tokens").value = state.max_tokens ?? "";
  }
  // Without an event log (a loop another driver holds may have none yet), the state's own
  // window of attempts.
  current.fromState = (skill.action_history || []).map(fromHistory);
  if (!current.attempts.length) redraw();
}

// ---- Attempts: the history, the timeline, the charts -------------------------------------------

const ATTEMPT_EVENTS = ["action_finished", "action_failed", "action_interrupted"];
// What tasks developed at once leave in the history beside their attempts: each merge back into
// the loop's tree, each conflict, and each race's entries.
const MERGE_EVENTS = ["merged", "merge_conflict", "race_decided"];
// The most attempts the page keeps and draws; the history says when there were more.
const MAX_ATTEMPTS = 500;
const TIMELINE_BARS = 120;

/** An attempt as the page keeps it, from its event. */
function fromEvent(e) {
  return {
    iteration: e.iteration ?? 0, action: e.action || "?", attempt: e.attempt ?? 1,
    task_id: e.task_id, outcome: e.outcome || (e.event === "action_finished" ? "success" : "failed"),
    ts: e.ts, duration_ms: e.duration_ms,
    tokens: (e.tokens_in || 0) + (e.tokens_out || 0) + (e.tokens_cached || 0),
    cost_usd: e.cost_usd || 0, summary: e.summary || e.question, error: e.error || e.message,
    checkpoint: e.checkpoint && e.checkpoint.name,
  };
}

/** A merge, a conflict or a race's decision as the page keeps it, from its event. */
function fromMergeEvent(e) {
  const row = { iteration: e.iteration ?? 0, action: "merge", attempt: 1, task_id: e.task_id, ts: e.ts };
  if (e.event === "merged") {
    const c = e.checkpoint || {};
    return { ...row, outcome: "success", checkpoint: c.name,
      summary: `merged into the loop's tree (${c.files ?? 0} file(s), +${c.insertions ?? 0} -${c.deletions ?? 0})` };
  }
  if (e.event === "merge_conflict") {
    return { ...row, outcome: e.failed ? "failed" : "merge_conflict", error: e.error };
  }
  return { ...row, action: "race", outcome: e.winner ? "success" : "failed", winner: e.winner,
    race: (e.entries || []).map((r) => ({ executor: r.executor, outcome: r.outcome, pass_rate: r.pass_rate,
      checkpoint: r.checkpoint && r.checkpoint.name,
      changed: r.checkpoint ? `+${r.checkpoint.insertions} -${r.checkpoint.deletions}` : "" })) };
}

/** An attempt as the page keeps it, from the state's history window. */
function fromHistory(h) {
  const took = Date.parse(h.finished_at) - Date.parse(h.started_at);
  return {
    iteration: h.iteration, action: h.action, attempt: h.attempt, task_id: h.task_id,
    outcome: h.outcome, ts: h.finished_at || h.started_at,
    duration_ms: Number.isNaN(took) ? undefined : took,
    tokens: h.tokens || 0, cost_usd: h.cost_usd || 0, summary: h.summary, error: h.error,
    checkpoint: h.checkpoint && h.checkpoint.name, pass_rate: h.pass_rate,
  };
}

function outcomeClass(outcome) {
  if (outcome === "success") return "ok";
  if (["interrupted", "needs_input", "blocked"].includes(outcome)) return "idle";
  if (outcome === "rate_limited") return "wait";
  return "bad";
}

function seconds(ms) {
  if (ms === undefined || ms === null) return "";
  return ms < 10_000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms / 1000)} s`;
}

function attemptText(a) {
  if (a.race) {
    return `#${a.iteration} race on ${a.task_id || "the task"} — ` +
      (a.winner ? `${a.winner} won` : "no entry succeeded");
  }
  const spent = a.tokens ? ` · ${a.tokens.toLocaleString()} tok` : "";
  const cost = a.cost_usd ? ` · $${a.cost_usd.toFixed(2)}` : "";
  return `#${a.iteration} ${a.action}${a.task_id ? " " + a.task_id : ""}` +
    `${a.attempt > 1 ? " (attempt " + a.attempt + ")" : ""} — ${a.outcome}` +
    `${a.summary ? ": " + a.summary : ""}${a.error ? " (" + a.error + ")" : ""}` +
    `${a.duration_ms !== undefined ? " · " + seconds(a.duration_ms) : ""}${spent}${cost}`;
}

/** The attempts shown: those of the event log, else the state's window. */
function attempts() {
  return current.attempts.length ? current.attempts : current.fromState;
}

/** The pass rate of each iteration that was validated, in iteration order. */
function passRates() {
  const rates = new Map(current.passRates);
  if (!current.attempts.length) {
    for (const a of current.fromState) if (a.pass_rate !== undefined) rates.set(a.iteration, a.pass_rate);
  }
  return [...rates].sort((a, b) => a[0] - b[0]);
}

let redrawPending = null;
/** Draws the history and the charts again, at most ten times a second. */
function redraw() {
  if (redrawPending) return;
  redrawPending = setTimeout(() => {
    redrawPending = null;
    if (!current) return;
    drawHistory();
    drawCharts();
  }, 100);
}

function drawHistory() {
  const shown = attempts();
  const list = $("history");
  // The event log's rows are added, never redrawn, so that an open diff stays open; the state's
  // window slides, and is drawn anew.
  const source = current.attempts.length ? "events" : "state";
  if (list.dataset.source !== source || source === "state") {
    list.replaceChildren();
    list.dataset.source = source;
    current.drawn = 0;
  }
  for (const a of shown.slice(current.drawn)) list.prepend(historyRow(a));
  current.drawn = shown.length;
  if (!shown.length) {
    list.replaceChildren(el("li", { class: "muted" },
      current.status === "running" ? "The first action is running: its output shows above." : "No action yet."));
    current.drawn = 0;
    list.dataset.source = "";
  }
  $("history-title").textContent = current.dropped ? `History (the last ${shown.length})` : "History";
}

function historyRow(a) {
  const row = el("li", { class: `attempt ${outcomeClass(a.outcome)}`, "data-action": a.action },
    el("span", {}, attemptText(a)));
  if (a.race) {
    // The race's entries side by side, each with its own diff.
    const entries = el("div", { class: "race" }, ...a.race.map((r) => {
      const rate = typeof r.pass_rate === "number" ? `${r.pass_rate}% passed` : "not checked";
      const box = el("div", { class: `entry ${r.executor === a.winner ? "won" : ""}`, "data-executor": r.executor },
        el("strong", {}, r.executor), " ", el("span", {}, r.executor === a.winner ? "won" : r.outcome),
        el("div", { class: "muted" }, `${rate}${r.changed ? " · " + r.changed : ""}`));
      if (r.checkpoint && !current.driver) box.append(...diffButton(r.checkpoint));
      return box;
    }));
    row.append(entries);
    return row;
  }
  if (a.checkpoint && !current.driver) {
    const back = el("button", { type: "button", class: "small secondary",
      "data-rollback": a.checkpoint }, "Roll back here");
    back.addEventListener("click", () => rollback(a.checkpoint));
    const [diff, shown] = diffButton(a.checkpoint);
    row.append(" ", diff, " ", back, shown);
  }
  return row;
}

/** A button that shows checkpoint `name`'s diff, and the box it shows it in. */
function diffButton(name) {
  const diff = el("button", { type: "button", class: "small", "aria-expanded": "false",
    "data-checkpoint": name }, "Diff");
  const shown = el("div", { class: "diff", hidden: "" });
  diff.addEventListener("click", () => toggleDiff(name, diff, shown));
  return [diff, shown];
}

async function toggleDiff(name, button, box) {
  const open = button.getAttribute("aria-expanded") !== "true";
  button.setAttribute("aria-expanded", String(open));
  box.hidden = !open;
  if (!open || box.dataset.loaded) return;
  box.replaceChildren(el("p", { class: "muted" }, "loading…"));
  try {
    const diff = await api("GET", loopPath(current.id, current.root,
      `/checkpoints/${encodeURIComponent(name)}/diff`));
    box.dataset.loaded = "1";
    box.replaceChildren(...renderDiff(diff));
  } catch (e) {
    box.replaceChildren(el("p", { class: "error" }, e.message));
  }
}

/** A checkpoint's diff: each file with its hunks, lines as text only. */
function renderDiff(diff) {
  const parts = [];
  if (!diff.files.length) parts.push(el("p", { class: "muted" }, "This action changed no file."));
  for (const f of diff.files) {
    const name = f.old_path && f.old_path !== f.path ? `${f.old_path} → ${f.path}` : f.path;
    const pre = el("pre", { class: "hunks", tabindex: "0" });
    for (const h of f.hunks) {
      pre.append(el("span", { class: "hunk" }, h.header + "\n"));
      for (const line of h.lines) {
        const kind = line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "ctx";
        pre.append(el("span", { class: kind }, line + "\n"));
      }
    }
    const file = el("details", { open: "", class: "file" },
      el("summary", {}, `${name} · ${f.status} · +${f.insertions} −${f.deletions}`));
    if (f.hunks.length) file.append(pre);
    if (f.cut) file.append(el("p", { class: "muted" }, "…the rest of this file's changes is left out"));
    parts.push(file);
  }
  if (diff.cut) parts.push(el("p", { class: "muted" }, diff.cut));
  return parts;
}

async function rollback(name) {
  const asked = `Put the work tree of "${$("detail-title").textContent}" back as it was at ` +
    `checkpoint ${name}? What the actions after it changed is lost from the work tree.`;
  if (!window.confirm(asked)) return;
  $("detail-error").textContent = "";
  try {
    const done = await api("POST", loopPath(current.id, current.root, "/rollback"), { checkpoint: name });
    $("history-note").textContent =
      `The work tree is back as it was at checkpoint ${done.checkpoint} (${done.commit.slice(0, 12)}).`;
  } catch (e) {
    $("detail-error").textContent = e.message;
  }
}

// Inline SVG, drawn here: no library, nothing fetched.
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

/** A chart: its SVG, scaled to the width it is given, described for a screen reader. */
function chart(width, height, label, ...children) {
  return svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": label,
    preserveAspectRatio: "xMinYMin meet" }, svg("title", {}, label), ...children);
}

function drawCharts() {
  const all = attempts();
  const rates = passRates();
  $("over-time").hidden = !all.length;
  $("over-time-empty").hidden = !!all.length;
  $("over-time-empty").textContent = "No attempt yet: the pictures start with the first one.";
  if (!all.length) return;

  // The timeline: a lane per action (per task for the tasks' own), a bar per attempt, in order,
  // coloured by outcome; merges and conflicts on a lane of their own.
  const recent = all.filter((a) => !a.race).slice(-TIMELINE_BARS);
  const laneOf = (a) => (a.task_id && a.action !== "merge" ? `${a.action} ${a.task_id}` : a.action);
  const lanes = [...new Set(recent.map(laneOf))];
  const LABEL = 120, LANE = 18, SLOT = slot(recent.length, LABEL);
  const width = Math.max(WIDTH, LABEL + recent.length * SLOT + 4);
  const timeline = chart(width, lanes.length * LANE + 4,
    `${recent.length} attempts${all.length > recent.length ? ` (the last of ${all.length})` : ""}`,
    ...lanes.map((action, i) => svg("text", { x: 0, y: i * LANE + 14, class: "lane" }, action)),
    ...recent.map((a, i) => svg("rect", {
      x: LABEL + i * SLOT, y: lanes.indexOf(laneOf(a)) * LANE + 3, width: SLOT * 0.8, height: LANE - 4,
      rx: 2, class: `mark ${outcomeClass(a.outcome)}`,
    }, svg("title", {}, attemptText(a)))));
  $("chart-timeline").replaceChildren(timeline);

  // Tokens per iteration, a bar each; the cost in each bar's details.
  const perIteration = new Map();
  for (const a of all) {
    const sum = perIteration.get(a.iteration) || { tokens: 0, cost: 0, attempts: 0 };
    sum.tokens += a.tokens || 0; sum.cost += a.cost_usd || 0; sum.attempts += 1;
    perIteration.set(a.iteration, sum);
  }
  const iterations = [...perIteration].sort((a, b) => a[0] - b[0]);
  const most = Math.max(1, ...iterations.map(([, s]) => s.tokens));
  const cost = iterations.reduce((sum, [, s]) => sum + s.cost, 0);
  const TOP = 14, TALL = 70, AXIS = 44, BAR = slot(iterations.length, AXIS);
  const tokensWidth = Math.max(WIDTH, AXIS + iterations.length * BAR + 4);
  $("tokens-caption").textContent = `Tokens per iteration` + (cost ? ` · $${cost.toFixed(2)} in all` : "");
  $("chart-tokens").replaceChildren(chart(tokensWidth, TOP + TALL + 16,
    `tokens per iteration, ${iterations.length} iterations, at most ${most.toLocaleString()}`,
    svg("text", { x: 0, y: TOP, class: "axis" }, compact(most)),
    svg("text", { x: 0, y: TOP + TALL, class: "axis" }, "0"),
    svg("line", { x1: AXIS - 2, y1: TOP + TALL, x2: tokensWidth, y2: TOP + TALL, class: "base" }),
    ...iterations.map(([n, s], i) => {
      const h = Math.max(1, (s.tokens / most) * TALL);
      return svg("rect", { x: AXIS + i * BAR, y: TOP + TALL - h, width: BAR * 0.75, height: h,
        class: "mark tokens", "data-iteration": n },
      svg("title", {}, `iteration ${n}: ${s.tokens.toLocaleString()} tokens · $${s.cost.toFixed(2)}` +
        ` · ${s.attempts} attempt(s)`));
    })));

  // The pass rate of each validated iteration, 0 to 100 %.
  const STEP = slot(rates.length, AXIS);
  const passWidth = Math.max(WIDTH, AXIS + rates.length * STEP + 4);
  const y = (rate) => TOP + TALL - (Math.min(100, Math.max(0, rate)) / 100) * TALL;
  const x = (i) => AXIS + i * STEP + STEP / 2;
  $("chart-pass").replaceChildren(rates.length
    ? chart(passWidth, TOP + TALL + 16, `pass rate of ${rates.length} validations`,
      svg("text", { x: 0, y: TOP, class: "axis" }, "100%"),
      svg("text", { x: 0, y: TOP + TALL, class: "axis" }, "0%"),
      svg("line", { x1: AXIS - 2, y1: TOP + TALL, x2: passWidth, y2: TOP + TALL, class: "base" }),
      svg("polyline", { points: rates.map(([, r], i) => `${x(i)},${y(r)}`).join(" "), class: "line" }),
      ...rates.map(([n, r], i) => svg("circle", { cx: x(i), cy: y(r), r: 3.5, class: "mark pass",
        "data-iteration": n }, svg("title", {}, `iteration ${n}: ${r}% passed`))))
    : el("p", { class: "muted" }, "No validation yet."));
}

// The width a chart is drawn in, and the room of each of its `n` marks past its `margin`: the
// marks fill the width while they are few, and make it wider (scaled down) when they are many.
const WIDTH = 320;
function slot(n, margin) {
  return Math.min(40, Math.max(6, (WIDTH - margin - 4) / Math.max(1, n)));
}

function compact(n) {
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)}k`;
  return String(n);
}

// ---- Live: events and the running attempt's output, both pushed --------------------------------

// The most output the page keeps: older text leaves from the top.
const MAX_OUTPUT = 64 * 1024;

function onEvent(m) {
  let e = {};
  try { e = JSON.parse(m.data); } catch { return; }
  const line = `${e.ts || ""} ${e.event || ""}${e.action ? " " + e.action : ""}` +
    `${e.summary ? " — " + e.summary : ""}${e.error ? " — " + e.error : ""}` +
    `${e.message ? " — " + e.message : ""}`;
  const list = $("events");
  list.append(el("li", {}, line));
  while (list.childElementCount > MAX_ATTEMPTS) list.firstElementChild.remove();
  list.scrollTop = list.scrollHeight;
  if (ATTEMPT_EVENTS.includes(e.event) || MERGE_EVENTS.includes(e.event)) {
    current.attempts.push(ATTEMPT_EVENTS.includes(e.event) ? fromEvent(e) : fromMergeEvent(e));
    if (current.attempts.length > MAX_ATTEMPTS) {
      current.attempts.shift();
      current.dropped = true;
      current.drawn = Math.max(0, current.drawn - 1);
      $("history").lastElementChild?.remove();
    }
    redraw();
  } else if (e.event === "validated" && typeof e.pass_rate === "number") {
    current.passRates.set(e.iteration ?? 0, e.pass_rate);
    redraw();
  }
}

function showRunning() {
  const run = current && current.running;
  // The last attempt's output stays until the next one's comes.
  $("tail").hidden = !$("tail").textContent;
  if (!run) {
    $("running").textContent = current && current.status === "running"
      ? "Nothing is running this moment: the next action starts soon."
      : "Nothing is running.";
    return;
  }
  const elapsed = Math.max(0, Date.now() - Date.parse(run.started_at));
  $("running").textContent = `${run.action}${run.task_id ? " " + run.task_id : ""}` +
    `, iteration ${run.iteration}, attempt ${run.attempt}` +
    `${run.pid ? ", pid " + run.pid : ""} · running for ${Number.isNaN(elapsed) ? "?" : seconds(elapsed)}`;
}

function appendOutput(text) {
  const tail = $("tail");
  const stick = tail.scrollTop + tail.clientHeight >= tail.scrollHeight - 4;
  let all = tail.textContent + text;
  if (all.length > MAX_OUTPUT) all = "…\n" + all.slice(all.length - MAX_OUTPUT);
  tail.textContent = all;
  tail.hidden = false;
  if (stick) tail.scrollTop = tail.scrollHeight;
}

function watchOutput() {
  const output = new EventSource(loopPath(current.id, current.root, "/output"));
  const data = (m) => { try { return JSON.parse(m.data); } catch { return {}; } };
  output.addEventListener("attempt", (m) => {
    current.running = data(m);
    $("tail").textContent = "";
    showRunning();
  });
  output.addEventListener("output", (m) => {
    const chunk = data(m);
    if (chunk.replace) $("tail").textContent = "";
    appendOutput(chunk.text || "");
  });
  output.addEventListener("skipped", (m) => {
    appendOutput(`\n… ${data(m).bytes.toLocaleString()} bytes of output left out …\n`);
  });
  output.addEventListener("idle", () => {
    current.running = null;
    showRunning();
  });
  return output;
}

function openDetail(id, root) {
  closeDetail();
  current = { id, root, status: "", attempts: [], fromState: [], passRates: new Map(), drawn: 0,
    running: null, dropped: false };
  $("detail-error").textContent = "";
  $("history-note").textContent = "";
  delete $("budget-form").dataset.editing;
  $("events").replaceChildren();
  $("history").replaceChildren();
  $("history").dataset.source = "";
  $("tail").textContent = "";
  current.events = new EventSource(loopPath(id, root, "/events"));
  current.events.onmessage = onEvent;
  current.output = watchOutput();
  // The elapsed time of the running attempt, counted here: no request for it.
  current.clock = setInterval(showRunning, 1000);
  showRunning();
  loadDetail().then(redraw).catch(showError("detail-error"));
}

function closeDetail() {
  if (!current) return;
  current.events.close();
  current.output.close();
  clearInterval(current.clock);
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
$("btn-retry").addEventListener("click", () => control("/retry"));
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
