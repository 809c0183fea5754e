// The dashboard in a real browser (Chromium through playwright-core), driven by tests/dashboard.rs,
// which starts `loopd serve` and passes, in the environment:
//   LOOPD_URL     the service's base address (http://127.0.0.1:PORT)
//   LOOPD_TOKEN   its token
//   LOOPD_ROOT    the project the service serves (its agent pauses, asks, then hangs)
//   LOOPD_GIT_ROOT, LOOPD_GIT_LOOP  a git project it also serves, and its loop (created, not
//                 started), whose agent reports tokens and cost, fails one validation, then passes
//   LOOPD_PARALLEL_LOOP  a loop of that project developing two tasks at once, then racing two
//                 executors on a third
//   LOOPD_SHOTS   where the screenshots go
//   LOOPD_BROWSER_DIR  where playwright-core is installed; CHROMIUM the browser
// Every wait has a generous deadline that catches a hang; none is a measure.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";
import assert from "node:assert/strict";

const env = (k) => { const v = process.env[k]; assert.ok(v, `${k} is not set`); return v; };
const base = env("LOOPD_URL"), token = env("LOOPD_TOKEN"), root = env("LOOPD_ROOT");
const shots = env("LOOPD_SHOTS");
const gitRoot = env("LOOPD_GIT_ROOT"), gitLoop = env("LOOPD_GIT_LOOP");
const parallelLoop = env("LOOPD_PARALLEL_LOOP");
const { chromium } = createRequire(path.join(env("LOOPD_BROWSER_DIR"), "noop.js"))("playwright-core");
const DEADLINE = 30_000;

const statePath = (id, at = root) => path.join(at, ".loop", `${id}.json`);
const state = (id, at = root) => JSON.parse(fs.readFileSync(statePath(id, at), "utf8"));
const events = (id, at) => fs.readFileSync(path.join(at, ".loop", `${id}.progress`, "events.jsonl"), "utf8")
  .split("\n").filter(Boolean).map((l) => JSON.parse(l));
