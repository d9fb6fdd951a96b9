// Shared: a reconnecting WebSocket on one run's event feed (dartboard/consumers.py).
window.dartboardLive = function (runId, onEvent, onState) {
  let delay = 500;
  function connect() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${proto}://${location.host}/ws/runs/${runId}/`);
    ws.onopen = () => { delay = 500; onState && onState("live"); };
    ws.onmessage = (m) => { try { onEvent(JSON.parse(m.data)); } catch (e) { console.error(e); } };
    ws.onclose = () => {
      onState && onState("reconnecting…");
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  connect();
};
