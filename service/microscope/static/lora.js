// The viewer's adapters tab: POST /inspect/compare (docs/api.md#post-inspectcompare) between a reference (the base or
// a LoRA adapter) and another, drawn as two heatmaps, blocks down and tokens across: how far the other moves the
// residual stream (relative to the reference's norm) and how far apart the two logit-lens readings are (KL, nats).
// Plain JS, no build step; shares only the page's API-key field with inspect.js.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let result = null; // the last /inspect/compare response

  function headers() {
    const key = $("api-key").value.trim();
    const h = { "Content-Type": "application/json" };
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function setStatus(text, isError) {
    $("lora-status").textContent = text;
    $("lora-status").className = isError ? "error" : "";
  }

  // the served models: the base first, then each adapter (its `parent` is the base)
  async function loadModels() {
    try {
      const res = await fetch("/v1/models", { headers: headers() });
      const data = await res.json();
      if (!res.ok) throw new Error((data.error && data.error.message) || res.statusText);
      const ids = data.data.map((m) => m.id);
      const adapters = data.data.filter((m) => m.parent).map((m) => m.id);
      for (const [select, names, pick] of [[$("lora-ref"), ids, ids[0]], [$("lora-other"), ids, adapters[0] || ids[0]]]) {
        select.replaceChildren(...names.map((n) => new Option(n, n)));
        select.value = pick;
      }
      if (!adapters.length) setStatus("this server serves no LoRA adapters (--lora-modules)", false);
    } catch (err) {
      setStatus(String(err.message || err), true);
    }
  }

  async function runCompare() {
    const body = { prompt: $("lora-prompt").value, model: $("lora-ref").value, compare: [$("lora-other").value],
                   mode: "none" };
    setStatus("comparing…");
    $("lora-run").disabled = true;
    try {
      const res = await fetch("/inspect/compare", { method: "POST", headers: headers(), body: JSON.stringify(body) });
      const data = await res.json();
      if (!res.ok) throw new Error((data.error && `${data.error.param}: ${data.error.message}`) || res.statusText);
      result = data;
      draw();
    } catch (err) {
      setStatus(String(err.message || err), true);
    } finally {
      $("lora-run").disabled = false;
    }
  }
  $("lora-run").addEventListener("click", runCompare);
  $("tab-adapters").addEventListener("click", loadModels);
  if (location.hash === "#adapters") loadModels();

  // white at 0 to deep orange at the chart's largest value
  function colour(v, max) {
    const f = max > 0 ? Math.min(1, v / max) : 0;
    const c = [255, 255, 255].map((x, i) => Math.round(x + ([194, 65, 12][i] - x) * f));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  // values[layer][position] on a canvas; -> the largest value and where
  function heatmap(canvas, rows) {
    const ctx = canvas.getContext("2d");
    const T = rows[0].values.length, L = rows.length;
    const max = Math.max(...rows.flatMap((r) => r.values));
    const cw = canvas.width / T, ch = canvas.height / L;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    let best = { value: -1, layer: 0, pos: 0 };
    rows.forEach((r, i) => r.values.forEach((v, t) => {
      ctx.fillStyle = colour(v, max);
      ctx.fillRect(t * cw, i * ch, Math.ceil(cw), Math.ceil(ch));
      if (v > best.value) best = { value: v, layer: r.layer, pos: t };
    }));
    return best;
  }

  function draw() {
    const cmp = result.comparisons[0];
    const tokens = result.tokens.map((t) => t.text);
    const moved = heatmap($("lora-residual"), cmp.layers.map((l) => ({ layer: l.layer, values: l.residual.relative })));
    const kl = heatmap($("lora-kl"), cmp.layers.map((l) => ({ layer: l.layer, values: l.logit_lens.kl })));
    const at = (b) => `layer ${b.layer}, token ${b.pos} ${JSON.stringify(tokens[b.pos])}`;
    $("lora-summary").textContent = `${cmp.model} against ${result.model}: the residual stream moves by up to ` +
      `${moved.value.toFixed(3)} of its norm (${at(moved)}); the logit lens departs by up to ${kl.value.toFixed(3)} ` +
      `nats (${at(kl)})`;
    $("lora-section").hidden = false;
    setStatus(`${tokens.length} tokens, ${cmp.layers.length} blocks in ${result.usage.compute_ms.toFixed(0)} ms`);
  }
})();
