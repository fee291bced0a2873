"""The probe line format (DESIGN.md's example, exactly)."""

from owner_reduce.planning.flush_plan import FlushPlan, FlushRange
from owner_reduce.planning.probe import FlushReport, format_probe_line

DESIGN_EXAMPLE = ("[dc-probe][r0] flushReduceBucket #3 dtype=BFloat16 tasks=118 reduced_elems=52428800 "
                  "kept_elems=6553600 discarded=87.5% pre_div=1 owner_tasks=0 owner_elems=0 (0.0%)")


def test_allreduce_flush_matches_the_documented_line():
    plan = FlushPlan(ranges=(FlushRange(0, 52428800, None),), tasks=118, reduced_elems=52428800, owner_tasks=0,
                     owner_elems=0, eligible_tasks=100, eligible_elems=40000000)
    line = format_probe_line(FlushReport(rank=0, flush_index=3, dtype="bfloat16", plan=plan, kept_elems=6553600,
                                         pre_div=True, calls=1))
    assert line.startswith(DESIGN_EXAMPLE + " ")
    assert line.endswith(" calls=1 eligible_tasks=100 eligible_elems=40000000 eligible_share=76.3%")


def test_owner_flush_discards_only_what_reached_this_rank():
    # 100 elements to rank 1, 50 to everyone; rank 1 keeps its 100 and 10 of the 50.
    plan = FlushPlan(ranges=(FlushRange(0, 100, 1), FlushRange(100, 50, None)), tasks=3, reduced_elems=150,
                     owner_tasks=2, owner_elems=100, eligible_tasks=2, eligible_elems=100)
    r1 = format_probe_line(FlushReport(1, 1, "float32", plan, kept_elems=110, pre_div=True, calls=2))
    r0 = format_probe_line(FlushReport(0, 1, "float32", plan, kept_elems=40, pre_div=True, calls=2))
    assert "[dc-probe][r1] flushReduceBucket #1 dtype=Float tasks=3 reduced_elems=150 kept_elems=110 " \
           "discarded=26.7% pre_div=1 owner_tasks=2 owner_elems=100 (66.7%)" in r1
    assert "kept_elems=40 discarded=6.7%" in r0


def test_counts_take_the_right_form():
    from owner_reduce.planning.wording import count_noun

    assert count_noun(1, "flush", "flushes") == "1 flush" and count_noun(2, "flush", "flushes") == "2 flushes"
    assert count_noun(0, "straddling gradient") == "0 straddling gradients"
    assert count_noun(1, "straddling gradient") == "1 straddling gradient"


def test_lines_go_through_deepspeeds_logger_at_info_in_one_write_each(monkeypatch):
    """Through DeepSpeed's logger, never around it: hidden at its default level (WARNING), one write per line with
    its newline at INFO, so ranks sharing a terminal never interleave inside a line."""
    import io
    import logging

    from deepspeed.utils import logger

    from owner_reduce.runtime.handle import emit

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    recorder = Recorder()
    handler = logging.StreamHandler(recorder)  # the class of DeepSpeed's own handler, with its format
    handler.setFormatter(logger.handlers[0].formatter)
    logger.addHandler(handler)
    before = logger.level
    logger.setLevel(logging.WARNING)  # DeepSpeed's default (setLevel: the logger caches what it lets through)
    line = format_probe_line(FlushReport(rank=1, flush_index=1, dtype="float32", plan=FlushPlan(
        ranges=(FlushRange(0, 8, 0),), tasks=1, reduced_elems=8, owner_tasks=1, owner_elems=8, eligible_tasks=1,
        eligible_elems=8), kept_elems=0, pre_div=True, calls=1))
    emit(line)
    assert recorder.writes == []  # the log level is the user's: nothing bypasses it
    logger.setLevel(logging.INFO)
    try:
        emit(line)
        emit("second")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
    assert len(recorder.writes) == 2 and recorder.writes[0].endswith("] " + line + "\n"), recorder.writes
    assert "[INFO]" in recorder.writes[0] and recorder.writes[1].endswith("] second\n")
    assert "\n" not in line


