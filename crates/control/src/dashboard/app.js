// nvpool's dashboard: reads the controller's JSON every two seconds and renders the
// summary, the migrations under way, and one page each of nodes and volumes. Search,
// sort and paging happen on the controller, so the page stays light for large pools.
"use strict";

const REFRESH_MS = 2000;
const PAGE = 50;
const tables = {
  nodes: { sort: "name", desc: false, offset: 0, q: "", total: 0 },
  volumes: { sort: "iops", desc: true, offset: 0, q: "", total: 0 },
};

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let u = 0;
  while (n >= 1024 && u < units.length - 1) { n /= 1024; u++; }
  return (u === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[u];
}

const count = (n) => Math.round(n).toLocaleString("en-US");
const mibs = (io) => ((io.read_bytes_per_second + io.write_bytes_per_second) / 1048576).toFixed(1);
const latency = (io) => (io.mean_latency_us > 0 ? io.mean_latency_us.toFixed(0) + " µs" : "–");
const iops = (io) => count(io.read_iops) + " / " + count(io.write_iops);

async function json(path) {
  const r = await fetch(path, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function query(name) {
  const t = tables[name];
  const p = new URLSearchParams({ q: t.q, sort: t.sort, desc: t.desc, offset: t.offset, limit: PAGE });
  return `/api/v1/${name}?${p}`;
}

function renderSummary(s) {
  const box = document.getElementById("summary");
  box.replaceChildren(
    el("span", {}, `${s.healthy_nodes}/${s.nodes} nodes healthy`),
    el("span", {}, `${s.volumes} volumes`),
    el("span", {}, `${s.attachments} attachments`),
    el("span", {}, `${bytes(s.used_bytes)} used of ${bytes(s.capacity_bytes)}`),
    el("span", { id: "pool-iops" }, `${count(s.io.read_iops + s.io.write_iops)} IOPS`),
    el("span", {}, `${mibs(s.io)} MiB/s`),
  );
  const section = document.getElementById("migrations-section");
  section.hidden = s.migrations.length === 0;
  document.querySelector("#migrations tbody").replaceChildren(...s.migrations.map((m) => {
    const done = m.allocated_bytes > 0 ? Math.min(1, m.copied_bytes / m.allocated_bytes) : 0;
    return el("tr", { "data-volume": m.volume },
      el("td", {}, m.volume), el("td", {}, m.from_node), el("td", {}, m.to_node), el("td", {}, m.phase),
      el("td", { class: "num" }, m.round),
      el("td", {}, el("progress", { class: "progress", max: "1", value: String(done) }),
        ` ${bytes(m.copied_bytes)} of ${bytes(m.allocated_bytes)} copied, ${bytes(m.dirty_bytes)} dirty`),
      el("td", { class: "num" }, bytes(m.rate) + "/s"));
  }));
}

function poolBar(p) {
  const pct = (v) => (p.capacity_bytes > 0 ? (100 * v) / p.capacity_bytes : 0).toFixed(1) + "%";
  return el("div", { class: "pool" },
    el("div", { class: "bar", title: `${p.name}: ${bytes(p.used_bytes)} used (${bytes(p.used_bytes - p.shared_bytes)} the volumes' own, ${bytes(p.shared_bytes)} shared: held by snapshots), ${bytes(p.provisioned_bytes)} provisioned` },
      el("div", { class: "provisioned", style: `width:${pct(p.provisioned_bytes)}` }),
      el("div", { class: "used", style: `width:${pct(p.used_bytes)}` }),
      el("div", { class: "shared", style: `width:${pct(p.shared_bytes)}` })),
    `${p.name} ${bytes(p.used_bytes)} / ${bytes(p.provisioned_bytes)} / ${bytes(p.capacity_bytes)}`,
    p.failed ? el("span", { class: "bad" }, " failed: " + p.failed) : "");
}

function renderNodes(t) {
  document.querySelector("#nodes tbody").replaceChildren(...t.items.map((n) => el("tr", { "data-node": n.name },
    el("td", {}, n.name, el("div", { class: "host" }, n.nvme_address + (n.engine_version ? " · " + n.engine_version : ""))),
    el("td", { class: n.healthy ? "ok" : "bad" }, n.healthy ? "healthy" : "down", n.engine_error ? ": " + n.engine_error : ""),
    el("td", {}, ...n.pools.map(poolBar)),
    el("td", { class: "num" }, n.volumes),
    el("td", { class: "num iops" }, iops(n.io)),
    el("td", { class: "num" }, mibs(n.io)),
    el("td", { class: "num" }, latency(n.io)))));
}

function paths(v) {
  if (v.attachments.length === 0) return [el("span", { class: "muted" }, "not attached")];
  return v.attachments.map((a) => el("div", {},
    el("div", { class: "host" }, a.host),
    ...(a.local ? [el("span", { class: "path local" }, `${v.node}: local device`)] :
      a.paths.map((p) => el("span", {
        class: `path ${p.healthy ? p.ana_state : "unhealthy"}`,
        title: p.owner ? "the owner" : "forwards to the owner",
      }, `${p.node}: ${p.ana_state}${p.owner ? " (owner)" : ""}`)))));
}

function renderVolumes(t) {
  document.querySelector("#volumes tbody").replaceChildren(...t.items.map((v) => el("tr", { "data-volume": v.name },
    el("td", {}, v.name, v.degraded ? el("div", { class: "bad" }, v.degraded) : ""),
    el("td", {}, v.node, el("div", { class: "host" }, v.pool),
      ...v.replicas.map((r) => el("div", { class: r.includes("in-sync") ? "host" : "bad" }, `replica ${r}`))),
    el("td", { class: "num" }, bytes(v.size_bytes)),
    el("td", {}, v.migration ? `moving to ${v.migration.to_node}` : v.state),
    el("td", {}, ...paths(v)),
    el("td", {}, v.limits || el("span", { class: "muted" }, "none")),
    el("td", { class: "num iops" }, iops(v.io)),
    el("td", { class: "num" }, mibs(v.io)),
    el("td", { class: "num" }, latency(v.io)))));
}

function renderPager(name) {
  const t = tables[name];
  const last = Math.max(0, Math.ceil(t.total / PAGE) - 1);
  const page = Math.floor(t.offset / PAGE);
  const go = (p) => { t.offset = Math.min(Math.max(p, 0), last) * PAGE; refresh(); };
  const prev = el("button", {}, "‹"); prev.onclick = () => go(page - 1); prev.disabled = page === 0;
  const next = el("button", {}, "›"); next.onclick = () => go(page + 1); next.disabled = page >= last;
  document.getElementById(`${name}-pager`).replaceChildren(prev, `page ${page + 1} of ${last + 1}`, next);
  document.getElementById(`${name}-count`).textContent = `(${t.total})`;
  for (const th of document.querySelectorAll(`#${name} th[data-sort]`)) {
    th.classList.toggle("sorted", th.dataset.sort === t.sort);
    th.classList.toggle("desc", th.dataset.sort === t.sort && t.desc);
  }
}

async function refresh() {
  try {
    const [s, n, v] = await Promise.all([json("/api/v1/summary"), json(query("nodes")), json(query("volumes"))]);
    renderSummary(s);
    tables.nodes.total = n.total; renderNodes(n); renderPager("nodes");
    tables.volumes.total = v.total; renderVolumes(v); renderPager("volumes");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("updated").textContent = "cannot read the controller: " + e.message;
  }
}

for (const name of Object.keys(tables)) {
  const t = tables[name];
  let typing;
  document.getElementById(`${name}-search`).addEventListener("input", (e) => {
    clearTimeout(typing);
    typing = setTimeout(() => { t.q = e.target.value; t.offset = 0; refresh(); }, 250);
  });
  for (const th of document.querySelectorAll(`#${name} th[data-sort]`)) {
    th.addEventListener("click", () => {
      t.desc = t.sort === th.dataset.sort ? !t.desc : th.dataset.sort !== "name" && th.dataset.sort !== "node";
      t.sort = th.dataset.sort;
      t.offset = 0;
      refresh();
    });
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
