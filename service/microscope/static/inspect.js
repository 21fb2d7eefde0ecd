// The inspect viewer: POST /inspect, then draw; live mode streams a completion with per-token telemetry. Plain JS, no
// build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
let current = null; // the last /inspect response
// Ordinary sentences over which "mean" averages an entry (the six docs/inspection.md and the tests use).
const REFERENCE = [
  "The museum opens at nine and closes early on Sundays.",
  "She packed two sandwiches, an apple and a bottle of water for the hike.",
  "Rain is expected tomorrow afternoon, so the match may be postponed.",
  "The committee will announce the results after the last interview.",
  "He fixed the bicycle's chain and rode to the market before noon.",
  "Most plants need sunlight, water and nutrients from the soil to grow.",
];
const INCLUDE = ["massive", "norms", "attention", "logit_lens", "prediction"];

// IEEE 754 half -> float (maps arrive as little-endian float16 in base64).
function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * Math.pow(2, e - 15) * (1 + f / 1024);
}

function decodeArray(arr) {
  if (arr.encoding === "list") return Float32Array.from(arr.data.flat(Infinity));
  const bytes = Uint8Array.from(atob(arr.data), (c) => c.charCodeAt(0));
  const view = new DataView(bytes.buffer);
  if (arr.dtype === "int32") return Int32Array.from({ length: bytes.length / 4 }, (_, i) => view.getInt32(4 * i, true));
  return Float32Array.from({ length: bytes.length / 2 }, (_, i) => halfToFloat(view.getUint16(2 * i, true)));
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function postInspect(body) {
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem("llamascope-key", key);
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  const res = await fetch("/inspect", { method: "POST", headers, body: JSON.stringify(body) });
  const data = await res.json();
  if (!res.ok) throw new Error((data.error && data.error.message) || res.statusText);
  return data;
}

async function runInspect() {
  const body = { prompt: $("prompt").value, max_tokens: Number($("max-tokens").value) || 0, mode: "auto", include: INCLUDE };
  setStatus("inspecting…");
  $("run").disabled = true;
  try {
    const data = await postInspect(body);
    current = data;
    $("compare").style.display = "none";
    render();
    const u = data.usage;
    setStatus(`${u.total_tokens} tokens · ${data.config.n_layers} layers · maps ${data.mode} · ` +
              `${u.compute_ms.toFixed(0)} ms compute · ${(u.response_bytes / 1024).toFixed(0)} KiB`);
  } catch (err) {
    setStatus(String(err.message || err), true);
  } finally {
    $("run").disabled = false;
  }
}

function render() {
  const d = current;
  $("model").textContent = `${d.model} · ${d.config.n_layers} layers · ${d.config.n_heads} heads / ${d.config.n_kv_heads} KV heads`;
  fillSelect($("layer"), d.layers.map((l) => [l.layer, `block ${l.layer}`]), d.layers.length - 1);
  fillSelect($("head"), d.heads_selected.map((h, i) => [i, `head ${h} (KV ${d.kv_groups[i]})`]), 0);
  drawHeatmap();
  drawMagnitudes();
  drawSinks();
  fillMassiveTable();
}

function fillSelect(sel, options, selectedIndex) {
  const keep = sel.value;
  sel.innerHTML = "";
  for (const [value, text] of options) sel.add(new Option(text, value));
  const still = options.findIndex(([v]) => String(v) === keep);
  sel.selectedIndex = still >= 0 ? still : Math.max(0, selectedIndex);
}

// ---- attention heatmap --------------------------------------------------------------------------------------

function currentMap() {
  const layer = current.layers.find((l) => String(l.layer) === $("layer").value);
  if (!layer || !layer.attention || !layer.attention.maps) return null;
  const maps = layer.attention.maps;
  const values = decodeArray(maps.values);
  const [H, R, C] = maps.values.shape;
  const h = Number($("head").value);
  return { layer, maps, R, C, data: values.subarray(h * R * C, (h + 1) * R * C), head: layer.attention.heads[h] };
}

function drawHeatmap() {
  const canvas = $("heatmap"), ctx = canvas.getContext("2d");
  const m = currentMap();
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!m) {
    $("map-info").textContent = "no map for this layer";
    $("heatmap-legend").getContext("2d").clearRect(0, 0, $("heatmap-legend").width, $("heatmap-legend").height);
    return;
  }
  const labelSpace = m.R <= 48 ? 70 : 0;
  const cell = Math.max(1, Math.floor((canvas.width - labelSpace) / Math.max(m.R, m.C)));
  const size = cell * Math.max(m.R, m.C);
  canvas.height = size + labelSpace;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  let max = 0;
  for (const v of m.data) if (v > max) max = v;
  for (let r = 0; r < m.R; r++) {
    for (let c = 0; c < m.C; c++) {
      ctx.fillStyle = weightColour(m.data[r * m.C + c] / (max || 1));
      ctx.fillRect(labelSpace + c * cell, r * cell, cell, cell);
    }
  }
  if (labelSpace) { // token labels: queries down the left, keys along the bottom
    ctx.fillStyle = "#1d2330";
    ctx.font = `${Math.min(12, cell - 1)}px ui-monospace, monospace`;
    ctx.textBaseline = "middle";
    for (let i = 0; i < m.R; i++) ctx.fillText(shortToken(i), 2, i * cell + cell / 2, labelSpace - 4);
    ctx.save();
    for (let j = 0; j < m.C; j++) {
      ctx.setTransform(1, 0, 0, 1, labelSpace + j * cell + cell / 2, size + 4);
      ctx.rotate(Math.PI / 2);
      ctx.fillText(shortToken(j), 0, 0, labelSpace - 6);
    }
    ctx.restore();
  }
  canvas.dataset.drawn = "1";
  canvas._geom = { labelSpace, cell, m };
  drawLegend(max, m.maps.mode === "pooled" ? `${m.maps.reduce} attention weight per tile` : "attention weight");
  const hs = m.head;
  $("map-info").textContent = `${m.maps.mode}${m.maps.pool_size ? " (tiles of " + m.maps.pool_size + ")" : ""} · sink ` +
    `${fmt(hs.sink_mass)} · entropy ${fmt(hs.entropy)} nats · max ${max.toFixed(3)}`;
}

