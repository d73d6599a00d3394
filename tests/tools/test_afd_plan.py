"""scripts/afd_plan.py and afd_planner's cost model on toy profiles whose answers can be worked by hand."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import afd_plan
from afd_planner.launch import Cluster
from afd_planner.cost import CostModel, fit_nonneg, touched_experts
from afd_planner.links import LINKS, parse_link
from afd_planner.profile import parse_profile
from afd_planner.search import plan


def toy(*, attention=((1, 0, 0.1), (2, 0, 0.1)), ffn=((1, 8, 0.1), (2, 8, 0.1)), transport=((0, 0.01), (2048, 0.01)),
        step=((1, 1.0),), layers=2, experts=8, top_k=2, extra=0.0) -> dict:
    """A profile: samples as (batch, context, ms), (tokens, experts, ms), (bytes, ms), (batch, ms); hidden 512 bf16."""
    return {"schema": "afd-profile", "version": 1, "device": "toy", "source": "test",
            "model": {"name": "toy", "hidden_size": 512, "num_layers": layers, "num_experts": experts,
                      "top_k": top_k, "dtype_bytes": 2},
            "attention": [{"batch": b, "context": c, "ms": ms} for b, c, ms in attention],
            "ffn": [{"tokens": n, "experts": e, "ms": ms} for n, e, ms in ffn],
            "transport": [{"bytes": n, "ms": ms} for n, ms in transport],
            "step": [{"batch": b, "ms": ms} for b, ms in step], "afd_step_extra_ms": extra}


def model_of(body: dict, link=None) -> CostModel:
    """As the CLI builds it: the link for the A<->F wire and the collectives, or the profile's wire and NVLink."""
    return CostModel.from_profile(parse_profile(body), link, link or LINKS["nvlink"])


# --- fits ---

def test_fit_recovers_exact_coefficients():
    rows = [[1.0, b, b * c] for b in (1, 8, 32) for c in (0, 1000)]
    y = [0.05 + 0.002 * r[1] + 1e-6 * r[2] for r in rows]
    assert fit_nonneg(rows, y) == pytest.approx([0.05, 0.002, 1e-6])


def test_fit_with_fewer_samples_than_terms_keeps_the_first_terms():
    assert fit_nonneg([[1.0, 4.0, 40.0]], [2.0]) == pytest.approx([2.0, 0.0, 0.0])  # one point: flat
    assert fit_nonneg([[1.0, 1.0, 0.0], [1.0, 3.0, 0.0]], [1.0, 2.0]) == pytest.approx([0.5, 0.5, 0.0])


def test_fit_never_returns_a_negative_coefficient():
    coef = fit_nonneg([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])  # falling: slope dropped
    assert coef == pytest.approx([2.0, 0.0])


