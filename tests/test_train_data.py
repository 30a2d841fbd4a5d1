"""akv_jax.train.sources and .data: records -> trajectories (segments from the serving chat
path, per-role loss masks, errors naming file, line and field), the converters, and the grain
pipeline (seeded shuffle, disjoint shards, packing within max_tokens, exact resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from akv_jax.agent.messages import Message
from akv_jax.agent.policies import RollingDrop
from akv_jax.agent.trajectory import TrajectorySpec, make_trajectory
from akv_jax.cache.ops import OpHistory, parse_history
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.train import data
from akv_jax.train.sources import (
    DataError,
    JsonlSource,
    Tokenise,
    chat_records,
    main,
    read_jsonl,
    read_trajectories,
    replay_records,
    without_ops,
    write_jsonl,
)
from akv_jax.train.synthetic import agent_chats

VOCAB = 512
EOS = VOCAB - 1  # <|im_end|> of the tiny byte-level ChatML tokenizer


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.byte_level_chatml(VOCAB)


def tokenise(tok, roles=("assistant",)) -> Tokenise:
    return Tokenise(tok, VOCAB, (EOS,), roles)


def masked_text(tok, traj) -> list[str]:
    return [
        tok.decode([t for t, m in zip(s, k, strict=True) if m])
        for s, k in zip(traj.segments, traj.loss_mask, strict=True)
    ]


CHAT = {
    "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "find n"},
        {"role": "assistant", "content": "n"},  # 'n' also occurs in '<|im_end|>' and header
        {"role": "tool", "content": "im_end"},
        {"role": "assistant", "content": "done"},
    ],
    "cache": {"drop": {"3": [1]}, "reposition": [3]},
    "id": "ignored, as the server ignores unknown fields",
}


def test_text_record_segments_come_from_the_serving_chat_path(tok):
    traj = tokenise(tok).parse(CHAT)
    assert [list(s) for s in traj.segments] == tok.encode_messages(CHAT["messages"][:5])
    assert traj.history == OpHistory(5, {3: (1,)}, (3,))
    # assistant targets: what serving generates after '<|im_start|>assistant\n', through the
    # stop token, never the header or the trailing newline
    assert masked_text(tok, traj) == ["", "", "n<|im_end|>", "", "done<|im_end|>"]
    assert traj.loss_mask[2].tolist() == [False] * 11 + [True, True, False]


def test_loss_roles_are_configurable(tok):
    traj = tokenise(tok, ("assistant", "tool", "system")).parse(CHAT)
    # a content span is found outside special tokens ('im_end' is also inside <|im_end|>);
    # the first token of the trajectory has nothing to be predicted from
    assert masked_text(tok, traj) == [
        "sys<|im_end|>",
        "",
        "n<|im_end|>",
        "im_end<|im_end|>",
        "done<|im_end|>",
    ]
    assert traj.loss_mask[0].sum() == 4 and not traj.loss_mask[0][0]
    with pytest.raises(ValueError, match="loss roles must be among"):
        tokenise(tok, ("bot",))


def test_token_id_records(tok):
    rec = {
        "messages": [
            {"role": "system", "token_ids": [1, 2]},
            {"role": "assistant", "token_ids": [3, 4, 5]},
            {"role": "tool", "token_ids": [6]},
            {"role": "assistant", "token_ids": [7]},
        ],
        "cache": {"drop": {"2": [2]}},
    }
    traj = tokenise(tok).parse(rec)
    assert [list(s) for s in traj.segments] == [[1, 2], [3, 4, 5], [6], [7]]
    assert [m.tolist() for m in traj.loss_mask] == [[False, False], [True] * 3, [False], [True]]
    assert traj.history == OpHistory(4, {2: (2,)}, ())
    assert without_ops(traj).history == OpHistory.empty(4)
    assert without_ops(traj).segments == traj.segments
    # a model without a tokenizer still reads token-id records
    assert Tokenise(None, VOCAB, (EOS,)).parse(rec).segments == traj.segments


@pytest.mark.parametrize(
    "record, error",
    [
        ("{not json", "record: not JSON (Expecting property name enclosed in double quotes)"),
        ("[1]", "record: expected an object with 'messages'"),
        ({"messages": []}, "messages: expected a non-empty list of messages"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant', "
            "'tool' or 'function', got 'bot'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]},
            "messages[1].content: expected a string or a list of content parts, got 3",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ],
                "cache": {"drop": {"3": [0]}},
            },
            'cache.drop["3"]: boundary 3 out of range [0, 2)',
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ],
                "cache": {"drop": {"1": [1, 1]}},
            },
            'cache.drop["1"][1]: segment 1 is dropped twice (already at boundary 1)',
        ),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            "messages: no loss tokens: no message has a role in ['assistant']",
        ),
        (
            {"messages": [{"role": "assistant", "token_ids": [1, 600]}]},
            "messages[0].token_ids[1]: token id 600 outside the vocabulary",
        ),
        (
            {"messages": [{"role": "assistant", "token_ids": []}]},
            "messages[0].token_ids: expected a non-empty list of token ids",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "token_ids": [1]},
                    {"role": "user", "content": "x"},
                ]
            },
            "messages[1].token_ids: required (a record's messages are all token ids or all text)",
        ),
    ],
)
def test_bad_records_name_file_line_and_field(tok, tmp_path, record, error):
    path = tmp_path / "d.jsonl"
    good = json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    bad = record if isinstance(record, str) else json.dumps(record)
    path.write_text(f"{good}\n\n{good}\n{bad}\n")
    with pytest.raises(DataError) as e:
        read_trajectories(path, tokenise(tok))
    assert str(e.value) == f"{path}:4: {error}"


def test_jsonl_source_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a":1}\n\n  \n{"b":2}\n{"c":3}')
    src = JsonlSource(path)
    assert len(src) == 3
    assert [src[i] for i in range(3)] == [(1, '{"a":1}\n'), (4, '{"b":2}\n'), (5, '{"c":3}')]
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="e.jsonl: file: no records"):
        JsonlSource(tmp_path / "e.jsonl")
    with pytest.raises(DataError, match="nope.jsonl: file: no such file"):
        JsonlSource(tmp_path / "nope.jsonl")


SMALL = TrajectorySpec(
    context=4096,
    system_tokens=8,
    task_range=(4, 8),
    output_range=(4, 8),
    tool_range=(10, 40),
    max_turns=6,
    min_turns=1,
    keep_tools=2,
)


def test_replay_records_give_each_answer_its_own_requests_view():
    recs = list(replay_records(3, 4, SMALL, lambda: RollingDrop(2, 100, 4096)))
    for index, rec in enumerate(recs):
        traj = make_trajectory(3, index, SMALL)
        roles = [m["role"] for m in rec["messages"]]
        assert roles == ["system", "user"] + ["assistant", "tool"] * (len(traj.turns) - 1) + [
            "assistant"
        ]
        final = parse_history(rec["cache"], len(roles))
        # replay turn by turn with a fresh policy: request k's segments and ops are the
        # record's first segments and the record's ops restricted to them
        pol, hist = RollingDrop(2, 100, 4096), traj.initial_history()
        for turn in traj.turns:
            req = pol.next_request(hist, turn.output_tokens)
            n = len(req.segments)
            assert [list(s) for s in req.segments] == [m["token_ids"] for m in rec["messages"][:n]]
            assert parse_history(req.cache, n) == final.truncate(n)
            assert rec["messages"][n] == {"role": "assistant", "token_ids": list(turn.assistant)}
            hist += [Message("assistant", turn.assistant), Message("tool", turn.tool)]
    # the rolling window dropped tool outputs and repositioned
    assert any(r["cache"]["drop"] for r in recs) and any(r["cache"]["reposition"] for r in recs)


def test_chat_records_add_rolling_drop_ops(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for k in range(4):
        msgs += [
            {"role": "assistant", "content": f"call {k}"},
            {"role": "tool", "content": "x" * 30},
        ]
    msgs.append({"role": "assistant", "content": "end"})
    (rec,) = chat_records([{"messages": msgs}], tok, keep_tools=1)
    # tools are messages 3, 5, 7, 9; each is dropped once a newer one exists, at the
    # boundary of that newer one (the last before the next assistant turn)
    assert rec["cache"] == {"drop": {"5": [3], "7": [5], "9": [7]}, "reposition": []}
    lens = [len(s) for s in tok.encode_messages(msgs)]
    assert lens == [11, 12] + [19, 38] * 4 + [16]
    # reposition when the position counter reaches the threshold with gaps to close: at 5
    # (next position 137 >= 137); the counter restarts at the 137 - 38 = 99 active tokens,
    # 99 + 19 + 38 = 156 >= 137 at boundary 7, and 118 + 57 = 175 at 9
    (rec,) = chat_records([{"messages": msgs}], tok, keep_tools=1, repos_threshold=137)
    assert rec["cache"]["reposition"] == [5, 7, 9]
    # threshold 176: not at 5 (137), at 7 (137 + 57 = 194), not at 9 (194 - 76 + 57 = 175)
    (rec,) = chat_records([{"messages": msgs}], tok, keep_tools=1, repos_threshold=176)
    assert rec["cache"]["reposition"] == [7]
    assert list(chat_records([{"messages": msgs}])) == [{"messages": msgs}]
    with pytest.raises(ValueError, match=r"records\[0\].cache: already has cache ops"):
        list(chat_records([rec], tok, keep_tools=1))


def test_converter_cli_writes_readable_files(tok, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["replay", "--out", str(out), "--count", "3", "--max-turns", "4"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 3 records to {out}"
    trajs = read_trajectories(out, tokenise(tok))
    assert len(trajs) == 3 and all(t.history.drops for t in trajs)
    assert main(["chat", "--data", str(tmp_path / "none.jsonl"), "--out", str(out)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"error: {tmp_path / 'none.jsonl'}: file: no such file"
    )
    chats = tmp_path / "chats.jsonl"
    write_jsonl(chats, agent_chats(0, 2, turns=3, lines=2))
    out2 = tmp_path / "c.jsonl"
    argv = ["chat", "--data", str(chats), "--out", str(out2), "--model-path", "tiny"]
    assert main([*argv, "--keep-tools", "1"]) == 0
    recs = list(read_jsonl(out2))
    # tools are messages 3, 5, 7: each dropped at the boundary of the next one
    assert [r["cache"] for r in recs] == [{"drop": {"5": [3], "7": [5]}, "reposition": []}] * 2
    assert [r["messages"] for r in recs] == [c["messages"] for c in read_jsonl(chats)]


# --------------------------------------------------------------------------- pipeline


class ConcatPacker:
    """Stand-in packer for the pipeline mechanics (the core's packer is tested below): first
    fit by token count into ``max_tokens``; a pack is the concatenated tokens plus which
    trajectory owns each row."""

    def __init__(self, max_tokens):
        self.max_tokens = max_tokens

    def over(self, traj):
        n = traj.num_tokens
        return f"max_tokens: {n} > {self.max_tokens}" if n > self.max_tokens else None

    def group(self, trajs):
        bins, room = [], []
        for i, t in enumerate(trajs):
            for b, r in enumerate(room):
                if t.num_tokens <= r:
                    bins[b].append(i)
                    room[b] -= t.num_tokens
                    break
            else:
                bins.append([i])
                room.append(self.max_tokens - t.num_tokens)
        return bins

    def pack(self, trajs):
        toks = np.zeros(self.max_tokens, np.int32)
        owner = np.full(self.max_tokens, -1, np.int32)
        at = 0
        for k, t in enumerate(trajs):
            flat = [x for s in t.segments for x in s]
            toks[at : at + len(flat)] = flat
            owner[at : at + len(flat)] = k
            at += len(flat)
        return {"tokens": toks, "owner": owner}

    def batch(self, examples):
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def records_file(tmp_path, n=23):
    """Token-id records whose first token is the record's number (to identify it)."""
    rng = np.random.default_rng(0)
    recs, lens = [], []
    for i in range(n):
        a, b = int(rng.integers(3, 20)), int(rng.integers(1, 10))
        recs.append(
            {
                "messages": [
                    {"role": "user", "token_ids": [i] + [300] * a},
                    {"role": "assistant", "token_ids": [400] * b},
                ]
            }
        )
        lens.append(1 + a + b)
    path = tmp_path / "d.jsonl"
    write_jsonl(path, recs)
    return path, lens


def pipeline(path, tok, **kw):
    args = dict(batch_size=2, seed=7, window=5)
    args.update(kw)
    packer = ConcatPacker(args.pop("max_tokens", 48))
    return data.train_batches(path, tokenise(tok), packer, **args)


def record_ids(batch):
    """Record numbers in a batch: the first token of each packed trajectory."""
    ids = []
    for toks, owner in zip(batch["tokens"], batch["owner"], strict=True):
        for k in range(owner.max() + 1):
            ids.append(int(toks[np.argmax(owner == k)]))
    return ids


def test_pipeline_shuffles_packs_and_covers_each_epoch(tok, tmp_path):
    path, lens = records_file(tmp_path)
    batches = list(pipeline(path, tok, num_epochs=2, batch_size=1))
    seen = [i for b in batches for i in record_ids(b)]
    assert sorted(seen) == sorted(list(range(23)) * 2)
    assert seen[:23] != list(range(23)) and seen[:23] != seen[23:46]  # shuffled per epoch
    for b in batches:  # every pack holds whole trajectories within max_tokens
        used = int((b["owner"][0] >= 0).sum())
        ids = record_ids(b)
        assert used == sum(lens[i] for i in ids) <= 48
    again = [i for b in pipeline(path, tok, num_epochs=2, batch_size=1) for i in record_ids(b)]
    assert again == seen  # same seed, same order
    other = [
        i for b in pipeline(path, tok, num_epochs=2, batch_size=1, seed=8) for i in record_ids(b)
    ]
    assert other != seen


def test_shards_are_disjoint_and_cover_the_data(tok, tmp_path):
    path, _ = records_file(tmp_path)
    shards = [
        [
            i
            for b in pipeline(path, tok, num_epochs=1, batch_size=1, shard_index=k, shard_count=3)
            for i in record_ids(b)
        ]
        for k in range(3)
    ]
    assert sorted(i for s in shards for i in s) == list(range(23))
    assert all(len(s) in (7, 8) for s in shards)
    with pytest.raises(ValueError, match=r"shard_index 3 outside \[0, 3\)"):
        pipeline(path, tok, shard_index=3, shard_count=3)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 9])
