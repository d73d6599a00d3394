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
