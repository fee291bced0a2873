"""A cluster's measured call times, in place of NCCL's tuning tables: fits, the file format.

Why: ``collective_time`` reproduces NCCL 2.30's own model on a named topology (H100/H200 HGX, one 400 Gb/s NIC per
GPU). A cluster that differs (another fabric, no NVLS, PCIe GPUs, gloo on CPU) makes different choices worth it;
``scripts/calibrate.py`` times the calls a flush issues on the cluster itself and writes this file; the DeepSpeed
config's ``compile.reduce_to_owner_calibration`` names it (read on every rank: ``rank_inputs``), and
``FlushCost(..., calibration=...)`` then costs every candidate on it (``flush_choice.CallTimes``).

The model per call kind is alpha-beta: ``latency_us + nbytes / (1000 * bandwidth_gbs)`` (1 GB/s moves 1000 bytes per
microsecond), ``nbytes`` the whole input of one call (a ReduceScatter's ``world_size x`` per-rank chunk). A send/recv
round adds a cost per peer: ``latency_us + per_peer_us * peers + max_bytes / (1000 * bandwidth_gbs)``, with
``peers`` and ``max_bytes`` the busiest rank's (``collective_time.p2p_load``).

Note (host): a call costs the host its issue before NCCL launches the group (``host_cost``). ``scripts/calibrate.py``
measures it through the runtime's own communicator, NCCL's enqueue and launch included: one group of ``n`` small
calls against one call of the same bytes, for a few ``n``; the time per extra call is the slope of a line through
(``n``, median us, max over ranks), ``per_call_us``; its intercept less the kind's fitted time for those bytes is the
group's own cost, ``per_group_us`` (the kind's fit times calls issued back to back, their issue hidden behind the
previous call; a group alone waits for its issue). Under a file that has them (format ``/2``) the model charges the
owner runtime these two (``HostCost``: nothing more for NCCL, which they include); native DeepCompile keeps the
defaults (its C++ loop and NCCL's enqueue, unmeasured: none charged), so the model still charges the owner path, not
native, for what is not measured. A format ``/1`` file (written before per-call costs were measured) is read as
before, with the default host cost, and the fits line says so.

Note (fit): least squares on (bytes, median microseconds) with relative residuals (each point weighted by 1 / its
time): a ladder from 4 KiB to 64 MiB spans about four orders of magnitude of time, and plain residuals would let
the largest sizes alone decide the latency. The coefficients are bounded (latency and per-peer cost >= 0, bandwidth
at most ``MAX_BANDWIDTH_GBS``, so > 0): the bounded least-squares optimum is found exactly by solving every face of
the box (each coefficient free or held at its bound) and keeping the best feasible solution (two or three
coefficients: at most eight small solves). So a ladder whose times do not grow with the bytes (all latency-bound)
gets ``MAX_BANDWIDTH_GBS`` and the mean latency, and one whose small sizes are noisy below a straight line gets
latency 0 rather than a negative one. A round measured at a single peer count cannot tell the per-peer cost from
the latency: it is fitted with ``per_peer_us`` 0.

Note (what is used): the file's fitted coefficients are what the cost model uses; ``points`` are the evidence they
were fitted from (kept for review, never refitted on load), so a coefficient may be edited by hand.

Note (agreement): every rank must choose alike, so every rank must load the same file: ``digest()`` (the canonical
JSON's sha256, 12 hex digits) is what ranks compare. Pure: no torch, no communication.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .calls import ALLREDUCE, COLLECTIVES, KindTable
from .host_cost import HostCost
from .json_digest import canonical_digest
from .json_fields import FieldCheck, parse_json, read_text

FORMAT = "owner_reduce.calibration/2"
FORMAT_V1 = "owner_reduce.calibration/1"  # before the host's per-call cost was measured: read, with the defaults
CALL_KINDS = COLLECTIVES  # the call kinds a calibration times (NCCL's collectives), in the order a file lists them
# Each kind the cost model may ask a calibration for, with its fit's name in the file (``calls`` Note (no
# fall-through)): a hand-off is timed as the send/recv round (``p2p``), never as a fit of its own.
_FITS: KindTable[str, str] = KindTable("the calibration (planning.calibration)", {k: k.value for k in CALL_KINDS},
                                       complete_for=CALL_KINDS)
MAX_BANDWIDTH_GBS = 10_000.0  # the bandwidth of a fit whose time does not grow with the bytes (10 TB/s: "free")


@dataclass(frozen=True)
class KindFit:
    """One call kind's alpha-beta fit and the (bytes, median us over repeats, max over ranks) points behind it."""

    kind: str
    latency_us: float
    bandwidth_gbs: float
    points: tuple[tuple[int, float], ...] = ()

    def call_us(self, nbytes: int) -> float:
        return self.latency_us + nbytes / (1000.0 * self.bandwidth_gbs)


