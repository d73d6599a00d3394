"""scripts/device/: the CUDA IPC parts of the GPU run, checked on CPU (serving.py, ipc_report.py, gpu_e2e.py).

The round serves AFD over P2pIpcAFDConnector eager and with FULL_DECODE_ONLY on both roles next to
plain vLLM and AFD over gloo; the `ipcfloor` phase measures the transport's own round trip. What can
fail before a server starts is tested here: the server flags, the ratios and the report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_ipc_floor
import gpu_e2e
import ipc_report
import serving
from bench_connector_rtt import parse_shapes

ROOT = Path(__file__).resolve().parents[2]

PORTS = {"afd_eager": 7001, "afd_ipc_eager": 7002, "afd_ipc_graphs": 7003}


def after(args, flag):
    return args[args.index(flag) + 1]


def test_a_full_round_pairs_every_afd_variant_with_its_own_ffn_port_and_graph_mode():
    settings = serving.ServeSettings(capture_sizes=(1, 32))

    specs = {s.name: s for s in serving.server_specs(list(gpu_e2e.VARIANTS), settings, afd_port=PORTS)}

    assert list(specs) == ["plain_eager", "plain_graphs", "afd_ffn", "afd_attention", "afd_ipc_ffn",
                           "afd_ipc_attention", "afd_ipcg_ffn", "afd_ipcg_attention"]
    for prefix, variant, connector, graphs in (("afd", "afd_eager", "P2pGlooAFDConnector", False),
                                               ("afd_ipc", "afd_ipc_eager", "P2pIpcAFDConnector", False),
                                               ("afd_ipcg", "afd_ipc_graphs", "P2pIpcAFDConnector", True)):
        ffn, attention = specs[f"{prefix}_ffn"], specs[f"{prefix}_attention"]
        assert (ffn.variant, attention.variant, attention.needs) == (None, variant, f"{prefix}_ffn")
        for spec, role in ((ffn, "ffn"), (attention, "attention")):
            afd = json.loads(after(spec.args, "--additional-config"))["afd"]
            assert (afd["role"], afd["connector"], afd["port"]) == (role, connector, PORTS[variant])
            assert ("--enforce-eager" in spec.args) is not graphs
        if graphs:  # identical on both roles: the handshake compares the graph mode
            assert after(ffn.args, "--compilation-config") == after(attention.args, "--compilation-config")
            assert json.loads(after(ffn.args, "--compilation-config"))["cudagraph_mode"] == "FULL_DECODE_ONLY"
        assert "--kv-cache-memory-bytes" not in ffn.args and "--kv-cache-memory-bytes" in attention.args
    assert serving.VARIANT_SERVERS["afd_ipc_graphs"] == "afd_ipcg_attention"


def test_a_stage_variant_runs_both_roles_with_its_stage_count_and_is_compared_with_its_one_stage_twin():
    import e2e_report

    specs = {s.name: s for s in serving.server_specs(["plain_eager", "afd_ipc_graphs_s2", "afd_ipc_eager_s3"],
                                                     serving.ServeSettings(), afd_port={"afd_ipc_graphs_s2": 7004,
                                                                                        "afd_ipc_eager_s3": 7005})}

    assert list(specs) == ["plain_eager", "afd_ipcg_s2_ffn", "afd_ipcg_s2_attention", "afd_ipc_s3_ffn",
                           "afd_ipc_s3_attention"]
    for prefix, stages, graphs in (("afd_ipcg_s2", 2, True), ("afd_ipc_s3", 3, False)):
        for role in ("ffn", "attention"):
            spec = specs[f"{prefix}_{role}"]
            afd = json.loads(after(spec.args, "--additional-config"))["afd"]
            assert (afd["num_stages"], afd["min_tokens_per_stage"], afd["connector"],
                    "--enforce-eager" in spec.args) == (stages, 1, "P2pIpcAFDConnector", not graphs)
    assert "num_stages" not in json.loads(serving.afd_config_json("ffn", 1, 10.0))["afd"]
    assert serving.STAGE_TWINS["afd_ipc_graphs_s3"] == "afd_ipc_graphs"
    assert tuple(serving.STAGE_TWINS) == e2e_report.STAGE_VARIANTS == gpu_e2e.STAGE_VARIANTS
    assert ("afd_ipc_graphs_s2", "afd_ipc_graphs") in e2e_report.COMPARISONS
    assert ("afd_ipc_eager_s3", "plain_eager") in e2e_report.COMPARISONS
    assert set(serving.STAGE_TWINS) <= set(serving.CUDA_ONLY_VARIANTS)


def test_afd_variants_need_their_ports_and_ipc_needs_cuda():
    with pytest.raises(ValueError,
                       match=r"AFD variants \['afd_eager', 'afd_ipc_eager'\] need one rendezvous port each"):
        serving.server_specs(["plain_eager", "afd_eager", "afd_ipc_eager"], serving.ServeSettings(), afd_port=1)
    with pytest.raises(ValueError, match=r"\['afd_ipc_eager'\] needs CUDA; drop it on CPU"):
        serving.server_specs(["afd_ipc_eager"], serving.ServeSettings(platform="cpu"), afd_port=1)


def test_the_gputests_phase_collects_the_ipc_gpu_tests():
    assert "tests/connectors/test_ipc_cuda.py" in gpu_e2e.GPU_TESTS
    assert all((ROOT / path).is_file() for path in gpu_e2e.GPU_TESTS)
    assert parse_shapes(bench_ipc_floor.DEFAULT_SHAPES) == [(1, 128), (32, 128), (1, 2048), (256, 2048)]


def rate(tok_s, tpot_ms):
    return {"tok_s": tok_s, "tpot_ms": tpot_ms}


VARIANTS = {
    "plain_eager": {"1": rate(100.0, 10.0)}, "plain_graphs": {"1": rate(300.0, 3.0)},
    "afd_eager": {"1": rate(50.0, 20.0)}, "afd_ipc_eager": {"1": rate(80.0, 12.5)},
    "afd_ipc_graphs": {"1": rate(150.0, 6.0)},
}


def test_serving_cost_per_layer_is_measured_against_the_plain_server_of_the_same_graph_mode():
    per_layer = ipc_report.per_layer_by_variant(VARIANTS, [1], num_layers=3)

    assert per_layer["afd_eager"]["1"] == pytest.approx((20.0 - 10.0) / 3)
    assert per_layer["afd_ipc_eager"]["1"] == pytest.approx((12.5 - 10.0) / 3)
    assert per_layer["afd_ipc_graphs"]["1"] == pytest.approx((6.0 - 3.0) / 3)
    assert ipc_report.per_layer_by_variant({"plain_eager": {}}, [1], 3) == {}


def test_the_ipc_block_shows_the_asked_ratios_and_serving_over_the_floor():
    bench = {"status": "ok", "models": {"qwen3_moe": {
        "batches": [1], "variants": VARIANTS, "hidden_size": 128, "num_crossing_layers": 3,
        "serving_per_layer_ms_by_variant": ipc_report.per_layer_by_variant(VARIANTS, [1], 3)}}}
    floor = {"status": "ok", "layers": 8, "rows": [{
        "rows": 1, "hidden": 128, "raw_graph_ms": {"p50": 0.5}, "raw_eager_ms": {"p50": 0.625},
        "connector_eager_ms": {"p50": 0.75}, "device_flags_graph_ms": {"p50": 0.45},
        "connector_eager_over_floor_p50": 1.5}]}
    summary = {"phases": {"bench": bench, "ipcfloor": floor}}

    text = ipc_report.render_markdown(summary)

    # IPC graphs / plain graphs, / plain eager; IPC eager / gloo eager, / plain eager
    assert "| qwen3_moe | 1 | 150 | 80 | 0.5 | 1.5 | 1.6 | 0.8 |" in text
    assert "| 1x128 | 0.5 | 0.625 | 0.75 | 0.45 | 1.5 |" in text
    assert "| qwen3_moe | afd_ipc_graphs | 1 | 1 | 0.5 | 2 |" in text  # (6 - 3) / 3 ms over the 0.5 ms floor
    assert "| qwen3_moe | afd_ipc_eager | 1 | 0.833 | 0.625 | 1.33 |" in text
    assert "- **qwen3_moe** (tok/s): IPC graphs / plain graphs at B=1: 0.5; IPC eager / gloo eager at B=1: 1.6" in text
    assert text.index("### AFD over CUDA IPC: verdict") < text.index("### IPC round trip per layer")


def test_the_verdict_is_the_median_of_the_paired_repetitions_where_the_bench_paired_them():
    """Two identical H100 runs read 0.979 and 0.871 as median ÷ median, 1.05 and 0.954 as paired medians."""
    paired = {"afd_ipc_graphs/plain_graphs": {"1": {"median": 0.914, "min": 0.72, "max": 1.16}}}
    bench = {"models": {"qwen3_moe": {"batches": [1], "variants": VARIANTS, "paired": paired}}}

    assert ipc_report.verdict_lines(bench) == [
        "- **qwen3_moe** (tok/s): IPC graphs / plain graphs at B=1: 0.914 (per repetition 0.72–1.16); "
        "IPC eager / gloo eager at B=1: 1.6"]


def test_the_throughput_table_reads_the_paired_ratios_where_the_bench_paired_them():
    paired = {"afd_ipc_graphs/plain_graphs": {"1": {"median": 0.914, "min": 0.72, "max": 1.16}}}
    bench = {"models": {"qwen3_moe": {"batches": [1], "variants": VARIANTS, "paired": paired}}}

    # IPC graphs / plain graphs paired (0.914, not 150 / 300 = 0.5); the others as median ÷ median
    assert "| qwen3_moe | 1 | 150 | 80 | 0.914 | 1.5 | 1.6 | 0.8 |" in "\n".join(ipc_report.throughput_lines(bench))


def test_a_paired_ratio_without_a_paired_repetition_reads_none_not_the_median_rates():
    import e2e_report

    paired = {"afd_ipc_graphs/plain_graphs": {"1": {"median": None, "num_paired": 0, "num_missing": 3}}}
    bench = {"batches": [1], "variants": VARIANTS, "paired": paired}

    assert e2e_report.paired_ratio(bench, "afd_ipc_graphs", "plain_graphs", 1) is None
    # a ratio the bench does not pair still reads median ÷ median
    assert e2e_report.paired_ratio(bench, "afd_ipc_eager", "afd_eager", 1) == 1.6


def test_a_round_without_ipc_renders_no_ipc_block():
    assert ipc_report.markdown_lines({"phases": {"bench": {"models": {"m": {"batches": [1], "variants": {
        "plain_eager": {"1": rate(1.0, 1.0)}}}}}}}) == []


def test_the_bench_record_adds_each_afd_variants_cost_per_layer_and_keeps_the_gloo_key():
    import round_records

    bench = round_records.bench_record({"bench": {"batches": [1], "variants": VARIANTS}},
                                       {"config": {"num_hidden_layers": 3, "hidden_size": 128}})

    assert (bench["num_crossing_layers"], bench["hidden_size"]) == (3, 128)
    assert bench["serving_per_layer_ms"] == bench["serving_per_layer_ms_by_variant"]["afd_eager"]
    assert sorted(bench["serving_per_layer_ms_by_variant"]) == ["afd_eager", "afd_ipc_eager", "afd_ipc_graphs"]
    assert round_records.tokens_record({"variants": ["plain_eager", "afd_ipc_graphs"], "variants_up": ["plain_eager"],
                                        "outputs": {}})["variants_not_up"] == ["afd_ipc_graphs"]


def test_the_stage_table_divides_each_split_variant_by_its_one_stage_twin_and_plain_of_its_mode():
    import e2e_report

    bench = {"models": {"m": {"batches": [8], "variants": {
        "plain_eager": {"8": rate(100.0, 1)}, "plain_graphs": {"8": rate(400.0, 1)},
        "afd_ipc_graphs": {"8": rate(200.0, 1)}, "afd_ipc_graphs_s2": {"8": rate(300.0, 1)}}}}}

    lines = e2e_report._stage_lines(bench)

    # No timeline in this bench: the prediction and busy columns read "—" (tests/tools/test_stage_prediction.py).
    assert lines[3].splitlines()[-1] == "| m | — | 8 | afd_ipc_graphs_s2 | 300 | 200 | 1.5 | — | — | 400 | 0.75 |"
    assert e2e_report._stage_lines({"models": {"m": {"batches": [8], "variants": {"plain_eager": {}}}}}) == []
