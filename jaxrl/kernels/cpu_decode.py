"""The decode step's CPU kernels (`cpu_decode.cc`), built with the machine's compiler on first use.

    if cpu_decode.enabled(config.compute_dtype, layout):       # float32, one CPU device
        x_db, k_cache, v_cache = cpu_decode.layer(stacked_weights, i, x_db, cos_bh, sin_bh,
                                                  write_index_b, valid_bc, k_cache, v_cache,
                                                  eps=1e-6, window=0, qk_norm=False)
        head_p = cpu_decode.panels(head_vd, in_major=False)     # once per generation
        logits_vb = cpu_decode.matmul(head_p, h_db, v)           # [V, D] x [D, B] -> [V, B]

On a CPU a decode step is a few matrix-vector products per weight and a short attention per
row; XLA runs it as ~30 small operations per layer, each with its own dispatch and thread
hand-off, and its library kernels lose much of the machine on such small products (measured on
the workload model M, 16 rows: its matmuls at 54% of the 2-core float32 peak, its batched
attention dots at ~25 GFLOP/s). Here a whole layer is one call: the batch sits in the vector
lanes (each weight element is read once and broadcast against all rows), the threads stay in
the call from the first projection to the last, and each row attends over its own prefix
only. The LM head is one `matmul` call.

The kernels read each weight [O, D] as panels of 16 output rows, [ceil(O / 16), D, 16]
(`panels`, built once per generation call): one contiguous stream per panel, in which each
input feature brings the cache line of the 16 weights the 16 accumulators need; with a
software prefetch ahead in that stream, the [32000, 512] LM head of model M runs at ~2.8 ms
per step, against ~4.3 ms for the same loop over row-major [O, D] weights (measured on this
machine's 2 cores: the hardware prefetchers lose the short 2 KiB rows).

The library is compiled once per source, jaxlib and CPU (`-O3 -march=native`) into
`$JAXRL_CACHE/kernels/` (default `~/.cache/jaxrl`), written atomically so concurrent processes
can share it. Without a C++ compiler, or when the build fails, a warning is logged once and a
rollout with `decode_backend: auto` decodes with XLA (the same results up to float rounding;
`cpu_kernels` then refuses to start, naming why). `JAXRL_CPU_KERNELS=0` turns the kernels off;
`CXX` names the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jaxtyping import Array, Float, Int

log = logging.getLogger("jaxrl.kernels")

_SOURCE = Path(__file__).with_name("cpu_decode.cc")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_LANES = 16


def _cpu_signature() -> str:
    """The CPU model and feature flags (a library built for one CPU must not load on another)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXRL_CACHE", "~/.cache/jaxrl")).expanduser() / "kernels"


@functools.cache
def _library() -> Path | None:
    """Path of the built library, building it if needed; None (with a warning) if it cannot be."""
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler (set CXX): decode_backend=auto decodes with XLA")
        return None
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), jaxlib.__version__, cxx, " ".join(_FLAGS), _cpu_signature()):
        key.update(part if isinstance(part, bytes) else part.encode())
    target = _cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", tmp]
    log.info("building the CPU decode kernels: %s", " ".join(command))
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        log.warning(
            "building %s failed; decode_backend=auto decodes with XLA:\n%s",
            _SOURCE.name,
            detail[-2000:],
        )
        Path(tmp).unlink(missing_ok=True)
        return None
    os.replace(tmp, target)  # atomic: a concurrent build writes the same bytes
    return target


@functools.cache
def _registered() -> bool:
    path = _library()
    if path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in (
        ("jaxrl_decode_matmul", lib.JaxrlDecodeMatmul),
        ("jaxrl_decode_layer", lib.JaxrlDecodeLayer),
    ):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
    return True


def enabled(dtype, layout=None) -> bool:
    """Whether the decode step uses these kernels: a float32 computation on one CPU device (no
    rollout layout, or a one-device one), unless `JAXRL_CPU_KERNELS=0`, and the library
    builds."""
    if os.environ.get("JAXRL_CPU_KERNELS", "1") == "0":
        return False
    if jnp.dtype(dtype) != jnp.float32 or jax.default_backend() != "cpu":
        return False
    if layout is not None and layout.mesh.size > 1:
        return False
    return _registered()


