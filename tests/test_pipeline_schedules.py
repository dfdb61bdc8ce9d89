"""Pipeline schedules as data: validity, the validator's rejections, closed-form bubbles,
the Zero Bubble paper's Table 5, peak activations, the simulate CLI and the plot."""

import dataclasses
import json

import pytest

from parallelisms.cli import main
from parallelisms.parallel.pipeline.schedules import (
    SCHEDULES, Action, Kind, ScheduleError, build_schedule)
from parallelisms.parallel.pipeline.simulate import Times, plot, simulate
from parallelisms.parallel.pipeline.validate import ScheduleValidationError, validate

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def _cases():
    for name in SCHEDULES:
        for pp in (2, 4):
            for m in sorted({2 * pp, 3 * pp, 4 * pp + 2 * (name != "interleaved")}):
                for v in ((2, 3) if name == "interleaved" else (None,)):
                    yield name, pp, m, v


@pytest.mark.parametrize("name,pp,m,v", list(_cases()))
def test_every_schedule_is_valid(name, pp, m, v):
    s = build_schedule(name, pp, m, v)
    validate(s)
    assert all(any(a.kind is Kind.FORWARD for a in acts) for acts in s.ranks)


@pytest.mark.parametrize("name", SCHEDULES)
def test_placement(name):
    s = build_schedule(name, 4, 16)
    ranks_of_stage = {s.rank_of(st, mb) for mb in range(16) for st in range(s.num_stages)}
    assert ranks_of_stage == set(range(4))
    if name in ("zb-v", "dualpipev"):
        assert s.placement[0] == (0, 1, 2, 3, 3, 2, 1, 0)
    if name == "dualpipe":  # two directions: rank r holds stage r and stage pp-1-r
        assert s.placement == ((0, 1, 2, 3), (3, 2, 1, 0)) and s.mb_path == (0,) * 8 + (1,) * 8
        assert s.modules_on(1) == [(0, 1), (1, 2)]
    if name == "interleaved":
        assert s.modules_on(1) == [(0, 1), (0, 5)]


# --- the validator rejects broken schedules ---------------------------------------------------

def _with_rank(schedule, rank, actions):
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def test_rejects_missing_receive():
    s = build_schedule("1f1b", 4, 8)
    acts = [a for a in s.ranks[2] if not (a.kind is Kind.RECV_F and a.mb == 3)]
    with pytest.raises(ScheduleValidationError, match=r"rank 2: F\(s2,mb3\): needs the activation of stage 1, mb 3"):
        validate(_with_rank(s, 2, acts))


def test_rejects_unreceived_send():
    s = build_schedule("gpipe", 2, 4)
    acts = list(s.ranks[1]) + [Action(Kind.SEND_B, 1, 0, peer=0)]
    with pytest.raises(ScheduleValidationError, match="duplicate send|never received"):
        validate(_with_rank(s, 1, acts))


def test_rejects_deadlock_cycle():
    # rank 0 waits for the gradient of mb 0 before sending the activation rank 1 needs to make it
    s = build_schedule("1f1b", 2, 4)
    acts = list(s.ranks[0])
    send = next(i for i, a in enumerate(acts) if a.kind is Kind.SEND_F and a.mb == 0)
    recv = next(i for i, a in enumerate(acts) if a.kind is Kind.RECV_B and a.mb == 0)
    acts.insert(send, acts.pop(recv))
    with pytest.raises(ScheduleValidationError, match="deadlock") as err:
        validate(_with_rank(s, 0, acts))
    assert "rank 0 waits at RECV_B(s1,mb0)" in str(err.value) and "rank 1 waits at RECV_F(s0,mb0)" in str(err.value)


def test_rejects_duplicated_forward():
    s = build_schedule("zb-h1", 2, 4)
    acts = list(s.ranks[0])
    acts.insert(1, acts[0])
    with pytest.raises(ScheduleValidationError, match=r"rank 0: F\(s0,mb0\): .*computed a second time"):
        validate(_with_rank(s, 0, acts))


def test_rejects_weight_pass_before_input_pass_and_missing_work():
    s = build_schedule("zb-h1", 2, 4)
    acts = [a for a in s.ranks[1] if a.kind is not Kind.BACKWARD_WEIGHT]
    with pytest.raises(ScheduleValidationError, match="weight gradient of stage 1, mb 0 is never computed"):
        validate(_with_rank(s, 1, acts))
    w = next(a for a in s.ranks[1] if a.kind is Kind.BACKWARD_WEIGHT)
    acts = [w] + [a for a in s.ranks[1] if a != w]
    with pytest.raises(ScheduleValidationError, match=r"W\(s1,mb0\): needs the input gradient"):
        validate(_with_rank(s, 1, acts))


