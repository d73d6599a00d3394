"""scripts/timeline_report.py on records of a scripted deployment: the breakdown's arithmetic and the picture."""

from __future__ import annotations

import json

import pytest

import timeline_report

from vllm_afd.wire.timeline import Mark, StepRecord

LAYERS = 3
US = 1000  # ns


def scripted_step(seq: int, *, compute_us: int, ffn_us: int, wire_us: int) -> tuple[StepRecord, StepRecord]:
    """One step on one clock: attention computes, sends (wire/2 each way), the FFN computes, sends back."""
    attention, ffn = [], []
    t = seq * 10_000 * US
    for layer in range(LAYERS):
        t += compute_us * US
        attention += [Mark("a2f_send_start", layer, 0, t), Mark("a2f_send_end", layer, 0, t)]
        ffn += [Mark("a2f_recv_start", layer, 0, t - 5 * US), Mark("a2f_recv_end", layer, 0, t + wire_us * US // 2)]
        sent = t + wire_us * US // 2 + ffn_us * US
        ffn += [Mark("f2a_send_start", layer, 0, sent), Mark("f2a_send_end", layer, 0, sent)]
        t = sent + wire_us * US // 2
        attention.append(Mark("f2a_recv_end", layer, 0, t))
    common = dict(step_seq=seq, graph_replay=True, warmup=False, profile=False, rows=4, clock="device",
                  host_syncs=0)
    opened = seq * 10_000 * US
    return (StepRecord("attention", 0, opened_ns=opened, closed_ns=opened, marks=tuple(attention), **common),
            StepRecord("ffn", 0, opened_ns=opened, closed_ns=opened, marks=tuple(ffn), **common))


@pytest.fixture
def timeline_dir(tmp_path):
    steps = [scripted_step(seq, compute_us=100, ffn_us=50, wire_us=300) for seq in range(5)]
    for role, index in (("attention", 0), ("ffn", 1)):
        lines = [json.dumps(pair[index].to_json()) for pair in steps]
        (tmp_path / f"{role}-0.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_the_breakdown_separates_compute_transport_and_host(timeline_dir):
    [row] = timeline_report.breakdown(timeline_report.load(timeline_dir))

    assert (row["kind"], row["rows"], row["steps"], row["layers"]) == ("graph replay", 4, 5, LAYERS)
    assert row["attention compute"] == pytest.approx(0.100)
    assert row["round trip"] == pytest.approx(0.350)
    assert row["FFN compute"] == pytest.approx(0.050)
    assert row["transport"] == pytest.approx(0.300)
    assert row["step"] == pytest.approx(10.0 / LAYERS)  # steps open 10 ms apart
    assert row["other"] == pytest.approx(10.0 / LAYERS - 0.450)


def test_the_report_prints_the_table_and_draws_a_step(timeline_dir, tmp_path, capsys):
    png = tmp_path / "t.png"

    assert timeline_report.main([str(timeline_dir), "--png", str(png), "--markdown", str(tmp_path / "t.md")]) == 0

    out = capsys.readouterr().out
    assert "| graph replay | 4 | 5 | 3 | 0.100 | 0.350 | 0.050 | 0.300 |" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "timeline picture" in out and (tmp_path / "t.md").read_text().startswith("| kind |")


def test_a_line_that_is_not_a_record_names_file_and_line(tmp_path):
    (tmp_path / "attention-0.jsonl").write_text('{"role": "attention"}\n')

    with pytest.raises(SystemExit, match="attention-0.jsonl:1 is not a step record"):
        timeline_report.load(tmp_path)


def test_an_empty_directory_says_what_to_pass(tmp_path):
    with pytest.raises(SystemExit, match="no \\*.jsonl in"):
        timeline_report.load(tmp_path)


# ---- an FFN pool: 2 attention ranks on 2 FFN ranks, FFN rank 1's rows arriving later --------------------------

def pool_step(seq: int, rank: int, *, late_us: int, ffn_us: int, clock: str = "host") -> tuple[StepRecord, StepRecord]:
    """Attention rank ``rank`` and its FFN rank ``rank`` for one step; the pair's rows cross ``late_us`` late."""
    attention, _ = scripted_step(seq, compute_us=100, ffn_us=ffn_us, wire_us=300)
    ffn_marks = []
    for m in scripted_step(seq, compute_us=100, ffn_us=ffn_us, wire_us=300)[1].marks:
        ffn_marks.append(Mark(m.kind, m.exchange, m.stage, m.t_ns + late_us * US))
    common = dict(step_seq=seq, graph_replay=False, warmup=False, profile=False, rows=2 + rank, clock=clock,
                  host_syncs=0, opened_ns=attention.opened_ns, closed_ns=attention.closed_ns)
    return (StepRecord("attention", rank, marks=attention.marks, **common),
            StepRecord("ffn", rank, marks=tuple(ffn_marks), **common))


def write_pool(directory, *, clock: str = "host", ffn_1_steps=range(5)) -> None:
    for rank, late_us, ffn_us in ((0, 0, 50), (1, 20, 80)):
        pairs = [pool_step(seq, rank, late_us=late_us, ffn_us=ffn_us, clock=clock) for seq in range(5)]
        (directory / f"attention-{rank}.jsonl").write_text("".join(json.dumps(a.to_json()) + "\n" for a, _ in pairs))
        kept = [f for seq, (_, f) in enumerate(pairs) if rank == 0 or seq in ffn_1_steps]
        (directory / f"ffn-{rank}.jsonl").write_text("".join(json.dumps(f.to_json()) + "\n" for f in kept))


def test_every_ffn_rank_gets_a_row_with_its_compute_and_how_late_its_rows_arrived(tmp_path):
    write_pool(tmp_path)

    pool = timeline_report.ffn_ranks(timeline_report.load(tmp_path))

    assert [(r["FFN rank"], r["steps"], r["joined"], r["rows"]) for r in pool] == [("0", 5, 5, 2), ("1", 5, 5, 3)]
    assert [r["FFN compute"] for r in pool] == [pytest.approx(0.050), pytest.approx(0.080)]
    # Rank 1: 20 us late at the first layer, 30 us more at each next one (its longer compute): 20, 50, 80 us.
    assert [r["rows arrive after first"] for r in pool] == [pytest.approx(0.0), pytest.approx(0.050)]


def test_device_clocks_of_two_ffn_ranks_are_not_compared(tmp_path):
    write_pool(tmp_path, clock="device")

    pool = timeline_report.ffn_ranks(timeline_report.load(tmp_path))

    assert [r["rows arrive after first"] for r in pool] == [None, None]
    assert pool[1]["FFN compute"] == pytest.approx(0.080)  # a rank's own spans still count


def test_the_pool_table_is_printed_and_the_picture_has_a_lane_per_rank(tmp_path, capsys):
    write_pool(tmp_path, ffn_1_steps={1, 3})
    ranks = timeline_report.load(tmp_path)

    step = timeline_report.pick_step(ranks)
    assert list(step) == ["attention-0", "attention-1", "ffn-0", "ffn-1"]
    assert {r.step_seq for r in step.values()} == {3}  # the middle one of the steps every file holds
    assert timeline_report.main([str(tmp_path), "--png", str(tmp_path / "pool.png")]) == 0
    out = capsys.readouterr().out
    assert "| FFN rank | steps | joined | rows | FFN compute | FFN idle | rows arrive after first |" in out
    assert "| 1 | 2 | 2 | 3 | 0.080 |" in out
    assert "timeline picture" in out and (tmp_path / "pool.png").read_bytes()[:4] == b"\x89PNG"


def test_one_ffn_rank_prints_no_pool_table(timeline_dir, capsys):
    timeline_report.main([str(timeline_dir)])

    assert "FFN rank" not in capsys.readouterr().out


def test_rank_files_sort_by_role_then_rank_number():
    stems = ["ffn-10", "attention-1", "ffn-2", "notes", "attention-0"]

    assert sorted(stems, key=timeline_report.rank_key) == ["attention-0", "attention-1", "ffn-2", "ffn-10", "notes"]
