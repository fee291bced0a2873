"""The probe line: what one bucket flush delivered to this rank and what this rank dropped.

Why a fixed format: users and tools grep these lines (DESIGN.md); fields may be appended as ` key=value`,
never changed. Pure: numbers in, string out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flush_plan import FlushPlan

PROBE_FLUSH_LIMIT = 20  # lines per rank: the first flushes only

# c10 ScalarType names, as the native runtime prints them.
SCALAR_TYPE_NAMES: dict[str, str] = {
    "float32": "Float", "float16": "Half", "bfloat16": "BFloat16", "float64": "Double",
    "int64": "Long", "int32": "Int", "int8": "Char", "uint8": "Byte",
}


@dataclass(frozen=True)
class FlushReport:
    rank: int
    flush_index: int  # 1-based, per rank, across all dtypes
    dtype: str  # torch dtype name without the "torch." prefix
    plan: FlushPlan
    kept_elems: int  # elements this rank copied into its non-empty grad buffers
    pre_div: bool
    calls: int  # collectives issued for this flush
    algo: str = ""  # the kinds of those calls (owner_layout.algo_of): reduce_scatter, reduce, allreduce or a mix

    @property
    def discarded_elems(self) -> int:
        return max(0, self.plan.received_elems(self.rank) - self.kept_elems)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "0.0%"


def format_probe_line(report: FlushReport) -> str:
    plan = report.plan
    dtype = SCALAR_TYPE_NAMES.get(report.dtype, report.dtype)
    return (f"[dc-probe][r{report.rank}] flushReduceBucket #{report.flush_index} dtype={dtype} tasks={plan.tasks} "
            f"reduced_elems={plan.reduced_elems} kept_elems={report.kept_elems} "
            f"discarded={_pct(report.discarded_elems, plan.reduced_elems)} pre_div={int(report.pre_div)} "
            f"owner_tasks={plan.owner_tasks} owner_elems={plan.owner_elems} "
            f"({_pct(plan.owner_elems, plan.reduced_elems)}) "
            f"calls={report.calls} eligible_tasks={plan.eligible_tasks} eligible_elems={plan.eligible_elems} "
            f"eligible_share={_pct(plan.eligible_elems, plan.reduced_elems)}"
            + (f" algo={report.algo}" if report.algo else ""))
