// patchserve operator page: fetches the server-rendered fragments with the bearer token, and sends the actions
// (rollback, delete, cancel, predict) to the JSON API. No framework, no build step.
"use strict";
const tokenInput = document.getElementById("token");
tokenInput.value = sessionStorage.getItem("patchserve-token") || "";
tokenInput.addEventListener("change", () => {
  sessionStorage.setItem("patchserve-token", tokenInput.value.trim());
  refreshAll();
});

function headers(extra) {
  const token = tokenInput.value.trim();
  return Object.assign(token ? { Authorization: "Bearer " + token } : {}, extra || {});
}

function say(text, isError) {
  const line = document.getElementById("message");
  line.textContent = text;
  line.className = isError ? "error" : "";
}

async function detail(response) {
  try { return (await response.json()).detail; } catch (e) { return response.statusText; }
}

const openTasks = new Set();  // tasks whose versions are shown: they stay open when the table refreshes

async function load(el) {
  const response = await fetch(el.dataset.src, { headers: headers() });
  if (!response.ok) {
    el.innerHTML = "";
    say(`${el.dataset.src}: ${await detail(response)} (HTTP ${response.status})`, true);
    return;
  }
  el.innerHTML = await response.text();
  if (el.id === "tasks") {
    for (const task of openTasks) await showVersions(task);
  }
}

function refreshAll() {
  say("");
  document.querySelectorAll("[data-src]").forEach(load);
}

async function call(method, url, body) {
  const response = await fetch(url, {
    method, headers: headers(body ? { "content-type": "application/json" } : {}),
    body: body ? JSON.stringify(body) : undefined,
  });
  if (!response.ok) {
    say(`${method} ${url}: ${await detail(response)} (HTTP ${response.status})`, true);
    return null;
  }
  return response.json();
}

async function showVersions(task) {
  const row = document.getElementById("versions-" + task);
  if (!row) { openTasks.delete(task); return; }  // the task is gone
  row.hidden = false;
  row.firstElementChild.dataset.src = "/ui/fragments/tasks/" + encodeURIComponent(task);
  await load(row.firstElementChild);
}

async function toggleVersions(task) {
  if (openTasks.has(task)) {
    openTasks.delete(task);
    document.getElementById("versions-" + task).hidden = true;
  } else {
    openTasks.add(task);
    await showVersions(task);
  }
}

document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-action]");
  if (!button) return;
  const { action, task, version, job } = button.dataset;
  if (action === "versions") {
    await toggleVersions(task);
  } else if (action === "rollback") {
    const done = await call("POST", `/tasks/${encodeURIComponent(task)}/rollback`, { version: Number(version) });
    if (done) { say(`${task}: version ${done.version} is current`); await load(document.getElementById("tasks")); }
  } else if (action === "delete") {
    if (!confirm(`Delete ${task} and all its versions?`)) return;
    if (await call("DELETE", `/tasks/${encodeURIComponent(task)}`)) {
      openTasks.delete(task);
      say(`${task} deleted`);
      await load(document.getElementById("tasks"));
    }
  } else if (action === "cancel") {
    const done = await call("POST", `/jobs/${job}/cancel`);
    if (done) { say(`job ${job.slice(0, 8)}: ${done.status === "cancelled" ? "cancelled" : "stopping"}`); await load(document.getElementById("jobs")); }
  }
});

document.getElementById("try").addEventListener("submit", async (event) => {
  event.preventDefault();
  const task = document.getElementById("try-task").value.trim();
  const inputs = document.getElementById("try-inputs").value.split("\n").map((s) => s.trim()).filter(Boolean);
  const answer = await call("POST", `/tasks/${encodeURIComponent(task)}/predict`, { inputs, top_k: 3 });
  const out = document.getElementById("answer");
  if (!answer) { out.textContent = ""; return; }
  out.textContent = answer.predictions.map((p, i) => {
    const shown = p.tokens ? p.tokens.map((t) => `${t.token}/${t.label}`).join(" ")
      : p.value !== undefined ? p.value.toFixed(4)
      : (p.top_k || []).map((s) => `${s.label} ${s.score.toFixed(3)}`).join(", ");
    return `${inputs[i]}\n  -> ${shown}${p.truncated ? " (truncated)" : ""}`;
  }).join("\n") + `\n(${answer.task} v${answer.version})`;
});

refreshAll();
document.querySelectorAll("[data-every]").forEach((el) => {
  setInterval(() => { if (!document.hidden) load(el); }, 1000 * Number(el.dataset.every));
});