def test_rejects_wrong_pipedream_version():
    s = build_schedule("pipedream", 2, 4)
    acts = list(s.ranks[0])
    i = next(i for i, a in enumerate(acts) if a.kind is Kind.BACKWARD and a.mb == 2)
    acts[i] = dataclasses.replace(acts[i], version=acts[i].version + 1)
    with pytest.raises(ScheduleValidationError, match="stashed version"):
        validate(_with_rank(s, 0, acts))


def test_pipedream_weight_stashing():
    s = build_schedule("pipedream", 4, 8)
    first = [a for a in s.ranks[0] if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER)]
    fwd = {a.mb: a.version for a in first if a.kind is Kind.FORWARD}
    assert [fwd[i] for i in range(8)] == [0, 0, 0, 0, 1, 2, 3, 4]  # 4 in flight before the first update
    assert all(a.version == fwd[a.mb] for a in first if a.kind is Kind.BACKWARD)
    assert [a.version for a in first if a.kind is Kind.OPTIMIZER] == list(range(1, 9))


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,msg", [
    (("nope", 4, 8), "unknown schedule 'nope'; valid: gpipe, 1f1b"),
    (("dualpipe", 3, 12), "even pp"),
    (("dualpipe", 4, 9), "even microbatch"),
    (("dualpipe", 4, 4), "needs at least 6 microbatches"),
    (("zb-v", 4, 6), "needs at least 7 microbatches"),
    (("interleaved", 4, 6, 2), "divisible by pp"),
    (("interleaved", 4, 8, 1), "chunks >= 2"),
    (("1f1b", 4, 8, 3), "only interleaved takes chunks"),
    (("1f1b", 0, 8), "pp must be >= 1"),
])
def test_bad_input_is_one_line_value_error(args, msg):
    with pytest.raises(ScheduleError, match=msg) as err:
        build_schedule(*args)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


# --- closed forms (t_comm = 0) ------------------------------------------------------------------

TIMES = [Times(1, 1, 1), Times(1, 2, 0.5), Times(2, 1.5, 1)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 12)])
def test_gpipe_1f1b_bubble(name, pp, m):
    for t in TIMES:
        sim = simulate(build_schedule(name, pp, m), t)
        assert sim.bubble / sim.ideal == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (4, 8, 4)])
def test_interleaved_bubble(pp, m, v):
    for t in TIMES:
        sim = simulate(build_schedule("interleaved", pp, m, v), t)
        assert sim.bubble / sim.ideal == pytest.approx((pp - 1) / (v * m))


@pytest.mark.parametrize("pp,m", [(2, 6), (4, 8), (4, 12), (8, 24)])
def test_zero_bubble_table2(pp, m):
    # Qi et al. Table 2, under its assumption that a forward/backward pass dominates a weight pass
    for t in [Times(1, 1, 1), Times(1.2, 1.1, 0.5), Times(1, 1, 0.3)]:
        bubble = {n: simulate(build_schedule(n, pp, m), t).bubble for n in ("1f1b", "zb-h1", "zb-h2")}
        assert bubble["1f1b"] == pytest.approx((pp - 1) * (t.t_f + t.t_b + t.t_w))
        assert bubble["zb-h1"] == pytest.approx((pp - 1) * (t.t_f + t.t_b - t.t_w))
        assert bubble["zb-h2"] == pytest.approx((pp - 1) * (t.t_f + t.t_b - 2 * t.t_w), abs=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 20), (6, 12), (8, 16)])
def test_dualpipe_deepseek_table2(pp, m):
    # DeepSeek-V3 Table 2: (PP/2-1)(F&B + B - 3W), B a full backward; F&B run back to back here.
    for tf, tw in [(1, 1), (1, 0.5), (2, 0.25)]:
        tb = tf  # balanced forward and input-gradient passes
        sim = simulate(build_schedule("dualpipe", pp, m), Times(tf, tb, tw))
        f_and_b, full_b = tf + tb + tw, tb + tw
        assert sim.bubble == pytest.approx((pp / 2 - 1) * (f_and_b + full_b - 3 * tw))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 20), (8, 16)])
def test_dualpipev_is_dualpipe_cut_in_half(pp, m):
    # DualPipeV on pp ranks is DualPipe over PP = 2pp half-size stages: same Table 2 formula
    for tf, tw in [(1, 1), (1, 0.5), (2, 0.25)]:
        sim = simulate(build_schedule("dualpipev", pp, m), Times(tf, tf, tw))
        f, b, w = tf / 2, tf / 2, tw / 2  # one chunk
        assert sim.bubble == pytest.approx((2 * pp / 2 - 1) * ((f + b + w) + (b + w) - 3 * w))


