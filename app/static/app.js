// The page: send the form to /qa with stream=true, show deltas as they arrive, highlight the
// kept spans of the document (character offsets from the "compression" event), list the figures.
"use strict";
const $ = (id) => document.getElementById(id);
const keep = $("keep");
const showKeep = () => { $("keep-out").textContent = Math.round(keep.value * 100) + "%"; };
keep.addEventListener("input", showKeep);
showKeep();

$("file").addEventListener("change", async () => {
  const f = $("file").files[0];
  if (f && !f.name.toLowerCase().endsWith(".pdf")) $("document").value = await f.text();
});

function showDocument(text, spans) {
  const view = $("doc-view");
  view.textContent = "";
  let at = 0;
  for (const [s, e] of spans) {
    if (s > at) view.appendChild(document.createTextNode(text.slice(at, s)));
    const m = document.createElement("mark");
    m.className = "kept";
    m.textContent = text.slice(s, e);
    view.appendChild(m);
    at = e;
  }
  if (at < text.length) view.appendChild(document.createTextNode(text.slice(at)));
}

function showFigures(done) {
  const rows = [];
  const c = done.compression || {}, s = done.speculative || {}, t = done.timings || {};
  rows.push(["document tokens", c.context_tokens], ["kept tokens", c.kept_context_tokens],
            ["scorer", c.scorer], ["mode", s.mode], ["drafts", s.num_drafts],
            ["accepted tokens", s.num_accepted_tokens], ["acceptance length", s.acceptance_length]);
  if (s.hit_rate !== undefined) rows.push(["branch hit rate", s.hit_rate]);
  rows.push(["tokens", (done.usage || {}).completion_tokens]);
  for (const k of ["queue_s", "compress_s", "prefill_s", "decode_s", "total_s"]) rows.push([k.replace("_s", " s"), t[k]]);
  const body = $("figures").querySelector("tbody");
  body.textContent = "";
  for (const [k, v] of rows) {
    if (v === undefined || v === null) continue;
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td>";
    tr.children[0].textContent = k;
    tr.children[1].textContent = typeof v === "number" ? (Number.isInteger(v) ? v : v.toFixed(3)) : v;
    body.appendChild(tr);
  }
}

async function ask(ev) {
  ev.preventDefault();
  $("answer").textContent = ""; $("error").textContent = ""; $("submit").disabled = true;
  const file = $("file").files[0];
  const headers = {};
  const key = $("api-key").value;
  if (key) headers["Authorization"] = "Bearer " + key;
  let body, docText = $("document").value;
  const fields = { question: $("question").value, keep_ratio: keep.value,
                   max_new_tokens: $("max-tokens").value, speculative: $("mode").value };
  if (file && file.name.toLowerCase().endsWith(".pdf")) {
    body = new FormData();
    body.append("file", file);
    for (const [k, v] of Object.entries(fields)) body.append(k, v);
    body.append("stream", "true");
    docText = null;
  } else {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify({ document: docText, question: fields.question, keep_ratio: Number(fields.keep_ratio),
      max_new_tokens: Number(fields.max_new_tokens), speculative: { mode: fields.speculative }, stream: true });
  }
  try {
    const res = await fetch("/qa", { method: "POST", headers, body });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || res.statusText);
    }
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, i).replace(/^data: /, "");
        buf = buf.slice(i + 2);
        if (line === "[DONE]") continue;
        const ev = JSON.parse(line);
        if (ev.type === "compression") {
          const spans = ev.compression.kept_spans || [];
          if (docText !== null) showDocument(docText, spans);
          $("kept-summary").textContent = `kept ${ev.compression.kept_context_tokens} of ${ev.compression.context_tokens} tokens (highlighted)`;
        } else if (ev.type === "delta") {
          $("answer").textContent += ev.text;
        } else if (ev.type === "done") {
          showFigures(ev);
          document.body.dataset.state = "done";
        } else if (ev.error) {
          throw new Error(ev.error.message);
        }
      }
    }
  } catch (e) {
    $("error").textContent = String(e.message || e);
    document.body.dataset.state = "error";
  } finally {
    $("submit").disabled = false;
  }
}
$("ask").addEventListener("submit", ask);
