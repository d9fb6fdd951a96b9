// Annotation queue: one key labels the rollout shown and submits (the page then serves the
// next one); "c" focuses the comment, Enter in it keeps typing out of the shortcuts.
(function () {
  const form = document.getElementById("label-form");
  if (!form) return;
  const comment = document.getElementById("label-comment");
  const buttons = new Map(
    Array.from(form.querySelectorAll("button[data-key]")).map((b) => [b.dataset.key, b])
  );
  document.addEventListener("keydown", (e) => {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.target === comment) {
      if (e.key === "Escape") comment.blur();
      if (e.key === "Enter") e.preventDefault(); // a label key must still be chosen
      return;
    }
    if (e.target.closest("input, textarea, select")) return;
    const key = e.key.toLowerCase();
    if (key === "c") { comment.focus(); e.preventDefault(); return; }
    if (key === "s") { document.getElementById("skip").click(); e.preventDefault(); return; }
    const button = buttons.get(key);
    if (button) { e.preventDefault(); form.requestSubmit(button); }
  });
})();