PANEL = 16  # output rows per weight panel


def _pad_columns(x_db: Float[Array, "d b"]) -> Float[Array, "d bp"]:
    """Columns padded with zeros to a multiple of the kernels' 16 vector lanes."""
    return jnp.pad(x_db, ((0, 0), (0, -x_db.shape[1] % _LANES)))


def panels(w: Float[Array, "... a b"], *, in_major: bool) -> Float[Array, "... p d 16"]:
    """Weights W [O, D] (a stack of them: leading dims kept) as the kernels read them:
    [ceil(O / 16), D, 16] with `p[i, d, r] = W[16 i + r, d]` (rows past O are zeros).

    Args:
        w: W in-major, [..., D, O] (the parameter tree's [in, out]), or out-major,
            [..., O, D] (an embedding table [V, D]); cast to float32.
        in_major: Which of the two.
    """
    w = w.astype(jnp.float32)
    if in_major:  # [..., D, O] -> [..., D, P, 16] -> [..., P, D, 16]: moves 64-byte runs
        pad = [(0, 0)] * (w.ndim - 1) + [(0, -w.shape[-1] % PANEL)]
        w = jnp.pad(w, pad).reshape(*w.shape[:-1], -1, PANEL)
        return jnp.swapaxes(w, -3, -2)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, -w.shape[-2] % PANEL), (0, 0)]
    w = jnp.pad(w, pad)  # [..., O, D] -> [..., P, 16, D] -> [..., P, D, 16]
    return jnp.swapaxes(w.reshape(*w.shape[:-2], -1, PANEL, w.shape[-1]), -1, -2)


def matmul(
    w_p: Float[Array, "p d 16"], x_db: Float[Array, "d b"], rows: int
) -> Float[Array, "o b"]:
    """W x for a few columns, W [rows, D] given as its `panels`: [rows, B] (float32; B padded
    to 16 inside)."""
    if not 0 < rows <= w_p.shape[0] * PANEL or w_p.shape[1:] != (x_db.shape[0], PANEL):
        raise ValueError(
            f"cpu_decode.matmul: panels {w_p.shape} do not hold a [{rows}, {x_db.shape[0]}] "
            "weight; build them with cpu_decode.panels"
        )
    x = _pad_columns(x_db)
    out = jax.ShapeDtypeStruct((rows, x.shape[1]), jnp.float32)
    y = jax.ffi.ffi_call("jaxrl_decode_matmul", out)(w_p, x.astype(jnp.float32))
    return y[:, : x_db.shape[1]]


def vectors_fit() -> bool:
    """Whether this CPU holds the kernels' working set in registers: 32 vector registers of 16
    floats (x86 AVX-512F). The matmul keeps 16 accumulators of 16 lanes live (plus the input
    and the weight broadcast); with AVX2's 16 registers of 8 floats they take 32 and spill on
    every step of the inner loop. Measured on a 2-core AMD EPYC (znver3, AVX2 only): SmolLM2's
    [49152, 576] LM head times 16 columns takes 56 ms in `matmul` against 9.6 ms as XLA's dot,
    and a W1 decode step of model S 25 ms against 6.6 ms."""
    return "avx512f" in _cpu_signature().split()


def supports(head_dim: int) -> bool:
    """The layer kernel's limit: head_dim a multiple of 16, at most 1024 (and the cache length
    a multiple of 16, as `jaxrl.rollout`'s caches are)."""
    return head_dim % _LANES == 0 and head_dim <= 1024