// White -> deep orange over [0, 1] (the weight over the map's largest), on a square-root scale so that small
// weights stay visible. The heatmap and its legend both colour through here.
function weightColour(fraction) {
  const t = Math.sqrt(Math.min(1, Math.max(0, fraction)));
  return `rgb(${255 - 61 * t | 0},${255 - 190 * t | 0},${255 - 243 * t | 0})`;
}

function drawLegend(max, what) {
  // the colour bar: x runs over sqrt(weight / max), so the ticks sit where their weights are drawn
  const canvas = $("heatmap-legend"), ctx = canvas.getContext("2d");
  const pad = 10, bar = { x: pad, y: 16, w: canvas.width - 2 * pad, h: 10 };
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < bar.w; i++) {
    ctx.fillStyle = weightColour((i / (bar.w - 1)) ** 2);
    ctx.fillRect(bar.x + i, bar.y, 1, bar.h);
  }
  ctx.strokeStyle = "#d9dde5"; ctx.strokeRect(bar.x + 0.5, bar.y + 0.5, bar.w - 1, bar.h - 1);
  ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#6b7280";
  ctx.textBaseline = "bottom"; ctx.textAlign = "left";
  ctx.fillText(`${what} (colour scale: square root of weight / max)`, bar.x, bar.y - 3);
  ctx.textBaseline = "top";
  for (const x of [0, 0.25, 0.5, 0.75, 1]) {
    const px = bar.x + x * (bar.w - 1);
    ctx.fillRect(px, bar.y + bar.h, 1, 3);
    ctx.textAlign = x === 0 ? "left" : x === 1 ? "right" : "center";
    ctx.fillText((x * x * max).toFixed(3), px, bar.y + bar.h + 3);
  }
  canvas.dataset.max = max.toFixed(3);
}

function shortToken(i) {
  const t = current.tokens[i];
  return t ? JSON.stringify(t.text).slice(1, -1).slice(0, 9) : String(i);
}

function fmt(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(3); }

