// A plain Node HTTP function for the Conveyor dispatcher: no framework, no SDK.
// It exists to show that the function contract is language-agnostic: read the
// CloudEvents binary-mode headers, optionally POST progress, answer JSON.
//
//   POST /  <any JSON>  ->  200 {"echo": <body>, "taskId": <ce-id>, "attempt": <n>}
//   invalid JSON        ->  400 {"errorMessage": "invalid JSON"}  (failed, not retried)
"use strict";

const http = require("node:http");

const HOST = process.env.HOST || "127.0.0.1";
const PORT = Number(process.env.PORT || 8080);
const MAX_BODY_BYTES = 1 << 20;

function answer(res, status, payload) {
  const data = JSON.stringify(payload);
  res.writeHead(status, {
    "Content-Type": "application/json",
    "Content-Length": Buffer.byteLength(data),
  });
  res.end(data);
}

// Best effort: a lost progress report must never fail the task.
async function reportProgress(url, progress) {
  if (!url) return;
  try {
    const res = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ progress }),
      signal: AbortSignal.timeout(2000),
    });
    await res.arrayBuffer();
  } catch (err) {
    console.error(`progress report failed: ${err.message}`);
  }
}

async function handleTask(req, res, raw) {
  let body;
  try {
    body = JSON.parse(raw.toString("utf8"));
  } catch {
    return answer(res, 400, { errorMessage: "invalid JSON" });
  }
  const taskId = req.headers["ce-id"] || null;
  const attempt = Number(req.headers["x-conveyor-attempt"] || 1);
  console.log(`call ce-id=${taskId} attempt=${attempt}`);
  await reportProgress(req.headers["x-conveyor-progress-url"], 50);
  answer(res, 200, { echo: body, taskId, attempt });
}

const server = http.createServer((req, res) => {
  if (req.method === "GET" && (req.url === "/healthz" || req.url === "/readyz")) {
    return answer(res, 200, { status: "ok" });
  }
  if (req.method !== "POST") {
    return answer(res, 405, { errorMessage: "method not allowed" });
  }
  const chunks = [];
  let size = 0;
  req.on("data", (chunk) => {
    size += chunk.length;
    if (size > MAX_BODY_BYTES) {
      answer(res, 413, { errorMessage: "request too large" });
      req.destroy();
      return;
    }
    chunks.push(chunk);
  });
  req.on("end", () => {
    if (size <= MAX_BODY_BYTES) handleTask(req, res, Buffer.concat(chunks));
  });
});

server.keepAliveTimeout = 65000;
server.listen(PORT, HOST, () => {
  console.log(`node-echo listening on http://${HOST}:${server.address().port}/`);
});

function shutdown() {
  server.close(() => process.exit(0));
  server.closeIdleConnections();
  setTimeout(() => process.exit(0), 5000).unref();
}
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);