def test_probe_lines_come_from_rank_0_unless_every_rank_is_asked_for(monkeypatch):
    import torch

    from tests.support.fakes import flat_map, mirror_runtime

    m = flat_map([8, 8], 2)

    def lines(rank, all_ranks):
        rt, _ = mirror_runtime(m, rank=rank, probe=True, all_ranks=all_ranks)
        rt.start_backward(True)
        for p in reversed(list(m)):
            rt.reduce_grad(torch.ones(p.numel), 11, p.param_id)
        rt.end_backward(11, False)
        assert rt.stats.flushes == 1
        return rt.stats.probe_lines

    assert [len(lines(r, False)) for r in (0, 1)] == [1, 0]  # 20 lines a run, not 20 per rank
    assert [lines(r, True)[0].split()[0] for r in (0, 1)] == ["[dc-probe][r0]", "[dc-probe][r1]"]


def test_a_probe_whose_lines_the_log_level_hides_is_said_once(monkeypatch):
    import logging

    from deepspeed.utils import logger
    from deepspeed.utils import logging as deepspeed_logging

    from owner_reduce.runtime import stats

    warnings = []
    monkeypatch.setattr(logger, "warning", warnings.append)
    monkeypatch.setattr(stats, "_hidden_said", set())
    before = logger.level
    try:
        deepspeed_logging.set_log_level_from_string("info")  # what the config's "log_level": "info" does
        assert not stats.say_if_hidden("compile.reduce_probe's lines") and warnings == []
        deepspeed_logging.set_log_level_from_string("warning")
        logger.setLevel(logging.INFO)  # the logger alone: its handler still drops INFO
        assert stats.say_if_hidden("compile.reduce_probe's lines") and "log level (WARNING) hides" in warnings[0]
        monkeypatch.setattr(stats, "_hidden_said", set())
        warnings.clear()
        deepspeed_logging.set_log_level_from_string("warning")
        assert stats.say_if_hidden("compile.reduce_probe's lines")
        assert stats.say_if_hidden("compile.reduce_probe's lines")
    finally:
        deepspeed_logging.set_log_level_from_string(logging.getLevelName(before).lower())
    assert warnings == ["owner_reduce: compile.reduce_probe's lines are logged at INFO, which DeepSpeed's log level "
                        '(WARNING) hides: add "log_level": "info" to the DeepSpeed config to see them']


def test_algo_is_appended_last():
    plan = FlushPlan(ranges=(FlushRange(0, 100, 0), FlushRange(100, 100, 1)), tasks=2, reduced_elems=200,
                     owner_tasks=2, owner_elems=200, eligible_tasks=2, eligible_elems=200)
    line = format_probe_line(FlushReport(0, 1, "float32", plan, kept_elems=100, pre_div=True, calls=1,
                                         algo="reduce_scatter"))
    assert line.endswith(" calls=1 eligible_tasks=2 eligible_elems=200 eligible_share=100.0% algo=reduce_scatter")
    assert " algo=" not in format_probe_line(FlushReport(0, 1, "float32", plan, 100, True, 2))


def test_the_init_line_is_shown_at_deepspeeds_default_level_and_the_rest_stays_at_info(monkeypatch):
    """Turning the owner path on always says what it does: rank 0's init line goes out at WARNING where DeepSpeed's
    log level (WARNING by default) hides INFO, and at INFO where INFO shows; the other lines stay at INFO either way.
    Negative control: without ``even_if_hidden`` the init line is dropped at the default level."""
    import logging

    from deepspeed.utils import logger
    from deepspeed.utils import logging as deepspeed_logging

    from owner_reduce.runtime import stats

    records: list[tuple[str, str]] = []
    monkeypatch.setattr(logger, "warning", lambda line: records.append(("warning", line)))
    monkeypatch.setattr(logger, "info", lambda line: records.append(("info", line)))
    before = logger.level
    try:
        deepspeed_logging.set_log_level_from_string("warning")
        stats.emit("DeepCompile reduce_to_owner: 3/4 gradients reduce to one rank", even_if_hidden=True)
        stats.emit("owner_reduce: settings: algo=auto")
        deepspeed_logging.set_log_level_from_string("info")
        stats.emit("DeepCompile reduce_to_owner: 3/4 gradients reduce to one rank", even_if_hidden=True)
    finally:
        deepspeed_logging.set_log_level_from_string(logging.getLevelName(before).lower())
    assert records == [("warning", "DeepCompile reduce_to_owner: 3/4 gradients reduce to one rank"),
                       ("info", "owner_reduce: settings: algo=auto"),
                       ("info", "DeepCompile reduce_to_owner: 3/4 gradients reduce to one rank")]
