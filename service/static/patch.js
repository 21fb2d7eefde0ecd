// The viewer's patching tab: POST /inspect/patch (activation patching, docs/inspection.md), drawn as one heatmap per
// site, layers down and tokens across, with a colour legend, hover values and the two baselines. Plain JS, no build
// step; shares only the page's API-key field with inspect.js.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let result = null; // the last /inspect/patch response

  // ---- tabs: "#patch" in the address opens this one ------------------------------------------------------------
  function showTab(name) {
    for (const t of ["inspect", "patch"]) {
      $(`tab-${t}`).setAttribute("aria-selected", String(t === name));
      $(`${t}-main`).hidden = t !== name;
    }
    if (location.hash !== (name === "patch" ? "#patch" : "")) history.replaceState(null, "", name === "patch" ? "#patch" : location.pathname);
  }
  $("tab-inspect").addEventListener("click", () => showTab("inspect"));
  $("tab-patch").addEventListener("click", () => showTab("patch"));
  showTab(location.hash === "#patch" ? "patch" : "inspect");

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

  function drawLegend() {
    const canvas = $("patch-legend"), ctx = canvas.getContext("2d");
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
    drawLegend();
    d.sites.forEach((site, s) => wrap.appendChild(panel(d, site, s)));
    wrap.dataset.cells = String(d.usage.cells); // drawn (what the browser test waits for)
  }

  function panel(d, site, s) {
    const box = document.createElement("div");
    box.className = "patch-panel";
    const h = document.createElement("h3");
    h.textContent = site;
    box.appendChild(h);
    const L = d.layers.length, P = d.positions.length;
    const labelW = 64, labelH = 90;
    const cell = Math.max(6, Math.min(28, Math.floor((560 - labelW) / P)));
    const canvas = document.createElement("canvas");
    canvas.width = labelW + cell * P;
    canvas.height = labelH + cell * L;
    canvas.dataset.site = site;
    canvas.setAttribute("aria-label", `${site}: normalised metric per layer (rows) and token (columns)`);
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
    for (let i = 0; i < L; i++) {
      if (L <= 32 || i % Math.ceil(L / 32) === 0) ctx.fillText(`block ${d.layers[i]}`, labelW - 4, labelH + i * cell + cell * 0.75);
      for (let j = 0; j < P; j++) {
        ctx.fillStyle = colour(d.normalized[s][i][j]);
        ctx.fillRect(labelW + j * cell, labelH + i * cell, cell, cell);
      }
      ctx.fillStyle = "#1d2330";
    }
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const x = (e.clientX - r.left) * (canvas.width / r.width), y = (e.clientY - r.top) * (canvas.height / r.height);
      const j = Math.floor((x - labelW) / cell), i = Math.floor((y - labelH) / cell);
      const tip = $("patch-tooltip");
      if (i < 0 || j < 0 || i >= L || j >= P) { tip.style.display = "none"; return; }
      const p = d.positions[j];
      tip.textContent = `${site} · block ${d.layers[i]} · token ${p} ${JSON.stringify(d.corrupted_tokens[p].text)}` +
        (d.clean_tokens[p].id !== d.corrupted_tokens[p].id ? ` (clean ${JSON.stringify(d.clean_tokens[p].text)})` : "") +
        `\nnormalised ${d.normalized[s][i][j].toFixed(4)}   raw ${d.raw[s][i][j].toFixed(4)}`;
      tip.style.display = "block";
      const host = $("patch-section").getBoundingClientRect();
      tip.style.left = `${e.clientX - host.left + 12}px`;
      tip.style.top = `${e.clientY - host.top + 12}px`;
    });
    canvas.addEventListener("mouseleave", () => { $("patch-tooltip").style.display = "none"; });
    box.appendChild(canvas);
    return box;
  }
})();
