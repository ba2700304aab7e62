// triage console: the traffic page's live numbers, polled every second from /console/api/traffic.
// Values are put in with textContent only (never as HTML): a request id or model name is text.
"use strict";
(function () {
  const stats = document.getElementById("all-stats");
  if (!stats) return;
  const status = document.getElementById("live-status");
  const dash = (v) => (v === null || v === undefined ? "–" : String(v));
  const money = (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(6));

  function cell(row, text, href) {
    const td = document.createElement("td");
    if (href) {
      const a = document.createElement("a");
      a.href = href;
      a.textContent = text;
      td.appendChild(a);
    } else {
      td.textContent = text;
    }
    row.appendChild(td);
  }

  function fill(tableId, rows, columns) {
    const body = document.querySelector("#" + tableId + " tbody");
    const fresh = document.createElement("tbody");
    for (const r of rows) {
      const tr = document.createElement("tr");
      for (const c of columns) cell(tr, c.text(r), c.href ? c.href(r) : null);
      fresh.appendChild(tr);
    }
    body.replaceWith(fresh);
  }

  function spark(svg, series, errors) {
    const most = Math.max(1, ...series);
    const points = (s) => s.map((v, i) => `${(i * 240) / Math.max(1, s.length - 1)},${38 - (v / most) * 36}`).join(" ");
    svg.replaceChildren();
    for (const [s, cls] of [[series, ""], [errors, "bad"]]) {
      const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
      line.setAttribute("points", points(s));
      if (cls) line.setAttribute("class", cls);
      svg.appendChild(line);
    }
  }

  async function tick() {
    try {
      const r = await fetch("/console/api/traffic", { credentials: "same-origin", cache: "no-store" });
      if (r.status === 401) {
        window.location.assign("/console/login?next=%2Fconsole");
        return;
      }
      const t = await r.json();
      for (const dd of stats.querySelectorAll("dd[data-k]")) dd.textContent = dash(t.all[dd.dataset.k]);
      fill("by-table", t.by, [
        { text: (r) => r.surface }, { text: (r) => r.model }, { text: (r) => dash(r.requests) }, { text: (r) => dash(r.rps) },
        { text: (r) => dash(r.p50) }, { text: (r) => dash(r.p95) }, { text: (r) => dash(r.p99) },
        { text: (r) => dash(r.client_errors) }, { text: (r) => dash(r.server_errors) },
      ]);
      fill("latest-table", t.latest, [
        { text: (r) => r.request_id, href: (r) => "/console/requests/" + encodeURIComponent(r.request_id) + (r.key == null ? "" : "?key=" + encodeURIComponent(r.key)) },
        { text: (r) => r.surface }, { text: (r) => dash(r.model) }, { text: (r) => dash(r.served) },
        { text: (r) => dash(r.status) }, { text: (r) => dash(r.latency_ms) }, { text: (r) => money(r.cost) },
      ]);
      spark(document.getElementById("spark"), t.per_second, t.errors_per_second);
      status.textContent = "";
    } catch (e) {
      status.textContent = "(not updating: " + e.message + ")";
    }
  }
  tick();
  setInterval(tick, 1000);
})();
