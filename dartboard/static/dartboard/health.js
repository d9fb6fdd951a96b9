// The run page's health line and outage banner, polled over plain HTTP (dartboard/health.py):
// the WebSocket feed rides on Redis, which is what may be down. A 503 from the server is the
// database outage page's JSON; a network error means the web itself is unreachable.
(function () {
  const line = document.getElementById("health-line");
  const banner = document.getElementById("outage-banner");
  if (!line || !banner) return;
  const time = (iso) => new Date(iso).toLocaleTimeString([], { hour12: false });

  function showBanner(text) {
    banner.textContent = text;
    banner.hidden = !text;
    document.documentElement.dataset.outage = text ? "yes" : "no";
  }

  function render(services) {
    line.replaceChildren(document.createTextNode("Health: "));
    services.forEach((s, i) => {
      const span = document.createElement("span");
      span.className = `svc ${s.state}`;
      span.dataset.service = s.service;
      span.title = s.last_error ? `last error (${time(s.last_error_at)}): ${s.last_error}` : "no error seen";
      span.textContent = `${s.label} ${s.state} ${s.since_word} ${time(s.since)}${s.detail ? ` (${s.detail})` : ""}`;
      if (i) line.appendChild(document.createTextNode(" · "));
      line.appendChild(span);
    });
  }

  async function poll() {
    try {
      const response = await fetch(line.dataset.url, { headers: { Accept: "application/json" } });
      const body = await response.json();
      if (body.services) render(body.services);
      showBanner(body.banner || (body.outage ? `Outage: ${body.outage}` : ""));
    } catch (e) {
      showBanner(`Outage: the Dartboard web server does not answer (${e.message}).`);
    }
    setTimeout(poll, 3000);
  }
  setTimeout(poll, 3000);
})();
