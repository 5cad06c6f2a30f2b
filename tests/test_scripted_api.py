"""Tests for tkcc_mcp.scripted_api: anthropic SDK round trips and the real
Claude Code CLI (bundled with claude-agent-sdk) driven through a tiny MCP server."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import anthropic
import anyio
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tkcc_mcp.scripted_api import (  # noqa: E402
    APIError, Conversation, ScriptedAPI, ToolCall, error, fail_first, is_main_request,
    resolve_tool, text, tool, tool_sequence, tools,
)

MCP_TOOLS = [
    {"name": "mcp__tkcc__read_engine_source", "description": "read",
     "input_schema": {"type": "object", "properties": {}}},
    {"name": "mcp__tkcc__submit_forward_pass", "description": "submit",
     "input_schema": {"type": "object", "properties": {"source": {"type": "string"}},
                      "required": ["source"]}},
]
USER = [{"role": "user", "content": "optimise the engine"}]


def client(api: ScriptedAPI) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.url, api_key="dummy", max_retries=0)


# --------------------------------------------------------------------------- anthropic SDK
def test_sdk_text_non_streaming_and_streaming():
    with ScriptedAPI(lambda body: "hello " * 20) as api:
        c = client(api)
        msg = c.messages.create(model="claude-x", max_tokens=50, messages=USER)
        assert msg.content[0].text == "hello " * 20
        assert msg.stop_reason == "end_turn" and msg.model == "claude-x"
        assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
        with c.messages.stream(model="claude-x", max_tokens=50, messages=USER) as s:
            streamed = "".join(s.text_stream)
            final = s.get_final_message()
        assert streamed == "hello " * 20 == final.content[0].text
        assert final.usage.output_tokens == msg.usage.output_tokens
        assert len(api.requests) == 2 and api.requests[1]["stream"] is True
        assert api.usage["requests"] == 2


def test_sdk_tool_use_round_trip_both_modes():
    seen = []

    def submit(conv: Conversation):
        seen.append(conv.result("read_engine_source").json())
        return tool("submit_forward_pass", source=conv.last.json()["source"] + "# v2")

    policy = tool_sequence(["read_engine_source", submit], final=lambda c: "id=" + c.last.json()["id"])
    with ScriptedAPI(policy) as api:
        c = client(api)
        for stream in (False, True):
            msgs = list(USER)
            results = iter([{"source": "def f(): pass\n"}, {"id": "cand-7"}])
            while True:
                kw = dict(model="m", max_tokens=100, messages=msgs, tools=MCP_TOOLS)
                if stream:
                    with c.messages.stream(**kw) as s:
                        msg = s.get_final_message()
                else:
                    msg = c.messages.create(**kw)
                if msg.stop_reason != "tool_use":
                    break
                (use,) = [b for b in msg.content if b.type == "tool_use"]
                assert use.name.startswith("mcp__tkcc__")
                msgs += [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": json.dumps(next(results))}]}]
            assert msg.content[0].text == "id=cand-7"
            assert msgs[3]["content"][0]["name"] == "mcp__tkcc__submit_forward_pass"
            assert msgs[3]["content"][0]["input"] == {"source": "def f(): pass\n# v2"}
        assert seen == [{"source": "def f(): pass\n"}] * 2
        assert all(r.main for r in api.log)


@pytest.mark.parametrize("status,etype,exc", [
    (400, "invalid_request_error", anthropic.BadRequestError),
    (401, "authentication_error", anthropic.AuthenticationError),
    (429, "rate_limit_error", anthropic.RateLimitError),
    (500, "api_error", anthropic.InternalServerError),
    (529, "overloaded_error", anthropic.InternalServerError),
])
def test_sdk_error_reply(status, etype, exc):
    with ScriptedAPI(lambda body: error(status, etype, "scripted boom")) as api:
        # default client retries; x-should-retry: false must stop it
        c = anthropic.Anthropic(base_url=api.url, api_key="dummy")
        for stream in (False, True):
            with pytest.raises(exc) as ei:
                if stream:
                    with c.messages.stream(model="m", max_tokens=5, messages=USER) as s:
                        s.get_final_message()
                else:
                    c.messages.create(model="m", max_tokens=5, messages=USER)
            assert ei.value.status_code == status
            assert ei.value.body["error"] == {"type": etype, "message": "scripted boom"}
        assert len(api.requests) == 2


def test_side_requests_count_tokens_and_unknown_routes():
    policy = fail_first(tool_sequence(["read_engine_source"], final="done", side_text="Title"), 1)
    with ScriptedAPI(policy) as api:
        c = client(api)
        side = c.messages.create(model="m", max_tokens=1, messages=USER)  # no tools: side request
        assert side.content[0].text == "Title"
        with pytest.raises(anthropic.InternalServerError):  # fail_first: 529 overloaded once
            c.messages.create(model="m", max_tokens=9, messages=USER, tools=MCP_TOOLS)
        msg = c.messages.create(model="m", max_tokens=9, messages=USER, tools=MCP_TOOLS)
        assert msg.content[0].name == "mcp__tkcc__read_engine_source"
        # Claude Code's session-title side request asks for JSON via output_config.format
        title_req = {"model": "m", "max_tokens": 99, "messages": USER, "tools": [], "output_config": {
            "format": {"type": "json_schema", "schema": {
                "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}}}
        r = httpx.post(api.url + "/v1/messages", json=title_req)
        assert json.loads(r.json()["content"][0]["text"]) == {"title": "Title"}
        n = c.messages.count_tokens(model="m", messages=USER)
        assert n.input_tokens > 0
        assert httpx.head(api.url + "/api/hello").status_code == 200
        r = httpx.post(api.url + "/v1/nope", json={"a": 1})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert [u.path for u in api.unknown] == ["/v1/nope"]
        assert [r.main for r in api.log if r.path == "/v1/messages"] == [False, True, True, False]
        assert len(api.main_requests) == 2


def test_helpers():
    body = {"tools": [{"name": "Read"}, {"name": "mcp__tkcc__measure_fast"}]}
    assert resolve_tool("measure_fast", body) == "mcp__tkcc__measure_fast"
    assert resolve_tool("Read", body) == "Read" and resolve_tool("nope", body) == "nope"
    assert is_main_request(body, ["measure_fast"]) and not is_main_request(body, ["check_bit_exact"])
    deferred = {"tools": [{"name": "ToolSearch"}],
                "system": [{"type": "text", "text": "deferred:\nmcp__tkcc__check_bit_exact\nX"}]}
    assert resolve_tool("check_bit_exact", deferred) == "mcp__tkcc__check_bit_exact"
    # deferred tool: the sequence loads it through ToolSearch first, without using a step
    seq = tool_sequence([("check_bit_exact", {"candidate_id": "c1"})])
    first = seq(deferred)
    assert first.tool_calls[0].name == "ToolSearch"
    assert first.tool_calls[0].input["query"] == "select:mcp__tkcc__check_bit_exact"
    assert tools(("a", {"x": 1}), ToolCall("b"), text="t").tool_calls[1].name == "b"
    assert text("x").text == "x" and isinstance(error(), APIError)


# --------------------------------------------------------------------------- real Claude Code
MCP_SERVER = textwrap.dedent('''
    import json, os
    from pydantic import BaseModel
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("tkcc")
    LOG = os.environ["TKCC_TEST_LOG"]

    class Source(BaseModel):
        path: str
        source: str

    class Submission(BaseModel):
        candidate_id: str
        accepted: bool

    def log(**kw):
        with open(LOG, "a") as f:
            f.write(json.dumps(kw) + "\\n")

    @server.tool()
    def read_engine_source() -> Source:
        """Return the engine forward-pass source."""
        log(tool="read_engine_source")
        return Source(path="engine/forward.py", source="def forward(x):\\n    return x\\n")

    @server.tool()
    def submit_forward_pass(source: str) -> Submission:
        """Submit a candidate forward pass."""
        log(tool="submit_forward_pass", source=source)
        return Submission(candidate_id="cand-0042", accepted=True)

    if __name__ == "__main__":
        server.run()
''')


def claude_options(api: ScriptedAPI, tmp_path: Path, **kw):
    from claude_agent_sdk import ClaudeAgentOptions

    script = tmp_path / "tiny_mcp.py"
    script.write_text(MCP_SERVER)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    stderr: list[str] = []
    opts = ClaudeAgentOptions(
        mcp_servers={"tkcc": {"type": "stdio", "command": sys.executable, "args": [str(script)],
                              "env": {"TKCC_TEST_LOG": str(tmp_path / "mcp_calls.jsonl")}}},
        strict_mcp_config=True,           # ignore any user/project MCP config
        setting_sources=[],               # no user/project settings, CLAUDE.md
        tools=[],                         # no built-in tools (MCP tools stay): small requests
        allowed_tools=["mcp__tkcc"],      # bypassPermissions is refused when running as root
        cwd=str(work),
        max_turns=8,
        env=api.claude_env(CLAUDE_CONFIG_DIR=str(tmp_path / "claude-config")),
        stderr=stderr.append,
        **kw,
    )
    return opts, stderr


async def run_claude(prompt: str, opts) -> list:
    from claude_agent_sdk import query

    out = []
    with anyio.fail_after(120):
        async for m in query(prompt=prompt, options=opts):
            out.append(m)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tool_search", [False, True], ids=["tools-listed", "tools-deferred"])
def test_claude_code_calls_mcp_tools_in_order(tmp_path, tool_search):
    """tools-listed: ENABLE_TOOL_SEARCH=false, no built-ins. tools-deferred: Claude
    Code's defaults (MCP tools behind ToolSearch; the script loads them first)."""
    from claude_agent_sdk import AssistantMessage, ResultMessage, TextBlock, ToolUseBlock

    def submit(conv: Conversation):
        src = conv.result("read_engine_source").json()
        return tool("submit_forward_pass", source=src["source"] + "# fused\n")

    policy = tool_sequence(
        ["read_engine_source", submit],
        final=lambda c: f"Submitted {c.result('submit_forward_pass').json()['candidate_id']}.",
    )
    t0 = time.monotonic()
    with ScriptedAPI(policy) as api:
        opts, stderr = claude_options(api, tmp_path)
        if tool_search:
            opts.tools, opts.env["ENABLE_TOOL_SEARCH"] = None, "true"
        msgs = anyio.run(run_claude, "Optimise the forward pass.", opts)
    elapsed = time.monotonic() - t0

    # the MCP server really ran both tools, in order, with the scripted input
    calls = [json.loads(line) for line in (tmp_path / "mcp_calls.jsonl").read_text().splitlines()]
    assert calls == [{"tool": "read_engine_source"},
                     {"tool": "submit_forward_pass", "source": "def forward(x):\n    return x\n# fused\n"}]

    main = api.main_requests
    assert len(main) == (5 if tool_search else 3), [r.path for r in api.log]
    assert all(r.main for r in api.log if r.path == "/v1/messages")
    # each tool's output reached the API as a tool_result in the next request
    convs = [Conversation(b) for b in main]
    after_read = next(c for c in convs if c.results)
    assert after_read.last.name == "mcp__tkcc__read_engine_source"
    assert after_read.last.json() == {"path": "engine/forward.py", "source": "def forward(x):\n    return x\n"}
    last = convs[-1]
    assert [c.short for c in last.results] == ["read_engine_source", "submit_forward_pass"]
    assert last.last.json() == {"candidate_id": "cand-0042", "accepted": True} and not last.last.is_error
    assert "Optimise the forward pass." in last.prompt
    assert api.errors == [] and api.unknown == []

    # and the final answer came back through the SDK
    uses = [b.name for m in msgs if isinstance(m, AssistantMessage) for b in m.content
            if isinstance(b, ToolUseBlock) and b.name != "ToolSearch"]
    assert uses == ["mcp__tkcc__read_engine_source", "mcp__tkcc__submit_forward_pass"]
    texts = [b.text for m in msgs if isinstance(m, AssistantMessage) for b in m.content
             if isinstance(b, TextBlock)]
    assert texts == ["Submitted cand-0042."]
    result = msgs[-1]
    assert isinstance(result, ResultMessage) and not result.is_error, stderr
    assert result.result == "Submitted cand-0042." and result.num_turns == len(main)
    assert result.usage["input_tokens"] == sum(r.usage["input_tokens"] for r in api.log if r.usage)
    assert elapsed < 60