# The layer kernel's weights, all stacked over the layers [L, ...], in argument order: the
# norm weights, each projection as `panels` with its bias (zeros where the model has none),
# the per-head q/k norm weights (ones where the model has none: unused).
LAYER_WEIGHTS = (
    "ln_attn_d",  # [L, D]
    "w_q_p",  # [L, ceil(N·H / 16), D, 16]
    "b_q_e",  # [L, N·H]
    "w_k_p",  # [L, ceil(K·H / 16), D, 16]
    "b_k_e",  # [L, K·H]
    "w_v_p",
    "b_v_e",
    "q_norm_h",  # [L, H]
    "k_norm_h",
    "w_o_p",  # [L, ceil(D / 16), N·H, 16]
    "b_o_d",  # [L, D]
    "ln_mlp_d",
    "w_gate_p",  # [L, ceil(F / 16), D, 16]
    "b_gate_f",  # [L, F]
    "w_up_p",
    "b_up_f",
    "w_down_p",  # [L, ceil(D / 16), F, 16]
    "b_down_d",  # [L, D]
)


def layer(
    weights: dict[str, Array],
    index: int,
    x_db: Float[Array, "d b"],
    cos_bh: Float[Array, "b h"],
    sin_bh: Float[Array, "b h"],
    write_index: Int[Array, " b"],
    kv_valid: Int[Array, "b c"],
    k_cache: Float[Array, "l b k h c"],
    v_cache: Float[Array, "l b k c h"],
    *,
    eps: float,
    window: int,
    qk_norm: bool,
    logit_softcap: float | None = None,
) -> tuple[Float[Array, "d b"], Float[Array, "l b k h c"], Float[Array, "l b k c h"]]:
    """Decoder layer `index` for one token per row (`jaxrl.models.transformer._block`'s
    math) in one kernel call.

    Row b's new key and value go to cache index `write_index[b]` of the layer's slice of the
    stacked caches (in place: the caches are aliased to the outputs), and its query attends
    to the entries c with `kv_valid[b, c]`,
    `c <= write_index[b]` and, for `window > 0`, `write_index[b] - c < window`.

    Args:
        weights: Every layer's weights, stacked (`LAYER_WEIGHTS`).
        index: Which layer.
        x_db: The residual stream, column-major [D, B].
        cos_bh, sin_bh: Each row's RoPE tables [B, H] (scaled, as `rope_cos_sin`).
        write_index: [B] cache index of each row's token.
        kv_valid: [B, C] nonzero where a real token's key is stored (the new one included).
        k_cache, v_cache: Every layer's keys [L, B, K, H, C] and values [L, B, K, C, H].
        eps: RMSNorm epsilon.
        window: Sliding window (0: none).
        qk_norm: Whether q and k are RMS-normed per head (`q_norm_h`, `k_norm_h`).
        logit_softcap: Must be None: the kernel has no score cap (refused otherwise).

    Returns:
        (x [D, B] after the layer, the updated caches).
    """
    if logit_softcap is not None:
        raise ValueError(
            f"cpu_decode.layer has no logit_softcap (got {logit_softcap}): the C++ kernel "
            "attends with uncapped scores; decode with rollout.decode_backend='xla'"
        )
    if k_cache.shape[-1] % _LANES:
        raise ValueError(
            f"cpu_decode.layer: the cache length {k_cache.shape[-1]} is not a multiple of "
            f"{_LANES}; allocate the cache with jaxrl.rollout's cache_geometry"
        )
    x = _pad_columns(x_db)
    h = k_cache.shape[3]
    outs = (
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
        jax.ShapeDtypeStruct(v_cache.shape, jnp.float32),
    )
    args = (
        x,
        cos_bh.astype(jnp.float32),
        sin_bh.astype(jnp.float32),
        write_index.astype(jnp.int32),
        kv_valid.astype(jnp.int32),
        *(weights[name] for name in LAYER_WEIGHTS),
        k_cache,
        v_cache,
    )
    caches = len(args) - 2
    y, k_cache, v_cache = jax.ffi.ffi_call(
        "jaxrl_decode_layer", outs, input_output_aliases={caches: 1, caches + 1: 2}
    )(
        *args,
        layer=np.int64(index),
        eps=np.float32(eps),
        window=np.int64(window),
        scale=np.float32(h**-0.5),
        qk_norm=bool(qk_norm),
    )
    return y[:, : x_db.shape[1]], k_cache, v_cache