def test_touched_experts_by_hand():
    assert touched_experts(1, 8, 8, 2) == pytest.approx(2.0)  # one token hits its top-2
    assert touched_experts(2, 8, 8, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert touched_experts(1, 4, 8, 2) == pytest.approx(1.0)  # half the experts on this rank: half the hits


def test_h200_shapes_split_the_ffn_into_weight_reads():
    """Qwen3-30B-A3B shapes (evidence/gpu-log.md): 0.047 ms at 1 token, 0.275 at 32 -> ~2.2 us per expert read."""
    body = toy(ffn=((1, 128, 0.047), (32, 128, 0.275)), experts=128, top_k=8)
    f_w, f0, f_t = model_of(body).ffn_coef
    assert f_w == pytest.approx(0.0022, abs=2e-4) and f0 == pytest.approx(0.029, abs=2e-3) and f_t == 0


# --- the step of each deployment, by hand ---

def test_steps_by_hand():
    """a = 0.1, f = 0.1 (flat), wire 0.01, 2 layers, host 1.0 ms (+ 0.5 for AFD)."""
    model = model_of(toy(extra=0.5))
    assert model.colocated_dp_ep_ms(1, 4, 0) == pytest.approx(2 * (0.1 + 0.1) + 1.0)
    assert model.colocated_tp_ms(1, 4, 0) == pytest.approx(2 * (0.1 + 0.1) + 1.0)
    assert model.afd_ms(1, 1, 1, 4, 0) == pytest.approx(2 * (0.1 + 0.01 + 0.1) + 1.0 + 0.5)
    # two stages of flat costs, as stage_model.simulate_layers schedules them: layer 0's FFN output of stage 0 is
    # back at 0.21, of stage 1 at 0.31; layer 1's attention runs 0.21-0.31 and 0.31-0.41, its FFN 0.315-0.415
    # and 0.415-0.515, back at 0.52
    assert model.afd_ms(1, 1, 2, 4, 0) == pytest.approx(0.52 + 1.0 + 0.5)


def test_an_ffn_pool_pays_its_collectives_on_the_link():
    model = model_of(toy(), LINKS["ib"])
    one = model.afd_layer_costs(2, 1, 4, 0)
    two = model.afd_layer_costs(2, 2, 4, 0)
    gather = LINKS["ib"].one_way_ms(4 * 512 * 2)  # (F - 1) = 1 step of one rank's 4 rows
    assert two[1] == pytest.approx(model.ffn(8, 4) + 2 * gather)
    assert one[2] == pytest.approx(LINKS["ib"].round_trip_ms(8 * 512 * 2))  # two attention ranks behind one FFN
    assert two[2] == pytest.approx(LINKS["ib"].round_trip_ms(4 * 512 * 2))


# --- what the planner prefers ---

def test_a_transport_bound_profile_stays_colocated():
    body = toy(transport=((0, 5.0), (2048, 5.0)))  # 5 ms per exchange against 0.2 ms of compute
    result = plan(model_of(body), gpus=2, context=0)
    assert result.baseline.kind == "colocated"
    assert not result.afd_wins(0.05)
    assert result.best_afd.tok_s_per_gpu < result.baseline.tok_s_per_gpu / 5


def test_an_ffn_bound_profile_prefers_more_ffn_ranks():
    """f is weight reads of the touched experts (1 ms each): halving the experts per rank halves f."""
    body = toy(attention=((1, 0, 0.01), (64, 0, 0.01)), ffn=((1, 8, 2.0), (2, 8, 3.5), (64, 8, 8.0)))
    result = plan(model_of(body, LINKS["nvlink"]), gpus=4, context=0, max_batch=64)
    assert (result.best_afd.attention_ranks, result.best_afd.ffn_ranks) == (2, 2)


def test_an_attention_bound_profile_prefers_more_attention_ranks():
    body = toy(attention=((1, 0, 0.5), (64, 0, 20.0)), ffn=((1, 8, 0.01), (64, 8, 0.02)))
    result = plan(model_of(body, LINKS["nvlink"]), gpus=4, context=0, max_batch=64)
    assert (result.best_afd.attention_ranks, result.best_afd.ffn_ranks) == (3, 1)


def test_stages_help_only_when_compute_covers_the_transport():
    """Per-token compute (no fixed part): two stages overlap attention and FFN; a dominant wire leaves nothing."""
    compute = toy(attention=((1, 0, 0.1), (16, 0, 1.6)), ffn=((1, 8, 0.0), (8, 8, 0.0), (16, 8, 0.0)),
                  transport=((0, 0.01), (2048, 0.01)))
    compute["ffn"] = [{"tokens": n, "experts": 8, "ms": 0.1 * n} for n in (1, 8, 16)]
    model = model_of(compute)
    assert model.afd_ms(1, 1, 2, 16, 0) < 0.8 * model.afd_ms(1, 1, 1, 16, 0)
    wire = model_of(toy(transport=((0, 5.0), (2048, 5.0))))
    assert wire.afd_ms(1, 1, 2, 16, 0) >= wire.afd_ms(1, 1, 1, 16, 0)


@given(tpot=st.floats(min_value=2.0, max_value=50.0))
def test_every_chosen_batch_meets_the_tpot_bound(tpot):
    result = plan(model_of(toy()), gpus=3, context=0, tpot_ms=tpot, max_batch=32)
    for candidate in (*result.colocated, *result.afd):
        assert not candidate.meets_tpot or candidate.step_ms <= tpot


def test_stage_counts_respect_min_tokens_per_stage():
    result = plan(model_of(toy()), gpus=2, context=0, max_batch=16, min_tokens_per_stage=4)
    for c in result.afd:
        assert c.batch >= c.num_stages * 4 or c.num_stages == 1


# --- memory ---

def test_memory_bounds_the_batch_and_drops_what_does_not_fit():
    """100 GiB devices, 1 GiB dense, 150 GiB of experts, 1 GiB of KV per request at context 1."""
    body = toy(**FLAT)
    body["memory"] = {"device_gib": 100, "dense_weights_gib": 1, "expert_weights_gib": 150,
                      "kv_bytes_per_token": 2**30, "utilization": 1.0}
    profile = parse_profile(body)
    result = plan(model_of(body), gpus=4, context=1, max_batch=512, memory=profile.memory)
    by_label = {c.label: c for c in (*result.colocated, *result.afd)}
    assert by_label["DP x EP 4"].max_batch == int(100 - 1 - 150 / 4)  # a quarter of the experts per rank
    assert by_label["TP 4"].max_batch == int((100 - 151 / 4) * 4)  # KV split over 4 (under 4 x 512)
    assert by_label["2A:2F"].max_batch == 99  # the attention holds no experts
    assert "3A:1F" not in by_label  # one FFN rank cannot hold 150 GiB of experts


def test_device_gib_replans_the_profiles_model_for_a_card_of_that_memory(tmp_path, capsys):
    """The same 150 GiB of experts on 4 cards of 200 GiB: one FFN rank holds them all, so 3A:1F fits."""
    body = toy(**FLAT)
    body["memory"] = {"device_gib": 100, "dense_weights_gib": 1, "expert_weights_gib": 150,
                      "kv_bytes_per_token": 2**30, "utilization": 1.0}
    profile = write(tmp_path, body)
    afd_plan.main(["plan", profile, "--gpus", "4", "--context", "1", "--max-batch", "512"])
    small = capsys.readouterr().out
    afd_plan.main(["plan", profile, "--gpus", "4", "--context", "1", "--max-batch", "512", "--device-gib", "200"])
    large = capsys.readouterr().out

    assert "what fits in 100 GiB per GPU" in small and "| AFD 3A:1F |" not in small
    assert "what fits in 200 GiB per GPU" in large and "| AFD 3A:1F |" in large
    with pytest.raises(SystemExit, match="--device-gib must be a positive number of GiB, got 0.0"):
        afd_plan.main(["plan", profile, "--gpus", "4", "--device-gib", "0"])
    with pytest.raises(SystemExit, match="this profile has none"):
        afd_plan.main(["plan", write(tmp_path, toy(**FLAT)), "--gpus", "4", "--device-gib", "141"])


# --- links ---

def test_links_parse_names_and_numbers():
    assert parse_link("ib").gb_per_s == 50.0
    custom = parse_link("25,8")
    assert custom.round_trip_ms(25e6) == pytest.approx(2 * (0.008 + 1.0))
    for bad in ("fast", "1,2,3", "0,1", "10,-1", "nan,1"):
        with pytest.raises(ValueError, match="--link"):
            parse_link(bad)


def test_hosts_put_the_collectives_and_exchanges_that_fit_one_host_on_its_link():
    """8 GPUs in hosts of 4 joined by ib: a ring within a host pays NVLink hops, one across hosts ib hops; an
    AFD deployment's exchange stays on NVLink only when all its GPUs fit one host."""
    ib, nvlink = LINKS["ib"], LINKS["nvlink"]
    model = CostModel.from_profile(parse_profile(toy()), ib, ib, gpus_per_host=4)
    rows = 4 * 512 * 2

    assert model.gather(4, 4) == pytest.approx(3 * nvlink.one_way_ms(rows))
    assert model.gather(8, 4) == pytest.approx(7 * ib.one_way_ms(rows))
    assert model.afd_layer_costs(3, 1, 4, 0)[2] == pytest.approx(nvlink.round_trip_ms(3 * rows))  # 4 GPUs, one host
    _, f, t = model.afd_layer_costs(6, 2, 4, 0)
    assert t == pytest.approx(ib.round_trip_ms(3 * rows))  # 8 GPUs: the exchange crosses hosts
    assert f == pytest.approx(model.ffn(24, 4) + 2 * nvlink.one_way_ms(3 * rows))  # the pool's ring inside a host
    flat = model_of(toy(), ib)  # no hosts: every wire is the link, as before
    assert flat.gather(4, 4) == pytest.approx(3 * ib.one_way_ms(rows))


def test_a_two_host_afd_split_gathers_its_ffn_pool_over_nvlink():
    """16 GPUs over ib: 8A:8F with the FFN pool in one host beats the same split with every ring on ib."""
    body = toy(**FLAT)
    flat = plan(model_of(body, LINKS["ib"]), gpus=16, context=0, max_batch=64)
    hosts = plan(CostModel.from_profile(parse_profile(body), LINKS["ib"], LINKS["ib"], gpus_per_host=8), gpus=16,
                 context=0, max_batch=64)

    def step(result, label):
        return next(c for c in result.afd if c.label == label and c.num_stages == 1).step_ms

    assert step(hosts, "8A:8F") < step(flat, "8A:8F")
    assert step(hosts, "9A:7F") < step(flat, "9A:7F")


def test_the_cli_plans_hosts_and_refuses_a_bad_host_count_or_link(tmp_path, capsys):
    profile = write(tmp_path, toy(**FLAT))
    afd_plan.main(["plan", profile, "--gpus", "16", "--link", "ib", "--gpus-per-host", "8"])
    assert ("collectives ib; hosts of 8 GPUs joined by it, nvlink inside a host, colocated EP allgather_reducescatter;"
            in capsys.readouterr().out)
    with pytest.raises(SystemExit, match="--gpus-per-host must be >= 1, got 0"):
        afd_plan.main(["plan", profile, "--gpus", "16", "--gpus-per-host", "0"])
    with pytest.raises(SystemExit):
        afd_plan.main(["plan", profile, "--gpus", "16", "--host-link", "fast"])
    assert "--host-link 'fast': expected one of" in capsys.readouterr().err


def test_an_all_to_all_sends_each_row_once_to_the_peers_holding_its_experts():
    """deepep_low_latency: one message's latency, the bytes of the busier of a rank's two links, by hand."""
    ib, nvlink = LINKS["ib"], LINKS["nvlink"]
    body = toy(**FLAT)  # top-2 of 8 experts, hidden 512 bf16: 1 KiB a row
    hosts = CostModel.from_profile(parse_profile(body), ib, ib, gpus_per_host=8, ep_all2all="deepep_low_latency")
    hit = 1 - (1 - 1 / 16) ** 2  # a peer of 16 holds one of a row's two experts
    inside, beyond = nvlink.one_way_ms(4 * 7 * hit * 1024), ib.one_way_ms(4 * 8 * hit * 1024)
    assert hosts.all_to_all(16, 4) == pytest.approx(max(inside, beyond)) == pytest.approx(beyond)
    assert hosts.all_to_all(4, 4) == pytest.approx(nvlink.one_way_ms(4 * 3 * (1 - 0.75 ** 2) * 1024))
    flat = CostModel.from_profile(parse_profile(body), ib, ib, ep_all2all="deepep_low_latency")
    assert flat.all_to_all(4, 4) == pytest.approx(ib.one_way_ms(4 * 3 * (1 - 0.75 ** 2) * 1024))
    assert flat.ep_exchange(1, 4) == 0.0 and flat.ep_exchange(4, 4) == pytest.approx(2 * flat.all_to_all(4, 4))
    ring = model_of(body, ib)
    assert ring.ep_exchange(4, 4) == pytest.approx(2 * ring.gather(4, 4))  # vLLM's default: the two rings


def test_all_to_all_kernels_lift_a_colocated_baseline_on_many_ranks_and_leave_the_afd_splits():
    """Over 32 GPUs in four hosts the rings pay 31 hops of ib latency a collective; the all-to-all one."""
    body = toy(**FLAT)

    def model(ep_all2all):
        return CostModel.from_profile(parse_profile(body), LINKS["ib"], LINKS["ib"], gpus_per_host=8,
                                      ep_all2all=ep_all2all)

    ring, a2a = model("allgather_reducescatter"), model("deepep_low_latency")
    assert a2a.colocated_dp_ep_ms(32, 16, 0) < ring.colocated_dp_ep_ms(32, 16, 0) / 2
    assert a2a.colocated_dp_ep_ms(1, 16, 0) == ring.colocated_dp_ep_ms(1, 16, 0)
    assert a2a.afd_ms(24, 8, 1, 16, 0) == ring.afd_ms(24, 8, 1, 16, 0)  # AFD's FFN pool runs the rings
    with pytest.raises(AssertionError):
        CostModel.from_profile(parse_profile(body), None, LINKS["nvlink"], ep_all2all="pplx")


def test_an_afd_recommendation_over_the_rings_says_to_plan_again_with_all_to_all_kernels(tmp_path, capsys):
    profile = write(tmp_path, toy(**FLAT))
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "eth"])
    assert "Run AFD 3A:1F" in (out := capsys.readouterr().out) and "--ep-all2all deepep_low_latency" in out
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "nvlink"])
    assert "Stay colocated" in (out := capsys.readouterr().out) and "plan again" not in out
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "eth", "--ep-all2all", "deepep_low_latency"])
    assert "plan again" not in capsys.readouterr().out