function onHover(ev) {
  const canvas = $("heatmap"), tip = $("tooltip"), g = canvas._geom;
  if (!g) return;
  const rect = canvas.getBoundingClientRect();
  const x = (ev.clientX - rect.left) * (canvas.width / rect.width), y = (ev.clientY - rect.top) * (canvas.height / rect.height);
  const c = Math.floor((x - g.labelSpace) / g.cell), r = Math.floor(y / g.cell);
  if (c < 0 || r < 0 || r >= g.m.R || c >= g.m.C) { tip.style.display = "none"; return; }
  const v = g.m.data[r * g.m.C + c];
  const pooled = g.m.maps.mode === "pooled";
  const b = g.m.maps.pool_size || 1;
  tip.textContent = pooled
    ? `queries ${r * b}-${r * b + b - 1} → keys ${c * b}-${c * b + b - 1}\n${g.m.maps.reduce} ${v.toFixed(4)}`
    : `query ${r} ${JSON.stringify(current.tokens[r].text)}\n→ key ${c} ${JSON.stringify(current.tokens[c].text)}\nweight ${v.toFixed(4)}`;
  tip.style.left = `${ev.clientX - rect.left + 14}px`;
  tip.style.top = `${ev.clientY - rect.top + 14}px`;
  tip.style.display = "block";
}

// ---- layer-wise plots ---------------------------------------------------------------------------------------

function drawMagnitudes(canvas = $("magnitudes"), data = current) {
  // Sun et al. 2024, Fig. 1 style: the three largest |h| and the median per block, log scale.
  const ctx = canvas.getContext("2d");
  const layers = data.layers;
  const series = [0, 1, 2].map((k) => layers.map((l) => (l.top[k] ? Math.abs(l.top[k].value) : null)));
  series.push(layers.map((l) => l.median_abs));
  const all = series.flat().filter((v) => v > 0);
  const lo = Math.floor(Math.log10(Math.min(...all))), hi = Math.ceil(Math.log10(Math.max(...all)));
  const pad = { l: 46, r: 10, t: 8, b: 24 }, W = canvas.width - pad.l - pad.r, H = canvas.height - pad.t - pad.b;
  const X = (i) => pad.l + (layers.length === 1 ? W / 2 : (i * W) / (layers.length - 1));
  const Y = (v) => pad.t + H - ((Math.log10(v) - lo) / Math.max(1, hi - lo)) * H;
  axes(ctx, canvas, pad, lo, hi, Y, layers, X);
  ["#c2410c", "#2563eb", "#059669", "#6b7280"].forEach((color, s) => {
    ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
    let started = false;
    series[s].forEach((v, i) => {
      if (!(v > 0)) return;
      if (started) ctx.lineTo(X(i), Y(v)); else { ctx.moveTo(X(i), Y(v)); started = true; }
    });
    ctx.stroke();
    series[s].forEach((v, i) => { if (v > 0) { ctx.beginPath(); ctx.arc(X(i), Y(v), 2.2, 0, 7); ctx.fill(); } });
  });
}