def test_resumed_iterator_yields_the_same_batches(tok, tmp_path, stop_after):
    path, _ = records_file(tmp_path)
    ds = pipeline(path, tok)
    it = iter(ds)
    for _ in range(stop_after):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = [next(it) for _ in range(8)]
    resumed = iter(pipeline(path, tok))
    resumed.set_state(state)
    got = [next(resumed) for _ in range(8)]
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(e["tokens"], g["tokens"])
        np.testing.assert_array_equal(e["owner"], g["owner"])
    assert record_ids(expected[0])  # batches are not empty


def test_a_record_longer_than_an_example_is_refused(tok, tmp_path):
    path, lens = records_file(tmp_path, 3)
    it = iter(pipeline(path, tok, max_tokens=5))
    with pytest.raises(
        DataError, match=r"d.jsonl:\d: messages: too large for one example \(max_tokens: \d+ > 5\)"
    ):
        next(it)


def test_pipeline_with_the_core_packer(tok, tmp_path):
    """The real packer: batches of PackedExample (leading batch axis), each trajectory's
    targets exactly once per epoch, and an exact resume."""
    from akv_jax.train.pack import PackShape

    path = tmp_path / "r.jsonl"
    write_jsonl(path, replay_records(3, 6, SMALL, lambda: RollingDrop(2, 100, 4096)))
    trajs = read_trajectories(path, tokenise(tok))
    shape = PackShape(max_tokens=512, max_segments=32, max_trajectories=3, max_versions=4)
    packer = data.CorePacker(shape)

    def batches(batch_size, **kw):
        return data.train_batches(
            path, tokenise(tok), packer, batch_size=batch_size, seed=1, window=4, **kw
        )

    epoch = list(batches(1, num_epochs=1))
    assert all(b.tokens.shape == (1, 512) for b in epoch)
    assert len(epoch) < len(trajs)  # several trajectories share a pack
    # targets: token j + 1 of each trajectory where its loss mask is set
    want = sum(float(np.concatenate(t.loss_mask)[1:].sum()) for t in trajs)
    assert sum(float(b.weights.sum()) for b in epoch) == want
    it = iter(batches(2))
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    want_batches = [next(it) for _ in range(3)]
    resumed = iter(batches(2))
    resumed.set_state(state)
    for w in want_batches:
        g = next(resumed)
        assert w.tokens.shape == (2, 512)
        for f in ("tokens", "targets", "weights", "q_positions", "write_slots", "page_table"):
            np.testing.assert_array_equal(getattr(w, f), getattr(g, f))


def test_synthetic_agent_chats_are_seeded_and_answer_from_the_latest_tool_output():
    chats = agent_chats(5, 3, turns=4, lines=3)
    assert chats == agent_chats(5, 3, turns=4, lines=3) and chats != agent_chats(6, 3, 4, 3)
    for chat in chats:
        msgs = chat["messages"]
        assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "tool"] * 4 + [
            "assistant"
        ]
        key = msgs[1]["content"].split()[4]  # "Report the value of KEY in ..."
        for tool, answer in zip(msgs[3::2], msgs[4::2], strict=True):
            settings = dict(line.split(" = ") for line in tool["content"].split("\n"))
            assert len(settings) == 3
            assert f": {key} = {settings[key]}." in answer["content"]
        assert msgs[-1]["content"].endswith("Done.")
    with pytest.raises(ValueError, match=r"turns must be in \[1, 10\], got 11"):
        agent_chats(0, 1, turns=11)
