"""The `tkcc` command line: a user's mistake is one line on stderr and a nonzero status, and
nothing is left behind."""
import json

import pytest
import torch

from tkcc_mcp import cli


def run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    return code, err


def test_mistakes_are_one_line_and_leave_nothing_behind(tmp_path, capsys, monkeypatch):
    for k in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "TKCC_DEBUG"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "list.json").write_text("[1, 2]")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((cli.Path(__file__).parent.parent / "engine_server/presets/gpt2.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    cases = {
        ("engine", "selfcheck", "--model", str(tmp_path / "nope" / "config.json")): "no such file or directory",
        ("engine", "selfcheck", "--model", str(tmp_path / "list.json")): "a model config is a JSON object",
        ("engine", "selfcheck", "--model", str(corrupt), "--device", "cpu"): "not a readable safetensors file",
        ("engine", "selfcheck", "--model", "llama-3.2-1b", "--max-batch", "0"): "max_batch 0",
        ("ledger", "list", "--db", str(tmp_path / "x" / "ledger.db")): "no ledger at",
        ("campaign", "--budget", "0s", "--out", str(tmp_path / "c")): "--budget must be above 0 s",
        ("campaign", "--agents", "0", "--out", str(tmp_path / "c")): "--agents at least 1",
        ("campaign", "--profile", "nosuch", "--out", str(tmp_path / "c")): "no profile 'nosuch'",
        ("campaign", "--agent", "anthropic", "--out", str(tmp_path / "c")): "no ANTHROPIC_API_KEY",
        ("campaign", "--model", "llama-9b", "--out", str(tmp_path / "c")): "unknown model 'llama-9b'",
        ("campaign", "--engines", str(tmp_path), "--model", "gpt2", "--out", str(tmp_path / "c")): "--model set",
        ("ablate", "--profiles", ",", "--out", str(tmp_path / "c")): "at least one profile",
        ("replay", str(tmp_path / "list.json"), "--url", "http://127.0.0.1:9", "--speed", "0"): "--speed",
    }
    if not torch.cuda.is_available():
        cases[("engine", "selfcheck", "--model", "llama-3.2-1b", "--device", "cuda")] = "CUDA is not available"
    for argv, words in cases.items():
        code, err = run(capsys, *argv)
        assert code == 1 and words in err, (argv, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt", "list.json"]  # no ledger, no campaign dirs


def test_ledger_options_apply_to_their_action(tmp_path, capsys):
    from engine_server.ledger import Ledger
    led = Ledger(tmp_path / "ledger.db")
    led.add_candidate("c0001", "x = 1\n", agent_id="a")
    led.add_candidate("c0002", "x = 2\n", agent_id="b")
    db = str(tmp_path / "ledger.db")
    assert run(capsys, "ledger", "list", "--db", db, "--format", "csv")[0] == 2
    assert run(capsys, "ledger", "export", "c0001", "--db", db)[0] == 2
    assert cli.main(["ledger", "export", "--db", db, "--table", "candidates", "--agent", "b"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == ["c0002"]


def test_engine_commands_shrink_a_preset_on_the_cpu_by_default():
    args = cli.parser().parse_args(["engine", "selfcheck", "--model", "llama-3.2-1b", "--device", "cpu"])
    assert cli.config_from(args, cli.EngineConfig).shrink is True
    args = cli.parser().parse_args(["engine", "selfcheck", "--model", "llama-3.2-1b", "--no-shrink"])
    assert cli.config_from(args, cli.EngineConfig).shrink is False


def test_debug_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("TKCC_DEBUG", "1")
    with pytest.raises(ValueError):
        cli.main(["engine", "selfcheck", "--model", str(tmp_path / "nope.json")])


def test_campaign_help_says_every_default():
    """`tkcc campaign --help` / `ablate --help`: each flag that has a default says what it is,
    as the parser holds it (a flag whose help went stale would name another value)."""
    import argparse
    import re
    p = cli.parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("campaign", "ablate"):
        for a in sub.choices[name]._actions:
            if a.default in (None, False, "", [], argparse.SUPPRESS) or a.help == argparse.SUPPRESS:
                continue
            said = re.search(r"default:? ([^\s,;)]+)", a.help or "")
            assert said and said.group(1) == str(a.default), (name, a.option_strings, a.help, a.default)
