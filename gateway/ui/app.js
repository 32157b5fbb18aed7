// Conveyor's dashboard: reads the admin API (SPEC §11.6) every two seconds and draws it.
// Every value goes into the page as text (never as HTML), and the page's policy runs no other
// script. The operator's credentials stay in this tab's sessionStorage.
"use strict";

const REFRESH_MS = 2000;
// A gateway that accepts connections but does not answer must not leave the page saying "live".
const TIMEOUT_MS = 5000;
// What the page shows of a request or a response: a client's 1 MiB of nested arrays pretty-prints
// to 130 M characters, which froze the tab. Pretty only while small, and never more than SHOWN_CHARS.
const PRETTY_CHARS = 20_000;
const SHOWN_CHARS = 100_000;
const KEY = "conveyor.operator";
const STATUSES = ["PENDING", "IN_PROGRESS", "SUCCESS", "FAILURE"];
const main = () => document.getElementById("main");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class Forbidden extends Error {}
// A task or a service that is not there (any more): said in the page, not only the indicator.
class NotFound extends Error {}

async function api(path) {
  const auth = sessionStorage.getItem(KEY);
  if (!auth) throw new Forbidden();
  const abort = new AbortController();
  const timeout = setTimeout(() => abort.abort(), TIMEOUT_MS);
  let body;
  try {
    const answer = await fetch(path, { headers: { Authorization: "Basic " + auth }, signal: abort.signal });
    if (answer.status === 403) throw new Forbidden();
    body = await answer.json();
  } catch (err) {
    throw abort.signal.aborted ? new Error(`no answer within ${TIMEOUT_MS / 1000} s`) : err;
  } finally {
    clearTimeout(timeout);
  }
  const said = body.error ? body.error.description : "error";
  if (body.status !== "success") throw body.error && body.error.number >= 404000 && body.error.number < 405000 ? new NotFound(said) : new Error(said);
  return body.data;
}

const fmt = {
  n: (v) => (v === null || v === undefined ? "—" : String(v)),
  s: (v) => (v === null || v === undefined ? "—" : v < 10 ? v.toFixed(2) + " s" : Math.round(v) + " s"),
  d: (v) => (v ? v.replace("T", " ").replace("Z", "") : "—"),
};

function trail(...parts) {
  const nav = document.getElementById("trail");
  nav.replaceChildren(...parts.flatMap((p) => [el("span", { class: "sep", text: "/" }), p]));
}

function badge(status) {
  return el("span", { class: "badge " + status.toLowerCase(), "data-status": status, text: status });
}

function table(headers, rows, attrs) {
  return el(
    "table",
    attrs,
    el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows),
  );
}

