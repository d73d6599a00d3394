"""scripts/device/stage_prediction.py: the H200 stage table's prediction column from scripted timelines, on CPU."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import e2e_report
import phases
import serving
import stage_model
import stage_prediction
from tests.tools._stage_steps import staged_step

ROOT = Path(__file__).resolve().parents[2]

TWIN, STAGED = "afd_ipc_graphs", "afd_ipc_graphs_s2"
LAYERS = 3


def a_us(n: int) -> int:
    return 20 + 2 * n  # attention compute per layer: 0.020 ms + 0.002 ms per token


def f_us(n: int) -> int:
    return 10 + 4 * n


def write_timeline(directory: Path, batches: list[int], window_of: dict[int, int]) -> None:
    """Two measured 1-stage decode steps per batch inside its window, and a slow warm-up step outside it."""
    directory.mkdir(parents=True)
    lines: dict[str, list[str]] = {"attention": [], "ffn": []}
    seq = 0
    for batch in batches:
        for opened_ns, slow in ((window_of[batch] + 10, 1), (window_of[batch] + 20, 1), (window_of[batch] - 10, 50)):
            seq += 1
            for role, record in zip(("attention", "ffn"), staged_step(a_us(batch) * slow, f_us(batch) * slow,
                                                                     wire_us=300, layers=LAYERS, stages=1)):
                record = dataclasses.replace(record, step_seq=seq, rows=batch, opened_ns=opened_ns)
                lines[role].append(json.dumps(record.to_json()))
    for role, role_lines in lines.items():
        (directory / f"{role}-0.jsonl").write_text("\n".join(role_lines) + "\n")


def rate(tok_s: float, batch: int) -> dict[str, float]:
    return {"tok_s": tok_s, "tpot_ms": 1000.0 * batch / tok_s}


def bench_part(batches: list[int], window_of: dict[int, int]) -> dict:
    """What serving._decode_bench returns for a round of plain graphs, the twin and its 2-stage variant."""
    rates = {"plain_graphs": 400.0, TWIN: 200.0, STAGED: 300.0}
    return {"batches": batches, "prompt_len": 512,
            "variants": {v: {str(b): rate(r * b, b) for b in batches} for v, r in rates.items()},
            "windows_ns": {v: {str(b): [[window_of[b], window_of[b] + 100]] for b in batches} for v in rates}}


def table_rows(lines: list[str]) -> list[list[str]]:
    """The cells of the stage table's data rows."""
    return [line.strip("| ").split(" | ") for line in "\n".join(lines).splitlines() if line.startswith("| m |")]


def test_each_stage_variant_gets_its_twins_fitted_costs_and_a_predicted_ratio(tmp_path):
    windows = {8: 1000, 32: 2000}
    write_timeline(tmp_path / TWIN, [8, 32], windows)
    bench = bench_part([8, 32], windows)

    stage_prediction.annotate(bench, tmp_path)

    (predicted,) = bench["stage_prediction"].values()
    assert predicted["twin"] == TWIN and "missing" not in predicted
    fits = predicted["fits_ms"]  # the warm-up steps (50x slower, outside the windows) are not in them
    assert (fits["a"]["fixed"], fits["a"]["per_token"]) == pytest.approx((0.020, 0.002))
    assert (fits["f"]["fixed"], fits["f"]["per_token"]) == pytest.approx((0.010, 0.004))
    assert (fits["t"]["fixed"], fits["t"]["per_token"]) == pytest.approx((0.300, 0.0), abs=1e-12)
    line = [stage_model.Linear(f["fixed"], f["per_token"]) for f in fits.values()]
    for batch in (8, 32):
        cell = predicted["batches"][str(batch)]
        step_1 = 1000.0 / 200.0  # the twin's TPOT: 200 tok/s per request
        assert cell["predicted"] == pytest.approx(
            step_1 / stage_model.predicted_step_ms(step_1, tuple(line), batch, LAYERS, 2))
        assert (cell["measured"], cell["stages_run"]) == (pytest.approx(1.5), 2)
        assert 0 < cell["attention_busy_1_stage"] < 1 and 0 < cell["ffn_busy_1_stage"] < 1
    # By hand at batch 32: 3 layers of a + t + f = 0.084 + 0.3 + 0.138 ms at one stage (1.566 ms) become 1.352 ms
    # with 2 stages of 16 tokens (a 0.052, f 0.074): the 5 ms step predicts 5 / (5 - 1.566 + 1.352) = 1.0447.
    assert predicted["batches"]["32"]["predicted"] == pytest.approx(1.0447, abs=1e-4)


def test_the_stage_table_shows_the_prediction_and_busy_shares_next_to_the_measured_ratio(tmp_path):
    windows = {8: 1000}
    write_timeline(tmp_path / TWIN, [8], windows)
    part = bench_part([8], windows)
    stage_prediction.annotate(part, tmp_path)
    cell = part["stage_prediction"][STAGED]["batches"]["8"]

    lines = e2e_report._stage_lines({"models": {"m": part}})

    (row,) = table_rows(lines)
    assert row == ["m", "512", "8", STAGED, "2.4e+03", "1.6e+03", "1.5", e2e_report._fmt(cell["predicted"]),
                   f"{cell['attention_busy_1_stage']:.2f} / {cell['ffn_busy_1_stage']:.2f}", "3.2e+03", "0.75"]
    assert any("what two GPUs, one per role, would give" in line for line in lines)


