"""User data formats, the embedded corpus, packing and deterministic batches."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.data import (
    DataError,
    Document,
    batch_for_step,
    embedded_documents,
    heldout_prompts,
    load_documents,
    pack_documents,
)
from trainer.target.embedded import build_embedded_tokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Spell cat."},
    {"role": "assistant", "content": "cat is spelled C-A-T."},
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Tiny models: a second intra-op thread gains nothing and, on a busy 2-core machine (the test
    # suite in parallel), oversubscription makes every op many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_embedded_tokenizer(small=True)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def assistant_text(tokenizer, doc: Document) -> str:
    return tokenizer.decode([i for i, m in zip(doc.input_ids, doc.loss_mask) if m])


# --- the embedded corpus -----------------------------------------------------------------------------


def test_embedded_corpus_is_deterministic_and_heldout_is_disjoint(tokenizer):
    train, heldout = embedded_documents("train"), embedded_documents("heldout")
    assert len(train) >= 2000 and len(heldout) >= 100
    assert not set(train) & set(heldout)
    assert embedded_documents("train") == train
    lengths = [len(ids) for ids in tokenizer(train[:500], add_special_tokens=False)["input_ids"]]
    assert 40 <= sum(lengths) / len(lengths) <= 200


def test_embedded_documents_are_text_with_loss_everywhere_and_eos(tokenizer):
    docs = load_documents("embedded", tokenizer, split="heldout")
    first = embedded_documents("heldout")[0]
    assert docs[0].input_ids == tokenizer(first, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert all(all(m == 1 for m in d.loss_mask) for d in docs)


# --- user formats --------------------------------------------------------------------------------------


def test_chat_messages_loss_only_on_assistant_tokens(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (doc,) = load_documents(str(path), tokenizer)
    # Reference: the rendered chat, and the assistant contents with their end-of-turn token.
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(doc.input_ids[:-1]) == rendered
    assert doc.input_ids[-1] == tokenizer.eos_token_id and doc.loss_mask[-1] == 0
    assert assistant_text(tokenizer, doc) == "2 plus 3 is 5.<|im_end|>cat is spelled C-A-T.<|im_end|>"
    assert len(doc.input_ids) == len(doc.loss_mask)


def test_sharegpt_rows_equal_the_same_messages(tokenizer, tmp_path):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in CHAT]
    a = load_documents(str(write_jsonl(tmp_path / "a.jsonl", [{"conversations": sharegpt}])), tokenizer)
    b = load_documents(str(write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT}])), tokenizer)
    assert a == b


def test_template_without_generation_markers_gives_the_same_mask(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with_markers = load_documents(str(path), tokenizer)
    plain = build_embedded_tokenizer(small=True)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert "{% generation %}" not in plain.chat_template
    assert load_documents(str(path), plain) == with_markers


def test_text_jsonl_and_txt_have_loss_on_every_token(tokenizer, tmp_path):
    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two three"}, {"text": "four five"}])
    docs = load_documents(str(jsonl), tokenizer)
    eos = tokenizer.eos_token_id
    assert [d.input_ids for d in docs] == [tokenizer("one two three")["input_ids"] + [eos],
                                          tokenizer("four five")["input_ids"] + [eos]]
    assert all(all(m == 1 for m in d.loss_mask) for d in docs)

    txt = tmp_path / "t.txt"
    txt.write_text("first doc\nstill first\n\n\nsecond doc\n  \nthird\n")
    docs = load_documents(str(txt), tokenizer)
    assert [tokenizer.decode(d.input_ids[:-1]) for d in docs] == ["first doc\nstill first", "second doc", "third"]


def test_user_heldout_split_is_disjoint_from_train(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"document number {i}"} for i in range(40)])
    train = load_documents(str(path), tokenizer, "train")
    heldout = load_documents(str(path), tokenizer, "heldout")
    assert len(train) == 38 and len(heldout) == 2
    assert not {tuple(d.input_ids) for d in train} & {tuple(d.input_ids) for d in heldout}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:2: not valid JSON"),
        ('{"text": "ok"}\n\n{"prompt": "x"}\n', "bad.jsonl:3: unknown row shape"),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', "bad.jsonl:1: messages[0] has unknown role"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}\n', "bad.jsonl:1: conversations[0] has unknown 'from'"),
        ('[1, 2]\n', "bad.jsonl:1: each line must be a JSON object"),
        ("\n\n", "no documents"),
    ],
)
def test_malformed_data_gives_a_one_line_error_with_file_and_line(tokenizer, tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as info:
        load_documents(str(path), tokenizer)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_missing_file_unknown_suffix_and_missing_template(tokenizer, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_documents(str(tmp_path / "nope.jsonl"), tokenizer)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown data format"):
        load_documents(str(tmp_path / "d.csv"), tokenizer)
    bare = build_embedded_tokenizer(small=True)
    bare.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match="c.jsonl:1: chat rows need a tokenizer with a chat template"):
        load_documents(str(path), bare)


# --- packing -------------------------------------------------------------------------------------------


def naive_pack(docs, seq_len, pad_id):
    """Reference: rows as Python lists, built token by token."""
    pieces = []
    for doc in docs:
        for start in range(0, len(doc.input_ids), seq_len):
            pieces.append(list(zip(doc.input_ids[start:start + seq_len], doc.loss_mask[start:start + seq_len])))
    rows = []
    current = []
    for piece in pieces:
        if len(current) + len(piece) > seq_len:
            rows.append(current)
            current = []
        doc_id = len({d for _, _, d, _ in current})
        current += [(tok, m, doc_id, pos) for pos, (tok, m) in enumerate(piece)]
    rows.append(current)
    return [row + [(pad_id, 0, -1, 0)] * (seq_len - len(row)) for row in rows]


def test_pack_documents_matches_a_naive_reference():
    docs = [
        Document(list(range(100, 105)), [1, 1, 0, 1, 1]),  # 5 tokens
        Document([7, 8, 9], [1, 1, 1]),  # fills row 0 exactly
        Document(list(range(200, 209)), [1] * 9),  # longer than seq_len: chunks of 8 and 1
        Document([1, 2, 3, 4], [0, 1, 1, 1]),
    ]
    packed = pack_documents(docs, seq_len=8, pad_id=0)
    expected = naive_pack(docs, 8, 0)
    got = [list(zip(*(t[r].tolist() for t in (packed.input_ids, packed.loss_mask, packed.doc_ids, packed.position_ids))))
           for r in range(packed.num_rows)]
    assert got == expected
    assert packed.num_rows == 3
    assert packed.doc_ids[2].tolist() == [0, 1, 1, 1, 1, -1, -1, -1]  # the 1-token tail chunk is its own doc
    assert packed.position_ids[2].tolist() == [0, 0, 1, 2, 3, 0, 0, 0]


def test_pack_fingerprint_identifies_the_data():
    docs = [Document([1, 2, 3], [1, 1, 1]), Document([4, 5], [1, 1])]
    a = pack_documents(docs, 4, 0)
    assert a.fingerprint == pack_documents(docs, 4, 0).fingerprint and len(a.fingerprint) == 64
    assert a.fingerprint != pack_documents(docs, 5, 0).fingerprint
    assert a.fingerprint != pack_documents([Document([1, 2, 3], [1, 0, 1]), docs[1]], 4, 0).fingerprint
    with pytest.raises(DataError):
        pack_documents([], 4, 0)


# --- batches -------------------------------------------------------------------------------------------


def test_batch_for_step_is_a_pure_function_of_seed_and_step_covering_each_epoch():
    rows = 10
    packed = pack_documents([Document([i + 1] * 4, [1] * 4) for i in range(rows)], seq_len=4, pad_id=0)
    first_tokens = lambda batch: batch["input_ids"][:, 0].tolist()  # noqa: E731 - row i holds token i+1

    sequence = [first_tokens(batch_for_step(packed, step, 5, seed=3)) for step in range(6)]
    # A resumed run asks for step 4 directly and gets what the uninterrupted run got.
    assert first_tokens(batch_for_step(packed, 4, 5, seed=3)) == sequence[4]
    for epoch in range(3):  # every epoch is a permutation of all rows
        assert sorted(sequence[2 * epoch] + sequence[2 * epoch + 1]) == list(range(1, rows + 1))
    assert sequence[0] + sequence[1] != sequence[2] + sequence[3]  # epochs are shuffled differently
    other_seed = [first_tokens(batch_for_step(packed, step, 5, seed=4)) for step in range(2)]
    assert other_seed != sequence[:2]

    batch = batch_for_step(packed, 1, 3, seed=0)  # crosses from draw 3 to 5, inside epoch 0
    assert set(batch) == {"input_ids", "loss_mask", "doc_ids", "position_ids"}
    assert all(t.shape == (3, 4) and t.dtype == torch.long for t in batch.values())
    big = batch_for_step(packed, 0, 25, seed=0)  # a batch larger than the data spans epochs
    assert sorted(first_tokens(big)[:10]) == list(range(1, rows + 1))


# --- held-out prompts ------------------------------------------------------------------------------------


def test_embedded_heldout_prompts_are_document_prefixes(tokenizer):
    prompts = heldout_prompts("embedded", tokenizer, n=6)
    assert prompts == heldout_prompts("embedded", tokenizer, n=6) and len(prompts) == 6
    heldout = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in embedded_documents("heldout")]
    for prompt in prompts:
        source = next(ids for ids in heldout if ids[: len(prompt)] == prompt)
        assert 8 <= len(prompt) <= 64 and len(source) - len(prompt) >= 7
    assert all(len(p) == 5 for p in heldout_prompts("embedded", tokenizer, n=3, prompt_len=5))


def test_chat_heldout_prompts_end_with_the_generation_prompt(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (prompt,) = heldout_prompts(str(path), tokenizer, n=4)
    expected = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompt) == expected


def test_chat_data_without_assistant_turns_is_refused(tmp_path, tokenizer):
    # Nothing supervised would train silently at loss 0; the user hears it instead.
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n' * 3)
    with pytest.raises(DataError, match="no token carries a loss"):
        load_documents(str(path), tokenizer)
