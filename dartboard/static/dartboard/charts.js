// Run charts: Plotly figure JSON from charts.json, refreshed periodically and (debounced)
// when a trajectory finishes.
(function () {
  const box = document.getElementById("charts");
  if (!box || !window.Plotly) return;
  let pending = null;
  async function refresh() {
    pending = null;
    try {
      const r = await fetch(box.dataset.url, { credentials: "same-origin" });
      if (!r.ok) return;
      const figs = await r.json();
      for (const [name, fig] of Object.entries(figs)) {
        const el = document.getElementById(`chart-${name}`);
        if (!el) continue;
        await Plotly.react(el, fig.data, fig.layout, { displaylogo: false, responsive: true });
        if (!el.dataset.clickable) {
          // A point's customdata is the page behind it (the window's or the update's
          // trajectories, or a group): a click opens it.
          el.dataset.clickable = "1";
          el.on("plotly_click", (ev) => {
            const url = ev.points && ev.points[0] && ev.points[0].customdata;
            if (typeof url === "string" && url.startsWith("/")) location.href = url;
          });
        }
      }
      box.dataset.loaded = "1";
    } catch (e) { console.error(e); }
  }
  function soon(ms) { if (!pending) pending = setTimeout(refresh, ms); }
  refresh();
  setInterval(refresh, 15000);
  document.addEventListener("dartboard:event", (e) => {
    if (e.detail.kind === "trajectory" || e.detail.kind === "group") soon(2000);
  });
})();
