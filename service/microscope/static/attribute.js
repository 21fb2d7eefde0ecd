// The viewer's attribution tab: POST /inspect/attribute twice (direct logit attribution of the clean prompt, and
// attribution patching of the pair), and with "beside the exact patching grid" POST /inspect/patch of the same cells.
// Direct logit attribution is drawn as a head x layer heatmap and one bar per MLP; attribution patching as the patching
// tab's heatmaps (patch.js's `window.patchGrids`), estimated beside exact, with their correlation and top-10 overlap.
// Plain JS, no build step.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const grids = window.patchGrids;
  let dla = null; // the last direct_logit response

  function setStatus(text, isError) {
    $("attr-status").textContent = text;
    $("attr-status").className = isError ? "error" : "";
  }

  async function post(path, body) {
    const key = $("api-key").value.trim();
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = "Bearer " + key;
    const res = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
    const data = await res.json();
    if (!res.ok) throw new Error((data.error && `${data.error.param}: ${data.error.message}`) || res.statusText);
    return data;
  }

  async function run() {
    const sites = [...document.querySelectorAll("#attr-sites input:checked")].map((i) => i.value);
    const common = { answer: $("attr-answer").value, contrast: $("attr-contrast").value };
    const pair = { clean: $("attr-clean").value, corrupted: $("attr-corrupted").value, sites, ...common };
    setStatus("attributing…");
    $("attr-run").disabled = true;
    try {
      const t0 = performance.now();
      dla = await post("/inspect/attribute", { method: "direct_logit", prompt: pair.clean, ...common });
      drawDla();
      const atp = await post("/inspect/attribute", { method: "attribution_patching", ...pair });
      const t1 = performance.now();
      const exact = $("attr-exact").checked ? await post("/inspect/patch", pair) : null;
      const t2 = performance.now();
      drawAtp(atp, exact);
      setStatus(`attribution ${((t1 - t0) / 1000).toFixed(1)} s` + (exact ? ` · exact patching ${((t2 - t1) / 1000).toFixed(1)} s` : "") +
                ` · ${atp.precision.quantization} ${atp.precision.dtype} weights, gradients in ${atp.gradient_precision}`);
    } catch (err) {
      setStatus(String(err.message || err), true);
    } finally {
      $("attr-run").disabled = false;
    }
  }
  $("attr-run").addEventListener("click", run);

  // ---- direct logit attribution ------------------------------------------------------------------------------
  function diverging(v, scale) { // blue (negative) - white (0) - orange (positive), |v| = scale at the ends
    const t = Math.max(-1, Math.min(1, scale > 0 ? v / scale : 0));
    const mix = (a, b, f) => a.map((x, i) => Math.round(x + (b[i] - x) * f));
    const c = t >= 0 ? mix([255, 255, 255], [194, 65, 12], t) : mix([255, 255, 255], [37, 99, 235], -t);
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function tooltip(e, text) {
    const tip = $("attr-tooltip");
    if (text === null) { tip.style.display = "none"; return; }
    tip.textContent = text;
    tip.style.display = "block";
    const host = $("attr-dla").getBoundingClientRect();
    tip.style.left = `${e.clientX - host.left + 12}px`;
    tip.style.top = `${e.clientY - host.top + 12}px`;
  }

  function local(canvas, e) {
    const r = canvas.getBoundingClientRect();
    return [(e.clientX - r.left) * (canvas.width / r.width), (e.clientY - r.top) * (canvas.height / r.height)];
  }

  function drawDla() {
    const d = dla, L = d.heads.length, H = d.heads[0].length;
    $("attr-dla-what").textContent = `logit(${JSON.stringify(d.answer.text)}) − logit(${JSON.stringify(d.contrast.text)}) ` +
      `${d.logit_diff.toFixed(3)} = embedding ${d.embedding.toFixed(3)} + heads + MLPs (sum ${d.sum.toFixed(3)})`;
    const scale = Math.max(...d.heads.flat().map(Math.abs)); // each chart's own: the MLPs' are larger
    $("attr-heads-legend").textContent = `each head's direct contribution (layers down, heads across; ±${scale.toFixed(2)} at the ends)`;
    // heads: layers down, heads across
    const hc = $("attr-heads"), hx = hc.getContext("2d");
    const labelW = 60, top = 18, cw = Math.floor((hc.width - labelW) / H), ch = Math.max(4, Math.floor((hc.height - top) / L));
    hx.fillStyle = "#fff";
    hx.fillRect(0, 0, hc.width, hc.height);
    hx.font = "11px ui-monospace, monospace";
    hx.fillStyle = "#1d2330";
    hx.textAlign = "center";
    for (let h = 0; h < H; h++) hx.fillText(`H${h}`, labelW + h * cw + cw / 2, 12);
    hx.textAlign = "right";
    for (let l = 0; l < L; l++) {
      if (l % Math.ceil(12 / ch) === 0) { hx.fillStyle = "#1d2330"; hx.fillText(`block ${l}`, labelW - 4, top + l * ch + ch * 0.8); }
      for (let h = 0; h < H; h++) {
        hx.fillStyle = diverging(d.heads[l][h], scale);
        hx.fillRect(labelW + h * cw, top + l * ch, cw - 1, ch - 1);
      }
    }
    hc.onmousemove = (e) => {
      const [x, y] = local(hc, e), h = Math.floor((x - labelW) / cw), l = Math.floor((y - top) / ch);
      tooltip(e, h < 0 || l < 0 || h >= H || l >= L ? null : `L${l}H${h}: ${d.heads[l][h].toFixed(4)}`);
    };
    hc.onmouseleave = (e) => tooltip(e, null);
    // MLPs: one horizontal bar per layer about a zero line
    const mc = $("attr-mlp"), mx = mc.getContext("2d"), mlpScale = Math.max(...d.mlp.map(Math.abs));
    const mid = labelW + (mc.width - labelW) / 2, half = (mc.width - labelW) / 2 - 6;
    mx.fillStyle = "#fff";
    mx.fillRect(0, 0, mc.width, mc.height);
    mx.font = "11px ui-monospace, monospace";
    mx.textAlign = "right";
    for (let l = 0; l < L; l++) {
      const v = d.mlp[l], w = mlpScale > 0 ? (v / mlpScale) * half : 0;
      mx.fillStyle = diverging(v, mlpScale);
      mx.fillRect(w >= 0 ? mid : mid + w, top + l * ch, Math.abs(w), ch - 1);
      if (l % Math.ceil(12 / ch) === 0) { mx.fillStyle = "#1d2330"; mx.fillText(`L${l}`, labelW - 4, top + l * ch + ch * 0.8); }
    }
    mx.strokeStyle = "#6b7280";
    mx.beginPath();
    mx.moveTo(mid + 0.5, top);
    mx.lineTo(mid + 0.5, top + L * ch);
    mx.stroke();
    mx.fillStyle = "#6b7280";
    mx.textAlign = "left";
    mx.fillText(`−${mlpScale.toFixed(2)}`, mid - half, 12);
    mx.textAlign = "center";
    mx.fillText("0", mid, 12);
    mx.textAlign = "right";
    mx.fillText(`+${mlpScale.toFixed(2)}`, mid + half, 12);
    mc.onmousemove = (e) => {
      const [, y] = local(mc, e), l = Math.floor((y - top) / ch);
      tooltip(e, l < 0 || l >= L ? null : `L${l} (MLP): ${d.mlp[l].toFixed(4)}   attention L${l}: ${d.attention[l].toFixed(4)}`);
    };
    mc.onmouseleave = (e) => tooltip(e, null);
    $("attr-heads").dataset.layers = String(L); // drawn (what the browser test waits for)
  }

  // ---- attribution patching: estimated beside exact --------------------------------------------------------
  function flat(grid) {
    return grid.flat(Infinity);
  }

  function pearson(a, b) {
    const n = a.length, ma = a.reduce((s, x) => s + x, 0) / n, mb = b.reduce((s, x) => s + x, 0) / n;
    let sab = 0, saa = 0, sbb = 0;
    for (let i = 0; i < n; i++) { sab += (a[i] - ma) * (b[i] - mb); saa += (a[i] - ma) ** 2; sbb += (b[i] - mb) ** 2; }
    return saa > 0 && sbb > 0 ? sab / Math.sqrt(saa * sbb) : NaN;
  }

  function topOverlap(a, b, k) { // of the k cells with the largest |value| in each, how many are the same
    const top = (v) => new Set(v.map((x, i) => [Math.abs(x), i]).sort((p, q) => q[0] - p[0]).slice(0, k).map((p) => p[1]));
    const ta = top(a), tb = top(b);
    return [...ta].filter((i) => tb.has(i)).length;
  }

  function drawAtp(atp, exact) {
    const wrap = $("attr-atp-panels");
    wrap.innerHTML = "";
    const b = atp.baselines;
    $("attr-atp-what").textContent = `${atp.usage.cells} cells · clean ${b.clean.toFixed(3)}, corrupted ${b.corrupted.toFixed(3)}`;
    grids.drawLegend($("attr-legend"));
    const opts = { tip: $("attr-atp-tooltip"), host: $("attr-atp") };
    atp.sites.forEach((site, s) => {
      wrap.appendChild(grids.panel(atp, site, s, { ...opts, title: `${site} · estimated` }));
      if (exact) wrap.appendChild(grids.panel(exact, site, s, { ...opts, title: `${site} · exact` }));
    });
    if (exact) {
      const est = flat(atp.normalized), ex = flat(exact.normalized);
      const r = pearson(est, ex), k = Math.min(10, est.length);
      $("attr-atp-stats").textContent = `estimated against exact over ${est.length} cells: correlation ${r.toFixed(3)}, ` +
        `top-${k} overlap ${topOverlap(est, ex, k)} of ${k}`;
      $("attr-atp-stats").dataset.correlation = String(r);
    } else {
      $("attr-atp-stats").textContent = "";
    }
    wrap.dataset.cells = String(atp.usage.cells); // drawn (what the browser test waits for)
  }
})();