def test_the_cli_prints_the_colocated_all2all_backend_it_planned_for(tmp_path, capsys):
    profile = write(tmp_path, toy(**FLAT))
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "nvlink", "--ep-all2all", "deepep_low_latency"])
    out = capsys.readouterr().out
    assert "colocated EP deepep_low_latency;" in out
    assert "--data-parallel-size 4 --enable-expert-parallel --all2all-backend deepep_low_latency" in out
    assert "--all2all-backend" not in out.split("anyway")[-1]  # AFD's commands keep vLLM's default
    with pytest.raises(SystemExit):
        afd_plan.main(["plan", profile, "--gpus", "4", "--ep-all2all", "pplx"])


# --- the CLI: table and recommendation ---

def write(tmp_path, body) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(body))
    return str(path)


FLAT = dict(attention=((1, 0, 0.02), (64, 0, 0.02)), ffn=((1, 8, 0.02), (64, 8, 0.02)), step=((1, 0.01),), layers=4)


def test_slow_collectives_make_afd_win_and_nvlink_keeps_colocated():
    """Colocated DP x EP pays two collectives per layer between its ranks; AFD 3A:1F pays one exchange."""
    eth = plan(model_of(toy(**FLAT), LINKS["eth"]), gpus=4, context=0, max_batch=64)
    nvlink = plan(model_of(toy(**FLAT), LINKS["nvlink"]), gpus=4, context=0, max_batch=64)
    assert eth.afd_wins(0.05) and eth.best_afd.label == "3A:1F"
    assert not nvlink.afd_wins(0.05) and nvlink.baseline.kind == "colocated"


