"""One forward's interventions as a table over its packed rows (`StepEdits`), and its application at a site.

Every execution path reads the same table, so each row gets exactly its own sequence's edits whatever shares its
step (model/interventions.py says what an edit is):

    site_ptr  (S L + 1,) int64     the ops of site k = S layer + s (S = SITES_PER_BLOCK, s = SITE_INDEX[site]) are
                                   ops[site_ptr[k] : site_ptr[k + 1]]
    ops       (Q, 4) int64         [row, u, keep, put]: a packed row and its entry's vectors (rows of `bank`, -1:
                                   absent); a row appears at most once per site
    bank      (V, D) float32       the step's vectors (the plans' `vectors`, concatenated)

and reads (block outputs, and where a read asks, the block's other sites), per site like the ops:

    read_ptr  (S L + 1,) int64     rows read at site k = S layer + s (after its edits) are
                                   read_rows[read_ptr[k] : read_ptr[k + 1]]
    read_rows (K,) int64
    read_out  (K, D) float32       filled by the forward

(mlp_normalized is no tensor a block hands over: its reads are taken at resid_mid, after its edits, as
rms_norm(x, ones, eps), the norm without its gain: `norm_eps` is the model's.)

and edits of single attention heads (model/interventions.py's head sites), beside them:

    head_ptr  (4L + 1,) int64      the head ops of site k = 4 layer + h (head_q, head_k, head_v, head_output) are
                                   head_ops[head_ptr[k] : head_ptr[k + 1]]
    head_ops  (Q_h, 5) int64       [row, head, u, keep, put], sorted by row; the vectors are the first E entries of
                                   `bank` rows

and feature clamps (model/features/sae/steer.py), applied at a site after its ops, x += (v - f_F(x)) s(x) d_F, as a
table like the ops,

    clamp_ptr    (S L + 1,) int64 site k's clamps are clamp_ops[clamp_ptr[k] : clamp_ptr[k + 1]], in order (a row's
                                  clamps in its request's order: each reads x as the one before left it)
    clamp_ops    (Qc, 4) int64    [row, w_F, d_F, b_dec (-1: not subtracted from the input)], rows of `bank`
    clamp_params (Qc, 7) float64  [activation, b_enc_F, threshold_F or b_mag_F or k, exp(r_mag_F) or the encoder's
                                  index, v, normalization, F]
                                  (codes: steer.py's KIND, NORM)
    encoders     [W_enc^T (F, D), b_enc (F,), ...] float32: the TopK and GroupMax dictionaries' encoders, whose
                                  encode of a row says whether F is selected

A step with head ops runs the module path (the fused native step and the CUDA graphs leave `module_only` steps to
it), and the CUDA graphs leave another path any step with a clamp, an edit at a site they do
not edit or a read of one they do not record (`edits_beyond`, `reads_beyond`). An entry is applied in float32
whatever the activation dtype: x -= (x . u) u (the dot product accumulated in float64), then x = x * keep + put,
rounded once to the activation dtype. For a single `add` that is x + v, for a `set` the value itself: bitwise what a
forward hook doing the same computes. Rows no op names are never touched, so they are bit-identical to a forward
without interventions. On CPU the native kernel applies it (the module path and the fused decode path then agree
bitwise); `apply_reference` is the PyTorch definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from model.interventions import HEAD_SITE_INDEX, SITE_INDEX, SITES_PER_BLOCK, HiddenStateRead, InterventionPlan
from model.kernels import ops as kernel_ops
from model.kernels import usable

S = SITES_PER_BLOCK
RESID_MID, MLP_NORMALIZED = SITE_INDEX["resid_mid"], SITE_INDEX["mlp_normalized"]


@dataclass
class StepEdits:
    site_ptr: Tensor  # (S L + 1,) int64
    ops: Tensor  # (Q, 4) int64
    bank: Tensor  # (V, D) float32
    read_ptr: Tensor  # (S L + 1,) int64
    read_rows: Tensor  # (K,) int64
    read_out: Tensor  # (K, D) float32
    head_ptr: Tensor | None = None  # (4L + 1,) int64, None: no head ops
    head_ops: Tensor | None = None  # (Q_h, 5) int64
    clamp_ptr: Tensor | None = None  # (S L + 1,) int64, None: no clamps
    clamp_ops: Tensor | None = None  # (Qc, 4) int64
    clamp_params: Tensor | None = None  # (Qc, 7) float64
    encoders: list[Tensor] = field(default_factory=list)  # [W_enc^T (F, D), b_enc (F,), ...] float32
    norm_eps: float = 1e-5  # the model's RMSNorm epsilon: mlp_normalized's reads

    def __post_init__(self) -> None:
        self.site_ptr_host = self.site_ptr.cpu().numpy()  # host copies: which sites have work is decided without a sync
        self.read_ptr_host = self.read_ptr.cpu().numpy()
        self.head_ptr_host = self.head_ptr.cpu().numpy() if self.head_ptr is not None else None
        self.clamp_ptr_host = self.clamp_ptr.cpu().numpy() if self.clamp_ptr is not None else None

    @property
    def has_edits(self) -> bool:
        return self.ops.shape[0] > 0 or self.has_head_edits or self.has_clamps

    @property
    def has_clamps(self) -> bool:
        return self.clamp_ops is not None and self.clamp_ops.shape[0] > 0

    @property
    def module_only(self) -> bool:
        """Whether the step needs the module path: edits of single heads (only it has those sites)."""
        return self.has_head_edits

    @property
    def has_head_edits(self) -> bool:
        """Whether a row edits a single head: only the module path has those sites (model/transformer.py)."""
        return self.head_ops is not None and self.head_ops.shape[0] > 0

    def reads_beyond(self, sites: tuple[str, ...]) -> bool:
        """Whether a row reads a site other than `sites` (the CUDA graphs record block outputs only)."""
        return _beyond(self.read_ptr_host, sites)

    def edits_beyond(self, sites: tuple[str, ...]) -> bool:
        """Whether a row is edited at a site other than `sites` (the CUDA graphs edit the sub-blocks' outputs and
        the block's output only)."""
        return _beyond(self.site_ptr_host, sites) or (self.clamp_ptr_host is not None
                                                      and _beyond(self.clamp_ptr_host, sites))

    def tensors(self) -> list[Tensor]:
        """The native decode kernel's trailing argument (model/kernels/csrc/interventions.cpp)."""
        base = [self.site_ptr, self.ops, self.bank, self.read_ptr, self.read_rows, self.read_out]
        if self.clamp_ops is None or self.clamp_ops.shape[0] == 0:
            return base
        return base + [self.clamp_ptr, self.clamp_ops, self.clamp_params] + self.encoders

    def apply(self, layer: int, site: str, x: Tensor, window: tuple[int, int] | None = None) -> Tensor:
        """Edit x (.., N, D) in place at (layer, site) and record the reads there; returns x. Its rows are
        the packed rows 0 .. N - 1, or, with `window` = (first, N), rows first .. first + N - 1 (a chunk of a
        longer sequence, as `ProbeRun` runs one). At a head site x is (.., N, heads, E), a view it edits in place."""
        if site in HEAD_SITE_INDEX:
            return self._apply_heads(4 * layer + HEAD_SITE_INDEX[site], x, window)
        k = S * layer + SITE_INDEX[site]
        a, b = int(self.site_ptr_host[k]), int(self.site_ptr_host[k + 1])
        x2 = x.view(-1, x.shape[-1])  # (N, D)
        if a < b:
            ops = self.ops[a:b] if window is None else _window(self.ops[a:b], *window)
            if ops.shape[0]:
                apply_ops(x2, ops, self.bank)
        if self.clamp_ptr_host is not None and self.clamp_ptr_host[k] < self.clamp_ptr_host[k + 1]:
            a, b = int(self.clamp_ptr_host[k]), int(self.clamp_ptr_host[k + 1])
            ops, params = self.clamp_ops[a:b], self.clamp_params[a:b]
            if window is not None:  # (a site's clamp rows are in request order, not sorted: a mask keeps it)
                on = (ops[:, 0] >= window[0]) & (ops[:, 0] < window[0] + window[1])
                ops, params = ops[on].clone(), params[on]
                ops[:, 0] -= window[0]
            if ops.shape[0]:
                apply_clamps(x2, ops, params, self.bank, self.encoders)
        self._read(k, x2, window)
        if SITE_INDEX[site] == RESID_MID:
            self._read(k + MLP_NORMALIZED - RESID_MID, x2, window, self._normalized)
        return x

    def _normalized(self, x: Tensor) -> Tensor:
        """x (n, D) -> x / rms(x), the RMSNorm without its gain, as the norm computes it (one row at a time)."""
        return kernel_ops.rms_norm(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), self.norm_eps)

    def _read(self, k: int, x2: Tensor, window: tuple[int, int] | None, f=None) -> None:
        """The reads at site k from x2 (N, D) (through `f`, rows -> values, where given) into read_out."""
        r0, r1 = int(self.read_ptr_host[k]), int(self.read_ptr_host[k + 1])
        if r0 < r1:
            rows = self.read_rows[r0:r1]
            if window is None:
                self.read_out[r0:r1] = (x2[rows] if f is None else f(x2[rows])).float()
            else:
                rows = rows - window[0]
                idx = torch.nonzero((rows >= 0) & (rows < window[1])).squeeze(1)
                self.read_out[r0 + idx] = (x2[rows[idx]] if f is None else f(x2[rows[idx]])).float()

    def _apply_heads(self, k: int, x: Tensor, window: tuple[int, int] | None) -> Tensor:
        if self.head_ptr_host is None or self.head_ptr_host[k] == self.head_ptr_host[k + 1]:
            return x
        ops = self.head_ops[int(self.head_ptr_host[k]) : int(self.head_ptr_host[k + 1])]
        if window is not None:
            ops = _window(ops, *window)
        if ops.shape[0]:
            E = x.shape[-1]
            x3 = x.flatten(0, -3)  # (N, heads, E): a view (the heads of a fused projection are strided)
            rows, heads = ops[:, 0], ops[:, 1]
            y = x3[rows, heads]  # (n, E): each op's own (row, head), at most one op each
            flat = torch.cat([torch.arange(len(rows), device=ops.device)[:, None], ops[:, 2:]], dim=1)
            apply_ops(y, flat, self.bank[:, :E].contiguous())
            x3[rows, heads] = y
        return x

    def without_reads(self) -> "StepEdits":
        """The edits alone (what tensor-parallel workers are sent: rank 0 takes the reads)."""
        empty = torch.zeros_like(self.read_ptr)
        return StepEdits(self.site_ptr, self.ops, self.bank, empty, self.read_rows[:0], self.read_out[:0],
                         clamp_ptr=self.clamp_ptr, clamp_ops=self.clamp_ops, clamp_params=self.clamp_params,
                         encoders=self.encoders, norm_eps=self.norm_eps)

    def restrict(self, layer: int) -> "StepEdits":
        """The part of the table one block reads (what a tensor-parallel rank is sent to probe one block)."""
        k0, k1 = S * layer, S * layer + S  # the block's sites
        a, b = int(self.site_ptr_host[k0]), int(self.site_ptr_host[k1])
        ptr = torch.zeros_like(self.site_ptr)
        ptr[k0 + 1 : k1 + 1] = self.site_ptr[k0 + 1 : k1 + 1] - a
        ptr[k1 + 1 :] = b - a
        empty = torch.zeros_like(self.read_ptr)
        table = {}
        if self.clamp_ptr is not None:
            ca, cb = int(self.clamp_ptr_host[k0]), int(self.clamp_ptr_host[k1])
            cptr = torch.zeros_like(self.clamp_ptr)
            cptr[k0 + 1 : k1 + 1] = self.clamp_ptr[k0 + 1 : k1 + 1] - ca
            cptr[k1 + 1 :] = cb - ca
            table = dict(clamp_ptr=cptr, clamp_ops=self.clamp_ops[ca:cb].clone(),
                         clamp_params=self.clamp_params[ca:cb].clone())
        return StepEdits(ptr, self.ops[a:b].clone(), self.bank, empty, self.read_rows[:0], self.read_out[:0],
                         encoders=self.encoders, norm_eps=self.norm_eps, **table)