const count = (page, selector) => page.locator(selector).count();
async function until(what, cond) {
  const end = Date.now() + DEADLINE;
  for (;;) {
    try { if (await cond()) return; } catch { /* a file half-written: look again */ }
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
const step = (text) => console.log(`dashboard test: ${text}`);

const browser = await chromium.launch({
  executablePath: env("CHROMIUM"),
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage"],
});
try {
  // Without the token nothing is served.
  const stranger = await browser.newPage();
  for (const route of ["/", "/v1/loops", "/app.js"]) {
    const r = await stranger.goto(base + route);
    assert.equal(r.status(), 401, `${route} without the token`);
  }
  const wrong = await stranger.goto(`${base}/?token=not-the-token`);
  assert.equal(wrong.status(), 401);
  await stranger.close();
  step("a request without the token is refused (401)");

  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(e.message));
  await page.goto(`${base}/?token=${token}`);
  assert.equal(new URL(page.url()).search, "", "the token is left out of the address");
  const cookies = await context.cookies();
  const session = cookies.find((c) => c.name === "loopd_token");
  assert.ok(session && session.httpOnly && session.sameSite === "Strict", JSON.stringify(cookies));
  await page.waitForSelector("#summary:has-text('running')", { timeout: DEADLINE });
  step("logged in with the link; the session cookie is HttpOnly and SameSite=Strict");

  // Every control has a label; the page fits a narrow window.
  const unlabelled = await page.evaluate(() =>
    [...document.querySelectorAll("input, select, textarea")].filter((e) => e.labels.length === 0).map((e) => e.id));
  assert.deepEqual(unlabelled, []);

  // A loop from the form, started at once.
  await page.selectOption("#create-root", root);
  await page.fill("#create-name", "Browser loop");
  await page.fill("#create-tasks", "first\nsecond");
  await page.click("#create button[type=submit]");
  await page.waitForURL(/#\/loop\//, { timeout: DEADLINE });
  const id = decodeURIComponent(page.url().match(/#\/loop\/([^?]+)/)[1]);
  step(`created and started ${id} from the form`);
  await page.evaluate(() => { window.__stayed = true; });

  // It progresses live: develop in flight, its output in the tail.
  await page.waitForSelector("#detail-status:has-text('develop')", { timeout: DEADLINE });
  await page.waitForSelector("#tail:has-text('working on task-001')", { timeout: DEADLINE });
  await page.waitForSelector("#running:has-text('develop task-001')", { timeout: DEADLINE });
  await page.waitForSelector("#running:has-text('running for')", { timeout: DEADLINE });
  await page.waitForSelector("#events li:has-text('action_started')", { timeout: DEADLINE });
  const polled = [];
  page.on("request", (r) => { if (r.url().includes("/tail")) polled.push(r.url()); });
  step("the page shows develop in flight, its output pushed with its running time, and its events, live");

  await page.click("#btn-pause");
  await until("the state file to say paused", () => state(id).status === "paused");
  await page.waitForSelector("#detail-status:has-text('paused')", { timeout: DEADLINE });
  step("paused from the page: the state file says paused");

  await page.click("#btn-resume");
  await until("the state file to say running", () => state(id).status === "running");
  await page.waitForSelector("#answer-form:not([hidden])", { timeout: DEADLINE });
  await page.waitForSelector("#question:has-text('Postgres or SQLite?')", { timeout: DEADLINE });
  step("resumed; the question waits on the page");
  await page.screenshot({ path: path.join(shots, "dashboard-loop.png"), fullPage: true });

  await page.fill("#answer-text", "SQLite");
  await page.click("#answer-form button[type=submit]");
  await until("the answer in the state file", () => state(id).skill_state.question?.answer === "SQLite"
    || (state(id).skill_state.action_history || []).some((h) => (h.summary || "").includes("SQLite")));
  await page.waitForSelector("#tail:has-text('still working')", { timeout: DEADLINE });
  step("answered from the page; the loop went on");

  // A change made on the cookie without the dashboard's header is refused.
  const forged = await page.evaluate((p) => fetch(p, { method: "POST" }).then((r) => r.status),
    `/v1/loops/${encodeURIComponent(id)}/pause?root=${encodeURIComponent(root)}`);
  assert.equal(forged, 403);
  assert.equal(state(id).status, "running");

  await page.fill("#budget-usd", "4.5");
  await page.fill("#budget-tokens", "250000");
  await page.click("#budget-form button[type=submit]");
  await until("the budget in the state file",
    () => state(id).max_cost_usd === 4.5 && state(id).max_tokens === 250000);
  step("the budget set from the page");

  await page.click("#btn-stop");
  await until("the state file to say failed", () => state(id).status === "failed");
  await page.waitForSelector("#detail-status:has-text('stopped')", { timeout: DEADLINE });
  await page.waitForSelector("#btn-pause", { state: "hidden", timeout: DEADLINE });
  assert.equal(await page.isVisible("#btn-stop"), false, "Stop on a stopped loop");
  assert.equal(await page.isVisible("#btn-resume"), true, "Resume on a stopped loop");
  assert.equal(await page.isVisible("#issues"), false, "skill-tuning's panel on a ccw-loop loop");
  assert.equal(await page.isVisible("#hypotheses"), true, "ccw-loop's own panel");
  assert.equal(await page.isVisible("#btn-retry"), true, "Retry on a stopped loop");
  await page.waitForSelector("#running:has-text('Nothing is running')", { timeout: DEADLINE });
  step("stopped from the page; only the controls and panels that fit remain");

  await page.click("#btn-retry");
  await until("the state file to say running again", () => state(id).status === "running");
  await page.waitForSelector("#running:has-text('running for')", { timeout: DEADLINE });
  await page.waitForSelector("#tail:has-text('still working')", { timeout: DEADLINE });
  await page.click("#btn-stop");
  await until("the state file to say failed again", () => state(id).status === "failed");
  assert.deepEqual(polled, [], "the page polled the output");
  step("retried from the page: the service took the loop up again; stopped it again");

  // The git project's loop, run from the page to its end.
  await page.evaluate(([id, at]) => { location.hash = `#/loop/${encodeURIComponent(id)}?root=${encodeURIComponent(at)}`; },
    [gitLoop, gitRoot]);
  await page.waitForSelector("#detail-title:has-text('Charts loop')", { timeout: DEADLINE });
  await page.waitForSelector("#over-time-empty:has-text('No attempt yet')", { timeout: DEADLINE });
  await page.waitForSelector("#history li:has-text('No action yet')", { timeout: DEADLINE });
  await page.waitForSelector("#next-step:has-text('Resume starts it')", { timeout: DEADLINE });
  step("a loop that has not started says what to do next");
  await page.click("#btn-resume");
  await until("the git loop to complete", () => state(gitLoop, gitRoot).status === "completed");
  const log = events(gitLoop, gitRoot);
  const tried = log.filter((e) => ["action_finished", "action_failed", "action_interrupted"].includes(e.event));
  const iterations = new Set(tried.map((e) => e.iteration)).size;
  const validations = log.filter((e) => e.event === "validated").length;
  assert.equal(validations, 2, "two validations");
  await until(`${tried.length} bars in the timeline`, async () =>
    await count(page, "#chart-timeline .mark") === tried.length);
  await until(`${iterations} marks in the tokens chart`, async () =>
    await count(page, "#chart-tokens .mark") === iterations);
  await until("two marks in the pass-rate chart", async () => await count(page, "#chart-pass .mark") === 2);
  const rates = await page.locator("#chart-pass .mark title").allTextContents();
  assert.ok(rates[0].includes("50% passed") && rates[1].includes("100% passed"), rates.join(" / "));
  await page.waitForSelector("#tokens-caption:has-text('$')", { timeout: DEADLINE });
  assert.equal(await page.isVisible("#btn-resume"), false, "Resume on a completed loop");
  step(`the timeline has ${tried.length} bars, the tokens chart ${iterations} (one per iteration), ` +
    "the pass rate 50% then 100%");

  // A develop's diff, opened with the keyboard.
  const second = page.locator("li.attempt[data-action='develop']:has-text('task-002')");
  await second.locator("button[data-checkpoint]").focus();
  await page.keyboard.press("Enter");
  await page.waitForSelector("li.attempt:has-text('task-002') .diff summary:has-text('work.txt')",
    { timeout: DEADLINE });
  const added = await second.locator(".diff .add").allTextContents();
  assert.deepEqual(added.map((l) => l.trim()), ["+line of task-002"]);
  step("the second develop's diff: work.txt, one line added");
  await page.screenshot({ path: path.join(shots, "dashboard-charts.png"), fullPage: true });

  // Back to the first develop's checkpoint, after a confirmation.
  assert.equal(fs.readFileSync(path.join(gitRoot, "work.txt"), "utf8"), "line of task-001\nline of task-002\n");
  let asked = "";
  page.once("dialog", (d) => { asked = d.message(); d.accept(); });
  // Newest first: the last develop is the first one.
  const first = page.locator("li.attempt[data-action='develop']").last();
  assert.ok((await first.locator("span").first().textContent()).includes("develop task-001"));
  await first.locator("button[data-rollback]").click();
  await until("the work tree rolled back", () =>
    fs.readFileSync(path.join(gitRoot, "work.txt"), "utf8") === "line of task-001\n");
  assert.ok(asked.includes("checkpoint"), `the confirmation: ${asked}`);
  await page.waitForSelector("#history-note:has-text('back as it was')", { timeout: DEADLINE });
  step("rolled the work tree back to the first develop's checkpoint from the page");

  // Tasks developed at once: a lane per task, each merge, the conflict, the race side by side.
  await page.evaluate(([id, at]) => { location.hash = `#/loop/${encodeURIComponent(id)}?root=${encodeURIComponent(at)}`; },
    [parallelLoop, gitRoot]);
  await page.waitForSelector("#detail-title:has-text('Parallel loop')", { timeout: DEADLINE });
  await page.click("#btn-resume");
  await until("the parallel loop to complete", () => state(parallelLoop, gitRoot).status === "completed");
  const plog = events(parallelLoop, gitRoot);
  const merges = plog.filter((e) => e.event === "merged").length;
  assert.ok(merges >= 2, `${merges} merges`);
  await until(`${merges} merges in the history`, async () =>
    await count(page, "li.attempt[data-action='merge']:has-text('merged into')") === merges);
  await page.waitForSelector("li.attempt[data-action='merge']:has-text('work.txt changed')", { timeout: DEADLINE });
  const race = page.locator("li.attempt[data-action='race']");
  await race.waitFor({ timeout: DEADLINE });
  assert.equal(await race.locator(".entry").count(), 2, "the race's two entries");
  assert.equal(await race.locator(".entry.won").count(), 1, "one winner");
  const lanes = await page.locator("#chart-timeline text.lane").allTextContents();
  for (const lane of ["develop task-001", "develop task-002", "merge"]) {
    assert.ok(lanes.includes(lane), `the timeline's lanes: ${lanes.join(", ")}`);
  }
  const loser = race.locator(".entry:not(.won)");
  await loser.locator("button[data-checkpoint]").click();
  await loser.locator(".diff summary:has-text('work.txt')").waitFor({ timeout: DEADLINE });
  step(`the parallel loop: ${merges} merges, the conflict, the race's entries side by side with ` +
    `their diffs, a timeline lane per task (${lanes.join(", ")})`);
  await page.screenshot({ path: path.join(shots, "dashboard-parallel.png"), fullPage: true });

  await page.setViewportSize({ width: 400, height: 900 });
  const narrowLoop = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(narrowLoop <= 0, `the loop's page is ${narrowLoop}px wider than a 400px window`);
  await page.screenshot({ path: path.join(shots, "dashboard-narrow.png"), fullPage: true });
  await page.setViewportSize({ width: 1280, height: 900 });
  step("the loop's page fits a 400px window");

  // The overview: a raw write to the state file shows without a reload.
  await page.click("text=← every loop");
  await page.waitForSelector(`tr[data-loop='${id}']`, { timeout: DEADLINE });
  const raw = state(id);
  raw.title = "Renamed by hand";
  fs.writeFileSync(statePath(id), JSON.stringify(raw, null, 2));
  const written = Date.now();
  await page.waitForSelector(`tr[data-loop='${id}'] :text('Renamed by hand')`, { timeout: DEADLINE });
  step(`a raw write of the title showed on the open page after ${Date.now() - written} ms`);
  await page.waitForSelector(`#spent li:has-text('today 0 tok')`, { timeout: DEADLINE });
  step("each project's spend, today and overall, under the list");
  assert.equal(await page.evaluate(() => window.__stayed), true, "the page was reloaded");

  await page.selectOption("#filter-status", "failed");
  await page.waitForSelector(`tr[data-loop='${id}']`, { timeout: DEADLINE });
  await page.selectOption("#filter-status", "");
  await page.screenshot({ path: path.join(shots, "dashboard-overview.png"), fullPage: true });

  await page.setViewportSize({ width: 380, height: 800 });
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow <= 0, `the page is ${overflow}px wider than a narrow window`);
  // From the top of the page, Tab reaches the links and then the filters.
  await page.evaluate(() => { document.activeElement?.blur(); window.scrollTo(0, 0); });
  const reached = [];
  for (let i = 0; i < 4; i++) {
    await page.keyboard.press("Tab");
    reached.push(await page.evaluate(() => document.activeElement?.id || document.activeElement?.tagName));
  }
  assert.ok(reached.includes("filter-status"), `Tab reached ${reached.join(", ")}`);
  step("narrow window: no horizontal overflow; the keyboard reaches the controls");
  assert.deepEqual(pageErrors, [], "the page's script failed");
  console.log("dashboard test: passed");
} finally {
  await browser.close();
}
