// Replay mode of the dashboard page (`tokenloom dashboard-replay`): recorded frames of one or more runs
// (engine/snapshot_recording.py; the lab records static, dynamic and continuous), loaded once from
// ./replay/data and drawn by the live page's own `render` (dashboard.js), one frame at a time.
// Controls: a tab per run, first / back / play / forward, a slider; keys ← → space Home End.
// Switching runs keeps the engine time (each run's clock starts at 0), so the runs are compared at
// the same moment; the strip below shows every run at that moment side by side.
"use strict";
(function () {
  const D = window.tokenloomDashboard;
  const $ = (id) => document.getElementById(id);
  const PLAY_FPS = 8;
  let data = null, run = 0, frame = 0, timer = null;

  const frames = (r) => data.runs[r === undefined ? run : r].frames;

  // The run's last frame at or before engine time t (its first if t is earlier).
  function frameAt(r, t) {
    const fs = frames(r);
    let lo = 0, hi = fs.length - 1;
    while (lo < hi) {
      const mid = Math.ceil((lo + hi) / 2);
      if (fs[mid].now <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  function show(r, f) {
    run = r;
    frame = Math.max(0, Math.min(f, frames().length - 1));
    const snap = frames()[frame];
    D.render(Object.assign({}, snap, { model: snap.model || data.model || "", plan: snap.plan || data.plan || "" }));
    const slider = $("replay-slider");
    slider.max = frames().length - 1;
    slider.value = frame;
    const rec = data.runs[run];
    $("replay-position").textContent = rec.label + ": frame " + (frame + 1) + " / " + frames().length +
      " · step " + snap.step.number + " of " + rec.num_steps + " · engine time " + snap.now.toFixed(3) + " s" +
      (rec.stride > 1 ? " · one frame every " + rec.stride + " steps" : "");
    for (const [i, tab] of Array.from($("replay-runs").children).entries()) {
      tab.setAttribute("aria-selected", String(i === run));
    }
    Object.assign(document.body.dataset, { replayRun: rec.label, replayFrame: frame });
    drawStrip(snap.now);
  }

  function drawStrip(t) {
    const rows = data.runs.map((rec, r) => {
      const snap = rec.frames[frameAt(r, t)];
      const last = rec.frames[rec.frames.length - 1];
      const finished = snap.timeline.filter((x) => x.end !== null && x.reason !== "abort").length;
      const state = t >= last.now ? "done at " + last.now.toFixed(2) + " s" : "running";
      const tr = document.createElement("tr");
      if (r === run) tr.className = "selected";
      for (const value of [rec.label, snap.step.number, snap.num_running, snap.num_waiting, finished,
        (100 * snap.kv.usage).toFixed(1) + "%", state]) {
        const td = document.createElement("td");
        td.textContent = value;
        tr.append(td);
      }
      tr.addEventListener("click", () => { pause(); show(r, frameAt(r, frames()[frame].now)); });
      return tr;
    });
    $("replay-strip").tBodies[0].replaceChildren(...rows);
  }

  function step(delta) { pause(); show(run, frame + delta); }

  function pause() {
    if (timer !== null) clearInterval(timer);
    timer = null;
    $("replay-play").textContent = "play";
  }

  function play() {
    if (timer !== null) { pause(); return; }
    if (frame >= frames().length - 1) show(run, 0);
    $("replay-play").textContent = "pause";
    timer = setInterval(() => {
      if (frame >= frames().length - 1) { pause(); return; }
      show(run, frame + 1);
    }, 1000 / PLAY_FPS);
  }

  function buildControls() {
    $("replay").hidden = false;
    const tabs = data.runs.map((rec, r) => {
      const b = document.createElement("button");
      b.type = "button";
      b.setAttribute("role", "tab");
      b.textContent = rec.label;
      b.addEventListener("click", () => { pause(); show(r, frameAt(r, frames()[frame].now)); });
      return b;
    });
    $("replay-runs").replaceChildren(...tabs);
    $("replay-first").addEventListener("click", () => { pause(); show(run, 0); });
    $("replay-back").addEventListener("click", () => step(-1));
    $("replay-forward").addEventListener("click", () => step(1));
    $("replay-play").addEventListener("click", play);
    $("replay-slider").addEventListener("input", (e) => { pause(); show(run, Number(e.target.value)); });
    document.addEventListener("keydown", (e) => {
      if (e.target instanceof HTMLInputElement) return;  // the slider moves itself (its input event shows the frame)
      if (e.target instanceof HTMLButtonElement && (e.key === " " || e.key === "Enter")) return;  // its own click
      const keys = { ArrowLeft: () => step(-1), ArrowRight: () => step(1), " ": play,
        Home: () => { pause(); show(run, 0); }, End: () => { pause(); show(run, frames().length - 1); } };
      if (keys[e.key]) { e.preventDefault(); keys[e.key](); }
    });
  }

  async function load() {
    D.setStatus("loading the replay", "connecting");
    let res;
    try {
      res = await fetch(location.pathname.replace(/\/+$/, "") + "/data", { cache: "no-store" });
    } catch (err) {
      D.setStatus("the replay could not be loaded: " + err, "error");
      return;
    }
    if (!res.ok) {
      D.setStatus("the replay could not be loaded: HTTP " + res.status, "error");
      return;
    }
    data = await res.json();
    D.setWindow(Math.max(...data.runs.map((rec) => rec.frames[rec.frames.length - 1].now), 1));
    document.querySelector("h1 .sub").textContent = "replay";
    document.title = "tokenloom · replay";
    buildControls();
    show(0, 0);
    D.setStatus("replay", "live");
    $("footer").textContent = data.command ? "recorded by: " + data.command : "";
  }

  load();
})();
