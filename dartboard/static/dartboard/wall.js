// The environment wall: one tile per env slot on the page, updated from the run's WebSocket
// events. A paged or filtered wall (data-complete absent) subscribes to the slots of the tiles
// it shows and updates only those, so 1,000 slots do not grow 1,000 tiles.
(function () {
  const wall = document.getElementById("wall");
  if (!wall) return;
  const runId = wall.dataset.run;
  const taskNames = JSON.parse(document.getElementById("task-names").textContent || "{}");
  const state = document.getElementById("ws-state");

  function tile(slotId) {
    let el = wall.querySelector(`.tile[data-slot="${slotId}"]`);
    if (el || !wall.dataset.complete) return el;
    const empty = document.getElementById("wall-empty");
    if (empty) empty.remove();
    el = document.createElement("a");
    el.className = "tile";
    el.dataset.slot = slotId;
    el.innerHTML = '<div class="shot"><span class="muted">no screenshot</span></div>' +
      '<div class="meta"><span class="badge status">starting</span> <span class="name"></span><br>' +
      '<span class="task">—</span> · step <span class="step">—</span> · <span class="version">v—</span>' +
      '<div class="error"></div></div>';
    wall.appendChild(el);
    return el;
  }
  function setText(el, sel, text) { el.querySelector(sel).textContent = text; }
  function setStatus(el, status, error) {
    const b = el.querySelector(".status");
    b.className = `badge status ${status}`;
    b.textContent = status;
    const bad = status === "quarantined" || status === "recovering" || status === "lost";
    setText(el, ".error", bad ? (error || "") : "");
  }
  function setTrajectory(el, trajId) {
    if (trajId) el.href = `/trajectories/${trajId}/`; else el.removeAttribute("href");
  }

  // Tasks added after the page loaded: take their names from the wall's JSON.
  let fetching = false;
  async function refreshNames() {
    if (fetching) return;
    fetching = true;
    try {
      // The page's own query (its filter, page and tiles a page): the names of its tiles.
      const r = await fetch(`/runs/${runId}/slots.json${location.search}`, { credentials: "same-origin" });
      const body = await r.json();
      Object.assign(taskNames, body.tasks);
      for (const s of body.slots) {
        const el = tile(s.id);
        if (!el) continue;
        if (s.task_name) setText(el, ".task", s.task_name);
        if (s.name) setText(el, ".name", s.name);
      }
    } finally { fetching = false; }
  }

  function onEvent(ev) {
    const d = ev.data || {};
    if (d.slot === null || d.slot === undefined) return;
    const el = tile(d.slot);
    if (!el) return;  // a slot on another page of the wall
    if (ev.kind === "step") {
      const shot = el.querySelector(".shot");
      let img = shot.querySelector("img");
      if (!img) { shot.innerHTML = ""; img = document.createElement("img"); shot.appendChild(img); }
      img.src = d.image;
      img.alt = `step ${d.step}`;
      setText(el, ".step", d.step);
      if (taskNames[d.task]) setText(el, ".task", taskNames[d.task]);
      else refreshNames().then(() => setText(el, ".task", taskNames[d.task] || `task ${d.task}`));
      setText(el, ".version", d.policy_version === null || d.policy_version === undefined ? "v—" : `v${d.policy_version}`);
      setTrajectory(el, d.trajectory);
      setStatus(el, "busy", "");
      el.classList.toggle("parse-error", !!d.parse_error);
    } else if (ev.kind === "slot") {
      if (d.name) setText(el, ".name", d.name);
      setStatus(el, d.status, d.error);
      if ("trajectory" in d) setTrajectory(el, d.trajectory);
    } else if (ev.kind === "trajectory") {
      el.dataset.last = d.status;
      el.title = `last trajectory ${d.trajectory}: ${d.status} (reward ${d.reward})`;
    }
  }
  // The whole wall listens to every slot; a page of it only to its own tiles' slots.
  const slots = wall.dataset.complete ? "all"
    : Array.from(wall.querySelectorAll(".tile[data-slot]"), (el) => el.dataset.slot);
  window.dartboardLive(runId, (ev) => {
    onEvent(ev);
    document.dispatchEvent(new CustomEvent("dartboard:event", { detail: ev }));
  }, (s) => { if (state) state.textContent = s; }, slots);
})();
