"""Write tests/fixtures/parser_golden.json: replies parsed by vLLM's own parsers.

Run with the vLLM venv's Python (``bash scripts/vllm_venv.sh /tmp/venvs/vllm311`` builds it):

    /tmp/venvs/vllm311/bin/python tests/make_parser_golden.py

Each text goes through the parser vLLM's chat server composes (``ParserManager.get_parser``,
then ``Parser.parse``, the non-streaming path) for Qwen3 (``--reasoning-parser qwen3
--tool-call-parser hermes``) and MiniMax-M2 (``minimax_m2`` for both), with auto tool choice
and the tools declared. The tokenizer is Qwen3's vocabulary, saved by the project's venv
(vLLM's parsers look up their markers' token ids; MiniMax-M2's two call markers are added to
it); the parses themselves are on text. tests/test_reply_parsers.py compares
akv_jax.formats' parses with these, Qwen3's with ``reasoning_open=True`` (vLLM's default
``enable_thinking``), both with the tools declared here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "parser_golden.json"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
    },
}
SEARCH = {"type": "object", "properties": {"q": {"type": "string"}}}
TOOLS = {"get_weather": WEATHER, "search": SEARCH}


def hermes(name: str, args: dict) -> str:
    call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def invoke(name: str, params: dict[str, str]) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


# Known, deliberate differences (field -> why), recorded with the case so the test checks
# that the other fields agree and that these still differ.
AFTER_CALLS = {"content": "vLLM keeps only the text before the first call; akv_jax keeps all"}
CALL_IN_REASONING = dict.fromkeys(
    ("reasoning", "content", "tool_calls"),
    "vLLM 0.32's Qwen3 engine ends reasoning at any <tool_call>; akv_jax keeps a hermes call "
    "written inside <think> as reasoning (vLLM's file-based Qwen3ReasoningParser ends it only "
    "before <function=, which hermes calls never have)",
)
UNDECLARED_ONLY = {
    "content": "vLLM drops a block whose invokes all name undeclared tools; akv_jax returns "
    "it as content (markup it cannot parse is never lost)"
}

# (text, deviations)
QWEN3_TEXTS = [
    ("<think>\nThe user says hi.\n</think>\n\nHello there!", {}),
    ("<think>\nNeed weather.\n</think>\n\n" + hermes("get_weather", {"city": "Paris"}), {}),
    ("<think>\nTwo.\n</think>\n\nLet me check.\n"
     + hermes("get_weather", {"city": "Zürich", "days": 3})
     + "\n" + hermes("search", {"q": "日本"}), {}),
    ("<think>\n\n</think>\n\n" + hermes("search", {"q": "x"}), {}),
    ("<think>\nStill thinking when cut", {}),
    ("<think>\nr\n</think>\n\nBad: <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n"
     "</tool_call>", {}),
    ("<think>\nr\n</think>\n\n<tool_call>\n"
     + json.dumps({"name": "search", "arguments": {"q": "a"}}), {}),
    ("No think tags: the prompt opened the block.\n</think>\n\nAnswer.", {}),
    ("Never closed, no tags at all", {}),
    ("<think>\nr\n</think>\n\n" + hermes("not_declared", {"a": [1, {"b": None}]}), {}),
    ("<think>\nr\n</think>\n\nBefore.\n" + hermes("search", {"q": "a"}) + "\nAfter.",
     AFTER_CALLS),
    ("<think>\nplan " + hermes("search", {"q": "a"}) + "\n</think>\n\nDone.", CALL_IN_REASONING),
]

MINIMAX_TEXTS = [
    ("Simple question.\n</think>\n\nThe answer is 4.", {}),
    ("Need weather.\n</think>\n\n" + block(invoke("get_weather", {"city": "Paris", "days": "3"})),
     {}),
    ("Several.\n</think>\n\nChecking.\n" + block(
        invoke("get_weather", {"city": "São Paulo", "days": "2", "ratio": "0.5",
                               "metric": "true", "opts": '{"a": [1, 2]}'}),
        invoke("search", {"q": "multi word query"}),
    ), {}),
    ("r\n</think>\n\n" + block(invoke("get_weather", {"city": "Oslo"}))
     + "\n" + block(invoke("search", {"q": "second block"})), {}),
    ("Cut inside reasoning", {}),
    ("r\n</think>\n\n" + block(invoke("get_weather", {"city": "  spaced  ", "days": " 4 "})), {}),
    ("r\n</think>\n\n" + block(invoke("get_weather", {"days": "many", "metric": "yes",
                                                       "ratio": "1e400"})), {}),
    ("r\n</think>\n\n" + block(invoke("not_declared", {"a": "1"})), UNDECLARED_ONLY),
    ("r\n</think>\n\n" + block(invoke("search", {"q": "a"}), invoke("not_declared", {"a": "1"})),
     {}),
    ("r\n</think>\n\nBefore.\n" + block(invoke("search", {"q": "a"})) + "\nAfter.", AFTER_CALLS),
]


def save_qwen3_tokenizer(path: Path) -> None:
    """Qwen3's tokenizer.json, written by the project's venv (quicktok's vocabulary)."""
    code = (
        "import sys; from akv_jax.model.vocabularies import qwen3_tokenizer; "
        "qwen3_tokenizer().save(sys.argv[1])"
    )
    subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code, str(path)], check=True)


def main() -> None:
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    with tempfile.TemporaryDirectory() as d:
        tj = Path(d) / "tokenizer.json"
        save_qwen3_tokenizer(tj)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tj), eos_token="<|im_end|>")
    tok.add_tokens(["<minimax:tool_call>", "</minimax:tool_call>"], special_tokens=True)

    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()
    ]
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="auto"
    )
    cases = []
    for family, names, texts in (
        ("qwen3", ("hermes", "qwen3"), QWEN3_TEXTS),
        ("minimax_m2", ("minimax_m2", "minimax_m2"), MINIMAX_TEXTS),
    ):
        parser_cls = ParserManager.get_parser(
            tool_parser_name=names[0], reasoning_parser_name=names[1], enable_auto_tools=True,
            tokenizer=tok,
        )
        for text, deviations in texts:
            parser = parser_cls(tok, request.tools)
            reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True)
            cases.append({
                "family": family,
                "text": text,
                "reasoning": reasoning,
                "content": content,
                "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls or []],
                "deviations": deviations,
            })
    import vllm

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(
        {"vllm": vllm.__version__, "tools": TOOLS, "cases": cases}, indent=1, ensure_ascii=False
    ) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
