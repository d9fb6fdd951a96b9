// Shared: a reconnecting WebSocket on one run's event feed (dartboard/consumers.py).
window.dartboardLive = function (runId, onEvent, onState) {
  let delay = 500;
  function connect() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${proto}://${location.host}/ws/runs/${runId}/`);
    // data-live on <html>: "open" once the server has subscribed this page to the run's
    // events (the consumer joins the group before it accepts), for scripts and tests.
    ws.onopen = () => {
      delay = 500;
      document.documentElement.dataset.live = "open";
      onState && onState("live");
    };
    ws.onmessage = (m) => { try { onEvent(JSON.parse(m.data)); } catch (e) { console.error(e); } };
    ws.onclose = () => {
      document.documentElement.dataset.live = "closed";
      onState && onState("reconnecting…");
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  connect();
};