// The last hour's throughput: one bar per bucket, successes below failures.
function chart(throughput) {
  const ns = "http://www.w3.org/2000/svg";
  const buckets = throughput.buckets;
  const top = Math.max(1, ...buckets.map((b) => b.SUCCESS + b.FAILURE));
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${buckets.length * 8} 24`);
  svg.setAttribute("class", "chart");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "Tasks finished per " + throughput.bucketSeconds / 60 + " minutes");
  buckets.forEach((b, i) => {
    let y = 24;
    for (const [kind, count] of [["ok", b.SUCCESS], ["ko", b.FAILURE]]) {
      const h = (count / top) * 22;
      if (!h) continue;
      y -= h;
      const rect = document.createElementNS(ns, "rect");
      Object.entries({ x: i * 8 + 1, y, width: 6, height: h, class: kind }).forEach(([k, v]) =>
        rect.setAttribute(k, v),
      );
      const title = document.createElementNS(ns, "title");
      title.textContent = `${b.SUCCESS} succeeded, ${b.FAILURE} failed`;
      rect.append(title);
      svg.append(rect);
    }
  });
  return svg;
}

async function overview() {
  trail(el("span", { text: "Services" }));
  const { services } = await api("/v1/admin/services");
  const rows = services.map((s) =>
    el(
      "tr",
      { "data-service": s.service },
      el("td", {}, el("a", { href: "/ui/services/" + encodeURIComponent(s.service), text: s.service })),
      ...["PENDING", "IN_PROGRESS"].map((st) => el("td", { class: "num", "data-count": st, text: fmt.n(s.tasks[st]) })),
      ...["SUCCESS", "FAILURE"].map((st) => el("td", { class: "num", "data-count": st, text: fmt.n(s.finishedLastHour[st]) })),
      el("td", {}, chart(s.throughput)),
      el("td", { class: "num", text: fmt.n(s.queues.in) }),
      el("td", { class: "num", text: fmt.n(s.queues.out) }),
      el("td", { class: "num", text: fmt.n(s.queues.dlq) }),
      el("td", { class: "num", text: fmt.s(s.oldestPendingAgeSeconds) }),
      el("td", { class: "num" }, `${fmt.s(s.runTimeSeconds.p50)} / ${fmt.s(s.runTimeSeconds.p95)}`),
    ),
  );
  const headers = [
    "Service", "PENDING", "IN_PROGRESS", "SUCCESS (1 h)", "FAILURE (1 h)", "Throughput (1 h)", "-in", "-out", "-dlq", "Oldest pending", "Run p50 / p95",
  ];
  return [
    el("h1", { text: "Services" }),
    services.length ? table(headers, rows, { id: "services" }) : el("p", { class: "muted", text: "No services yet." }),
  ];
}

function taskRows(tasks, withError) {
  return tasks.map((t) =>
    el(
      "tr",
      { "data-task": t.taskId },
      el("td", {}, el("a", { href: "/ui/tasks/" + t.taskId, class: "mono", text: t.taskId })),
      el("td", { text: t.clientId }),
      el("td", {}, badge(t.status)),
      el("td", { text: fmt.d(t.submitionDate) }),
      el("td", { text: fmt.d(t.endDate) }),
      withError ? el("td", { class: "error", text: t.errorMessage || "" }) : null,
    ),
  );
}

const filters = {};

async function service(name) {
  trail(el("a", { href: "/ui/", text: "Services" }), el("span", { text: name }));
  const base = "/v1/admin/services/" + encodeURIComponent(name) + "/tasks";
  const status = filters[name] || "";
  const [recent, failures] = await Promise.all([
    api(base + "?limit=50" + (status ? "&status=" + status : "")),
    api(base + "?limit=10&status=FAILURE"),
  ]);
  const select = el(
    "select",
    { id: "status-filter", onchange: (e) => { filters[name] = e.target.value; refresh(); } },
    el("option", { value: "", text: "every status" }),
    ...STATUSES.map((s) => el("option", { value: s, text: s })),
  );
  select.value = status;
  return [
    el("h1", { text: name }),
    el("section", {},
      el("h2", { text: "Recent tasks " }, select),
      recent.tasks.length
        ? table(["Task", "Client", "Status", "Submitted", "Ended"], taskRows(recent.tasks, false), { id: "tasks" })
        : el("p", { class: "muted", text: "No tasks." }),
    ),
    el("section", {},
      el("h2", { text: "Recent failures" }),
      failures.tasks.length
        ? table(["Task", "Client", "Status", "Submitted", "Ended", "Error"], taskRows(failures.tasks, true), { id: "failures" })
        : el("p", { class: "muted", text: "No failures." }),
    ),
  ];
}

function fields(pairs) {
  return el(
    "dl",
    { class: "fields" },
    ...pairs.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { "data-field": k }, v)]),
  );
}

// The last block drawn per name ("request", "response"), with the compact JSON it shows: an
// unchanged value keeps its node at each refresh instead of being rebuilt and laid out again.
const jsonBlocks = new Map();

function jsonBlock(name, value) {
  const compact = JSON.stringify(value) ?? "null";
  const kept = jsonBlocks.get(name);
  if (kept && kept.compact === compact) return kept.node;
  // Indentation multiplies deep JSON (2 spaces a level): pretty only while that stays small.
  const pretty = compact.length <= PRETTY_CHARS ? JSON.stringify(value, null, 2) : compact;
  const text = pretty.length <= PRETTY_CHARS * 4 ? pretty : compact;
  const left = text.length - SHOWN_CHARS;
  const node = el(
    "div",
    { id: name },
    el("pre", { text: left > 0 ? text.slice(0, SHOWN_CHARS) : text }),
    left > 0 ? el("p", { class: "muted omitted", text: `… ${left.toLocaleString("en")} more characters not shown` }) : null,
  );
  jsonBlocks.set(name, { compact, node });
  return node;
}

async function task(id) {
  const t = await api("/v1/admin/tasks/" + encodeURIComponent(id));
  trail(
    el("a", { href: "/ui/", text: "Services" }),
    el("a", { href: "/ui/services/" + encodeURIComponent(t.service), text: t.service }),
    el("span", { class: "mono", text: id }),
  );
  const attempts = t.attempts.map((a) =>
    el("tr", {},
      el("td", { class: "mono", text: a.attemptId }),
      el("td", { text: a.workerHost || "—" }),
      el("td", { text: fmt.d(a.startDate) }),
      el("td", { text: fmt.d(a.endDate) }),
      el("td", { text: a.outcome || "running" }),
      el("td", { class: "error", text: a.errorMessage || "" }),
    ),
  );
  return [
    el("h1", {}, "Task ", el("span", { class: "mono", text: t.taskId })),
    fields([
      ["Status", badge(t.status)],
      ["Service", t.service],
      ["Client", t.clientId],
      ["Submitted", fmt.d(t.submitionDate)],
      ["Not before", fmt.d(t.notBefore)],
      ["Started", fmt.d(t.startDate)],
      ["Ended", fmt.d(t.endDate)],
      ["Progress", t.progress + " %"],
      ["Worker", t.workerHost || "—"],
      ["Calls", String(t.deliveries)],
      ["Error", el("span", { class: "error", id: "error-message", text: t.errorMessage || "—" })],
      ["Callback", t.callback ? `${t.callback.url} — ${t.callback.status || "not due"} after ${t.callback.rounds} round(s)` : "—"],
    ]),
    el("h2", { text: "Attempts" }),
    attempts.length
      ? table(["Attempt", "Worker", "Started", "Ended", "Outcome", "Error"], attempts, { id: "attempts" })
      : el("p", { class: "muted", text: "Not started." }),
    el("h2", { text: "Request" }),
    jsonBlock("request", t.request),
    t.status === "SUCCESS" ? el("h2", { text: "Response" }) : null,
    t.status === "SUCCESS" ? jsonBlock("response", t.response) : null,
  ];
}

function login(message) {
  clearInterval(timer);
  trail(el("span", { text: "Log in" }));
  document.getElementById("logout").hidden = true;
  const id = el("input", { id: "operator-id", name: "id", autocomplete: "username", required: "" });
  const secret = el("input", { id: "operator-secret", name: "secret", type: "password", autocomplete: "current-password", required: "" });
  const form = el(
    "form",
    {
      id: "login",
      onsubmit: (e) => {
        e.preventDefault();
        const raw = new TextEncoder().encode(id.value + ":" + secret.value);
        sessionStorage.setItem(KEY, btoa(String.fromCharCode(...raw)));
        start();
      },
    },
    el("h1", { text: "Operators only" }),
    message ? el("p", { class: "error", role: "alert", text: message }) : null,
    el("label", {}, "Operator id", id),
    el("label", {}, "Secret", secret),
    el("button", { type: "submit", text: "Log in" }),
  );
  main().replaceChildren(form);
}

function route() {
  const path = decodeURIComponent(location.pathname.replace(/^\/ui\/?/, ""));
  const [kind, ...rest] = path.split("/");
  if (kind === "services" && rest.length) return () => service(rest.join("/"));
  if (kind === "tasks" && rest.length) return () => task(rest.join("/"));
  return overview;
}

let timer = null;
let drawing = false;

async function refresh() {
  if (drawing) return;
  drawing = true;
  const live = document.getElementById("live");
  try {
    const nodes = await route()();
    main().replaceChildren(...nodes.filter((n) => n));
    live.textContent = "live · " + new Date().toLocaleTimeString();
    live.classList.remove("stale");
  } catch (err) {
    if (err instanceof Forbidden) {
      const tried = sessionStorage.getItem(KEY) !== null;
      sessionStorage.removeItem(KEY);
      login(tried ? "Wrong operator id or secret." : "");
    } else if (err instanceof NotFound) {
      main().replaceChildren(
        el("p", { class: "error", role: "alert", text: err.message }),
        el("p", {}, el("a", { href: "/ui/", text: "Services" })),
      );
      live.textContent = "live · " + new Date().toLocaleTimeString();
      live.classList.remove("stale");
    } else {
      live.textContent = "not refreshed: " + err.message;
      live.classList.add("stale");
    }
  } finally {
    drawing = false;
  }
}

function start() {
  if (!sessionStorage.getItem(KEY)) return login("");
  document.getElementById("logout").hidden = false;
  clearInterval(timer);
  refresh();
  timer = setInterval(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    login("");
  });
  start();
});
