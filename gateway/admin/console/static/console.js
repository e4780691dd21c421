// fleetgate console: the only script (the Content-Security-Policy allows no inline one).
// Asks before a revoke, and refreshes the live traffic tables from /admin/ui/traffic.json.
// Everything is written with textContent, never as HTML, so names are always shown as text.
"use strict";

const REFRESH_MS = 3000;

function num(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  return value.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

function fillTable(id, rows, cells) {
  const body = document.querySelector(`#${id} tbody`);
  if (!body) return;
  const fresh = document.createElement("tbody");
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const text of cells(row)) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    fresh.appendChild(tr);
  }
  body.replaceWith(fresh);
}

function showTraffic(data) {
  document.getElementById("window").textContent = String(data.window_s);
  fillTable("traffic-models", data.models, (r) => [
    r.model, num(r.requests_per_s, 2), num(r.p50_ms, 1), num(r.p99_ms, 1),
    num(r.errors_per_s, 2), num(r.queued, 0), num(r.total, 0),
  ]);
  fillTable("traffic-tenants", data.tenants, (r) => [
    r.tenant, num(r.requests_per_s, 2), num(r.errors_per_s, 2), num(r.queued, 0), num(r.total, 0),
  ]);
  if (data.kv_cache.length) {
    fillTable("traffic-kv", data.kv_cache, (r) => [r.deployment, `${num(r.usage * 100, 1)} %`]);
  }
  document.getElementById("updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
}

async function refreshTraffic(source) {
  try {
    const response = await fetch(source, { credentials: "same-origin", cache: "no-store" });
    if (response.status === 401) {
      window.location.reload(); // the session ended: show the sign-in form
      return;
    }
    if (response.ok) showTraffic(await response.json());
  } catch (err) {
    document.getElementById("updated").textContent = "Could not reach the gateway; retrying.";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const form of document.querySelectorAll("form.confirm")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
  const traffic = document.getElementById("traffic");
  if (traffic) {
    const source = traffic.dataset.source;
    setInterval(() => refreshTraffic(source), REFRESH_MS);
  }
});
