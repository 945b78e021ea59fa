"""Randomized Hadamard rotations of a decoder's residual stream and value heads, folded into the weights.

Outlier channels make a weight group's range wide: a few large input features set the scale of every group they
fall in.  An orthogonal matrix ``Q`` that mixes every feature into every other (a Hadamard matrix: all entries
``±1 / sqrt(n)``) spreads them out, and in a decoder whose residual stream only ever passes through RMSNorms,
linears and additions the rotation can be folded into the weights *exactly* (QuaRot, Ashkboos et al. 2024;
SpinQuant, Liu et al. 2024: the offline part, no extra ops in the graph).

The math (row vectors; a Hugging Face linear ``W`` ``[N, K]`` computes ``y = x Wᵀ + b``):

* **RMSNorm commutes with Q once its gamma is folded out.**  ``rms(x Q) = rms(x)`` (``Q`` keeps the norm), so
  ``n(x Q) = n(x) Q`` with ``n(x) = x / sqrt(mean(x²) + eps)``.  A norm's gamma ``g`` does not commute, so it
  moves into the linears that read the norm: ``(n(x) ∘ g) Wᵀ = n(x) (W diag(g))ᵀ`` and the norm keeps ``g = 1``.
* **The stream is carried rotated**, ``x' = x Q``: the embedding rows ``E' = E Q``; a **reader** of a norm
  (q / k / v or the packed qkv, gate / up or gate_up, the lm_head) ``W' = W diag(g) Q``, since
  ``n(x') W'ᵀ = n(x) Q Qᵀ diag(g) Wᵀ = (n(x) ∘ g) Wᵀ``; a **writer** of the stream (o_proj, down_proj)
  ``W' = Qᵀ W``, ``b' = Qᵀ b``, since ``(z Wᵀ + b) Q = z (Qᵀ W)ᵀ + b Q``.  The residual additions add rotated
  vectors; the final norm feeds the rotated lm_head: the logits are unchanged.
* **A tied embedding becomes two tables**: the embedding ``E Q`` and the lm_head ``E diag(g_final) Q`` differ
  unless ``g_final = 1``, so the builder stores the head apart (``WeightTransform.unties``).
* **Per-head rotation of the values**: with an orthogonal ``R`` of the head size, every key/value head's rows of
  ``W_v`` become ``Rᵀ W_v[h]`` (its values ``V_h R``) and every query head's columns of ``W_o`` become
  ``W_o[:, i] R``.  Attention mixes value rows with scalar weights, so head ``i`` outputs ``A_i V_h R`` and
  ``A_i V_h R (W_o[:, i] R)ᵀ = A_i V_h W_o[:, i]ᵀ``: exact, with GQA too (one ``R`` for every head).  It makes
  o_proj's input (whose groups run along ``K = heads x head_dim``) incoherent as well.

Which families: those whose residual stream sees nothing but pre-norm RMSNorms, linears and additions
(:attr:`quantkit.frontends.families.Family.rotation_invariant`): no LayerNorm (its mean subtraction does not
commute with ``Q``), no norm of a sub-layer's output before the residual add (Gemma 2 / 3), no learned position
table.  Others are refused with a :class:`~quantkit.errors.RecipeError`.

**The rotation Q** (:func:`random_hadamard`): ``Q = diag(s) H / sqrt(n)`` with ``s`` random signs (a seeded
``numpy`` generator) and ``H`` a Hadamard matrix of order ``n`` (``H Hᵀ = n I``), made exactly by
:func:`hadamard`: a Kronecker product of a Paley matrix (Paley I: order ``q + 1`` for a prime ``q ≡ 3 mod 4``;
Paley II: ``2 (q + 1)`` for a prime ``q ≡ 1 mod 4``) and a Sylvester power of two, the smallest Paley order
first: SmolLM2's hidden size 576 = 36 x 16 (Paley II, q = 17), 960 = 60 x 16, 3072 = 12 x 256, 3584 = 28 x 128,
powers of two by Sylvester alone.  Hadamard matrices exist only for orders 1, 2 and multiples of 4; an order
with no construction here gets a block-diagonal matrix of Hadamard blocks of the largest constructible order
dividing ``n``: still orthogonal and exact, mixing within each block only; its description says so.  Everything is computed in
float64 and stored as float32, in row (or column) chunks of a few MB, as the weights stream: one block at a time.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from quantkit.errors import RecipeError
from quantkit.frontends.families import FAMILIES, DecoderConfig
from quantkit.frontends.llm_builder import WeightTransform, block_prefix, linear_groups, norm_gamma

__all__ = ["ROTATIONS", "HadamardRotation", "hadamard", "random_hadamard", "rotatable_model_types", "rotation_for"]

ROTATIONS = ("none", "hadamard")
"""Values of ``quantization.rotation``."""

_CHUNK_BYTES = 16 << 20  # float64 bytes of one chunk of rows being rotated


# --------------------------------------------------------------------------- Hadamard matrices


def _is_prime(p: int) -> bool:
    if p < 2:
        return False
    return all(p % d for d in range(2, math.isqrt(p) + 1))


def _paley_kind(order: int) -> tuple[str, int] | None:
    """``("I", q)`` or ``("II", q)`` when a Paley construction gives a Hadamard matrix of ``order``, else None."""
    if _is_prime(order - 1) and (order - 1) % 4 == 3:
        return "I", order - 1
    if order % 2 == 0 and _is_prime(order // 2 - 1) and (order // 2 - 1) % 4 == 1:
        return "II", order // 2 - 1
    return None


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=256)
def _factors(n: int) -> tuple[int, ...] | None:
    """Orders whose Hadamard matrices' Kronecker product has order ``n``, or None when ``n`` has no such
    factorization: a power of two alone; else the smallest Paley order ``odd(n) x 2^j`` times a power of two (the
    structure a fast transform would use: 576 = 36 x 16); else a product of Paley orders (and a power of two)."""
    if _power_of_two(n):
        return (n,)
    twos = (n & -n).bit_length() - 1
    odd = n >> twos
    for j in range(twos + 1):
        if _paley_kind(odd << j) is not None:
            return (odd << j,) if j == twos else (odd << j, 1 << (twos - j))
    divisors = sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})
    for d in divisors:
        if d < n and not _power_of_two(d) and _paley_kind(d) is not None:
            rest = _factors(n // d)
            if rest is not None:
                return (d, *rest)
    return None


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _paley(order: int) -> np.ndarray:
    """A Paley Hadamard matrix of ``order`` (see :func:`_paley_kind`), entries ±1."""
    kind = _paley_kind(order)
    assert kind is not None  # noqa: S101 - callers pick orders from _factors
    which, q = kind
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)])
    idx = np.arange(q)
    jac = chi[(idx[None, :] - idx[:, None]) % q]  # Jacobsthal matrix: chi(j - i)
    ones = np.ones(q)
    if which == "I":  # q = 3 mod 4: jac is skew; H = I + [[0, 1ᵀ], [-1, jac]]
        s = np.zeros((q + 1, q + 1))
        s[0, 1:], s[1:, 0], s[1:, 1:] = ones, -ones, jac
        return np.eye(q + 1) + s
    # q = 1 mod 4: jac is symmetric; C = [[0, 1ᵀ], [1, jac]] is a symmetric conference matrix
    c = np.zeros((q + 1, q + 1))
    c[0, 1:], c[1:, 0], c[1:, 1:] = ones, ones, jac
    return np.kron(c, np.array([[1.0, 1.0], [1.0, -1.0]])) + np.kron(np.eye(q + 1), np.array([[1.0, -1.0], [-1.0, -1.0]]))


def _name(order: int) -> str:
    if _power_of_two(order):
        return f"H{order} (Sylvester)"
    which, q = _paley_kind(order) or ("?", 0)
    return f"H{order} (Paley {which}, q={q})"


def hadamard(n: int) -> tuple[np.ndarray, str]:
    """A matrix ``H`` ``[n, n]`` (float64) with orthogonal rows of norm ``sqrt(n)`` and entries ``±1``, and how
    it was made.

    A Hadamard matrix when ``n`` factors into Paley orders and a power of two (:func:`_factors`); else a
    block-diagonal one of Hadamard blocks of the largest order ``d`` dividing ``n`` that does (``H Hᵀ = n I``
    still holds once each block is scaled by ``sqrt(n / d)``: its entries are then ``±sqrt(n / d)``).

    Raises:
        RecipeError: ``n`` < 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RecipeError(f"hadamard order {n!r}; allowed: an integer >= 1")
    factors = _factors(n)
    if factors is not None:
        h: np.ndarray = np.ones((1, 1), np.float64)
        for f in factors:
            h = np.kron(h, _sylvester(f) if _power_of_two(f) else _paley(f))
        return h, " ⊗ ".join(_name(f) for f in factors)
    d = max(k for k in range(1, n) if n % k == 0 and _factors(k) is not None)
    block, how = hadamard(d)
    h = np.kron(np.eye(n // d), block * math.sqrt(n / d))
    return h, f"block-diagonal: {n // d} blocks of {how} (no Hadamard matrix of order {n} is constructed here)"


def random_hadamard(n: int, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """``Q = diag(s) H / sqrt(n)`` (float64, orthogonal) with random signs ``s`` drawn from ``rng``."""
    h, how = hadamard(n)
    s = rng.choice(np.array([-1.0, 1.0]), size=n)
    return (s[:, None] * h) / math.sqrt(n), how


# --------------------------------------------------------------------------- folding into streamed weights


def _rows64(t: Any, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a torch tensor or numpy array (any float dtype, maybe a strided view) as float64."""
    chunk = t[start:stop]
    if isinstance(chunk, np.ndarray):
        return np.asarray(chunk, np.float64)
    import torch

    return chunk.to(torch.float64).numpy()


def _right(t: Any, m: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """``(t diag(scale)) @ m`` as float32, ``t`` ``[R, K]`` read in row chunks (float64 math)."""
    rows, k = int(t.shape[0]), int(t.shape[1])
    out = np.empty((rows, m.shape[1]), np.float32)
    step = max(1, _CHUNK_BYTES // (8 * max(k, m.shape[1])))
    for a in range(0, rows, step):
        x = _rows64(t, a, min(rows, a + step))
        if scale is not None:
            x *= scale
        out[a : a + step] = x @ m
    return out


def _left(m: np.ndarray, t: Any) -> np.ndarray:
    """``m @ t`` as float32 (``t`` ``[K, C]`` read in column chunks)."""
    return np.ascontiguousarray(_right(t.T, m.T).T)


def _vector(t: Any) -> np.ndarray:
    return _rows64(t, 0, int(t.shape[0])).reshape(-1)


def rotatable_model_types() -> list[str]:
    """The model types whose family's residual stream can be rotated (:attr:`Family.rotation_invariant`); a variant
    of a model type with several (:attr:`Family.when`) with the config values that select it."""
    out = []
    for f in FAMILIES:
        if not f.rotation_invariant:
            continue
        for t in f.model_types:
            shared = any(t in o.model_types for o in FAMILIES if o is not f)
            when = ", ".join(f"{k}: {str(v[0]).lower()}" for k, v in f.when)
            out.append(f"{t} ({when})" if shared and when else t)
    return out


class HadamardRotation(WeightTransform):
    """The residual-stream rotation ``Q`` and the per-head value rotation ``R`` of one decoder (module docstring),
    applied to the weights as :func:`~quantkit.frontends.llm_builder.build_llm` streams them.

    Raises:
        RecipeError: the family's residual stream is not rotation-invariant (naming it and the allowed ones).
    """

    unties = True

    def __init__(self, cfg: DecoderConfig, seed: int = 0) -> None:
        fam = cfg.spec
        why = fam.rotation_refusal
        if why is not None:
            raise RecipeError(
                f"quantization.rotation 'hadamard' cannot be folded into model_type {cfg.model_type!r} "
                f"({fam.title}): {why}; allowed: model types {', '.join(rotatable_model_types())}, or "
                "quantization.rotation: none")  # fmt: skip
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise RecipeError(f"quantization.rotation_seed {seed!r}; allowed: an integer >= 0")
        self.cfg, self.seed = cfg, seed
        rng = np.random.default_rng(seed)
        self.Q, self.q_how = random_hadamard(cfg.hidden_size, rng)
        self.R, self.r_how = random_hadamard(cfg.head_dim, rng)
        # the factor of a norm whose gamma was folded out: 1, stored as the family stores its norm weight
        self.unit = np.zeros if fam.norm == "rms_offset" else np.ones

    def describe(self) -> str:
        return (f"hadamard (seed {self.seed}): residual stream rotated by diag(s) H / sqrt({self.cfg.hidden_size}), "
                f"H = {self.q_how}; value / o_proj heads by a {self.cfg.head_dim}-point one, H = {self.r_how}; norm "
                "gammas folded into the linears that read them; the lm_head stored apart from the embedding")

    # -- the WeightTransform ---------------------------------------------------------------------------
    def embedding(self, table: Any) -> np.ndarray:
        return _right(table, self.Q)

    def final_norm(self, gamma: Any) -> np.ndarray:
        return np.ones(self.cfg.hidden_size, np.float32)

    def head(self, weight: Any, gamma: Any) -> np.ndarray:
        return _right(weight, self.Q, _vector(gamma))

    def block(self, index: int, weights: dict[str, Any]) -> None:
        cfg, w = self.cfg, weights
        n, p = cfg.spec.names, block_prefix(cfg, index)
        attn_in, (o_proj,), mlp_in, (down,) = linear_groups(cfg)
        H = cfg.hidden_size
        for norm, readers in ((n.attn_norm, attn_in), (n.mlp_norm, mlp_in)):
            key = f"{p}.{norm}.weight"
            g = _vector(norm_gamma(cfg, w[key]))
            w[key] = self.unit(H, np.float32)
            for s in readers:
                w[f"{p}.{s}.weight"] = _right(w[f"{p}.{s}.weight"], self.Q, g)
        for s in (o_proj, down):
            w[f"{p}.{s}.weight"] = _left(self.Q.T, w[f"{p}.{s}.weight"])
            if f"{p}.{s}.bias" in w:
                w[f"{p}.{s}.bias"] = (self.Q.T @ _vector(w[f"{p}.{s}.bias"])).astype(np.float32)
        self._value_heads(p, w, attn_in, o_proj)

    def _value_heads(self, p: str, w: dict[str, Any], attn_in: tuple[str, ...], o_proj: str) -> None:
        """Rows of every value head ``Rᵀ W_v[h]`` (``b_v[h] R``), columns of every o_proj head ``W_o[:, i] R``."""
        cfg, R = self.cfg, self.R
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        names = cfg.spec.names
        v_name = names.v if names.v is not None else attn_in[0]  # a packed [q | k | v] weight: its last rows
        first = 0 if names.v is not None else (nh + nkv) * hd
        rows = slice(first, first + nkv * hd)
        key = f"{p}.{v_name}.weight"
        v = np.asarray(w[key], np.float32)  # float32 already: rotated by Q above
        v[rows] = np.einsum("ji,hjk->hik", R, v[rows].reshape(nkv, hd, -1).astype(np.float64)).reshape(nkv * hd, -1)
        w[key] = v
        bias = f"{p}.{v_name}.bias"
        if bias in w:
            b = _vector(w[bias])
            b[rows] = (b[rows].reshape(nkv, hd) @ R).reshape(-1)
            w[bias] = b.astype(np.float32)
        key = f"{p}.{o_proj}.weight"
        o = np.asarray(w[key], np.float32)
        w[key] = (o.reshape(o.shape[0], nh, hd).astype(np.float64) @ R).reshape(o.shape[0], nh * hd).astype(np.float32)


def rotation_for(kind: str, seed: int, cfg: DecoderConfig) -> HadamardRotation | None:
    """The transform ``quantization.rotation`` names for this decoder (None for ``none``).

    Raises:
        RecipeError: an unknown kind, or a family whose residual stream is not rotation-invariant.
    """
    if kind == "none":
        return None
    if kind == "hadamard":
        return HadamardRotation(cfg, seed)
    raise RecipeError(f"quantization.rotation {kind!r}; allowed: {', '.join(ROTATIONS)}")
