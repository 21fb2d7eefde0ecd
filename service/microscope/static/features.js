// The viewer's features tab: POST /inspect with `features` (a served dictionary's feature x token grid,
// docs/api.md#features-the-feature-x-token-grid) and no other reading, drawn as the prompt's tokens, the grid's
// features in a table, and for the token and the feature picked, what each is made of: a token's top features, and a
// feature's activations over the prompt (the tokens shaded by it) with the tokens its decoder direction promotes and
// suppresses through the unembedding. The dictionary picker lists GET /v1/saes where the server has that endpoint,
// and stays a text field where it has not. Plain JS, no build step; shares only the page's API-key field.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let grid = null; // the last response's `features`
  let tokens = []; // its tokens
  let selected = null; // the feature picked (its entry in grid.features)

  function headers() {
    const key = $("api-key").value.trim();
    const h = { "Content-Type": "application/json" };
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function setStatus(text, isError) {
    $("feat-status").textContent = text;
    $("feat-status").className = isError ? "error" : "";
  }

  // the dictionaries served, where the server lists them (GET /v1/saes); else the field takes a name as typed
  async function loadDictionaries() {
    try {
      const res = await fetch("/v1/saes", { headers: headers() });
      if (!res.ok) return;
      const data = await res.json();
      const names = (data.data || []).map((d) => d.name || d.id).filter(Boolean);
      $("feat-sae-list").replaceChildren(...names.map((n) => new Option(n, n)));
      if (names.length && !$("feat-sae").value) $("feat-sae").value = names[0];
    } catch (err) { /* no listing: the text field is the picker */ }
  }
  $("tab-features").addEventListener("click", loadDictionaries);
  if (location.hash === "#features") loadDictionaries();

  async function run() {
    const ids = $("feat-ids").value.trim();
    const body = { prompt: $("feat-prompt").value, include: [], mode: "none",
                   features: { sae: $("feat-sae").value.trim(), top_k: Number($("feat-top-k").value) || 8 } };
    if (ids) body.features.ids = ids.split(/[\s,]+/).map(Number);
    setStatus("reading features…");
    $("feat-run").disabled = true;
    try {
      const t0 = performance.now();
      const res = await fetch("/inspect", { method: "POST", headers: headers(), body: JSON.stringify(body) });
      const data = await res.json();
      if (!res.ok) throw new Error((data.error && `${data.error.param}: ${data.error.message}`) || res.statusText);
      grid = data.features;
      tokens = data.tokens;
      selected = null;
      draw();
      setStatus(`${grid.num_tokens} tokens · ${grid.features.length} features of ${grid.d_sae} at ${grid.hook_name} · ` +
                `${((performance.now() - t0) / 1000).toFixed(1)} s`);
    } catch (err) {
      setStatus(String(err.message || err), true);
    } finally {
      $("feat-run").disabled = false;
    }
  }
  $("feat-run").addEventListener("click", run);

  const fmt = (v) => (Math.abs(v) >= 100 ? v.toFixed(1) : v.toFixed(3));
  const shown = (text) => JSON.stringify(text).slice(1, -1);

  function shade(v, max) { // white (0) to the page's deep orange (max)
    const t = max > 0 ? Math.max(0, Math.min(1, v / max)) : 0;
    const c = [255, 255, 255].map((x, i) => Math.round(x + ([194, 65, 12][i] - x) * t));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function draw() {
    $("feat-section").hidden = false;
    // the prompt's tokens: hover or click one for its top features
    const spans = tokens.map((t, i) => {
      const s = document.createElement("span");
      s.textContent = t.text === "" ? "\u2205" : t.text.replace(/\n/g, "\u21b5\n"); // an empty or newline token stays visible
      s.dataset.index = String(i);
      s.addEventListener("mouseenter", () => showToken(i));
      s.addEventListener("click", () => showToken(i));
      return s;
    });
    $("feat-tokens").replaceChildren(...spans);
    // the grid's features, largest max first: click one to shade the tokens by it
    const rows = grid.features.map((f) => {
      const tr = document.createElement("tr");
      tr.dataset.id = String(f.id);
      tr.dataset.max = String(f.max);
      tr.dataset.mean = String(f.mean);
      const cells = [f.id, fmt(f.max), fmt(f.mean), f.positions.length,
                     f.promotes.slice(0, 4).map((p) => shown(p.text)).join(" ")];
      tr.replaceChildren(...cells.map((c, j) => {
        const td = document.createElement("td");
        td.textContent = String(c);
        if (j === 4) td.className = "tok";
        return td;
      }));
      tr.addEventListener("click", () => selectFeature(f));
      return tr;
    });
    $("feat-list").querySelector("tbody").replaceChildren(...rows);
    $("feat-section").dataset.features = String(grid.features.length);
    if (grid.features.length) selectFeature(grid.features[0]);
    showToken(tokens.length - 1);
  }

  function selectFeature(f) {
    selected = f;
    for (const tr of $("feat-list").querySelectorAll("tbody tr")) tr.classList.toggle("picked", tr.dataset.id === String(f.id));
    const act = new Array(tokens.length).fill(0);
    f.positions.forEach((p, j) => { act[p] = f.activations[j]; });
    for (const s of $("feat-tokens").children) {
      const v = act[Number(s.dataset.index)];
      s.dataset.act = String(v);
      s.style.background = shade(v, f.max);
      s.title = `token ${s.dataset.index}: feature ${f.id} = ${fmt(v)}`;
    }
    $("feat-tokens").dataset.feature = String(f.id);
    $("feat-what").textContent = `feature ${f.id}: max ${fmt(f.max)}, mean ${fmt(f.mean)}, active at ${f.positions.length} ` +
      `of ${tokens.length} tokens (white 0, deep orange ${fmt(f.max)})`;
    for (const [id, list] of [["feat-promotes", f.promotes], ["feat-suppresses", f.suppresses]]) {
      $(id).replaceChildren(...list.map((p) => {
        const li = document.createElement("li");
        li.dataset.id = String(p.id);
        li.textContent = `${shown(p.text)}  ${p.logit >= 0 ? "+" : ""}${fmt(p.logit)}`;
        return li;
      }));
    }
  }

  function showToken(i) {
    for (const s of $("feat-tokens").children) s.classList.toggle("picked", s.dataset.index === String(i));
    const entries = grid.by_token[i] || [];
    $("feat-token-what").textContent = `token ${i} ${JSON.stringify(tokens[i].text)}: its top ${grid.top_k} features`;
    $("feat-token-top").dataset.token = String(i);
    const largest = entries.length ? entries[0][1] : 0;
    $("feat-token-top").querySelector("tbody").replaceChildren(...entries.map(([id, v]) => {
      const tr = document.createElement("tr");
      tr.dataset.id = String(id);
      tr.dataset.value = String(v);
      const bar = document.createElement("td");
      bar.className = "tok";
      const b = document.createElement("b");
      b.className = "bar";
      b.style.width = `${Math.round(120 * (largest > 0 ? v / largest : 0))}px`;
      bar.append(b);
      const idCell = document.createElement("td");
      idCell.textContent = String(id);
      const vCell = document.createElement("td");
      vCell.textContent = fmt(v);
      tr.replaceChildren(idCell, vCell, bar);
      tr.addEventListener("click", () => {
        const f = grid.features.find((x) => x.id === id);
        if (f) selectFeature(f);
      });
      return tr;
    }));
  }
})();