@dataclass(frozen=True)
class P2pFit:
    """A grouped send/recv round's fit: latency, a cost per peer of the busiest rank, and its bytes' bandwidth;
    points are (peers, max_bytes, median us)."""

    latency_us: float
    per_peer_us: float
    bandwidth_gbs: float
    points: tuple[tuple[int, int, float], ...] = ()

    def round_us(self, peers: int, max_bytes: int) -> float:
        return self.latency_us + self.per_peer_us * peers + max_bytes / (1000.0 * self.bandwidth_gbs)


@dataclass(frozen=True)
class HostFit:
    """The host's cost of a call on the runtime's own communicator (Note (host)): per extra call of a group, and per
    group beyond its calls' fitted time; points are (calls in the group, bytes in all, median us, max over ranks),
    of one ``kind`` (the call the groups were made of)."""

    per_call_us: float
    per_group_us: float
    kind: str = ALLREDUCE.value
    points: tuple[tuple[int, int, float], ...] = ()

    def group_us(self, calls: int, fitted_us: float) -> float:
        """A group of ``calls`` calls whose calls the kind's fit times at ``fitted_us`` in all."""
        return self.per_group_us + self.per_call_us * calls + fitted_us


@dataclass(frozen=True)
class Calibration:
    """Measured call times of one cluster (``flush_choice.CallTimes``). ``backend``: the communicator that was timed
    (``cupy-nccl``, ``torch.distributed/gloo``); ``device``: what it ran on; ``measured_at``: UTC, ISO 8601;
    ``dtype``: the buffers' element type; ``software``: (name, version) pairs (torch, NCCL)."""

    world_size: int
    backend: str
    device: str
    fits: tuple[KindFit, ...]
    p2p: P2pFit | None
    measured_at: str
    dtype: str = "float32"
    warmup: int = 0
    repeats: int = 0
    software: tuple[tuple[str, str], ...] = ()
    host: HostFit | None = None  # None: not measured (a format /1 file, or scripts/calibrate.py --kinds without it)
    format: str = FORMAT  # the file's format as read (a /1 file keeps its digest)

    def host_cost(self, default: HostCost) -> HostCost:
        """The host cost under this calibration (Note (host)): the measured per-call and per-group cost for the owner
        runtime, NCCL's included; native's and the two-level stage's from ``default``. Without a measurement,
        ``default``."""
        if self.host is None:
            return default
        return HostCost(owner_call_us=self.host.per_call_us, owner_group_us=self.host.per_group_us,
                        owner_stage_us=default.owner_stage_us, nccl_call_us=0.0, nccl_group_us=0.0,
                        native_call_us=default.native_call_us, source=f"calibration {self.digest()}")

    def fit_of(self, kind: str) -> KindFit:
        name = _FITS[kind]  # a kind no calibration times raises here, naming it
        for f in self.fits:
            if f.kind == name:
                return f
        measured = ", ".join(f.kind for f in self.fits) or "none"
        raise ValueError(f"owner_reduce: the calibration has no '{kind}' measured (it has: {measured}); "
                         "rerun scripts/calibrate.py")

    def call_us(self, kind: str, nbytes: int) -> float:
        """One call of ``kind`` on ``nbytes`` of input; 0 for no bytes (no call is issued)."""
        fit = self.fit_of(kind)
        return 0.0 if nbytes <= 0 else fit.call_us(nbytes)

    def p2p_round_us(self, peers: int, max_bytes: int) -> float:
        """One grouped send/recv round whose busiest rank has ``peers`` peers and moves ``max_bytes``; 0 for none."""
        if self.p2p is None:
            raise ValueError("owner_reduce: the calibration has no send/recv round measured; rerun "
                             "scripts/calibrate.py")
        return 0.0 if peers <= 0 else self.p2p.round_us(peers, max_bytes)

    def missing_for_runtime(self) -> list[str]:
        """What the runtime would need and this file lacks (empty: complete): every call kind and the send/recv round
        (a file written with ``scripts/calibrate.py --kinds`` may hold only some)."""
        measured = {f.kind for f in self.fits}
        missing = [kind for kind in CALL_KINDS if kind not in measured]
        return missing + (["the send/recv round (p2p)"] if self.p2p is None else [])

    def check_world_size(self, world_size: int) -> None:
        """A calibration times calls at one world size (latencies grow with the ranks): refuse another."""
        if world_size != self.world_size:
            raise ValueError(f"owner_reduce: the calibration was measured on {self.world_size} ranks, this run has "
                             f"{world_size}; rerun scripts/calibrate.py at this world size")

    # ---- the file -------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": self.format,
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "measured_at": self.measured_at,
            "dtype": self.dtype,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "software": dict(self.software),
            "fits": {f.kind: {"latency_us": f.latency_us, "bandwidth_gbs": f.bandwidth_gbs,
                              "points": [list(p) for p in f.points]} for f in self.fits},
            "p2p": None if self.p2p is None else {
                "latency_us": self.p2p.latency_us, "per_peer_us": self.p2p.per_peer_us,
                "bandwidth_gbs": self.p2p.bandwidth_gbs, "points": [list(p) for p in self.p2p.points]},
        }
        if self.format != FORMAT_V1:
            out["host"] = None if self.host is None else {
                "per_call_us": self.host.per_call_us, "per_group_us": self.host.per_group_us, "kind": self.host.kind,
                "points": [list(p) for p in self.host.points]}
        return out

    def to_json(self) -> str:
        """The file's text (indented; floats as repr, so ``from_json`` gives back an equal Calibration)."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def digest(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no spaces), first 12 hex digits: the same file on every rank."""
        return canonical_digest(self.to_dict())

    @classmethod
    def from_json(cls, text: str, source: str = "<text>") -> Calibration:
        """Parse and validate; a ValueError names ``source`` and the key at fault (``fits.reduce.bandwidth_gbs``)."""
        return cls.from_dict(parse_json(text, "calibration", source), source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Calibration:
        obj = FieldCheck("calibration", source, FORMAT).mapping(data, "")
        version = obj.get("format")
        if version not in (FORMAT, FORMAT_V1):
            FieldCheck("calibration", source, FORMAT).fail("format", f"must be {FORMAT!r} (or {FORMAT_V1!r})", version)
        v = FieldCheck("calibration", source, version)
        v.keys(obj, "", required=("format", "world_size", "backend", "device", "measured_at", "fits", "p2p"),
               optional=("dtype", "warmup", "repeats", "software") + (("host",) if version == FORMAT else ()))
        world_size = v.integer(obj["world_size"], "world_size", minimum=1)
        strings = {k: v.string(obj[k], k) for k in ("backend", "device", "measured_at")}
        dtype = v.string(obj.get("dtype", "float32"), "dtype")
        warmup = v.integer(obj.get("warmup", 0), "warmup", minimum=0)
        repeats = v.integer(obj.get("repeats", 0), "repeats", minimum=0)
        software = v.mapping(obj.get("software", {}), "software")
        pairs = tuple((k, v.string(val, f"software.{k}")) for k, val in software.items())
        fits_obj = v.mapping(obj["fits"], "fits")
        fits = []
        for kind, fit in fits_obj.items():
            key = f"fits.{kind}"
            if kind not in CALL_KINDS:
                v.fail(key, f"is not a call kind (one of {', '.join(CALL_KINDS)})", kind)
            f = v.mapping(fit, key)
            v.keys(f, key, required=("latency_us", "bandwidth_gbs"), optional=("points",))
            points = tuple((v.integer(p[0], f"{key}.points[{i}][0]", minimum=0),
                            v.number(p[1], f"{key}.points[{i}][1]", minimum=0.0))
                           for i, p in enumerate(v.rows(f.get("points", []), f"{key}.points", 2)))
            fits.append(KindFit(kind, v.number(f["latency_us"], f"{key}.latency_us", minimum=0.0),
                                v.number(f["bandwidth_gbs"], f"{key}.bandwidth_gbs", positive=True), points))
        p2p = None
        if obj["p2p"] is not None:
            p = v.mapping(obj["p2p"], "p2p")
            v.keys(p, "p2p", required=("latency_us", "per_peer_us", "bandwidth_gbs"), optional=("points",))
            points3 = tuple((v.integer(r[0], f"p2p.points[{i}][0]", minimum=1),
                             v.integer(r[1], f"p2p.points[{i}][1]", minimum=0),
                             v.number(r[2], f"p2p.points[{i}][2]", minimum=0.0))
                            for i, r in enumerate(v.rows(p.get("points", []), "p2p.points", 3)))
            p2p = P2pFit(v.number(p["latency_us"], "p2p.latency_us", minimum=0.0),
                         v.number(p["per_peer_us"], "p2p.per_peer_us", minimum=0.0),
                         v.number(p["bandwidth_gbs"], "p2p.bandwidth_gbs", positive=True), points3)
        host = None
        if obj.get("host") is not None:
            h = v.mapping(obj["host"], "host")
            v.keys(h, "host", required=("per_call_us", "per_group_us"), optional=("kind", "points"))
            kind = v.string(h.get("kind", ALLREDUCE.value), "host.kind")
            if kind not in CALL_KINDS:
                v.fail("host.kind", f"is not a call kind (one of {', '.join(CALL_KINDS)})", kind)
            host_points = tuple((v.integer(r[0], f"host.points[{i}][0]", minimum=1),
                                 v.integer(r[1], f"host.points[{i}][1]", minimum=0),
                                 v.number(r[2], f"host.points[{i}][2]", minimum=0.0))
                                for i, r in enumerate(v.rows(h.get("points", []), "host.points", 3)))
            host = HostFit(v.number(h["per_call_us"], "host.per_call_us", minimum=0.0),
                           v.number(h["per_group_us"], "host.per_group_us", minimum=0.0), kind, host_points)
        return cls(world_size=world_size, fits=tuple(sorted(fits, key=lambda f: CALL_KINDS.index(f.kind))), p2p=p2p,
                   dtype=dtype, warmup=warmup, repeats=repeats, software=pairs, host=host, format=version,
                   **strings)


# ---- fitting ------------------------------------------------------------------------------------------------


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(rhs)
    a = [row[:] + [b] for row, b in zip(matrix, rhs, strict=True)]
    scale = max((abs(x) for row in matrix for x in row), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * max(scale, 1e-300):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def bounded_least_squares(columns: Sequence[Sequence[float]], target: Sequence[float], weights: Sequence[float],
                          lower: Sequence[float]) -> list[float]:
    """Minimise sum_i (w_i (sum_j c_j x_ij - t_i))^2 subject to c_j >= lower_j: every face of the box solved (each
    coefficient free or at its bound), the best feasible solution kept (exact for a convex objective)."""
    n = len(columns)
    # Columns scaled to unit size, so that bytes (1e7) and ones sit in one well-conditioned system.
    norms = [max((abs(x) for x in col), default=0.0) or 1.0 for col in columns]
    scaled = [[x / s for x in col] for col, s in zip(columns, norms, strict=True)]
    lows = [b * s for b, s in zip(lower, norms, strict=True)]
    best: tuple[float, list[float]] | None = None
    for mask in range(1 << n):
        free = [j for j in range(n) if mask >> j & 1]
        coef = list(lows)
        if free:
            residual = [t - sum(lows[j] * scaled[j][i] for j in range(n) if j not in free)
                        for i, t in enumerate(target)]
            normal = [[sum(w * w * scaled[a][i] * scaled[b][i] for i, w in enumerate(weights)) for b in free]
                      for a in free]
            rhs = [sum(w * w * scaled[a][i] * residual[i] for i, w in enumerate(weights)) for a in free]
            solution = _solve(normal, rhs)
            if solution is None:
                continue
            for j, value in zip(free, solution, strict=True):
                coef[j] = value
        if any(c < low - 1e-12 * max(1.0, abs(low)) for c, low in zip(coef, lows, strict=True)):
            continue
        cost = sum((w * (sum(coef[j] * scaled[j][i] for j in range(n)) - t)) ** 2
                   for i, (w, t) in enumerate(zip(weights, target, strict=True)))
        if best is None or cost < best[0] * (1 - 1e-12):
            best = (cost, coef)
    assert best is not None, "the all-at-bound face is always feasible"
    return [max(c, low) / s for c, low, s in zip(best[1], lows, norms, strict=True)]


def _weights(times: Sequence[float]) -> list[float]:
    floor = max(max(times, default=1.0) * 1e-9, 1e-6)
    return [1.0 / max(t, floor) for t in times]


def fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(latency_us, bandwidth_gbs) of ``latency + bytes / (1000 * bandwidth)`` through (bytes, us) points; see Note
    (fit). Needs two distinct sizes."""
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"owner_reduce: a fit needs at least two distinct sizes, got {sorted({b for b, _ in points})}")
    times = [float(t) for _, t in points]
    latency, per_byte = bounded_least_squares(
        [[1.0] * len(points), [float(b) for b, _ in points]], times, _weights(times),
        lower=[0.0, 1.0 / (1000.0 * MAX_BANDWIDTH_GBS)])
    return latency, 1.0 / (1000.0 * per_byte)


def fit_host(points: Sequence[tuple[int, int, float]], kind_fit: KindFit) -> HostFit:
    """The host's per-call and per-group cost (Note (host)) from (calls in one group, bytes in all, median us)
    points of groups of ``kind_fit.kind`` calls: the slope of the least-squares line through (calls, us) per call
    (bounded at 0; with two group sizes exactly ``(T_n - T_1) / (n - 1)``), its intercept less the kind's fitted time
    for the bytes per group (bounded at 0). Needs two distinct call counts and one byte count."""
    counts = sorted({c for c, _, _ in points})
    sizes = {b for _, b, _ in points}
    if len(counts) < 2 or len(sizes) != 1:
        raise ValueError(f"owner_reduce: a per-call fit needs groups of at least two call counts over one byte count, "
                         f"got counts {counts} and bytes {sorted(sizes)}")
    xs = [float(c) for c, _, _ in points]
    ys = [float(t) for _, _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
                / sum((x - mx) ** 2 for x in xs))
    intercept = my - slope * mx
    per_group = max(0.0, intercept - kind_fit.call_us(next(iter(sizes))))
    return HostFit(slope, per_group, kind_fit.kind, tuple((int(c), int(b), float(t)) for c, b, t in points))


def fit_kind(kind: str, points: Sequence[tuple[int, float]]) -> KindFit:
    latency, bandwidth = fit(points)
    return KindFit(kind, latency, bandwidth, tuple((int(b), float(t)) for b, t in points))


def fit_p2p(points: Sequence[tuple[int, int, float]]) -> P2pFit:
    """The send/recv round's fit through (peers, max_bytes, us) points; see Note (fit)."""
    if len({b for _, b, _ in points}) < 2:
        raise ValueError("owner_reduce: a send/recv fit needs at least two distinct sizes")
    times = [float(t) for _, _, t in points]
    peer_counts = {p for p, _, _ in points}
    columns = [[1.0] * len(points), [float(b) for _, b, _ in points]]
    lower = [0.0, 1.0 / (1000.0 * MAX_BANDWIDTH_GBS)]
    if len(peer_counts) > 1:
        columns.append([float(p) for p, _, _ in points])
        lower.append(0.0)
    coef = bounded_least_squares(columns, times, _weights(times), lower)
    per_peer = coef[2] if len(coef) > 2 else 0.0
    return P2pFit(coef[0], per_peer, 1.0 / (1000.0 * coef[1]), tuple((int(p), int(b), float(t)) for p, b, t in points))


def max_relative_residual(fitted: KindFit | P2pFit) -> float:
    """The largest |model - measured| / measured over the fit's points (0 without points): how well a line fits."""
    if isinstance(fitted, KindFit):
        pairs = [(fitted.call_us(b), t) for b, t in fitted.points]
    else:
        pairs = [(fitted.round_us(p, b), t) for p, b, t in fitted.points]
    return max((abs(m - t) / t for m, t in pairs if t > 0), default=0.0)


# ---- loading --------------------------------------------------------------------------------------------------


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file; errors name the file (and the key)."""
    p = Path(path)
    return Calibration.from_json(read_text(p, "calibration"), source=str(p))


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def _span(sizes: Sequence[int]) -> str:
    return f"{len(sizes)} sizes {_size(min(sizes))}..{_size(max(sizes))}" if sizes else "no points"


def _capped(bandwidth_gbs: float) -> str:
    return ("; the time did not grow with the bytes: bandwidth at its cap, a larger ladder would measure it"
            if bandwidth_gbs >= MAX_BANDWIDTH_GBS else "")


def _host_residual(cal: Calibration) -> float:
    """The largest |line - measured| / measured over the per-call fit's points (0 without them)."""
    h = cal.host
    if h is None or not any(f.kind == h.kind for f in cal.fits):
        return 0.0
    fit = cal.fit_of(h.kind)
    return max((abs(h.group_us(c, fit.call_us(b)) - t) / t for c, b, t in h.points if t > 0), default=0.0)


def format_fits(cal: Calibration) -> list[str]:
    """Lines for the log (DeepSpeed style: ``owner_reduce: ...``), one per fit, with how well each line fits."""
    lines = [f"owner_reduce: calibration {cal.digest()}: {cal.world_size} ranks, {cal.backend} on {cal.device}, "
             f"{cal.dtype}, median of {cal.repeats} after {cal.warmup} warm-up, max over ranks, {cal.measured_at}"]
    for f in cal.fits:
        lines.append(f"owner_reduce:   {f.kind:<15} latency {f.latency_us:9.1f} us, bandwidth {f.bandwidth_gbs:9.3f} "
                     f"GB/s ({_span(sorted({b for b, _ in f.points}))}, max residual "
                     f"{max_relative_residual(f):.0%}){_capped(f.bandwidth_gbs)}")
    if cal.p2p is not None:
        p = cal.p2p
        peers = sorted({q for q, _, _ in p.points})
        lines.append(f"owner_reduce:   {'send/recv':<15} latency {p.latency_us:9.1f} us + {p.per_peer_us:.1f} us per "
                     f"peer, bandwidth {p.bandwidth_gbs:9.3f} GB/s ({_span(sorted({b for _, b, _ in p.points}))}, "
                     f"peers {','.join(map(str, peers))}, max residual {max_relative_residual(p):.0%})"
                     f"{_capped(p.bandwidth_gbs)}")
    if cal.host is not None:
        h = cal.host
        counts = sorted({c for c, _, _ in h.points})
        worst = _host_residual(cal)
        lines.append(f"owner_reduce:   {'per call':<15} host {h.per_call_us:9.1f} us per call, {h.per_group_us:.1f} us "
                     f"per group (one group of {','.join(map(str, counts))} {h.kind} calls against one call of the "
                     f"same bytes, max residual {worst:.0%}); the owner runtime's issue is charged this")
    else:
        why = ("a format /1 file, written before per-call costs were measured" if cal.format == FORMAT_V1
               else "host was not among --kinds")
        lines.append(f"owner_reduce:   {'per call':<15} not measured ({why}): the default host cost is charged; "
                     f"rerun scripts/calibrate.py to measure it")
    return lines
