"""Traffic profiles and drift on the real traces; the `tkcc traffic` commands."""
import json

import pytest

from engine_server import drift as D
from engine_server import traffic
from tkcc_mcp.cli import main

AZURE = traffic.DATA_DIR / "traces" / "azure_llm_2023_code.csv"
MOONCAKE = traffic.DATA_DIR / "traces" / "mooncake_fast25_synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def azure():
    return D.profile_file(AZURE)


@pytest.fixture(scope="module")
def mooncake():
    return D.profile_file(MOONCAKE)


def test_profile_of_a_real_trace(azure):
    ref = traffic.profile(traffic.read_trace(AZURE))
    assert azure.requests == ref.requests == 8819 and azure.format == "azure_llm_2023"
    assert azure.prompt_len == ref.prompt_len and azure.output_len == ref.output_len
    assert azure.arrival_rate == pytest.approx(ref.arrival_rate)
    assert len(azure.prompt_log2) == D.SKETCH and azure.prompt_log2 == sorted(azure.prompt_log2)
    assert sum(azure.batch_mix.values()) == pytest.approx(1.0, abs=1e-3)
    assert not azure.concurrency_measured and azure.experts is None


def test_azure_code_and_mooncake_differ(azure, mooncake):
    d = D.drift(azure, mooncake)
    assert d.drifted and d.prompt.drifted and d.output.drifted
    assert d.prompt.ks > 0.4 and d.prompt.w1_log2 > 2.0 and d.prompt.p90_shift > 5.0
    assert any("prompt lengths" in r for r in d.reasons)


def test_a_trace_does_not_drift_from_itself_nor_from_a_sample_of_itself(azure):
    same = D.drift(azure, azure)
    assert not same.drifted and same.prompt.ks == 0 and same.prompt.w1_log2 == 0 and same.reasons == []
    reqs = traffic.read_trace(AZURE).requests[::200]  # 45 requests spread over the hour
    sample = D.profile_requests([{"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
                                 for r in reqs], "every 200th", "azure_llm_2023")
    d = D.drift(azure, sample)
    assert not d.drifted, d.summary()
    assert d.prompt.ks_limit > D.DriftConfig().ks_max  # a small window's own noise raises the bar


def test_small_windows_are_never_called_drifted(azure):
    tiny = D.profile_file(MOONCAKE, limit=10)
    d = D.drift(azure, tiny)
    assert not d.drifted and d.reasons[0].startswith("window too small")


def test_distances():
    a = [float(x) for x in range(100)]
    assert D.ks(a, a) == 0.0 and D.ks(a, [x + 1000 for x in a]) == 1.0
    assert D.w1(a, [x + 1.0 for x in a]) == pytest.approx(1.0)
    assert D.js([1, 1, 0, 0], [1, 1, 0, 0]) == 0.0
    assert D.js([1, 0], [0, 1]) == pytest.approx(1.0)
    # every length doubled (+1): log2(1 + 2x + 1) = 1 + log2(1 + x), so W1 is exactly one doubling
    def rows(f):
        return [{"arrival_s": i, "prompt_len": f(x), "output_len": 5} for i, x in enumerate(range(1, 200))]
    p, q = D.profile_requests(rows(lambda x: x), "a", "t"), D.profile_requests(rows(lambda x: 2 * x + 1), "b", "t")
    assert D.drift(p, q).prompt.w1_log2 == pytest.approx(1.0, abs=1e-3)


def test_serving_log_profile_uses_finish_times_and_experts(tmp_path):
    def log(path, skew):
        with open(path, "w") as f:
            for i in range(64):
                hist = [10, 10, 10, 10] if not skew else [37, 1, 1, 1]
                f.write(json.dumps({"arrival_s": i * 0.1, "prompt_len": 50 + i, "output_len": 8,
                                    "finish_s": i * 0.1 + 0.35, "experts": hist}) + "\n")
        return path
    a, b = D.profile_file(log(tmp_path / "a.jsonl", False)), D.profile_file(log(tmp_path / "b.jsonl", True))
    assert a.format == "serving_log" and a.concurrency_measured
    assert a.concurrency == pytest.approx(4.0, abs=0.1)  # 0.35 s in flight, one arrival per 0.1 s
    assert a.experts == [0.25] * 4
    d = D.drift(a, b)
    assert d.drifted and d.experts_js > 0.2 and not d.prompt.drifted
    assert any("expert routing" in r for r in d.reasons)


def test_cli_traffic_profile_and_diff(capsys):
    assert main(["traffic", "profile", str(MOONCAKE), "--limit", "500"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "prompt tokens" in out[1] and json.loads(out[-1])["requests"] == 500
    assert main(["traffic", "diff", str(AZURE), str(MOONCAKE)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("verdict: DRIFTED")
    d = json.loads(out[-1])
    assert d["drifted"] and d["prompt"]["drifted"] and d["thresholds"]["ks_max"] == 0.2
    assert main(["traffic", "diff", str(AZURE), str(AZURE), "--ks-max", "0.1"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not d["drifted"] and d["thresholds"]["ks_max"] == 0.1