@pytest.mark.parametrize("pp,m", [(2, 6), (4, 8), (4, 16), (8, 24)])
def test_zb_v_bubble(pp, m):
    # ZB-V: no bubble when T_F = T_B = T_W; with T_F = T_B it is ZB-H2's (p-1)(T_F+T_B-2T_W) at half
    # the per-chunk time, with ZB-H1's memory (p microbatches)
    for tf, tw in [(1, 1), (1, 0.5), (2, 1)]:
        sim = simulate(build_schedule("zb-v", pp, m), Times(tf, tf, tw))
        assert sim.bubble == pytest.approx((pp - 1) * (2 * tf - 2 * tw) / 2, abs=1e-9)


# --- Zero Bubble paper, Table 5 (measured times of its App. D, 1.5B model, p = 8) ---------------

TABLE5 = [  # m, T_F, T_B, T_W, T_comm, 1F1B, ZB-H1, ZB-H2
    (24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083),
    (32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837),
    (64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444),
]


@pytest.mark.parametrize("m,tf,tb,tw,tc,r_1f1b,r_h1,r_h2", TABLE5)
def test_zero_bubble_table5(m, tf, tb, tw, tc, r_1f1b, r_h1, r_h2):
    for name, paper in (("1f1b", r_1f1b), ("zb-h1", r_h1), ("zb-h2", r_h2)):
        rate = simulate(build_schedule(name, 8, m), Times(tf, tb, tw, tc)).bubble_rate
        assert abs(rate - paper) < 5e-4, (name, rate, paper)


# --- peak activations ---------------------------------------------------------------------------

@pytest.mark.parametrize("pp", [2, 4, 8])
def test_peak_activations(pp):
    m = 3 * pp
    peak = {n: max(simulate(build_schedule(n, pp, m)).peak_activations) for n in SCHEDULES if n != "interleaved"}
    assert peak["gpipe"] == m
    assert peak["1f1b"] == peak["zb-h1"] == peak["pipedream"] == pp
    assert peak["zb-h2"] == 2 * pp - 1
    assert peak["dualpipe"] == pp + 1
    assert peak["zb-v"] == pp
    for v in (2, 3):  # Korthikanti et al.: the first stage holds 1F1B's p times (1 + (p-1)/(p v))
        first = simulate(build_schedule("interleaved", pp, m, v)).peak_activations[0]
        assert first == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))


# --- CLI and plot -------------------------------------------------------------------------------

def _cli(argv, capsys):
    rc = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json(capsys):
    rc, out, err = _cli(["--schedule", "zb-h2", "--pp", "8", "--microbatches", "24", "--tf", "18.522",
                         "--tb", "18.086", "--tw", "9.337", "--tcomm", "0.601", "--json"], capsys)
    assert rc == 0 and not err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["schedule"] == "zb-h2" and result["pp"] == 8 and result["microbatches"] == 24
    assert abs(result["bubble_rate"] - 0.1083) < 5e-4
    assert result["peak_activations"] == [15] * 8 and result["makespan"] > 0


def test_cli_human_summary_and_plot(tmp_path, capsys):
    for suffix in (".png", ".svg"):
        path = tmp_path / f"dualpipe{suffix}"
        rc, out, _ = _cli(["--schedule", "dualpipe", "--pp", "4", "--microbatches", "8", "--plot", str(path)], capsys)
        assert rc == 0 and "bubble rate" in out and path.stat().st_size > 1000


@pytest.mark.parametrize("argv,msg", [
    (["--schedule", "dualpipe", "--pp", "3", "--microbatches", "8"], "even pp"),
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "6", "--chunks", "2"], "divisible"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--tf", "-1"],
     "argument --tf: must be a finite number in [0, "),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--plot", "x.pdf"], ".png or .svg"),
])
def test_cli_bad_input(argv, msg, capsys):
    rc, out, err = _cli(argv, capsys)
    assert rc == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1