def _beyond(ptr, sites: tuple[str, ...]) -> bool:
    """Whether a per-site pointer (S L + 1,) has entries at a site not among `sites`."""
    counts = (ptr[1:] - ptr[:-1]).reshape(-1, S)  # (L, S)
    other = [i for s, i in SITE_INDEX.items() if s not in sites]
    return bool(counts[:, other].any())


def _window(ops: Tensor, row_offset: int, n: int) -> Tensor:
    """The ops on rows [row_offset, row_offset + n), renumbered from 0 (rows are sorted within a site)."""
    rows = ops[:, 0]
    lo = int(torch.searchsorted(rows, torch.tensor(row_offset)))
    hi = int(torch.searchsorted(rows, torch.tensor(row_offset + n)))
    out = ops[lo:hi].clone()
    out[:, 0] -= row_offset
    return out


def apply_ops(x: Tensor, ops: Tensor, bank: Tensor) -> None:
    """x (N, D) in place: each op's row gets its entry (see the module docstring)."""
    native = usable(x)
    if native is not None and x.is_contiguous() and bank.device.type == "cpu":
        native.apply_edits(x, ops, bank)
    else:
        apply_reference(x, ops, bank)


def apply_clamps(x: Tensor, ops: Tensor, params: Tensor, bank: Tensor, encoders: list[Tensor] = ()) -> None:
    """x (N, D) in place: each clamp op's row, in order (see the module docstring)."""
    native = usable(x)
    if native is not None and x.is_contiguous() and bank.device.type == "cpu":
        native.apply_clamps(x, ops.contiguous(), params.contiguous(), bank, list(encoders))
    else:
        clamp_reference(x, ops, params, bank, encoders)


