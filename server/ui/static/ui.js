// The batches page: swap in fresh server-rendered rows every second, and keep one plan-report
// card per batch (GET /v1/batches/{id}/report + its .png), shown as soon as the worker has one.
"use strict";

const REFRESH_MS = 1000;
const REPORT_RETRY_MS = 2000;
const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);
const reports = new Map(); // batch id -> {card, loadedFor: status or null, triedAt}

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

function shown(value) {
  if (typeof value === "number" && !Number.isInteger(value)) return value.toPrecision(4);
  if (value === null || value === undefined) return "–";
  return String(value);
}

// Scalars of the report, one level of nesting flattened ("predicted.makespan_s").
function figures(report) {
  const out = [];
  for (const [k, v] of Object.entries(report)) {
    if (v !== null && typeof v === "object" && !Array.isArray(v)) {
      for (const [k2, v2] of Object.entries(v)) {
        if (v2 === null || typeof v2 !== "object") out.push([`${k}.${k2}`, v2]);
      }
    } else if (!Array.isArray(v)) {
      out.push([k, v]);
    }
  }
  return out.slice(0, 24);
}

function card(id) {
  let entry = reports.get(id);
  if (!entry) {
    const node = el("article", { class: "report", "data-batch-id": id });
    node.append(el("h3", {}, id), el("div", { class: "report-body" }));
    node.querySelector(".report-body").append(el("p", { class: "none" }, "no report yet"));
    entry = { card: node, loadedFor: null, triedAt: 0 };
    reports.set(id, entry);
  }
  return entry;
}

function renderReport(entry, id, report) {
  const body = entry.card.querySelector(".report-body");
  body.replaceChildren();
  const dl = el("dl");
  for (const [k, v] of figures(report)) dl.append(el("dt", {}, k), el("dd", {}, shown(v)));
  body.append(dl);
  const img = el("img", {
    class: "plan-plot",
    alt: "compute and memory time per engine step",
    src: `/v1/batches/${encodeURIComponent(id)}/report.png?t=${Date.now()}`,
  });
  img.addEventListener("error", () => img.replaceWith(el("p", { class: "none" }, "no plot yet")));
  body.append(img);
}

async function loadReport(entry, id, status) {
  entry.triedAt = Date.now();
  const resp = await fetch(`/v1/batches/${encodeURIComponent(id)}/report`, {
    credentials: "same-origin",
  });
  if (resp.status === 404) {
    // "no report yet" stays; a finished batch without one will not get one: stop asking
    if (TERMINAL.has(status)) entry.loadedFor = status;
    return;
  }
  if (!resp.ok) return;
  renderReport(entry, id, await resp.json());
  entry.loadedFor = status;
}

function syncReports(rows) {
  const section = document.getElementById("reports");
  const ids = [];
  for (const row of rows) {
    const id = row.dataset.batchId;
    const status = row.dataset.status;
    ids.push(id);
    const entry = card(id);
    section.append(entry.card); // same order as the table
    const final = entry.loadedFor !== null && TERMINAL.has(entry.loadedFor);
    const stale = entry.loadedFor !== status;
    if (!final && stale && Date.now() - entry.triedAt > REPORT_RETRY_MS) {
      loadReport(entry, id, status).catch(() => {});
    }
  }
  for (const [id, entry] of reports) {
    if (!ids.includes(id)) {
      entry.card.remove();
      reports.delete(id);
    }
  }
}

async function refresh() {
  try {
    const resp = await fetch("/ui/rows", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401) {
      window.location.reload(); // signed out elsewhere: back to the key form
      return;
    }
    if (resp.ok) document.getElementById("rows").innerHTML = await resp.text();
  } catch (e) {
    // the server is restarting: keep the last rows and try again
  }
  syncReports(document.querySelectorAll("#rows tr.batch"));
}

syncReports(document.querySelectorAll("#rows tr.batch"));
setInterval(refresh, REFRESH_MS);