def test_plan_prints_the_baseline_first_then_the_recommendation(tmp_path, capsys):
    assert afd_plan.main(["plan", write(tmp_path, toy(**FLAT)), "--gpus", "4", "--link", "eth", "--max-batch",
                          "64", "--hosts", "10.0.0.5,10.0.0.6,10.0.0.7,10.0.0.8", "--port", "7000"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "deployment" not in line]
    assert rows[0].startswith("| colocated DP x EP 4 (baseline) | 1 | 64 (max) |")
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| AFD 3A:1F", "| AFD 2A:2F"]
    assert "Run AFD 3A:1F with 3 stage(s)" in out
    configs = [json.loads(line.split("'")[1])["afd"] for line in out.splitlines() if "--additional-config" in line]
    assert [c["role"] for c in configs] == ["ffn", "attention", "attention", "attention"]  # a GPU per host
    for config in configs:
        assert {k: v for k, v in config.items() if k != "role"} == {
            "num_attention_ranks": 3, "num_ffn_ranks": 1, "num_stages": 3, "connector": "P2pNcclAFDConnector",
            "host": "10.0.0.5", "port": 7000}
    assert ("--port 8000 --data-parallel-size 3 --data-parallel-size-local 1 --data-parallel-address 10.0.0.6 "
            "--data-parallel-rpc-port 13346 --compilation-config") in out


def test_a_split_that_fits_one_host_is_recommended_over_its_ipc_connector(tmp_path, capsys):
    """--link eth joins the hosts; 4 GPUs of a host of 8 exchange over NVLink: CUDA IPC, not NCCL."""
    profile = write(tmp_path, toy(**FLAT))
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "eth", "--max-batch", "64", "--gpus-per-host", "8"])
    one_host = capsys.readouterr().out
    afd_plan.main(["plan", profile, "--gpus", "4", "--link", "eth", "--max-batch", "64", "--gpus-per-host", "2"])
    two_hosts = capsys.readouterr().out

    assert '"connector": "P2pIpcAFDConnector"' in one_host and "P2pNccl" not in one_host
    assert '"connector": "P2pNcclAFDConnector"' in two_hosts


