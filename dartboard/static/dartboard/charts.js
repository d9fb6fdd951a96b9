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
        if (el) Plotly.react(el, fig.data, fig.layout, { displaylogo: false, responsive: true });
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