def test_without_a_timeline_the_prediction_cells_read_a_dash(tmp_path):
    part = bench_part([8, 32], {8: 1000, 32: 2000})

    stage_prediction.annotate(part, tmp_path)  # no afd_ipc_graphs/ folder: the round ran without --timeline

    predicted = part["stage_prediction"][STAGED]
    assert predicted["fits_ms"] is None and "--timeline" in predicted["missing"]
    assert predicted["batches"]["8"]["predicted"] is None and predicted["batches"]["8"]["measured"] == 1.5
    rows = table_rows(e2e_report._stage_lines({"models": {"m": part}}))
    assert [row[2] for row in rows] == ["8", "32"] and all(row[6:9] == ["1.5", "—", "—"] for row in rows)


def test_a_failed_prediction_is_recorded_and_keeps_the_rounds_results(tmp_path):
    (tmp_path / TWIN).mkdir()
    (tmp_path / TWIN / "attention-0.jsonl").write_text("not a record\n")
    bench = {"models": {}, **bench_part([8], {8: 1000})}

    phases.stage_predictions(bench, tmp_path)

    assert f"{TWIN}/attention-0.jsonl:1 is not a step record (JSONDecodeError" in bench["stage_prediction"]["error"]
    assert bench["variants"][STAGED]["8"]["tok_s"] == 2400.0
    lines = e2e_report._stage_lines({"models": {"m": bench}})
    (row,) = table_rows(lines)
    assert row[6:9] == ["1.5", "—", "—"]
    assert lines[-1].startswith("Stage prediction failed: m, 512 prompt tokens: ValueError: ")


def test_every_prompt_length_gets_its_own_rows_and_prediction(tmp_path):
    write_timeline(tmp_path / TWIN, [8], {8: 1000})
    short, long = bench_part([8], {8: 1000}), bench_part([8], {8: 5000})  # the long bench's steps: none written
    long["prompt_len"] = 8192
    bench = {**short, "by_prompt_len": {"512": short, "8192": long}}

    stage_prediction.annotate(bench, tmp_path)

    assert short["stage_prediction"][STAGED]["batches"]["8"]["predicted"] is not None
    assert long["stage_prediction"][STAGED]["batches"]["8"]["predicted"] is None
    rows = table_rows(e2e_report._stage_lines({"models": {"m": bench}}))
    assert [row[1] for row in rows] == ["512", "8192"] and rows[0][7] != "—" and rows[1][7] == "—"


@given(a=st.floats(0.0, 2.0), f=st.floats(0.0, 2.0), t=st.floats(0.0, 2.0), host=st.floats(0.0, 5.0),
       batch=st.sampled_from([1, 2, 3, 8, 64]), k=st.sampled_from([2, 3]))
def test_flat_costs_never_predict_a_gain(a, f, t, host, batch, k):
    """One benched batch size fits flat costs (fit_linear's pessimistic reading): k stages then cost at least
    one lap per layer, so the predicted k ÷ 1 ratio is <= 1, and exactly 1 where the step does not split."""
    fits = tuple(stage_model.fit_linear([(batch, cost)]) for cost in (a, f, t))
    step_1 = host + stage_model.simulate_layers(a, f, t, LAYERS, 1)
    assume(step_1 > 0)
    ran = stage_model.stages_run(k, batch, serving.MIN_TOKENS_PER_STAGE)

    ratio = step_1 / stage_model.predicted_step_ms(step_1, fits, batch, LAYERS, ran)

    assert ratio <= 1 + 1e-9
    if batch < k:
        assert ratio == pytest.approx(1.0)


class _FakeCompletions(BaseHTTPRequestHandler):
    """/v1/completions answering max_tokens token ids per prompt, as vLLM does with ignore_eos."""

    def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        choices = [{"index": i, "text": "", "token_ids": [7] * body["max_tokens"], "finish_reason": "length",
                    "prompt_token_ids": prompt} for i, prompt in enumerate(body["prompt"])]
        payload = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_the_bench_records_the_window_of_every_measured_request():
    """The windows the prediction selects the twin's decode steps by: one per measured repeat, none for warm-up."""
    import time

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    before = time.perf_counter_ns()
    try:
        bench = serving.run_decode_bench({TWIN: url, STAGED: url}, serving.BenchPlan(batches=(2, 4), repeats=2),
                                         lambda: 600.0)
    finally:
        server.shutdown()

    for variant in (TWIN, STAGED):
        for batch in ("2", "4"):
            spans = bench["windows_ns"][variant][batch]
            assert len(spans) == 2 and all(before < lo < hi < time.perf_counter_ns() for lo, hi in spans)
    assert bench["token_counts_ok"]
