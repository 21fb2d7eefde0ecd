"""`ProbeRun`: one inspection of one sequence over the serving weights, advanced in bounded steps between the
engine's serving steps; `inspect` runs one at once."""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from model.edits import EditTables, Segment
from model.interventions import Intervention, InterventionPlan
from model.features.lora import LoRAAdapter
from model.probes.activations import massive_activations
from model.probes.attention import ProbeAttention
from model.probes.feature_grid import GRID_SITES, FeatureGrid, FeatureRequest
from model.probes.options import HeadStats, LayerProbe, LensEntry, Prediction, ProbeOptions, ProbeResult
from model.transformer import Transformer

class ProbeRun:
    """One inspection of one sequence, advanced in bounded steps: `step(budget)` returns True when done.

    The forward is the serving one (same modules, RoPE, SDPA) over the whole sequence without a KV cache, in
    inference mode; the per-layer reductions run on each block's output as it is produced. Massive activations
    and per-head sink mass are measured in every block (they feed the summary); everything else only in the
    selected layers.

    A block runs in chunks of query rows (chunked prefill within one block: each chunk attends over the keys of
    the rows before it), sized from the measured cost per row so that one `step(budget_s)` does about
    `budget_s` of work: the engine thread interleaves serving steps with an inspection of any length and never
    waits for a whole block of it. Models whose blocks run across processes (tensor parallelism) take whole
    blocks (`supports_row_chunks = False`).
    """

    MIN_CHUNK_ROWS = 4

    def __init__(self, model: Transformer, token_ids: list[int], opts: ProbeOptions,
                 interventions: list[Intervention] | None = None, num_prompt_tokens: int | None = None,
                 adapter: LoRAAdapter | None = None, features: FeatureRequest | None = None) -> None:
        """`interventions` edit the inspected forward as they would a completion's (model/interventions.py), its
        "prompt" being the first `num_prompt_tokens` tokens (default: all of them); `adapter`: a LoRA adapter the
        whole sequence runs under (model/features/lora/adapters.py), as a completion naming it does; `features`: a
        dictionary whose feature x token grid to report (model/probes/feature_grid.py), read at its site in this
        forward."""
        c = model.config
        T = len(token_ids)
        if T == 0:
            raise ValueError("nothing to inspect: the sequence is empty")
        opts.validate(c.n_layers, c.n_heads, T)
        self.model, self.opts, self.token_ids = model, opts, list(token_ids)
        self.report = opts.selected_layers(c.n_layers)
        every = set(range(c.n_layers)) if "attention" in opts.include else set()
        edits = None
        if interventions:
            plan = InterventionPlan(interventions, num_prompt_tokens or T, c.n_layers, c.dim)
            edits, _ = EditTables(c.n_layers, c.dim, model.device, c.norm_eps).build([Segment(0, 0, T, plan)])
        self.ctx = ProbeAttention(opts, c.n_heads, c.n_kv_heads, every, set(self.report) if opts.mode != "none" else set(),
                                  edits, c.sliding_window, c.attention_multiplier, adapter)
        self.hidden_positions = (sorted(opts.hidden_positions) if opts.hidden_positions is not None else list(range(T))) \
            if "hidden_states" in opts.include else None
        self.prediction: Prediction | None = None
        self.final: Tensor | None = None  # (T, D) the last block's output while the prediction's rows are left
        self.predict_row, self.nll = 0, 0.0
        self.ctx.num_tokens = T
        self.chunked = getattr(model, "supports_row_chunks", True)
        self.grid = None
        if features is not None:
            hook = features.dictionary.hook_in
            if hook.site not in GRID_SITES:
                raise ValueError(f"features.sae: dictionary {features.name!r} reads {hook.site}, a site an inspection "
                                 f"does not read yet (it reads {', '.join(GRID_SITES)})")
            if not self.chunked:  # its blocks run on every rank, where no tap reaches
                raise ValueError("features: a feature grid needs the whole model in one process; this server runs it "
                                 "across tensor-parallel ranks")
            if not 0 <= hook.layer < c.n_layers:
                raise ValueError(f"features.sae: dictionary {features.name!r} reads block {hook.layer}, and the model "
                                 f"has {c.n_layers}")
            self.grid = FeatureGrid(model, features, T)
            self.ctx.taps[(hook.layer, hook.site)] = self.grid.rows
        # chunk boundaries on whole pooling tiles, so each chunk's rows fill whole rows of tiles
        self.row_quantum = opts.pool_size if opts.mode == "pooled" else 1
        self.lens_positions = sorted({p % T for p in (opts.lens_positions or [-1])})
        self.next_layer = -1  # -1: the embeddings come next
        self.next_row = 0  # first row of the next chunk of block `next_layer`
        self.h: Tensor | None = None  # (1, T, D) the input of block `next_layer`
        self.h_out: Tensor | None = None  # (1, T, D) its output, filled chunk by chunk
        self.seconds_per_row: float | None = None  # measured cost of one row of one block
        self.probes: dict[int, LayerProbe] = {}
        self.sink_mass_by_layer: dict[int, float] = {}
        self.massive_layers: list[int] = []
        self.massive_dims: set[int] = set()
        self.massive_tokens: set[int] = set()
        self.done = False
        self.elapsed = 0.0

    @torch.inference_mode()
    def step(self, budget_s: float | None = None) -> bool:
        """Advance by about `budget_s` seconds of work (at least one chunk); None: one whole block."""
        t0 = time.perf_counter()
        while not self.done:
            left = budget_s - (time.perf_counter() - t0) if budget_s is not None else None
            if self.next_layer == len(self.model.layers):  # the forward has run: the prediction's rows, the grid's stages
                self._after_forward(left)
            else:
                self._advance(left)
            if budget_s is None or time.perf_counter() - t0 >= budget_s:
                break
        self.elapsed += time.perf_counter() - t0
        return self.done

    def _advance(self, budget_s: float | None) -> None:
        """The embeddings, or one chunk of rows of the next block (a whole block when `budget_s` is None)."""
        m, T = self.model, len(self.token_ids)
        if self.next_layer < 0:
            tokens = torch.tensor([self.token_ids], device=m.device)  # (1, T)
            positions = torch.arange(T, device=m.device).unsqueeze(0)  # (1, T)
            self.cos, self.sin = m.rope(positions)  # (1, T, E)
            self.h = m.embed_tokens(tokens)  # (1, T, D): the embeddings as every path starts (Granite's multiplier)
            self.next_layer = 0
            return
        i, r0 = self.next_layer, self.next_row
        r1 = r0 + self._chunk_rows(budget_s, T - r0)
        t0 = time.perf_counter()
        self.ctx.row_offset = r0
        if r0 == 0 and r1 == T:
            self.h_out = m.layers[i](self.h, self.cos, self.sin, self.ctx)  # (1, T, D)
        else:
            if r0 == 0:
                self.h_out = torch.empty_like(self.h)
            self.h_out[:, r0:r1] = m.layers[i](self.h[:, r0:r1], self.cos[:, r0:r1], self.sin[:, r0:r1], self.ctx)
        # cost per row: up at once, down slowly (a chunk's attention grows with its position, and overshooting the
        # budget is what stalls serving, undershooting only costs an extra chunk)
        per_row = (time.perf_counter() - t0) / (r1 - r0)
        self.seconds_per_row = per_row if self.seconds_per_row is None else max(per_row, 0.8 * self.seconds_per_row)
        self.next_row = r1
        if r1 < T:
            return
        self.h, self.h_out, self.next_row = self.h_out, None, 0  # (1, T, D): residual stream after block i
        self._reduce_block(i, self.h[0])
        self.next_layer += 1
        if self.next_layer == len(m.layers):
            self._finish()
            if "prediction" in self.opts.include:
                self.final, self.predict_row, self.nll = self.h[0], 0, 0.0  # (T, D): the last block's output
            self.h = None
            self.done = self.final is None and self.grid is None

    def _chunk_rows(self, budget_s: float | None, remaining: int) -> int:
        if budget_s is None or not self.chunked:
            return remaining
        if self.seconds_per_row is None:
            rows = self.MIN_CHUNK_ROWS
        else:
            rows = max(self.MIN_CHUNK_ROWS, int(max(budget_s, 0.0) / self.seconds_per_row))
        q = self.row_quantum
        rows = max(q, rows // q * q)
        return remaining if rows >= remaining else rows

    def run(self) -> ProbeResult:
        while not self.step():
            pass
        return self.result()

    def _reduce_block(self, i: int, h: Tensor) -> None:
        """h (T, D): block i's output."""
        opts, T = self.opts, len(self.token_ids)
        acts = massive_activations(h, opts)
        if acts.num_massive:
            self.massive_layers.append(i)
            self.massive_tokens.update(acts.flagged[:, 0].tolist())
            self.massive_dims.update(acts.flagged[:, 1].tolist())
        received, entropy, maps = self.ctx.stats.pop(i, (None, None, None))
        if received is not None and T > 1:
            self.sink_mass_by_layer[i] = received[:, 0].mean().item()
        if i not in self.report:
            return
        probe = LayerProbe(i, acts.max_abs, acts.median_abs, acts.top, acts.massive, acts.num_massive)
        if "norms" in opts.include:
            probe.residual_norm = h.float().norm(dim=-1).cpu()  # (T,)
        if received is not None:
            probe._received, probe.maps = received, maps
            probe.heads = [HeadStats(h_, g, received[j, 0].item() if T > 1 else None, None,
                                     entropy[j].item() if T > 1 else None)
                           for j, (h_, g) in enumerate(zip(self.ctx.heads, self.ctx.kv_groups))]
        if "logit_lens" in opts.include:
            probe.lens = self._lens(h)
        if self.hidden_positions is not None:
            probe.hidden = h[self.hidden_positions].float().cpu()  # (P, D)
        self.probes[i] = probe

    def _lens(self, h: Tensor) -> list[LensEntry]:
        """h (T, D) -> top-k of softmax(logits(h)) at the lens positions (the final norm and head, as decoding)."""
        m = self.model
        pos = torch.tensor(self.lens_positions, device=h.device)
        probs = m.logits(h[pos]).float().softmax(-1)  # (P, V)
        top = probs.topk(min(self.opts.lens_top_k, probs.shape[-1]), dim=-1)
        return [LensEntry(p, ids, ps) for p, ids, ps in zip(self.lens_positions, top.indices.tolist(), top.values.tolist())]

    PREDICT_ROWS = 64  # positions per head call (each is a (rows, V) logits block): the unit of a step's work

    def _after_forward(self, budget_s: float | None) -> None:
        """One unit of the work after the last block: the prediction's next rows (a whole head call each, so the
        sum runs over the same blocks whatever the budget), else the feature grid's next slice."""
        if self.final is not None:
            self._predict_rows()
        elif self.grid is not None:
            self.grid.advance(budget_s)
        self.done = self.final is None and (self.grid is None or self.grid.done)

    def _predict_rows(self) -> None:
        """Rows predict_row .. + PREDICT_ROWS of the final output h (T, D): their next-token NLL (tokens 1..T-1);
        after the last, the perplexity and the top next tokens after T-1."""
        m, h, T = self.model, self.final, self.final.shape[0]
        a = self.predict_row
        b = min(T - 1, a + self.PREDICT_ROWS)
        if a < b:
            targets = torch.tensor(self.token_ids[a + 1 : b + 1], device=h.device)
            logits = m.logits(h[a:b]).float()  # (rows, V)
            self.nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        self.predict_row = b
        if b < T - 1:
            return
        last = m.logits(h[T - 1 :]).float().softmax(-1)[0]  # (V,)
        top = last.topk(min(self.opts.lens_top_k, last.shape[0]))
        self.prediction = Prediction(math.exp(self.nll / (T - 1)) if T > 1 else None, T - 1, top.indices.tolist(),
                                     top.values.tolist())
        self.final = None

    def _finish(self) -> None:
        """Mass on the massive-activation tokens needs all of them known: filled in once the last block ran."""
        if len(self.token_ids) < 2:
            return
        tokens = sorted(self.massive_tokens)
        for probe in self.probes.values():
            if probe.heads is None:
                continue
            mass = probe._received[:, tokens].sum(-1) if tokens else torch.zeros(len(probe.heads))
            for hs, v in zip(probe.heads, mass.tolist()):
                hs.massive_mass = v
            probe._received = None

    def result(self) -> ProbeResult:
        if not self.done:
            raise RuntimeError("the probe has not finished")
        return ProbeResult(
            token_ids=self.token_ids, heads=self.ctx.heads, kv_groups=self.ctx.kv_groups,
            layers=[self.probes[i] for i in self.report], sink_mass_by_layer=self.sink_mass_by_layer,
            massive_layers=self.massive_layers, massive_dims=sorted(self.massive_dims),
            massive_tokens=sorted(self.massive_tokens), compute_ms=self.elapsed * 1e3,
            hidden_positions=self.hidden_positions, prediction=self.prediction,
            features=self.grid.result if self.grid is not None else None,
        )


def inspect(model: Transformer, token_ids: list[int], opts: ProbeOptions | None = None,
            interventions: list[Intervention] | None = None) -> ProbeResult:
    """Run a whole inspection at once (the engine thread steps a ProbeRun instead, a block at a time)."""
    return ProbeRun(model, token_ids, opts or ProbeOptions(), interventions).run()
