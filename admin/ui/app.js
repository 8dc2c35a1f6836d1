// The tandem dashboard: signs in with the admin key, then reads and drives the admin API.
// Plain DOM, no framework, no build step. Server data only ever goes into textContent and SVG
// attributes, never into markup, so a hostile model name or error message cannot inject anything.
"use strict";

const KEY_STORAGE = "tandem.adminKey";
const REFRESH_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// ---- API -------------------------------------------------------------------------------------

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(KEY_STORAGE) || ""}` };
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, `Cannot reach the server (${err.message}).`, "unreachable");
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const error = (data && data.error) || {};
    throw new ApiError(response.status, error.message || `${response.status} ${response.statusText}`, error.code);
  }
  return data;
}

// ---- formatting ------------------------------------------------------------------------------

const pad = (n) => String(n).padStart(2, "0");

// The browser's local time, saying which: "2026-12-06 19:41:01 UTC" or "... UTC+01:00".
function fmtTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  const day = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
  return `${day} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())} ${fmtZone(d)}`;
}

function fmtZone(d) {
  const minutes = -d.getTimezoneOffset();
  if (minutes === 0) return "UTC";
  const sign = minutes > 0 ? "+" : "-";
  return `UTC${sign}${pad(Math.floor(Math.abs(minutes) / 60))}:${pad(Math.abs(minutes) % 60)}`;
}

function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
  const s = Math.abs(seconds);
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${pad(Math.round(s % 60))}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${pad(Math.floor((s % 3600) / 60))}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function fmtRelative(iso) {
  if (!iso) return "";
  const seconds = (new Date(iso).getTime() - Date.now()) / 1000;
  return seconds >= 0 ? `in ${fmtDuration(seconds)}` : `${fmtDuration(seconds)} ago`;
}

function fmtNum(value, digits = 4) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "—";
}

function fmtScore(value) {
  if (typeof value !== "number" || !Number.isFinite(value)) return "—";
  return `${value > 0 ? "+" : value < 0 ? "−" : ""}${Math.abs(value).toFixed(2)}`;
}

function fmtWhen(schedule) {
  if (schedule.kind === "cron") return `cron ${schedule.cron}`;
  if (schedule.kind === "interval") return `every ${fmtDuration(schedule.interval_s)}`;
  return `after ${schedule.min_feedback} new ratings`;
}

// ---- DOM helpers -----------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

const td = (content, cls) => el("td", { class: cls }, content);
const mono = (text, title) => el("span", { class: "mono", text, title: title || text });
const badge = (text, kind) => el("span", { class: `badge ${kind || text}`, text });

function shortId(id, keep = 18) {
  return id && id.length > keep ? `${id.slice(0, keep - 1)}…` : id || "—";
}

function fill(tbodyId, rows, columns, emptyText) {
  const body = $(tbodyId);
  if (rows.length === 0) {
    body.replaceChildren(el("tr", {}, el("td", { class: "empty", colSpan: columns, text: emptyText })));
  } else {
    body.replaceChildren(...rows);
  }
}

function fillError(tbodyId, columns, error) {
  const text = error.status === 404 ? "Not available on this server." : error.message;
  $(tbodyId).replaceChildren(el("tr", {}, el("td", { class: "empty error", colSpan: columns, text })));
}

// ---- notices and the reason dialog -----------------------------------------------------------

let noticeTimer = null;

function notify(message, kind = "error") {
  const banner = $("banner");
  banner.className = `banner ${kind}`;
  banner.textContent = message;
  banner.hidden = false;
  clearTimeout(noticeTimer);
  if (kind === "ok") noticeTimer = setTimeout(() => (banner.hidden = true), 6000);
}

function askReason(title, confirmLabel) {
  const dialog = $("reason-dialog");
  $("reason-title").textContent = title;
  $("reason-confirm").textContent = confirmLabel;
  $("reason-input").value = "";
  return new Promise((resolve) => {
    const form = $("reason-form");
    const done = (value) => {
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("cancel", onCancel);
      dialog.close();
      resolve(value);
    };
    const onSubmit = (event) => {
      event.preventDefault();
      done(event.submitter && event.submitter.value === "confirm" ? $("reason-input").value.trim() : null);
    };
    const onCancel = (event) => {
      event.preventDefault();
      done(null);
    };
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("cancel", onCancel);
    dialog.showModal();
    $("reason-input").focus();
  });
}

// One action at a time (a hot swap takes a while: a second click must not queue another); its
// outcome shows in the banner and the page refreshes after it.
let acting = false;

async function act(label, run) {
  if (acting) return notify(`${label}: another action is still running.`);
  acting = true;
  notify(`${label}…`, "info");
  try {
    const message = await run();
    if (message) notify(message, "ok");
  } catch (err) {
    if (err.status === 401) return signOut("The admin key was refused; sign in again.");
    notify(`${label} failed: ${err.message}`);
  } finally {
    acting = false;
  }
  refresh();
}

// ---- sections --------------------------------------------------------------------------------

const state = { trendModel: null, servingModel: null, adapterScope: null };

async function loadServing() {
  const serving = await api("GET", "/admin/weights");
  state.servingModel = serving.model;
  const box = $("serving");
  box.replaceChildren("serving ", el("strong", { text: serving.model }), " @ ", mono(serving.weight_version));
  box.hidden = false;
}

async function loadTrend() {
  const points = (await api("GET", "/admin/stats/ratings")).data;
  const models = [...new Set(points.map((p) => p.model))];
  if (!models.includes(state.trendModel)) {
    state.trendModel = models.includes(state.servingModel) ? state.servingModel : models[0] || null;
  }
  const select = $("trend-model");
  select.replaceChildren(...models.map((m) => el("option", { value: m, text: m, selected: m === state.trendModel })));
  select.parentElement.hidden = models.length < 2; // one model: the header already names it
  const shown = points.filter((p) => p.model === state.trendModel);
  drawTrend($("trend-chart"), shown, (p) => p.weight_version);
  fill("trend-rows", shown.map((p) => ratingRow(p.weight_version, p)), 8, "No rated answers yet.");
}

function ratingRow(id, p) {
  return el(
    "tr",
    { "data-id": id },
    td(mono(id)),
    td(p.status ? badge(p.status) : el("span", { class: "muted", text: "unrecorded" })),
    td(String(p.rated), "num"),
    td(String(p.up), "num"),
    td(String(p.down), "num"),
    td(fmtScore(p.mean_score), `num ${p.mean_score >= 0 ? "pos" : "neg"}`),
    td(fmtTime(p.first_at)),
    td(fmtTime(p.last_at)),
  );
}

async function loadAdapters() {
  const points = (await api("GET", "/admin/stats/adapter-ratings")).data;
  const scopeOf = (p) => `${p.tenant_id} / ${p.scope_kind} / ${p.scope}`;
  const scopes = [...new Set(points.map(scopeOf))];
  if (!scopes.includes(state.adapterScope)) state.adapterScope = scopes[0] || null;
  const select = $("adapter-scope");
  select.replaceChildren(...scopes.map((s) => el("option", { value: s, text: s, selected: s === state.adapterScope })));
  select.parentElement.hidden = scopes.length === 0;
  const shown = points.filter((p) => scopeOf(p) === state.adapterScope);
  drawTrend($("adapter-chart"), shown, (p) => p.adapter_id);
  fill("adapter-rows", shown.map((p) => ratingRow(p.adapter_id, p)), 8, "No rated answers from adapters yet.");
}

function drawTrend(chart, points, name) {
  if (points.length === 0) {
    chart.replaceChildren(el("p", { class: "muted empty", text: "No ratings to draw yet." }));
    return;
  }
  const W = 880;
  const H = 240;
  const m = { left: 48, right: 24, top: 22, bottom: 44 };
  const inset = 44; // keeps the first and last point (and their labels) clear of the axis labels
  const plotW = W - m.left - m.right - 2 * inset;
  const plotH = H - m.top - m.bottom;
  const x = (i) => m.left + inset + (points.length === 1 ? plotW / 2 : (i * plotW) / (points.length - 1));
  const y = (v) => m.top + ((1 - v) / 2) * plotH;
  const most = Math.max(...points.map((p) => p.rated));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "Mean rating per version" });

  for (const v of [1, 0.5, 0, -0.5, -1]) {
    root.append(
      svg("line", { x1: m.left, x2: W - m.right, y1: y(v), y2: y(v), class: v === 0 ? "axis zero" : "axis" }),
      svg("text", { x: m.left - 8, y: y(v) + 4, class: "tick", "text-anchor": "end" }, fmtScore(v)),
    );
  }
  const line = points.map((p, i) => `${x(i)},${y(p.mean_score)}`).join(" ");
  root.append(svg("polyline", { points: line, class: "trend-line" }));

  const labelEvery = Math.max(1, Math.ceil(points.length / 12));
  points.forEach((p, i) => {
    const r = 4 + 5 * Math.sqrt(p.rated / most);
    const dot = svg("circle", { cx: x(i), cy: y(p.mean_score), r, class: `dot ${p.status || "unrecorded"}` });
    dot.append(svg("title", {}, `${name(p)}: ${fmtScore(p.mean_score)} over ${p.rated} rated answers`));
    root.append(dot);
    if (i % labelEvery === 0 || i === points.length - 1) {
      const above = p.mean_score > 0.75 ? y(p.mean_score) + r + 14 : y(p.mean_score) - r - 6;
      root.append(
        svg("text", { x: x(i), y: above, class: "value", "text-anchor": "middle" }, fmtScore(p.mean_score)),
        svg("text", { x: x(i), y: H - m.bottom + 20, class: "tick", "text-anchor": "middle" }, shortId(name(p), 16)),
        svg("text", { x: x(i), y: H - m.bottom + 34, class: "tick faint", "text-anchor": "middle" }, `n=${p.rated}`),
      );
    }
  });
  chart.replaceChildren(root);
}

async function loadModels() {
  const versions = (await api("GET", "/admin/models?limit=50")).data;
  fill(
    "model-rows",
    versions.map((v) => {
      const status = el("span", {}, badge(v.status));
      if (v.status_reason) status.append(el("div", { class: "muted small", text: v.status_reason }));
      const skipped = v.evaluation && v.evaluation.skipped;
      if (skipped) {
        const text = `preference not checked: ${skipped}`;
        status.append(el("div", { class: "warn small", text, title: "Held-out ratings or TANDEM_EVAL_PROMPTS let the gate compare answers" }));
      }
      const checks = guardChecks(v.evaluation);
      if (checks) status.append(checks);
      return el(
        "tr",
        { "data-id": v.id },
        td(mono(v.id)),
        td(v.model),
        td(status),
        td(v.parent_id ? mono(v.parent_id) : el("span", { class: "muted", text: "—" })),
        td(fmtNum(v.metrics.loss), "num"),
        td(fmtNum(v.metrics.reward_mean, 3), "num"),
        td(fmtTime(v.created_at)),
        td(versionAction(v), "actions"),
      );
    }),
    8,
    "No model versions yet: the first learning round records one.",
  );
}

// Canaries (admin/routes/canaries.py): a candidate adapter serving a share of its scope until live
// ratings decide it; a running one can be decided by hand.
async function loadCanaries() {
  const canaries = (await api("GET", "/admin/canaries?limit=20")).data;
  fill(
    "canary-rows",
    canaries.map((c) => {
      const status = el("span", {}, badge(c.status));
      if (c.reason) status.append(el("div", { class: "muted small", text: c.reason }));
      const thumbs = (side) => (side ? `${side.up} / ${side.up + side.down}` : "—");
      const numbers = c.numbers || {};
      return el(
        "tr",
        { "data-id": c.id },
        td(mono(shortId(c.id), c.id)),
        td(c.scope_kind === "base" ? "base model (every tenant)" : `${c.tenant_id} / ${c.scope_kind} / ${c.scope}`),
        td(mono(c.candidate_id)),
        td(c.control_id ? mono(c.control_id) : el("span", { class: "muted", text: "the base" })),
        td(`${Math.round(c.share * 100)} %`, "num"),
        td(status),
        td(thumbs(numbers.canary), "num"),
        td(thumbs(numbers.control), "num"),
        td(numbers.p_not_worse === undefined ? "—" : fmtNum(numbers.p_not_worse, 3), "num"),
        td(fmtTime(c.started_at)),
        td(c.status === "running" ? canaryActions(c) : null, "actions"),
      );
    }),
    11,
    "No canaries yet: set TANDEM_ADAPTER_CANARY_SHARE, or start one from the admin API.",
  );
}

function canaryActions(canary) {
  return el(
    "span",
    {},
    ...[
      ["promote", "Promote"],
      ["rollback", "Roll back"],
    ].map(([action, label]) => {
      const onclick = async () => {
        const reason = await askReason(`${label} canary ${canary.id}?`, label);
        if (reason === null) return;
        await act(label, async () => {
          const path = `/admin/canaries/${encodeURIComponent(canary.id)}/${action}`;
          const decided = await api("POST", path, { reason: reason || null });
          return `Canary ${decided.id} ${decided.status.replace("_", " ")}.`;
        });
      };
      return el("button", { type: "button", class: "small", text: label, onclick });
    }),
  );
}

// The capability guard's checks (learner/evaluation/guard.py): a summary line, every check on opening it.
function guardChecks(evaluation) {
  const checks = (evaluation && evaluation.checks) || [];
  if (!checks.length) return null;
  const failed = checks.filter((c) => !c.passed).length;
  const summary = failed ? `guard: ${failed} of ${checks.length} checks failed` : `guard: ${checks.length} checks passed`;
  const rows = checks.map((c) =>
    el(
      "tr",
      { class: c.passed ? "check passed" : "check failed" },
      td(c.passed ? "✓" : "✗"),
      td(c.name),
      td(fmtNum(c.value, 3), "num"),
      td(`${c.rule} ${fmtNum(c.bound, 3)}`),
      td(c.serving === null ? "" : `serving ${fmtNum(c.serving, 3)}`, "muted"),
    ),
  );
  return el(
    "details",
    { class: "guard small" },
    el("summary", { class: failed ? "guard-failed" : "muted", text: summary }),
    el("table", { class: "checks" }, el("tbody", {}, ...rows)),
  );
}

function versionAction(version) {
  const action = { candidate: "promote", retired: "rollback" }[version.status];
  if (!action) return null;
  const label = action === "promote" ? "Promote" : "Roll back";
  const onclick = async () => {
    const verb = action === "promote" ? "Promote" : "Roll back to";
    const reason = await askReason(`${verb} ${version.id}?`, label);
    if (reason === null) return;
    await act(label, async () => {
      const result = await api("POST", `/admin/models/${encodeURIComponent(version.id)}/${action}`, {
        reason: reason || null,
      });
      return `Now serving ${result.weight_version} (was ${result.previous_version}; swap ${fmtDuration(result.swap_s)}).`;
    });
  };
  return el("button", { type: "button", class: "small", text: label, onclick });
}

async function loadRuns() {
  const runs = (await api("GET", "/admin/runs?limit=20")).data;
  // A run a schedule fired names it (the schedules' names, read only when one is needed).
  const fired = runs.some((r) => r.schedule_id);
  const schedules = fired ? (await api("GET", "/admin/schedules?limit=100")).data : [];
  const names = Object.fromEntries(schedules.map((s) => [s.id, s.name]));
  fill(
    "run-rows",
    runs.map((r) => {
      const metrics = r.metrics || {};
      const status = el("span", {}, badge(r.status.replaceAll("_", " "), r.status));
      const note = r.error || r.reason; // a failure's last line, or why there was nothing to learn
      if (note) status.append(el("div", { class: "muted small clip", text: note, title: note }));
      const samples = r.samples_trained === null ? "—" : `${r.samples_trained} / ${r.samples_collected ?? "—"}`;
      return el(
        "tr",
        { "data-id": r.id },
        td(mono(shortId(r.id, 16), r.id)),
        td(status),
        td(r.schedule_id ? `schedule ${names[r.schedule_id] || shortId(r.schedule_id)}` : r.trigger),
        td(fmtTime(r.started_at || r.created_at)),
        td(fmtDuration(r.duration_s), "num"),
        td(samples, "num"),
        td(fmtNum(metrics.loss), "num"),
        td(fmtNum(metrics.reward_mean, 3), "num"),
        td(r.produced_version_id ? mono(r.produced_version_id) : "—"),
      );
    }),
    9,
    "No learning rounds yet.",
  );
}

async function loadSchedules() {
  const schedules = (await api("GET", "/admin/schedules?limit=100")).data;
  fill(
    "schedule-rows",
    schedules.map((s) => {
      const quiet = s.quiet_start && s.quiet_end ? `${s.quiet_start}–${s.quiet_end} ${s.timezone}` : "—";
      const next = s.next_fire_at ? el("span", {}, fmtTime(s.next_fire_at), el("div", { class: "muted small", text: fmtRelative(s.next_fire_at) })) : "—";
      const toggle = s.enabled ? "disable" : "enable";
      return el(
        "tr",
        { "data-id": s.id },
        td(el("strong", { text: s.name })),
        td(fmtWhen(s)),
        td(quiet),
        td(pausedOrNot(s)),
        td(next),
        td(fmtTime(s.last_fired_at)),
        td(
          el(
            "span",
            { class: "buttons" },
            scheduleButton(s, toggle, toggle === "enable" ? "Enable" : "Disable"),
            scheduleButton(s, "run", "Run now"),
          ),
          "actions",
        ),
      );
    }),
    7,
    "No schedules yet.",
  );
}

// A schedule the drift guard paused says why; enabling it is the resume (docs/evaluation.md).
function pausedOrNot(schedule) {
  if (schedule.enabled || !schedule.paused_reason) return badge(schedule.enabled ? "enabled" : "disabled");
  return el(
    "span",
    {},
    badge("paused", "disabled"),
    el("div", { class: "muted small paused-reason", text: `${schedule.paused_reason} (${fmtTime(schedule.paused_at)})` }),
  );
}

function scheduleButton(schedule, action, label) {
  const onclick = () =>
    act(label, async () => {
      await api("POST", `/admin/schedules/${encodeURIComponent(schedule.id)}/${action}`);
      return action === "run" ? `Schedule ${schedule.name} fired a round.` : `Schedule ${schedule.name}: ${action}d.`;
    });
  return el("button", { type: "button", class: "small", text: label, onclick });
}

async function loadEngines() {
  const replicas = (await api("GET", "/admin/engines")).data;
  fill(
    "engine-rows",
    replicas.map((r) => {
      const ratio = r.cache_hit_ratio === null ? "—" : `${(100 * r.cache_hit_ratio).toFixed(1)} %`;
      const stateText = r.updating_weights ? "updating weights" : r.drained ? "drained" : "in rotation";
      const action = r.drained ? "undrain" : "drain";
      const onclick = () =>
        act(action === "drain" ? "Drain" : "Undrain", async () => {
          await api("POST", `/admin/engines/${r.id}/${action}`);
          return `${r.id}: ${action}ed.`;
        });
      return el(
        "tr",
        { "data-id": r.id },
        td(mono(r.id)),
        td(badge(r.healthy ? "healthy" : "unhealthy")),
        td(r.weight_version ? mono(r.weight_version) : "—"),
        td(String(r.in_flight), "num"),
        td(ratio, "num"),
        td(badge(stateText, stateText.replace(" ", "-"))),
        td(el("button", { type: "button", class: "small", text: r.drained ? "Undrain" : "Drain", onclick }), "actions"),
      );
    }),
    7,
    "No engine replicas.",
  );
}

const SECTIONS = [
  [loadTrend, "trend-rows", 8],
  [loadAdapters, "adapter-rows", 8],
  [loadCanaries, "canary-rows", 11],
  [loadModels, "model-rows", 8],
  [loadRuns, "run-rows", 9],
  [loadSchedules, "schedule-rows", 7],
  [loadEngines, "engine-rows", 7],
];

// ---- refresh loop ----------------------------------------------------------------------------

let refreshTimer = null;
let refreshing = null;

function refresh() {
  clearTimeout(refreshTimer);
  refreshing = (refreshing || Promise.resolve()).then(refreshOnce).finally(() => {
    clearTimeout(refreshTimer); // refreshes queued by actions end here too: keep a single timer
    if (sessionStorage.getItem(KEY_STORAGE)) refreshTimer = setTimeout(refresh, REFRESH_MS);
  });
  return refreshing;
}

async function refreshOnce() {
  if (!sessionStorage.getItem(KEY_STORAGE)) return;
  // The serving model picks the trend's default model, so it is read first.
  const results = [await loadServing().then(() => null, (err) => err)];
  for (const outcome of await Promise.allSettled(SECTIONS.map(([load]) => load()))) {
    results.push(outcome.status === "rejected" ? outcome.reason : null);
  }
  if (results.some((err) => err && err.status === 401)) return signOut("The admin key was refused; sign in again.");
  SECTIONS.forEach(([, tbodyId, columns], i) => {
    if (results[i + 1]) fillError(tbodyId, columns, results[i + 1]);
  });
  const down = results.find((err) => err && (err.status === 0 || err.status >= 500));
  const stamp = $("refreshed");
  stamp.hidden = false;
  stamp.className = down ? "refreshed stale" : "refreshed";
  stamp.textContent = down ? `refresh failed: ${down.message}` : `updated ${fmtTime(new Date().toISOString()).slice(11)}`;
}

// ---- schedule form ---------------------------------------------------------------------------

function showKindFields() {
  const kind = $("schedule-form").elements.kind.value;
  for (const label of document.querySelectorAll("#schedule-form [data-kind]")) {
    label.hidden = label.dataset.kind !== kind;
  }
}

function scheduleBody(form) {
  const f = form.elements;
  const kind = f.kind.value;
  let roundSettings = {};
  if (f.round_settings.value.trim()) {
    try {
      roundSettings = JSON.parse(f.round_settings.value);
    } catch (err) {
      throw new ApiError(400, `Round settings are not valid JSON (${err.message}).`);
    }
  }
  const integer = (input) => (input.value === "" ? null : Number(input.value));
  return {
    name: f.name.value.trim(),
    kind,
    cron: kind === "cron" ? f.cron.value.trim() : null,
    interval_s: kind === "interval" ? integer(f.interval_s) : null,
    min_feedback: kind === "feedback" ? integer(f.min_feedback) : null,
    quiet_start: f.quiet_start.value || null,
    quiet_end: f.quiet_end.value || null,
    timezone: f.timezone.value.trim() || "UTC",
    round_settings: roundSettings,
    enabled: f.enabled.checked,
  };
}

async function createSchedule(event) {
  event.preventDefault();
  const form = event.target;
  const error = $("schedule-error");
  error.hidden = true;
  try {
    const created = await api("POST", "/admin/schedules", scheduleBody(form));
    form.reset();
    showKindFields();
    notify(`Schedule ${created.name} created${created.next_fire_at ? `; next firing ${fmtTime(created.next_fire_at)}` : ""}.`, "ok");
    refresh();
  } catch (err) {
    if (err.status === 401) return signOut("The admin key was refused; sign in again.");
    error.textContent = err.message;
    error.hidden = false;
  }
}

// ---- sign in and out -------------------------------------------------------------------------

function show(signedIn) {
  $("login-view").hidden = signedIn;
  $("dashboard").hidden = !signedIn;
  $("logout").hidden = !signedIn;
  if (!signedIn) {
    $("serving").hidden = true;
    $("refreshed").hidden = true;
  }
}

function signOut(message) {
  sessionStorage.removeItem(KEY_STORAGE);
  clearTimeout(refreshTimer);
  show(false);
  const error = $("login-error");
  error.textContent = message || "";
  error.hidden = !message;
  $("admin-key").focus();
}

async function signIn(event) {
  event.preventDefault();
  await signInWith($("admin-key").value.trim());
}

async function signInWith(key) {
  const error = $("login-error");
  error.hidden = true;
  sessionStorage.setItem(KEY_STORAGE, key);
  try {
    await api("GET", "/admin/engines");
  } catch (err) {
    sessionStorage.removeItem(KEY_STORAGE);
    const messages = {
      401:
        "That is not the admin key. It is TANDEM_ADMIN_KEY, or without one the key in the dashboard link " +
        "`tandem serve` printed at start (it lasts for that run).",
      403: "That is a tenant's API key: the dashboard needs the admin key (TANDEM_ADMIN_KEY).",
    };
    error.textContent = messages[err.status] || err.message;
    error.hidden = false;
    return;
  }
  $("admin-key").value = "";
  show(true);
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", signIn);
  $("logout").addEventListener("click", () => signOut());
  $("schedule-form").addEventListener("submit", createSchedule);
  $("schedule-form").elements.kind.addEventListener("change", showKindFields);
  $("trend-model").addEventListener("change", (event) => {
    state.trendModel = event.target.value;
    refresh();
  });
  $("adapter-scope").addEventListener("change", (event) => {
    state.adapterScope = event.target.value;
    refresh();
  });
  // The link `tandem serve` prints carries this run's admin key in the fragment (never sent to the
  // server): sign in with it and take it out of the address bar and the history.
  const fromLink = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromLink) {
    history.replaceState(null, "", location.pathname + location.search);
    show(false);
    signInWith(fromLink);
    return;
  }
  const signedIn = Boolean(sessionStorage.getItem(KEY_STORAGE));
  show(signedIn);
  if (signedIn) refresh();
});
