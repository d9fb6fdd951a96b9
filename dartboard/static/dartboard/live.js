// Shared: a reconnecting WebSocket on one run's event feed (dartboard/consumers.py): the
// run's own events, and those of `slots` ("all", or an array of env slot ids: a page of the
// wall gets only its own tiles' events).
window.dartboardLive = function (runId, onEvent, onState, slots) {
  let delay = 500;
  const query = slots === "all" ? "?slots=all" : slots && slots.length ? `?slots=${slots.join(",")}` : "";
  function connect() {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${proto}://${location.host}/ws/runs/${runId}/${query}`);
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