def test_plot_function(tmp_path):
    sim = simulate(build_schedule("zb-v", 2, 4), Times(1, 1, 1, 0.1))
    assert plot(sim, tmp_path / "zbv.svg").read_text().startswith("<?xml")


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_fused_overlapped_chunks_stay_valid(name):
    """The executor runs each DualPipe F&B chunk as one (the backward inside the forward's expert dispatch):
    the reordered lists, receives first and the forward's sends after the backward, are still correct and
    deadlock-free for every size tried."""
    from parallelisms.parallel.pipeline.schedules import fuse_overlapped
    from parallelisms.parallel.pipeline.validate import validate
    checked = 0
    for pp in (2, 4, 6, 8):
        for m in range(2, 4 * pp + 1, 2):
            try:
                schedule = build_schedule(name, pp, m)
            except ScheduleError:
                continue
            fused = fuse_overlapped(schedule)
            validate(fused)
            pairs = sum(1 for acts in fused.ranks for a, b in zip(acts, acts[1:]) if a.overlap and b.kind.value in "BI")
            assert pairs == sum(1 for acts in schedule.ranks for a in acts if a.overlap)  # every chunk adjacent
            checked += 1
    assert checked >= 10


def _as_run(sim, steps: int = 3) -> list[list[dict]]:
    """A simulated timeline as the runtime reports it: per rank and step, compute records in nanoseconds."""
    ranks = []
    for row in sim.timeline:
        records = [(a.kind.value, a.stage, a.mb, round(start * 1e9), round(end * 1e9)) for a, start, end in row]
        step = {"span": records[-1][4] - records[0][3], "busy": sum(e - s for *_, s, e in records),
                "records": records, "peak_held": 0}
        ranks.append([step] * steps)
    return ranks


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved"])
def test_the_bubble_of_a_run_is_recovered_from_its_records(name):
    """Fed with a timeline whose stages differ (a heavier last stage) and whose messages take t_comm and
    actions t_host apart, pipeline_bubble recovers the per-stage times, the latency and the host time, and
    its in-run simulation reproduces the timeline's bubble; uniform per-stage times give the paper's bubble."""
    from parallelisms.parallel.pipeline.runner import pipeline_bubble
    schedule = build_schedule(name, 4, 8, 2 if name == "interleaved" else 1)
    split = name == "zb-h1"
    stages = tuple((1.0 + 0.5 * (s == schedule.num_stages - 1), 2.0, 1.0 if split else 0.0)
                   for s in range(schedule.num_stages))
    truth = simulate(schedule, Times(stages=stages, t_comm=0.3, t_host=0.1))
    got = pipeline_bubble(schedule, _as_run(truth), one_clock=True)
    assert got["t_latency_in_run_s"] == pytest.approx(0.3) and got["t_host_s"] == pytest.approx(0.1)
    assert got["stage_times_s"] == [pytest.approx(list(t)) for t in stages]
    assert got["measured_bubble_rate"] == pytest.approx(truth.bubble_rate, abs=1e-9)
    assert got["simulated_bubble_rate_in_run"] == pytest.approx(truth.bubble_rate, abs=1e-9)
    assert got["simulated_bubble_rate"] < got["measured_bubble_rate"]  # without latency and host time: less
    uniform = tuple((1.0 / schedule.chunks, 2.0 / schedule.chunks, 0.0) for _ in range(schedule.num_stages))
    assert simulate(schedule, Times(1, 2, 0, stages=uniform)).bubble_rate == pytest.approx(
        simulate(schedule, Times(1, 2, 0)).bubble_rate)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "dualpipe", "pipedream"])
def test_the_reduction_hook_precedes_each_update(name):
    """The executor calls a stage's data-parallel reduction (``on_stage_done``) right after the stage's last
    backward work before each OPTIMIZER action of that stage (PipeDream: after every microbatch's backward), or,
    in a schedule without one, once per stage at the end of the step's backward work."""
    import types

    import torch

    from parallelisms.parallel.pipeline.executor import Executor

    pp, m = 2, 4
    s = build_schedule(name, pp, m)
    for rank in range(pp):
        stages = {stage: types.SimpleNamespace(seq_shards=1, rope_cos=torch.zeros(1))
                  for _, stage in s.modules_on(rank)}
        executor = Executor(s, rank, stages, comm=None, timeline=None)
        actions = executor.actions
        backward = ("B", "W")
        for stage in stages:
            done = sorted(i for i, st in executor.stage_done_at.items() if st == stage)
            updates = [i for i, a in enumerate(actions) if a.kind.value == "OPT" and a.stage == stage]
            work = [i for i, a in enumerate(actions) if a.kind.value in backward and a.stage == stage]
            if name == "pipedream":  # one reduction per update, after the backward it follows
                assert len(done) == len(updates) == m
                for reduce_at, update_at in zip(done, updates):
                    assert reduce_at < update_at and max(i for i in work if i < update_at) == reduce_at
            else:
                assert not updates and done == [max(work)]
