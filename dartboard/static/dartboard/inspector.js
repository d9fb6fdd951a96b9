// Trajectory inspector: one step at a time, arrow keys / strip buttons to move; the URL hash
// (#step-N) keeps the position across the live reloads of a running trajectory.
(function () {
  const steps = Array.from(document.querySelectorAll("#steps .step"));
  const strip = Array.from(document.querySelectorAll("#strip button"));
  let current = steps.length - 1;
  function show(i) {
    if (!steps.length) return;
    current = Math.max(0, Math.min(steps.length - 1, i));
    steps.forEach((s, j) => { s.hidden = j !== current; });
    strip.forEach((b, j) => b.classList.toggle("current", j === current));
    history.replaceState(null, "", `#step-${current}`);
  }
  const m = location.hash.match(/^#step-(\d+)$/);
  show(m ? parseInt(m[1], 10) : steps.length - 1);
  document.addEventListener("keydown", (e) => {
    if (e.target.closest("input, textarea, select")) return;
    if (e.key === "ArrowLeft") { show(current - 1); e.preventDefault(); }
    if (e.key === "ArrowRight") { show(current + 1); e.preventDefault(); }
  });
  strip.forEach((b) => b.addEventListener("click", () => show(parseInt(b.dataset.index, 10))));

  // While the trajectory runs, reload on its new steps (following the newest step when the
  // user was looking at the newest one).
  const meta = document.getElementById("traj");
  if (meta && meta.dataset.run && meta.dataset.status === "running" && window.dartboardLive) {
    const id = parseInt(meta.dataset.id, 10);
    window.dartboardLive(meta.dataset.run, (ev) => {
      const d = ev.data || {};
      if (d.trajectory !== id || (ev.kind !== "step" && ev.kind !== "trajectory")) return;
      const atEnd = current === steps.length - 1;
      if (atEnd) history.replaceState(null, "", ev.kind === "step" ? `#step-${d.step}` : location.hash);
      location.reload();
    }, null, meta.dataset.slot ? [meta.dataset.slot] : "all");
  }
})();