function axes(ctx, canvas, pad, lo, hi, Y, layers, X) {
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#e5e7eb"; ctx.lineWidth = 1;
  ctx.textBaseline = "middle"; ctx.textAlign = "right";
  for (let e = lo; e <= hi; e++) {
    ctx.beginPath(); ctx.moveTo(pad.l, Y(10 ** e)); ctx.lineTo(canvas.width - pad.r, Y(10 ** e)); ctx.stroke();
    ctx.fillText(`1e${e}`, pad.l - 6, Y(10 ** e));
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  const every = Math.ceil(layers.length / 15);
  layers.forEach((l, i) => { if (i % every === 0) ctx.fillText(String(l.layer), X(i), canvas.height - pad.b + 6); });
  ctx.textAlign = "left";
}

function drawSinks(canvas = $("sinks"), data = current) {
  const ctx = canvas.getContext("2d");
  const sinks = data.summary.sink_mass_by_layer || [];
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const pad = { l: 46, r: 10, t: 8, b: 22 }, W = canvas.width - pad.l - pad.r, H = canvas.height - pad.t - pad.b;
  ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#6b7280"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (const v of [0, 0.5, 1]) ctx.fillText(v.toFixed(1), pad.l - 6, pad.t + H - v * H);
  const bw = W / Math.max(1, sinks.length);
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  sinks.forEach((v, i) => {
    if (v === null) return;
    ctx.fillStyle = "#2563eb";
    ctx.fillRect(pad.l + i * bw + 1, pad.t + H - v * H, Math.max(1, bw - 2), v * H);
    if (i % Math.ceil(sinks.length / 15) === 0) { ctx.fillStyle = "#6b7280"; ctx.fillText(String(i), pad.l + i * bw + bw / 2, pad.t + H + 4); }
  });
}

function fillMassiveTable() {
  const tbody = $("massive").tBodies[0];
  tbody.innerHTML = "";
  let n = 0;
  for (const l of current.layers) {
    for (const e of l.massive) {
      const tr = tbody.insertRow();
      const cells = [l.layer, e.token, JSON.stringify(e.token_text), e.dim, e.value.toFixed(1), e.ratio === null ? "–" : e.ratio.toFixed(0)];
      cells.forEach((text, i) => { const td = tr.insertCell(); td.textContent = String(text); if (i === 2) td.className = "tok"; });
      const actions = tr.insertCell();
      actions.className = "tok";
      for (const kind of ["zero", "mean"]) {
        const b = document.createElement("button");
        b.textContent = kind;
        b.className = kind;
        b.addEventListener("click", () => intervene(l.layer, e.token, e.dim, kind));
        actions.appendChild(b);
      }
      tr.dataset.dim = String(e.dim);
      tr.dataset.layer = String(l.layer);
      n++;
    }
  }
  if (!n) {
    const td = tbody.insertRow().insertCell();
    td.colSpan = 7; td.className = "tok"; td.textContent = "none at these thresholds";
  }
  $("massive-rule").textContent = `(|x| > 100 and ≥ 1000× the layer median; ${n} found)`;
}

// ---- interventions: re-run with one massive entry set to zero or to its mean ----------------------------------

async function referenceMean(layer, token, dim) {
  // the entry's mean over the reference sentences long enough to have that token (hidden states in float32)
  const values = [];
  for (const prompt of REFERENCE) {
    const d = await postInspect({ prompt, layers: [layer], include: ["hidden_states"], hidden_dtype: "float32", mode: "none" })
      .catch(() => null); // too short for the token: skipped
    if (!d || d.tokens.length <= token) continue;
    const h = d.layers[0].hidden_states;
    const row = decodeFloat32(h.values).subarray(token * d.config.dim, (token + 1) * d.config.dim);
    values.push(row[dim]);
  }
  if (!values.length) throw new Error(`no reference sentence has a token ${token}`);
  return values.reduce((a, b) => a + b, 0) / values.length;
}

function decodeFloat32(arr) {
  if (arr.encoding === "list") return Float32Array.from(arr.data.flat(Infinity));
  const bytes = Uint8Array.from(atob(arr.data), (c) => c.charCodeAt(0));
  return new Float32Array(bytes.buffer);
}

async function intervene(layer, token, dim, kind) {
  const before = current;
  setStatus(kind === "mean" ? "averaging the entry over the reference sentences…" : "re-running with the edit…");
  document.querySelectorAll("td button").forEach((b) => { b.disabled = true; });
  try {
    const value = kind === "zero" ? 0 : await referenceMean(layer, token, dim);
    const edit = { layer, site: "block_output", op: "set", dims: [dim], values: [value], positions: [token] };
    const body = { prompt: $("prompt").value, max_tokens: 0, mode: "none", include: INCLUDE, interventions: [edit] };
    if (before.completion) { body.prompt = undefined; body.input_ids = before.tokens.map((t) => t.id); }
    const after = await postInspect(body);
    $("compare-what").textContent = `(block ${layer}, token ${token}, dim ${dim} set to ${kind === "zero" ? "0" : value.toFixed(1) + ", its mean"})`;
    $("compare").dataset.kind = kind;
    $("compare").style.display = "block";
    fillColumn($("before"), before, "before");
    fillColumn($("after"), after, `after: set to ${kind === "zero" ? "0" : "the mean"}`);
    setStatus(`perplexity ${fmtPpl(before)} → ${fmtPpl(after)}`);
  } catch (err) {
    setStatus(String(err.message || err), true);
  } finally {
    document.querySelectorAll("td button").forEach((b) => { b.disabled = false; });
  }
}

function fmtPpl(d) {
  const p = d.prediction && d.prediction.perplexity;
  if (p === null || p === undefined) return "–";
  return p >= 1e4 ? p.toExponential(2) : p.toFixed(2);
}

function fillColumn(col, d, title) {
  if (!col.firstElementChild) col.appendChild($("column").content.cloneNode(true));
  col.querySelector("h3").textContent = title;
  const ppl = col.querySelector(".ppl-value");
  ppl.textContent = fmtPpl(d);
  ppl.dataset.value = d.prediction && d.prediction.perplexity !== null ? String(d.prediction.perplexity) : "";
  const list = col.querySelector("ol.top5");
  list.innerHTML = "";
  for (const t of (d.prediction ? d.prediction.next_tokens : [])) {
    const li = document.createElement("li");
    li.textContent = `${JSON.stringify(t.text)} ${t.prob.toFixed(3)}`;
    list.appendChild(li);
  }
  drawSinks(col.querySelector("canvas.sinks"), d);
  drawMagnitudes(col.querySelector("canvas.magnitudes"), d);
  col.dataset.massive = String(d.summary.massive_layers.length);
  col.dataset.sinks = JSON.stringify(d.summary.sink_mass_by_layer);
}

// ---- live mode: a streamed completion whose chunks carry each token's attention telemetry -----------------------

const live = { tokens: [], layers: 0 };

async function runLive() {
  const key = $("api-key").value.trim();
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  const body = { prompt: $("prompt").value, max_tokens: Number($("max-tokens").value) || 32, temperature: 0,
                 stream: true, inspect: { stream: true } };
  const w = Number($("window").value);
  if (w > 0) body.kv_window = { sink_tokens: 4, window: w };
  live.tokens = [];
  $("live-section").hidden = false;
  $("live-tokens").innerHTML = "";
  const head = document.createElement("span");
  head.className = "prompt";
  head.textContent = body.prompt;
  $("live-tokens").append(head);
  drawLive();
  $("live").disabled = true;
  setStatus("generating…");
  try {
    const res = await fetch("/v1/completions", { method: "POST", headers, body: JSON.stringify(body) });
    if (!res.ok) {
      const data = await res.json();
      throw new Error((data.error && data.error.message) || res.statusText);
    }
    const reader = res.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        for (const c of chunk.choices) if (c.inspect) addLiveToken(c.text, c.inspect);
      }
    }
    setStatus(`${live.tokens.length} tokens streamed with their telemetry`);
  } catch (err) {
    setStatus(String(err.message || err), true);
  } finally {
    $("live").disabled = false;
  }
}