def test_plan_says_stay_colocated_with_the_colocated_command(tmp_path, capsys):
    afd_plan.main(["plan", write(tmp_path, toy(transport=((0, 5.0), (2048, 5.0)))), "--gpus", "2"])
    out = capsys.readouterr().out
    assert "Stay colocated" in out
    dp_ep = "--data-parallel-size 2 --enable-expert-parallel"
    flags = "--tensor-parallel-size 2" if "TP 2 (baseline)" in out else dp_ep
    assert f"vllm serve toy {flags}\n" in out


def test_an_ffn_pool_is_recommended_eager_with_expert_parallelism(tmp_path):
    result = plan(model_of(toy()), gpus=4, context=0, max_batch=8)
    pool = next(c for c in result.afd if c.ffn_ranks == 2)
    lines = afd_plan.afd_commands(pool, "M", Cluster.of(4, 2, "ib", "nvlink", ("h", "g")), 1)  # a host per role
    ffn, attention = (line for line in lines if not line.startswith("# "))
    assert ("--data-parallel-size 2 --enable-expert-parallel --all2all-backend allgather_reducescatter "
            "--enforce-eager") in ffn
    assert '"reform_timeout_s": 0' in ffn and "P2pNcclAFDConnector" in attention and "--enforce-eager" in attention