def clamp_reference(x: Tensor, ops: Tensor, params: Tensor, bank: Tensor, encoders: list[Tensor] = ()) -> None:
    """The PyTorch definition of `apply_clamps` (csrc/interventions.cpp's arithmetic, in float64; a TopK or GroupMax
    clamp's selection from the row's encode in float32): the ops in rounds where each row appears once, so a row's
    second clamp reads what its first left."""
    count: dict[int, int] = {}
    rank = []  # each op's index among its row's ops
    for r in ops[:, 0].tolist():
        rank.append(count.get(r, 0))
        count[r] = rank[-1] + 1
    rank_t = torch.tensor(rank, device=ops.device)
    zeros = torch.zeros(1, bank.shape[1], device=bank.device)
    for j in range(max(rank) + 1):
        sel = torch.nonzero(rank_t == j).squeeze(1)
        op, p = ops[sel], params[sel].double()
        r = op[:, 0]
        y = x[r].double()  # (n, D)
        w, dF = bank[op[:, 1]].double(), bank[op[:, 2]].double()
        bd = torch.where((op[:, 3] >= 0)[:, None], bank[op[:, 3].clamp_min(0)], zeros).double()
        kind, b, third, er, v, norm, F = p.unbind(-1)
        D = y.shape[1]
        mu = torch.where(norm == 2, y.mean(-1), 0.0)
        sd = (y - y.mean(-1, keepdim=True)).pow(2).sum(-1).div(D - 1).sqrt()
        c = torch.where(norm == 1, math.sqrt(D) / y.pow(2).sum(-1).sqrt(), torch.where(norm == 2, 1.0 / (sd + 1e-5), 1.0))
        s = torch.where(norm == 1, 1.0 / c, torch.where(norm == 2, sd, 1.0))
        xn = (y - mu[:, None]) * c[:, None] - bd  # (n, D)
        a = (xn * w).sum(-1)
        pre = a + b
        f = torch.where(kind == 0, pre.clamp_min(0.0), torch.where(
            kind == 1, torch.where(pre > third, pre.clamp_min(0.0), 0.0),
            torch.where(pre > 0, (a * er + third).clamp_min(0.0), 0.0)))
        f = torch.where(kind >= 3, pre.clamp_min(0.0), f)
        for i in torch.nonzero(kind >= 3).squeeze(1).tolist():  # topk, groupmax: is F selected at all?
            W, be = encoders[2 * int(er[i])], encoders[2 * int(er[i]) + 1]
            row = W @ xn[i].float() + be  # (F,) float32
            k, Fi = int(third[i]), int(F[i])
            if kind[i] == 4:  # GroupMax: F's group of F / k features
                g = row.shape[0] // k
                row = row[Fi // g * g : Fi // g * g + g]
                Fi %= g
                selected = int((row > row[Fi]).sum()) == 0
            else:
                selected = int((row > row[Fi]).sum()) < k
            if not selected:
                f[i] = 0.0
        x[r] = (y + ((v - f) * s)[:, None] * dF).float().to(x.dtype)


def apply_reference(x: Tensor, ops: Tensor, bank: Tensor) -> None:
    """The PyTorch definition of `apply_ops`: the ragged table as dense per-row indices, then `apply_dense`."""
    if ops.shape[0] == 0:
        return
    rows = ops[:, 0]
    dense_bank = torch.cat([torch.zeros(1, bank.shape[1], device=bank.device),
                            torch.ones(1, bank.shape[1], device=bank.device), bank])  # rows 0, 1: no u / put, no keep
    identity = torch.tensor([0, 1, 0], device=ops.device)
    idx = torch.where(ops[:, 1:] >= 0, ops[:, 1:] + 2, identity)  # (n, 3)
    y = x[rows]  # (n, D)
    apply_dense(y, idx, None, dense_bank)
    x[rows] = y


def apply_dense(x: Tensor, idx: Tensor, on: Tensor | None, bank: Tensor) -> None:
    """x (n, D) in place, row i edited by bank rows idx[i] = (u, keep, put), where `on` (n,) says (None: every row):
    x -= (x . u) u with the dot product in float64, then x = x * keep + put in float32, rounded once to x's dtype
    (the native kernel's arithmetic, csrc/interventions.cpp). Fixed shapes, no host sync: what a captured CUDA graph
    runs too (model/engine/graph_edits.py). Bank rows 0 (zeros) and 1 (ones) stand for an absent u / put and keep."""
    y = x.float()
    u = bank[idx[:, 0]].double()
    yd = y.double()
    y = (yd - (yd * u).sum(-1, keepdim=True) * u).float()
    y = (y * bank[idx[:, 1]] + bank[idx[:, 2]]).to(x.dtype)
    x.copy_(y if on is None else torch.where(on.unsqueeze(1), y, x))


@dataclass
class Segment:
    """A sequence's part of a forward: packed rows row0 .. row0 + n - 1 hold its positions pos0 .. pos0 + n - 1."""

    row0: int
    pos0: int
    n: int
    plan: InterventionPlan | None
    read: HiddenStateRead | None = None
    num_prompt_tokens: int = 0
    read_from: int = 0  # positions below this were read already (before a preemption): not again
    owner: object = None  # whose rows these are (the engine's Sequence)


class EditTables:
    """Builds each forward's `StepEdits` from its segments. The bank is rebuilt only when the set of plans changes
    (in steady decoding it does not: the same sequences step after step)."""

    def __init__(self, n_layers: int, dim: int, device: torch.device, norm_eps: float) -> None:
        """`norm_eps`: the model's RMSNorm epsilon (mlp_normalized's reads)."""
        self.n_layers, self.dim, self.device, self.norm_eps = n_layers, dim, torch.device(device), norm_eps
        self._plans: list[InterventionPlan] = []  # held (not just their ids) so no new plan can reuse an id
        self._bank = torch.zeros(0, dim, device=self.device)
        self._base: dict[int, int] = {}

    def build(self, segments: list[Segment], extra: list | None = None
              ) -> tuple[StepEdits | None, list[tuple[Segment, list[int], list[int]]]]:
        """-> the table (None when no segment edits or reads anything), and per reading segment (segment, positions
        read, and for each of its layers the first row of its block in read_out's layer-major layout). `extra`: the
        per-row features' reads (model/features/protocol.py's `SiteRead`: layer, site, packed rows), each given its
        `start` in read_out here."""
        L = self.n_layers
        extra = extra or []
        plans = [s.plan for s in segments if s.plan is not None]
        reads = [s for s in segments if s.read is not None]
        if not plans and not reads and not extra:
            return None, []
        if len(plans) != len(self._plans) or any(a is not b for a, b in zip(plans, self._plans)):
            self._base, parts, off = {}, [], 0
            for p in plans:
                if id(p) not in self._base:
                    self._base[id(p)] = off
                    parts.append(p.vectors)
                    off += p.vectors.shape[0]
            self._bank = torch.cat(parts).to(self.device) if parts else torch.zeros(0, self.dim, device=self.device)
            self._plans = plans
        chunks, head_chunks = [], []
        clamp_rows: dict[tuple[int, int, int], list[np.ndarray]] = {}  # (k, segment, clamp index) -> rows
        for j, s in enumerate(segments):
            if s.plan is None:
                continue
            base = self._base[id(s.plan)]
            for off, n, pat in s.plan.runs(s.pos0, s.n):
                rows = np.arange(s.row0 + off, s.row0 + off + n, dtype=np.int64)
                template = _template(pat, base)  # (S, 5): [site, row (unset), u, keep, put]
                block = np.repeat(template[:, None, :], n, 1)  # (S, n, 5)
                block[:, :, 1] = rows
                chunks.append(block.reshape(-1, 5))
                if pat.heads.shape[0]:  # (S_h, 6): [k_h, row, head, u, keep, put]
                    hb = np.repeat(_head_template(pat.heads, base)[:, None, :], n, 1)
                    hb[:, :, 1] = rows
                    head_chunks.append(hb.reshape(-1, 6))
                for k, ci in pat.clamps:
                    clamp_rows.setdefault((int(k), j, int(ci)), []).append(rows)
        clamp_table = {}
        if clamp_rows:  # per site, by segment, then in the request's order (a row's clamps apply in that order)
            sites, cops, cparams = [], [], []
            encoders: dict[int, int] = {}  # id(W_enc) -> its index in the step's encoders
            enc_list: list[Tensor] = []
            for k, j, ci in sorted(clamp_rows):
                rows = np.concatenate(clamp_rows[k, j, ci])
                plan = segments[j].plan
                base = self._base[id(plan)]
                op = np.empty((rows.size, 4), dtype=np.int64)
                op[:, 0] = rows
                op[:, 1:] = [e + base if e >= 0 else -1 for e in plan.clamp_rows[ci]]
                sites.append(np.full(rows.size, k, dtype=np.int64))
                cops.append(op)
                params = np.asarray(plan.clamp_params[ci], dtype=np.float64)
                enc = plan.clamps[ci].encoder(self.device)
                if enc is not None:  # a TopK / GroupMax clamp: its dictionary's encoder, named once a step
                    if id(enc[0]) not in encoders:
                        encoders[id(enc[0])] = len(enc_list) // 2
                        enc_list += list(enc)
                    params = params.copy()
                    params[3] = encoders[id(enc[0])]
                cparams.append(np.tile(params, (rows.size, 1)))
            if cops:
                cptr = np.searchsorted(np.concatenate(sites), np.arange(S * L + 1)).astype(np.int64)
                clamp_table = dict(clamp_ptr=torch.from_numpy(cptr).to(self.device),
                                   clamp_ops=torch.from_numpy(np.concatenate(cops)).to(self.device),
                                   clamp_params=torch.from_numpy(np.concatenate(cparams)).to(self.device),
                                   encoders=enc_list)
        head_ptr = head_ops = None
        if head_chunks:
            table = np.concatenate(head_chunks)
            table = table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]  # by site, then row, then head
            head_ptr = torch.from_numpy(np.searchsorted(table[:, 0], np.arange(4 * L + 1)).astype(np.int64))
            head_ops = torch.from_numpy(np.ascontiguousarray(table[:, 1:])).to(self.device)
        if chunks:
            table = np.concatenate(chunks)
            table = table[np.argsort(table[:, 0], kind="stable")]
            site_ptr = np.searchsorted(table[:, 0], np.arange(S * L + 1)).astype(np.int64)
            ops = table[:, 1:]
        else:
            site_ptr, ops = np.zeros(S * L + 1, dtype=np.int64), np.zeros((0, 4), dtype=np.int64)
        # reads, site-major (k = S layer + s): for each site the reading segments' wanted rows
        wanted: list[tuple[Segment, list[int]]] = []
        for s in reads:
            pos = [p for p in range(max(s.pos0, s.read_from), s.pos0 + s.n) if s.read.wants(p, s.num_prompt_tokens)]
            if pos:
                wanted.append((s, pos))
        per_site: list[list[int]] = [[] for _ in range(S * L)]
        layouts: list[tuple[Segment, list[int], list[int]]] = []
        for s, pos in wanted:
            for k in _read_sites(s.read):
                per_site[k] += [s.row0 + p - s.pos0 for p in pos]
        for r in extra:
            per_site[S * r.layer + SITE_INDEX[r.site]] += r.rows
        read_ptr = np.zeros(S * L + 1, dtype=np.int64)
        read_ptr[1:] = np.cumsum([len(r) for r in per_site])
        cursor = read_ptr[:-1].copy()
        for s, pos in wanted:  # where each segment's rows land in read_out, per (layer, site) in the read's order
            starts = []
            for k in _read_sites(s.read):
                starts.append(int(cursor[k]))
                cursor[k] += len(pos)
            layouts.append((s, pos, starts))
        for r in extra:  # after the segments' rows at its site, in the order given
            k = S * r.layer + SITE_INDEX[r.site]
            r.start = int(cursor[k])
            cursor[k] += len(r.rows)
        read_rows = np.asarray([r for rows in per_site for r in rows], dtype=np.int64)
        dev = self.device
        edits = StepEdits(
            torch.from_numpy(site_ptr).to(dev), torch.from_numpy(np.ascontiguousarray(ops)).to(dev), self._bank,
            torch.from_numpy(read_ptr).to(dev), torch.from_numpy(read_rows).to(dev),
            torch.zeros(len(read_rows), self.dim, device=dev), head_ptr, head_ops, **clamp_table,
            norm_eps=self.norm_eps)
        return edits, layouts


