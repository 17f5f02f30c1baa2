// The dashboard page: reads /dashboard/stream (server-sent events of engine snapshots, see
// tokenloom/engine/snapshot.py) with fetch() so the API key travels in a header, never in the URL
// (EventSource cannot send headers), and draws each snapshot on canvases. Plain JS, no build step.
// Every view writes what it drew into data-* attributes too, so tests read the page, not our guesses.
// In replay mode (body data-mode="replay", `tokenloom dashboard-replay`) the page opens no stream:
// dashboard_replay.js feeds recorded frames to the same `render` (window.tokenloomDashboard).
"use strict";
(function () {
  const KEY_ITEM = "tokenloom-dashboard-key";  // set by the login form (dashboard_login.html)
  const RATE = 5;  // frames per second asked of the server (it allows 0.2 to 10)
  // The timeline shows the last minute; a replay sets the window to its runs' length (setWindow), so a
  // run of seconds is not a sliver at the right edge. The charts' window never gets shorter than it.
  let TIMELINE_S = 60;
  const css = getComputedStyle(document.documentElement);
  const C = {};
  for (const name of ["ink", "muted", "line", "prefill", "decode", "draft", "queued", "free", "used", "cached",
    "shared", "swapped", "finished", "aborted"]) C[name] = css.getPropertyValue("--" + name).trim();
  const $ = (id) => document.getElementById(id);
  // The page's own ?model= (a multi-model server) goes to the stream too, so both show one model.
  const model = new URLSearchParams(location.search).get("model");
  const streamPath = location.pathname.replace(/\/+$/, "") + "/stream?rate=" + RATE +
    (model ? "&model=" + encodeURIComponent(model) : "");

  // -- the stream ---------------------------------------------------------------------------------

  function setStatus(text, kind) {
    const el = $("status");
    el.textContent = text;
    el.className = "status " + kind;
  }

  async function connect() {
    const headers = {};
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) headers.Authorization = "Bearer " + key;
    setStatus("connecting", "connecting");
    let res;
    try {
      res = await fetch(streamPath, { headers, cache: "no-store" });
    } catch (err) {
      setStatus("disconnected; retrying", "error");
      setTimeout(connect, 2000);
      return;
    }
    if (res.status === 401) {
      sessionStorage.removeItem(KEY_ITEM);
      setStatus("the API key was refused: reload the page to enter it", "error");
      return;
    }
    if (!res.ok) {
      let message = "HTTP " + res.status;
      try { message = (await res.json()).error.message; } catch (err) { /* not JSON */ }
      setStatus(message + "; retrying", "error");
      setTimeout(connect, res.status === 503 ? 5000 : 2000);
      return;
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          onEvent(event);
        }
      }
    } catch (err) { /* the connection dropped: reconnect below */ }
    setStatus("disconnected; retrying", "error");
    setTimeout(connect, 2000);
  }

  function onEvent(text) {
    let name = "message", data = "";
    for (const line of text.split("\n")) {
      if (line.startsWith("data: ")) data += line.slice(6);
      else if (line.startsWith("event: ")) name = line.slice(7);
    }
    if (!data) return;  // a comment (keep-alive) or the retry hint
    if (name === "end") { setStatus("the server is shutting down", "error"); return; }
    const snap = JSON.parse(data);
    if (snap.error) { setStatus(snap.error, "error"); return; }
    setStatus("live", "live");
    render(snap);
  }

  // -- drawing helpers ----------------------------------------------------------------------------

  function canvas2d(id) {
    const cv = $(id);
    const ratio = window.devicePixelRatio || 1;
    const width = cv.clientWidth, height = cv.clientHeight;
    if (cv.width !== Math.round(width * ratio) || cv.height !== Math.round(height * ratio)) {
      cv.width = Math.round(width * ratio);
      cv.height = Math.round(height * ratio);
    }
    const ctx = cv.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    return { cv, ctx, width, height };
  }

  function legend(id, items) {
    const el = $(id);
    el.replaceChildren(...items.map(([color, label]) => {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = color;
      span.append(swatch, label);
      return span;
    }));
  }

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(value)));
    for (const m of [1, 2, 2.5, 5, 10]) if (value <= m * p) return m * p;
    return 10 * p;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    return Number(value).toFixed(digits === undefined ? 0 : digits);
  }

  function shortId(id) {
    return id.length > 22 ? id.slice(0, 10) + "…" + id.slice(-10) : id;
  }

  // -- the views ----------------------------------------------------------------------------------

  let lastSnap = null;

  function render(snap) {
    lastSnap = snap;
    document.body.dataset.step = snap.step.number;
    $("model").textContent = snap.model;
    $("plan").textContent = snap.plan;
    const s = snap.server;
    const summary = [
      ["step", snap.step.number],
      ["step time", fmt(snap.step.duration_ms, 1) + " ms"],
      ["running", snap.num_running + " / " + snap.config.max_num_seqs],
      ["waiting", snap.num_waiting],
      ["swapped", snap.num_swapped],
      ["preemptions", snap.num_preemptions],
      ["batching", snap.config.batching],
      // SLO attainment of finished requests (TTFT / TPOT / both), once any had an SLO.
      ...(snap.slo && snap.slo.requests ? [["SLO met ttft/tpot/both", ["ttft", "tpot", "both"].map(
        (k) => Math.round(100 * snap.slo[k] / snap.slo.requests) + "%").join(" / ") + " of " + snap.slo.requests +
        " · goodput " + fmt(snap.slo.goodput, 2) + "/s"]] : []),
      // Live: who else watches; a recorded frame has no server, but a time on its run's engine clock.
      s ? ["viewers", s.viewers + " / " + s.max_viewers] : ["engine time", fmt(snap.now, 2) + " s"],
    ];
    $("summary").replaceChildren(...summary.map(([k, v]) => {
      const span = document.createElement("span");
      const b = document.createElement("b");
      b.textContent = v;
      span.append(k + " ", b);
      return span;
    }));
    fillModels(snap.overview);
    drawBatch(snap);
    drawKV(snap);
    fillQueues(snap);
    drawTimeline(snap.timeline);
    drawCharts(snap.series);
  }

  function drawBatch(snap) {
    const step = snap.step, rows = step.rows;
    const { cv, ctx, width, height } = canvas2d("batch");
    const budget = step.budget;
    const left = 150, right = 60, top = 34, rowH = 16;
    const plot = width - left - right;
    const x = (tokens) => left + plot * Math.min(tokens / budget, 1);
    let prefill = 0, decode = 0, drafts = 0;
    for (const r of rows) {
      if (r.kind === "prefill") prefill += r.tokens; else { decode += r.tokens - r.drafts; drafts += r.drafts; }
    }
    // The whole budget as one bar: how this step's tokens were split.
    ctx.fillStyle = C.free;
    ctx.fillRect(left, 6, plot, 14);
    let at = left;
    for (const [tokens, color] of [[prefill, C.prefill], [decode, C.decode], [drafts, C.draft]]) {
      const w = plot * tokens / budget;
      ctx.fillStyle = color;
      ctx.fillRect(at, 6, w, 14);
      at += w;
    }
    ctx.fillStyle = C.ink;
    ctx.textAlign = "right";
    ctx.fillText("token budget", left - 8, 13);
    ctx.textAlign = "left";
    ctx.fillText(step.used + " / " + budget, left + plot + 6, 13);
    // One bar per request, on the same scale; a decode's single token still shows.
    const fit = Math.max(Math.floor((height - top - 18) / rowH), 1);
    const shown = rows.slice(0, fit);
    shown.forEach((r, i) => {
      const y = top + i * rowH;
      ctx.fillStyle = C.ink;
      ctx.textAlign = "right";
      ctx.fillText(shortId(r.id), left - 8, y + rowH / 2);
      const base = r.kind === "prefill" ? r.tokens : r.tokens - r.drafts;
      const w = Math.max(x(base) - left, 3);
      ctx.fillStyle = r.kind === "prefill" ? C.prefill : C.decode;
      ctx.fillRect(left, y + 2, w, rowH - 4);
      if (r.drafts) {
        ctx.fillStyle = C.draft;
        ctx.fillRect(left + w, y + 2, Math.max(plot * r.drafts / budget, 2), rowH - 4);
      }
      ctx.fillStyle = C.muted;
      ctx.textAlign = "left";
      const label = r.tokens + " tok · ctx " + r.context + (r.drafts ? " · " + r.drafts + " drafts" : "");
      ctx.fillText(label, Math.min(left + w + 6 + (r.drafts ? plot * r.drafts / budget : 0), width - 110), y + rowH / 2);
    });
    // The budget line and the axis.
    const axisY = Math.max(top + shown.length * rowH + 4, top + 4);
    ctx.strokeStyle = C.aborted;
    ctx.setLineDash([4, 3]);
    ctx.beginPath(); ctx.moveTo(x(budget), top - 4); ctx.lineTo(x(budget), axisY); ctx.stroke();
    ctx.setLineDash([]);
    ctx.strokeStyle = C.line;
    ctx.beginPath(); ctx.moveTo(left, axisY); ctx.lineTo(left + plot, axisY); ctx.stroke();
    ctx.fillStyle = C.muted;
    ctx.textAlign = "center";
    for (const f of [0, 0.25, 0.5, 0.75, 1]) ctx.fillText(String(Math.round(budget * f)), x(budget * f), axisY + 9);
    ctx.fillText("tokens this step", left + plot / 2, axisY + 22);
    if (!rows.length) {
      ctx.fillStyle = C.muted;
      ctx.fillText(snap.num_running ? "no row of the last step is still running" : "idle: nothing running", left, top + 8);
    } else if (rows.length > shown.length) {
      ctx.fillStyle = C.muted;
      ctx.fillText("+ " + (rows.length - shown.length) + " more rows", left, height - 6);
    }
    $("batch-caption").textContent = "step " + step.number + ": " + rows.length + " rows, " + prefill +
      " prompt-chunk + " + decode + " decode" + (drafts ? " + " + drafts + " draft" : "") + " tokens of " + budget +
      (step.preempted ? " · " + step.preempted + " preempted" : "");
    cv.dataset.ids = rows.map((r) => r.id).join(",");
    cv.dataset.kinds = rows.map((r) => r.kind).join(",");
    cv.dataset.used = step.used;
    legend("batch-legend", [[C.prefill, "prompt chunk (prefill)"], [C.decode, "decode"], [C.draft, "speculative drafts"],
      [C.aborted, "budget (max_num_batched_tokens, dashed)"]]);
  }

  // Which request holds each block (from the rows' block_runs): for the hover text and the selection.
  function kvOwners(snap) {
    const owners = new Map();
    for (const r of [...snap.running, ...snap.waiting]) {
      for (const [first, count] of r.block_runs || []) {
        for (let b = first; b < first + count; b++) {
          if (!owners.has(b)) owners.set(b, []);
          owners.get(b).push(r.id);
        }
      }
    }
    return owners;
  }

  const KV_STATES = ["free", "in use", "cached for reuse", "shared"];
  let selected = null;  // a request picked in the Running table or on the map: its blocks are outlined
  let kvLayout = null;  // what the last drawKV put where, for the pointer

  function select(id) {
    selected = selected === id ? null : id;
    if (lastSnap) render(lastSnap);
  }

  function drawKV(snap) {
    const kv = snap.kv, blockSize = snap.config.block_size;
    const { cv, ctx, width, height } = canvas2d("kv");
    const hostRows = kv.host_blocks ? 1 : 0;
    const n = kv.num_blocks;
    // The largest square cell that fits every block (and a row for the host pool's count).
    let cell = Math.max(Math.floor(Math.sqrt((width * (height - 24 * hostRows)) / n)), 2);
    while (cell > 2 && Math.floor(width / cell) * Math.floor((height - 24 * hostRows) / cell) < n) cell--;
    const cols = Math.max(Math.floor(width / cell), 1);
    const gap = cell >= 6 ? 1 : 0;
    const colors = [C.free, C.used, C.cached, C.shared];
    const map = kv.map;
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = colors[map.charCodeAt(i) - 48] || C.free;
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
    }
    const owners = kvOwners(snap);
    kvLayout = { cell, cols, n, map, owners };
    let selectedBlocks = 0;
    if (selected !== null) {  // the selected request's blocks, outlined in ink over their state colour
      ctx.strokeStyle = C.ink;
      ctx.lineWidth = Math.max(Math.min(cell / 4, 2), 1);
      for (const [b, ids] of owners) {
        if (!ids.includes(selected) || b >= n) continue;
        selectedBlocks++;
        ctx.strokeRect((b % cols) * cell + 0.5, Math.floor(b / cols) * cell + 0.5, cell - gap - 1, cell - gap - 1);
      }
      ctx.lineWidth = 1;
    }
    if (hostRows) {
      const y = height - 18;
      const w = width * 0.6;
      ctx.fillStyle = C.free;
      ctx.fillRect(0, y, w, 12);
      ctx.fillStyle = C.swapped;
      ctx.fillRect(0, y, w * kv.host_used / kv.host_blocks, 12);
      ctx.fillStyle = C.ink;
      ctx.textAlign = "left";
      ctx.fillText("host pool: " + kv.host_used + " / " + kv.host_blocks + " blocks swapped out", w + 6, y + 6);
    }
    const hit = kv.hit_rate === null || kv.hit_rate === undefined ? "–" : (100 * kv.hit_rate).toFixed(1) + "%";
    $("kv-caption").textContent = n + " blocks of " + blockSize + " tokens · in use " +
      (100 * kv.usage).toFixed(1) + "% · prefix-cache hit rate " + hit;
    Object.assign(cv.dataset, { free: kv.free, used: kv.used, cached: kv.cached, shared: kv.shared,
      hostUsed: kv.host_used, hitRate: kv.hit_rate === null ? "" : kv.hit_rate,
      selected: selected === null ? "" : selected, selectedBlocks });
    const items = [[C.free, "free " + kv.free], [C.used, "in use " + kv.used],
      [C.cached, "cached for reuse " + (kv.cached ?? "(operator only)")],
      [C.shared, "shared (>1 request) " + (kv.shared ?? "(operator only)")],
      [C.swapped, "swapped to host " + kv.host_used]];
    items.push(selected === null ? [C.line, "click a block or a running request to outline its blocks"]
      : [C.ink, "outlined: " + selectedBlocks + " blocks of " + shortId(selected) + " (click again to clear)"]);
    legend("kv-legend", items);
  }

  function fillTable(id, rows, cells, countId, total) {
    const body = $(id).tBodies[0];
    const trs = rows.map((r) => {
      const tr = document.createElement("tr");
      for (const value of cells(r)) {
        const td = document.createElement("td");
        td.textContent = value;
        tr.append(td);
      }
      tr.title = r.id + (r.prompt !== undefined ? "\nprompt: " + r.prompt + "\noutput: " + r.output : "");
      tr.dataset.id = r.id;
      if (r.id === selected) tr.className = "selected";
      return tr;
    });
    if (!trs.length) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = document.createElement("td");
      td.colSpan = 5;
      td.textContent = "empty";
      tr.append(td);
      trs.push(tr);
    }
    body.replaceChildren(...trs);
    $(countId).textContent = "(" + total + ")";
    $(id).dataset.ids = rows.map((r) => r.id).join(",");
  }

  function fillQueues(snap) {
    fillTable("waiting", snap.waiting, (r) => [r.id, fmt(r.age_s, 1), r.priority, r.prompt_tokens, r.preemptions],
      "waiting-count", snap.num_waiting);
    fillTable("swapped", snap.swapped, (r) => [r.id, fmt(r.age_s, 1), r.priority, r.host_blocks, r.preemptions],
      "swapped-count", snap.num_swapped);
    fillTable("running", snap.running, (r) => [r.id, fmt(r.age_s, 1), r.computed, r.output_tokens, r.blocks],
      "running-count", snap.num_running);
  }

  // A multi-model server's every model and cascade (server/multi_serve.py `overview`); the model this page
  // shows is in bold, each resident one's name a link to its own page.
  function fillModels(overview) {
    $("models-panel").hidden = !overview;
    if (!overview) return;
    const MiB = (bytes) => fmt(bytes / 1048576, 0);
    const shown = lastSnap.model;
    // One table row: a cell per value (text), then `first` (a cell node) before them when given.
    const row = (values, data, first) => {
      const tr = document.createElement("tr");
      if (first) tr.append(first);
      for (const value of values) {
        const td = document.createElement("td");
        td.textContent = value;
        tr.append(td);
      }
      Object.assign(tr.dataset, data);
      return tr;
    };
    const rows = overview.models.map((m) => {
      const name = document.createElement("td");
      if (m.status === "loaded") {
        const a = document.createElement("a");
        a.href = "?model=" + encodeURIComponent(m.name);
        a.textContent = m.name;
        name.append(a);
      } else name.textContent = m.name;
      const tr = row([m.status + (m.pinned ? " (pinned)" : ""), MiB(m.resident_bytes), m.in_flight,
        m.running ?? "", m.waiting ?? "", m.kv_usage === undefined ? "" : Math.round(100 * m.kv_usage) + "%",
        m.loads], {name: m.name, status: m.status}, name);
      if (m.name === shown) tr.className = "selected";
      return tr;
    });
    $("models").tBodies[0].replaceChildren(...rows);
    const pairs = (o) => Object.entries(o || {}).map(([k, v]) => k + " " + v).join(", ");
    const cascades = overview.cascades.map((c) => row(
      [c.name, c.tiers.join(" → "), c.requests, pairs(c.answered), pairs(c.escalations)],
      {name: c.name, requests: c.requests}));
    $("cascades").tBodies[0].replaceChildren(...cascades);
    $("cascades").hidden = !cascades.length;
    $("models-caption").textContent = "(" + MiB(overview.resident_bytes) + " MiB resident" +
      (overview.budget_bytes ? " of a " + MiB(overview.budget_bytes) + " MiB budget" : "") +
      ", " + overview.evictions + " evictions)";
  }

  function timeAxis(ctx, left, plot, y, windowS, step) {
    ctx.strokeStyle = C.line;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plot, y); ctx.stroke();
    ctx.fillStyle = C.muted;
    ctx.textAlign = "center";
    const ticks = Math.round(windowS / step);  // counted in whole ticks: fractional steps do not drift
    for (let k = 0; k <= ticks; k++) {
      const t = -windowS + k * step;
      const x = left + plot * (t + windowS) / windowS;
      ctx.fillText(k === ticks ? "now" : String(+t.toFixed(2)), x, y + 9);
    }
  }

  function drawTimeline(items) {
    const { cv, ctx, width, height } = canvas2d("timeline");
    const left = 150, right = 20, top = 4, bottom = 30;
    const plot = width - left - right;
    const fit = Math.max(Math.floor((height - top - bottom) / 12), 1);
    const shown = items.slice(-fit);
    const rowH = Math.min((height - top - bottom) / Math.max(shown.length, 1), 16);
    const x = (t) => left + plot * (Math.max(t, -TIMELINE_S) + TIMELINE_S) / TIMELINE_S;
    let preemptions = 0, aborted = 0;
    shown.forEach((r, i) => {
      const y = top + i * rowH;
      const mid = y + rowH / 2;
      const end = r.end === null ? 0 : r.end;
      ctx.fillStyle = C.ink;
      ctx.textAlign = "right";
      ctx.fillText(shortId(r.id), left - 8, mid);
      const segments = [
        [r.arrival, r.scheduled === null ? end : r.scheduled, C.queued],
        [r.scheduled, r.first_token === null ? end : r.first_token, C.prefill],
        [r.first_token, end, C.decode],
      ];
      for (const [a, b, color] of segments) {
        if (a === null || b === null || b < -TIMELINE_S) continue;
        ctx.fillStyle = color;
        ctx.fillRect(x(a), y + 2, Math.max(x(b) - x(a), 1.5), rowH - 4);
      }
      if (r.end !== null && r.end >= -TIMELINE_S) {
        const bad = r.reason === "abort" || r.reason === "error";
        if (bad) aborted++;
        ctx.strokeStyle = bad ? C.aborted : C.finished;
        ctx.lineWidth = 2;
        ctx.beginPath();
        if (bad) {  // a cross: aborted by its client, or failed
          ctx.moveTo(x(end) - 4, y + 2); ctx.lineTo(x(end) + 4, y + rowH - 2);
          ctx.moveTo(x(end) + 4, y + 2); ctx.lineTo(x(end) - 4, y + rowH - 2);
        } else {
          ctx.moveTo(x(end) + 1, y + 1); ctx.lineTo(x(end) + 1, y + rowH - 1);
        }
        ctx.stroke();
        ctx.lineWidth = 1;
      }
      for (const t of r.preempted) {  // a red triangle where the scheduler took its KV away
        if (t < -TIMELINE_S) continue;
        preemptions++;
        ctx.fillStyle = C.aborted;
        ctx.beginPath();
        ctx.moveTo(x(t), y + rowH - 1); ctx.lineTo(x(t) - 5, y); ctx.lineTo(x(t) + 5, y); ctx.closePath();
        ctx.fill();
      }
    });
    timeAxis(ctx, left, plot, height - bottom + 6, TIMELINE_S, niceMax(TIMELINE_S / 6));
    ctx.fillStyle = C.muted;
    ctx.textAlign = "left";
    ctx.fillText("seconds ago", left, height - 6);
    if (!shown.length) ctx.fillText("no request in the last minutes", left, top + 10);
    $("timeline-caption").textContent = "last " + TIMELINE_S + " s · " + items.length + " requests";
    Object.assign(cv.dataset, { ids: shown.map((r) => r.id).join(","), preemptions, aborted,
      live: shown.filter((r) => r.end === null).map((r) => r.id).join(",") });
    legend("timeline-legend", [[C.queued, "queued"], [C.prefill, "prefill"], [C.decode, "decode"],
      [C.finished, "finished"], [C.aborted, "aborted / failed (×), preempted (▼)"]]);
  }

  // A chart over the last minutes: x in seconds ago, y from 0 with a labelled unit.
  function chart(id, series, windowS, yLabel) {
    const { cv, ctx, width, height } = canvas2d(id);
    const left = 48, right = 10, top = 16, bottom = 30;
    const plotW = width - left - right, plotH = height - top - bottom;
    let maxY = 0;
    for (const s of series) for (const [, v] of s.points) if (v !== null && v > maxY) maxY = v;
    maxY = niceMax(maxY * 1.05);
    const x = (t) => left + plotW * (t + windowS) / windowS;
    const y = (v) => top + plotH * (1 - v / maxY);
    ctx.strokeStyle = C.line;
    ctx.fillStyle = C.muted;
    ctx.textAlign = "right";
    for (let k = 0; k <= 4; k++) {
      const v = maxY * k / 4;
      ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(left + plotW, y(v)); ctx.stroke();
      ctx.fillText(v >= 100 ? String(Math.round(v)) : String(+v.toFixed(1)), left - 4, y(v));
    }
    ctx.save();
    ctx.translate(10, top + plotH / 2);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "center";
    ctx.fillText(yLabel, 0, 0);
    ctx.restore();
    timeAxis(ctx, left, plotW, top + plotH, windowS, windowS > 120 ? 60 : windowS >= 60 ? 20 : niceMax(windowS / 6));
    ctx.textAlign = "right";
    ctx.fillText("seconds ago", left + plotW, height - 5);
    let count = 0;
    for (const s of series) {
      const pts = s.points.filter(([t, v]) => v !== null && t >= -windowS);
      count += pts.length;
      ctx.strokeStyle = ctx.fillStyle = s.color;
      if (s.dots) {
        for (const [t, v] of pts) { ctx.beginPath(); ctx.arc(x(t), y(v), 2.5, 0, 2 * Math.PI); ctx.fill(); }
      } else {
        ctx.lineWidth = 1.5;
        ctx.beginPath();
        pts.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
        ctx.stroke();
        ctx.lineWidth = 1;
      }
    }
    cv.dataset.points = count;
    cv.dataset.maxY = maxY;
  }

  function drawCharts(series) {
    const cols = {};
    series.columns.forEach((name, i) => (cols[name] = i));
    const buckets = series.buckets;
    // The window grows with the history, a minute at a time, up to what the server keeps.
    const oldest = buckets.length ? -buckets[0][cols.t] : 0;
    const windowS = oldest <= TIMELINE_S ? TIMELINE_S : Math.min(Math.max(Math.ceil(oldest / 60) * 60, 60), series.window_s);
    // Seconds without a step have no bucket: fill them with zeros so the throughput line drops.
    const byT = new Map(buckets.map((b) => [Math.round(b[cols.t]), b]));
    const gen = [], prompt = [], itl = [];
    const last = buckets.length ? Math.round(buckets[buckets.length - 1][cols.t]) : 0;
    for (let t = Math.min(-windowS, last); t <= last; t++) {
      const b = byT.get(t);
      gen.push([t, b ? b[cols.generated] : 0]);
      prompt.push([t, b ? b[cols.prompt] : 0]);
      if (b && b[cols.itl_ms] !== null) itl.push([t, b[cols.itl_ms]]);
    }
    chart("throughput", [{ points: prompt, color: C.prefill }, { points: gen, color: C.decode }], windowS, "tokens / s");
    legend("throughput-legend", [[C.decode, "generated tok/s"], [C.prefill, "prompt tok/s (prefill)"]]);
    chart("ttft", [{ points: series.ttft_ms, color: C.prefill, dots: true }], windowS, "TTFT (ms)");
    legend("ttft-legend", [[C.prefill, "one dot per request: first token − arrival, ms"]]);
    chart("itl", [{ points: itl, color: C.decode }], windowS, "ITL (ms)");
    legend("itl-legend", [[C.decode, "mean gap between a sequence's tokens, per second, ms"]]);
  }

  function kvBlockAt(event) {
    if (!kvLayout) return null;
    const rect = $("kv").getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / kvLayout.cell);
    const row = Math.floor((event.clientY - rect.top) / kvLayout.cell);
    const b = row * kvLayout.cols + col;
    return col < kvLayout.cols && b >= 0 && b < kvLayout.n ? b : null;
  }

  $("kv").addEventListener("mousemove", (event) => {
    const b = kvBlockAt(event);
    const ids = b === null ? [] : kvLayout.owners.get(b) || [];
    $("kv").title = b === null ? "" : "block " + b + ": " + KV_STATES[kvLayout.map.charCodeAt(b) - 48] +
      (ids.length ? " · " + ids.join(", ") : "");
  });
  $("kv").addEventListener("click", (event) => {
    const b = kvBlockAt(event);
    const ids = b === null ? [] : kvLayout.owners.get(b) || [];
    if (ids.length) select(ids[0]); else if (selected !== null) select(selected);
  });
  $("running").addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (tr && tr.dataset.id) select(tr.dataset.id);
  });

  window.addEventListener("resize", () => { if (lastSnap) render(lastSnap); });
  // For the replay: seconds the timeline and charts span at least (a nice round number above `seconds`).
  function setWindow(seconds) { TIMELINE_S = Math.min(niceMax(seconds), 60); }
  window.tokenloomDashboard = { render, setStatus, setWindow };
  if (document.body.dataset.mode !== "replay") connect();
})();
