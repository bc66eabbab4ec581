"""User data and the embedded corpus, tokenised, packed into rows, and batched deterministically.

Formats (see `load_documents`):
- `.jsonl` chat rows: `{"messages": [{"role", "content"}, ...]}` or ShareGPT
  `{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}`. Rendered with the tokenizer's
  chat template; the loss mask is 1 only on assistant tokens.
- `.jsonl` text rows: `{"text": "..."}`; loss on every token.
- `.txt`: documents separated by blank lines; loss on every token.

A user's mistake raises `DataError` with a one-line message that names the file (and line).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from trainer.data.corpus import embedded_documents
from trainer.data.errors import DataError
from trainer.safe_io import loads_json
from trainer.data.prepared import is_prepared_dir, load_prepared_rows

# Every HELDOUT_EVERY-th document of a user file is held out (eval prompts) when the file has at least
# that many documents; smaller files are used whole for both (there is nothing to spare).
USER_HELDOUT_EVERY = 20
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
CHAT_ROLES = {"system", "user", "assistant", "tool"}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Document:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the drafter is trained to predict (anchors are drawn from here)
    chat: bool = False  # rendered from chat messages with the tokenizer's chat template


def chat_rendering(documents: list[Document], tokenizer: Any) -> dict[str, Any]:
    """How chat documents were rendered, for the run record (sleuth's dflash.chat_template_consistency):
    sha256 of the chat template text (null when no document is chat) and the template kwargs (none are
    passed: thinking mode is whatever the template defaults to)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    rendered = any(doc.chat for doc in documents) and isinstance(template, str)
    return {
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest() if rendered else None,
        "chat_template_kwargs": {},
    }


@dataclass
class PackedData:
    input_ids: Tensor  # [N, S] long; padding holds pad_id
    loss_mask: Tensor  # [N, S] long; 0 on padding
    doc_ids: Tensor  # [N, S] long; document index within its row, -1 on padding
    position_ids: Tensor  # [N, S] long; restart at 0 for every document (chunk)
    fingerprint: str  # sha256 of the four tensors and the shape: tells two runs' data apart

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


# --- loading -------------------------------------------------------------------------------------------


def load_documents(data: str, tokenizer: Any, split: Literal["train", "heldout"] = "train") -> list[Document]:
    """Tokenised documents of `data` ("embedded" or a path), each ending with eos when the tokenizer has one.

    For a user file, `split="heldout"` is every 20th document and "train" the rest (a file with fewer
    than 20 documents is used whole for both).
    """
    if split not in ("train", "heldout"):
        raise DataError(f"split must be 'train' or 'heldout', got {split!r}")
    eos_id = tokenizer.eos_token_id
    if data == "embedded":
        texts = embedded_documents(split)
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        docs = [Document(list(ids), [1] * len(ids)) for ids in encoded]
    elif is_prepared_dir(Path(data).expanduser()):
        # speculators' prepare-data output: already tokenized and masked; used as it is (no eos added).
        rows = load_prepared_rows(Path(data).expanduser(), len(tokenizer))
        docs = [Document(ids, mask) for ids, mask in rows]
        if len(docs) >= USER_HELDOUT_EVERY:
            heldout = split == "heldout"
            docs = [d for i, d in enumerate(docs) if (i % USER_HELDOUT_EVERY == USER_HELDOUT_EVERY - 1) == heldout]
        return docs
    else:
        docs = _load_user_documents(Path(data).expanduser(), tokenizer)
        if len(docs) >= USER_HELDOUT_EVERY:
            heldout = split == "heldout"
            docs = [d for i, d in enumerate(docs) if (i % USER_HELDOUT_EVERY == USER_HELDOUT_EVERY - 1) == heldout]
        if not any(any(doc.loss_mask) for doc in docs):
            # Otherwise every step trains on nothing and logs loss 0: a silent failure.
            raise DataError(f"{data}: no token carries a loss (chat data without assistant turns?)")
    return [_with_eos(doc, eos_id) for doc in docs if doc.input_ids]


def _with_eos(doc: Document, eos_id: int | None) -> Document:
    # The eos that closes a document is trained exactly when the document's last token is (an assistant
    # turn's end in chat, always in text), so padding-free packing still teaches where documents stop.
    if eos_id is None or doc.input_ids[-1] == eos_id:
        return doc
    return Document(doc.input_ids + [eos_id], doc.loss_mask + [doc.loss_mask[-1]], doc.chat)


def _load_user_documents(path: Path, tokenizer: Any) -> list[Document]:
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if not path.is_file():
        raise DataError(f"data path {path} is not a file (expected .jsonl or .txt)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except PermissionError:
        raise DataError(f"permission denied: {path}") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None

    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        docs = _load_jsonl(path, text, tokenizer)
    elif suffix == ".txt":
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        encoded = tokenizer(paragraphs, add_special_tokens=True)["input_ids"] if paragraphs else []
        docs = [Document(list(ids), [1] * len(ids)) for ids in encoded]
    else:
        raise DataError(
            f"{path}: unknown data format {suffix or '(no suffix)'!r}; "
            "use .jsonl (one JSON object per line) or .txt"
        )
    if not docs:
        raise DataError(f"{path}: no documents (the file is empty)")
    return docs


def _load_jsonl(path: Path, text: str, tokenizer: Any) -> list[Document]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = loads_json(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:  # nested deeper than any document, a number too long to convert
            raise DataError(f"{where}: {' '.join(str(exc).split())[:120]}") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
        if "messages" in row:
            docs.append(_chat_document(_messages(row["messages"], where), tokenizer, where))
        elif "conversations" in row:
            docs.append(_chat_document(_sharegpt_messages(row["conversations"], where), tokenizer, where))
        elif "text" in row:
            if not isinstance(row["text"], str):
                raise DataError(f"{where}: 'text' must be a string")
            ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"]
            docs.append(Document(list(ids), [1] * len(ids)))
        else:
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise DataError(
                f"{where}: unknown row shape; expected 'messages', 'conversations' or 'text' (keys: {keys})"
            )
    return docs


def _messages(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise DataError(f"{where}: messages[{i}] has unknown role {role!r} (use system, user, assistant)")
        if not isinstance(content, str):
            raise DataError(f"{where}: messages[{i}].content must be a string")
        messages.append({"role": role, "content": content})
    return messages


def _sharegpt_messages(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}")
    messages = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(f"{where}: conversations[{i}] must be an object with 'from' and 'value'")
        speaker = turn["from"]
        if speaker not in SHAREGPT_ROLES:
            raise DataError(f"{where}: conversations[{i}] has unknown 'from' {speaker!r} (use human, gpt, system)")
        if not isinstance(turn["value"], str):
            raise DataError(f"{where}: conversations[{i}].value must be a string")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
    return messages


def _chat_document(messages: list[dict[str, str]], tokenizer: Any, where: str) -> Document:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError(f"{where}: chat rows need a tokenizer with a chat template, and this one has none")
    if isinstance(template, dict):  # several named templates: the default one is what chat uses
        template = template.get("default", "")
    try:
        if _GENERATION_TAG.search(template):
            encoded = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
        else:
            ids, mask = _assistant_mask_from_prefixes(messages, tokenizer, where)
    except DataError:
        raise
    except Exception as exc:  # a strict template raising on this conversation (jinja's TemplateError, ...)
        raise DataError(f"{where}: the chat template rejects this conversation: {exc}") from None
    return Document(ids, [int(m) for m in mask], chat=True)


def _assistant_mask_from_prefixes(
    messages: list[dict[str, str]], tokenizer: Any, where: str
) -> tuple[list[int], list[int]]:
    """Assistant spans for templates without {% generation %}: render growing prefixes of the chat.

    Assistant message i spans from the end of "messages[:i] + generation prompt" to the end of
    "messages[:i+1]". That holds for templates whose renders of a prefix are a prefix of the full
    render; when a template rewrites earlier turns we cannot tell where answers are, so we say so.
    """
    def render(msgs: list[dict[str, str]], generation_prompt: bool) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text, end_text = render(messages[:i], True), render(messages[: i + 1], False)
        if not (full.startswith(start_text) and full.startswith(end_text) and len(start_text) <= len(end_text)):
            raise DataError(
                f"{where}: the chat template re-renders earlier turns, so assistant tokens cannot be located; "
                "add {% generation %} markers to the template"
            )
        # Whitespace the template puts after a turn (ChatML's newline) separates turns; it is not
        # something the assistant says, and {% generation %} templates leave it out as well.
        spans.append((len(start_text), max(len(start_text), len(end_text.rstrip()))))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < end and e > start for s, e in spans)) for start, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


# --- packing and batches ---------------------------------------------------------------------------------


def pack_documents(docs: list[Document], seq_len: int, pad_id: int) -> PackedData:
    """Greedily pack documents, in order, into rows of `seq_len` tokens.

    A document longer than `seq_len` is cut into `seq_len` chunks, each its own document (own doc id,
    positions from 0): the target never attends across a cut, so features stay consistent with what
    the target computes on that chunk alone. A document that does not fit in the current row's space
    starts a new row.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be positive, got {seq_len}")
    pieces: list[tuple[list[int], list[int]]] = []
    for doc in docs:
        if len(doc.input_ids) != len(doc.loss_mask):
            raise DataError("a document's input_ids and loss_mask differ in length")
        for start in range(0, len(doc.input_ids), seq_len):
            pieces.append((doc.input_ids[start : start + seq_len], doc.loss_mask[start : start + seq_len]))
    if not pieces:
        raise DataError("no documents to pack (the dataset is empty)")

    rows: list[list[tuple[list[int], list[int]]]] = [[]]
    used = 0
    for piece in pieces:
        if used + len(piece[0]) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += len(piece[0])

    n = len(rows)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, seq_len), dtype=torch.long)
    doc_ids = torch.full((n, seq_len), -1, dtype=torch.long)
    position_ids = torch.zeros((n, seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        offset = 0
        for d, (ids, mask) in enumerate(row):
            span = slice(offset, offset + len(ids))
            input_ids[r, span] = torch.tensor(ids, dtype=torch.long)
            loss_mask[r, span] = torch.tensor(mask, dtype=torch.long)
            doc_ids[r, span] = d
            position_ids[r, span] = torch.arange(len(ids))
            offset += len(ids)
    fingerprint = _fingerprint_tensors(input_ids, loss_mask, doc_ids, position_ids)
    return PackedData(input_ids, loss_mask, doc_ids, position_ids, fingerprint)


def _fingerprint_tensors(*tensors: Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def _epoch_order(num_rows: int, seed: int, epoch: int) -> Tensor:
    # One generator per (seed, epoch): any step's rows are computed from scratch, so a resumed run (or
    # another process) sees exactly the same batches without replaying the ones before.
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(num_rows, generator=generator)


def batch_for_step(packed: PackedData, step: int, batch_size: int, seed: int) -> dict[str, Tensor]:
    """The rows of training step `step`: a deterministic function of (seed, step).

    Rows are drawn epoch by epoch from a permutation seeded by (seed, epoch); batch k takes the global
    draws k*batch_size .. (k+1)*batch_size-1, crossing into the next epoch's permutation when needed.
    Returns input_ids, loss_mask, doc_ids, position_ids, each [batch_size, S].
    """
    if batch_size < 1 or step < 0:
        raise ValueError(f"need batch_size >= 1 and step >= 0, got batch_size={batch_size}, step={step}")
    n = packed.num_rows
    draws = range(step * batch_size, (step + 1) * batch_size)
    orders: dict[int, Tensor] = {}
    rows = []
    for draw in draws:
        epoch = draw // n
        if epoch not in orders:
            orders[epoch] = _epoch_order(n, seed, epoch)
        rows.append(int(orders[epoch][draw % n]))
    index = torch.tensor(rows, dtype=torch.long)
    return {
        "input_ids": packed.input_ids[index],
        "loss_mask": packed.loss_mask[index],
        "doc_ids": packed.doc_ids[index],
        "position_ids": packed.position_ids[index],
    }


def heldout_prompts(data: str, tokenizer: Any, n: int, prompt_len: int | None = None) -> list[list[int]]:
    """Up to `n` prompts from the held-out split, deterministic (documents in order).

    Chat documents: a user turn, i.e. everything before an assistant answer (the template's generation
    prompt included; one per document, cycling through the turns so prompts of every length occur), so
    the continuation is the assistant's answer and generation stops at the end of that turn, as served.
    Text documents: the first `prompt_len` tokens (default: half the document, 8..64 tokens), so the
    continuation is predictable from the structure already seen.
    `prompt_len` also caps chat prompts (their last `prompt_len` tokens). Documents too short to leave a
    continuation of at least 8 tokens are skipped.
    """
    prompts: list[list[int]] = []
    for doc in load_documents(data, tokenizer, split="heldout"):
        if len(prompts) >= n:
            break
        ids = doc.input_ids
        if doc.loss_mask and doc.loss_mask[0] == 0 and 1 in doc.loss_mask:
            # Each answer starts where the loss mask turns on; what precedes it is that turn's prompt.
            # One prompt per document (documents differ more than turns do), cycling through the turns
            # so later turns, with their longer prompts, are evaluated too.
            starts = [i for i in range(1, len(ids)) if doc.loss_mask[i] and not doc.loss_mask[i - 1]]
            prompt = ids[: starts[len(prompts) % len(starts)]]
            if prompt_len is not None:
                prompt = prompt[-prompt_len:]
        else:
            length = prompt_len if prompt_len is not None else max(8, min(len(ids) // 2, 64))
            if len(ids) - length < 8:
                continue
            prompt = ids[:length]
        if prompt:
            prompts.append(list(prompt))
    if not prompts:
        raise DataError(f"no held-out prompts could be taken from {data!r} (documents too short?)")
    return prompts