function addLiveToken(text, tel) {
  const sinks = tel.layers.map((l) => l.sink_mass);
  live.layers = sinks.length;
  live.tokens.push({ text, sinks, position: tel.position });
  const mean = sinks.reduce((a, b) => a + b, 0) / sinks.length;
  const span = document.createElement("span");
  span.textContent = text;
  span.dataset.sinks = sinks.map((v) => v.toFixed(4)).join(",");
  span.style.borderBottomColor = weightColour(mean);
  span.title = `query position ${tel.position} · sink mass by layer: ` + sinks.map((v, i) => `${i}:${v.toFixed(2)}`).join(" ");
  $("live-tokens").append(span);
  $("live-status").textContent = `(${live.tokens.length} tokens · mean sink mass ${mean.toFixed(3)} for the last)`;
  drawLive();
}

function drawLive() {
  const canvas = $("live-sinks"), ctx = canvas.getContext("2d"), L = Math.max(1, live.layers);
  const pad = { l: 60, t: 4, b: 18 }, n = Math.max(live.tokens.length, 32);
  const cw = Math.max(1, Math.floor((canvas.width - pad.l) / n)), ch = Math.max(2, Math.floor((canvas.height - pad.t - pad.b) / L));
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  live.tokens.forEach((t, x) => t.sinks.forEach((v, y) => {
    ctx.fillStyle = weightColour(v);
    ctx.fillRect(pad.l + x * cw, pad.t + y * ch, cw, ch);
  }));
  ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#6b7280"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let y = 0; y < L; y += Math.ceil(L / 6)) ctx.fillText(`block ${y}`, pad.l - 4, pad.t + y * ch + ch / 2);
  ctx.textAlign = "left"; ctx.textBaseline = "top";
  ctx.fillText("generated tokens →", pad.l, pad.t + L * ch + 3);
  canvas.dataset.tokens = String(live.tokens.length);
  canvas.dataset.layers = String(live.layers);
}

$("live").addEventListener("click", runLive);
$("run").addEventListener("click", runInspect);
$("layer").addEventListener("change", drawHeatmap);
$("head").addEventListener("change", drawHeatmap);
$("heatmap").addEventListener("mousemove", onHover);
$("heatmap").addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });
$("api-key").value = sessionStorage.getItem("llamascope-key") || "";