def test_a_bad_profile_exits_naming_the_field(tmp_path):
    body = toy()
    body["ffn"][1]["ms"] = -1
    with pytest.raises(SystemExit, match=r"ffn\[1\]\.ms must be a finite number of ms >= 0, got -1"):
        afd_plan.main(["plan", write(tmp_path, body), "--gpus", "2"])
    with pytest.raises(SystemExit, match="--gpus must be >= 1"):
        afd_plan.main(["plan", write(tmp_path, toy()), "--gpus", "0"])


def test_predict_prints_one_deployment(tmp_path, capsys):
    afd_plan.main(["predict", write(tmp_path, toy(extra=0.5)), "--attention-ranks", "1", "--ffn-ranks", "1",
                   "--batch", "4"])
    assert capsys.readouterr().out.startswith(f"step {2 * 0.21 + 1.5:.3f} ms")


def test_a_measured_host_share_replaces_the_profiles_step_samples(tmp_path, capsys):
    """The served engine's host share (bench_afd_cpu.py's 'host ms') instead of the isolated profile's 1.0 ms."""
    one = ["predict", write(tmp_path, toy(extra=0.5)), "--attention-ranks", "1", "--ffn-ranks", "1", "--batch", "4"]
    afd_plan.main([*one, "--host-ms", "9"])
    assert capsys.readouterr().out.startswith(f"step {2 * 0.21 + 9 + 0.5:.3f} ms")
    with pytest.raises(SystemExit, match="--host-ms must be >= 0, got -1.0"):
        afd_plan.main([*one, "--host-ms", "-1"])


def test_predict_on_one_shared_device_serializes_the_roles_and_counts_one_gpu(tmp_path, capsys):
    profile = write(tmp_path, toy(extra=0.5))
    one = ["predict", profile, "--attention-ranks", "1", "--ffn-ranks", "1", "--batch", "4"]
    afd_plan.main([*one, "--stages", "2"])
    two_devices = capsys.readouterr().out
    afd_plan.main([*one, "--stages", "2", "--shared-device"])
    shared = capsys.readouterr().out

    step = lambda out: float(out.split()[1])  # noqa: E731
    assert step(shared) > step(two_devices)
    assert shared.split("(")[1].split()[0] == shared.split("ms, ")[1].split()[0]  # tok/s per GPU == tok/s
    with pytest.raises(SystemExit, match="--shared-device models both roles of 1A1F"):
        afd_plan.main(["predict", profile, "--attention-ranks", "2", "--ffn-ranks", "1", "--batch", "4",
                       "--shared-device"])
