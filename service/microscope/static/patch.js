// The viewer's patching tab: POST /inspect/patch (activation patching, docs/inspection.md), drawn as one heatmap per
// site, layers (and at a head site each layer's heads) down and tokens across, with a colour legend, hover values
// and the two baselines. Plain JS, no build step; shares only the page's API-key field with inspect.js, and its
// heatmaps with attribute.js (`window.patchGrids`).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let result = null; // the last /inspect/patch response

  // ---- tabs: "#patch" / "#attribute" / "#adapters" / "#features" in the address opens that one -------------------
  const TABS = ["inspect", "patch", "attribute", "adapters", "features"];
  function showTab(name) {
    for (const t of TABS) {
      $(`tab-${t}`).setAttribute("aria-selected", String(t === name));
      $(`${t}-main`).hidden = t !== name;
    }
    const hash = name === "inspect" ? "" : `#${name}`;
    if (location.hash !== hash) history.replaceState(null, "", hash || location.pathname);
  }
  for (const t of TABS) $(`tab-${t}`).addEventListener("click", () => showTab(t));
  showTab(TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "inspect");

  function setStatus(text, isError) {
    $("patch-status").textContent = text;
    $("patch-status").className = isError ? "error" : "";
  }

  function listOrAll(text) {
    const t = text.trim();
    if (t === "" || t === "all") return "all";
    return t.split(/[\s,]+/).map(Number);
  }

  async function runPatch() {
    const sites = [...document.querySelectorAll("#patch-sites input:checked")].map((i) => i.value);
    const body = {
      clean: $("patch-clean").value, corrupted: $("patch-corrupted").value,
      answer: $("patch-answer").value, metric: $("patch-metric").value, direction: $("patch-direction").value,
      sites, layers: listOrAll($("patch-layers").value), positions: listOrAll($("patch-positions").value),
    };
    if (body.metric === "logit_diff") body.contrast = $("patch-contrast").value;
    const key = $("api-key").value.trim();
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = "Bearer " + key;
    setStatus("patching…");
    $("patch-run").disabled = true;
    try {
      const res = await fetch("/inspect/patch", { method: "POST", headers, body: JSON.stringify(body) });
      const data = await res.json();
      if (!res.ok) throw new Error((data.error && `${data.error.param}: ${data.error.message}`) || res.statusText);
      result = data;
      draw();
      setStatus(`${data.usage.cells} cells in ${data.usage.seconds.toFixed(1)} s · ${data.precision.quantization} ` +
                `${data.precision.dtype} (the weights the server runs)`);
    } catch (err) {
      setStatus(String(err.message || err), true);
    } finally {
      $("patch-run").disabled = false;
    }
  }
  $("patch-run").addEventListener("click", runPatch);

  // ---- colours: a diverging scale, blue below 0, white at 0, orange at 1 and beyond -----------------------------
  const LO = -0.5, HI = 1.0;
  function colour(v) {
    const t = Math.max(LO, Math.min(HI, v));
    const mix = (a, b, f) => a.map((x, i) => Math.round(x + (b[i] - x) * f));
    const white = [255, 255, 255], blue = [37, 99, 235], orange = [194, 65, 12];
    const c = t >= 0 ? mix(white, orange, t / HI) : mix(white, blue, t / LO);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function drawLegend(canvas) {
    const ctx = canvas.getContext("2d");
    const W = canvas.width, pad = 40, w = W - 2 * pad;
    ctx.clearRect(0, 0, W, canvas.height);
    for (let x = 0; x < w; x++) {
      ctx.fillStyle = colour(LO + (HI - LO) * (x / (w - 1)));
      ctx.fillRect(pad + x, 4, 1, 14);
    }
    ctx.strokeStyle = "#d9dde5";
    ctx.strokeRect(pad - 0.5, 3.5, w + 1, 15);
    ctx.fillStyle = "#6b7280";
    ctx.font = "11px ui-monospace, monospace";
    ctx.textAlign = "center";
    for (const v of [LO, 0, 0.5, HI]) {
      const x = pad + ((v - LO) / (HI - LO)) * (w - 1);
      ctx.fillText(v === 0 ? "0 corrupted" : v === HI ? "1 clean" : String(v), x, 32);
    }
  }

  function tokenLabel(t) {
    return JSON.stringify(t.text).slice(1, -1);
  }

  function draw() {
    const d = result;
    const wrap = $("patch-panels");
    wrap.innerHTML = "";
    const b = d.baselines;
    const what = d.metric === "logit_diff" ? `logit(${JSON.stringify(d.answer.text)}) − logit(${JSON.stringify(d.contrast.text)})`
                                           : `log p(${JSON.stringify(d.answer.text)})`;
    $("patch-baselines").textContent = `${what} at the last position: clean ${b.clean.toFixed(3)} · corrupted ` +
      `${b.corrupted.toFixed(3)} · ${d.direction === "denoise" ? "clean activations patched into the corrupted run"
                                                               : "corrupted activations patched into the clean run"}`;
    drawLegend($("patch-legend"));
    d.sites.forEach((site, s) => wrap.appendChild(panel(d, site, s, { tip: $("patch-tooltip"), host: $("patch-section") })));
    wrap.dataset.cells = String(d.usage.cells); // drawn (what the browser test waits for)
  }

  // The rows of a site's grid: one per layer, or at a head site one per (layer, head), layer-major.
  function gridRows(d, site, s, grid) {
    const heads = site.startsWith("head_") ? (site === "head_k" || site === "head_v" ? d.kv_heads : d.heads) : null;
    const rows = [];
    d.layers.forEach((layer, i) => {
      if (!heads) rows.push({ label: `block ${layer}`, values: grid[s][i], layer, head: null });
      else heads.forEach((head, j) => rows.push({ label: `L${layer}H${head}`, values: grid[s][i][j], layer, head }));
    });
    return rows;
  }

  // One site's heatmap of `opts.grid` (default d.normalized), with hover values (`opts.raw`, default d.raw).
  function panel(d, site, s, opts) {
    const grid = opts.grid || d.normalized, raw = opts.raw || d.raw;
    const box = document.createElement("div");
    box.className = "patch-panel";
    const h = document.createElement("h3");
    h.textContent = opts.title || site;
    box.appendChild(h);
    const rows = gridRows(d, site, s, grid), rawRows = gridRows(d, site, s, raw);
    const L = rows.length, P = d.positions.length;
    const labelW = 64, labelH = 90;
    const cell = Math.max(6, Math.min(28, Math.floor((560 - labelW) / P)));
    const rowH = L > 64 ? Math.max(2, Math.floor(cell / 3)) : cell; // a head site's many rows, thinner
    const canvas = document.createElement("canvas");
    canvas.width = labelW + cell * P;
    canvas.height = labelH + rowH * L;
    canvas.dataset.site = site;
    canvas.setAttribute("aria-label", `${opts.title || site}: normalised metric per ${rowH < cell ? "layer and head" : "layer"} (rows) and token (columns)`);
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.font = "11px ui-monospace, monospace";
    ctx.fillStyle = "#1d2330";
    for (let j = 0; j < P; j++) { // token labels, rotated, above the columns
      const tok = d.corrupted_tokens[d.positions[j]];
      ctx.save();
      ctx.translate(labelW + j * cell + cell / 2 + 4, labelH - 6);
      ctx.rotate(-Math.PI / 2.6);
      ctx.fillText(tokenLabel(tok).slice(0, 12), 0, 0);
      ctx.restore();
    }
    ctx.textAlign = "right";
    const perLayer = L / d.layers.length; // rows per layer: 1, or a head site's heads
    const labelEvery = Math.max(1, Math.ceil(11 / (perLayer * rowH))); // layers between labels, 11 px apart at least
    for (let i = 0; i < L; i++) {
      if (i % perLayer === 0 && (i / perLayer) % labelEvery === 0) {
        ctx.fillText(`block ${rows[i].layer}`, labelW - 4, labelH + i * rowH + Math.min(perLayer * rowH, 12) * 0.8);
      }
      for (let j = 0; j < P; j++) {
        ctx.fillStyle = colour(rows[i].values[j]);
        ctx.fillRect(labelW + j * cell, labelH + i * rowH, cell, rowH);
      }
      ctx.fillStyle = "#1d2330";
    }
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const x = (e.clientX - r.left) * (canvas.width / r.width), y = (e.clientY - r.top) * (canvas.height / r.height);
      const j = Math.floor((x - labelW) / cell), i = Math.floor((y - labelH) / rowH);
      const tip = opts.tip;
      if (i < 0 || j < 0 || i >= L || j >= P) { tip.style.display = "none"; return; }
      const p = d.positions[j], row = rows[i];
      tip.textContent = `${opts.title || site} · block ${row.layer}${row.head === null ? "" : ` head ${row.head}`} · token ${p} ` +
        `${JSON.stringify(d.corrupted_tokens[p].text)}` +
        (d.clean_tokens[p].id !== d.corrupted_tokens[p].id ? ` (clean ${JSON.stringify(d.clean_tokens[p].text)})` : "") +
        `\nnormalised ${row.values[j].toFixed(4)}   raw ${rawRows[i].values[j].toFixed(4)}`;
      tip.style.display = "block";
      const host = opts.host.getBoundingClientRect();
      tip.style.left = `${e.clientX - host.left + 12}px`;
      tip.style.top = `${e.clientY - host.top + 12}px`;
    });
    canvas.addEventListener("mouseleave", () => { opts.tip.style.display = "none"; });
    box.appendChild(canvas);
    return box;
  }

  window.patchGrids = { colour, drawLegend, panel, gridRows };
})();