@pytest.mark.timeout(180)
def test_claude_code_surfaces_api_error(tmp_path):
    policy = tool_sequence(["read_engine_source", error(400, "invalid_request_error", "scripted refusal")])
    with ScriptedAPI(policy) as api:
        opts, _ = claude_options(api, tmp_path)
        with pytest.raises(Exception, match="scripted refusal"):
            anyio.run(run_claude, "go", opts)
    # a 400 is re-sent without some betas (Claude Code's feature fallback), never with backoff
    statuses = [r.status for r in api.log]
    assert statuses[0] == 200 and 1 <= statuses.count(400) <= 4 and set(statuses) == {200, 400}


@pytest.mark.timeout(180)
def test_claude_code_retries_transient_overload(tmp_path):
    from claude_agent_sdk import ResultMessage

    policy = fail_first(tool_sequence(["read_engine_source"], final="recovered"), 2)  # two 529s
    with ScriptedAPI(policy) as api:
        opts, _ = claude_options(api, tmp_path)
        msgs = anyio.run(run_claude, "go", opts)
    assert isinstance(msgs[-1], ResultMessage) and msgs[-1].result == "recovered"
    assert [r.status for r in api.log] == [529, 529, 200, 200]


@pytest.mark.timeout(180)
def test_claude_sdk_client_multi_turn_with_side_requests(tmp_path):
    """With non-essential traffic allowed Claude Code also probes HEAD /api/hello
    and asks for a session title (no tools, JSON output format): side requests."""
    from claude_agent_sdk import ClaudeSDKClient, ResultMessage

    policy = tool_sequence(["read_engine_source"], final=lambda c: "answer to: " + c.prompt.splitlines()[-1],
                           side_text="Scripted session")
    with ScriptedAPI(policy) as api:
        opts, _ = claude_options(api, tmp_path)
        del opts.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]

        async def chat() -> list[str]:
            results = []
            with anyio.fail_after(120):
                async with ClaudeSDKClient(opts) as client:
                    for prompt in ("first question", "second question"):
                        await client.query(prompt)
                        async for m in client.receive_response():
                            if isinstance(m, ResultMessage):
                                results.append(m.result)
            return results

        results = anyio.run(chat)
    assert results == ["answer to: first question", "answer to: second question"]
    main = api.main_requests
    assert len(main) == 3 and Conversation(main[2]).turns == 2
    side = [r.body for r in api.log if r.path == "/v1/messages" and not r.main]
    assert side and all(not b.get("tools") for b in side)
    assert "/api/hello" in [r.path for r in api.log]
    assert api.errors == [] and api.unknown == []