def _read_sites(read: HiddenStateRead) -> list[int]:
    """The sites k = S layer + s a read takes, layer-major (its values' column order)."""
    return [S * layer + SITE_INDEX[site] for layer in read.layers for site in read.sites]


def _template(pat, base: int) -> np.ndarray:
    """A pattern's ops with its vectors at bank offset `base`, cached on the pattern (decode steps reuse it)."""
    if pat.template is not None and pat.template[0] == base:
        return pat.template[1]
    t = np.empty((pat.sites.size, 5), dtype=np.int64)
    t[:, 0], t[:, 1] = pat.sites, 0
    for j, col in ((2, pat.u), (3, pat.keep), (4, pat.put)):
        t[:, j] = np.where(col >= 0, col + base, -1)
    pat.template = (base, t)
    return t


def _head_template(heads: np.ndarray, base: int) -> np.ndarray:
    """A pattern's head ops (S_h, 5) [k_h, head, u, keep, put] -> (S_h, 6) [k_h, row (unset), head, u, keep, put]
    with its vectors at bank offset `base`."""
    t = np.zeros((heads.shape[0], 6), dtype=np.int64)
    t[:, 0], t[:, 2] = heads[:, 0], heads[:, 1]
    t[:, 3:] = np.where(heads[:, 2:] >= 0, heads[:, 2:] + base, -1)
    return t


def gather_reads(edits: StepEdits, layout: tuple[Segment, list[int], list[int]]) -> Tensor:
    """One segment's reads out of `read_out` -> (n_positions, n_layers x n_sites, D) float32 on the CPU."""
    s, pos, starts = layout
    parts = [edits.read_out[a : a + len(pos)] for a in starts]  # each (n_positions, D)
    return torch.stack(parts, dim=1).cpu()
